"""HSDP on real torchrun nodes: the lab's rank function (loop.train, strategy "hsdp") unchanged,
checked against single-process training and torch's fully_shard on the same 2-D mesh. Run one torchrun agent per node, e.g. two on this
machine (the test tests/test_hsdp_torchrun.py runs exactly this):

    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --rdzv-backend=c10d \
             --rdzv-endpoint=127.0.0.1:29400 scripts/hsdp_two_nodes.py      # node 0
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2 --rdzv-backend=c10d \
             --rdzv-endpoint=127.0.0.1:29400 scripts/hsdp_two_nodes.py      # node 1

The topology is torchrun's (labkit.topology(): LOCAL_WORLD_SIZE ranks per node, GROUP_RANK), the
mesh (nodes, ranks per node); nothing is throttled: the network is real. Prints rank 0's verdict.
"""

import sys

import torch.distributed as dist

import labkit
from labkit import loop
from labkit.checks import compare


def where():
    t = labkit.topology()
    return dist.get_rank(), t.node, t.local_rank, t.ranks_per_node


def main(steps=3):
    cfg = loop.PRESETS["toy"].replace(batch_size=8)
    places = labkit.run(where)
    out = labkit.run(loop.train, "hsdp", cfg, steps)
    torch_out = labkit.run(loop.train, "torch-hsdp", cfg, steps)  # fully_shard, the same 2-D mesh
    if dist.get_rank() != 0:
        return 0
    print("topology (rank, node, local rank, ranks per node):", list(places))
    reference = loop.reference(cfg, steps)
    nodes = len({p[1] for p in places})
    for rank, got in enumerate(out):
        compare(reference["grads"], got["grads"], rank=rank, world_size=len(out)).raise_if_failed()
        compare(reference["state"], got["state"], rank=rank, world_size=len(out)).raise_if_failed()
        compare(
            torch_out[rank]["state"], got["state"], rank=rank, world_size=len(out), label="hsdp vs torch-hsdp"
        ).raise_if_failed()
    print(f"hsdp on {nodes} nodes x {places[0][3]} ranks vs single-process and fully_shard: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
