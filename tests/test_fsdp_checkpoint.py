"""Checkpoints of the hand-written per-parameter FSDP: restoring at the same world size continues
bit for bit; at another world size (2 -> 3, 3 -> 2 with the uneven 3, 3, 2 split of a batch of 8,
2 -> 4, 4 -> 2) with the losses of the uninterrupted run (rel 1e-6); the full export loads into one
process's model bit for bit; a corrupted file, a file of another save, a checkpoint of another
model or of the other FSDP layout, and 'latest' with nothing complete are refused with a message
that says why; fsdp-flat saves and resumes through the same code; the toy preset's hard cases (frozen,
tied across units, unused, 7 rows) resume; fp16's loss scale is saved; fully_shard's model
round-trips through torch.distributed.checkpoint and equals our full checkpoint after the same
steps. The rank-free parts: tests/test_fsdp_checkpoint_shards.py; a save killed at any point
(old or whole new, never a mix): tests/test_faults.py."""

import hashlib
import json
import os
import shutil
import sys

import pytest
import torch

import labkit
import labkit.strategies
from labkit import loop
from labkit.checks import compare
from labkit.labs.checkpoint_runs import train_fully_shard_and_round_trip, train_resumable
from labkit.strategies.checkpoint import (
    CheckpointError,
    is_complete,
    latest_complete,
    read_full,
    resolve,
    verify,
)

TOTAL = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Two ranks, 6 steps, saving a sharded checkpoint at steps 3 and 6."""
    root = str(tmp_path_factory.mktemp("two_ranks"))
    run = labkit.run(train_resumable, TOTAL, root, save_every=3, world_size=2, timeout=180)
    return root, run[0]


def only_step3(uninterrupted, tmp_path):
    """A root holding just a copy of the uninterrupted run's step-3 checkpoint."""
    root = str(tmp_path / "root")
    shutil.copytree(os.path.join(uninterrupted[0], "step_000003"), os.path.join(root, "step_000003"))
    return root, os.path.join(root, "step_000003")


def test_same_world_size_continues_exactly(uninterrupted):
    root, straight = uninterrupted
    path = os.path.join(root, "step_000003")
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from=path, world_size=2, timeout=180)[0]
    assert resumed["start"] == 3
    assert resumed["losses"] == straight["losses"][3:]
    assert compare(straight["state"], resumed["state"], rtol=0, atol=0).ok


@pytest.mark.parametrize("world_size", [3, 4])
def test_two_to_more_ranks(uninterrupted, world_size):
    # 3 ranks split the batch of 8 as 3, 3, 2: each rank's loss must weigh its tokens, not its mean.
    root, straight = uninterrupted
    resumed = labkit.run(
        train_resumable,
        TOTAL,
        root,
        resume_from=os.path.join(root, "step_000003"),
        world_size=world_size,
        timeout=300,
    )[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)


def test_three_to_two_ranks_uneven_split(uninterrupted, tmp_path):
    _, straight = uninterrupted
    root = str(tmp_path)
    three = labkit.run(train_resumable, 3, root, save_every=3, world_size=3, timeout=300)[0]
    assert three["losses"] == pytest.approx(straight["losses"][:3], rel=1e-6)
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from="latest", world_size=2, timeout=180)[0]
    assert resumed["start"] == 3
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)


def test_four_to_two_ranks_skips_the_crashed_save(uninterrupted, tmp_path):
    _, straight = uninterrupted
    root = str(tmp_path)
    # Four ranks save at steps 2 and 4; the save at 4 crashes before its COMPLETE manifest: its
    # files exist, in the hidden saving directory only.
    labkit.run(train_resumable, 4, root, save_every=2, crash_save_at=4, world_size=4, timeout=300)
    assert os.path.exists(os.path.join(root, ".step_000004.saving", "rank3.pt"))
    assert not is_complete(os.path.join(root, "step_000004"))
    assert latest_complete(root).endswith("step_000002")
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from="latest", world_size=2, timeout=180)[0]
    assert resumed["start"] == 2
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-6)


