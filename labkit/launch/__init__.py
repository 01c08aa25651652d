"""Starting ranks and reporting on them: `labkit.run` and what it stands on.

    run        labkit.run, labkit.device(), set_output, warm_up, RunResult (the forkserver, the launch)
    _worker    a rank's side: process group, hooks around fn, output capture, stack dumps
    _supervise the kernel's side while ranks run: results, deaths, hangs, interrupts, killing
    _rundir    the per-run temp folder (logs, stack dumps), its owner, the sweep at import
    _report    error reports (RankError, RankTimeout) and rank output
    _torchrun  labkit.run under torchrun (join the existing group)
    _kernel_exit  a Jupyter kernel's shutdown stops the forkserver first (a clean, quick exit)

Nothing here is imported by `import labkit.launch`: import the submodule you need.
"""
