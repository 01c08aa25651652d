"""Hand-written collectives.

    collectives   ring / naive all-reduce, reduce-scatter, all-gather (sync and async handles)
    _ring         the ring schedule and one ring pass
    _comm_thread  the communication thread behind async_op=True
    _crosscheck   every rank called the same collective with matching shapes (or a clear error)
"""
