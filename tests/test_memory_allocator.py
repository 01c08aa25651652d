"""The memory tracker's CUDA accounting, on CPU: the allocator's rounding (block_bytes), cuBLAS's
workspace size (cublas_workspace_bytes), and the categories "allocator" / "workspace" that make the
tracker's total equal torch.cuda.memory_allocated() and its peak max_memory_allocated(), with the
allocator's reading simulated (monkeypatch) over a tracker counting CPU tensors. Also the host pool
(mark_host, host_allocations) on one process. The real allocator: scripts/gpu_check.py."""

import torch

from labkit.observe import memory
from labkit.observe.memory import MemoryTracker, block_bytes, cublas_workspace_bytes

KiB, MiB = 1024, 1 << 20


def test_block_bytes_rounds_to_512_byte_blocks():
    assert block_bytes(0) == 0
    assert block_bytes(1) == 512
    assert block_bytes(512) == 512
    assert block_bytes(513) == 1024
    assert block_bytes(MiB) == MiB  # the small pool's largest request
    assert block_bytes(MiB + 1) == MiB + 512  # the large pool rounds to 512 too


def test_cublas_workspace_size():
    assert cublas_workspace_bytes(":4096:8") == 32 * MiB
    assert cublas_workspace_bytes(":16:8") == 128 * KiB
    assert cublas_workspace_bytes(":4096:2:16:8") == 8 * MiB + 128 * KiB
    assert cublas_workspace_bytes("", capability=(9, 0)) == 32 * MiB  # Hopper's default
    assert cublas_workspace_bytes("", capability=(8, 0)) == 8 * MiB + 128 * KiB
    try:
        cublas_workspace_bytes(":4096")
    except ValueError as e:
        assert "SIZE_KiB:COUNT" in str(e)
    else:
        raise AssertionError("an odd CUBLAS_WORKSPACE_CONFIG must raise")


class FakeAllocator:
    """memory_allocated = every live tracked tensor's block + a 32 MiB workspace once `matmul`
    ran; max_memory_allocated follows it (and a `spike` between samples)."""

    def __init__(self):
        self.tensors, self.workspace, self.max = [], 0, 0

    def allocated(self):
        live = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in self.tensors}
        return sum(block_bytes(n) for n in live.values()) + self.workspace

    def reading(self):
        now = self.allocated()
        self.max = max(self.max, now)
        return now, self.max, now + 3 * MiB


def _tracker(monkeypatch, fake):
    mt = MemoryTracker(device="cpu")
    monkeypatch.setattr(mt, "_cuda", fake.reading)
    return mt


def test_total_equals_allocated_and_parts_are_named(monkeypatch):
    fake = FakeAllocator()
    mt = _tracker(monkeypatch, fake)
    with mt:
        a = torch.zeros(1000)  # 4000 B -> a 4096 B block: 96 B of rounding
        b = torch.zeros(3)  # 12 B -> 512 B
        fake.tensors += [a, b]
        mt.register([a, b], "parameters")
        mt.mark("before matmul")
        fake.workspace = 32 * MiB  # cuBLAS's workspace at the first matmul
        mt.mark("after matmul")
    before, after = mt.samples[1], mt.samples[2]
    assert before.by_category["parameters"] == 4012
    assert before.by_category["allocator"] == 96 + 500
    assert before.by_category["workspace"] == 0
    assert before.total == fake.allocated() - 32 * MiB
    assert after.by_category["workspace"] == 32 * MiB
    assert after.total == fake.allocated()
    assert mt.device_samples[-1] == (fake.allocated(), fake.allocated() + 3 * MiB)


def test_peak_is_the_allocators_high_water(monkeypatch):
    fake = FakeAllocator()
    mt = _tracker(monkeypatch, fake)
    with mt:
        keep = torch.zeros(256)
        fake.tensors.append(keep)
        mt.register(keep, "parameters")
        mt.mark("one")
        spike = torch.zeros(10_000)  # allocated and freed between two samples
        fake.tensors.append(spike)
        fake.reading()  # the allocator saw it
        fake.tensors.pop()
        del spike
        mt.mark("two")
    assert mt.peak().total == fake.max == block_bytes(1024) + block_bytes(40_000)
    # Without a rise of max_memory_allocated: the tracked high-water plus the allocator's extra.
    assert mt.high_water[-1] >= mt.samples[-1].total


def test_cpu_tracker_has_no_allocator_categories():
    mt = MemoryTracker(device="cpu")
    with mt:
        mt.register(torch.zeros(10), "parameters")
        mt.mark("x")
    assert "allocator" not in mt.samples[-1].by_category
    assert mt.samples[-1].host == {}


def test_host_pool_apart_from_the_device_pool():
    mt = MemoryTracker(device="cpu")
    early = memory.mark_host(torch.zeros(100))  # marked before the tracker adopts it
    with mt:
        mt.register(early, "parameters")
        device = torch.zeros(50)
        mt.register(device, "parameters")
        with memory.host_allocations():
            state = torch.zeros(25)
        mt.register(state, "optimizer")
        late = torch.zeros(10)
        mt.register(late, "gradients")
        memory.mark_host(late)  # moved into the host pool after adoption
        mt.mark("after")
    sample = mt.samples[-1]
    assert sample.by_category["parameters"] == 200
    assert sample.total == 200
    assert sample.host == {"parameters": 400, "optimizer": 100, "gradients": 40}
    assert mt.record().host_peak == 540
    assert "host pool peak" in mt.record().table()
