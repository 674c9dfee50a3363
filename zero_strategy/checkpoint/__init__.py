"""Layer 8, checkpoints: sharded save and load through ``torch.distributed.checkpoint``
(``state``), versioned directories and their pointer files (``versions``), safe file I/O
(``files``), uneven pieces for DCP (``dcp_pieces``), loading full state dicts and the offline
export to one file (``loading``, ``export``), and other engines' checkpoints: FSDP2's and
torchtitan's DCP directories, DeepSpeed's ZeRO partitions (``foreign``, ``deepspeed_files``).

May import: ``api`` and every layer below it. The public functions are re-exported here.
"""

from zero_strategy.checkpoint.state import load_checkpoint, save_checkpoint
from zero_strategy.checkpoint.versions import (
    begin_versioned_save,
    commit_versioned_save,
    read_checkpoint_object,
    resolve_checkpoint,
)

__all__ = [
    "begin_versioned_save",
    "commit_versioned_save",
    "load_checkpoint",
    "read_checkpoint_object",
    "resolve_checkpoint",
    "save_checkpoint",
]
