"""Helpers for notebooks/dp_lab.ipynb: the ring picture, the DDP checks with the lab's hints, and
the world-size / bucket-size control that re-runs an experiment on real ranks.

What it leaves out: the picture shows the ring all-reduce of ONE tensor cut into n chunks (no
pipelining of chunks into smaller pieces, no tree algorithms); the hints look only at numbers.
"""

import contextlib

# matplotlib is imported inside the picture helpers: ranks import this module (check_ddp's and
# the experiments' rank functions) and draw nothing
import torch

from labkit.checks import compare
from labkit.strategies import Strategy
from labkit.observe.style import OP_COLORS, show_own, use_course_style


# ---------------------------------------------------------------- ring picture


def ring_schedule(n):
    """[(phase, [(src, dst, chunk), ...]), ...] for the 2(n-1) steps of a ring all-reduce.

    Reduce-scatter step k: rank r sends chunk (r-k-1) % n to r+1, which adds it to its own copy;
    after n-1 steps rank r holds chunk r summed over all ranks. All-gather step k: rank r sends
    chunk (r-k) % n (complete) to r+1, which overwrites its copy."""
    steps = [("reduce-scatter", [(r, (r + 1) % n, (r - k - 1) % n) for r in range(n)]) for k in range(n - 1)]
    steps += [("all-gather", [(r, (r + 1) % n, (r - k) % n) for r in range(n)]) for k in range(n - 1)]
    return steps


def ring_contents(n, upto):
    """contents[rank][chunk] = set of ranks whose data that copy holds, before step `upto`."""
    contents = [[{r} for _ in range(n)] for r in range(n)]
    for phase, transfers in ring_schedule(n)[:upto]:
        sent = [(dst, chunk, set(contents[src][chunk])) for src, dst, chunk in transfers]
        for dst, chunk, data in sent:  # all sends of a step happen at once
            contents[dst][chunk] = contents[dst][chunk] | data if phase == "reduce-scatter" else data
    return contents


