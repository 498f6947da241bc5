"""`normkit bench`: normkit side by side with torch, torch.compile, Liger-Kernel and quack.

    bytemodel.py  the bytes a perfect kernel must move (what GB/s is counted against)
    ops.py        the ops as data: shapes, inputs, the float64 oracle, suites and tolerances
    impls.py      the timed implementations: normkit and the peers, each with a skip reason
    timing.py     CUDA-event / host-clock timers, the copy ceiling, host overhead per call
    runner.py     one point: build inputs, check every implementation against the oracle, time it
    report.py     rows, CSV (with the environment), markdown summary, --compare
    environment.py  GPU, driver, versions, date, source revision of a run
    plots.py      GB/s against N per implementation, with the copy ceiling
    cli.py        the command line
"""
