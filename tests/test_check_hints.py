"""Each lab check, fed the typical wrong answers a learner writes, says what is wrong: which half,
expected vs got, and a hint that is true for that mistake. One launch per check feeds it all of
its wrong answers (the rank functions return outputs; the diagnosis runs here)."""

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.comm.collectives import ring_all_gather, ring_reduce_scatter, shard_range
from labkit.labs import collective_checks as cc
from labkit.strategies import ddp
from labkit import loop
from labkit import drills
from labkit.labs.ddp_lab import LabDDP, check_ddp


# ---------------------------------------------------------------- DDP (dp_lab exercises 2-3)


class DividedTwice(ddp.DDPNaive):
    def sync_gradients(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()  # the loss is already / the GLOBAL token count


class FlatWithoutCopyBack(ddp.DDPFlat):
    def sync_gradients(self):
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat)
        dist.all_reduce(self.flat)  # ... and p.grad never sees the result


DP = loop.PRESETS["dp"].replace(batch_size=8)  # dp_lab's runs


def _ddp_mistakes():
    """Rank function: one step of each, as dp_lab runs a learner's class (ddp_lab.LabDDP)."""

    def lab(cls, **options):
        return loop.train(LabDDP, DP, 1, ddp=cls, spans=False, **options)

    return {
        "right": lab(ddp.DDPNaive),
        "divided twice": lab(DividedTwice),
        "no copy back": lab(FlatWithoutCopyBack),
        "whole batch": lab(ddp.DDPNaive, hooks=loop.Hooks(shard=drills.whole_batch_on_every_rank)),
        "no broadcast": loop.train(drills.NoBroadcast, DP, 1, spans=False),
    }


@pytest.fixture(scope="module")
def ddp_runs():
    runs = labkit.run(_ddp_mistakes, world_size=2, timeout=300)
    reference = loop.reference(DP, 1)
    return {name: [r[name] for r in runs] for name in runs[0]}, reference["grads"], reference["state"]


def _ddp_message(ddp_runs, name, key="grads", capsys=None):
    runs, grads, state = ddp_runs
    with pytest.raises(AssertionError) as err:
        check_ddp(grads if key == "grads" else state, runs[name], key, label="step-0 gradients")
    if capsys is not None:
        assert capsys.readouterr().out == ""  # everything is in the one exception
    return str(err.value)


def test_ddp_right_answer_passes(ddp_runs, capsys):
    runs, grads, state = ddp_runs
    check_ddp(grads, runs["right"], "grads", label="step-0 gradients")
    check_ddp(state, runs["right"], "state")
    out = capsys.readouterr().out.splitlines()  # one line per passing check, no table
    assert len(out) == 2 and out[0].startswith("step-0 gradients: ok on all 2 ranks, "), out
    assert out[1].startswith("ok on all 2 ranks, ") and "max |diff|" in out[1], out


def test_ddp_divided_twice_keeps_compares_hint(ddp_runs, capsys):
    text = _ddp_message(ddp_runs, "divided twice", capsys=capsys)
    assert "2× too small: divided twice" in text and "every gradient is 1/2" in text
    assert text.count("first mismatch") == 1 and "of shape (61, 32)" in text
    assert "exactly one rank" not in text  # the old generic hint


def test_ddp_missing_copy_back_says_ranks_differ(ddp_runs):
    text = _ddp_message(ddp_runs, "no copy back")
    assert "agree with each other" not in text
    assert "differ from each other" in text and "add up to the single-process gradient" in text
    assert "copy the buffer back" in text
    state_text = _ddp_message(ddp_runs, "no copy back", key="state")
    assert "weights differ from each other" in state_text and "gradient check" in state_text


def test_ddp_whole_batch_and_no_broadcast(ddp_runs):
    text = _ddp_message(ddp_runs, "whole batch")
    assert "2× too large" in text and "whole batch" in text and "agree with each other" in text
    text = _ddp_message(ddp_runs, "no broadcast")
    assert "agree with each other (checked)" in text and "broadcast" in text
    assert "weights differ from each other" in _ddp_message(ddp_runs, "no broadcast", key="state")


# ---------------------------------------------------------------- ring (dp_lab exercise 1)


