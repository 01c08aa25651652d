"""MemoryTracker: exact bytes on CPU, frees seen at once, categories add up, plots render."""

import pickle

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from labkit.observe import memory, memory_plot  # noqa: E402
from labkit.observe.memory import MemoryTracker  # noqa: E402
from labkit.observe.memory_record import CATEGORIES  # noqa: E402
from labkit.observe.memory_record import MemoryRecord  # noqa: E402
from labkit.observe.style import MEMORY_COLORS  # noqa: E402

F32 = 4
LINEAR_PARAMS = 7 * 13 + 13  # Linear(7, 13): weight + bias


def one_adamw_step(mt, model, opt, x):
    with mt.phase("forward"):
        loss = model(x).square().sum()
    with mt.phase("backward"):
        loss.backward()
    with mt.phase("step"):
        opt.step()
    mt.mark("after step")
    return loss


def test_linear_adamw_accounted_to_the_byte():
    model = torch.nn.Linear(7, 13)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(5, 7)  # made before tracking and not registered: not counted
    mt = MemoryTracker(model=model, optimizer=opt)
    with mt:
        one_adamw_step(mt, model, opt, x)
        after = mt.samples[-1].by_category
        opt.zero_grad()
        mt.mark("after zero_grad")
    assert after["parameters"] == LINEAR_PARAMS * F32
    assert after["gradients"] == LINEAR_PARAMS * F32
    # exp_avg + exp_avg_sq per parameter, plus one 0-dim float32 `step` tensor per parameter (4 B each)
    assert after["optimizer"] == 2 * LINEAR_PARAMS * F32 + 2 * F32
    assert mt.samples[-2].by_category["gradients"] == 0  # zero_grad(set_to_none) freed them


def test_activations_are_what_forward_allocated_and_kept():
    model = torch.nn.Linear(7, 13)
    x = torch.randn(5, 7)
    with MemoryTracker(model=model) as mt:
        with mt.phase("forward"):
            out = model(x)
        assert mt.samples[-1].by_category["activations"] == 5 * 13 * F32
        del out
        mt.mark("freed")
    assert mt.samples[-1].by_category["activations"] == 0


def test_views_tied_weights_and_flat_grad_buffer_count_once():
    emb = torch.nn.Embedding(11, 4)
    head = torch.nn.Linear(4, 11, bias=False)
    head.weight = emb.weight  # tied embedding / LM head
    model = torch.nn.ModuleList([emb, head])
    with MemoryTracker(model=model) as mt:
        flat = torch.zeros(11 * 4)
        emb.weight.grad = flat.view(11, 4)  # grad aliases a flat buffer
        mt.register(flat[:10], "gradients")  # a view of the same storage: still once
        mt.mark("tied")
    sample = mt.samples[-2]
    assert sample.by_category["parameters"] == 11 * 4 * F32
    assert sample.by_category["gradients"] == 11 * 4 * F32
    assert sample.total == 2 * 11 * 4 * F32


def test_freed_parameter_leaves_the_timeline():
    param = torch.nn.Parameter(torch.empty(0))
    mt = MemoryTracker()
    mt.register([param], "parameters")
    with mt:
        param.data = torch.ones(1000)  # "all-gathered" full parameter
        mt.mark("gathered")
        param.data = torch.ones(250)  # back to the shard: the full one is freed
        mt.mark("resharded")
        buffer = torch.ones(500)
        mt.tag(buffer, "all_gather")
        mt.mark("buffer")
        buffer.untyped_storage().resize_(0)  # FSDP's way of freeing a gathered param
        mt.mark("resized")
    by_label = {s.label: s for s in mt.samples}
    assert by_label["gathered"].by_category["parameters"] == 1000 * F32
    assert by_label["resharded"].by_category["parameters"] == 250 * F32
    assert by_label["buffer"].by_category["all_gather"] == 500 * F32
    assert by_label["resized"].by_category["all_gather"] == 0
    assert by_label["resized"].total == 250 * F32


def test_replaced_module_parameter_is_seen():
    linear = torch.nn.Linear(10, 10, bias=False)
    with MemoryTracker(model=linear) as mt:
        mt.mark("full")
        linear.weight = torch.nn.Parameter(torch.zeros(5))  # the module now holds a shard
        mt.mark("shard")
    by_label = {s.label: s for s in mt.samples}
    assert by_label["full"].by_category["parameters"] == 100 * F32
    assert by_label["shard"].by_category["parameters"] == 5 * F32
    assert by_label["shard"].total == 5 * F32


