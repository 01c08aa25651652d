"""Misuse as a new user would try it (issue 21): labkit's drop-ins behave like PyTorch's, and
every mistake is refused with a message naming it. Each test here failed before its fix."""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.comm import collectives as C
from labkit.comm import flat as F


def _aliased_all_gather_rank():
    """The input a slice of the output that is NOT this rank's chunk (rank 1: out[:8])."""
    rank = dist.get_rank()
    got = {}
    for name, gather in (
        ("ring_all_gather", C.ring_all_gather),
        ("all_gather_coalesced", lambda o, i: F.all_gather_coalesced([o], [i])),
        ("torch", dist.all_gather_into_tensor),
    ):
        out = torch.arange(16.0) + 100 * rank
        gather(out, out[:8])
        got[name] = out.tolist()
    return got


def test_all_gather_with_an_input_aliasing_a_peers_chunk_matches_torch():
    results = labkit.run(_aliased_all_gather_rank, world_size=2)
    want = list(range(8)) + [100.0 + i for i in range(8)]  # rank 0's out[:8], then rank 1's
    for rank, got in enumerate(results):
        assert got["torch"] == want
        assert got["ring_all_gather"] == want, (rank, got)
        assert got["all_gather_coalesced"] == want, (rank, got)


def _after_destroy_rank():
    dist.destroy_process_group()
    raised = {}
    for name, call in (
        ("torch", lambda t: dist.all_reduce(t)),
        ("ring_all_reduce", C.ring_all_reduce),
        ("ring_all_gather", lambda t: C.ring_all_gather(torch.zeros(8), t)),
        ("reduce_scatter_padded", F.reduce_scatter_padded),
    ):
        try:
            call(torch.ones(4))
            raised[name] = None
        except (RuntimeError, ValueError) as exc:
            raised[name] = type(exc).__name__ + ": " + str(exc)
    return raised


def test_collectives_after_destroy_process_group_raise_as_torch_does():
    for raised in labkit.run(_after_destroy_rank, world_size=2):
        assert raised["torch"] is not None
        for name in ("ring_all_reduce", "ring_all_gather", "reduce_scatter_padded"):
            assert raised[name] is not None, f"{name} ran as a world of one after destroy"
            assert "init_process_group" in raised[name]


@pytest.mark.parametrize(
    "bad",
    [
        dict(init_scale=0),
        dict(init_scale=-8),
        dict(init_scale=float("inf")),
        dict(growth_interval=0),
        dict(growth_interval=1.5),
    ],
)
def test_mixed_precision_refuses_a_loss_scale_that_cannot_work(bad):
    from labkit.strategies.precision import MixedPrecision

    with pytest.raises(ValueError, match=next(iter(bad))):
        MixedPrecision(param_dtype=torch.float16, **bad)


def _train_negative_steps():
    from labkit import loop

    try:
        out = loop.train("ddp-naive", loop.PRESETS["toy"], steps=-3, return_state=False)
        return f"trained, {len(out['losses'])} losses"
    except ValueError as exc:
        return str(exc)


def test_train_refuses_a_negative_step_count():
    from labkit import loop

    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        loop.reference(loop.PRESETS["toy"], steps=-3)
    for message in labkit.run(_train_negative_steps, world_size=2):
        assert "steps must be an int >= 0, got -3" in message


def test_run_refuses_a_world_size_far_beyond_the_machine(monkeypatch):
    from labkit.launch import run as launch

    monkeypatch.setattr(launch, "_usable_cores", lambda: 2)
    with pytest.raises(ValueError, match="world_size=400 is far beyond.*LABKIT_MAX_WORLD_SIZE"):
        labkit.run(print, world_size=400)
    monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", "500")
    assert launch._check_args(print, 400, "auto", 60.0) == (400, 60.0)  # asked for: allowed


def _sharded_optimizer_misuse_rank():
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from labkit.strategies.zero import ShardedOptimizer

    out = {}
    for name, cls in (("torch", ZeroRedundancyOptimizer), ("labkit", ShardedOptimizer)):
        for bad in (dict(momentun=0.9), dict(lrr=0.5)):
            model = torch.nn.Linear(4, 2)
            try:
                cls(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, **bad)
                out[name, next(iter(bad))] = None
            except TypeError as exc:
                out[name, next(iter(bad))] = str(exc)
    model, extra = torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    try:
        opt.add_param_group({"params": list(extra.parameters())})
        out["add_param_group"] = None
    except NotImplementedError as exc:
        out["add_param_group"] = str(exc)
    try:
        opt.consolidate_state_dict()
        out["consolidate"] = None
    except NotImplementedError as exc:
        out["consolidate"] = str(exc)
    try:
        ShardedOptimizer(model.parameters(), torch.nn.Linear, lr=0.1)
        out["not an optimizer"] = None
    except TypeError as exc:
        out["not an optimizer"] = str(exc)
    return out


