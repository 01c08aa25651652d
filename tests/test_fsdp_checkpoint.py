"""Checkpoints of the hand-written FSDP: restoring at the same world size continues bit for bit;
4 -> 2 and 2 -> 4 continue with the losses of the uninterrupted run (fp32 rounding of another
split: rel 1e-5); a save that crashed before its marker is never loaded; fully_shard's model
round-trips through torch.distributed.checkpoint."""
import os

import pytest
import torch

import labkit
from labkit.checks import compare
from labkit.strategies.fsdp_checkpoint import is_complete, latest_complete, train_fully_shard_and_round_trip
from labkit.strategies.fsdp_checkpoint import train_resumable

TOTAL = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two ranks, 6 steps, saving a sharded checkpoint at step 3 (and a full one elsewhere)."""
    root = str(tmp_path_factory.mktemp("two_ranks"))
    run = labkit.run(train_resumable, TOTAL, root, save_every=3, world_size=2, timeout=180)
    return root, run[0]


def test_same_world_size_continues_exactly(uninterrupted):
    root, straight = uninterrupted
    path = os.path.join(root, "step_000003")
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from=path, world_size=2, timeout=180)[0]
    assert resumed["start"] == 3
    assert resumed["losses"] == straight["losses"][3:]
    assert compare(straight["state"], resumed["state"], rtol=0, atol=0).ok


def test_two_to_four_ranks(uninterrupted):
    root, straight = uninterrupted
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from=os.path.join(root, "step_000003"),
                         world_size=4, timeout=300)[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-5)


def test_four_to_two_ranks_skips_the_crashed_save(uninterrupted, tmp_path):
    _, straight = uninterrupted
    root = str(tmp_path)
    # Four ranks save at steps 2 and 4; the save at 4 crashes before its COMPLETE marker.
    labkit.run(train_resumable, 4, root, save_every=2, crash_save_at=4, world_size=4, timeout=300)
    assert os.path.exists(os.path.join(root, "step_000004", "rank3.pt"))
    assert not is_complete(os.path.join(root, "step_000004"))
    assert latest_complete(root).endswith("step_000002")
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from="latest", world_size=2, timeout=180)[0]
    assert resumed["start"] == 2
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-5)


def test_full_checkpoint_and_incomplete_refused(uninterrupted, tmp_path):
    root, straight = uninterrupted
    full_root = str(tmp_path)
    labkit.run(train_resumable, 3, full_root, save_every=3, fmt="full", world_size=2, timeout=180)
    assert os.path.exists(os.path.join(full_root, "step_000003", "full.pt"))
    resumed = labkit.run(train_resumable, TOTAL, full_root, resume_from="latest", world_size=2, timeout=180)[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)
    os.remove(os.path.join(full_root, "step_000003", "COMPLETE"))
    with pytest.raises(labkit.RankError, match="COMPLETE"):
        labkit.run(train_resumable, TOTAL, full_root, resume_from=os.path.join(full_root, "step_000003"),
                   world_size=2, timeout=180)


def test_fully_shard_round_trips_through_dcp(tmp_path):
    before, after = labkit.run(train_fully_shard_and_round_trip, 2, str(tmp_path / "dcp"), world_size=2,
                               timeout=180)[0]
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
