"""Checks for fsdp_lab's last two exercises, the learner's whole FSDP on labkit.loop:
exercise 5, 5 AdamW steps equal single-process training (gradients of step 0, then weights) and
torch's fully_shard on the lab's preset, and the toy preset's hard cases; exercise 6,
reshard_after_forward=False (one all-gather per block per step, blocks stay gathered between
forward and backward) and prefetch with a limit on the all-gathers in flight.

What it leaves out: timing and overlap (noisy on 2 shared cores: the lab shows the timeline).
"""

import functools

from labkit import loop
from labkit.checks import compare
from labkit.labs.fsdp_checks import run_ranks

TOY = loop.PRESETS["toy"]
# Weights after AdamW steps: an element whose gradient is fp32 rounding noise (its value depends on
# the summation order, i.e. on the split) moves by up to lr * noise / eps ~ 1e-5 per step at lr 1e-2,
# eps 1e-6 (seen: 1.2e-5 after 5 steps on the lab's preset). The step-0 gradients, compared at
# rtol 1e-5 / atol 1e-7 first, are what catches a wrong algorithm.
ATOL = 1e-4
PREFETCH_CFG = loop.PRESETS["dp"].replace(gpt=dict(d_model=32, n_heads=4, n_layers=4), batch_size=8)


def _first_failure(reports):
    return next((r for r in reports if not r.ok), None)


def _raise(what, report, hint="", replace=False):
    problem = report.first_problem()
    if replace:  # the lab's hint knows the cause: compare's guess from the shapes alone goes
        problem = "\n".join(line for line in problem.splitlines() if not line.strip().startswith("hint:"))
    lines = [what, report.summary(), problem]
    if hint:
        lines.append(f"hint: {hint}")
    raise AssertionError("\n".join(lines))


