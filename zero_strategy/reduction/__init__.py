"""Layer 5, gradient reduction: the gradient schedules (by type), the reducer that
reduce-scatters (or all-reduces) buckets and finishes and clips gradients, and top-k
compression with error feedback. Its policy, ``ReducePolicy`` (``policy.py``: overlap, the
ZeRO-1/2 bucket size, the compression section, the wire format of the reductions), is what the reducer is built from.

May import: ``sharding``, ``storage``, ``comm``, ``config``.
"""