def test_the_flat_parameter_walk_finds_what_parameters_finds():
    """_roots walks modules by hand (it runs at every sample); it must list what parameters()
    lists: a module reached twice, a tied weight, a None slot, a child added after the tracker
    was made, and a module class with its own parameters()."""
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(3, 4, bias=False))
    model.register_parameter("unused", None)
    emb = torch.nn.Embedding(4, 3)
    emb.weight = model[3].weight  # tied: one Parameter in two modules
    model.append(emb)
    found = []
    memory._parameters_of(model, found)
    assert [id(p) for p in found] != [] and len(found) == len({id(p) for p in found})
    assert {id(p) for p in found} == {id(p) for p in model.parameters()}
    model.append(torch.nn.Linear(2, 2))  # a later child is seen: nothing is cached
    found = []
    memory._parameters_of(model, found)
    assert {id(p) for p in found} == {id(p) for p in model.parameters()}

    class OnlyTheHead(torch.nn.Module):  # a wrapper that names its parameters itself
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(5, 5), torch.nn.Linear(5, 1)

        def parameters(self, recurse=True):
            return self.head.parameters(recurse)

    wrapper = OnlyTheHead()
    found = []
    memory._parameters_of(wrapper, found)
    assert [id(p) for p in found] == [id(p) for p in wrapper.head.parameters()]
    with MemoryTracker(model=wrapper) as mt:
        mt.mark("now")
    assert mt.samples[-1].by_category["parameters"] == (5 + 1) * F32

    class HidesItsChild(torch.nn.Module):  # deeper: a submodule that lists its modules itself
        def __init__(self):
            super().__init__()
            self.kept, self.hidden = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)

        def named_modules(self, memo=None, prefix="", remove_duplicate=True):
            return self.kept.named_modules(memo, prefix, remove_duplicate)

    outer = torch.nn.Sequential(torch.nn.Linear(4, 4), HidesItsChild())
    found = []
    memory._parameters_of(outer, found)
    assert {id(p) for p in found} == {id(p) for p in outer.parameters()}
    assert not {id(p) for p in outer[1].hidden.parameters()} & {id(p) for p in found}


def test_tag_beats_parameters_for_views_of_a_gather_buffer():
    linear = torch.nn.Linear(4, 4, bias=False)
    with MemoryTracker(model=linear) as mt:
        gathered = mt.tag(torch.zeros(16), "all_gather")
        linear.weight.data = gathered.view(4, 4)
        mt.mark("gathered")
    sample = mt.samples[-2]
    assert sample.by_category["all_gather"] == 16 * F32
    assert sample.by_category["parameters"] == 0


def test_categories_add_up_and_peak_catches_a_transient():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(3, 8)
    mt = MemoryTracker(model=model, optimizer=opt)
    with mt:
        for _ in range(2):
            one_adamw_step(mt, model, opt, x)
            opt.zero_grad()
        memory.notify("between steps")  # what the tracer calls at collectives
        before = mt.samples[-1].total
        transient = torch.empty(10_000)
        del transient
        mt.mark("after transient")
    for sample in mt.samples:
        assert set(sample.by_category) == set(CATEGORIES)
        assert sum(sample.by_category.values()) == sample.total
    peak = mt.peak()
    assert all(peak.total >= s.total for s in mt.samples)
    assert peak.total >= before + 10_000 * F32
    assert sum(peak.by_category.values()) == max(s.total for s in mt.samples)
    assert any(s.label == "between steps" for s in mt.samples)


def test_notify_is_a_no_op_without_a_tracker_and_unknown_category_raises():
    memory.notify("nothing listening")
    with pytest.raises(ValueError, match="all_gather"):
        MemoryTracker().tag(torch.zeros(1), "all-gather")
    with pytest.raises(RuntimeError):
        MemoryTracker().mark("outside")


def test_worker_hooks_return_a_picklable_record():
    memory.worker_begin(1, 2)
    model = torch.nn.Linear(3, 3)
    with MemoryTracker(model=model, name="ddp") as mt:
        mt.mark("a")
    record = pickle.loads(pickle.dumps(memory.worker_end()))
    assert isinstance(record, MemoryRecord) and (record.rank, record.world_size) == (1, 2)
    assert record.peak().by_category["parameters"] == 12 * F32
    assert "parameters" in record.table()
    memory.worker_begin(0, 1)
    assert memory.worker_end() is None


def test_two_trackers_on_one_rank_merge_and_restore_resize():
    original_resize = torch.UntypedStorage.resize_
    memory.worker_begin(0, 1)
    for name, size in (("ddp", 100), ("zero", 40)):
        with MemoryTracker(name=name) as mt:
            shard = torch.nn.Parameter(torch.zeros(size))
            mt.register(shard, "parameters")
            mt.mark("params")
            assert mt.samples[-1].by_category["parameters"] == size * F32
    record = memory.worker_end()
    assert torch.UntypedStorage.resize_ is original_resize
    assert [s.label for s in record.samples if s.label.endswith("params")] == ["ddp: params", "zero: params"]
    assert record.peak_total == 100 * F32


def test_matches_torch_memtracker_after_one_adamw_step():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = torch.nn.Linear(7, 13)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(5, 7)
    theirs = MemTracker()
    theirs.track_external(model, opt, x)
    with theirs:
        model(x).sum().backward()
        opt.step()
        snap = next(iter(theirs.get_tracker_snapshot("current").values()))
    by_name = {getattr(k, "value", k): v for k, v in snap.items()}
    opt.zero_grad()
    ours = MemoryTracker(model=model, optimizer=opt)
    with ours:
        model(x).sum().backward()
        opt.step()
        mine = ours.current().by_category
    assert mine["parameters"] == by_name["Parameter"]
    assert mine["gradients"] == by_name["Gradient"]
    assert mine["optimizer"] == by_name["Optstate"]


