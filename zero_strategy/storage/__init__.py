"""Layer 3, storage primitives: where bytes live, independent of how they are sharded. Offload
policies by type (``OnDevice``, ``OnHost``, ``OnDisk``), swap files with their aligned
asynchronous I/O, and the fixed-size rows on disk that ZeRO-3 parameters use. Its policy,
``StoragePolicy`` (``offload.py``), holds the two offload policies and whether a ``ratio: auto``
is still to be resolved; its builder reads the config's two offload sections only (a ``Protocol``),
and nothing here imports the config.

May import: ``comm``, ``config``.
"""
