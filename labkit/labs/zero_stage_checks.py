"""Checks for the ZeRO lab's strategies (exercises 2b and 3), run through labkit.loop.train on the
toy preset (frozen, tied, unused-on-even-steps parameters, odd sizes, 7 rows):

- check_zero1(cls): this rank's range of the step-0 gradient after the reduce-scatter (names the
  tensor, index, expected vs got; SUM-vs-AVG against the loop's convention), then the weights
  after 3 steps against single-process training (the lab compares with torch's
  ZeroRedundancyOptimizer on its own model, outside the graded cell: torch's DDP warns on stderr);
- check_zero2(cls): the gradient shard (per bucket), the weights, then what makes it ZeRO-2: the
  gradient bytes alive at the end of every backward (<= the shard plus two buckets), buckets
  launched during backward, in bucket order; then one backward of LateFirst, whose gradients
  arrive out of bucket order, so one arrival completes several buckets (`if` for `while`).
Left out: timing (the 2-core machine is too noisy), gradient accumulation (no_sync).
"""

import torch

from labkit import loop
from labkit.checks import compare
from labkit.strategies.zero import FlatPartition, backward_grad_bytes

CFG = loop.PRESETS["toy"]
STEPS = 3


def _names(model):
    return {id(p): n for n, p in model.named_parameters()}


def _capture_step0(strategy, steps_done):
    """after_step hook: after step 1, this rank's elements of every p.grad, by flat segment
    (what the reduce-scatter left there), and the strategy's grad_shard if it has one."""
    if steps_done != 1:
        return
    import torch.distributed as dist

    model = strategy.model
    part = FlatPartition(model.parameters(), dist.get_world_size())
    names = _names(model)
    pieces = {}
    for i, lo, hi in part.segments(dist.get_rank()):
        p, o = part.params[i], part.offsets[i]
        if p.grad is not None:
            pieces[f"{names[id(p)]}[{lo - o}:{hi - o}]"] = (
                p.grad.detach().reshape(-1)[lo - o : hi - o].clone()
            )
    shard = getattr(strategy, "grad_shard", None)
    strategy._lab_step0 = {"pieces": pieces, "grad_shard": None if shard is None else shard.detach().clone()}


def _report_step0(strategy):
    """report hook: what _capture_step0 kept, and the strategy's bucket layout (ZeRO-2's), with
    its parameters' names, so the check cuts the expected shard exactly as the run did."""
    out = dict(getattr(strategy, "_lab_step0", {}))
    out["unwaited"] = getattr(strategy, "_lab_unwaited", None)
    layout = getattr(strategy, "layout", None)
    if layout is not None and hasattr(layout, "shard_slice"):
        names = _names(strategy.model)
        out["layout"], out["layout_names"] = layout, [names[id(p)] for p in layout.params]
    return out


_STEP0_HOOKS = loop.Hooks(after_step=_capture_step0, report=_report_step0)


def _expected_pieces(ref_grads, model, world_size, rank):
    part, names = FlatPartition(model.parameters(), world_size), _names(model)
    out = {}
    for i, lo, hi in part.segments(rank):
        p, o = part.params[i], part.offsets[i]
        name = names[id(p)]
        if name in ref_grads:
            out[f"{name}[{lo - o}:{hi - o}]"] = ref_grads[name].reshape(-1)[lo - o : hi - o]
    return out


def _reduce_hint(report, world_size, declared, fallback=None):
    """SUM / AVG against the loop's convention, read from the first mismatch's ratio."""
    text = str(report)
    if f"{world_size}× too large" in text or "too large" in text:
        return (
            f"the gradient is {world_size}× too large: the loop divides each rank's loss by the GLOBAL "
            f"token count (reduce_op = 'sum'), or multiplies it by N when you declare 'avg' (you "
            f"declared {declared!r}): reduce with the op you declare"
        )
    if "too small" in text:
        return (
            f"the gradient is {world_size}× too small: you averaged (AVG) gradients the loop had "
            f"already divided by the global token count; with reduce_op = 'sum' reduce with SUM"
        )
    if "missing in got" in text:
        return "a parameter's gradient is missing (p.grad None) although it was used in this step"
    return fallback or (
        "the gradient in this rank's range is not the reduced one: reduce-scatter the "
        "whole flat gradient into this rank's chunk of it (flat_grad[chunk_slice(rank)])"
    )