def _sample_records(world_size=2):
    records = []
    for rank in range(world_size):
        memory.worker_begin(rank, world_size)
        model = torch.nn.Linear(32, 32 * (rank + 1))
        opt = torch.optim.AdamW(model.parameters())
        with MemoryTracker(model=model, optimizer=opt) as mt:
            one_adamw_step(mt, model, opt, torch.randn(8, 32))
            with mt.phase("all_gather"):
                mt.tag(torch.empty(1024), "all_gather")
        records.append(memory.worker_end())
    return records


def test_plots_render_to_png(tmp_path):
    import matplotlib.pyplot as plt

    assert set(CATEGORIES) <= set(MEMORY_COLORS)
    records = _sample_records()
    figures = {
        "timeline_ranks": memory_plot.plot_memory_timeline(
            records, theory={"16P": 16 * 32 * 33}, title="two ranks"
        ),
        "timeline_one": memory_plot.plot_memory_timeline(records[0], x="time"),
        "bars": memory_plot.plot_memory_bars(
            {"DDP": records, "ZeRO-1": records[:1], "predicted": {"parameters": 4000, "optimizer": 8000}},
            theory={"DDP": 20_000, "ZeRO-1": {"parameters": 4224, "gradients": 4224, "optimizer": 4232}},
        ),
    }
    for name, fig in figures.items():
        path = tmp_path / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        assert path.stat().st_size > 10_000


def _tracked_rank_step():
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    with MemoryTracker(model=model, optimizer=opt) as mt:
        one_adamw_step(mt, model, opt, torch.randn(4, 16))
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
        mt.mark("after all_reduce")
    return mt.peak().total, [s.label for s in mt.samples]


def test_labkit_run_returns_one_record_per_rank():
    import labkit

    if not hasattr(labkit, "run"):
        pytest.skip("labkit.run not available yet")
    results = labkit.run(_tracked_rank_step, world_size=2, backend="gloo", timeout=60.0)
    assert [r.rank for r in results.memory] == [0, 1]
    assert [r.peak_total for r in results.memory] == [peak for peak, _ in results]
    labels = results[0][1]
    assert any("all_reduce" in label for label in labels), labels  # the tracer's notify() samples
    assert results.memory[0].peak().by_category["optimizer"] == 2 * (16 * 16 + 16) * F32 + 2 * F32


def test_timeline_thins_crowded_tick_labels_and_keeps_the_peak():
    import matplotlib.pyplot as plt
    import numpy as np
    from labkit.observe.memory_plot import MAX_TICK_LABELS

    model = torch.nn.Linear(8, 8)
    with MemoryTracker(model=model) as mt:
        for i in range(40):
            held = torch.empty(64 * (50 - abs(i - 25)))  # grows, peaks at mark 25, shrinks
            mt.mark(f"mark {i}")
            del held
    record = mt.record()
    fig = memory_plot.plot_memory_timeline(record)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    plt.close(fig)
    assert len(labels) <= MAX_TICK_LABELS, labels
    assert record.samples[int(np.argmax(record.high_water))].label in labels, labels


def test_phase_names_never_overlap_on_the_timeline():
    """Short phases side by side (an optimizer step after a long backward) once drew their names
    over each other ("optimoptimizer"); each name now fits its row or is left out."""
    import matplotlib.pyplot as plt

    model = torch.nn.Linear(8, 8)
    with MemoryTracker(model=model) as mt:
        for name, marks in (
            ("forward", 30),
            ("backward", 40),
            ("optim", 1),
            ("optimizer", 1),
            ("zero_grad", 1),
            ("forward", 2),
        ):
            with mt.phase(name):
                for i in range(marks):
                    held = torch.empty(64 * (i + 1))
                    mt.mark(f"{name} {i}")
                    del held
    fig = memory_plot.plot_memory_timeline(mt.record())
    fig.canvas.draw()
    ax = fig.axes[0]
    names = [
        t for t in ax.texts if t.get_text() in {"forward", "backward", "optim", "optimizer", "zero_grad"}
    ]
    boxes = [t.get_window_extent() for t in names]
    plt.close(fig)
    assert {"forward", "backward"} <= {t.get_text() for t in names}
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (names[i].get_text(), names[j].get_text())


def test_a_theory_line_can_skip_a_panel():
    import matplotlib.pyplot as plt

    records = _sample_records()
    fig = memory_plot.plot_memory_timeline(records, theory={"16P/N": [5000, None]})
    lines = [[t.get_text() for t in ax.texts if t.get_text().startswith("16P/N")] for ax in fig.axes[:2]]
    plt.close(fig)
    from labkit.units import fmt_bytes

    assert lines == [["16P/N = " + fmt_bytes(5000)], []], lines