def test_sharded_optimizer_refuses_what_it_would_ignore():
    for out in labkit.run(_sharded_optimizer_misuse_rank, world_size=2):
        for key in ("momentun", "lrr"):
            assert out["torch", key] is not None  # torch raises TypeError
            assert out["labkit", key] is not None and key in out["labkit", key]
        assert "every group when building" in out["add_param_group"]
        assert "state_dict()" in out["consolidate"]
        assert "torch.optim.Optimizer subclass" in out["not an optimizer"]


def _mean_loss_step(which, divide_factor=None):
    """One SGD step of nn.Linear(4, 2) on this rank's half of 8 rows, a MEAN loss per rank (how
    every FSDP2 script is written), sharded by `which`; the full weights after the step."""
    from torch.distributed.fsdp import fully_shard
    from labkit.strategies.fsdp import full_state_dict, fully_shard_by_hand

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    shard = (fully_shard_by_hand if which == "labkit" else fully_shard)(model)
    if divide_factor is not None:
        shard.set_gradient_divide_factor(divide_factor)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rows = slice(4 * rank, 4 * rank + 4)
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    opt.step()
    if which == "labkit":
        return full_state_dict(model)
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


def _single_process_mean_step(scale=1.0):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    (scale * torch.nn.functional.mse_loss(model(x), y)).backward()
    opt.step()
    return model.state_dict()


def _fully_shard_defaults_rank():
    return [_mean_loss_step("labkit"), _mean_loss_step("torch"), _mean_loss_step("labkit", 1.0)]


def test_fully_shard_by_hand_averages_by_default_like_fully_shard():
    want, summed = _single_process_mean_step(), _single_process_mean_step(scale=2.0)
    for ours, torchs, ours_sum in labkit.run(_fully_shard_defaults_rank, world_size=2):
        for k in want:
            torch.testing.assert_close(torchs[k], want[k])
            torch.testing.assert_close(ours[k], want[k])  # AVG, as fully_shard
            torch.testing.assert_close(ours_sum[k], summed[k])  # divide factor 1: SUM


def _optimizer_before_sharding_rank():
    from labkit.strategies.fsdp import fully_shard_by_hand

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    fully_shard_by_hand(model[0])
    fully_shard_by_hand(model)
    model(torch.randn(5, 4)).sum().backward()
    try:
        early.step()
        return None
    except RuntimeError as exc:
        return str(exc)


def test_an_optimizer_built_before_sharding_raises_at_its_first_step():
    for message in labkit.run(_optimizer_before_sharding_rank, world_size=2):
        assert message is not None, "the orphaned parameters were stepped silently"
        assert "AdamW was built before fully_shard_by_hand sharded 0.weight" in message
        assert "AFTER sharding" in message


def _strategy_options_rank():
    from labkit import loop, strategies
    from labkit.strategies.precision import MixedPrecision

    out = {}
    for name in strategies.NAMES:
        # The tensor-parallel family splits TinyGPT's heads, sp / cp / ulysses its sequence, the
        # pipelines its blocks: built on a TinyGPT preset.
        three_d = name in ("zero1-tp-pp", "fsdp-tp-pp")  # on 2 ranks: dp 1 x pp 2 x tp 1
        cfg = loop.PRESETS[
            "moe"  # expert parallelism splits MoE blocks' experts
            if name == "ep"
            else "dp"
            if name.endswith(("tp", "sp", "cp", "ulysses"))
            or name in ("pp", "pp-zero1", "torch-pp")
            or three_d
            else "toy"
        ]
        for bad in ("bucket_cap_mbb", "find_unused_paramters"):
            try:
                strategies.build(name, loop.build_model(cfg), cfg, **{bad: 1})
                out[name, bad] = None
            except TypeError as exc:
                out[name, bad] = str(exc)
        op = "avg" if name.startswith("torch-") else "sum"
        shape = dict(tp=1) if three_d else {}
        strategies.build(name, loop.build_model(cfg), cfg, reduce_op=op, mp_policy=None, **shape)  # one shape
    bf16 = loop.PRESETS["toy"].replace(mp=MixedPrecision(torch.bfloat16, torch.float32))
    for name in ("torch-ddp", "torch-zero1"):
        try:
            loop.train(name, bf16, 1, return_state=False)
            out[name, "mp"] = None
        except NotImplementedError as exc:
            out[name, "mp"] = str(exc)
    return out


def test_every_strategy_refuses_unknown_options_and_policies_it_cannot_honour():
    from labkit import strategies

    for out in labkit.run(_strategy_options_rank, world_size=2, timeout=180):
        for name in strategies.NAMES:
            for bad in ("bucket_cap_mbb", "find_unused_paramters"):
                assert out[name, bad] is not None, f"{name} accepted {bad}= and ignored it"
                assert bad in out[name, bad], out[name, bad]
        from labkit.launch.run import _gpu_count

        for name in ("torch-ddp", "torch-zero1") if _gpu_count() < 2 else ():  # 2 CPU ranks
            assert out[name, "mp"] is not None, f"{name} trained fp32 under a bf16 preset"
            # bf16 is DDP's own _MixedPrecision, which needs CUDA (tests/test_bf16_strategies.py)
            assert "needs CUDA" in out[name, "mp"]


