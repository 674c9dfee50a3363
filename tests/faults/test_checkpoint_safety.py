"""Checkpoints that others may have written or damaged: nothing in them runs code, nothing
outside the root is followed, a flipped byte is named, a full disk or two jobs sharing a root
leave every checkpoint whole. Single process (world of one): the files' safety does not
depend on the number of ranks; the multi-rank agreement is in ``test_faults.py``."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint.files import CheckpointFileError


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return zs.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-2), stage=2)


def _train(model, opt, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.ones(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()


class _Payload:
    """Unpickling this creates ``marker``: the evidence that a loader ran the file's code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_meta_record(version: Path, name: str) -> None:
    """Record ``name``'s current size and checksum, so only the unpickler can stop it."""
    from zero_strategy.checkpoint.files import crc32_file

    meta_path = version / "zero_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][name] = {"size": (version / name).stat().st_size, "crc32": crc32_file(version / name)}
    meta_path.write_text(json.dumps(meta))


def test_malicious_metadata_and_object_files_run_no_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model()
    _train(model, opt)
    version = Path(zs.save_checkpoint(tmp_path / "ck", model, opt, objects={"trainer": {"step": 1}}))
    marker = tmp_path / "pwned"
    (version / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rewrite_meta_record(version, ".metadata")
    with pytest.raises(CheckpointFileError, match=r"\.metadata: not a readable DCP metadata file .*posix.system"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)
    with pytest.raises(CheckpointFileError, match="not a readable DCP metadata file"):
        zs.export_full(tmp_path / "ck", tmp_path / "out.safetensors")
    done = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "export", str(tmp_path / "ck"), str(tmp_path / "o.pt")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "not a readable DCP metadata file" in done.stderr, done.stderr[-2000:]
    torch.save(_Payload(str(marker)), version / "trainer.pt")
    _rewrite_meta_record(version, "trainer.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        zs.read_checkpoint_object(tmp_path / "ck", "trainer")
    # Lightning's weights_only=None stays safe where torch's default would not be
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        zs.read_checkpoint_object(tmp_path / "ck", "trainer", weights_only=None)
    assert not marker.exists(), "a checkpoint file ran code"


def test_metadata_entries_must_be_tensors_in_plain_files(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model, opt = _model()
    version = Path(zs.save_checkpoint(tmp_path / "ck", model, opt))
    original = (version / ".metadata").read_bytes()
    md = pickle.loads(original)
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = BytesStorageMetadata()  # DCP would torch.load(weights_only=False) it
    (version / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_meta_record(version, ".metadata")
    with pytest.raises(CheckpointFileError, match=rf"entries \['{key}'\] are not tensors"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)
    md = pickle.loads(original)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../outside.distcp"
    (version / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_meta_record(version, ".metadata")
    with pytest.raises(CheckpointFileError, match=r"'\.\./\.\./outside\.distcp' is not a plain file name"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)


def test_latest_and_file_names_stay_inside_the_root(tmp_path: Path) -> None:
    model, opt = _model()
    zs.save_checkpoint(tmp_path / "ck", model, opt)
    (tmp_path / "ck" / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointFileError, match=r"latest: '\.\./\.\./etc' is not a plain file name"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, tmp_path / "ck" / "sneaky")
    (tmp_path / "ck" / "latest").write_text("sneaky\n")
    with pytest.raises(CheckpointFileError, match="outside"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)
    (tmp_path / "ck" / "latest").write_text("step-0\n")
    meta_path = tmp_path / "ck" / "step-0" / "zero_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["/etc/passwd"] = {"size": 1}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointFileError, match="'/etc/passwd' is not a plain file name"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)


def test_a_flipped_byte_is_named(tmp_path: Path) -> None:
    model, opt = _model()
    _train(model, opt)
    version = Path(zs.save_checkpoint(tmp_path / "ck", model, opt))
    shard = next(version.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=rf"{shard.name}' does not match the checksum"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)


def test_a_full_disk_removes_the_partial_save_and_keeps_the_last_good_one(tmp_path: Path, monkeypatch) -> None:
    from zero_strategy.checkpoint import files as checkpoint_files

    model, opt = _model()
    _train(model, opt)
    zs.save_checkpoint(tmp_path / "ck", model, opt)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt)
    written = [0]

    class FullDisk:
        """The file under the writer: it fills up after 200 bytes."""

        def __init__(self, raw) -> None:
            self.raw = raw

        def write(self, data):
            written[0] += len(memoryview(data))
            if written[0] > 200:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.raw.write(data)

        def __getattr__(self, name):
            return getattr(self.raw, name)

    real_init = checkpoint_files._CRCStream.__init__
    monkeypatch.setattr(
        checkpoint_files._CRCStream, "__init__", lambda self, raw, errors: real_init(self, FullDisk(raw), errors)
    )
    with pytest.raises(
        RuntimeError, match=r"writing .*step-2.* failed .*No space left on device.*partial directory was removed"
    ):
        zs.save_checkpoint(tmp_path / "ck", model, opt)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["latest", "step-1"]
    zs.load_checkpoint(tmp_path / "ck", model, opt)  # the previous checkpoint is whole
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[k]), k


def test_pruning_touches_only_our_complete_or_abandoned_directories(tmp_path: Path) -> None:
    from zero_strategy.checkpoint.files import OWNER

    root = tmp_path / "ck"
    model, opt = _model()
    zs.save_checkpoint(root, model, opt, tag="a")
    (root / "foreign").mkdir()  # another tool's checkpoint (no owner marker): never touched
    (root / "foreign" / ".metadata").write_bytes(b"x")
    (root / "in-progress").mkdir()  # another live job's save (pid 1 is alive): never touched
    (root / "in-progress" / OWNER).write_text(json.dumps({"host": os.uname().nodename, "pid": 1, "created": 0.0}))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout
    (root / "abandoned").mkdir()  # a killed job's partial save: its process is gone
    (root / "abandoned" / OWNER).write_text(json.dumps({"host": os.uname().nodename, "pid": int(dead), "created": 0.0}))
    zs.save_checkpoint(root, model, opt, tag="b", keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["b", "foreign", "in-progress", "latest"]


_SAVER = textwrap.dedent("""
    import sys, torch, zero_strategy as zs
    seed, root = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    model, opt = zs.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
    for step in range(6):
        with torch.no_grad():
            model.weight.fill_(seed * 100 + step)
        zs.save_checkpoint(root, model, opt, extra={"seed": seed, "step": step})  # both jobs: "step-0"
""")


def test_two_jobs_saving_into_one_root_never_mix(tmp_path: Path) -> None:
    """Two processes save six checkpoints each, all under the same default tag (step-0), into one
    root at the same time (a requeued job overlapping the old one): every directory holds one
    job's save whole."""
    script = tmp_path / "saver.py"
    script.write_text(_SAVER)
    root = tmp_path / "ck"
    procs = [subprocess.Popen([sys.executable, str(script), str(seed), str(root)], stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    dirs = sorted(p for p in root.iterdir() if p.is_dir())
    assert len(dirs) == 12, [d.name for d in dirs]
    model, opt = zs.initialize(torch.nn.Linear(64, 64), lambda p: torch.optim.SGD(p, lr=0.1), stage=2)
    for d in dirs:
        extra = zs.load_checkpoint(d, model, opt)
        expected = extra["seed"] * 100 + extra["step"]
        assert torch.all(model.weight == expected), (d.name, extra)  # no shard of the other job


@pytest.mark.parametrize("point", ["before_write", "after_shards", "after_objects", "before_latest", "after_latest"])
def test_a_save_that_dies_at_any_point_leaves_a_loadable_checkpoint(tmp_path: Path, point: str) -> None:
    """SIGKILL at each phase of a save (here: the process exits at once, as SIGKILL would, leaving
    no cleanup): `latest` names a complete checkpoint, which loads, before and after the pointer moves."""
    script = tmp_path / "die.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, torch, zero_strategy as zs
        import zero_strategy.checkpoint.state as ckpt
        torch.manual_seed(0)
        model, opt = zs.initialize(torch.nn.Linear(8, 8), lambda p: torch.optim.AdamW(p, lr=1e-2), stage=2)
        model(torch.ones(2, 8)).sum().backward(); opt.step(); opt.zero_grad()
        zs.save_checkpoint({str(tmp_path / "ck")!r}, model, opt, objects={{"trainer": {{"step": 1}}}})
        torch.save(dict(model.state_dict()), {str(tmp_path / "state-1.pt")!r})
        model(torch.ones(2, 8)).sum().backward(); opt.step(); opt.zero_grad()
        torch.save(dict(model.state_dict()), {str(tmp_path / "state-2.pt")!r})
        ckpt.FAULT_HOOK = lambda where, rank: os._exit(9) if where == {point!r} else None
        zs.save_checkpoint({str(tmp_path / "ck")!r}, model, opt, objects={{"trainer": {{"step": 2}}}})
    """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 9, done.stderr[-3000:]
    latest = (tmp_path / "ck" / "latest").read_text().strip()
    assert latest == ("step-2" if point == "after_latest" else "step-1"), (point, latest)
    model, opt = zs.initialize(torch.nn.Linear(8, 8), lambda p: torch.optim.AdamW(p, lr=1e-2), stage=2)
    zs.load_checkpoint(tmp_path / "ck", model, opt)
    assert zs.read_checkpoint_object(tmp_path / "ck", "trainer")["step"] == int(latest[-1])
    saved = torch.load(tmp_path / f"state-{latest[-1]}.pt", weights_only=True)  # exactly what was saved
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), (point, k)


def test_metadata_files_are_not_followed_out_and_damaged_records_are_named(tmp_path: Path) -> None:
    model, opt = _model()
    _train(model, opt)
    version = Path(zs.save_checkpoint(tmp_path / "ck", model, opt))
    # DCP metadata written without storage_meta (older torch, or edited): loads
    md = pickle.loads((version / ".metadata").read_bytes())
    md.storage_meta = None
    (version / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_meta_record(version, ".metadata")
    zs.load_checkpoint(tmp_path / "ck", model, opt)
    # a damaged record in zero_meta.json is named, not a KeyError
    meta = json.loads((version / "zero_meta.json").read_text())
    good = dict(meta["files"])
    meta["files"][".metadata"] = {"crc32": 1}
    (version / "zero_meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointFileError, match=r"the record of '\.metadata' is damaged"):
        zs.load_checkpoint(tmp_path / "ck", model, opt)
    meta["files"] = good
    (version / "zero_meta.json").write_text(json.dumps(meta))
    # symlinks out of the checkpoint are not followed, for the metadata files either
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in (".metadata", "zero_meta.json"):
        os.replace(version / name, outside / name)
        os.symlink(outside / name, version / name)
        with pytest.raises(CheckpointFileError, match="outside"):
            zs.load_checkpoint(tmp_path / "ck", model, opt)
        os.remove(version / name)
        os.replace(outside / name, version / name)
    zs.load_checkpoint(tmp_path / "ck", model, opt)


def test_pruning_spares_what_any_pointer_names_and_other_subgroups_saves(tmp_path: Path) -> None:
    """Pipeline stages share a root, each with its own ``latest-<ranks>`` pointer: one stage's
    keep_last counts its own saves only, and no directory a pointer names is removed."""
    from zero_strategy.checkpoint.files import OWNER
    from zero_strategy.checkpoint.versions import COMPLETE

    root = tmp_path / "ck"
    model, opt = _model()
    zs.save_checkpoint(root, model, opt, tag="a")
    record = json.loads((root / "a" / OWNER).read_text())
    assert record["pointer"] == "latest"

    def fake_save(name: str, pointer: str, created: float) -> None:
        (root / name).mkdir()
        (root / name / OWNER).write_text(json.dumps({**record, "pointer": pointer, "created": created}))
        (root / name / COMPLETE).write_text("")

    fake_save("stage-b-old", "latest-1-1-0000abcd", 1.0)
    fake_save("stage-b", "latest-1-1-0000abcd", 2.0)
    (root / "latest-1-1-0000abcd").write_text("stage-b\n")
    fake_save("pinned", "latest", 0.5)  # ours, but a pointer (a copy someone made) names it
    (root / "latest-backup").write_text("pinned\n")
    zs.save_checkpoint(root, model, opt, tag="b", keep_last=1)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["b", "pinned", "stage-b", "stage-b-old"]
