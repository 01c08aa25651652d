"""labkit.run: the foundation every lab stands on (issue: points 1-10)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

import labkit
from conftest import forkservers, notebook_namespace, run_in_own_group, wait_while_it_works
from labkit.launch.run import _gpu_count

# For the launches whose ranks all-reduce CPU tensors (this file tests the launcher, not the
# backend): gloo, also on a machine with GPUs, where "auto" would pick NCCL.
CPU = dict(backend="gloo")

CELL = """
import torch, torch.distributed as dist, labkit

def hello(greeting):
    return f"{greeting} from {dist.get_rank()}/{dist.get_world_size()} on {labkit.device()}"

scale = 3
def closure_sum():
    t = torch.ones(2) * scale * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t

class Accumulator:
    def __init__(self): self.total = 0
    def add(self, x): self.total += x; return self

def use_class():
    return Accumulator().add(dist.get_rank()).total

def fails_on_rank_1():
    t = torch.ones(4)
    if dist.get_rank() == 1:
        raise ValueError("bad shard size 7")
    dist.all_reduce(t)

def never_joins():
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.recv(t, src=1)

def mismatched():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(8))
    else:
        dist.broadcast(torch.ones(8), src=1)

def unpicklable():
    import threading
    return threading.Lock()

def prints():
    import ctypes
    print("python print")
    os_write = __import__("os").write
    os_write(1, b"raw fd write\\n")
    ctypes.CDLL(None).puts(b"from C puts")
    return True
"""


@pytest.fixture(scope="module")
def nb():
    return notebook_namespace(CELL)


def test_functions_closures_lambdas_and_classes_from_a_notebook(nb, no_leftover_workers):
    assert labkit.run(nb["hello"], "hi", world_size=2, **CPU) == ["hi from 0/2 on cpu", "hi from 1/2 on cpu"]
    assert [t.tolist() for t in labkit.run(nb["closure_sum"], world_size=3, **CPU)] == [[18.0, 18.0]] * 3
    assert labkit.run(lambda k=2: k * 21, world_size=2) == [42, 42]
    assert labkit.run(nb["use_class"], world_size=2, **CPU) == [0, 1]


def test_kwargs_reach_fn_and_result_is_indexed_by_rank(no_leftover_workers):
    import torch.distributed as dist

    res = labkit.run(lambda a, b=0: (dist.get_rank(), a + b), 1, b=2, world_size=4)
    assert list(res) == [(r, 3) for r in range(4)]
    assert res.world_size == 4 and res.backend == _auto(4) and res.wall_s > 0


def _auto(world_size):
    """What backend="auto" must pick on this machine: NCCL when every rank gets a GPU."""
    return "nccl" if _gpu_count() >= world_size else "gloo"


def test_auto_backend_is_nccl_with_a_gpu_per_rank_else_gloo_and_kernel_never_initialises_cuda(
    no_leftover_workers,
):
    """On a CPU-only machine gloo; on a machine with a GPU, NCCL at world_size 1 (the README's
    rule). Either way the launching process never initialises CUDA (it counts GPUs with NVML)."""
    import torch.distributed as dist

    assert labkit.run(lambda: dist.get_backend(), world_size=1) == [_auto(1)]
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_auto_picks_nccl_on_k_gpus_for_up_to_k_ranks(monkeypatch, gpus):
    """The selection logic, on any machine (the GPU count monkeypatched): k GPUs -> NCCL for
    world_size <= k, gloo beyond; an explicit "nccl" beyond k raises; "gloo" is always gloo."""
    from labkit.launch import run as launch

    monkeypatch.setattr(launch, "_gpu_count", lambda: gpus)
    for world_size in range(1, gpus + 3):
        assert launch._resolve_backend("auto", world_size) == ("nccl" if world_size <= gpus else "gloo")
        assert launch._resolve_backend("gloo", world_size) == "gloo"
    if gpus:
        assert launch._resolve_backend("nccl", gpus) == "nccl"
    with pytest.raises(ValueError, match="one GPU per rank"):
        launch._resolve_backend("nccl", gpus + 1)


def test_nccl_ranks_pass_their_device_id_and_gloo_ranks_none():
    """init_process_group(device_id=cuda:r) on NCCL (no "Guessing device ID" warning, the rank
    bound to its GPU); nothing for gloo, whose groups ignore a device."""
    import inspect

    import torch.distributed as dist

    from labkit.launch._worker import process_group_options

    assert "device_id" in inspect.signature(dist.init_process_group).parameters  # torch >= 2.3
    gpu = torch.device("cuda", 1)
    assert process_group_options("nccl", gpu) == {"device_id": gpu}
    assert process_group_options("gloo", torch.device("cpu")) == {}
    assert process_group_options("gloo", gpu) == {}


def test_explicit_nccl_without_gpus_is_a_clear_error():
    if _gpu_count() >= 2:
        pytest.skip("needs fewer than 2 GPUs (test_auto_picks_nccl_on_k_gpus covers the rule anywhere)")
    with pytest.raises(ValueError, match=r"one GPU per rank.*found \d+ GPU"):
        labkit.run(print, world_size=2, backend="nccl")


def test_two_notebooks_launching_at_once_do_not_collide(tmp_path):
    # Each call meets at a FileStore in its own temp folder: no shared port, no shared file.
    script = tmp_path / "nb.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, labkit, torch, torch.distributed as dist
        def f():
            t = torch.ones(1) * (dist.get_rank() + 1); dist.all_reduce(t); return t.item()
        if __name__ == "__main__":
            for _ in range(5):
                assert labkit.run(f, world_size=2, backend="gloo") == [3.0, 3.0]
            print("OK")
    """)
    )
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert all(o.strip().endswith("OK") for o in outs), outs