def _raise_reduce(report, world_size, declared, fallback=None):
    """The report with the lab's hint in place of compare's generic guess (whose "divided twice?"
    for a 1/N gradient is wrong here: the loop divides once, the learner's AVG a second time)."""
    hint = _reduce_hint(report, world_size, declared, fallback)
    for entry in report.failures():
        entry.hint = ""
    raise AssertionError(f"{report}\nhint: {hint}")


def _state_hint(results, names):
    states = [r["state"] for r in results]
    if any(not compare(states[0], s, rtol=0, atol=0).ok for s in states[1:]):
        return "ranks hold different weights: the updated chunks were never all-gathered"
    if names and names[0].startswith("extra."):  # the worst tensor is the sometimes-unused one
        return (
            "extra.* has no gradient on even steps: a parameter without a gradient must reach "
            "the optimizer with grad None (set p.grad = None before the step), or weight decay moves it "
            "(and every weight after it differs too)"
        )
    return "the gradients were right: look at the optimizer step and the all-gather"


def _check_state(results, reference, label):
    for r, res in enumerate(results):
        report = compare(
            reference, res["state"], rtol=1e-5, atol=1e-6, rank=r, world_size=len(results), label=label
        )
        if not report.ok:
            bad = [e.name for e in sorted(report.failures(), key=lambda e: -e.max_diff)]
            raise AssertionError(f"{report}\nhint: {_state_hint(results, bad)}")


def check_zero1(cls, world_size=2):
    """cls through loop.train on `world_size` ranks: gradients in this rank's range, then the
    weights, against single-process training."""
    import labkit

    results = labkit.run(loop.train, cls, CFG, STEPS, hooks=_STEP0_HOOKS, world_size=world_size)
    ref = loop.reference(CFG, STEPS)
    model = loop.build_model(CFG)
    declared = getattr(cls, "reduce_op", "sum")
    for r, res in enumerate(results):
        expected = _expected_pieces(ref["grads"], model, world_size, r)
        got = {k: v for k, v in res.get("pieces", {}).items() if k in expected}  # unused: the state shows it
        report = compare(
            expected,
            got,
            rtol=1e-5,
            atol=1e-7,
            rank=r,
            world_size=world_size,
            label="step-0 gradient in this rank's range, after the reduce-scatter",
        )
        if not report.ok:
            _raise_reduce(report, world_size, declared)
    _check_state(results, ref["state"], f"weights after {STEPS} steps vs single-process")
    return results


# ---------------------------------------------------------------- ZeRO-2
def expected_grad_shard(ref_grads, layout, names, rank):
    """This rank's shard of the reduced step-0 gradient in `layout`'s bucket geometry (names:
    the state-dict name of each of layout.params)."""
    flat = torch.zeros(layout.numel)
    for name, view in zip(names, layout.views(flat)):
        if name in ref_grads:
            view.copy_(ref_grads[name])
    return {f"grad_shard, bucket {b}": flat[layout.rank_slice(b, rank)] for b in range(len(layout.buckets))}


def bucket_launches(trace, steps):
    """Per step: the sizes (bytes) of the reduce-scatters, in launch order, and how many were
    launched while that step's backward ran."""
    from labkit.observe.trace_stats import steps as step_windows

    backward = [(s["start"], s["end"]) for s in trace["spans"] if s["name"] == "backward"]
    out = []
    for lo, hi in step_windows(trace)[:steps]:
        events = sorted(
            (e for e in trace["events"] if "reduce_scatter" in e["op"] and lo <= e["start"] <= hi),
            key=lambda e: e["start"],
        )
        early = sum(any(a <= e["start"] <= b for a, b in backward) for e in events)
        out.append(([e["nbytes"] for e in events], early))
    return out


def _mark_waits():
    """In this rank: each labkit collective handle remembers that wait() was called on it."""
    from labkit.comm.collectives import CollectiveHandle

    if getattr(CollectiveHandle.wait, "lab_marks", False):
        return
    original = CollectiveHandle.wait

    def wait(self, timeout=None):
        self.lab_waited = True
        return original(self, timeout)

    wait.lab_marks = True
    CollectiveHandle.wait = wait


