"""Layer 2, communication: the only caller of ``torch.distributed`` (``collectives``: timed
waits, named errors, failure agreement), named profiler ranges, and the load-balance scores
that decide how unevenly ranks share the shards.

May import: ``config`` (and the bottom leaves).
"""
