"""A sharded checkpoint of the Trainer's ``ZeroStrategy`` as one Lightning checkpoint: the full
fp32 weights as ``state_dict`` and the Trainer's own state (epoch, step, hyperparameters, loops,
callbacks) beside them, without optimizer state, the counterpart of Lightning's
``convert_zero_checkpoint_to_fp32_state_dict`` for DeepSpeed.

- ``convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file)`` and the command
  ``zero-strategy convert CHECKPOINT OUT.ckpt`` write it as one file, for
  ``LightningModule.load_from_checkpoint``, ``load_state_dict`` or a DDP run;
- ``LightningModule.load_from_checkpoint(checkpoint_dir)`` reads the directory itself once
  ``lightning_zero`` is imported: Lightning's checkpoint reader (``core.saving.pl_load``) is
  wrapped so that a ``zero_strategy`` checkpoint directory is read through ``load_zero_checkpoint``;
  everything else goes to Lightning's own reader unchanged. Fabric's ``TorchCheckpointIO`` (the
  reader of ``Trainer(...).fit/test(ckpt_path=...)`` under any other strategy) raises
  ``ShardedCheckpointError`` for such a directory, naming ``ZeroStrategy`` and ``zero-strategy
  convert``, instead of the bare ``IsADirectoryError`` of opening a directory as a file. A process
  that never imports ``lightning_zero`` still gets Lightning's bare error (nothing of ours runs
  there): import it, or convert.

The conversion runs offline in one process (no ranks, no process group), one tensor at a time
from the shards, whatever the number of ranks and the stage that wrote them. Only the full
weights are held in memory, as with a ``.ckpt`` file.
"""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Any

import torch

import zero_strategy as zs
from lightning_zero._trainer import LIGHTNING_OBJECT

__all__ = ["ShardedCheckpointError", "convert_zero_checkpoint_to_fp32_state_dict", "install_checkpoint_reader",
           "is_zero_checkpoint", "load_zero_checkpoint", "main"]  # fmt: skip

_META = "zero_meta.json"  # what marks a zero_strategy checkpoint directory


class ShardedCheckpointError(IsADirectoryError):
    """A reader that takes one checkpoint file was given a sharded ZeroStrategy directory (an
    ``IsADirectoryError``, as before, with the fix in its message)."""


def _sharded_error(path: Any, call: str) -> ShardedCheckpointError:
    p = os.fspath(path)
    return ShardedCheckpointError(
        f"{call}: {p!r} is a sharded zero_strategy checkpoint directory (ZeroStrategy's), not one checkpoint file. "
        "Resume it with strategy=lightning_zero.ZeroStrategy(...) (any number of devices, any stage), or write one "
        f"fp32 .ckpt (weights and the Trainer's state, no optimizer state): `zero-strategy convert {p} out.ckpt`, "
        "then ckpt_path='out.ckpt' or Model.load_from_checkpoint('out.ckpt'), which also reads the directory itself "
        "once lightning_zero is imported"
    )


def is_zero_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a local directory written by ``zero_strategy.save_checkpoint`` (its
    root, whose ``latest`` is followed, or a versioned subdirectory)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return False
    try:
        return os.path.isfile(os.path.join(zs.resolve_checkpoint(path), _META))
    except (ValueError, OSError):
        return False


