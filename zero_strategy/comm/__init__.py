"""Layer 2, communication: the only caller of ``torch.distributed`` (``collectives``: timed
waits, named errors, failure agreement), named profiler ranges, and the load-balance scores
that decide how unevenly ranks share the shards. Its policy, ``CommPolicy`` (``policy.py``:
the timeout and the collective implementation), is what every context is made from.

May import: ``config`` (and the bottom leaves).
"""
