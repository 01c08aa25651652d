"""The labs' debug drills: each classic mistake as a small subclass of a reference strategy or a
wrong sampler, injected from the lab's side; labkit.strategies holds the algorithms only. Out of
labkit.labs on purpose: the labs send learners here to read the drills, and labs/ holds the
exercise checks and reference solutions (reading this module gives no exercise away).

    labkit.run(loop.train, drills.OptimizerBeforeSharding, cfg, steps=2, world_size=2)
    labkit.run(loop.train, "fsdp", cfg, steps=2, hooks=loop.Hooks(shard=drills.same_rows_on_every_rank),
               world_size=2)
    labkit.run(loop.train, drills.NoBroadcast, cfg, steps=1, world_size=2)

Every drill trains without an error: the symptom is in the numbers (weights that never move, an
equivalence check that fails, memory that never drops), which is what the labs teach to look at.
"""

import torch
import torch.distributed as dist

from labkit.data import shard_batch
from labkit.strategies.ddp import DDPNaive
from labkit.strategies.fsdp import FSDP, allow_orphaned_parameters


def reinit_per_rank(model, cfg):
    """Give this rank's replica the init of seed cfg.seed + rank, as separate processes that each
    initialise their own model would have (labkit.loop builds the same model on every rank)."""
    from labkit import loop

    own = loop.build_model(cfg.replace(seed=cfg.seed + dist.get_rank()))
    with torch.no_grad():
        for mine, theirs in zip(model.state_dict().values(), own.state_dict().values()):
            mine.copy_(theirs)


class NoBroadcast(DDPNaive):
    """Naive DDP without the start-up broadcast, on ranks that initialised their replicas on their
    own: the same averaged gradient then moves different models."""

    @classmethod
    def from_preset(cls, model, cfg, **options):
        reinit_per_rank(model, cfg)
        return super().from_preset(model, cfg, **options)

    def broadcast(self):
        pass


class OptimizerBeforeSharding(FSDP):
    """The optimizer is built over the model's parameters BEFORE sharding: fully_shard_by_hand
    replaces every one of them by a new nn.Parameter holding the shard, so the optimizer's tensors
    are no longer used, get no gradient, and AdamW skips them: nothing trains. (labkit refuses
    this at the first step; the drill lets it through, to show what fully_shard does silently.)"""

    def __init__(self, model, cfg, **options):
        early = allow_orphaned_parameters(
            cfg.make_optimizer([p for p in model.parameters() if p.requires_grad])
        )
        super().__init__(model, cfg, **options)
        self.optimizer = early


class OwnMeanLossSummed(FSDP):
    """Each rank averages its loss over its OWN tokens (what a reduction by AVG expects: N times
    the loop's global-count share on an even split) while the reduce-scatter SUMs, the course's
    convention: every gradient N times too large. The loop's reported losses are N times too
    large as well."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        if isinstance(out, tuple):
            logits, loss = out
            return logits, loss * dist.get_world_size()
        return out * dist.get_world_size()


class NeverReshards(FSDP):
    """The missing reshard: no unit's gathered weights are ever freed, neither after forward nor
    after backward, so every rank ends up holding the whole model next to its shards (and the
    next step's forward, finding every unit gathered, computes with the weights of the step
    before: the optimizer updated the shards only)."""

    def __init__(self, model, cfg, **options):
        super().__init__(model, cfg, reshard_after_forward=False, **options)
        for unit in self.units:
            unit.reshard = lambda: None


def same_rows_on_every_rank(x, y, rank, world_size):
    """Overlapping samplers (a DataLoader without a DistributedSampler): every rank reads rank 0's
    share of the batch."""
    return shard_batch(x, y, 0, world_size)


def whole_batch_on_every_rank(x, y, rank, world_size):
    """No sampler at all: every rank trains on the whole global batch."""
    return x, y


def show(name: str, text: str) -> None:
    """Print a drill's symptom (a failed comparison, its hint) labelled as the deliberate mistake
    it is, so that a solved Run All never shows a bare "FAILED ... hint:" that reads like the
    learner's own failure."""
    for line in text.splitlines():
        print(f"[drill {name!r}, a deliberate mistake] {line}")