def test_full_checkpoint_and_incomplete_refused(uninterrupted, tmp_path):
    root, straight = uninterrupted
    full_root = str(tmp_path)
    three = labkit.run(train_resumable, 3, full_root, save_every=3, fmt="full", world_size=2, timeout=180)[0]
    assert os.path.exists(os.path.join(full_root, "step_000003", "full.pt"))
    # The export loads into one process's plain model, every key, bit for bit.
    step, state, optimizer = read_full(os.path.join(full_root, "step_000003"))
    model = loop.build_model(loop.PRESETS["fsdp"])
    model.load_state_dict(state)
    assert step == 3 and compare(three["state"], model.state_dict(), rtol=0, atol=0).ok
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(optimizer) == trainable
    assert all(
        optimizer[n]["exp_avg"].shape == p.shape for n, p in model.named_parameters() if n in trainable
    )
    with pytest.raises(CheckpointError, match="sharded checkpoint"):
        read_full(os.path.join(root, "step_000003"))
    resumed = labkit.run(train_resumable, TOTAL, full_root, resume_from="latest", world_size=2, timeout=180)[
        0
    ]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)
    os.remove(os.path.join(full_root, "step_000003", "COMPLETE"))
    with pytest.raises(labkit.RankError, match="COMPLETE"):
        labkit.run(
            train_resumable,
            TOTAL,
            full_root,
            resume_from=os.path.join(full_root, "step_000003"),
            world_size=2,
            timeout=180,
        )


# A save killed at any (rank, point) leaves the old checkpoint or the whole new one, never a mix,
# and the survivor resumes exactly: tests/test_faults.py's kill-mid-save campaign (every rank and
# kill point of a 2-rank save, with counts), not repeated here.


GPT = loop.PRESETS["fsdp"].gpt_config()
L, D, V = GPT.n_layers, GPT.d_model, GPT.vocab_size


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"n_layers": L + 1},
            rf"model has {L + 2} units .* checkpoint has {L + 1} (.|\n)*missing keys "
            rf".*blocks\.{L}\.attn",
        ),
        ({"n_layers": L - 1}, rf"unexpected keys .*blocks\.{L - 1}\.attn"),
        (
            {"d_model": D // 2},
            rf"tok_emb\.weight: shape \({V}, {D // 2}\) in the model, \({V}, {D}\) in the "
            rf"checkpoint",
        ),
    ],
)
def test_checkpoint_of_another_model_refused(uninterrupted, config, expected):
    root, _ = uninterrupted
    with pytest.raises(labkit.RankError, match=expected):
        labkit.run(
            train_resumable,
            TOTAL,
            root,
            resume_from=os.path.join(root, "step_000003"),
            gpt_config=config,
            world_size=2,
            timeout=180,
        )


