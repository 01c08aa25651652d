"""Issue 36's fresh misuse probe: each finding, reproduced on real ranks the way a user meets it,
now behaves as PyTorch does or raises an error that names the problem. One launch holds the
independent cases (each caught and recorded by name); the file starts two launches."""

import json
import os

import pytest
import torch
import torch.distributed as dist

import labkit


class PerTensorNormSGD(torch.optim.Optimizer):
    """A user-written optimizer that is NOT element-wise: each gradient normalised by its own norm."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


class SignSGD(torch.optim.Optimizer):
    """A user-written optimizer that IS element-wise (signSGD)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def _raised(fn):
    """(type name, message) of what fn() raises, or None if it returns."""
    try:
        fn()
    except Exception as exc:  # the cases are independent: record each one's outcome
        return type(exc).__name__, str(exc)
    return None


def _zero1_step(opt_cls, rows=8):
    """One ZeRO1 step of Linear(6, 5) on this rank's half of `rows` rows (the loop's loss
    convention: summed over the rank's rows, divided by the global count); the full weights."""
    from labkit.strategies.zero.stages import ZeRO1

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).double()
    x, y = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 5, dtype=torch.float64)
    s = ZeRO1(model, opt_cls, lr=0.1)
    s.zero_grad()
    half = slice(rank * rows // 2, (rank + 1) * rows // 2)
    (torch.nn.functional.mse_loss(model(x[half]), y[half], reduction="sum") / (rows * 5)).backward()
    s.after_backward()
    s.step()
    return s.full_state_dict()


def _one_process_step(opt_cls, rows=8):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).double()
    x, y = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, 5, dtype=torch.float64)
    opt = opt_cls(model.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return model.state_dict()


def _probe_rank(root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from labkit import loop, strategies
    from labkit.strategies import checkpoint as ckpt
    from labkit.strategies.fsdp import full_state_dict, fully_shard_by_hand
    from labkit.strategies.tp import parallelize_by_hand
    from labkit.strategies.zero.stages import ZeRO1, ZeRO2

    out = {}
    toy = loop.PRESETS["toy"]

    # Bad 1: a string mp_policy. torch's fully_shard takes it and fails at the first forward.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model, mp_policy="bf16")
    out["torch fully_shard bf16"] = _raised(lambda: model(torch.randn(2, 4)))
    out["fully_shard_by_hand bf16"] = _raised(
        lambda: fully_shard_by_hand(torch.nn.Linear(4, 4), mp_policy="bf16")
    )
    for name in strategies.NAMES:
        cfg = loop.PRESETS["dp" if name.endswith("tp") else "toy"]
        out[name, "bf16"] = _raised(
            lambda: strategies.build(name, loop.build_model(cfg), cfg, mp_policy="bf16")
        )

    # Bad 2: ZeRO over a user-written optimizer that is not element-wise.
    for stage in (ZeRO1, ZeRO2):
        out[stage.__name__, "norm"] = _raised(lambda: stage(torch.nn.Linear(6, 5), PerTensorNormSGD, lr=0.1))
    out["sign zero1"] = _zero1_step(SignSGD)  # element-wise: accepted, and exact

    # prefetch, max_inflight, max_in_flight, verify: validated like torch validates its own.
    for bad in (-1, 1.5, True):
        out["prefetch", bad] = _raised(
            lambda: strategies.build("fsdp", loop.build_model(toy), toy, prefetch=bad)
        )
    out["max_inflight 0"] = _raised(
        lambda: strategies.build("fsdp", loop.build_model(toy), toy, max_inflight=0)
    )
    for which, sharder in (("torch", fully_shard), ("labkit", fully_shard_by_hand)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        sharder(model[0])
        sharder(model)
        out["prefetch a plain module", which] = _raised(
            lambda: model.set_modules_to_forward_prefetch([torch.nn.Linear(2, 2)])
        )
    out["max_in_flight 0"] = _raised(lambda: ZeRO2(torch.nn.Linear(6, 5), max_in_flight=0))
    out["verify yes"] = _raised(lambda: ZeRO1(torch.nn.Linear(6, 5), verify="yes"))

    # forward_backward with no micro-batch.
    s = strategies.build("ddp-naive", loop.build_model(toy), toy)
    out["forward_backward []"] = _raised(lambda: s.forward_backward([], lambda x, y: x.sum()))

    # full_state_dict of a model tensor-parallelised alone: whole tensors, as the model's own.
    torch.manual_seed(1)
    tp_model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    whole = {k: v.clone() for k, v in tp_model.state_dict().items()}
    mesh = init_device_mesh("cpu", (2,))
    parallelize_by_hand(tp_model, mesh, {"0": "colwise", "2": "rowwise"})
    out["tp full_state_dict"] = (whole, full_state_dict(tp_model))

    # A row-parallel Linear under bf16 autocast: the dtype torch's RowwiseParallel gives.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dtypes = {}
    for which in ("labkit", "torch"):
        torch.manual_seed(2)
        m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
        if which == "labkit":
            parallelize_by_hand(m, mesh, {"0": "colwise", "1": "rowwise"})
        else:
            parallelize_module(m, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes[which] = m(torch.randn(3, 4)).dtype
    out["rowwise autocast"] = dtypes

    # Checkpoints: torch-fsdp and hsdp refused before any file; a manifest's world_size edited.
    def save_with(name, saver, where, **options):
        s = strategies.build(name, loop.build_model(toy), toy, **options)
        return _raised(lambda: saver(s, s.optimizer, os.path.join(root, where), 1))

    out["torch-fsdp save"] = save_with("torch-fsdp", ckpt.save_sharded, "torch")
    hsdp_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    hsdp = strategies.build("hsdp", loop.build_model(toy), toy, mesh=hsdp_mesh)
    out["hsdp save_sharded"] = _raised(
        lambda: ckpt.save_sharded(hsdp, hsdp.optimizer, os.path.join(root, "h1"), 1)
    )
    out["hsdp save_full"] = _raised(lambda: ckpt.save_full(hsdp, hsdp.optimizer, os.path.join(root, "h2"), 1))
    fsdp = strategies.build("fsdp", loop.build_model(toy), toy)
    path = ckpt.save_sharded(fsdp, fsdp.optimizer, os.path.join(root, "fsdp"), 1)
    out["hsdp load fsdp"] = _raised(lambda: ckpt.load(hsdp, hsdp.optimizer, path))
    own = [dist.new_group([r]) for r in range(2)][dist.get_rank()]  # a group of one: not the world
    out["subgroup save"] = save_with("fsdp", ckpt.save_sharded, "sub", group=own)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, ckpt.MARKER)) as f:
            manifest = json.load(f)
        manifest["world_size"] = 3
        with open(os.path.join(path, ckpt.MARKER), "w") as f:
            json.dump(manifest, f)
    dist.barrier()
    out["edited world_size"] = _raised(lambda: ckpt.load(fsdp, fsdp.optimizer, path))
    return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("probe36"))
    return root, labkit.run(_probe_rank, root, world_size=2, timeout=300)


def test_a_string_mp_policy_is_refused_where_it_is_passed(probe):
    from labkit import strategies

    for out in probe[1]:
        kind, message = out["torch fully_shard bf16"]  # torch: only at the first forward
        assert kind == "AttributeError" and "param_dtype" in message
        kind, message = out["fully_shard_by_hand bf16"]
        assert kind == "TypeError" and "mp_policy" in message and "'bf16'" in message
        for name in strategies.NAMES:  # fsdp, hsdp, zero1/2, ddp-*: TypeError; others refuse any
            assert out[name, "bf16"] is not None, f"{name} accepted mp_policy='bf16'"
            kind, message = out[name, "bf16"]
            assert kind in ("TypeError", "NotImplementedError"), (name, kind, message)
            assert "mp_policy" in message or "mixed precision" in message, (name, message)
            if name in (
                "fsdp",
                "hsdp",
                "zero1",
                "zero2",
                "ddp-naive",
                "ddp-flat",
                "ddp-bucketed",
                "torch-fsdp",
            ):
                assert kind == "TypeError" and "MixedPrecision" in message, (name, message)


def test_zero_refuses_an_optimizer_that_is_not_element_wise_and_takes_one_that_is(probe):
    want = _one_process_step(SignSGD)
    for out in probe[1]:
        for stage in ("ZeRO1", "ZeRO2"):
            kind, message = out[stage, "norm"]
            assert kind == "TypeError", message
            assert "PerTensorNormSGD" in message and "not element-wise" in message
            assert "ZeroRedundancyOptimizer" in message and "torch-zero1" in message
        for k in want:
            torch.testing.assert_close(out["sign zero1"][k], want[k], rtol=1e-12, atol=1e-12)


def test_prefetch_and_inflight_limits_are_validated(probe):
    for out in probe[1]:
        for bad in (-1, 1.5, True):
            kind, message = out["prefetch", bad]
            assert kind == "ValueError" and "prefetch must be an int >= 0" in message
        kind, message = out["max_inflight 0"]
        assert kind == "ValueError" and "limit must be an int >= 1" in message
        torch_kind, torch_message = out["prefetch a plain module", "torch"]
        kind, message = out["prefetch a plain module", "labkit"]
        assert (kind, message) == (torch_kind, torch_message)  # ValueError: Expects FSDPModule ...
        kind, message = out["max_in_flight 0"]
        assert kind == "ValueError" and "max_in_flight must be an int >= 1" in message
        kind, message = out["verify yes"]
        assert kind == "TypeError" and "verify must be True, False or None" in message


def test_forward_backward_of_no_micro_batch_names_it(probe):
    for out in probe[1]:
        kind, message = out["forward_backward []"]
        assert kind == "ValueError" and "non-empty list of (x, y) micro-batches" in message


def test_full_state_dict_of_a_tensor_parallel_model_is_whole_tensors(probe):
    for out in probe[1]:
        whole, got = out["tp full_state_dict"]
        assert set(got) == set(whole)
        for k in whole:
            assert type(got[k]) is torch.Tensor, (k, type(got[k]))
            torch.testing.assert_close(got[k], whole[k], rtol=0, atol=0)


def test_row_parallel_linear_under_autocast_returns_torchs_dtype(probe):
    for out in probe[1]:
        assert out["rowwise autocast"]["torch"] == torch.bfloat16
        assert out["rowwise autocast"]["labkit"] == out["rowwise autocast"]["torch"]


def test_checkpoints_refuse_what_their_format_cannot_hold_before_touching_a_file(probe):
    root, results = probe
    for out in results:
        kind, message = out["torch-fsdp save"]
        assert kind == "TypeError" and "TorchFSDP" in message and "torch.distributed.checkpoint" in message
        for case in ("hsdp save_sharded", "hsdp save_full", "hsdp load fsdp"):
            kind, message = out[case]
            assert kind == "NotImplementedError" and "HSDP" in message, (case, message)
            assert "'hsdp'" not in message.split("do not handle")[0]  # no longer listed as supported
        kind, message = out["subgroup save"]
        assert kind == "NotImplementedError" and "sharded over the whole world" in message
        kind, message = out["edited world_size"]
        assert kind == "CheckpointError", message
        assert "world_size 3" in message and "rank2.pt" in message and "edited" in message
    assert sorted(os.listdir(root)) == ["fsdp"], os.listdir(root)  # nothing of the refused saves


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


def _raise_unprintable():
    if dist.get_rank() == 1:
        raise _Unprintable()
    dist.barrier()  # rank 0 waits on rank 1, which never comes


def test_a_rank_whose_exception_cannot_be_printed_is_reported_at_once_with_its_stack():
    with pytest.raises(labkit.RankError) as info:
        labkit.run(_raise_unprintable, world_size=2, timeout=120)
    message = str(info.value)
    assert "_Unprintable" in message, message
    assert "str() of this _Unprintable raised RuntimeError: no str for you" in message, message
    assert "_raise_unprintable" in message, message  # the stack
    assert "did not finish" not in message, message
