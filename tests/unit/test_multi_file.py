"""Hugging Face's multi-file weights (issue 33 item 2): ``load_full_state_dict`` reads a
directory of ``model-0000k-of-0000n.safetensors`` files and its index, tensor by tensor, and
``export_full(..., max_shard_size=...)`` writes the same layout, which ``from_pretrained`` loads
unchanged. One process: the file format is what is tested here (the per-rank loading it feeds
is the same ``load_full_state_dict`` the distributed tests run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint.multi_file import SAFE_INDEX, parse_size, shard_plan

transformers = pytest.importorskip("transformers")


def _llama(seed: int, tied: bool = False):  # type: ignore[no-untyped-def]
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("model-*.safetensors"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sharded_save_pretrained_directory_loads_tensor_by_tensor(tmp_path: Path, stage: int) -> None:
    src = _llama(1)
    src.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    files = _files(tmp_path / "hf")
    assert len(files) > 2 and (tmp_path / "hf" / SAFE_INDEX).exists(), files  # several files: the layout is real
    model, _ = zs.initialize(_llama(2), None, stage=stage, stage3_param_persistence_threshold=0)
    opened: list[str] = []
    from safetensors import safe_open as real_open

    def counting_open(path: str, framework: str):  # type: ignore[no-untyped-def]
        opened.append(Path(path).name)
        return real_open(path, framework=framework)

    for source in (tmp_path / "hf", tmp_path / "hf" / SAFE_INDEX):
        opened.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("safetensors.safe_open", counting_open)
            zs.load_full_state_dict(model, source)
        assert sorted(opened) == files, opened  # each file opened once, on demand
        got = zs.full_state_dict(model)
        want = src.state_dict()
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k


def test_export_with_max_shard_size_writes_what_from_pretrained_loads(tmp_path: Path) -> None:
    for tied in (False, True):
        out = tmp_path / f"out{int(tied)}"
        model, _ = zs.initialize(_llama(3, tied), None, stage=3, stage3_param_persistence_threshold=0)
        want = zs.full_state_dict(model)
        index = zs.export_full(model, out, max_shard_size="30KB")
        assert index == str(out / SAFE_INDEX)
        body = json.loads(Path(index).read_text())
        assert len(_files(out)) > 2 and sorted(set(body["weight_map"].values())) == _files(out), body
        sizes = [p.stat().st_size for p in out.glob("model-*.safetensors")]
        biggest = max(t.numel() * t.element_size() for t in want.values())
        assert max(sizes) <= max(30_000, biggest) + 4096, sizes  # each file within the limit (+ its header)
        model.config.save_pretrained(out)
        loaded = transformers.LlamaForCausalLM.from_pretrained(out)  # unchanged transformers
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, want[k]), k
        back, _ = zs.initialize(_llama(4, tied), None, stage=2)
        zs.load_full_state_dict(back, out)  # and our own reader
        for k, v in zs.full_state_dict(back).items():
            assert torch.equal(v, want[k]), k


def test_offline_export_of_a_checkpoint_to_several_files(tmp_path: Path) -> None:
    model, opt = zs.initialize(_llama(5), lambda p: torch.optim.SGD(p, lr=0.1), stage=3)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    want = zs.full_state_dict(model)
    from zero_strategy.cli import main

    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--max-shard-size", "40KB"])
    assert len(_files(tmp_path / "out")) > 1
    back, _ = zs.initialize(_llama(6), None, stage=3)
    zs.load_full_state_dict(back, tmp_path / "out")
    for k, v in zs.full_state_dict(back).items():
        assert torch.equal(v, want[k]), k


def test_sizes_plans_and_errors(tmp_path: Path) -> None:
    assert parse_size("5GB", what="x") == 5 * 10**9 and parse_size("2GiB", what="x") == 2 * 2**30
    assert parse_size(123, what="x") == 123 and parse_size("1.5MB", what="x") == 1_500_000
    for bad in ("lots", "0", -1, "5XB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad, what="export_full(max_shard_size)")  # type: ignore[arg-type]
    f32 = torch.float32
    entries = [("a", [10], f32), ("b", [10], f32), ("c", [100], f32), ("d", [1], f32)]
    assert shard_plan(entries, 80) == [[0, 1], [2], [3]]  # a 400-byte tensor alone in its file
    model, _ = zs.initialize(_llama(7), None, stage=2)
    with pytest.raises(ValueError, match="give the directory"):
        zs.export_full(model, tmp_path / "w.safetensors", max_shard_size="1MB")
    with pytest.raises(FileNotFoundError, match="holds none of"):
        zs.load_full_state_dict(model, tmp_path)
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {"lm_head.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="not beside it"):
        zs.load_full_state_dict(model, tmp_path)
