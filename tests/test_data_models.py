"""Corpus, batches, sharding, TinyGPT and ToyModel: the invariants every lab relies on."""

import hashlib
import importlib.util
from pathlib import Path

import pytest
import torch

from labkit.data import CORPUS_PATH, Tokenizer, get_batch, load_corpus, micro_batches, rank_slice, shard_batch
from labkit import loop
from labkit.models import GPTConfig, TinyGPT, ToyModel, make_optimizer, num_params, toy_batch, toy_loss

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@pytest.fixture(autouse=True)
def one_thread():
    # These models are tiny; on a busy 2-core machine a second intra-op thread only adds
    # spin-waiting (a 3 ms step becomes 0.8 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_corpus", DATA_DIR / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_reproduces_committed_corpus_byte_for_byte():
    generated = _load_generator().make_corpus().encode("ascii")
    committed = CORPUS_PATH.read_bytes()
    assert 300_000 <= len(committed) <= 2_000_000
    assert hashlib.sha256(generated).hexdigest() == hashlib.sha256(committed).hexdigest()


def test_readme_states_the_current_checksum_and_size():
    readme = (DATA_DIR / "README.md").read_text()
    committed = CORPUS_PATH.read_bytes()
    assert hashlib.sha256(committed).hexdigest() in readme
    assert f"{len(committed):,}" in readme


def test_tokenizer_roundtrip_and_config_vocab():
    tokenizer = Tokenizer()
    assert tokenizer.vocab_size == GPTConfig().vocab_size
    text = 'Mira had 3 pears. "Hello?" asked Osk!\n'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    corpus = load_corpus()
    assert corpus.dtype == torch.long and corpus.dim() == 1
    assert load_corpus() is corpus  # cached
    assert tokenizer.decode(corpus[:200]) == CORPUS_PATH.read_text()[:200]
    with pytest.raises(ValueError):
        tokenizer.encode("~")


def test_get_batch_is_deterministic_and_shifted():
    x, y = get_batch(3, 6, 16, seed=1)
    x2, y2 = get_batch(3, 6, 16, seed=1)
    assert x.shape == y.shape == (6, 16) and x.dtype == torch.long
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, get_batch(4, 6, 16, seed=1)[0])
    assert not torch.equal(x, get_batch(3, 6, 16, seed=2)[0])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("batch_size", [1, 4, 7, 8, 12, 13])
def test_shard_batch_covers_global_batch_exactly(world_size, batch_size):
    x = torch.arange(batch_size)[:, None].repeat(1, 3)
    shards = [shard_batch(x, x + 100, rank, world_size) for rank in range(world_size)]
    assert torch.equal(torch.cat([sx for sx, _ in shards]), x)
    assert torch.equal(torch.cat([sy for _, sy in shards]), x + 100)
    sizes = [len(sx) for sx, _ in shards]
    base, extra = divmod(batch_size, world_size)
    assert sizes == [base + 1] * extra + [base] * (world_size - extra)


def test_rank_slice_rejects_bad_rank():
    assert rank_slice(10, 3, 4) == slice(8, 10)
    with pytest.raises(ValueError):
        rank_slice(10, 4, 4)


def test_micro_batches_uneven():
    x, y = get_batch(0, 7, 8)
    parts = micro_batches(x, y, 3)
    assert [len(p[0]) for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    with pytest.raises(ValueError):
        micro_batches(x, y, 8)


def test_tinygpt_tied_weight_is_one_parameter():
    model = TinyGPT()
    assert model.lm_head.weight is model.tok_emb.weight
    assert isinstance(model.blocks, torch.nn.ModuleList)
    unique = {id(p): p for m in model.modules() for p in m.parameters(recurse=False)}
    assert num_params(model) == sum(p.numel() for p in unique.values())
    assert sum(p.numel() for p in model.state_dict().values()) == (
        num_params(model) + model.tok_emb.weight.numel()
    )


def test_tinygpt_init_is_deterministic_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = TinyGPT(seed=0), TinyGPT(seed=0), TinyGPT(seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_loss_sum_is_mean_times_token_count():
    model = TinyGPT(GPTConfig(seq_len=16, d_model=32, n_layers=1))
    x, y = get_batch(0, 4, 16)
    _, mean = model(x, y)
    logits, total = model(x, y, reduction="sum")
    assert logits.shape == (4, 16, model.config.vocab_size)
    assert torch.allclose(total, mean * x.numel(), rtol=1e-6)
    assert model(x)[1] is None


def test_single_process_training_reduces_loss_and_is_deterministic():
    cfg = loop.PRESETS["dp"].replace(gpt=dict(d_model=32, n_heads=4, n_layers=1), batch_size=4)
    first, second = loop.reference(cfg, 3), loop.reference(cfg, 3)
    assert first["losses"] == second["losses"] and first["losses"][-1] < first["losses"][0]
    assert all(torch.equal(first["state"][k], second["state"][k]) for k in first["state"])
    assert set(first["state"]) == set(loop.build_model(cfg).state_dict())  # both tied keys kept


@pytest.mark.parametrize("use_extra", [False, True])
def test_toy_model_hard_cases(use_extra):
    model = ToyModel()
    loss = toy_loss(model, toy_batch(0, 6), use_extra=use_extra)
    loss.backward()
    assert model.frozen_in.weight.grad is None and not model.frozen_in.weight.requires_grad
    assert model.frozen_in.bias.grad is not None
    assert (model.extra.weight.grad is not None) == use_extra
    for param in model.parameters():
        assert all(param.numel() % d for d in (2, 3, 4)), param.shape
    assert num_params(model, trainable_only=True) == 433


def test_toy_training_and_optimizer_defaults():
    cfg = loop.PRESETS["toy"].replace(extra_every=0)  # the extra parameter never used
    out = loop.reference(cfg, 4)
    losses, state, initial = out["losses"], out["state"], loop.build_model(cfg).state_dict()
    assert torch.equal(state["frozen_in.weight"], initial["frozen_in.weight"])
    assert not torch.equal(state["head.weight"], initial["head.weight"])
    # AdamW skips a parameter whose .grad is None: no update and no weight decay either (the
    # preset ties extra.weight to head.weight; extra.bias is extra's own).
    assert torch.equal(state["extra.bias"], initial["extra.bias"])
    group = make_optimizer(ToyModel().parameters()).param_groups[0]
    assert group["weight_decay"] > 0 and group["foreach"] is False
    assert torch.equal(toy_batch(2, 3)[0], toy_batch(2, 3)[0])
    assert len(losses) == 4
