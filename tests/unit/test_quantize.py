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


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("numel", [600, 601, 603])
def test_unpack_reads_rows_at_any_offset_and_stride(ranks: int, numel: int):
    """Rows of any width, at any byte offset of their buffer (qgZ's unpadded rows put the scales
    at ``numel``): the scales are copied where they cannot be viewed as fp32 in place."""
    x = torch.randn(numel)
    for padded in (True, False):
        width = quantize.packed_bytes(numel, padded=padded)
        for lead, extra in ((0, 0), (1, 3), (2, 1)):
            buf = torch.zeros(lead + ranks * (width + extra), dtype=torch.uint8)
            rows = buf[lead:].view(ranks, width + extra)
            for r in range(ranks):
                quantize.pack(x * (r + 1), rows[r, :width], padded=padded)
            back = quantize.unpack(rows, numel, padded=padded)
            want = quantize.unpack(rows[:, :width].clone(), numel, padded=padded)
            assert back.shape == (ranks, numel) and torch.equal(back, want), (padded, lead, extra)
            assert float((back[0] - x).abs().max()) <= float(x.abs().max()) / 254 + 1e-7


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_codecs_write_the_tag_and_their_wire_dtype(ranks: int):
    # one rank included: its row of a [1, slot] buffer once had scales at a stride not a multiple of 4
    rows = (torch.randn(500), torch.randn(12))
    for codec, dtype in ((EXACT, torch.float32), (Cast(torch.bfloat16), torch.bfloat16), (Int8(), torch.uint8)):
        assert codec.wire_dtype(torch.float32) == dtype
        s = codec.slot_numel(512)
        if codec is not EXACT and dtype == torch.uint8:  # every rank's scales fp32-aligned, read in place
            assert all(codec.slot_numel(n) % 4 == 0 for n in (1, 255, 512, 513, 1001))
        buf = torch.zeros(ranks, s, dtype=dtype)
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


def test_qwz_at_world_size_one_trains_a_llama_like_plain_training(tmp_path):
    """qwZ in a one-rank gloo group (a smoke cell; two ranks: tests/distributed/test_cheap_gathers.py).
    The first gather of a ``LlamaForCausalLM`` crashed: a [1, slot] row of the gathered bytes had
    its scales at a row stride not a multiple of 4, which ``view(float32)`` refuses. Losses within
    the int8 rounding of plain training, SGD, every unit gathered quantized."""
    import copy

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy as zs
    from zero_strategy.testing import rel_error

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    ref = LlamaForCausalLM(cfg)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    zero = {"stage": 3, "zero_quantized_weights": True, "stage3_param_persistence_threshold": 0}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, opt = zs.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.5), config={"zero_optimization": zero}
        )
        got, want = [], []
        for step in range(3):
            x = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
            for m, o, out in ((model, opt, got), (ref, ref_opt, want)):
                loss = m(input_ids=x, labels=x).loss
                loss.backward()
                o.step()
                o.zero_grad()
                out.append(float(loss.detach()))
        model.zero_engine.close()
    finally:
        dist.destroy_process_group()
    assert rel_error(got, want, what="qwZ losses at one rank") <= 1e-2, (got, want)  # measured 2.2e-3
    assert got != want  # the gathers were quantized: not the exact values
