"""What happened on each rank, recorded and drawn.

tracing       collective + compute-span recorder (results.traces[rank])
recording     a rank's recording: worker_begin/worker_end, paused(), and the patch that
              records torch.distributed collectives called from Python
trace_stats   numbers from traces: steps, collective counts, overlap, bus bandwidth
timeline      the Gantt chart of a run's traces
memory        per-rank memory by category (MemoryTracker; results.memory[rank])
_memory_ledger  the storage ledger behind MemoryTracker
memory_record the picklable MemoryRecord and its types
memory_plot   memory timeline and bar charts
style         shared colors and fonts (the byte formatter is labkit.units.fmt_bytes)
"""
