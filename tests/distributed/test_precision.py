"""Mixed precision: bf16 against DDP under autocast, fp16 loss scaling with an injected overflow."""

from __future__ import annotations

import math

import pytest


def _bf16_worker(rank: int, world: int) -> list[float]:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    worst = []
    for stage in (1, 2):
        def train(mode: str) -> list[float]:
            torch.manual_seed(0)
            model = GPT(cfg)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if mode == "ddp":
                net = DDP(model)
            else:
                net, opt = zs.initialize(model, opt, config=zs.ZeroConfig(stage=stage, precision="bf16", reduce_bucket_size=5000))
                assert all(p.dtype == torch.bfloat16 for p in model.parameters())
                assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
            losses = []
            for step in range(10):
                x, y = synthetic_batch(cfg, 2, step, seed=rank)
                if mode == "ddp":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = net(x)
                else:
                    logits = net(x)
                assert logits.dtype == torch.bfloat16  # compute ran in the low dtype
                loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses

        ref, got = train("ddp"), train("zero")
        rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
        assert rel <= 1e-2, f"stage {stage}: bf16 losses {got} vs DDP+autocast {ref} (rel {rel:.3e})"
        worst.append(rel)
    return worst


@pytest.mark.parametrize("world", [2])
def test_bf16_matches_ddp_autocast(launch, world: int) -> None:
    worst = launch(_bf16_worker, world, timeout=300)
    assert all(len(w) == 2 and max(w) <= 1e-2 for w in worst)


def _fp16_worker(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, num_parameters, synthetic_batch

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    out = {}
    for stage in (1, 2):
        torch.manual_seed(0)
        model = GPT(cfg)
        assert num_parameters(model) <= 100_000
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        zcfg = zs.ZeroConfig(stage=stage, precision="fp16", loss_scale={"initial_scale_power": 8, "hysteresis": 1})
        model, opt = zs.initialize(model, opt, config=zcfg)
        scaler = model.zero_engine.scaler
        scales, changed, losses = [], [], []
        for step in range(5):
            x, y = synthetic_batch(cfg, 2, step, seed=rank)
            loss = F.cross_entropy(model(x).float().view(-1, cfg.vocab_size), y.reshape(-1))
            if step == 2 and rank == world - 1:
                loss = loss * float("inf")  # an overflow on one rank only
            if step % 2:
                zs.backward(loss)
            else:
                opt.scale_loss(loss).backward()
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            changed.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
            scales.append(scaler.scale)
            losses.append(loss.item())
        out[stage] = {"scales": scales, "changed": changed, "skipped": scaler.skipped_steps,
                      "state_steps": {float(s["step"]) for s in opt.state.values() if "step" in s}}
        model.zero_engine.close()
    return out


def test_fp16_overflow_on_one_rank_skips_everywhere(launch) -> None:
    results = launch(_fp16_worker, 2, timeout=300)
    for rank_result in results:
        for stage, r in rank_result.items():
            assert r["changed"] == [True, True, False, True, True], (stage, r)
            assert r["scales"] == [256.0, 256.0, 128.0, 128.0, 128.0], (stage, r)
            assert r["skipped"] == 1
            assert r["state_steps"] == {4.0}, "the skipped step must not advance Adam's step count"
    assert not math.isnan(results[0][1]["scales"][0])
