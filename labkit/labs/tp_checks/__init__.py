"""Checks for tp_lab's exercises: each runs the learner's code on gloo ranks and compares it
element-wise with one process AND with torch's tensor parallelism (parallelize_module with
ColwiseParallel / RowwiseParallel; for FSDP x TP also fully_shard(mesh=mesh["dp"])).

    check_conjugates(f, g)              f(x, group), g(x, group): the autograd conjugates
    check_linears(Col, Row)             Col(full, group, copy_input=True), Row(full, group)
    check_blocks(TPMLP, TPAttention)    the TP MLP and attention blocks, one all-reduce forward and
                                        one backward each (counted by the tracer)
    check_fsdp_tp(shard, gather, reduce_grad)   the dp sharding of FSDP x TP on 2 x 2 ranks, then 3
                                        SGD steps of the block

Exercises 1-3 run on 4 ranks as a ("tp", "dp") mesh: tp groups {0, 2} and {1, 3}, so a tp group is
not the world and a rank's place in it is not its global rank.

Each raises one AssertionError naming the rank and case, with a "hint:" for the mistake it
recognises (f and g swapped, an all-reduce left out or added, AVG for SUM, the input reduced in
place, the weight split along the wrong dim or not as torch.chunk, the bias added on every rank,
f applied per projection, the global head count, the wrong mesh dimension or rank, SUM for AVG).
Tolerances: fp32; a row-parallel layer sums its input features as tp partial sums (another
order than one process), and torch's RowwiseParallel adds bias / tp on each rank before the
all-reduce: both differ from ours in the last bits (measured <= 1.5e-8 on 3 steps of the block),
so values are compared within atol 1e-6 (a mistake is off by far more).

A learner's error that raises on some ranks only, while a peer waits for that rank in a
collective, is reported within seconds with that rank's exception, its line and the hint
(shared.AGREE_S), never as the launch's timeout.

    shared          the launch, the mesh, the comparisons, the agreement after each piece of
                    the learner's code, the hints for errors a rank raised
    conjugates      exercise 1          linears     exercise 2
    blocks          exercise 3          block_mistakes  exercise 3's mistakes, by their numbers
    fsdp_tp         exercise 4
"""

from labkit.labs.tp_checks.blocks import check_blocks
from labkit.labs.tp_checks.conjugates import check_conjugates
from labkit.labs.tp_checks.fsdp_tp import check_fsdp_tp
from labkit.labs.tp_checks.linears import check_linears
from labkit.labs.tp_checks.shared import ATOL

__all__ = ["ATOL", "check_blocks", "check_conjugates", "check_fsdp_tp", "check_linears"]