def test_rank_output_is_prefixed_and_includes_c_level_writes(nb, capsys, no_leftover_workers):
    labkit.set_output("ordered")
    labkit.run(nb["prints"], world_size=2, **CPU)
    out = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        mine = [l for l in out if l.startswith(f"[rank {r}] ")]
        assert {"python print", "raw fd write", "from C puts"} <= {l.split("] ", 1)[1] for l in mine}
    # Ordered mode: all of rank 0, then all of rank 1.
    ranks = [l.split("]")[0] for l in out if l.startswith("[rank")]
    assert ranks == sorted(ranks)
    labkit.set_output("auto")


def test_live_mode_prints_while_ranks_run(capsys, no_leftover_workers):
    labkit.set_output("live")
    labkit.run(lambda: print("live line"), world_size=2)
    assert capsys.readouterr().out.count("live line") == 2
    labkit.set_output("auto")
    with pytest.raises(ValueError, match="live"):
        labkit.set_output("loud")


def test_failing_rank_is_named_with_its_traceback_and_root_cause_first(nb, no_leftover_workers):
    t0 = time.perf_counter()
    with pytest.raises(labkit.RankError) as info:
        labkit.run(nb["fails_on_rank_1"], world_size=2, **CPU)
    msg = str(info.value)
    print(f"failure reported after {time.perf_counter() - t0:.2f} s")
    assert msg.startswith("rank 1 of 2 (gloo) failed: ValueError: bad shard size 7")
    assert 'File "<notebook-cell>"' in msg and "in fails_on_rank_1" in msg
    assert "Connection" not in msg.split("---")[0]
    assert info.value.failures[1] == ("ValueError", "bad shard size 7")


def test_unpicklable_return_value_names_rank_and_type(nb, no_leftover_workers):
    with pytest.raises(labkit.RankError, match=r"rank 0 returned a value of type lock"):
        labkit.run(nb["unpicklable"], world_size=2, **CPU)


def test_a_rank_that_never_joins_fails_with_where_each_rank_is_stuck(nb, no_leftover_workers):
    with pytest.raises(labkit.RankTimeout) as info:
        labkit.run(nb["never_joins"], world_size=2, timeout=3, **CPU)
    msg = str(info.value)
    assert "timed out after 3 s" in msg and "rank 0 did not finish (finished: 1)" in msg
    assert "in never_joins" in msg and "--- rank 0 ---" in msg


def test_mismatched_collectives_fail_instead_of_hanging(nb, no_leftover_workers):
    with pytest.raises(labkit.RankError):
        labkit.run(nb["mismatched"], world_size=2, timeout=3, **CPU)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (dict(world_size=0), ValueError, "≥ 1"),
        (dict(world_size=1.5), TypeError, "int"),
        (dict(world_size=True), TypeError, "int"),
        (dict(backend="mpi"), ValueError, "'auto', 'gloo', 'nccl'"),
        (dict(timeout=-1), ValueError, "positive"),
    ],
)
def test_bad_input_says_what_is_allowed(bad, exc, match):
    with pytest.raises(exc, match=match):
        labkit.run(print, **bad)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        labkit.run(42)


def test_oversubscription_is_a_note_on_stdout_once_per_kernel(capsys, no_leftover_workers):
    n = (os.cpu_count() or 1) + 1
    labkit.launch.run._noted_oversubscription = False
    assert labkit.run(lambda: 1, world_size=n) == [1] * n
    first = capsys.readouterr()
    assert "oversubscribed" in first.out and "oversubscribed" not in first.err
    assert labkit.run(lambda: 1, world_size=n + 1) == [1] * (n + 1)
    assert "oversubscribed" not in capsys.readouterr().out


def _script(tmp_path, body):
    path = tmp_path / "kernel.py"
    path.write_text(textwrap.dedent(body))
    return path


