"""Misuse cases for `benchmarks/faults.py` (issue 21): a new user's mistakes, off the course's
paths, each either doing what PyTorch's own API does or refused with a message naming it.

    misuse_trial() -> {case: (held, seconds, detail)}

One trial is one 2-rank launch that tries every in-rank case (each case timed on its own), plus
the cases the kernel side must try itself (a second checkpoint writer, a setsid'd grandchild, a
collective after destroy_process_group, a 400-rank typo). held: the promise in MISUSE_CASES.
"""

import os
import subprocess
import sys
import tempfile
import time

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])

MISUSE_CASES = {
    "alias-all-gather": "ring_all_gather(out, out[:8]) equals all_gather_into_tensor",
    "fully-shard-avg": "fully_shard_by_hand averages a mean loss like fully_shard",
    "sharded-opt-kwargs": "ShardedOptimizer: momentun= raises TypeError, add_param_group raises",
    "optimizer-before-shard": "an optimizer built before sharding raises at its step",
    "options-swallowed": "every strategy refuses bucket_cap_mbb=; torch-ddp refuses a bf16 policy",
    "loss-scale": "MixedPrecision(init_scale=0) and growth_interval=0 are refused",
    "negative-steps": "loop.train(steps=-3) raises",
    "subgroup-outsider": "a rank outside a subgroup gets a message naming the group",
    "double-after-optimizer": "model.double() after ShardedOptimizer is named",
    "root-before-inner": "sharding the root before an inner module is named",
    "unit-names": "units='blocks' / 'Linear' list the known names",
    "cfg-string": "cfg='dp' points at loop.PRESETS['dp']",
    "batch-below-world": "batch_size < world_size is named",
    "after-destroy": "a collective after destroy_process_group raises as dist.all_reduce does",
    "checkpoint-two-writers": "a second writer of one root is refused, naming the holder",
    "setsid-grandchild": "a setsid'd grandchild dies with the call",
    "world-size-typo": "world_size=400 on a small machine is refused before any fork",
    # issue 29: torch's own tools on fully_shard_by_hand's model, the same answer as fully_shard
    "clip-grad-norm": "clip_grad_norm_(model.parameters()) gives fully_shard's global norm on every rank",
    "freeze-after-shard": "requires_grad_(False) after sharding: no .grad, the weight does not move",
    "replaced-param": "a parameter replaced after sharding is refused at the next forward, by name",
    "double-after-shard": "model.double() after sharding says conversion comes BEFORE sharding",
    "full-state-dict": "get_model_state_dict(full_state_dict=True) gives whole tensors, as fully_shard",
    "sharded-opt-lbfgs": "ShardedOptimizer refuses LBFGS and Adafactor by name",
    "group-defaults": "ShardedOptimizer.param_groups[0] carries betas, eps, weight_decay",
    "accum-steps-float": "loop.train(accum_steps=2.0) is refused up front",
    "optimizer-dict": "cfg.optimizer=dict is refused up front",
    "latest-step-order": "latest_complete picks step 1000000 over 999999",
    "save-bad-step": "a checkpoint step of -1, 2.5 or True is refused naming step",
    "run-keyword-clash": "a rank parameter named timeout is named as labkit.run's own keyword",
    "costmodel-nonsense": "the cost model refuses stage=7, n=-4, mfu=1.5 and a negative message",
}


def _raises(fn, exc, text):
    try:
        fn()
    except exc as e:
        return text in str(e), str(e)[:120]
    except Exception as e:  # noqa: BLE001  (the wrong exception is a failure, reported)
        return False, f"{type(e).__name__}: {str(e)[:100]}"
    return False, "no error"


