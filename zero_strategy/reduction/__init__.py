"""Layer 5, gradient reduction: the gradient schedules (by type), the reducer that
reduce-scatters (or all-reduces) buckets and finishes and clips gradients, and top-k
compression with error feedback.

May import: ``sharding``, ``storage``, ``comm``, ``config``.
"""