def load_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, map_location: Any = None, weights_only: bool | None = True
) -> dict[str, Any]:
    """The Lightning checkpoint dict of a sharded checkpoint: the Trainer's state with the full
    weights (floating tensors in fp32) as ``state_dict``, on the CPU unless ``map_location`` is a
    device. ``weights_only`` as for ``torch.load`` (None reads as True); pass False only for
    checkpoints you trust."""
    path = os.fspath(checkpoint_dir)
    if not is_zero_checkpoint(path):
        raise ValueError(
            f"{path!r} is not a zero_strategy checkpoint directory (no {_META} in it or in what its `latest` names); "
            "give the directory ModelCheckpoint or trainer.save_checkpoint wrote under ZeroStrategy"
        )
    try:
        state = zs.read_checkpoint_object(path, LIGHTNING_OBJECT, weights_only=weights_only)
    except ValueError as exc:
        raise ValueError(
            f"{path!r} holds no Lightning Trainer state ({exc}); it was not written by the Trainer's ZeroStrategy. "
            "`zero-strategy export CHECKPOINT OUT.safetensors` writes its weights alone"
        ) from None
    weights = zs.full_state_dict(path, dtype=torch.float32)
    if isinstance(map_location, (str, torch.device)):
        weights = {name: t.to(map_location) for name, t in weights.items()}
    return {**state, "state_dict": weights}


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str],
    tag: str | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Write the sharded checkpoint ``checkpoint_dir`` as one Lightning ``.ckpt`` file and return
    its dict (see ``load_zero_checkpoint``). ``tag``: a versioned subdirectory (default: the one
    ``latest`` names). The file is written whole or not at all (a temporary file, then renamed)."""
    source = os.path.join(os.fspath(checkpoint_dir), tag) if tag else os.fspath(checkpoint_dir)
    out = os.fspath(output_file)
    if os.path.isdir(out):
        raise ValueError(f"convert: the output {out!r} is a directory; give a file name such as model.ckpt")
    checkpoint = load_zero_checkpoint(source, weights_only=weights_only)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        torch.save(checkpoint, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return checkpoint


def install_checkpoint_reader(ns: str) -> None:
    """Let ``load_from_checkpoint`` of namespace ``ns`` (``lightning.pytorch`` or
    ``pytorch_lightning``) read a zero_strategy checkpoint directory, and its fabric's
    ``TorchCheckpointIO`` name the fix for one (idempotent)."""
    fabric = "lightning.fabric" if ns == "lightning.pytorch" else "lightning_fabric"
    _wrap_reader(f"{ns}.core.saving", load_zero_checkpoint)

    def refuse(path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        raise _sharded_error(path, "TorchCheckpointIO.load_checkpoint (Trainer ckpt_path=...)")

    _wrap_reader(f"{fabric}.plugins.io.torch_io", refuse)


def _wrap_reader(module_name: str, on_directory: Any) -> None:
    """The module's ``pl_load`` (Lightning's reader, read as the module global at each call)
    hands a zero_strategy checkpoint directory to ``on_directory``; once."""
    module = importlib.import_module(module_name)
    original = module.pl_load
    if getattr(original, "_zero_strategy_reader", False):
        return

    def pl_load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if is_zero_checkpoint(path_or_url):
            return on_directory(path_or_url, map_location=map_location, weights_only=weights_only)
        return original(path_or_url, map_location=map_location, weights_only=weights_only)

    pl_load._zero_strategy_reader = True  # type: ignore[attr-defined]  # marks the wrapper: installed once
    pl_load.__wrapped__ = original  # type: ignore[attr-defined]  # Lightning's own reader
    setattr(module, "pl_load", pl_load)  # noqa: B010  # Lightning reads the module global at each call


def main(argv: list[str] | None = None) -> None:
    """``zero-strategy convert CHECKPOINT OUT.ckpt [--tag TAG] [--allow-pickle]``."""
    parser = argparse.ArgumentParser(
        prog="zero-strategy convert",
        description="Write a sharded checkpoint of Lightning's ZeroStrategy as one fp32 Lightning .ckpt "
        "(full weights and the Trainer's state, no optimizer state) for LightningModule.load_from_checkpoint.",
    )
    parser.add_argument("checkpoint", help="the checkpoint directory (ModelCheckpoint's or trainer.save_checkpoint's)")
    parser.add_argument("out", help="the .ckpt file to write")
    parser.add_argument("--tag", help="a versioned subdirectory to convert (default: the one `latest` names)")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read the Trainer's state with full unpickling (weights_only=False): only for checkpoints you trust",
    )
    ns = parser.parse_args(argv)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(ns.checkpoint, ns.out, ns.tag, weights_only=not ns.allow_pickle)
    except (ValueError, OSError, RuntimeError) as exc:
        parser.exit(1, f"zero-strategy convert: error: {exc}\n")
    print(ns.out)
