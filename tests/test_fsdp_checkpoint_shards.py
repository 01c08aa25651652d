"""The parts of the FSDP checkpoint that need no ranks: the dim-0 cut (the same as the per-parameter
FSDP's own shard), the structure comparison, the atomic commit."""
import os

import pytest
import torch

from labkit.strategies.fsdp_checkpoint_shards import structure_differences


def test_other_optimizer_settings_refused():
    saved = {"units": [], "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.01}]}}
    live = {"units": [], "optimizer": {"class": "AdamW", "param_groups": [{"lr": 0.001}]}}
    assert structure_differences(saved, saved) == []
    assert "optimizer" in structure_differences(saved, live)[0]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_commit_replaces_a_step_whole(tmp_path, monkeypatch, exchange):
    from labkit.strategies import fsdp_checkpoint_files as files
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    final, tmp = str(tmp_path / "step_000003"), files.saving_dir(str(tmp_path / "step_000003"))
    for directory, name in ((final, "old.pt"), (tmp, "new.pt")):
        os.makedirs(directory)
        open(os.path.join(directory, name), "w").close()
    files.commit(tmp, final)
    assert os.listdir(final) == ["new.pt"]
    assert os.listdir(tmp_path) == ["step_000003"]   # the replaced checkpoint is gone


@pytest.mark.parametrize("shape", [(7, 3), (5,), (1, 4), (2,), ()])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_cut_is_the_reference_shard_and_join_undoes_it(shape, world_size):
    # One definition of the split: the checkpoint's cut must be what the FSDP holds on each rank.
    from labkit.strategies.fsdp_checkpoint_shards import cut, join, shard_shape
    from labkit.strategies.fsdp_param import FSDPParam
    full = torch.randn(shape)
    pieces = [cut(full, r, world_size) for r in range(world_size)]
    for r, piece in enumerate(pieces):
        held = FSDPParam(torch.nn.Parameter(full.clone()), [], ["w"], r, world_size).sharded
        assert piece.shape == shard_shape(shape, world_size) == held.shape
        assert torch.equal(piece, held.detach())
    assert torch.equal(join(pieces, shape), full)
