# ---
# jupyter:
#   kernelspec:
#     display_name: Python (labkit course)
#     language: python
#     name: labkit
# ---

# %% [markdown]
# # 00 · Set-up: real ranks from a notebook cell
#
# Every lab in this course runs **real** `torch.distributed` ranks: separate processes, each with
# its own rank, talking over gloo (CPU) or NCCL (one GPU per rank). `labkit.run` starts them from
# a cell and brings their return values back as a list indexed by rank.
#
# This notebook checks your environment, launches 2 and 4 ranks, and shows what a failing rank and
# a hang look like — so that when it happens in a lab, you know how to read it.

# %%
import labkit  # first (it needs no torch): the ranks' forkserver imports torch on another core meanwhile
import os, sys, time
import torch, torch.distributed as dist

print(f"python {sys.version.split()[0]} · torch {torch.__version__} · {os.cpu_count()} CPU cores")
print(f"GPUs visible: {torch.cuda.device_count()} · gloo available: {dist.is_gloo_available()}")

# %% [markdown]
# ## Hello from every rank
# A rank function is an ordinary Python function. Inside it, plain `torch.distributed` works, and
# `labkit.device()` is the rank's device (`cpu` with gloo, `cuda:<rank>` with NCCL).


# %%
def hello():
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"hello from rank {rank} of {world}")
    return f"rank {rank}: backend={dist.get_backend()} device={labkit.device()}"


# %%
# NBVAL_CHECK_OUTPUT
results = labkit.run(hello, world_size=2)
results

# %% [markdown]
# Each line a rank printed carries its `[rank r]` prefix. The return value is a list indexed by
# rank. Now four ranks, each contributing `rank + 1` to an all-reduce: every rank must end with
# 1 + 2 + 3 + 4 = 10.


# %%
def contribute():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)  # SUM over ranks, in place, on every rank
    return t.item()


sums = labkit.run(contribute, world_size=4)
print(sums, "match" if sums == [10.0] * 4 else "MISMATCH")

# %% [markdown]
# ## How long does a launch take?
# The first launch in a kernel starts a *forkserver* with torch already imported; every later
# launch forks from it. Measured here, in this run:

# %%
times = []
for _ in range(5):
    t0 = time.perf_counter()
    labkit.run(contribute, world_size=4)
    times.append(time.perf_counter() - t0)
print("4-rank launches (s):", " ".join(f"{t:.2f}" for t in times))
print(f"median {sorted(times)[2]:.2f} s")

# %% [markdown]
# ## When a rank fails
# If any rank raises, the cell raises one `labkit.RankError` naming the failing rank, the exception
# and its traceback — the root cause first. Rank 0 below was waiting in `all_reduce` for rank 1;
# labkit stops it instead of letting it hang.


# %% tags=["raises-exception"]
def shard_sizes_disagree():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 computed a shard of 7 elements, expected 8")
    dist.all_reduce(torch.ones(8))


labkit.run(shard_sizes_disagree, world_size=2)

# %% [markdown]
# ## When ranks hang
# A rank that never joins a collective makes its peers wait forever. `timeout=` turns that into an
# error that shows **where each rank is stuck** (its Python stack).


# %% tags=["raises-exception"]
def forgot_to_send():
    t = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.recv(t, src=1)  # rank 1 never sends
    return t.item()


labkit.run(forgot_to_send, world_size=2, timeout=3)

# %% [markdown]
# ## Nothing is left behind
# After success, failure or a hang, labkit has stopped every rank it started. The only processes
# that remain are the forkserver and its resource tracker, which the next launch reuses.

# %%
# NBVAL_CHECK_OUTPUT
import psutil

me = psutil.Process()
server = [p for p in me.children() if "forkserver" in " ".join(p.cmdline())]
ranks_alive = [c for s in server for c in s.children() if c.status() != psutil.STATUS_ZOMBIE]
print("rank processes still alive:", len(ranks_alive))

# %% [markdown]
# ## Summary
# - `labkit.run(fn, *args, world_size=N)` runs `fn` on N real ranks and returns their values by rank.
# - Output is prefixed by rank; failures name the rank and show its traceback; hangs show stacks.
# - The same `fn` runs unchanged under `torchrun` on a GPU cluster (see the README).
#
# **Exercises**
# 1. Make `contribute` use `dist.ReduceOp.MAX`. What does each rank get?
# 2. Run `hello` with `world_size=8` on this machine. What does the note say, and why is it only a note?
# 3. In `forgot_to_send`, add the missing `dist.send` on rank 1 so the cell succeeds.
