"""Per-lab helpers: drivers, checks with hints, widgets, formulas (not the algorithms: those are
labkit.strategies).

    ddp_run, ddp_lab            the DP lab: training drivers, ring pictures, check_ddp
    zero_run, zero_checks       the ZeRO lab: drivers, wire bytes, shard/step checks
    memory_widget               the ZeRO lab's memory calculator and bars
    fsdp_run                    the FSDP lab: drivers, sweeps, peak-memory formula
    collective_checks           checks of learners' ring / reduce-scatter / all-gather
"""