def check_training(strategy_cls, cfg, steps=5, world_size=2):
    """Exercise 5: labkit.loop.train with the learner's class vs loop.reference and torch-fsdp.
    Returns [mine on cfg, torch-fsdp on cfg, mine on the toy] (labkit.run's per-rank lists)."""
    runs = run_ranks(
        "MyFSDP's training",
        loop.sweep,
        [
            dict(strategy=strategy_cls, cfg=cfg),
            dict(strategy="torch-fsdp", cfg=cfg),
            dict(strategy=strategy_cls, cfg=TOY),
        ],
        steps=steps,
        world_size=world_size,
        timeout=300,
    )
    ref, toy_ref = loop.reference(cfg, steps), loop.reference(TOY, steps)
    for preset, expected, index in (("the lab's preset", ref, 0), ("the toy preset", toy_ref, 2)):
        grads = [
            compare(
                expected["grads"],
                runs[r][index]["grads"] or {},
                rank=r,
                world_size=world_size,
                label=f"step-0 gradients, {preset}",
            )
            for r in range(world_size)
        ]
        bad = _first_failure(grads)
        if bad is not None:
            _raise(
                f"gradients of step 0 differ from single-process training ({preset})",
                bad,
                "full_grad_dict gathers each shard's .grad (gather_dim0); if that is right, see "
                "exercise 4's check"
                if bad.missing
                else "",
            )
        states = [
            compare(
                expected["state"],
                runs[r][index]["state"],
                rank=r,
                atol=ATOL,
                label=f"weights after {steps} steps, {preset}",
            )
            for r in range(world_size)
        ]
        bad = _first_failure(states)
        if bad is not None:
            initial = loop.build_model(TOY if index else cfg).state_dict()
            still = compare(initial, runs[bad.rank][index]["state"], rtol=0, atol=0).ok
            sharded = [
                e.name
                for e in bad.entries
                if len(e.shape)
                and e.got_shape != e.shape
                and e.got_shape == (-(-e.shape[0] // world_size), *e.shape[1:])
            ]
            _raise(
                f"weights after {steps} AdamW steps differ from single-process training ({preset})",
                bad,
                f"{', '.join(repr(n) for n in sharded[:3])}{' ...' if len(sharded) > 3 else ''} "
                f"came back with exactly its shard's shape (ceil(rows / {world_size}) rows): "
                f"full_state_dict returned the shards, never unsharded. Unshard every unit first, "
                f"copy the whole tensors, then reshard"
                if sharded
                else "no weight moved: the optimizer must be built AFTER sharding, over the shards"
                if still
                else "",
                replace=bool(sharded),
            )
    vs_torch = [
        compare(runs[r][1]["state"], runs[r][0]["state"], rank=r, atol=ATOL, label="weights vs fully_shard")
        for r in range(world_size)
    ]
    bad = _first_failure(vs_torch)
    if bad is not None:
        _raise("weights differ from torch's fully_shard on the same units", bad)
    return runs


def probe_class(strategy_cls):
    """The learner's class, instrumented: after each block's pre-forward hook, how many units'
    all-gathers are in flight; after the forward, which blocks are still gathered."""

    class Probe(strategy_cls):
        def __init__(self, model, cfg, **options):
            super().__init__(model, cfg, **options)
            self.inflight, self.after_forward = [], []
            gathered = lambda: [u.unsharded[0].untyped_storage().nbytes() > 0 for u in self.units]  # noqa: E731
            self.which = []  # per block's pre-forward: (its index, the units with a gather in flight)
            for i, block in enumerate(model.blocks):
                block.register_forward_pre_hook(functools.partial(self._seen, i))
            model.register_forward_hook(lambda m, a, o: self.after_forward.append(gathered()))

        def _seen(self, i, module, args):  # returns None: the block's inputs stay as they are
            self.inflight.append(sum(u.handle is not None for u in self.units))
            self.which.append((i, [k for k, u in enumerate(self.units) if u.handle is not None]))

    Probe.__name__ = Probe.__qualname__ = f"Probed{strategy_cls.__name__}"
    return Probe


def _report(s):
    return {"inflight": s.inflight, "after_forward": s.after_forward, "which": s.which}


PREFETCH_RUNS = [
    dict(reshard_after_forward=False, prefetch=0, max_inflight=2),
    dict(reshard_after_forward=True, prefetch=2, max_inflight=1),
    dict(reshard_after_forward=True, prefetch=2, max_inflight=2),
]


def gathers_per_step(trace):
    """ring all-gathers started inside each 'step' span of one rank's trace."""
    steps = [s for s in trace["spans"] if s["name"] == "step"]
    return [
        sum(1 for ev in trace["events"] if "all_gather" in ev["op"] and s["start"] <= ev["start"] <= s["end"])
        for s in steps
    ]


def check_prefetch(strategy_cls, steps=2, world_size=2):
    """Exercise 6 on a 4-block TinyGPT: the weights still equal single-process training; with
    reshard_after_forward=False 1 + L all-gathers per step and every block gathered after the
    forward; with prefetch d and at most k in flight, min(d, k, blocks left) gathers in flight
    after each block's pre-forward."""
    cfg, blocks = PREFETCH_CFG, PREFETCH_CFG.gpt["n_layers"]
    runs = run_ranks(
        "PrefetchingFSDP's training",
        loop.sweep,
        [dict(run, strategy=probe_class(strategy_cls)) for run in PREFETCH_RUNS],
        cfg=cfg,
        steps=steps,
        hooks=loop.Hooks(report=_report),
        world_size=world_size,
        timeout=300,
    )
    ref = loop.reference(cfg, steps)["state"]
    counts = gathers_per_step(runs.traces[0])
    for i, (run, result) in enumerate(zip(PREFETCH_RUNS, runs[0])):
        label = ", ".join(f"{k}={v}" for k, v in run.items())
        for block, units in result["which"]:  # units in flight must come after the computing block
            early = [k for k in units if k <= block]
            if early:
                raise AssertionError(
                    f"{label}: while block {block} computes, a gather is in flight for block(s) {early}\n"
                    f"hint: prefetch the units AFTER this one in `order`: i = order.index(unit), then "
                    f"order[i + 1 : i + 1 + prefetch]; order[:prefetch] starts from the first block again"
                )
        report = compare(ref, result["state"], rank=0, atol=ATOL, label=f"weights after {steps} steps")
        if not report.ok:
            _raise(
                f"{label}: the weights differ from single-process training",
                report,
                "a prefetched gather of the previous step's shards used after the step? wait for (or "
                "drop) every gather in flight before the optimizer changes the shards",
            )
        want = 1 + (2 if run["reshard_after_forward"] else 1) * blocks
        got = counts[i * steps : (i + 1) * steps]
        if any(c != want for c in got):
            raise AssertionError(
                f"{label}: {got} all-gathers per step, expected {want} (the root once, "
                f"each of {blocks} blocks {want // blocks}x)\nhint: "
                + (
                    "with reshard_after_forward=False the blocks stay gathered until "
                    "their backward: pre_backward must not gather again"
                    if not run["reshard_after_forward"]
                    else "a prefetched unit must not be gathered a second time when it computes"
                )
            )
        ends = result["after_forward"]
        if not run["reshard_after_forward"] and not all(all(g[:blocks]) for g in ends):
            raise AssertionError(
                f"{label}: blocks resharded after the forward: {ends[0][:blocks]}\n"
                "hint: reshard_after_forward=False keeps them until their backward"
            )
        expected = [min(run["prefetch"], run["max_inflight"], blocks - 1 - b) for b in range(blocks)] * steps
        if result["inflight"] != expected:
            raise AssertionError(
                f"{label}: all-gathers in flight after each block's pre-forward: "
                f"{result['inflight']}, expected {expected}\nhint: after unsharding block "
                f"i start the next {run['prefetch']} blocks' gathers, but never more than "
                f"{run['max_inflight']} in flight (count the units whose .handle is set)"
            )
    return runs


def best_wrap(measured, budget):
    """The wrap whose measured peak fits `budget` with the fewest collectives per step (None if
    none fits): the answer check_choose_wrap expects, from the same figures the learner has."""
    fits = [w for w, m in measured.items() if m["peak"] <= budget]
    return min(fits, key=lambda w: (measured[w]["collectives"], measured[w]["peak"])) if fits else None


def check_choose_wrap(choose, measured):
    """choose(measured, budget) for budgets at, between, above and below the measured peaks."""
    peaks = sorted(m["peak"] for m in measured.values())
    budgets = peaks + [(a + b) / 2 for a, b in zip(peaks, peaks[1:])] + [2 * peaks[-1], peaks[0] - 1]
    for budget in budgets:
        want, got = best_wrap(measured, budget), choose(measured, budget)
        if got == want:
            continue
        fits = sorted(w for w, m in measured.items() if m["peak"] <= budget)
        if want is None:
            hint = "no wrap fits this budget: return None"
        elif got not in fits:
            hint = f"{got!r} does not fit: its measured peak is {measured[got]['peak']:.0f} B"
        else:
            hint = "of the wraps that fit, take the one with the fewest collectives per step"
        raise AssertionError(
            f"budget {budget:.0f} B: expected {want!r}, got {got!r} (fitting: {fits})\nhint: {hint}"
        )
    return True


SEED = dict(weights_gb=12, grads_gb=12, optimizer_gb=72, world_size=8, largest_group_gb=3, prefetch_gb=3)


def _seed_hint(key, got, parts):
    """What a wrong seed answer left out or added, named without the number it should be."""
    w, g, o, n = parts["weights_gb"], parts["grads_gb"], parts["optimizer_gb"], parts["world_size"]
    steady = (w + g + o) / n
    extra = parts["largest_group_gb"] + parts["prefetch_gb"]
    near = lambda a, b: abs(a - b) <= 1e-6 * max(abs(b), 1)  # noqa: E731
    if key == "steady":
        if near(got, w + g + o):
            return "not divided by N: under FSDP every state (weights, gradients, optimizer) is sharded over the N ranks"
        if near(got, w / n + g + o) or near(got, (w + g) / n + o) or near(got, w / n + (g + o)):
            return "some states left whole: FSDP shards the weights, the gradients AND the optimizer state"
        return "every state is sharded: (weights + grads + optimizer) / N"
    if near(got, steady + parts["largest_group_gb"]) or near(got, steady + parts["prefetch_gb"]):
        return "one term left out: the peak adds both the largest unsharded unit and the prefetched one"
    if near(got, extra):
        return "the steady state left out: the peak is the steady state PLUS what is gathered"
    if near(got, (w + g + o) + extra):
        return "the steady state here is sharded: (weights + grads + optimizer) / N, then the gathered units"
    return "steady state + the largest unsharded group + the prefetch buffer"


def check_seed(answer):
    """The seed's exercise: answer() -> {"steady", "peak_lower_bound"} in GB per rank. A wrong
    value is named by what it left out, without printing the answer."""
    from labkit.checks import answer_numbers
    from labkit.labs.fsdp_lab import seed_exercise

    want = seed_exercise(**SEED)
    got = answer_numbers(answer(), list(want), "seed_answer()")
    for key in ("steady", "peak_lower_bound"):
        if not abs(got[key] - want[key]) <= 1e-6 * want[key]:
            side = "too large" if got[key] > want[key] else "too small"
            raise AssertionError(
                f"{key}: {got[key]:g} GB per rank is {side}\nhint: {_seed_hint(key, got[key], SEED)}"
            )
    return True
