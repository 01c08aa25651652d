"""The pipeline schedules as pure data: each rank's ordered list of forward / backward actions,
and a replay of those orders that gives the timeline, the bubble and the live activations.

    orders = schedule.orders("1f1b", n_stages=4, n_microbatches=8)   # [[Action, ...] per rank]
    schedule.bubble_fraction(orders)                                   # 3 / 11: (p-1)/(m+p-1)
    schedule.bubble_fraction(orders, backward_slots=2)                 # the same: B = input + weights
    schedule.bubble_fraction(schedule.orders("zb-h1", 4, 8))           # F = B = W = 1 slot: 1 / 9

An Action is F(chunk, microbatch), B(chunk, microbatch) or W(chunk, microbatch). With p ranks
and v virtual stages per rank the model is cut into p*v chunks; rank r holds chunks r, r+p, r+2p,
... (Megatron's interleaved assignment), so chunk c's activation always goes to another rank
(p > 1), except under "zbv": rank r holds chunks r and 2p-1-r (a V: down the ranks and back up,
torch's ScheduleZBVZeroBubble), so chunk p-1 hands over to chunk p on the same rank and the last
chunk is on rank 0 (chunks_of / rank_of take the schedule).

The zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split the
backward: B(c, i) is the gradient w.r.t. the chunk's INPUT only (what chunk c-1 waits for: on the
critical path), W(c, i) the gradient w.r.t. its weights (nobody waits for it, so it can be
deferred into what would be a bubble). In an order with W actions, B means input gradients only;
without them (gpipe, 1f1b, interleaved) B does both at once.
What each action communicates follows from the chunk: F(c, i) receives chunk c-1's output for
micro-batch i (c > 0) and sends its own to chunk c+1 (c < last); B(c, i) receives the gradient of
its output from chunk c+1 (c < last) and sends the gradient of its input to chunk c-1 (c > 0).
The runtime posts every send asynchronously and waits for a receive only when its action runs, so
an order can deadlock only if its dependencies form a cycle; `timeline` replays the orders and
raises naming the stuck ranks if they do.

- "gpipe": every forward, then every backward (micro-batches in order): m live activations;
- "1f1b": p-1-r forwards of warm-up, then one forward one backward, then the cool-down
  backwards: at most p-r live on rank r;
- "interleaved": Megatron-LM's interleaved 1F1B over v chunks per rank (m a multiple of p):
  forwards walk the chunks in groups of p micro-batches, backwards walk them in reverse;
  warm-up 2(p-1-r) + (v-1)p forwards (all of them when m == p);
- "zb-h1": the paper's ZB-H1, 1F1B with B and W split: rank r runs W(k) right after B(k + r),
  i.e. defers r of its W's, which then fill the cool-down bubble (torch's
  ScheduleInterleavedZeroBubble with one stage per rank makes the same order). Every rank holds
  at most p micro-batches (an activation lives from its F to its W): 1F1B's peak (rank 0's); the
  ranks r > 0 hold up to p instead of 1F1B's p-r;
- "zbv": the paper's ZB-V, two chunks per rank in a V (virtual_stages=2), torch's
  ScheduleZBVZeroBubble's order (rank r: 2(p-r)-1 forwards of chunk r, r pairs of both chunks,
  p-r of chunk 2p-1-r each followed by its B and W, then F/B/W of both chunks in turn, the
  cool-down's W's last); with m < 2p-1 the micro-batches >= m are dropped, as torch does.

The replay gives every action one slot (forward, backward and weight alike; `backward_slots` is
the length of a B, `weight_slots` of a W) and no transfer time; the bubble is the idle share of
the p ranks' slots up to the last action, (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1)
interleaved, whatever backward_slots. To compare a classic schedule with a zero-bubble one on the
same footing, price the classic B (input and weight gradients) as two slots:
bubble_fraction(orders("1f1b", 4, 8), backward_slots=2) = 3/11 against zb-h1's 1/9 at
F = B = W = 1. What it leaves out: transfer time in the replay, unequal F / B / W times (the
paper's ZB-H2 and its automatic scheduler), the optimizer-step synchronisation the paper bypasses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
ZERO_BUBBLE = ("zb-h1", "zbv")  # the schedules whose backward is split into B (input) and W (weights)
V_SHAPED = ("zbv",)  # rank r holds chunks r and 2p-1-r, not r and r+p


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One slot of a rank's order: kind "F", "B" or "W" of model chunk `chunk` on micro-batch
    `microbatch` (forward; backward: input gradients, and weight gradients too when the order has
    no W; W: weight gradients)."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


def F(chunk: int, microbatch: int) -> Action:
    return Action("F", chunk, microbatch)


def B(chunk: int, microbatch: int) -> Action:
    return Action("B", chunk, microbatch)


def W(chunk: int, microbatch: int) -> Action:
    return Action("W", chunk, microbatch)


def check(schedule: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> None:
    """Raise, naming the problem, for a schedule these arguments cannot make."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {', '.join(map(repr, SCHEDULES))}")
    for name, value in (
        ("n_stages", n_stages),
        ("n_microbatches", n_microbatches),
        ("virtual_stages", virtual_stages),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if n_microbatches < n_stages:
        raise ValueError(
            f"n_microbatches={n_microbatches} < {n_stages} pipeline stages: some stage would never "
            f"have work while others run (use n_microbatches >= {n_stages})"
        )
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(
            f"schedule='zbv' runs exactly two chunks per rank (a V: chunks r and 2p-1-r), so "
            f"virtual_stages=2, got virtual_stages={virtual_stages}"
        )
    if schedule not in ("interleaved", "zbv") and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' (or 'zbv', with 2) "
            f"({schedule!r} runs one chunk per rank)"
        )
    if schedule == "interleaved" and n_microbatches % n_stages:
        raise ValueError(
            f"schedule='interleaved' needs n_microbatches to be a multiple of the {n_stages} "
            f"stages (Megatron's groups of p micro-batches), got {n_microbatches}"
        )