# The ranks sleep until the test stops them: an interrupt that a loaded machine delivers late
# still finds them running (with a sleep of 60 s they could return first and the kernel exit
# normally, without a KeyboardInterrupt).
SLEEPER = """
    import os, sys, time, labkit
    def sleeper(d):
        open(os.path.join(d, f"pid{os.environ['RANK']}"), "w").write(str(os.getpid()))
        time.sleep(3600)
    if __name__ == "__main__":
        labkit.run(sleeper, sys.argv[1], world_size=2, timeout=3600)
"""


def _pids_written(d, n):
    """The n ranks' pids once each has written its file whole (one write of a few bytes: a file
    is empty or whole), else None."""
    texts = [p.read_text() for p in d.glob("pid*")]
    return [int(t) for t in texts] if len(texts) == n and all(texts) else None


def _wait_for_pids(d, n, proc):
    # No deadline in seconds: a loaded machine takes a minute and more to start a kernel and its
    # ranks (60 s was missed beside 8 CPU hogs); the kernel's CPU clock tells a hang instead.
    wait_while_it_works(lambda: _pids_written(d, n), proc, "ranks did not start")
    return _pids_written(d, n)


def _all_gone(pids, within=10):
    deadline = time.time() + within
    while time.time() < deadline:
        alive = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ]
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_no_worker_survives_an_interrupt_or_the_kernel_dying(tmp_path, how):
    # Output to a file, not a pipe: the forkserver inherits the pipe and would keep it open.
    log = open(tmp_path / "out.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, str(_script(tmp_path, SLEEPER)), str(tmp_path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
        wait_while_it_works(lambda: proc.poll() is not None, proc, f"the kernel did not exit ({how})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if how == "interrupt":
        assert "KeyboardInterrupt" in (tmp_path / "out.txt").read_text()
    assert _all_gone(pids), f"workers {pids} survived ({how})"


def test_same_fn_runs_unchanged_under_torchrun(tmp_path):
    script = _script(
        tmp_path,
        """
        import torch, torch.distributed as dist, labkit
        def f(x):
            t = torch.ones(1, device=labkit.device()) * (dist.get_rank() + 1); dist.all_reduce(t)
            return x, dist.get_rank(), t.item()
        res = labkit.run(f, "hi", world_size=2)
        if dist.get_rank() == 0:
            print("RESULT", list(res))
    """,
    )
    out = run_in_own_group(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(script)],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESULT [('hi', 0, 3.0), ('hi', 1, 3.0)]" in out.stdout


def test_the_suites_forkserver_preloads_pytest():
    # nbval's plugin imports ipykernel into pytest; `import labkit` must not take that for a
    # kernel and start the forkserver before conftest's preload("pytest") (every rank then
    # imported pytest itself: three test files took 125 s instead of 117 s).
    assert labkit.run(lambda: 1, world_size=1) == [1]
    servers = forkservers()
    assert servers, "no forkserver below this process"
    for line in servers.values():
        assert "'pytest'" in line, line
    probe = "import ipykernel, labkit; from labkit.launch import run; print(run._warm_up_started)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_import_labkit_needs_no_torch_and_the_labs_import_it_first():
    # A kernel's `import labkit` starts the forkserver, which imports torch (and torch._dynamo)
    # for seconds; the labs import labkit before torch so that this runs on one core while the
    # kernel imports torch on the other. That holds only while `import labkit` loads no torch.
    probe = "import sys, labkit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", "`import labkit` imported torch: " + out.stderr[-2000:]
    import ast
    import glob

    sources = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "notebooks", "src", "*.py")))
    assert sources
    for src in sources:
        first_code = open(src).read().split("# %%\n")[1]  # from the first code cell on
        imports = [n for n in ast.parse(first_code).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        first = imports[0]
        names = [a.name for a in first.names] if isinstance(first, ast.Import) else [first.module]
        assert names == ["labkit"], f"{os.path.basename(src)}: the first import is {names}, not labkit"


def test_every_preloaded_module_imports_and_preload_takes_names():
    # multiprocessing's forkserver skips a preload name that fails to import without a word: a
    # misspelt or moved module would only make every launch slower again. Checked here.
    import importlib

    from labkit.launch.run import PRELOAD, preload

    for name in PRELOAD:
        importlib.import_module(name)
    assert "pytest" in PRELOAD  # tests/conftest.py
    with pytest.raises(TypeError, match="module names"):
        preload(3)
    with pytest.raises(TypeError, match="module names"):
        preload("")
    labkit.warm_up(background=False)  # a running forkserver: a name already there is fine,
    preload("pytest")  # a new one would be ignored, so it is refused
    with pytest.raises(RuntimeError, match=r"already running, so \['json'\] would not"):
        preload("json")
    assert "json" not in PRELOAD
