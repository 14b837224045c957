from meshserve.cli import main

main()
