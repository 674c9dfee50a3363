"""Layer 3, storage primitives: where bytes live, independent of how they are sharded. Offload
policies by type (``OnDevice``, ``OnHost``, ``OnDisk``), swap files with their aligned
asynchronous I/O, and the fixed-size rows on disk that ZeRO-3 parameters use.

May import: ``comm``, ``config``.
"""