def test_flipped_bytes_refused_naming_the_file(uninterrupted, tmp_path):
    root, path = only_step3(uninterrupted, tmp_path)
    pristine = {name: open(os.path.join(path, name), "rb").read() for name in ("rank0.pt", "rank1.pt")}
    for name in pristine:
        data = pristine[name]
        for where in (0, len(data) // 3, len(data) - 1):
            flipped = bytearray(data)
            flipped[where] ^= 0x10
            with open(os.path.join(path, name), "wb") as f:
                f.write(flipped)
            with pytest.raises(CheckpointError, match=f"file {name}: sha256 mismatch"):
                verify(path)
            assert not is_complete(path) and latest_complete(root) is None
        with open(os.path.join(path, name), "wb") as f:
            f.write(data[:-7])
        with pytest.raises(CheckpointError, match=f"file {name}: size mismatch"):
            verify(path)
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    assert is_complete(path)
    flipped = bytearray(pristine["rank1.pt"])
    flipped[len(flipped) // 2] ^= 0x01
    with open(os.path.join(path, "rank1.pt"), "wb") as f:
        f.write(flipped)
    with pytest.raises(labkit.RankError, match="file rank1.pt: sha256 mismatch"):
        labkit.run(train_resumable, TOTAL, root, resume_from=path, world_size=2, timeout=180)


def test_a_rank_file_of_another_save_refused(uninterrupted, tmp_path):
    # A file that verifies on its own (its checksum written into the manifest) but comes from the
    # step-6 save: the save id inside it gives it away.
    root, path = only_step3(uninterrupted, tmp_path)
    other = open(os.path.join(uninterrupted[0], "step_000006", "rank1.pt"), "rb").read()
    with open(os.path.join(path, "rank1.pt"), "wb") as f:
        f.write(other)
    manifest = json.load(open(os.path.join(path, "COMPLETE")))
    manifest["files"]["rank1.pt"] = {"size": len(other), "sha256": hashlib.sha256(other).hexdigest()}
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match=r"file rank1\.pt belongs to another save \(step 6"):
        verify(path)


def test_flat_fsdp_checkpoints_too(uninterrupted, tmp_path):
    # fsdp-flat through the same code: exact resume, its sharded files refused by the per-parameter
    # FSDP (and back) with the reason, its full export loaded by the per-parameter one.
    _, straight = uninterrupted
    flat, full = str(tmp_path / "flat"), str(tmp_path / "full")
    run = labkit.run(
        train_resumable, TOTAL, flat, save_every=3, strategy="fsdp-flat", world_size=2, timeout=180
    )[0]
    assert run["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    path = os.path.join(flat, "step_000003")
    resumed = labkit.run(
        train_resumable, TOTAL, flat, resume_from=path, strategy="fsdp-flat", world_size=3, timeout=180
    )[0]
    assert resumed["losses"] == pytest.approx(run["losses"][3:], rel=1e-6)
    if labkit.strategies.get("fsdp") is not labkit.strategies.get("fsdp-flat"):
        with pytest.raises(labkit.RankError, match="holds flat shards .*fsdp-flat"):
            labkit.run(train_resumable, TOTAL, flat, resume_from=path, world_size=2, timeout=180)
        with pytest.raises(labkit.RankError, match="holds per-parameter shards"):
            labkit.run(
                train_resumable,
                TOTAL,
                flat,
                resume_from=os.path.join(uninterrupted[0], "step_000003"),
                strategy="fsdp-flat",
                world_size=2,
                timeout=180,
            )
    labkit.run(
        train_resumable, 3, full, save_every=3, fmt="full", strategy="fsdp-flat", world_size=2, timeout=180
    )
    resumed = labkit.run(train_resumable, TOTAL, full, resume_from="latest", world_size=2, timeout=180)[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)


def test_latest_with_nothing_complete_says_so(tmp_path):
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        resolve(root, "latest")
    os.makedirs(os.path.join(root, "step_000002"))
    with open(os.path.join(root, "step_000002", "COMPLETE"), "w") as f:
        f.write(json.dumps({"note": "a marker that lists no files"}))
    with pytest.raises(labkit.RankError, match=r"no complete checkpoint in (.|\n)*skipped: .*step_000002"):
        labkit.run(train_resumable, TOTAL, root, resume_from="latest", world_size=2, timeout=180)


def test_fully_shard_round_trips_through_dcp_and_matches_ours(tmp_path):
    before, after = labkit.run(
        train_fully_shard_and_round_trip, 2, str(tmp_path / "dcp"), world_size=2, timeout=180
    )[0]
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The hand-written FSDP's full checkpoint after the same 2 steps holds the same model, every
    # key, bit for bit (both train like single-process on 2 ranks).
    labkit.run(
        train_resumable, 2, str(tmp_path / "ours"), save_every=2, fmt="full", world_size=2, timeout=180
    )
    _, ours, _ = read_full(str(tmp_path / "ours" / "step_000002"))
    assert set(ours) == set(after)
    assert compare(after, ours, rtol=0, atol=0).ok


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp-flat"])
def test_toy_hard_cases_resume(tmp_path, strategy):
    # A frozen weight (sharded and saved, not in the optimizer), a weight tied across units, a
    # parameter unused on even steps, odd sizes and 7 rows: exact on 2 ranks, close on 3.
    root, toy = str(tmp_path), dict(batch_size=7, preset="toy", strategy=strategy)
    straight = labkit.run(train_resumable, TOTAL, root, save_every=3, world_size=2, timeout=180, **toy)[0]
    path = os.path.join(root, "step_000003")
    if strategy == "fsdp":
        saved = torch.load(os.path.join(path, "rank1.pt"), weights_only=True)["tensors"]
        frozen = [k for k, v in saved.items() if v["exp_avg"] is None]
        assert frozen, f"no frozen parameter among the saved tensors {sorted(saved)}"
    for world_size, exact in ((2, True), (3, False)):
        resumed = labkit.run(
            train_resumable, TOTAL, root, resume_from=path, world_size=world_size, timeout=180, **toy
        )[0]
        if exact:
            assert resumed["losses"] == straight["losses"][3:]
            assert compare(straight["state"], resumed["state"], rtol=0, atol=0).ok
        else:
            assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)
            assert compare(straight["state"], resumed["state"], rtol=1e-5, atol=1e-6).ok


@pytest.mark.parametrize("saver, loader", [("fsdp", "fsdp-flat"), ("fsdp-flat", "fsdp")])
def test_toy_full_export_crosses_layouts(tmp_path, saver, loader):
    # The full format is by name: a frozen weight sharded by one FSDP and replicated by the other
    # (fsdp-flat keeps frozen parameters whole) loads either way, on another world size.
    root, toy = str(tmp_path), dict(batch_size=7, preset="toy")
    straight = labkit.run(
        train_resumable,
        TOTAL,
        root,
        save_every=3,
        fmt="full",
        strategy=saver,
        world_size=2,
        timeout=180,
        **toy,
    )[0]
    resumed = labkit.run(
        train_resumable,
        TOTAL,
        root,
        resume_from=os.path.join(root, "step_000003"),
        strategy=loader,
        world_size=3,
        timeout=180,
        **toy,
    )[0]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)
    assert compare(straight["state"], resumed["state"], rtol=1e-5, atol=1e-6).ok


