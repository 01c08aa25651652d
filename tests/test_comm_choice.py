"""The comm= option every hand-written strategy takes (labkit.strategies.comm_choice): "ring"
(labkit's collectives) or "torch" (torch.distributed's) train the toy exactly like one process,
and each strategy's default is what it ran before (DDP torch's, ZeRO and FSDP labkit's)."""

import pytest
import torch

import labkit
from labkit import loop, strategies
from labkit.checks import compare

F64 = dict(rtol=1e-9, atol=1e-12)  # float64: only the summation order differs
CFG = loop.PRESETS["toy"].replace(dtype=torch.float64)


@pytest.mark.parametrize("name", [n for n in strategies.HAND_WRITTEN])
def test_unknown_comm_raises_naming_the_choices(name):
    with pytest.raises(ValueError, match="comm must be one of 'ring', 'torch', got 'nccl'"):
        strategies.build(name, torch.nn.Linear(2, 2), CFG, comm="nccl")


def test_what_comm_cannot_be_combined_with_raises():
    with pytest.raises(TypeError, match="pass comm= or all_reduce=, not both"):
        strategies.build("ddp-naive", torch.nn.Linear(2, 2), CFG, comm="ring", all_reduce=print)
    with pytest.raises(ValueError, match="verify= is labkit's cross-rank check; comm='torch' has none"):
        strategies.build("zero1", torch.nn.Linear(2, 2), CFG, comm="torch", verify=True)


def _runs(runs, cfg=CFG):
    """Rank function: loop.train per (strategy, options), and the names of the collectives the
    tracer saw during it (labkit's: ring_* / all_gather_coalesced; torch's: dist.*'s names)."""
    import warnings

    from labkit.observe import tracing

    out = []
    for name, options in runs:
        before = len(tracing._recorder.events)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = loop.train(name, cfg, 3, accum_steps=2, **options)
        events = tracing._recorder.events[before:]
        ops = {e["op"] for e in events if e.get("kind") == "collective"}
        # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor: comm="torch" must
        # call their new names there (a FutureWarning from every rank of every launch otherwise)
        renamed = [
            str(w.message)
            for w in caught
            if "is deprecated" in str(w.message) and "_tensor" in str(w.message)
        ]
        out.append({**result, "ops": ops, "renamed": renamed})
    return out


def _labkit_ops(ops):
    return {op for op in ops if op.startswith("ring_") or op == "all_gather_coalesced"}


def _check(runs, results, reference):
    for rank, outs in enumerate(results):
        for (name, options), out in zip(runs, outs):
            label = f"{name} {options}"
            for what in ("state", "grads"):
                compare(
                    reference[what], out[what], **F64, rank=rank, label=f"{label} {what}"
                ).raise_if_failed()
            comm = options.get("comm", "torch" if name.startswith("ddp") else "ring")
            ours = _labkit_ops(out["ops"])
            # torch's: no hand-written collective at all; labkit's: the gradients' reduction is one
            assert (not ours) if comm == "torch" else bool(ours), (label, sorted(out["ops"]))
            assert out["renamed"] == [], (label, out["renamed"])


RUNS = [
    ("ddp-bucketed", dict(bucket_cap_mb=0.0001)),
    ("ddp-bucketed", dict(bucket_cap_mb=0.0001, comm="ring")),
    ("ddp-flat", dict(comm="torch")),
    ("zero2", dict(comm="torch")),
    ("fsdp", dict(comm="torch")),
    ("fsdp", dict(comm="torch", reduce_op="avg")),
    ("fsdp-flat", dict(comm="torch")),
]


def test_every_family_trains_on_both_choices():
    _check(RUNS, labkit.run(_runs, RUNS, world_size=2, timeout=300), loop.reference(CFG, 3))


HSDP_RUNS = [("hsdp", dict(comm="torch")), ("hsdp", dict(comm="torch", reduce_op="avg")), ("hsdp", {})]


def test_hsdp_on_torch_collectives():
    """Two levels on torch's collectives (the across-nodes all-reduce waits for the in-node
    reduce-scatter: torch runs each group's ops on its own threads) and on labkit's."""
    cfg = CFG.replace(batch_size=8)  # 4 ranks x 2 micro-batches
    results = labkit.run(_runs, HSDP_RUNS, cfg, world_size=4, nodes=2, timeout=300)
    _check(HSDP_RUNS, results, loop.reference(cfg, 3))


GPT = loop.PRESETS["dp"].replace(dtype=torch.float64)  # TP splits TinyGPT's heads and MLP


@pytest.mark.parametrize(
    "runs, world_size",
    [
        ([("tp", dict(comm="torch")), ("tp", {})], 2),
        ([("fsdp-tp", dict(comm="torch")), ("tp", dict(tp=2, comm="torch"))], 4),
    ],
    ids=["tp", "fsdp-tp"],
)
def test_tensor_parallel_on_both_choices(runs, world_size):
    # comm= reaches the conjugate ops' all-reduces (and, for "tp" with dp > 1, the dp reduction):
    # with "torch" no hand-written collective runs at all.
    _check(runs, labkit.run(_runs, runs, GPT, world_size=world_size, timeout=300), loop.reference(GPT, 3))
