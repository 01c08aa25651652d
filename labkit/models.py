"""The models the labs train and the shared optimizer.

- `TinyGPT`: a small GPT (pre-LayerNorm blocks, tied embedding / LM head) for the corpus; with
  GPTConfig(n_experts=E) every block's MLP is a mixture of experts (labkit.strategies.ep.moe,
  built through the `mlp` factory) whose load-balancing loss the loss includes.
- `ToyModel`: a few Linear layers that contain every hard case a strategy must survive.
- `make_optimizer`: the AdamW every lab uses, so all strategies can be compared exactly.
The reference every strategy is checked against is labkit.loop.reference (one process, the
whole global batch, the course's loss convention).

What it leaves out: dropout (it would need an RNG shared across ranks), weight-decay groups
(decay applies to every parameter, biases and LayerNorms included), mixed precision, KV caches and
generation helpers beyond a greedy `generate`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# len(sorted(set(data/corpus.txt))); tests/test_data_models.py checks it against the corpus, so
# building a model does not need to read the corpus.
CORPUS_VOCAB_SIZE = 61


@dataclass
class GPTConfig:
    vocab_size: int = CORPUS_VOCAB_SIZE
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 4
    # Mixture of experts (labkit.strategies.ep.moe): n_experts > 0 puts a MoE layer of that many
    # experts (each an MLP of mlp_ratio * d_model) in every block's MLP slot, built by the `mlp`
    # factory TinyGPT is given (loop.build_model passes labkit.strategies.ep.moe_mlp: the base
    # layer cannot import a strategy). capacity_factor None: dropless.
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01


MLPFactory = Callable[[GPTConfig], nn.Module]  # builds a block's MLP slot (a MoE layer)


class CausalSelfAttention(nn.Module):
    """Multi-head attention written with plain matmuls, so every step can be read and is
    deterministic on CPU."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.d_model % config.n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        mask = torch.tril(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool))
        # A buffer, not a parameter: strategies must not shard, reduce or optimize it.
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, time, channels = h.shape
        head_dim = channels // self.n_heads
        q, k, v = self.qkv(h).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        scores = scores.masked_fill(~self.causal_mask[:time, :time], float("-inf"))
        out = F.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, time, channels))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: h + attn(ln(h)), then h + mlp(ln(h))."""

    def __init__(self, config: GPTConfig, mlp: MLPFactory | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        hidden = config.mlp_ratio * config.d_model
        if config.n_experts:
            if mlp is None:
                raise ValueError(
                    f"TinyGPT: n_experts={config.n_experts} needs its MoE layer: build the model with "
                    f"loop.build_model, or pass TinyGPT(config, mlp=labkit.strategies.ep.moe_mlp)"
                )
            self.mlp = mlp(config)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(config.d_model, hidden), nn.GELU(), nn.Linear(hidden, config.d_model)
            )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, `blocks` (an nn.ModuleList of Block), final LayerNorm,
    and an LM head whose weight IS the token embedding weight (one Parameter object).

    Because of the tie, `named_parameters()` lists the weight once (as tok_emb.weight) while
    `state_dict()` holds it under both tok_emb.weight and lm_head.weight.

    Initialization is a pure function of `seed`: it draws from its own torch.Generator and leaves
    the global RNG state exactly as it found it.
    """

    def __init__(self, config: GPTConfig | None = None, seed: int = 0, mlp: MLPFactory | None = None):
        super().__init__()
        self.config = config = config or GPTConfig()
        # nn.Linear's own default init draws from the global RNG; fork it so building a model
        # has no side effect on the caller's random stream.
        with torch.random.fork_rng(devices=[]):
            self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
            self.blocks = nn.ModuleList(Block(config, mlp) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        # GPT-2's scaling: projections that write into the residual stream get a smaller std so
        # the stream's variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                param.fill_(1.0)
            else:
                residual = ("attn.proj.weight", "mlp.2.weight", ".fc2.weight")  # fc2: a MoE expert's
                std = residual_std if name.endswith(residual) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        """Returns (logits [B, T, vocab], loss); loss is None without targets.

        reduction="sum" returns the summed token loss, so callers with uneven shards or
        micro-batches can divide by the global token count themselves.
        """
        time = idx.shape[1]
        if time > self.config.seq_len:
            raise ValueError(f"{time} tokens is longer than seq_len={self.config.seq_len}")
        h = self.tok_emb(idx) + self.pos_emb(torch.arange(time, device=idx.device))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        if targets is None:
            return logits, None
        # The loss in fp32 at least (as autocast does): a bf16 sum of 256 token losses would
        # round to about 1% of itself.
        wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        loss = F.cross_entropy(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1), reduction=reduction)
        # A MoE layer's load-balancing loss, in the summed form (labkit.strategies.ep.moe: divided
        # by the global token count it is the coefficient times this rank's share).
        terms = [term() for b in self.blocks if (term := getattr(b.mlp, "loss_term", None)) is not None]
        if terms:
            if reduction not in ("sum", "mean"):
                raise ValueError(
                    f"TinyGPT with MoE layers: reduction must be 'sum' or 'mean', got {reduction!r}"
                )
            aux = torch.stack(terms).sum()
            loss = loss + (aux if reduction == "sum" else aux / targets.numel())
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation (argmax), deterministic; for eyeballing what a model learned."""
        for _ in range(new_tokens):
            logits, _ = self(idx[:, -self.config.seq_len :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return idx


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements; a tied weight counts once (parameters() deduplicates)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class ToyModel(nn.Module):
    """Tiny MLP (7 inputs -> 5 outputs) that contains every hard case a hand-written strategy meets.

    (a) frozen parameter: `frozen_in.weight` (7x7) has requires_grad=False, while its bias is
        trainable, so one module mixes frozen and trainable parameters. It never gets a .grad.
    (b) parameter without gradient in some steps: `extra` (weight 5x13, bias 5) is used only by
        forward(x, use_extra=True); after a step with use_extra=False its .grad stays None
        (DDP-style hooks for it never fire). AdamW skips a None grad entirely, weight decay
        included, so a strategy that fills in a zero gradient instead decays it and diverges
        from the reference.
    (c) awkward sizes: every numel is 7, 13, 49, 65, 91 or 169, none divisible by 2, 3 or 4, and
        the trainable total (433) is prime, so no world size 2..8 splits anything evenly:
        padding and uneven shards are unavoidable.
    (d) weight used twice: `shared` (13x13) is applied twice in a row, so its gradient is the sum
        of two contributions and grad hooks see two accumulations in one backward.

    (e) with tied=True, `extra.weight` IS `head.weight` (one Parameter in two modules), so a
        strategy that shards by module meets a weight shared by two units; `extra.bias` stays the
        sometimes-unused parameter. The trainable total is then 368 (even), per-tensor sizes stay odd.

    What it leaves out: buffers and LayerNorm.
    """

    in_features, hidden, out_features = 7, 13, 5

    def __init__(self, seed: int = 0, tied: bool = False):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            self.frozen_in = nn.Linear(self.in_features, self.in_features)
            self.encoder = nn.Linear(self.in_features, self.hidden)
            self.shared = nn.Linear(self.hidden, self.hidden)
            self.head = nn.Linear(self.hidden, self.out_features)
            self.extra = nn.Linear(self.hidden, self.out_features)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.parameters():
                fan_in = param.shape[-1] if param.dim() > 1 else self.hidden
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(fan_in))
        self.frozen_in.weight.requires_grad_(False)
        if tied:  # after the init, so the other parameters are the untied model's, bit for bit
            self.extra.weight = self.head.weight

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.encoder(self.frozen_in(x)))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        out = self.head(h)
        return out + self.extra(h) if use_extra else out


def toy_batch(step: int, batch_size: int, seed: int = 0):
    """Deterministic (x [B, 7], y [B, 5]) float32 batch for `step`, from its own generator."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, ToyModel.in_features, generator=generator)
    y = torch.randn(batch_size, ToyModel.out_features, generator=generator)
    return x, y


def toy_loss(model: nn.Module, batch, use_extra: bool = False, reduction: str = "mean") -> torch.Tensor:
    """Mean squared error of the toy model; reduction="sum" sums over every element instead."""
    x, y = batch
    return F.mse_loss(model(x, use_extra=use_extra), y, reduction=reduction)


# Shared by every lab so that strategies can be compared with the single-process reference.
# foreach=False pins the per-tensor AdamW path. We checked on CPU (torch 2.13) that AdamW over
# flat shards cut at odd offsets is bit-identical to AdamW over the whole parameters, with both
# foreach=False and foreach=True (elementwise math), and the two paths agree with each other;
# pinning one removes a variable when a ZeRO lab's result differs.
# eps=1e-6, the one eps of every run and reference (labkit.loop.EPS says why 1e-8 is too small).
ADAMW_DEFAULTS = dict(betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)


def make_optimizer(params, lr: float = 1e-2, **overrides) -> torch.optim.AdamW:
    """AdamW with the course's fixed hyperparameters (ADAMW_DEFAULTS); weight_decay is nonzero so
    the decoupled decay is part of every comparison."""
    return torch.optim.AdamW(params, lr=lr, **{**ADAMW_DEFAULTS, **overrides})