def _probed(cls):
    """cls, recording at each step() how many reduce-scatters in self.in_flight nobody waited
    for: the step reads grad_shard, so it must not start before they land (whether they have
    already landed is timing; whether anyone waited is not)."""

    class Probe(cls):
        def __init__(self, *args, **kwargs):
            _mark_waits()
            super().__init__(*args, **kwargs)

        def step(self):
            from labkit.comm.collectives import CollectiveHandle

            entries = getattr(self, "in_flight", None) or []
            handles = [e[0] if isinstance(e, (tuple, list)) and e else e for e in entries]
            unwaited = sum(
                isinstance(h, CollectiveHandle) and not getattr(h, "lab_waited", False) for h in handles
            )
            self._lab_unwaited = getattr(self, "_lab_unwaited", []) + [unwaited]
            super().step()

    Probe.__name__ = Probe.__qualname__ = cls.__name__
    return Probe


ZERO2_SHARD_HINT = (
    "this rank's chunk of a bucket is not the reduced one: reduce-scatter each bucket's "
    "flattened gradient (bucket.flatten) into self.grad_shard[layout.shard_slice(b)]"
)


def _order_hint(sizes, bucket_bytes):
    if sorted(sizes) == sorted(bucket_bytes):
        return (
            "the same buckets, launched out of order: launch bucket k only when it and every "
            "bucket before it are complete (bucket 0 holds the LAST parameters), the same order "
            "on every rank"
        )
    if len(sizes) < len(bucket_bytes) and all(sizes.count(b) <= bucket_bytes.count(b) for b in sizes):
        return (
            f"{len(bucket_bytes) - len(sizes)} bucket(s) never launched: a bucket launched as "
            f"soon as it is complete, out of order, moves self.launched past the earlier ones, "
            f"and after_backward skips them; launch strictly in order (while bucket "
            f"self.launched is complete)"
        )
    return "one reduce-scatter per bucket, of the whole (padded) bucket"


def _launch_problem(step, sizes, bucket_bytes):
    return (
        f"rank 0, step {step}: reduce-scatters of {sizes} B, expected the buckets {bucket_bytes} B "
        f"in this order\nhint: {_order_hint(sizes, bucket_bytes)}"
    )


class LateFirst(torch.nn.Module):
    """Two Linears registered in the opposite order of their use: `late` is registered first but
    applied last, so its gradients arrive first in backward while its parameters sit in the LAST
    buckets (buckets follow reverse registration order). On this model one gradient's arrival
    completes several buckets at once: the toy's gradients arrive in bucket order and cannot
    tell `if` from `while` in grad_ready."""

    def __init__(self, width=8):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.late = torch.nn.Linear(width, width)
        self.early = torch.nn.Linear(width, width)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / width**0.5)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def launched_during_backward(cls, bucket_cap_mb=0.0002):
    """Rank function: one backward of LateFirst under the learner's strategy (8x8 weights are
    256 B, over the 200-byte cap: four one-parameter buckets, completed 0, then 1, 2 and 3 at
    once). Returns which buckets still held their gradients when backward returned (those the
    hooks never launched), then drains them through after_backward."""
    import torch.distributed as dist

    from labkit import strategies

    model = LateFirst()
    strategy = strategies.build(cls, model, CFG, bucket_cap_mb=bucket_cap_mb)  # as loop.train
    strategy.zero_grad()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    model(x).square().sum().backward()
    buckets = strategy.layout.buckets
    pending = [b for b, bucket in enumerate(buckets) if any(p.grad is not None for p in bucket.params)]
    strategy.after_backward()
    return {"pending": pending, "buckets": len(buckets)}


