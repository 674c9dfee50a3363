"""Block-quantized int8 (comm/quantize.py) and the keys of the cheaper gathers (gather_dtype,
zero_quantized_weights): bounds, non-finite values, wire sizes, config reading and refusals."""

from __future__ import annotations

import pytest
import torch

from zero_strategy.comm import quantize
from zero_strategy.config import ZeroConfig
from zero_strategy.sharding.gather_codec import EXACT, Cast, Int8, gather_codec


def test_int8_blocks_stay_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 2, 1000)  # blocks of very different scales
    q, scales = quantize.quantize(x)
    assert q.dtype == torch.int8 and q.shape == (4, quantize.BLOCK) and scales.shape == (4,)
    back = quantize.dequantize(q, scales)[: x.numel()]
    step = scales.repeat_interleave(quantize.BLOCK)[: x.numel()]
    assert bool(((back - x).abs() <= step / 2 + 1e-12 * x.abs()).all())
    assert bool((back.view(-1)[:256] != 0).any())
    zeros = quantize.dequantize(*quantize.quantize(torch.zeros(300)))
    assert bool((zeros == 0).all())


def test_pack_round_trip_and_non_finite_blocks():
    x = torch.randn(600, dtype=torch.float64)
    rows = torch.empty(2, quantize.packed_bytes(600), dtype=torch.uint8)
    quantize.pack(x, rows[0])
    quantize.pack(-x, rows[1])
    back = quantize.unpack(rows, 600)
    assert back.shape == (2, 600) and torch.equal(back[0], -back[1])
    assert float((back[0] - x).abs().max()) <= float(x.abs().max()) / 254 + 1e-7
    x[3] = float("nan")
    quantize.pack(x, rows[0])
    back = quantize.unpack(rows, 600)[0]
    assert bool(back[:256].isnan().all()) and bool(back[256:].isfinite().all())  # the block, not hidden
    # 256 int8 values and a 4-byte scale per block: 0.254 of fp32's bytes
    assert quantize.packed_bytes(256 * 100) / (4 * 256 * 100) == pytest.approx(260 / 1024)


def test_unpadded_pack_sends_no_padding_and_decodes_alike():
    # qgZ's layout (padded=False): the same values and scales, without the last block's padding
    x = torch.randn(600)
    assert quantize.packed_bytes(600) == 3 * 256 + 4 * 3
    assert quantize.packed_bytes(600, padded=False) == 600 + 4 * 3
    padded = torch.empty(1, quantize.packed_bytes(600), dtype=torch.uint8)
    bare = torch.empty(1, quantize.packed_bytes(600, padded=False), dtype=torch.uint8)
    quantize.pack(x, padded[0])
    quantize.pack(x, bare[0], padded=False)
    assert torch.equal(bare[0, :600], padded[0, :600]) and torch.equal(bare[0, 600:], padded[0, 768:])
    assert torch.equal(quantize.unpack(bare, 600, padded=False), quantize.unpack(padded, 600))


def test_codecs_write_the_tag_and_their_wire_dtype():
    rows = (torch.randn(500), torch.randn(12))
    for codec, dtype in ((EXACT, torch.float32), (Cast(torch.bfloat16), torch.bfloat16), (Int8(), torch.uint8)):
        assert codec.wire_dtype(torch.float32) == dtype
        s = codec.slot_numel(512)
        buf = torch.zeros(2, s, dtype=dtype)
        codec.encode(buf[0], rows, tag=300)
        values, digits = codec.decode(buf, 512)
        assert digits[0].tolist() == [300 % 256, 300 // 256], codec
        full = torch.cat(rows)
        tol = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.uint8: 1 / 254}[dtype] * float(full.abs().max())
        assert float((values[0, :512].float() - full).abs().max()) <= tol + 1e-7, codec


def test_cheap_gather_keys():
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    assert cfg.zero_quantized_weights and isinstance(gather_codec(cfg), Int8)
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "zero_strategy": {"gather_dtype": "bf16"}})
    assert cfg.gather_dtype == torch.bfloat16 and isinstance(gather_codec(cfg), Cast)
    assert ZeroConfig.from_dict(cfg.to_dict()).gather_dtype == torch.bfloat16  # the flat form
    assert gather_codec(ZeroConfig(stage=3)) is EXACT and ZeroConfig(gather_dtype="fp32").gather_dtype is None
    with pytest.raises(ValueError, match="need stage 3"):
        ZeroConfig(stage=1, gather_dtype="bf16")
    assert any("need stage 3" in m for m in ZeroConfig(zero_quantized_weights=True).conflicts())  # default stage 2
    with pytest.raises(ValueError, match="give one"):
        ZeroConfig(stage=3, gather_dtype="bf16", zero_quantized_weights=True)
    with pytest.raises(ValueError, match="gathers those in bf16 already"):
        ZeroConfig(stage=3, gather_dtype="fp16", precision="bf16")
    assert ZeroConfig(stage=3, gather_dtype="bf16", precision="bf16-mixed").gather_dtype == torch.bfloat16
