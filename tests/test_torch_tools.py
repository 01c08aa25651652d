"""PyTorch's own tools on labkit's sharded models (issue 29): clip_grad_norm_, requires_grad_,
state dicts and torch.distributed.checkpoint give on fully_shard_by_hand what they give on torch's
fully_shard (side by side, same seed, gloo), and what neither can honour is refused by name.
Each test here failed before its fix."""

import torch
import torch.distributed as dist
import torch.nn as nn

import labkit
from labkit.strategies.fsdp import fully_shard_by_hand


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))  # 5 rows: uneven on 2 ranks


def _shard(model, kind):
    if kind == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        fully_shard_by_hand(model[0])
        fully_shard_by_hand(model)
    return model


def _batch():
    torch.manual_seed(1 + dist.get_rank())  # a different batch per rank
    return torch.randn(4, 6)


def _clip_and_state(kind, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    model = _shard(_build(), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(_batch()).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    opt.step()
    out = {"norm": float(norm)}
    out["model"] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    osd = get_optimizer_state_dict(model, opt, options=full)["state"]
    out["optimizer"] = {k: {n: t.clone() for n, t in s.items()} for k, s in osd.items()}
    out["plain"] = {k: (type(v).__name__, tuple(v.shape)) for k, v in model.state_dict().items()}
    # A whole state dict back into the model: set_model_state_dict and plain load_state_dict.
    zero = {k: torch.zeros_like(v) for k, v in out["model"].items()}
    set_model_state_dict(model, zero, options=full)
    out["after_set"] = {k: float(v.abs().sum()) for k, v in get_model_state_dict(model, options=full).items()}
    if kind == "hand":  # fully_shard refuses a plain tensor here (mixed Tensor and DTensor)
        model.load_state_dict(out["model"])
    else:
        set_model_state_dict(model, dict(out["model"]), options=full)  # it rewrites the dict
    out["after_load"] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    # torch.distributed.checkpoint: save the sharded state dict, zero, load it back.
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    set_model_state_dict(model, zero, options=full)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    out["after_dcp"] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    return out


def _compare(ours, theirs):
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].shape == theirs[k].shape, (k, ours[k].shape, theirs[k].shape)
        assert torch.equal(ours[k], theirs[k]), k


def test_clip_grad_norm_state_dicts_and_dcp_equal_fully_shard(tmp_path):
    theirs = labkit.run(_clip_and_state, "torch", str(tmp_path / "torch"), world_size=2, timeout=180)
    ours = labkit.run(_clip_and_state, "hand", str(tmp_path / "hand"), world_size=2, timeout=180)
    for rank in range(2):
        o, t = ours[rank], theirs[rank]
        # clip_grad_norm_ on the plain parameters: the global norm on every rank, the same clip.
        assert o["norm"] == t["norm"] == theirs[0]["norm"], (rank, o["norm"], t["norm"])
        _compare(o["model"], t["model"])  # whole (5, 6), not a padded (3, 6) shard
        assert o["model"]["0.weight"].shape == (5, 6)
        for k in t["optimizer"]:
            _compare(o["optimizer"][k], t["optimizer"][k])
        assert o["plain"] == t["plain"]  # state_dict(): DTensors of the global shape
        assert all(v == 0 for v in o["after_set"].values())
        _compare(o["after_load"], t["model"])
        _compare(o["after_dcp"], t["model"])


def _freeze_and_replace(kind):
    model = _shard(_build(), kind)
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD([p for p in model.parameters()], lr=0.1)
    model(_batch()).sum().backward()
    grad_none = model[0].weight.grad is None
    opt.step()
    moved = not torch.equal(model[0].weight.detach(), before)
    model[2].bias = nn.Parameter(torch.zeros(3))
    try:
        model(_batch())
        replaced = None
    except RuntimeError as exc:
        replaced = str(exc)
    return grad_none, moved, replaced


def test_requires_grad_after_sharding_is_honoured_and_a_replaced_parameter_refused():
    for grad_none, moved, _ in labkit.run(_freeze_and_replace, "torch", world_size=2, timeout=120):
        assert grad_none and not moved  # fully_shard honours the freeze
    for grad_none, moved, replaced in labkit.run(_freeze_and_replace, "hand", world_size=2, timeout=120):
        assert grad_none, "a weight frozen after sharding still got a .grad"
        assert not moved, "a weight frozen after sharding still moved"
        assert replaced is not None and "2.bias" in replaced and "replaced" in replaced, replaced


def _double_after_sharding():
    model = fully_shard_by_hand(_build())
    model.double()
    try:
        model(_batch().double())
    except RuntimeError as exc:
        return str(exc)
    return None


def test_dtype_conversion_after_sharding_names_the_cause():
    for message in labkit.run(_double_after_sharding, world_size=2, timeout=120):
        assert message is not None and "BEFORE sharding" in message, message


def test_latest_complete_orders_steps_by_number_and_save_refuses_a_bad_step(tmp_path, monkeypatch):
    import pytest

    from labkit.strategies.checkpoint import files, save_load

    for step in (999999, 1000000):
        (tmp_path / f"step_{step:06d}").mkdir()
    monkeypatch.setattr(files, "verify", lambda path: None)  # both complete
    assert files.latest_complete(str(tmp_path)).endswith("step_1000000")
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="step"):
            save_load._start_save(str(tmp_path), bad)


