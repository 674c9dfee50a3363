"""Layer 5, offload tiers: the engine's handle on swap files (``DiskTier``) and the optimizer
state stepped group by group through them (``SwappedOptimizerState``). These sit above
``sharding`` because they work on shard groups; the primitives they use are in ``storage``.

May import: ``sharding``, ``storage``, ``comm``, ``config``. Not ``reduction`` (a sibling).
"""
