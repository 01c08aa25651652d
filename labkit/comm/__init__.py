"""Hand-written collectives.

collectives   ring / naive all-reduce, reduce-scatter, all-gather (sync and async handles);
              picks the ring or the direct exchange by size (DIRECT_MAX_BYTES)
flat          on top of them: padded reduce-scatter / all-gather (any numel) and the
              coalesced all-gather (several pairs, one collective: ZeRO-2's buckets)
all_to_all    all_to_all_single (torch's signature, on the mailbox: splits checked across ranks,
              uneven and empty ones), its autograd form (AllToAll, all_to_all_autograd);
              all_to_all_single is re-exported here as labkit.comm.all_to_all_single
p2p           traced point-to-point: send / recv (async, a pipeline's) and sendrecv (a ring step: ring attention's K/V)
hierarchical  the two-level all-reduce (reduce-scatter in the node, all-reduce across nodes,
              all-gather in the node) on a 2-D device mesh; node_mesh() from the topology
_link         every send's cost on the simulated two-level network, and its byte counts
_ring         the ring schedule and one ring pass
_direct       the direct exchange for small messages (one message per pair, same bits)
_dispatch     what every collective does around its algorithm: argument checks, the rank's
              place in its group, direct-or-ring, the cross-rank check, the comm-thread hand-off
_comm_thread  the communication thread behind async_op=True
_crosscheck   every rank called the same collective with matching shapes (or a clear error);
              the reused message buffers both algorithms start with
"""

from labkit.comm.all_to_all import all_to_all_single

__all__ = ["all_to_all_single"]