def _in_rank_cases():
    import torch
    import torch.distributed as dist
    from labkit import loop, strategies
    from labkit.comm import collectives as C
    from labkit.strategies.comm_choice import torch_all_gather
    from labkit.strategies.precision import MixedPrecision
    from labkit.strategies.fsdp import full_state_dict, fully_shard_by_hand
    from labkit.strategies.zero import ShardedOptimizer
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()

    def alias():
        got = []
        for gather in (C.ring_all_gather, torch_all_gather()):
            out = torch.arange(16.0) + 100 * rank
            gather(out, out[:8])
            got.append(out)
        return torch.equal(*got), f"ours {got[0][8].item()} torch {got[1][8].item()}"

    def avg():
        states = []
        for shard in (fully_shard_by_hand, fully_shard):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            x, y = torch.randn(8, 4), torch.randn(8, 2)
            shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            rows = slice(4 * rank, 4 * rank + 4)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            states.append(
                full_state_dict(model)
                if shard is fully_shard_by_hand
                else {k: v.full_tensor() for k, v in model.state_dict().items()}
            )
        diff = max((states[0][k] - states[1][k]).abs().max().item() for k in states[1])
        return diff < 1e-6, f"max diff {diff:.2g}"

    def kwargs():
        ok, detail = _raises(
            lambda: ShardedOptimizer(
                torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1, momentun=0.9
            ),
            TypeError,
            "momentun",
        )
        opt = ShardedOptimizer(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1)
        ok2, detail2 = _raises(
            lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]}),
            NotImplementedError,
            "add_param_group",
        )
        return ok and ok2, f"{detail} | {detail2}"

    def before():
        model = torch.nn.Linear(4, 2)
        early = torch.optim.AdamW(model.parameters())
        fully_shard_by_hand(model)
        model(torch.randn(3, 4)).sum().backward()
        return _raises(early.step, RuntimeError, "AFTER sharding")

    def options():
        for name in strategies.NAMES:
            # The tensor-parallel family splits TinyGPT's heads: built on a TinyGPT preset.
            cfg = loop.PRESETS["dp" if name.endswith("tp") else "toy"]
            ok, detail = _raises(
                lambda: strategies.build(name, loop.build_model(cfg), cfg, bucket_cap_mbb=1),
                TypeError,
                "bucket_cap_mbb",
            )
            if not ok:
                return False, f"{name}: {detail}"
        bf16 = loop.PRESETS["toy"].replace(mp=MixedPrecision(torch.bfloat16, torch.float32))
        return _raises(
            lambda: loop.train("torch-ddp", bf16, 1), NotImplementedError, "no public mixed precision"
        )

    def scale():
        ok, detail = _raises(lambda: MixedPrecision(torch.float16, init_scale=0), ValueError, "init_scale")
        ok2, _ = _raises(
            lambda: MixedPrecision(torch.float16, growth_interval=0), ValueError, "growth_interval"
        )
        return ok and ok2, detail

    def outsider():
        sub = dist.new_group([0])
        if rank == 0:
            return True, "rank 0 is a member"
        return _raises(lambda: C.ring_all_reduce(torch.ones(4), group=sub), ValueError, "not a member")

    def doubled():
        model = torch.nn.Linear(4, 2)
        opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        model.double()
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        return _raises(opt.step, RuntimeError, "converted or moved")

    def root_first():
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fully_shard_by_hand(model)
        return _raises(lambda: fully_shard_by_hand(model[0]), ValueError, "root last")

    def units():
        cfg = loop.PRESETS["dp"]
        for name in ("blocks", "Linear"):
            ok, detail = _raises(
                lambda: strategies.build("fsdp", loop.build_model(cfg), cfg, units=name),
                ValueError,
                "a name must be one of",
            )
            if not ok:
                return False, detail
        return True, detail

    def _tiny():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))

    def _torch_sharded(model):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def _hand_sharded(model):
        fully_shard_by_hand(model[0])
        return fully_shard_by_hand(model)

    def _batch():
        torch.manual_seed(1 + rank)
        return torch.randn(4, 6)

    def clip():
        norms = []
        for shard in (_hand_sharded, _torch_sharded):
            model = shard(_tiny())
            model(_batch()).pow(2).mean().backward()
            n = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            norms.append(float(n.full_tensor() if hasattr(n, "full_tensor") else n))
        return norms[0] == norms[1], f"ours {norms[0]:.6g} fully_shard {norms[1]:.6g}"

    def freeze():
        model = _hand_sharded(_tiny())
        model[0].weight.requires_grad_(False)
        before = model[0].weight.detach().clone()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(_batch()).sum().backward()
        no_grad = model[0].weight.grad is None
        opt.step()
        still = torch.equal(model[0].weight.detach(), before)
        return no_grad and still, f"grad None {no_grad}, unmoved {still}"

    def replaced():
        model = _hand_sharded(_tiny())
        model[2].bias = torch.nn.Parameter(torch.zeros(3))
        return _raises(lambda: model(_batch()), RuntimeError, "2.bias")

    def doubled_shard():
        model = _hand_sharded(_tiny())
        model.double()
        return _raises(lambda: model(_batch().double()), RuntimeError, "BEFORE sharding")

    def full_sd():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = StateDictOptions(full_state_dict=True)
        shapes = [
            {k: tuple(v.shape) for k, v in get_model_state_dict(shard(_tiny()), options=full).items()}
            for shard in (_hand_sharded, _torch_sharded)
        ]
        return shapes[0] == shapes[
            1
        ], f"ours {shapes[0].get('0.weight')} fully_shard {shapes[1].get('0.weight')}"

    def lbfgs():
        for cls in (torch.optim.LBFGS, torch.optim.Adafactor):
            ok, detail = _raises(
                lambda: ShardedOptimizer(torch.nn.Linear(4, 3).parameters(), cls, lr=0.1),
                TypeError,
                cls.__name__,
            )
            if not ok:
                return False, detail
        return True, detail

    def defaults():
        opt = ShardedOptimizer(torch.nn.Linear(4, 3).parameters(), torch.optim.AdamW, lr=0.1)
        missing = [k for k in ("betas", "eps", "weight_decay") if k not in opt.param_groups[0]]
        return not missing, f"missing {missing}" if missing else "all there"

    cases = {
        "alias-all-gather": alias,
        "fully-shard-avg": avg,
        "sharded-opt-kwargs": kwargs,
        "optimizer-before-shard": before,
        "options-swallowed": options,
        "loss-scale": scale,
        "negative-steps": lambda: _raises(
            lambda: loop.train("ddp-naive", loop.PRESETS["toy"], -3), ValueError, "steps must be"
        ),
        "subgroup-outsider": outsider,
        "double-after-optimizer": doubled,
        "root-before-inner": root_first,
        "unit-names": units,
        "cfg-string": lambda: _raises(lambda: loop.train("ddp-naive", "dp", 1), TypeError, "PRESETS['dp']"),
        "batch-below-world": lambda: _raises(
            lambda: loop.train("ddp-naive", loop.PRESETS["dp"].replace(batch_size=1), 1),
            ValueError,
            "batch_size=1",
        ),
        "clip-grad-norm": clip,
        "freeze-after-shard": freeze,
        "replaced-param": replaced,
        "double-after-shard": doubled_shard,
        "full-state-dict": full_sd,
        "sharded-opt-lbfgs": lbfgs,
        "group-defaults": defaults,
        "accum-steps-float": lambda: _raises(
            lambda: loop.train("ddp-flat", loop.PRESETS["toy"], 1, accum_steps=2.0),
            ValueError,
            "accum_steps must be an int",
        ),
        "optimizer-dict": lambda: _raises(
            lambda: loop.train("ddp-flat", loop.PRESETS["toy"].replace(optimizer=dict), 1),
            TypeError,
            "cfg.optimizer must be",
        ),
    }
    out = {}
    for name, case in cases.items():
        start = time.perf_counter()
        held, detail = case()
        out[name] = (held, time.perf_counter() - start, detail)
    return out


