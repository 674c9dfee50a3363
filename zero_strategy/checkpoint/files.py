"""The files of a checkpoint: read safely, written durably, named inside their root.

**Reading untrusted files.** DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain
``pickle``, so a crafted file runs code; torch's ``weights_only`` unpickler refuses DCP's
metadata. :class:`SafeFileSystemReader` unpickles it with an allow-list (the DCP metadata
classes, ``_StorageInfo``, ``torch.Size``, dtypes, layouts and ``pathlib`` paths: nothing that
runs code), then requires every entry to be a tensor (a "bytes" entry would make DCP
``torch.load(weights_only=False)`` its data) and every data file to be a plain file name inside
the checkpoint directory. DCP itself reads tensors with ``weights_only=True``.

**Writing.** DCP writes and fsyncs the files; the streams it writes through compute a CRC32 of
every file as it is written, so no second pass is needed, and :func:`verify_checksums` finds a
flipped byte on load. :func:`write_atomic` and :func:`fsync_dir` make small files and directory
entries durable.

**Names.** ``latest`` and every name in ``zero_meta.json`` must be a plain name that resolves
inside the checkpoint root (no absolute path, no ``..``, no symlink out of it).

**Ownership.** Each versioned directory carries ``.zero_owner.json`` (host, process, job id and
creation time), written when rank 0 creates the directory exclusively. Pruning only removes
directories that carry it and are complete, or whose owner process is gone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import socket
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

__all__ = [
    "single_process_quiet",
    "OWNER",
    "CheckpointFileError",
    "SafeFileSystemReader",
    "checksumming_writer",
    "check_plain_name",
    "fsync_dir",
    "inside",
    "owner_record",
    "owner_is_gone",
    "verify_checksums",
    "write_atomic",
]

OWNER = ".zero_owner.json"


class CheckpointFileError(RuntimeError):
    """A checkpoint file is unsafe, outside its directory, missing, truncated or corrupted."""


# --------------------------------------------------------------------------- reading

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    | {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")}
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def check_plain_name(name: Any, what: str) -> str:
    """``name`` must be one path component: no separator, not absolute, not ``.``/``..``."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or os.path.isabs(name)
    ):
        raise CheckpointFileError(
            f"{what}: {name!r} is not a plain file name inside the checkpoint; the file was altered"
        )
    return name