def plot_ring_step(n, step, ax=None):
    """Grid of ranks x chunks before `step` (0 .. 2(n-1)): each cell says whose data it sums;
    outlined cells are sent to the next rank in this step."""
    import matplotlib.pyplot as plt  # not at the top: see the imports

    use_course_style()
    schedule = ring_schedule(n)
    own_figure = ax is None
    if own_figure:
        _, ax = plt.subplots(figsize=(1.3 * n + 2.5, 0.8 * n + 1.2))
    contents = ring_contents(n, step)
    moving = {(src, chunk) for src, _, chunk in schedule[step][1]} if step < len(schedule) else set()
    color = OP_COLORS["reduce_scatter" if step < n - 1 else "all_gather"]
    for rank in range(n):
        for chunk in range(n):
            have = contents[rank][chunk]
            full = len(have) == n
            ax.add_patch(
                plt.Rectangle(
                    (chunk, -rank),
                    0.95,
                    -0.9,
                    facecolor=color,
                    alpha=0.15 + 0.75 * len(have) / n,
                    edgecolor="black" if (rank, chunk) in moving else "none",
                    linewidth=3,
                )
            )
            label = "Σ" if full else "+".join(map(str, sorted(have)))
            ax.text(
                chunk + 0.47,
                -rank - 0.45,
                label,
                ha="center",
                va="center",
                fontsize=12,
                color="white" if full else "black",
            )
    ax.set_xlim(0, n)
    ax.set_ylim(-n, 0.1)
    ax.set_xticks([c + 0.47 for c in range(n)], [f"chunk {c}" for c in range(n)])
    ax.set_yticks([-r - 0.45 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0)
    ax.set_frame_on(False)
    if step < len(schedule):
        phase = schedule[step][0]
        k = step if phase == "reduce-scatter" else step - (n - 1)
        ax.set_title(f"{phase} step {k + 1}/{n - 1}: outlined chunks go to rank+1", fontsize=12)
    else:
        ax.set_title("done: every rank holds every chunk's sum (Σ)", fontsize=12)
    if own_figure:
        show_own(ax.figure)
    return ax


def ring_slider(n=4):
    """A slider through the steps of a ring all-reduce on n ranks (static small multiples under
    nbval / CI, where widgets are off)."""
    import matplotlib.pyplot as plt  # not at the top: see the imports
    from labkit.exercise import draw_into, widgets_enabled

    if not widgets_enabled():
        steps = 2 * (n - 1) + 1
        fig, axes = plt.subplots(1, steps, figsize=(3.1 * steps, 0.75 * n + 1.3))
        for step, ax in enumerate(axes):
            plot_ring_step(n, step, ax=ax)
            ax.set_title(ax.get_title().split(":")[0], fontsize=11)
        fig.tight_layout()
        plt.show()
        return None
    import ipywidgets as widgets

    slider = widgets.IntSlider(min=0, max=2 * (n - 1), value=0, description="step")
    out = widgets.Output()  # not interactive_output: it captures with `with out:` (draw_into says why)

    def show(_change=None):
        draw_into(out, plot_ring_step, n, slider.value)

    slider.observe(show, names="value")
    show()
    return widgets.VBox([slider, out])


# ---------------------------------------------------------------- checks with the lab's hints


def _first_difference(results, key):
    """(rank, tensor name, max |diff|) of the first rank whose `key` differs from rank 0's."""
    for rank, r in enumerate(results[1:], start=1):
        report = compare(results[0][key], r[key], rtol=0, atol=0)
        if not report.ok:
            bad = report.failures()
            return rank, (bad[0].name if bad else "(names differ)"), (bad[0].max_diff if bad else 0)
    return None


def _scale(reference, got):
    """got / reference as one factor when every tensor is that multiple (to 0.1%), else None."""
    pairs = [
        (reference[n].double(), got[n].double())
        for n in reference
        if n in got and got[n].shape == reference[n].shape and reference[n].abs().sum() > 0
    ]
    if not pairs:
        return None
    factor = (pairs[0][1].abs().sum() / pairs[0][0].abs().sum()).item()
    fits = all(torch.allclose(g, e * factor, rtol=1e-3, atol=1e-9) for e, g in pairs)
    return factor if fits else None


def _lab_hint(reference, results, key, world_size, tolerance, known=()):
    """A hint for the lab's classic mistakes; every claim in it is checked on the numbers.
    known: (what a mistake would give, its hint) pairs, tried once the ranks agree."""
    differ = _first_difference(results, key)
    if differ:
        rank, name, diff = differ
        text = (
            f"the ranks' {'gradients' if key == 'grads' else 'weights'} differ from each "
            f"other (rank 0 vs rank {rank}, '{name}', max |diff| {diff:.3g})"
        )
        if key == "state":
            return (
                text + ": did every rank start from rank 0's weights (broadcast)? Or did "
                "the ranks step with different gradients? The gradient check tells which."
            )
        added = {n: sum(r[key][n] for r in results) for n in results[0][key]}
        if compare(reference, added, rtol=max(1e-4, tolerance.get("rtol", 0)), atol=1e-6).ok:
            return (
                text + ", and they add up to the single-process gradient: each p.grad is "
                "still only its own rank's contribution. The all-reduce was skipped, or its "
                "result never reached p.grad (flat / bucketed: copy the buffer back)."
            )
        return text + ": some gradient was not all-reduced, or not copied back after it."
    agree = "the ranks agree with each other (checked) but not with single-process training"
    for wrong, hint in known:
        if compare(wrong, results[0][key], rtol=max(1e-4, tolerance.get("rtol", 0)), atol=1e-6).ok:
            return f"{agree}: {hint}"
    scale = _scale(reference, results[0][key]) if key == "grads" else None
    if scale and abs(scale * world_size - 1) < 1e-3:
        return (
            f"{agree}: every gradient is 1/{world_size} of it. labkit.loop.train already divides "
            f"each rank's summed loss by the GLOBAL token count, so the SUM all-reduce alone "
            f"is the full-batch gradient: dividing by world_size again (or op AVG) is once "
            f"too many."
        )
    if scale and abs(scale / world_size - 1) < 1e-3:
        return (
            f"{agree}: every gradient is {world_size}× it: a SUM of per-rank MEAN losses "
            f"(divide by the GLOBAL token count), or every rank trained on the whole batch "
            f"instead of its own shard?"
        )
    if key == "state":
        return (
            f"{agree}. AdamW hides a wrong gradient scale in the weights: run the "
            f"gradient check (step-0 gradients) first."
        )
    return (
        f"{agree}: did every rank start from rank 0's weights (without the broadcast the "
        f"ranks sum gradients of different models)? Does every row of the global batch land "
        f"on exactly one rank, and is each rank's loss summed over its tokens and divided by "
        f"the GLOBAL token count?"
    )


# Weights after several AdamW steps: AdamW divides each element's update by its own running
# gradient size, so the 1-ulp reordering noise of a rank's partial sums (the step-0 gradients
# hold compare()'s rtol 1e-5 / atol 1e-7) is amplified on near-zero gradient elements. Measured
# on 2 ranks, 5 steps of the dp preset: under 1e-7 on one 2-core CI machine, up to 1.25e-6 on an
# AVX-512 Xeon (2026-12, its fp32 GEMM sums in another order). A wrong reduction is caught by the
# gradients, which keep the tight tolerance; 1e-5 is still 1000x below one step's movement.
STATE_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def check_ddp(reference, results, key="state", label="", verbose_rank=0, known=(), **tolerance):
    """Compare each rank's `key` ('state' or 'grads') with the single-process reference.

    Passed: prints one line (ranks, tensors, the largest difference). Failed: prints nothing and
    raises one AssertionError that holds all of it (so a notebook shows it once): every rank's
    summary, rank `verbose_rank`'s table (exact / close / max|diff| per tensor) or the first
    mismatch with its expected and got values, compare()'s hint and the lab's hint. known: (what
    a named mistake would give, its hint) pairs, each checked on rank 0's numbers."""
    world_size = len(results)
    if key == "state":
        tolerance = {**STATE_TOLERANCE, **tolerance}
    reports = [
        compare(reference, r[key], rank=rank, world_size=world_size, label=label, **tolerance)
        for rank, r in enumerate(results)
    ]
    worst = max((e.max_diff for rep in reports for e in rep.entries), default=0.0)
    summaries = [rep.summary() for rep in reports]
    bad = [rep for rep in reports if not rep.ok]
    if bad:
        shown = reports[verbose_rank] if verbose_rank is not None else None
        detail = shown.details() if shown is not None and not shown.ok else bad[0].first_problem()
        hint = _lab_hint(reference, results, key, world_size, tolerance, known)
        raise AssertionError("\n".join(summaries + [detail, f"lab hint: {hint}"]))
    what = f"{label}: " if label else ""
    print(
        f"{what}ok on all {world_size} ranks, {len(reports[0].entries)} tensor(s) each, "
        f"max |diff| {worst:.3g}"
    )
    return reports


# ---------------------------------------------------------------- gradient accumulation (section 6)

ACCUMULATE_STEPS = 5


def train_accumulated(step_fn, steps=ACCUMULATE_STEPS, k=2, cfg=None):
    """A learner's accumulated step on the lab's data: the loop's model (seed = rank: the broadcast
    fixes it), batches and AdamW; returns what loop.train returns for the check (step-0 grads, the
    final state) and the bucket count."""
    import torch.distributed as dist

    from labkit import loop
    from labkit.data import shard_batch
    from labkit.strategies import ddp

    cfg = cfg or loop.PRESETS["dp"]  # 7 rows: 4 and 3 on 2 ranks, micro-batches of 2, 2 and 2, 1
    rank, n = dist.get_rank(), dist.get_world_size()
    model = loop.build_model(cfg.replace(seed=rank))
    strategy = ddp.DDPBucketed(model, bucket_cap_mb=0.02)
    optimizer = cfg.make_optimizer(model.parameters())
    grads = None
    for step in range(steps):
        x, y = loop.global_batch(cfg, step)
        step_fn(strategy, model, optimizer, *shard_batch(x, y, rank, n), k, y.numel())
        grads = grads or {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"grads": grads, "state": model.state_dict(), "buckets": len(strategy.buckets)}


def last_micro_batch_grads(cfg, world_size, k):
    """Step-0 gradients when every rank keeps only its LAST micro-batch's (zero_grad inside the
    micro-batch loop wipes the earlier ones), summed over ranks, / the global token count."""
    from labkit import loop, strategies
    from labkit.data import micro_batches, shard_batch

    model = loop.build_model(cfg)  # rank 0's weights, which the broadcast gives every rank
    x, y = loop.global_batch(cfg, 0)
    lasts = [micro_batches(*shard_batch(x, y, r, world_size), k)[-1] for r in range(world_size)]
    xs, ys = torch.cat([a for a, _ in lasts]), torch.cat([b for _, b in lasts])
    (model(xs, ys, reduction="sum")[1] / y.numel()).backward()
    return strategies.replica_grads(model)


def accumulation_check(step_fn, world_size=2, k=2):
    """dp_lab's Exercise 5 check: step-0 gradients and the weights after ACCUMULATE_STEPS steps
    against single-process training on the whole batch, then one all-reduce per bucket per step."""
    import labkit
    from labkit import loop
    from labkit.checks import assert_match
    from labkit.observe import trace_stats

    cfg = loop.PRESETS["dp"]
    reference = loop.reference(cfg, ACCUMULATE_STEPS)
    results = labkit.run(train_accumulated, step_fn, ACCUMULATE_STEPS, k, world_size=world_size)
    wiped = (
        last_micro_batch_grads(cfg, world_size, k),
        "they are exactly what the LAST micro-batch alone gives (checked). The earlier "
        "micro-batches' gradients were wiped: zero_grad() inside the micro-batch loop clears "
        "them; call it once per step, before the first micro-batch.",
    )
    check_ddp(
        reference["grads"], results, "grads", label="step-0 gradients", verbose_rank=None, known=[wiped]
    )
    check_ddp(reference["state"], results, "state", label="weights", verbose_rank=None, rtol=1e-5, atol=1e-5)
    count = trace_stats.collective_counts(results.traces[0])["all_reduce"][0]
    assert_match(
        "all-reduces per step (= buckets, not K × buckets)",
        results[0]["buckets"],
        count / ACCUMULATE_STEPS,
        unit="",
    )
    return results


# ---------------------------------------------------------------- re-run control


def experiment_controls(run, draw, world_sizes=(2, 4), bucket_mbs=(0.005, 0.02, 0.1, 1.0), default=(2, 0.02)):
    """Dropdowns for world size and bucket size and a Run button: run(world_size, bucket_mb)
    launches real ranks (a progress bar shows while they run), then draw(results) redraws.
    Without widgets (nbval / CI) it runs once with `default` and draws statically."""
    import matplotlib.pyplot as plt  # not at the top: see the imports
    from labkit.exercise import draw_into, widgets_enabled

    if not widgets_enabled():
        draw(run(*default))
        plt.show()
        return None
    import ipywidgets as widgets

    size = widgets.Dropdown(options=list(world_sizes), value=default[0], description="ranks")
    bucket = widgets.Dropdown(options=list(bucket_mbs), value=default[1], description="bucket MiB")
    button = widgets.Button(description="run on real ranks", button_style="primary")
    progress = widgets.IntProgress(min=0, max=2, value=0, description="idle")
    out = widgets.Output()

    def on_click(_=None):
        button.disabled, progress.value, progress.description = True, 1, "ranks running"
        try:
            results = run(size.value, bucket.value)
            progress.value, progress.description = 2, "drawing"
            draw_into(out, draw, results)
        finally:
            button.disabled, progress.value, progress.description = False, 0, "idle"

    button.on_click(on_click)
    on_click()
    return widgets.VBox([widgets.HBox([size, bucket, button, progress]), out])


# ---------------------------------------------------------------- a learner's DDP on loop.train


class LabDDP(Strategy):
    """A class written in the lab (`MyDDPNaive(model, **options)` with sync_gradients(), and
    no_sync() for accumulation) as a labkit.strategies strategy, for loop.train:

        labkit.run(loop.train, LabDDP, cfg, 5, ddp=MyDDPNaive, world_size=2)

    Each rank first re-initialises its replica with seed cfg.seed + rank, as separate processes
    would, so a class that forgets the start-up broadcast fails the check; the optimizer is the
    preset's, over the replica's trainable parameters."""

    @classmethod
    def from_preset(cls, model, cfg, ddp, **options):
        from labkit.drills import reinit_per_rank

        reinit_per_rank(model, cfg)
        self = cls()
        self.model, self.ddp = model, ddp(model, **options)
        self.reduce_op = getattr(self.ddp, "reduce_op", "sum")  # a learner's class may not say
        self.optimizer = cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
        self._initial, self._steps, self._carried = _container_sizes(self.ddp), 0, []
        return self

    def scale_loss(self, loss):
        """The loss, whose backward names state carried over from the previous step when the
        learner's hooks raise (issue 30: `self.ready` never cleared gave a bare AttributeError)."""
        return _NamedBackward(loss, self)

    def no_sync(self):
        return getattr(self.ddp, "no_sync", contextlib.nullcontext)()

    def after_backward(self):
        self.ddp.sync_gradients()

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        if self._steps:  # a step began: what differs from right after __init__ was carried over
            now = _container_sizes(self.ddp)
            self._carried = [name for name, size in now.items() if size != self._initial.get(name)]
        self._steps += 1
        self.optimizer.zero_grad(set_to_none=True)


def _container_sizes(obj):
    """{attribute: its nested container sizes} for obj's list / tuple / set / dict attributes
    (tensors count as leaves): what a step may fill and must empty again."""

    def size(v):
        if isinstance(v, (list, tuple)):
            return tuple(size(x) for x in v)
        if isinstance(v, (set, frozenset, dict)):
            return len(v)
        return None

    return {k: size(v) for k, v in vars(obj).items() if isinstance(v, (list, tuple, set, frozenset, dict))}


class _NamedBackward:
    def __init__(self, loss, lab):
        self.loss, self.lab = loss, lab

    def backward(self, *args, **kwargs):
        try:
            return self.loss.backward(*args, **kwargs)
        except Exception as exc:
            carried = self.lab._carried
            if not carried:
                raise
            names = ", ".join(f"self.{n}" for n in carried)
            raise AssertionError(
                f"step {self.lab._steps - 1}'s backward raised {type(exc).__name__}: {exc}\n"
                f"hint: state carried over from the previous step: {names} did not hold at the "
                f"start of step {self.lab._steps - 1} what it held after __init__ (e.g. the ready "
                f"sets still full, so a bucket launches before its gradients exist). Reset it at "
                f"the end of sync_gradients, after the last wait"
            ) from exc


def bucket_count(strategy):
    """loop.train's report=: {"buckets": how many buckets the strategy (or the class it wraps) cut}."""
    inner = getattr(strategy, "ddp", strategy)
    return {"buckets": len(getattr(inner, "buckets", [])) or None}
