"""Reference parallel training strategies (the labs' solutions) behind one interface, by one name.

    from labkit import loop, strategies
    strategies.NAMES                          # every strategy loop.train accepts by name
    s = strategies.build("zero1", model, loop.PRESETS["zero"], **options)

The interface: what `labkit.loop.train` calls, and all a learner's class has to implement.

    class MyStrategy(strategies.Strategy):      # the base class supplies the defaults marked (*)
        reduce_op = "sum"                 (*)   # "sum" or "avg": how gradients are reduced
        optimizer = None                  (*)   # the torch optimizer (the memory tracker's)
        def __init__(self, model, cfg, **options)
        from_preset(model, cfg, **options)  (*) # classmethod, what build() calls: cls(model, cfg,
                                                # **options) unless a class builds otherwise
                                                # cfg: a loop.Preset; cfg.make_optimizer(params)
                                                # builds the course's optimizer
        def __call__(self, *args, **kwargs) (*) # forward: self.model(*args, **kwargs)
        def no_sync(self)                   (*) # context: backward inside communicates nothing
        def after_backward(self)            (*) # once per step, after the last backward
        def scale_loss(self, loss)          (*) # what backward starts from (fp16: loss * scale)
        def step(self)                          # the optimizer step (and whatever sharding needs)
        def zero_grad(self)                     # before the step's first backward
        def full_state_dict(self)           (*) # every rank: {state_dict key: whole tensor}
        def full_grad_dict(self)            (*) # every rank, after step(): {param name: whole grad}
        def sharded_parameters(self)        (*) # what this rank holds of the model when it is
                                                # sharded (a list of tensors); None: a whole replica
        observe                             (*) # set by the loop: instrumentation's one hook,
                                                # observe("begin" | "end", span name),
                                                # observe("mark", label): a memory sample,
                                                # observe("tag", category, tensor): a buffer's kind

One step of the loop: zero_grad(); for each micro-batch but the last, backward inside no_sync();
the last one's backward; after_backward(); step(). The loss each rank backpropagates is (sum of
its token losses) / (global token count), multiplied by the world size when reduce_op == "avg":
SUM-reducing those gradients gives exactly the gradient of the global-batch mean, for any split.
full_state_dict and full_grad_dict are collectives: every rank calls them, at the same point.

One constructor shape for every name in NAMES: from_preset(model, cfg, **options), where options
are the class's own keywords plus two every strategy takes, reduce_op ("sum" / "avg"; torch's own
ones can only average) and mp_policy (a MixedPrecision, or None; a strategy that cannot honour
one raises). An unknown or misspelled option raises TypeError (ZeRO's go on to the optimizer,
whose constructor refuses them), so nothing is accepted and ignored. The loop asks the interface
(`declared(s, "reduce_op")`, `call(s, "sharded_parameters")`), never a class's other attributes.

What it leaves out: evaluation, checkpoints (strategies/checkpoint/ has the FSDP ones), gradient
clipping and schedules, strategies that change the model's forward signature.
"""

import contextlib
import importlib

from labkit.strategies.precision import MixedPrecision  # noqa: F401  (the one policy object)

# name -> (module, class); torch-* are PyTorch's own implementations, the oracles.
_REGISTRY = {
    "ddp-naive": ("labkit.strategies.ddp.by_hand", "DDPNaive"),
    "ddp-flat": ("labkit.strategies.ddp.by_hand", "DDPFlat"),
    "ddp-bucketed": ("labkit.strategies.ddp.by_hand", "DDPBucketed"),
    "zero1": ("labkit.strategies.zero.stages", "ZeRO1"),
    "zero2": ("labkit.strategies.zero.stages", "ZeRO2"),
    "fsdp": ("labkit.strategies.fsdp.fully_shard", "FSDP"),
    "fsdp-flat": ("labkit.strategies.fsdp.flat", "FSDPModel"),
    "hsdp": ("labkit.strategies.fsdp.hsdp", "HSDP"),
    "torch-ddp": ("labkit.strategies.ddp.torch_ref", "TorchDDP"),
    "torch-zero1": ("labkit.strategies.zero.torch_ref", "TorchZeRO1"),
    "torch-fsdp": ("labkit.strategies.fsdp.torch_ref", "TorchFSDP"),
    "torch-hsdp": ("labkit.strategies.fsdp.hsdp", "TorchHSDP"),
}
NAMES = tuple(_REGISTRY)
HAND_WRITTEN = tuple(n for n in NAMES if not n.startswith("torch-"))
REQUIRED = ("step", "zero_grad")