def check_zero2(cls, world_size=2, bucket_cap_mb=0.0002):
    """cls(model, cfg, bucket_cap_mb=...) through loop.train with the memory tracker: gradient
    shard, weights, gradient bytes at the end of backward, bucket launches during backward and
    in order. Returns the ranks' results (memory records and traces: the lab draws them)."""
    import labkit

    results = labkit.run(
        loop.train,
        _probed(cls),
        CFG,
        STEPS,
        hooks=_STEP0_HOOKS,
        track_memory=True,
        bucket_cap_mb=bucket_cap_mb,
        world_size=world_size,
    )
    ref = loop.reference(CFG, STEPS)
    declared = getattr(cls, "reduce_op", "sum")
    if "layout" not in results[0]:
        raise AssertionError(
            "the strategy has no .layout (a zero.FlatLayout): keep the given "
            "self.layout = self.optimizer.layout"
        )
    layout, names = results[0]["layout"], results[0]["layout_names"]
    bucket_bytes = [4 * b.padded_numel for b in layout.buckets]
    launches = bucket_launches(results.traces[0], STEPS)
    for r, res in enumerate(results):
        expected = expected_grad_shard(ref["grads"], layout, names, r)
        shard = res.get("grad_shard")
        if shard is None or shard.numel() != layout.shard_numel:
            raise AssertionError(
                f"rank {r}: grad_shard after step 1 is "
                f"{'missing' if shard is None else f'{shard.numel()} elements'}, expected "
                f"{layout.shard_numel} (one chunk per bucket)"
            )
        got = {
            name: shard[layout.shard_offsets[b] : layout.shard_offsets[b] + layout.buckets[b].chunk]
            for b, name in enumerate(expected)
        }
        report = compare(
            expected,
            got,
            rtol=1e-5,
            atol=1e-7,
            rank=r,
            world_size=world_size,
            label="step-0 gradient shard after the bucket reduce-scatters",
        )
        if not report.ok:
            if launches[0][0] != bucket_bytes:  # a bucket skipped or sent twice says why
                raise AssertionError(
                    f"{report.summary()}\n{_launch_problem(0, launches[0][0], bucket_bytes)}"
                )
            _raise_reduce(report, world_size, declared, ZERO2_SHARD_HINT)
    for r, res in enumerate(results):
        unwaited = res.get("unwaited") or []
        if any(unwaited):
            step = next(i for i, u in enumerate(unwaited) if u)
            raise AssertionError(
                f"rank {r}, step {step}: the optimizer step began with {unwaited[step]} reduce-scatter(s) "
                f"in self.in_flight never waited for\nhint: after_backward must wait for every bucket "
                f"still in flight: the step reads self.grad_shard, which they are still writing"
            )
    _check_state(results, ref["state"], f"weights after {STEPS} steps vs single-process")
    bound = 4 * layout.shard_numel + 2 * max(bucket_bytes)
    # Steps where every parameter gets a gradient (the toy's extra.* only on odd ones): elsewhere
    # the bucket holding extra.* never completes in backward, so it and all after it wait for
    # after_backward (in-order launching), as they must.
    full = [s for s in range(STEPS) if s % CFG.extra_every == 1]
    for step, (sizes, early) in enumerate(launches):
        if step not in full and sizes == bucket_bytes:
            continue
        if sizes != bucket_bytes:
            raise AssertionError(_launch_problem(step, sizes, bucket_bytes))
        if early == 0 and len(bucket_bytes) > 1:
            raise AssertionError(
                f"rank 0, step {step}: no reduce-scatter started during backward\nhint: "
                f"launch each bucket from the post-accumulate-grad hook as soon as it is "
                f"complete, not in after_backward"
            )
    for r, res in enumerate(results):
        alive = backward_grad_bytes(res["memory"])
        if max(alive[s] for s in full) > bound:
            raise AssertionError(
                f"rank {r}: gradient bytes alive at the end of backward, per step: {alive}; expected at most "
                f"{bound} in step(s) {full}, where every parameter has a gradient "
                f"(the shard, {4 * layout.shard_numel} B, plus two buckets in flight; the full "
                f"gradient is {4 * layout.numel} B)\nhint: free each bucket's p.grad as soon as it is "
                f"copied into the send buffer, and drop a send buffer once its reduce-scatter has landed "
                f"(wait for the oldest when two are in flight)"
            )
    seen = labkit.run(launched_during_backward, cls, bucket_cap_mb, world_size=world_size)[0]
    if seen["pending"]:
        raise AssertionError(
            f"rank 0, a model whose gradients arrive out of bucket order ({LateFirst.__name__}: "
            f"its last layer is registered first; {seen['buckets']} buckets): bucket(s) "
            f"{seen['pending']} were complete when backward ended but never launched by the hook\n"
            f"hint: one gradient can complete several buckets at once (bucket k waits for its last "
            f"gradient while k+1, k+2 are already complete): grad_ready must launch in a loop, "
            f"`while` bucket self.launched is complete, not `if` (one launch per call)"
        )
    return results