def _after_destroy():
    import torch
    import torch.distributed as dist
    from labkit.comm import collectives as C

    dist.destroy_process_group()
    return _raises(lambda: C.ring_all_reduce(torch.ones(4)), RuntimeError, "init_process_group")


def _start_setsid_grandchild():
    out = subprocess.run(
        ["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _timed(fn):
    start = time.perf_counter()
    try:
        held, detail = fn()
    except Exception as e:  # noqa: BLE001
        held, detail = False, f"{type(e).__name__}: {str(e)[:100]}"
    return held, time.perf_counter() - start, detail


def _wants_timeout(x, timeout):
    return x + timeout


def _kernel_cases():
    import labkit
    from labkit.launch import run as launch

    out = {"after-destroy": _timed(lambda: labkit.run(_after_destroy, world_size=2)[1])}

    def two_writers():
        from labkit.labs.checkpoint_runs import train_resumable

        with tempfile.TemporaryDirectory() as root:
            holder = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys, time; from labkit.strategies.checkpoint.files "
                    "import lock_root; lock_root(sys.argv[1]); print('locked', flush=True); time.sleep(60)",
                    root,
                ],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ},
            )
            try:
                holder.stdout.readline()
                return _raises(
                    lambda: labkit.run(
                        train_resumable, 1, root, save_every=1, gpt_config=dict(n_layers=2), world_size=2
                    ),
                    labkit.RankError,
                    f"pid {holder.pid}",
                )
            finally:
                holder.kill()
                holder.wait()

    out["checkpoint-two-writers"] = _timed(two_writers)

    def grandchild():
        pids = labkit.run(_start_setsid_grandchild, world_size=2)
        deadline = time.time() + 5
        while any(_alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.05)
        alive = [p for p in pids if _alive(p)]
        for p in alive:
            os.kill(p, 9)
        return not alive, f"alive after the call: {alive}" if alive else "all gone"

    out["setsid-grandchild"] = _timed(grandchild)

    def step_order():
        from labkit.strategies.checkpoint import files

        with tempfile.TemporaryDirectory() as root:
            for step in (999999, 1000000):
                os.mkdir(os.path.join(root, f"step_{step:06d}"))
            verify, files.verify = files.verify, lambda path: None  # both complete
            try:
                got = files.latest_complete(root)
            finally:
                files.verify = verify
            return got.endswith("step_1000000"), os.path.basename(got)

    def bad_step():
        from labkit.strategies.checkpoint import save_load

        with tempfile.TemporaryDirectory() as root:
            for step in (-1, 2.5, True):
                ok, detail = _raises(lambda: save_load._start_save(root, step), ValueError, "step")
                if not ok:
                    return False, f"step={step!r}: {detail}"
            return True, detail

    def costmodel_nonsense():
        from labkit import costmodel as cm
        from labkit.costmodel import links

        for call, name in (
            (lambda: cm.memory_per_rank(7.5e9, 64, 7), "stage"),
            (lambda: cm.memory_per_rank(7.5e9, -4, 1), "n must be"),
            (lambda: cm.with_mfu(cm.A100, 1.5), "mfu"),
            (lambda: links.collective_time("all_reduce", 4, -1.0, links.IB_200G), "size_bytes"),
        ):
            ok, detail = _raises(call, (ValueError, TypeError), name)
            if not ok:
                return False, detail
        return True, detail

    out["latest-step-order"] = _timed(step_order)
    out["save-bad-step"] = _timed(bad_step)
    out["run-keyword-clash"] = _timed(
        lambda: _raises(
            lambda: labkit.run(_wants_timeout, 1, timeout=5), TypeError, "labkit.run's own keyword"
        )
    )
    out["costmodel-nonsense"] = _timed(costmodel_nonsense)
    # The check alone (no launch): a build without it would fork 400 processes.
    out["world-size-typo"] = _timed(
        lambda: _raises(
            lambda: launch._check_args(print, 400 * launch._usable_cores(), "auto", 60.0),
            ValueError,
            "far beyond",
        )
    )
    return out


def misuse_trial():
    """{case: (held, seconds, detail)}: every in-rank case on 2 ranks (held on both), then the
    kernel-side ones."""
    import labkit

    ranks = labkit.run(_in_rank_cases, world_size=2, timeout=120)
    out = {}
    for name in ranks[0]:
        held = all(r[name][0] for r in ranks)
        detail = next((r[name][2] for r in ranks if not r[name][0]), ranks[0][name][2])
        out[name] = (held, max(r[name][1] for r in ranks), detail)
    out.update(_kernel_cases())
    return out
