"""Per-lab helpers: drivers, checks with hints, widgets, formulas (not the algorithms: those are
labkit.strategies).

    ddp_lab                     the DP lab: ring pictures, check_ddp, LabDDP (a learner's class on loop.train)
    zero_lab, zero_checks       the ZeRO lab: wire bytes; partition and sharded-optimizer checks
    zero_stage_checks           the ZeRO lab: ZeRO-1 step and ZeRO-2 bucket-hook checks
    memory_widget               the ZeRO lab's memory calculator and bars
    fsdp_lab                    the FSDP lab: unit sizes, peak-memory formula; its experiments' rank
                                functions, figures and knob widget
    collective_checks           checks of learners' ring / reduce-scatter / all-gather
"""