def inside(root: str | os.PathLike[str], name: object, what: str) -> str:
    """``root/name`` after checking ``name`` (any value read from a file: it must be a plain
    name) and that it resolves inside ``root`` (symlinks too)."""
    path = os.path.join(os.fspath(root), check_plain_name(name, what))
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointFileError(f"{what}: {name!r} resolves to {real}, outside {real_root}; refusing to follow it")
    return path


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read without running code (see the module docstring).

    ``bytes_entries=True`` (another engine's checkpoint, ``foreign.py``) accepts non-tensor
    entries in the metadata; they are never loaded through DCP (which would unpickle them with
    ``torch.load(weights_only=False)``), only read by :func:`read_bytes_entry`."""

    def __init__(self, path: Any, *args: Any, bytes_entries: bool = False, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.bytes_entries = bytes_entries

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        inside(self.path, os.path.basename(path), f"{self.path}: DCP metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointFileError(f"{path}: not a readable DCP metadata file ({exc}); refusing to load it") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointFileError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        bad = [k for k, v in metadata.state_dict_metadata.items() if not isinstance(v, TensorStorageMetadata)]
        if bad and not self.bytes_entries:
            raise CheckpointFileError(
                f"{path}: entries {bad[:5]} are not tensors; zero_strategy checkpoints hold tensors only (a non-tensor "
                "entry would be unpickled with torch.load(weights_only=False))"
            )
        for info in (metadata.storage_data or {}).values():
            inside(self.path, getattr(info, "relative_path", None), f"{path}: data file")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()  # None in older or edited files
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def tensor_entries(self) -> dict[str, TensorStorageMetadata]:
        """The checkpoint's entries by key (``read_metadata`` refuses any that is not a tensor)."""
        entries = self.read_metadata().state_dict_metadata
        return {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}


# --------------------------------------------------------------------------- writing


class _CRCStream(io.RawIOBase):
    """A write stream that keeps a CRC32 of everything written through it, in order."""

    def __init__(self, raw: Any, errors: list[OSError]) -> None:
        super().__init__()
        self._raw = raw
        self._errors = errors
        self.crc = 0
        self.in_order = True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        try:
            return self._raw.write(data)
        except OSError as exc:  # torch.save's C++ writer turns it into "unexpected pos": keep the real one
            self._errors.append(exc)
            raise

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not (offset == 0 and whence == io.SEEK_CUR):
            self.in_order = False  # a writer that moves around: hash the file afterwards
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


class _ChecksummingFileSystem(FileSystem):
    def __init__(self, sums: dict[str, int]) -> None:
        super().__init__()
        self.sums = sums
        self.errors: list[OSError] = []  # write errors seen (a full disk), first one first
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _CRCStream(raw, self.errors)
            yield stream
        name = Path(path).name
        name = name[: -len(".tmp")] if name.endswith(".tmp") else name  # DCP renames .metadata.tmp
        crc = stream.crc if stream.in_order else crc32_file(path)
        with self._lock:
            self.sums[name] = crc


def checksumming_writer(path: str | os.PathLike[str]) -> tuple[FileSystemWriter, dict[str, int], list[OSError]]:
    """A DCP writer for ``path`` (files fsynced), the dict it fills (file name -> CRC32) and the
    list of the write errors it met."""
    sums: dict[str, int] = {}
    fs = _ChecksummingFileSystem(sums)
    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = fs
    return writer, sums, fs.errors


def crc32_file(path: str | os.PathLike[str], chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def verify_checksums(path: str, files: dict[str, dict[str, int]], names: list[str]) -> None:
    """Check the size and CRC32 of each of ``names`` against ``files`` (from ``zero_meta.json``);
    raise naming the first file that is missing, truncated or corrupted."""
    for name in names:
        full = inside(path, name, f"{path}/zero_meta.json: file")
        want = files[name]
        if (
            not isinstance(want, dict)
            or not isinstance(want.get("size"), int)
            or not isinstance(want.get("crc32", 0), int)
        ):
            raise CheckpointFileError(
                f"{path}/zero_meta.json: the record of {name!r} is damaged ({want!r}); the checkpoint is corrupted"
            )
        if not os.path.exists(full):
            raise CheckpointFileError(
                f"checkpoint file {full!r} is missing; the checkpoint is incomplete (load an earlier one)"
            )
        size = os.path.getsize(full)
        if size != want["size"]:
            raise CheckpointFileError(
                f"checkpoint file {full!r} has {size} bytes, {want['size']} were written; it is truncated or corrupted "
                "(load an earlier checkpoint)"
            )
        if "crc32" in want and crc32_file(full) != want["crc32"]:
            raise CheckpointFileError(
                f"checkpoint file {full!r} does not match the checksum recorded when it was written: it is corrupted "
                "(load an earlier checkpoint)"
            )


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a new file, a rename) durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to a temporary file, fsync it, rename it over ``path``, fsync the directory."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


# --------------------------------------------------------------------------- ownership


def _job_id() -> str | None:
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"):
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def owner_record() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": _job_id(), "created": time.time()}


def owner_is_gone(owner: dict[str, Any]) -> bool:
    """Whether the process that created a directory has ended (only decidable on its own host;
    elsewhere it is assumed alive, so its directory is left alone)."""
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, KeyError, TypeError, ValueError):
        return False
    return False


def read_owner(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, OWNER)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP's save and load warn "torch.distributed is disabled ..." whenever no process group
    exists, which is the intended single-process case here (one process, ``export``,
    ``convert``): silence that one warning around the call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