def test_the_loop_asks_the_interface_and_probes_no_attributes():
    import ast
    import inspect
    from labkit import loop

    probes = [
        node.lineno
        for node in ast.walk(ast.parse(inspect.getsource(loop)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and node.args
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == "s"
    ]  # the strategy
    assert probes == [], f"loop.py probes the strategy's attributes at lines {probes}"


def test_ddp_stages_take_reduce_op_like_every_strategy():
    from labkit.strategies import ddp
    from labkit.strategies.ddp import by_hand

    assert "reduce_op" in inspect_parameters(by_hand._DDPBase) and "op" not in inspect_parameters(
        by_hand._DDPBase
    )
    for cls in (ddp.DDPNaive, ddp.DDPFlat, ddp.DDPBucketed, ddp.TorchDDP):
        assert not hasattr(cls, "finish_gradient_sync"), cls  # one name: sync_gradients


def inspect_parameters(cls):
    import inspect

    return inspect.signature(cls.__init__).parameters


def test_a_second_writer_of_one_checkpoint_root_is_refused_and_a_dead_ones_lock_taken_over(tmp_path):
    import subprocess
    import sys
    from labkit.labs.checkpoint_runs import train_resumable
    from labkit.strategies.checkpoint import latest_complete

    root = str(tmp_path / "ckpt")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from labkit.strategies.checkpoint.files "
            "import lock_root; lock_root(sys.argv[1]); print('locked', flush=True); time.sleep(120)",
            root,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        small = dict(n_layers=2)
        with pytest.raises(labkit.RankError, match=rf"being written by another run \(pid {holder.pid} "):
            labkit.run(train_resumable, 2, root, save_every=1, gpt_config=small, world_size=2)
        assert latest_complete(root) is None
    finally:
        holder.kill()
        holder.wait()
    # The holder is dead (its lock file, naming it, is still there): the next run takes over.
    labkit.run(train_resumable, 2, root, save_every=1, gpt_config=small, world_size=2)
    assert latest_complete(root).endswith("step_000002")


def _start_escapees():
    """A child in a session of its own, and a setsid'd grandchild whose parent has exited."""
    import subprocess

    child = subprocess.Popen(["sleep", "300"], start_new_session=True)
    out = subprocess.run(
        ["sh", "-c", "setsid sleep 301 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    return [child.pid, int(out.stdout)]


def test_nothing_a_rank_started_outlives_the_call_not_even_in_its_own_session():
    import time
    import psutil

    pids = [pid for pair in labkit.run(_start_escapees, world_size=2) for pid in pair]
    deadline = time.time() + 5
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        time.sleep(0.1)
    try:
        assert alive == [], f"still running after labkit.run returned: {alive}"
    finally:
        for p in alive:
            psutil.Process(p).kill()


def _cryptic_rank():
    """Each mistake's message, as a new user meets it."""
    from labkit import loop, strategies
    from labkit.strategies.fsdp import fully_shard_by_hand
    from labkit.strategies.zero import ShardedOptimizer

    rank, out = dist.get_rank(), {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as exc:  # noqa: BLE001  (the message is what is checked)
            out[name] = f"{type(exc).__name__}: {exc}"

    sub = dist.new_group([0])
    attempt(
        "outside subgroup",
        lambda: (
            C.ring_all_reduce(torch.ones(4), group=sub)
            if rank == 1
            else (_ for _ in ()).throw(ValueError("not a member"))
        ),
    )

    def doubled():
        model = torch.nn.Linear(4, 2)
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        model.double()
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()

    attempt("double after optimizer", doubled)

    def root_first():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fully_shard_by_hand(model)
        fully_shard_by_hand(model[0])

    attempt("root before inner", root_first)
    for units in ("blocks", "Linear"):
        attempt(
            f"units={units}",
            lambda: strategies.build(
                "fsdp", loop.build_model(loop.PRESETS["dp"]), loop.PRESETS["dp"], units=units
            ),
        )
    attempt("cfg str", lambda: loop.train("ddp-naive", "dp", 1))
    attempt("batch < world", lambda: loop.train("ddp-naive", loop.PRESETS["dp"].replace(batch_size=1), 1))
    return out


def test_cryptic_mistakes_get_messages_naming_them():
    for rank, out in enumerate(labkit.run(_cryptic_rank, world_size=2, timeout=120)):
        if rank == 1:
            assert "not a member of the group" in out["outside subgroup"]
        assert "model was converted or moved" in out["double after optimizer"]
        assert "shard the inner modules first and the root last" in out["root before inner"]
        for units in ("blocks", "Linear"):
            assert f"units={units!r}: a name must be one of" in out[f"units={units}"]
        assert "cfg must be a loop.Preset" in out["cfg str"] and "PRESETS['dp']" in out["cfg str"]
        assert "batch_size=1 rows cannot give each of 2 ranks" in out["batch < world"]
