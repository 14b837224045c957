from load.cli import main

main()
