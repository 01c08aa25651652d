"""The parts of the FSDP checkpoint that need no ranks: the dim-0 cut (the same as the per-parameter
FSDP's own shard), the structure comparison, shards that disagree with their save's world size,
the atomic commit."""

import os

import pytest
import torch

from labkit.strategies.checkpoint.shards import structure_differences


def test_other_optimizer_settings_refused():
    saved = {"units": [], "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.01}]}}
    live = {"units": [], "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.001}]}}
    assert structure_differences(saved, saved) == []
    assert "optimizer" in structure_differences(saved, live)[0]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_commit_replaces_a_step_whole(tmp_path, monkeypatch, exchange):
    from labkit.strategies.checkpoint import files

    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    final, tmp = str(tmp_path / "step_000003"), files.saving_dir(str(tmp_path / "step_000003"))
    for directory, name in ((final, "old.pt"), (tmp, "new.pt")):
        os.makedirs(directory)
        open(os.path.join(directory, name), "w").close()
    files.commit(tmp, final)
    assert os.listdir(final) == ["new.pt"]
    assert os.listdir(tmp_path) == ["step_000003"]  # the replaced checkpoint is gone


@pytest.mark.parametrize("shape", [(7, 3), (5,), (1, 4), (2,), ()])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_cut_is_the_reference_shard_and_join_undoes_it(shape, world_size):
    # One definition of the split: the checkpoint's cut must be what the FSDP holds on each rank.
    from labkit.strategies.checkpoint.shards import cut, join, shard_shape
    from labkit.strategies.fsdp.param import FSDPParam

    full = torch.randn(shape)
    pieces = [cut(full, r, world_size) for r in range(world_size)]
    for r, piece in enumerate(pieces):
        held = FSDPParam(torch.nn.Parameter(full.clone()), [], ["w"], r, world_size).sharded
        assert piece.shape == shard_shape(shape, world_size) == held.shape
        assert torch.equal(piece, held.detach())
    assert torch.equal(join(pieces, shape), full)


def test_a_shard_of_the_wrong_shape_or_offset_refused():
    # Rank files that verify but disagree with their save's world size (a writer's bug): joined()
    # names the file, the tensor and what rank r of that save must hold.
    from labkit.strategies.checkpoint.files import CheckpointError
    from labkit.strategies.checkpoint.shards import Entry, cut, joined

    full = torch.randn(7, 3)
    files = {
        f"rank{r}.pt": {
            "tensors": {
                "w": {
                    "shard": cut(full, r, 2),
                    "offset": 4 * r,
                    "adam_step": None,
                    "exp_avg": None,
                    "exp_avg_sq": None,
                }
            }
        }
        for r in range(2)
    }
    manifest, live = {"world_size": 2, "full": False}, [Entry("w", "root", None, (7, 3), [[["w"], [7, 3]]])]
    assert torch.equal(joined("ckpt", manifest, files, live)["w"]["shard"], full)
    files["rank1.pt"]["tensors"]["w"]["offset"] = 3
    with pytest.raises(
        CheckpointError,
        match=r"ckpt: file rank1\.pt: 'w' has \(shape, row offset\) "
        r"\(\(4, 3\), 3\); rank 1 of a 2-rank save holds \(\(4, 3\), 4\)",
    ):
        joined("ckpt", manifest, files, live)
    files["rank1.pt"]["tensors"]["w"].update(offset=4, shard=torch.zeros(3, 3))
    with pytest.raises(CheckpointError, match=r"rank 1 of a 2-rank save holds"):
        joined("ckpt", manifest, files, live)