def chunks_of(rank: int, n_stages: int, virtual_stages: int = 1, schedule: str | None = None) -> list[int]:
    """The model chunks rank `rank` holds, in its local order: rank, rank + p, rank + 2p, ...;
    under "zbv" (V_SHAPED) rank and 2p-1-rank. schedule None: the first (a schedule function's
    chunks are placed so)."""
    if schedule in V_SHAPED:
        return [rank, 2 * n_stages - 1 - rank]
    return [rank + k * n_stages for k in range(virtual_stages)]


def rank_of(chunk: int, n_stages: int, schedule: str | None = None) -> int:
    """The rank that holds model chunk `chunk` (chunks_of's inverse): chunk mod p; under "zbv"
    chunk for the way down (chunk < p), 2p-1-chunk for the way back up."""
    if schedule in V_SHAPED:
        if not 0 <= chunk < 2 * n_stages:
            raise ValueError(
                f"schedule {schedule!r} on {n_stages} stages has chunks 0..{2 * n_stages - 1}, not {chunk}"
            )
        return chunk if chunk < n_stages else 2 * n_stages - 1 - chunk
    return chunk % n_stages


def order(
    schedule: str, rank: int, n_stages: int, n_microbatches: int, virtual_stages: int = 1
) -> list[Action]:
    """Rank `rank`'s actions, in the order it runs them."""
    check(schedule, n_stages, n_microbatches, virtual_stages)
    p, m, r = n_stages, n_microbatches, rank
    if not 0 <= r < p:
        raise ValueError(f"rank {r} is not one of the {p} stages")
    if schedule == "gpipe":
        return [F(r, i) for i in range(m)] + [B(r, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(p - 1 - r, m)
        out = [F(r, i) for i in range(warmup)]
        for k in range(m - warmup):
            out += [F(r, warmup + k), B(r, k)]
        return out + [B(r, i) for i in range(m - warmup, m)]
    if schedule == "zb-h1":
        return _zb_h1(r, p, m)
    if schedule == "zbv":
        return _zbv(r, p, m)
    return _interleaved(r, p, m, virtual_stages)


def _zb_h1(r: int, p: int, m: int) -> list[Action]:
    """ZB-H1 on rank r: 1F1B's warm-up (p-1-r forwards), then F, B per step as 1F1B and a W after
    each B from the (r+1)-th on; the r W's deferred so run after the last B, where 1F1B's rank r
    waits for the gradients coming back (torch's _get_1f1b_rank_ops with enable_zero_bubble and
    num_1f1b_microbatches = rank)."""
    warmup = min(p - 1 - r, m)
    out = [F(r, i) for i in range(warmup)]
    weights = 0
    for k in range(m):  # the k-th backward, with the forward that precedes it in the steady state
        if warmup + k < m:
            out.append(F(r, warmup + k))
        out.append(B(r, k))
        if k >= r:  # rank r's W runs r backwards behind: its deferred W's fill the cool-down
            out.append(W(r, weights))
            weights += 1
    return out + [W(r, i) for i in range(weights, m)]


def _zbv(r: int, p: int, m: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble._calculate_single_rank_operations for rank r, chunks
    r (down) and 2p-1-r (up); at least 2p-1 micro-batches are planned, the ones >= m dropped."""
    down, up = r, 2 * p - 1 - r
    n = max(2 * p - 1, m)
    count = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    out: list[Action] = []

    def put(kind: str, chunk: int, key: str) -> None:
        out.append(Action(kind, chunk, count[key]))
        if kind != "W":  # a W reuses its B's counter (its micro-batch), advanced by the B
            count[key] += 1

    for _ in range(2 * (p - r) - 1):
        put("F", down, "f0")
    for _ in range(r):
        put("F", up, "f1")
        put("F", down, "f0")
    for _ in range(p - r):
        put("F", up, "f1")
        put("B", up, "b1")
        out.append(W(up, count["b1"] - 1))
    while count["f1"] < count["f0"] or count["f0"] < n:
        if count["f0"] < n:
            put("F", down, "f0")
        put("B", down, "b0")
        out.append(W(down, count["b0"] - 1))
        put("F", up, "f1")
        put("B", up, "b1")
        out.append(W(up, count["b1"] - 1))
    w0, w1 = count["b0"], count["b1"]
    for _ in range(r):
        put("B", down, "b0")
        put("B", up, "b1")
    for _ in range(p - r):
        put("B", down, "b0")
        out.append(W(down, w0))
        w0 += 1
    out += [W(up, i) for i in range(w1, count["b1"])]
    out += [W(down, i) for i in range(w0, count["b0"])]
    return [a for a in out if a.microbatch < m]


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron-LM's forward_backward_pipelining_with_interleaving, as an order."""
    total = m * v

    def action(kind: str, k: int) -> Action:
        local = (k % (p * v)) // p  # which of this rank's chunks the k-th virtual micro-batch uses
        if kind == "B":
            local = v - 1 - local
        microbatch = (k // (p * v)) * p + k % p
        return Action(kind, r + local * p, microbatch)

    warmup = total if m == p else min(2 * (p - 1 - r) + (v - 1) * p, total)
    out = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [action("F", warmup + k), action("B", k)]
    return out + [action("B", k) for k in range(total - warmup, total)]


def orders(schedule: str, n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's order: [order(schedule, r, ...) for r in range(n_stages)]."""
    return [order(schedule, r, n_stages, n_microbatches, virtual_stages) for r in range(n_stages)]


def predicted_bubble(n_stages: int, n_microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1) / (v m + p-1): the idle share of the ranks' time (v = 1: GPipe and 1F1B)."""
    p, m, v = n_stages, n_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One action placed on the replayed timeline: it runs in [start, end)."""

    action: Action
    start: float
    end: float


def timeline(
    rank_orders: Sequence[Sequence[Action]], backward_slots: float = 1.0, weight_slots: float = 1.0
) -> list[list[Slot]]:
    """Replay the orders (each rank runs its actions in order; an action starts once its rank is
    free and its input exists: F(c, i) after F(c-1, i), B(c, i) after B(c+1, i) and F(c, i),
    W(c, i) after B(c, i)). Forward slots last 1, backward ones `backward_slots`, weight ones
    `weight_slots`. Raises if the orders deadlock or miss an action (every chunk of 0..C-1 forward
    and backward on every micro-batch exactly once, and a W for each when any order has a W)."""
    p = len(rank_orders)
    seen = [a for o in rank_orders for a in o]
    chunks = sorted({a.chunk for a in seen})
    mbs = sorted({a.microbatch for a in seen})
    kinds = "FBW" if any(a.kind == "W" for a in seen) else "FB"
    expected = {Action(k, c, i) for k in kinds for c in range(len(chunks)) for i in range(len(mbs))}
    if chunks != list(range(len(chunks))) or len(seen) != len(set(seen)) or set(seen) != expected:
        missing = sorted(expected - set(seen))[:4]
        twice = sorted({a for a in seen if seen.count(a) > 1})[:4]
        what = "forward, backward and weight gradients" if kinds == "FBW" else "forward and backward"
        raise ValueError(
            f"the orders do not run every chunk {what} once per micro-batch "
            f"(missing {missing}, repeated {twice})"
        )
    last = len(chunks) - 1
    length = {"F": 1.0, "B": backward_slots, "W": weight_slots}
    done: dict[Action, float] = {}
    free = [0.0] * p
    placed: list[list[Slot]] = [[] for _ in range(p)]
    nxt = [0] * p
    while any(nxt[r] < len(rank_orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while nxt[r] < len(rank_orders[r]):
                a = rank_orders[r][nxt[r]]
                deps = [F(a.chunk - 1, a.microbatch)] if a.kind == "F" and a.chunk > 0 else []
                if a.kind == "B":
                    deps.append(F(a.chunk, a.microbatch))
                    if a.chunk < last:
                        deps.append(B(a.chunk + 1, a.microbatch))
                if a.kind == "W":
                    deps.append(B(a.chunk, a.microbatch))
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + length[a.kind]
                done[a], free[r] = end, end
                placed[r].append(Slot(a, start, end))
                nxt[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: rank_orders[r][nxt[r]] for r in range(p) if nxt[r] < len(rank_orders[r])}
            raise ValueError(
                f"the orders deadlock: each rank waits for an input no rank can produce ({stuck})"
            )
    return placed


def bubble_fraction(
    rank_orders: Sequence[Sequence[Action]], backward_slots: float = 1.0, weight_slots: float = 1.0
) -> float:
    """The idle share of the p ranks' time up to the last action, from the replayed timeline
    (slot lengths as timeline's). Comparing a classic schedule (its B computes the input and the
    weight gradients) with a zero-bubble one at F = B = W = 1: backward_slots=2 for the classic."""
    slots = timeline(rank_orders, backward_slots, weight_slots)
    end = max(s.end for rank in slots for s in rank)
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1 - busy / (end * len(slots))


def live_peak(rank_order: Sequence[Action]) -> int:
    """The most (chunk, micro-batch) activations one rank holds at once: +1 at a forward, -1
    once its backward is done, or, in an order with W actions, once its W is (the weight
    gradients need the layers' saved inputs: they stay from F to W)."""
    release = "W" if any(a.kind == "W" for a in rank_order) else "B"
    live = peak = 0
    for a in rank_order:
        live += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak = max(peak, live)
    return peak
