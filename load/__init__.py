"""meshserve load generator, benchmark suite and tuning advice (issue #7).

`python -m load` / `meshserve load` drive any KServe v2 / Triton endpoint; `python -m load.bench`
runs the benchmark suite; `meshserve tune MODEL --p99-ms N` sweeps and recommends batching settings.
"""