def unobserved(event, label, tensor=None):
    """The observe hook when nothing observes (see the interface above): does nothing."""


class Strategy:
    """Defaults for a strategy that keeps a whole replica in `self.model` (see the module doc).
    A subclass sets self.model in __init__ and writes step() and zero_grad() at least."""

    reduce_op = "sum"
    model = None
    optimizer = None
    observe = staticmethod(unobserved)

    @classmethod
    def from_preset(cls, model, cfg, **options):
        return cls(model, cfg, **options)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def after_backward(self):
        pass

    def scale_loss(self, loss):
        """The tensor backward starts from: the loss itself (fp16 strategies multiply it by the
        loss scale)."""
        return loss

    def replica(self):
        """The whole model this rank holds (a wrapper such as torch's DDP returns what it wraps,
        so the state dict's keys are the model's own)."""
        return self.model

    def full_state_dict(self):
        return {k: v.detach().clone() for k, v in self.replica().state_dict().items()}

    def full_grad_dict(self):
        return replica_grads(self.replica())

    def sharded_parameters(self):
        """None: this strategy holds a whole replica (`replica()`), nothing sharded."""
        return None


class SyncSwitch:
    """no_sync() for a strategy whose backward hooks communicate (DDPBucketed's buckets, ZeRO2's
    reduce-scatters): the hooks read self.syncing, which no_sync() turns off for its block, so
    backward inside accumulates into .grad locally and communicates nothing."""

    syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous


def replica_grads(model):
    """{name: grad clone} of a whole replica (tied weights once, under their first name)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def get(name):
    """The class registered under `name` (one of NAMES)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def build(strategy, model, cfg, **options):
    """An instance of `strategy` (a name in NAMES, or a class) for `model` under preset `cfg`."""
    cls = get(strategy) if isinstance(strategy, str) else strategy
    if not isinstance(cls, type):
        raise TypeError(
            f"strategy must be a name in labkit.strategies.NAMES or a class, got {type(cls).__name__} {cls!r}"
        )
    _check_preset(cfg, cls)
    factory = getattr(cls, "from_preset", None)  # a learner's class need not subclass Strategy
    instance = factory(model, cfg, **options) if factory is not None else cls(model, cfg, **options)
    missing = [m for m in REQUIRED if not callable(getattr(instance, m, None))]
    if not callable(instance):
        missing.insert(0, "__call__ (forward)")
    if missing:
        raise TypeError(
            f"{cls.__name__} lacks {', '.join(missing)}: see "
            f"labkit.strategies' docstring (or subclass labkit.strategies.Strategy)"
        )
    op = declared(instance, "reduce_op")
    if op not in ("sum", "avg"):
        raise ValueError(
            f"{cls.__name__}.reduce_op must be 'sum' or 'avg' (how it reduces "
            f"gradients: the loop scales the loss for 'avg'), got {op!r}"
        )
    return instance


def _check_preset(cfg, cls):
    # By its fields, not its class: labkit.loop (Preset's module) imports this one.
    if not all(hasattr(cfg, f) for f in ("make_optimizer", "units", "has_unused_parameters")):
        hint = f" (labkit.loop.PRESETS[{cfg!r}]?)" if isinstance(cfg, str) else ""
        raise TypeError(
            f"{cls.__name__}: cfg must be a labkit.loop.Preset, got {type(cfg).__name__} {cfg!r}{hint}"
        )


DECLARED = ("reduce_op", "optimizer")  # the interface's attributes (module docstring)


def declared(instance, name):
    """instance's value of the interface attribute `name`, or the Strategy default when its class
    does not declare it (a learner's class need not subclass Strategy)."""
    if name not in DECLARED:
        raise ValueError(f"{name!r} is not one of the interface's attributes {DECLARED}")
    return getattr(instance, name, getattr(Strategy, name))


def call(instance, method, *args):
    """instance.method(*args), or the Strategy default when the class does not define it."""
    bound = getattr(instance, method, None)
    if bound is not None:
        return bound(*args)
    return getattr(Strategy, method)(instance, *args)