def rs_right(x):
    out = torch.empty(x.numel() // dist.get_world_size())
    ring_reduce_scatter(out, x)
    return out


def ag_right(shard):
    out = torch.empty(shard.numel() * dist.get_world_size())
    ring_all_gather(out, shard)
    return out


def rs_own_chunk_unsummed(x):
    return x.chunk(dist.get_world_size())[dist.get_rank()].clone()


def rs_next_chunk(x):
    full = x.clone()
    dist.all_reduce(full)
    return full.chunk(dist.get_world_size())[(dist.get_rank() + 1) % dist.get_world_size()]


def rs_last_index_off_by_one(x):  # the lab's loop, but it returns the chunk after its own
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks, incoming = [c.clone() for c in x.chunk(n)], torch.empty(x.numel() // n)
    for k in range(n - 1):
        request = dist.isend(chunks[(rank - k - 1) % n], dst=(rank + 1) % n)
        dist.recv(incoming, src=(rank - 1) % n)
        chunks[(rank - k - 2) % n] += incoming
        request.wait()
    return chunks[(rank + 1) % n]


def ag_reversed(shard):
    return torch.cat(ag_right(shard).chunk(dist.get_world_size())[::-1])


def not_written(_):
    raise NotImplementedError


RING_CASES = {
    "right": (rs_right, ag_right),
    "avg": (lambda x: rs_right(x) / 2, ag_right),
    "unsummed": (rs_own_chunk_unsummed, ag_right),
    "next chunk": (rs_next_chunk, ag_right),
    "whole": (lambda x: ag_right(rs_right(x)), ag_right),
    "ag own shard": (rs_right, lambda s: s),
    "ag reversed": (rs_right, ag_reversed),
    "ag not written": (rs_right, not_written),
}


def _ring_cases(cases):
    return {name: cc.ring_outputs(*fns) for name, fns in cases.items()}


def test_ring_names_the_wrong_half_on_two_ranks():
    runs = labkit.run(_ring_cases, RING_CASES, world_size=2, timeout=120)
    problems = {name: cc.diagnose_ring([r[name] for r in runs]) for name in RING_CASES}
    assert problems["right"] == []
    for name in ("avg", "unsummed", "next chunk", "whole"):  # reduce-scatter wrong, all-gather right
        assert [p.split(" on ")[0] for p in problems[name]] == ["reduce-scatter", "all-reduce"]
        assert "follows from the half above" in problems[name][1]
    assert "divided by n = 2: this collective SUMs" in problems["avg"][0]
    assert "divided twice" not in problems["avg"][0]  # compare's guess is replaced, not added
    assert "own chunk, unsummed" in problems["unsummed"][0]
    assert "got chunk 1 of the sum; rank 0 must end with chunk 0" in problems["next chunk"][0]
    assert "expected (6,)" in problems["whole"][0] and "got      (12,)" in problems["whole"][0]
    assert "returned a whole tensor" in problems["whole"][0]
    for name in ("ag own shard", "ag reversed"):  # all-gather wrong, reduce-scatter right
        assert [p.split(" on ")[0] for p in problems[name]] == ["all-gather", "all-reduce"]
    assert (
        "expected (10,)" in problems["ag own shard"][0] and "one rank's shard" in problems["ag own shard"][0]
    )
    assert "position 0 holds rank 1's shard" in problems["ag reversed"][0]
    assert "not implemented yet (ranks 0, 1)" in problems["ag not written"][0]


def test_ring_partial_sum_on_four_ranks():
    cases = {"right": RING_CASES["right"], "off by one": (rs_last_index_off_by_one, ag_right)}
    runs = labkit.run(_ring_cases, cases, world_size=4, timeout=120)
    assert cc.diagnose_ring([r["right"] for r in runs]) == []
    text = cc.diagnose_ring([r["off by one"] for r in runs])[0]
    assert text.startswith("reduce-scatter on 4 ranks: FAILED on ranks 0, 1, 2, 3")
    assert "got chunk 1 summed over ranks [0, 2, 3] only" in text  # cf. ddp_lab.ring_contents
    assert "the complete chunk on rank 0 is chunk 0" in text


def rs_receives_from_next(x):  # the lab's loop, receiving from rank+1: the same rank on 2 ranks
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks, incoming = [c.clone() for c in x.chunk(n)], torch.empty(x.numel() // n)
    for k in range(n - 1):
        request = dist.isend(chunks[(rank - k - 1) % n], dst=(rank + 1) % n)
        dist.recv(incoming, src=(rank + 1) % n)
        chunks[(rank - k - 2) % n] += incoming
        request.wait()
    return chunks[rank]


def test_ring_receive_from_the_wrong_neighbour_is_named_without_a_deadlock(capsys):
    # issue 30: passed on 2 ranks, then a 60 s RankTimeout on 4 with every rank's stack
    with pytest.raises(AssertionError) as err:
        cc.check_ring(rs_receives_from_next, ag_right)  # the lab's world sizes, (2, 4)
    assert "2 ranks: reduce-scatter ok, all-gather ok, all-reduce ok" in capsys.readouterr().out
    text = str(err.value)
    assert text.startswith("reduce-scatter on 4 ranks: send/recv pairs do not match on 4 ranks")
    assert "rank 0 receives 3 message(s) from rank 1, which sends it 0 (rank 1 sends to rank 2)" in text
    assert "receive from (rank - 1) % n" in text and "why 2 ranks passed" in text
    assert "all-gather" not in text  # the all-gather half is right
    assert "all-reduce on 4 ranks: not run: a half above fails" in text
    runs = labkit.run(_ring_cases, {"next": (rs_receives_from_next, ag_right)}, world_size=4, timeout=20)
    assert runs.wall_s < 20  # named before anything is sent: no rank waits for a message


def test_check_ring_passes_and_says_which_half_is_unfinished(capsys):
    assert cc.check_ring(rs_right, ag_right, world_sizes=(2,))
    assert "2 ranks: reduce-scatter ok, all-gather ok, all-reduce ok" in capsys.readouterr().out
    with pytest.raises(NotImplementedError, match="all-gather on 2 ranks: not implemented yet"):
        cc.check_ring(rs_right, not_written, world_sizes=(2,))
    assert "2 ranks: reduce-scatter ok" in capsys.readouterr().out


# ---------------------------------------------------------------- FSDP unshard / reduce_grad


def unshard_right(shard, numel):
    full = torch.empty(shard.numel() * dist.get_world_size())
    ring_all_gather(full, shard)
    return full[:numel]


def reduce_grad_variant(flat_grad, op="avg", owner_shift=0, cut=False):
    rank, n = dist.get_rank(), dist.get_world_size()
    start, end, padded = shard_range(flat_grad.numel(), rank, n)
    padded_grad = torch.zeros(padded)
    padded_grad[: flat_grad.numel()] = flat_grad
    if owner_shift:
        dist.all_reduce(padded_grad)
        return (padded_grad / n).chunk(n)[(rank + owner_shift) % n]
    out = torch.empty(padded // n)
    ring_reduce_scatter(out, padded_grad, op=op)
    return out[: end - start] if cut else out


FSDP_CASES = {
    "right": (unshard_right, reduce_grad_variant),
    "padding left in": (lambda s, numel: unshard_right(s, 10**6), reduce_grad_variant),
    "own shard": (lambda s, numel: s, reduce_grad_variant),
    "sum": (unshard_right, lambda g: reduce_grad_variant(g, op="sum")),
    "wrong shard": (unshard_right, lambda g: reduce_grad_variant(g, owner_shift=1)),
    "padding cut": (unshard_right, lambda g: reduce_grad_variant(g, cut=True)),
}


def _fsdp_cases(numel):
    return {name: cc.unshard_outputs(*fns, numel) for name, fns in FSDP_CASES.items()}


def test_unshard_and_reduce_grad_each_checked_alone():
    runs = labkit.run(_fsdp_cases, 13, world_size=3, timeout=120)
    problems = {name: cc.diagnose_unshard([r[name] for r in runs], 13) for name in FSDP_CASES}
    assert problems["right"] == []
    padding = problems["padding left in"]
    assert len(padding) == 1 and padding[0].startswith("unshard on 3 ranks: FAILED on ranks 0, 1, 2")
    assert "expected (13,), got (15,)" in padding[0] and "full[:numel]" in padding[0]
    assert padding[0].count("12, 0, 0]") == 1  # the values once, not once per rank
    assert "one shard's worth (5 elements)" in problems["own shard"][0]
    for name, hint in (
        ("sum", "3× too large"),
        ("wrong shard", "got rank 1's chunk: rank 0 keeps chunk 0"),
        ("padding cut", "padding included"),
    ):
        assert len(problems[name]) == 1 and problems[name][0].startswith("reduce_grad (AVG)")
        assert hint in problems[name][0]
    assert "FAILED on rank 2 (shown: rank 2)" in problems["padding cut"][0]  # only it has padding


# The zero1_lab's checks and their hints: tests/test_zero_checks.py.