def test_fp16_loss_scale_is_saved(tmp_path):
    # A scale starting at 2^20 overflows (3 skipped steps: 2^17 at step 3): a resume that lost the
    # scale would skip again. Same ranks: exact; a run without fp16 refuses the checkpoint.
    from labkit.strategies.precision import MixedPrecision

    mp = MixedPrecision(param_dtype=torch.float16, init_scale=2.0**20, growth_interval=2)
    root = str(tmp_path)
    straight = labkit.run(train_resumable, TOTAL, root, save_every=3, mp=mp, world_size=2, timeout=180)[0]
    path = os.path.join(root, "step_000003")
    assert torch.load(os.path.join(path, "rank0.pt"), weights_only=True)["scaler"]["scale"] == 2.0**17
    resumed = labkit.run(train_resumable, TOTAL, root, resume_from=path, mp=mp, world_size=2, timeout=180)[0]
    assert resumed["losses"] == straight["losses"][3:]
    with pytest.raises(labkit.RankError, match="fp16 loss scaling in the checkpoint, not in the run"):
        labkit.run(train_resumable, TOTAL, root, resume_from=path, world_size=2, timeout=180)


def _refused_saves(root):
    """Rank function: every entry point of labkit's checkpoints on "tp" (no FSDP units) and on
    "fsdp-tp" (FSDP x TP shards): each refuses before writing or reading anything."""
    from labkit.strategies import build
    from labkit.strategies.checkpoint.save_load import load, save_full, save_sharded

    cfg = loop.PRESETS["dp"]
    out = []
    for name, tp in (("tp", 2), ("fsdp-tp", 2)):
        s = build(name, loop.build_model(cfg), cfg, tp=tp)
        for call, args in ((save_sharded, (root, 1)), (save_full, (root, 1)), (load, (root,))):
            try:
                call(s, s.optimizer, *args)
            except (TypeError, NotImplementedError) as e:
                out.append((name, call.__name__, type(e).__name__, str(e)))
    return out


def test_tensor_parallel_strategies_are_refused_before_anything_is_written(tmp_path):
    root = str(tmp_path / "ckpt")
    results = labkit.run(_refused_saves, root, world_size=4, timeout=120)
    for refused in results:
        assert [(n, c, k) for n, c, k, _ in refused] == [
            (n, c, k)
            for n, k in (("tp", "TypeError"), ("fsdp-tp", "NotImplementedError"))
            for c in ("save_sharded", "save_full", "load")
        ], refused
        assert all("torch.distributed.checkpoint" in message for *_, message in refused)
    assert not os.path.exists(root) or not os.listdir(root)


def test_scratch_dir_is_this_kernels_emptied_and_removed_at_exit(tmp_path):
    # fsdp_lab's checkpoint folder: a rerun of its cell starts clean; the folder goes with the
    # kernel (a learner's temp dir does not fill up with one folder per run)
    import subprocess

    code = (
        "import os; from labkit.labs.checkpoint_runs import scratch_dir\n"
        "p = scratch_dir('fsdp_ckpt'); open(os.path.join(p, 'old'), 'w').close()\n"
        "assert scratch_dir('fsdp_ckpt') == p and os.listdir(p) == []\n"
        "assert p.endswith(f'labkit_fsdp_ckpt_{os.getpid()}')\n"
        "open(os.path.join(p, 'left'), 'w').close(); print(p)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert os.path.dirname(path) == str(tmp_path) and not os.path.exists(path)
