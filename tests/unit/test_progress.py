"""Progress on long checkpoint work: the bytes/s bar of export and ``load_full_state_dict`` (only
on a terminal, rank 0, large enough), and one INFO log line per checkpoint save and load."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint import progress
from zero_strategy.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layer=2, n_head=2)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_bytes_per_second_on_a_terminal_only() -> None:
    total = 96 * 2**20
    term = _Terminal()
    with progress.byte_progress(total, "export x.safetensors", stream=term) as advance:
        for _ in range(3):
            advance(total // 3)
    text = term.getvalue()
    assert "export x.safetensors" in text and "/s" in text and "100.7" in text, text  # 96 MiB = 100.7 MB
    for kwargs in (
        {"stream": io.StringIO()},
        {"stream": _Terminal(), "rank": 1},
        {"stream": _Terminal(), "min_bytes": total + 1},
    ):
        stream = kwargs["stream"]
        with progress.byte_progress(total, "quiet", **kwargs) as advance:  # type: ignore[arg-type]
            advance(total)
        assert stream.getvalue() == "", kwargs


def test_export_and_load_full_state_dict_advance_the_bar_by_every_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, int, list[int]]] = []

    def recording(total, description, *, rank=0, stream=None, min_bytes=progress.MIN_BYTES):  # type: ignore[no-untyped-def]
        steps: list[int] = []
        seen.append((description, total, steps))
        yield steps.append

    import contextlib

    from zero_strategy.checkpoint import export, loading

    monkeypatch.setattr(export, "byte_progress", contextlib.contextmanager(recording))
    monkeypatch.setattr(loading, "byte_progress", contextlib.contextmanager(recording))
    torch.manual_seed(0)
    model, opt = zs.initialize(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=1e-3), stage=2)
    out = tmp_path / "w.safetensors"
    zs.export_full(model, out)
    zs.load_full_state_dict(model, out)
    (d_export, t_export, s_export), (d_load, t_load, s_load) = seen
    n_bytes = sum(p.numel() * 4 for p in GPT(CFG).state_dict().values())  # fp32, tied weights under each name
    assert d_export == "export w.safetensors" and t_export == sum(s_export) == n_bytes
    assert d_load == "load w.safetensors" and t_load == out.stat().st_size and sum(s_load) == n_bytes


def test_checkpoint_save_and_load_log_duration_and_size_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, opt = zs.initialize(GPT(CFG), lambda p: torch.optim.AdamW(p, lr=1e-3), stage=3)
    with caplog.at_level(logging.INFO, logger="zero_strategy.checkpoint"):
        path = zs.save_checkpoint(tmp_path, model, opt)
        zs.load_checkpoint(tmp_path, model, opt)
    lines = [r.getMessage() for r in caplog.records if r.name == "zero_strategy.checkpoint"]
    assert len(lines) == 2, lines
    mib = progress.dir_bytes(path) / 2**20
    assert mib > 0
    assert lines[0].startswith(f"save_checkpoint: wrote {path}, {mib:.1f} MiB, in ") and lines[0].endswith(" s")
    assert lines[1].startswith(f"load_checkpoint: read {path}, {mib:.1f} MiB, in "), lines[1]
