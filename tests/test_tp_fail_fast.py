"""tp_lab's checks fail fast: a learner's mistake that raises on rank 1 only, while its tp (or dp)
peer waits for it in a collective, is reported with rank 1's own error (its type, message and the
learner's line) and the hint, not after the launch's whole timeout as "did not finish"; so is
one that leaves no peer waiting (a constructor), after the ranks' agreement. One launch per case, each run under a launch timeout of FAST_S: a check that waited for the
timeout would fail with labkit.run's RankTimeout instead of the AssertionError asserted here."""

import pytest
import torch.distributed as dist
import torch.nn.functional as F

from labkit.labs import tp_checks as TC, tp_lab as T
from labkit.labs.tp_checks import shared

FAST_S = 60.0  # far below the checks' own 180 s; the failing checks here end after AGREE_S (5 s)


@pytest.fixture(autouse=True)
def _short_launch_timeout(monkeypatch):
    monkeypatch.setattr(shared, "RUN_TIMEOUT_S", FAST_S)


def _only_rank_1(where):
    if dist.get_rank() == 1:
        raise ValueError(f"only rank 1 breaks, in {where}")


def g_raises_on_rank_1(x, group):
    _only_rank_1("g")  # rank 3, rank 1's tp peer, waits in g's all-reduce
    return T.g_op(x, group)


class RowRaisesOnRank1(T.RowParallelLinear):
    def forward(self, x):
        _only_rank_1("RowParallelLinear.forward")
        return super().forward(x)


class ColBuildRaisesOnRank1(T.ColumnParallelLinear):  # no peer waits: reported after the agreement
    def __init__(self, full, group, copy_input=True):
        _only_rank_1("ColumnParallelLinear.__init__")
        super().__init__(full, group, copy_input)


class MLPRaisesOnRank1(T.TPMLP):
    def forward(self, x):
        h = F.gelu(self.fc1(x))
        _only_rank_1("the MLP's forward")
        return self.fc2(h)


def gather_raises_on_rank_1(shard, dim0, mesh):
    _only_rank_1("gather")  # rank 3, rank 1's dp peer, waits in the all-gather
    return T.gather_over_dp(shard, dim0, mesh)


@pytest.mark.parametrize(
    "check, args, first",
    [
        (
            TC.check_conjugates,
            (T.f_op, g_raises_on_rank_1),
            "rank 1 (0 of tp group [1, 3]), g: raised ValueError",
        ),
        (
            TC.check_linears,
            (T.ColumnParallelLinear, RowRaisesOnRank1),
            "rank 1 (0 of tp group [1, 3]), column -> GELU -> row: raised ValueError",
        ),
        (
            TC.check_linears,
            (ColBuildRaisesOnRank1, T.RowParallelLinear),
            "rank 1 (0 of tp group [1, 3]), building the layers: raised ValueError",
        ),
        (
            TC.check_blocks,
            (MLPRaisesOnRank1, T.TPAttention),
            "rank 1 (0 of tp group [1, 3]), MLP: its forward: raised ValueError",
        ),
        (
            TC.check_fsdp_tp,
            (T.shard_over_dp, gather_raises_on_rank_1, T.reduce_grad_over_dp),
            "rank 1 (dp 0, tp 1), a (7, 3) TP-local tensor, gathered: raised ValueError",
        ),
    ],
    ids=["f and g", "linears", "linears, building", "blocks", "fsdp x tp"],
)
def test_an_error_on_one_rank_is_reported_at_once_with_its_line(check, args, first):
    with pytest.raises(AssertionError) as err:
        check(*args)
    text = str(err.value)
    assert first in text.splitlines()[0], text
    assert "only rank 1 breaks" in text.splitlines()[0], text
    assert 'raise ValueError(f"only rank 1 breaks, in {where}")' in text, text  # the learner's line
    assert "test_tp_fail_fast.py" in text and "\nhint: " in text, text
    assert "timed out" not in text and "did not finish" not in text, text
