"""The pipeline schedules as pure data: each rank's ordered list of forward / backward actions,
and a replay of those orders that gives the timeline, the bubble and the live activations.

    orders = schedule.orders("1f1b", n_stages=4, n_microbatches=8)   # [[Action, ...] per rank]
    schedule.bubble_fraction(orders)                                   # 3 / 11: (p-1)/(m+p-1)

An Action is F(chunk, microbatch) or B(chunk, microbatch). With p ranks and v virtual stages per
rank the model is cut into p*v chunks; rank r holds chunks r, r+p, r+2p, ... (Megatron's
interleaved assignment), so chunk c's activation always goes to another rank (p > 1).
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
  warm-up 2(p-1-r) + (v-1)p forwards (all of them when m == p).

The replay gives every action one slot (forward and backward alike, `backward_slots` to change
that) and no transfer time; the bubble is the idle share of the p ranks' slots up to the last
action, (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) interleaved. What it leaves out: zero-
bubble schedules (split backward into input and weight gradients), transfer time in the replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One slot of a rank's order: kind "F" or "B" of model chunk `chunk` on micro-batch `microbatch`."""

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


def F(chunk: int, microbatch: int) -> Action:
    return Action("F", chunk, microbatch)


def B(chunk: int, microbatch: int) -> Action:
    return Action("B", chunk, microbatch)


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
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} needs schedule='interleaved' ({schedule!r} runs one "
            f"chunk per rank)"
        )
    if schedule == "interleaved" and n_microbatches % n_stages:
        raise ValueError(
            f"schedule='interleaved' needs n_microbatches to be a multiple of the {n_stages} "
            f"stages (Megatron's groups of p micro-batches), got {n_microbatches}"
        )


def chunks_of(rank: int, n_stages: int, virtual_stages: int = 1) -> list[int]:
    """The model chunks rank `rank` holds: rank, rank + p, rank + 2p, ..."""
    return [rank + k * n_stages for k in range(virtual_stages)]


def rank_of(chunk: int, n_stages: int) -> int:
    """The rank that holds model chunk `chunk`."""
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
    return _interleaved(r, p, m, virtual_stages)


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


def timeline(rank_orders: Sequence[Sequence[Action]], backward_slots: float = 1.0) -> list[list[Slot]]:
    """Replay the orders (each rank runs its actions in order; an action starts once its rank is
    free and its input exists: F(c, i) after F(c-1, i), B(c, i) after B(c+1, i) and F(c, i)).
    Forward slots last 1, backward ones `backward_slots`. Raises if the orders deadlock or miss an
    action (every chunk of 0..C-1 forward and backward on every micro-batch, exactly once)."""
    p = len(rank_orders)
    seen = [a for o in rank_orders for a in o]
    chunks = sorted({a.chunk for a in seen})
    mbs = sorted({a.microbatch for a in seen})
    expected = {Action(k, c, i) for k in "FB" for c in range(len(chunks)) for i in range(len(mbs))}
    if chunks != list(range(len(chunks))) or len(seen) != len(set(seen)) or set(seen) != expected:
        missing = sorted(expected - set(seen))[:4]
        twice = sorted({a for a in seen if seen.count(a) > 1})[:4]
        raise ValueError(
            f"the orders do not run every chunk forward and backward once per micro-batch "
            f"(missing {missing}, repeated {twice})"
        )
    last = len(chunks) - 1
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
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + (1.0 if a.kind == "F" else backward_slots)
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


def bubble_fraction(rank_orders: Sequence[Sequence[Action]], backward_slots: float = 1.0) -> float:
    """The idle share of the p ranks' time up to the last action, from the replayed timeline."""
    slots = timeline(rank_orders, backward_slots)
    end = max(s.end for rank in slots for s in rank)
    busy = sum(s.end - s.start for rank in slots for s in rank)
    return 1 - busy / (end * len(slots))


def live_peak(rank_order: Sequence[Action]) -> int:
    """The most (chunk, micro-batch) activations one rank holds at once: +1 at a forward, -1
    once its backward is done."""
    live = peak = 0
    for a in rank_order:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
