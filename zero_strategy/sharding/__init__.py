"""Layer 4, sharding: how parameters are cut and held. The flat layout of a rank's pieces,
shard groups and their master policies, ZeRO-3 units (placement policy, storage, the gathered
/sharded state machine), placeholders and ``sharded_init``, precision policies, checks made at
initialize, and bytes per kind and tier. Its policies: ``GatherPolicy`` (``gather_policy.py``:
prefetch, persistence, wire codec, hpZ, checks, the MoE switches) and ``Precision``
(``precision.py``), each built from the few settings it reads (a ``Protocol`` beside the builder).
MoE experts units, gathered by the router's selection, are the subpackage ``experts``.

May import: ``storage``, ``comm``, ``config``.
"""