def _sharded_optimizer_refusals():
    from labkit.strategies.zero import ShardedOptimizer

    out = {}
    for cls in (torch.optim.LBFGS, torch.optim.Adafactor):
        try:
            ShardedOptimizer(nn.Linear(4, 3).parameters(), cls, lr=0.1)
            out[cls.__name__] = None
        except TypeError as exc:
            out[cls.__name__] = str(exc)
    opt = ShardedOptimizer(nn.Linear(4, 3).parameters(), torch.optim.AdamW, lr=0.1)
    out["group"] = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return out


def test_sharded_optimizer_refuses_non_elementwise_and_groups_carry_defaults():
    for out in labkit.run(_sharded_optimizer_refusals, world_size=2, timeout=120):
        for name in ("LBFGS", "Adafactor"):
            assert out[name] is not None and name in out[name], out[name]
        group = out["group"]
        for k in ("betas", "eps", "weight_decay", "amsgrad"):
            assert k in group, (k, group)


def _wants_timeout(x, timeout):
    return x + timeout


def test_run_names_a_rank_parameter_that_clashes_with_its_own_keyword():
    import pytest

    with pytest.raises(TypeError, match="'timeout'.*labkit.run's own keyword"):
        labkit.run(_wants_timeout, 1, timeout=5)
    assert labkit.run(_wants_timeout, 1, 2, world_size=2) == [3, 3]  # positional: fine


def _train_refusals():
    from labkit import loop

    out = []
    cfg = loop.PRESETS["toy"]
    for call in (
        lambda: loop.train("ddp-flat", cfg, 1, accum_steps=2.0),
        lambda: loop.train("ddp-flat", cfg.replace(optimizer=dict), 1),
    ):
        try:
            call()
            out.append(None)
        except (TypeError, ValueError) as exc:
            out.append(str(exc))
    return out


def test_train_checks_accum_steps_and_the_optimizer_up_front():
    for accum, optimizer in labkit.run(_train_refusals, world_size=2, timeout=120):
        assert accum is not None and "accum_steps must be an int" in accum, accum
        assert optimizer is not None and "cfg.optimizer must be" in optimizer, optimizer


def _optimizer_state_round_trip(kind, path):
    """get_/set_optimizer_state_dict, full and sharded (through torch.distributed.checkpoint):
    train a step, save, train on (the state moves), load into a new optimizer, step again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    model = _shard(_build(), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(_batch()).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    saved_model = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    saved_full = get_optimizer_state_dict(model, opt, options=full)
    dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    model(_batch()).pow(2).mean().backward()
    opt.step()  # moves the weights and the moments past what was saved
    opt.zero_grad()
    out = {}
    for how in ("full", "dcp"):
        set_model_state_dict(model, saved_model, options=full)
        fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
        if how == "full":
            set_optimizer_state_dict(model, fresh, saved_full, options=full)
        else:
            state = {"optimizer": get_optimizer_state_dict(model, fresh)}
            dcp.load(state, checkpoint_id=path)
            set_optimizer_state_dict(model, fresh, state["optimizer"])
        model(_batch()).pow(2).mean().backward()
        fresh.step()
        fresh.zero_grad()
        out[how] = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    return out


def test_optimizer_state_dicts_round_trip_as_on_fully_shard(tmp_path):
    theirs = labkit.run(_optimizer_state_round_trip, "torch", str(tmp_path / "t"), world_size=2, timeout=180)
    ours = labkit.run(_optimizer_state_round_trip, "hand", str(tmp_path / "h"), world_size=2, timeout=180)
    for rank in range(2):
        for how in ("full", "dcp"):
            _compare(ours[rank][how], theirs[rank][how])
