"""ZeRO-3 against the DDP oracle, plus its failure modes and accounting."""

from __future__ import annotations

from typing import Any

import pytest

from zero_strategy.testing import assert_close, assert_state_close, run_subtests
from zero_strategy.testing.parity import TORCH_CLIPPING


def _cells(full: bool, world: int = 2) -> list[dict]:
    features = [
        {},
        {"clip": 0.05},
        {"tied": True},  # embedding and head: both in the root unit
        {"tied_units": True},  # one weight in two blocks: moved to the root unit
        {"reuse": True},  # a unit called twice per forward
        {"ckpt": "reentrant"},
        {"ckpt": "nonreentrant"},
        {"frozen": True},
        {"groups": True},
        {"unused": "some_steps", "policy": "blocks"},  # a unit that runs on some steps only
        {"unused": "some_ranks"},  # a conditional block inside the root unit: declared, so fine
        {"dtype": "float32", "clip": 0.05, "tied": True},
        {"prefetch": 0},
        {"prefetch": 2, "reuse": True, "ckpt": "nonreentrant"},
        {"optim": "adagrad", "groups": True, "frozen": True, "tied_units": True, "ckpt": "reentrant"},
        {"set_to_none": False, "unused": "some_steps", "policy": "blocks"},
        {"reuse": True, "ckpt": "reentrant"},  # re-gathered for a second backward: late gradients
        {"persist": 10**6},  # small units stay gathered until the step
    ]
    if not full:
        features = features[:1] + features[3:6] + features[9:11] + features[-2:]
    cells = [dict(stage=3, accum=a, **f) for a in ("none", "plain", "no_sync") for f in features]
    # the production code paths: native collectives (NCCL's), no overlap, bf16 reduction (DDP's bf16 hook)
    paths = [{"impl": "native"}, {"impl": "native", "accum": "no_sync"}, {"overlap": False, "accum": "plain"}]
    paths += (
        [{"reduce": "bf16"}, {"reduce": "bf16", "accum": "no_sync", "clip": 0.05}, {"reduce": "fp16", "clip": 0.05}]
        if world == 2
        else []
    )  # see zero12
    clipping = TORCH_CLIPPING if full else []  # torch.nn.utils' clipping in a plain loop (see zero12)
    return cells + [dict(stage=3, **p) for p in paths + clipping]


def _parity_worker(rank: int, world: int, full: bool) -> int:
    from zero_strategy.testing.parity import Cell, compare

    cells = _cells(full, world)
    run_subtests(lambda **kw: compare(Cell(**kw), rank, world), cells, label=f"zero3 parity, world {world}")
    return len(cells)


@pytest.mark.parametrize(
    "world,full", [(1, False), (2, True), (3, False), (4, False)], ids=["ws1-smoke", "ws2-full", "ws3", "ws4"]
)
def test_zero3_matches_ddp(launch, world: int, full: bool) -> None:
    """World size 1 is a smoke test (one process, nothing is reduced), not distributed evidence."""
    counts = launch(_parity_worker, world, args=(full,), timeout=600)
    assert counts == [len(_cells(full, world))] * world and counts[0] >= 18


def _divergence_worker(rank: int, world: int) -> str:
    import zero_strategy as zs
    from zero_strategy.testing.parity import Cell, compare

    try:
        # `extra` is its own unit and runs on rank 0 only: undeclared divergence
        compare(Cell(stage=3, unused="some_ranks", policy="blocks", steps=2), rank, world)
    except zs.UnitDivergence as e:
        return str(e)
    return "no error"


def test_undeclared_divergence_raises_on_every_rank(launch) -> None:
    messages = launch(_divergence_worker, 2, timeout=120)
    for msg in messages:
        assert "diverged" in msg, msg
        assert "unit 'extra'" in msg and "ranks [0]" in msg and "ranks [1]" in msg, msg
        assert "@zero_auto_partition" in msg, msg


def _moe_worker(rank: int, world: int) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.out(F.gelu(self.fc(x)))

    class MoEBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(8, 4)
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            gates = self.router(x).softmax(-1)
            top = gates.argmax(-1)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):
                mask = top == e
                if mask.any():  # top-1 routing: an expert runs only on the ranks whose data pick it
                    out[mask] = gates[mask][:, e : e + 1] * expert(x[mask])
                else:
                    skipped[0] += 1
            return x + out

    class MoENet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
            self.head = nn.Linear(8, 16)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    skipped = [0]

    def train(mode: str):
        torch.manual_seed(0)
        model = MoENet().double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "ddp":
            net = DDP(model, find_unused_parameters=True)
        else:
            net, opt = zs.initialize(model, opt, config=zs.ZeroConfig(stage=3))  # no decoration
            assert {g.label for g in model.zero_engine.groups} == {"blocks.0", "blocks.1", "<root>"}
        losses = []
        for step in range(10):
            g = torch.Generator().manual_seed(100 * step + rank)
            idx = torch.randint(0, 16, (3, 2), generator=g)
            loss = F.cross_entropy(net(idx).view(-1, 16), idx.view(-1).flip(0))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with zs.gathered_parameters(model) if mode == "zero" else torch.no_grad():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return losses, state

    ref_losses, ref = train("ddp")
    losses, got = train("zero")
    assert_close(losses, ref_losses, rtol=1e-9, what="MoE losses")
    assert_state_close(got, ref, rtol=1e-6, atol=1e-12, what="MoE")
    return {"tensors": len(ref), "skipped": skipped[0]}


def test_moe_top1_routing_trains_without_decoration(launch) -> None:
    results = launch(_moe_worker, 2, timeout=180)
    assert results[0]["tensors"] == results[1]["tensors"] > 10
    assert sum(r["skipped"] for r in results) > 0, results  # some expert was skipped on some rank


def _accounting_worker(rank: int, world: int) -> dict:
    import gc

    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, num_parameters, synthetic_batch

    cfg = GPTConfig(vocab_size=256, seq_len=16, d_model=128, n_layer=4, n_head=4, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    psi = num_parameters(model)
    zcfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0)  # no unit stays gathered
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters()), config=zcfg)
    root_numel = sum(p.numel() for g in model.zero_engine.groups if g.label == "<root>" for p in g.params)
    unit_bytes = max(sum(p.numel() * 4 for p in g.params) for g in model.zero_engine.groups if g.label != "<root>")
    n_params = sum(len(g.params) for g in model.zero_engine.groups)
    for step in range(4):
        if step == 1:
            zs.reset_comm_stats()
        x, y = synthetic_batch(cfg, 2, step, seed=rank)
        F.cross_entropy(model(x).view(-1, 256), y.reshape(-1)).backward()
        outside = [p.untyped_storage().nbytes() > p.element_size() for p in model.parameters()]
        assert not any(outside), "outside forward and backward, parameters hold no full data"
        opt.step()
        if step < 3:
            opt.zero_grad()
    per_step = sum(v["elements"] for v in zs.comm_stats().values()) / 3
    gc.collect()
    stats = zs.memory_stats(model)
    # validation between steps: no_grad + eval gathers and frees, builds no graph, same output twice
    model.eval()
    x, _ = synthetic_batch(cfg, 2, 99, seed=rank)
    with torch.no_grad():
        a, b = model(x), model(x)
    eval_ok = torch.equal(a, b) and not a.requires_grad and zs.memory_stats(model)["gathered"] == 0
    model.train()
    model.zero_engine.close()

    # stage3_max_live_parameters caps what prefetching may gather
    peaks = {}
    for cap in (10**9, root_numel + unit_bytes // 4 + 1000):
        torch.manual_seed(0)
        m = GPT(cfg)
        m, o = zs.initialize(
            m,
            torch.optim.AdamW(m.parameters()),
            config=zs.ZeroConfig(
                stage=3, prefetch=2, stage3_max_live_parameters=cap, stage3_param_persistence_threshold=0
            ),
        )
        for step in range(3):
            x, y = synthetic_batch(cfg, 2, step, seed=rank)
            F.cross_entropy(m(x).view(-1, 256), y.reshape(-1)).backward()
            o.step()
            o.zero_grad()
        peaks[cap] = zs.memory_stats(m)["gathered_peak"]
        m.zero_engine.close()
    return {
        "per_step": per_step,
        "psi": psi,
        "root": root_numel,
        "n_params": n_params,
        "stats": stats,
        "unit_bytes": unit_bytes,
        "eval_ok": eval_ok,
        "peaks": peaks,
    }


def test_zero3_comm_volume_and_memory(launch) -> None:
    for world in (2, 3):
        for r in launch(_accounting_worker, world, timeout=180):
            psi, n = r["psi"], world
            # forward gather + backward gather + reduce-scatter; the root unit stays gathered
            # from forward to backward, so it is gathered once
            expected = 3 * psi - r["root"]
            padding = 2 * n * r["n_params"] + 2 * n * 20 + 4 * r["n_params"]
            assert expected <= r["per_step"] <= 1.05 * expected + padding, r
            s = r["stats"]
            assert s["model_state"] <= 1.05 * 16 * psi / n, s  # (4 + 4 + 8) Psi / N after a step
            assert s["model_state"] >= 16 * psi / n * 0.95, s
            # root + one unit + one prefetched unit at most
            assert s["gathered_peak"] <= r["root"] * 4 + 2 * r["unit_bytes"], s
            assert r["eval_ok"]
            (free, free_peak), (cap, cap_peak) = sorted(r["peaks"].items(), reverse=True)
            assert free_peak >= r["root"] * 4 + 3 * r["unit_bytes"], r["peaks"]  # prefetch 2 really gathers ahead
            assert cap_peak <= cap * 4 + r["unit_bytes"], r["peaks"]  # max live + one unit


def _reuse_worker(rank: int, world: int) -> dict:
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.testing.parity import VOCAB, Cell, Net, batch

    calls = {}
    for distance in (0, 10**9):
        torch.manual_seed(0)
        model = Net(Cell(stage=3, reuse=True)).double()  # blocks[0] runs twice per forward
        cfg = zs.ZeroConfig(stage=3, stage3_max_reuse_distance=distance, stage3_param_persistence_threshold=0)
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
        for step in range(3):
            if step == 2:
                zs.reset_comm_stats()
            x, y = batch(step, 0, rank)
            F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        calls[distance] = zs.comm_stats()["all_gather"]["calls"]
        model.zero_engine.close()
    return calls


def test_reuse_distance_keeps_a_unit_that_runs_again_soon(launch) -> None:
    for calls in launch(_reuse_worker, 2, timeout=120):
        # blocks.0 runs twice in a row in forward: cached, it is gathered once instead of twice.
        # (In backward its two uses are consecutive, so it stays the active unit either way.)
        assert calls[0] - calls[10**9] == 1, calls


def _train_gpt(net: Any, opt: Any, cfg: Any, rank: int, counter: Any = None) -> tuple[list, list]:
    """Three steps of the tiny GPT: the losses, and the frames ``counter`` had compiled after each."""
    import torch.nn.functional as F

    from zero_strategy.models import synthetic_batch

    losses, frames = [], []
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, step, seed=rank)
        loss = F.cross_entropy(net(x).view(-1, 64), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        frames.append(counter.frame_count if counter is not None else 0)
    return losses, frames


def _compile_worker(rank: int, world: int) -> list[bool]:
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=4)
    ok = []
    for stage in (2, 3):
        runs = []
        counter = CompileCounterWithBackend("aot_eager")  # independent evidence that dynamo compiled something
        for compiled in (False, True):
            torch.manual_seed(0)
            m = GPT(cfg)
            m, opt = zs.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), config=zs.ZeroConfig(stage=stage))
            net = torch.compile(m, backend=counter) if compiled else m
            losses, _ = _train_gpt(net, opt, cfg, rank)
            with zs.gathered_parameters(m):
                runs.append((losses, [p.detach().clone() for p in m.parameters()]))
            m.zero_engine.close()
        (l0, p0), (l1, p1) = runs
        assert counter.frame_count > 0 and counter.op_count > 0, (stage, counter.frame_count, counter.op_count)
        assert_close(l1, l0, rtol=1e-5, what=f"stage {stage} compiled losses")
        for a, b in zip(p1, p0, strict=True):
            assert_close(a, b, rtol=1e-5, atol=1e-6, what=f"stage {stage} compiled parameters")
        ok.append(counter.frame_count)
    return ok


def test_torch_compile_of_the_wrapped_model_matches_eager(launch) -> None:
    for frames in launch(_compile_worker, 2, timeout=300):
        assert len(frames) == 2 and all(f > 0 for f in frames), frames  # dynamo compiled frames at stage 2 and 3


def _inductor_worker(rank: int, world: int) -> dict:
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    ref = GPT(cfg)
    ref_losses, _ = _train_gpt(DDP(ref), torch.optim.SGD(ref.parameters(), lr=0.1), cfg, rank)
    out = {}
    # stage 3 with units freed between uses (threshold 0) and kept (the default keeps this tiny model's
    # units). Compiled after initialize with units kept: the aot_eager test above (inductor's cold
    # compiles cost ~10 s a case here, so the cases that passed before the fix are not all repeated).
    cases = [(2, None, "before"), (3, None, "before"), (3, 0, "before"), (3, 0, "after")]
    for stage, threshold, order in cases:
        extra = {} if threshold is None else {"stage3_param_persistence_threshold": threshold}
        torch._dynamo.reset()  # each case compiles (and is counted) on its own
        counter = CompileCounterWithBackend("inductor")  # inductor's compile_fx, counted
        torch.manual_seed(0)
        m = GPT(cfg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if order == "before":
            m = torch.compile(m, backend=counter, mode="default")
        m, opt = zs.initialize(m, opt, config=zs.ZeroConfig(stage=stage, **extra))
        net = torch.compile(m, backend=counter, mode="default") if order == "after" else m
        losses, frames = _train_gpt(net, opt, cfg, rank, counter)
        what = f"stage {stage}, threshold {threshold}, compiled {order} initialize"
        assert_close(losses, ref_losses, rtol=1e-5, what=f"{what}: losses")
        with zs.gathered_parameters(m):
            for a, b in zip(m.parameters(), ref.parameters(), strict=True):
                assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6, what=f"{what}: parameters")
        m.zero_engine.close()
        out[what] = frames
    return out


def _inductor_unavailable() -> str | None:
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()  # raises without a C++ compiler (inductor's CPU code needs one)
    except Exception as e:  # any failure: inductor cannot build here
        return f"torch inductor cannot compile C++ here: {type(e).__name__}: {e}"
    return None


def test_torch_compile_with_inductor_before_and_after_initialize_matches_ddp(launch) -> None:
    """torch.compile with inductor (torch's default backend), of the model before ``initialize``
    or of the wrapped model after it: the engine's hooks run eagerly, the module bodies are
    compiled by inductor, and losses and parameters match eager DDP (ZeRO-2, ZeRO-3 with units
    kept or freed between uses; before the fix the freed cases failed at step 0 on inductor's
    stride assertion for the placeholder). Every case compiled frames in its first step and none later
    (no recompilation each step, no silent fallback to eager)."""
    reason = _inductor_unavailable()
    if reason is not None:
        pytest.skip(reason)
    for cases in launch(_inductor_worker, 2, timeout=600):
        assert len(cases) == 4, cases
        for what, frames in cases.items():
            assert frames[0] > 0 and frames[-1] == frames[0], (what, frames)


def _order_change_worker(rank: int, world: int) -> dict:
    import logging

    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.testing.parity import VOCAB, Cell, Net, batch

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("zero_strategy").addHandler(Keep())
    torch.manual_seed(0)
    # `extra` is its own unit and runs on steps 1, 4, 7: the recorded order changes
    model = Net(Cell(stage=3, unused="some_steps", policy="blocks")).double()
    model, opt = zs.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=3), policy={type(model.extra)}
    )
    for step in range(8):
        x, y = batch(step, 0, rank)
        F.cross_entropy(model(x, step % 3 == 1).view(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    changed = [r.getMessage() for r in records if "order of ZeRO-3 units changed" in r.getMessage()]
    return {"warnings": len(changed), "text": changed[:1]}


def test_a_changed_unit_order_falls_back_and_logs_once(launch) -> None:
    for r in launch(_order_change_worker, 2, timeout=120):
        assert r["warnings"] == 1, r
        assert "prefetching is off" in r["text"][0]


def _t5():
    """A tiny T5 (no download), in float64, dropout off: the same weights on every call."""
    import torch
    import transformers

    cfg = transformers.T5Config(
        vocab_size=64, d_model=64, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=32,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).double()
    with torch.no_grad():  # small embeddings (tied to the head): the greedy ids follow the encoder's input
        model.shared.weight.mul_(0.05)
    return model


def _zero3(model, persist: int | None, lr: float = 1e-2, config: dict | None = None, policy=None):
    import torch

    import zero_strategy as zs

    kw = dict(config or {}) | ({} if persist is None else {"stage3_param_persistence_threshold": persist})
    return zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), stage=3, policy=policy, **kw)


def _ddp_against_zero3(build, loss_of, rank: int, persist: int | None, steps: int = 3, *, config=None, policy=None):
    """Train ``build()`` for a few steps under DDP and under ZeRO-3 (more ``config`` keys, the
    unit ``policy``): equal losses and weights. Returns the ZeRO-3 model."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ddp = DDP(ref)
    model, opt = _zero3(build(), persist, config=config, policy=policy)
    if persist == 0:
        assert not any(u.persistent for u in model.zero_engine.params.units), "units must be freed"
    runs: dict[str, list[float]] = {"ddp": [], "zero": []}
    for step in range(steps):
        for name, net, o in (("ddp", ddp, ref_opt), ("zero", model, opt)):
            loss = loss_of(net, step, rank)
            loss.backward()
            o.step()
            o.zero_grad()
            runs[name].append(loss.item())
    assert_close(runs["zero"], runs["ddp"], rtol=1e-9, what="losses")
    with zs.gathered_parameters(model):
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        assert_close(got[k], v, rtol=1e-7, atol=1e-12, what=k)
    return model


def case_t5_trains(rank: int, persist: int | None) -> None:
    """T5 blocks pass ``position_bias`` through unchanged: a later block must not claim it."""
    import torch

    def loss_of(net, step: int, rank: int):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(2, 64, (2, 6), generator=g)
        return net(input_ids=ids, labels=ids.flip(1)).loss

    _ddp_against_zero3(_t5, loss_of, rank, persist)


def case_pass_through_block(rank: int, persist: int | None) -> None:
    """Plain torch: the first block makes a bias, the others return it unchanged (positional
    and keyword inputs), one of them after changing it in place (then it made it)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, first: bool) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.make = nn.Linear(8, 8) if first else None

        def forward(self, x, extra, bias=None, scale=None):
            if bias is None:
                bias = self.make(x)
            if scale is not None:
                bias = bias.mul_(scale)
            return torch.tanh(self.lin(x) + bias + extra), extra, bias

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(Block(i == 0) for i in range(4))

        def forward(self, x):
            h = self.inp(x)
            extra, bias = h * 0.5, None
            for i, blk in enumerate(self.blocks):
                h, extra, bias = blk(h, extra, bias=bias, scale=0.9 if i == 2 else None)
            return h

    def build():
        torch.manual_seed(0)
        return Net().double()

    def loss_of(net, step: int, rank: int):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        return net(x).pow(2).mean()

    _ddp_against_zero3(build, loss_of, rank, persist)


def case_gpt2_generate() -> None:
    import copy

    import torch
    import transformers

    import zero_strategy as zs

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(plain)
    model, _ = zs.initialize(model, lambda p: torch.optim.SGD(p, lr=0.1), config=zs.ZeroConfig(stage=3))
    assert {g.label for g in model.zero_engine.groups} == {"transformer.h.0", "transformer.h.1", "<root>"}
    model.eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = model.generate(prompt, **kw)
        ref = plain.generate(prompt, **kw)
    assert got[0].tolist() == ref[0].tolist() and len(got[0]) == 10, (got, ref)


def case_t5_outside_calls(rank: int, persist: int | None) -> None:
    """``generate`` calls the encoder outside the model's forward; so does a user calling a block
    or a module inside a unit: each gathers what it reads, as a forward does."""
    import torch

    import zero_strategy as zs

    plain = _t5().eval()
    model, _ = _zero3(_t5(), persist)
    model.eval()
    prompt = torch.tensor([[25, 36, 47, 8, 9, 10], [31, 12, 53, 14, 15, 1]])
    kw = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    with torch.no_grad():
        got, ref = model.generate(prompt, **kw), plain.generate(prompt, **kw)
    assert got.tolist() == ref.tolist() and got.shape == (2, 6), (got.tolist(), ref.tolist())
    assert len(set(ref[:, 1:].reshape(-1).tolist())) > 2, ref  # not a degenerate (all-pad) answer
    with torch.no_grad():
        hidden = plain.shared(prompt)
        calls = [
            lambda m: m.encoder.block[0](hidden)[0],  # a unit called directly
            lambda m: m.encoder.block[1].layer[1](hidden),  # a module inside a unit
            lambda m: m.encoder.final_layer_norm(hidden),  # a module of the root unit
            lambda m: m.encoder(input_ids=prompt).last_hidden_state,  # a module holding units
        ]
        for k, call in enumerate(calls):
            assert_close(call(model), call(plain), rtol=1e-12, atol=1e-12, what=f"outside call {k}")
        # a call that raises leaves nothing behind, also an interrupt (torch then skips its always-called hooks)
        for exc in (ValueError, KeyboardInterrupt):

            def stop(module, args, exc=exc):
                raise exc("stop")

            handle = model.encoder.block[1].register_forward_pre_hook(stop)
            with pytest.raises(exc):
                model.encoder(input_ids=prompt)
            handle.remove()
            with zs.gathered_parameters(model.shared.weight):  # between steps again
                pass
            start = torch.zeros(2, 1, dtype=torch.long)
            assert_close(model(prompt, decoder_input_ids=start).logits, plain(prompt, decoder_input_ids=start).logits,
                         rtol=1e-12, atol=1e-12, what=f"forward after {exc.__name__}")  # fmt: skip
            assert_close(calls[3](model), calls[3](plain), rtol=1e-12, atol=1e-12, what=f"call after {exc.__name__}")
            assert model.zero_engine.training_state.name == "IDLE"
        with zs.gathered_parameters(model):  # calls inside the block free nothing the block gathered
            model.encoder(input_ids=prompt)
            for name in ("shared.weight", "encoder.block.1.layer.0.SelfAttention.q.weight"):
                value = model.get_parameter(name)
                assert_close(value, plain.get_parameter(name), rtol=0, atol=0, what=f"{name} in gathered_parameters")
    # with gradients: the encoder alone, backward, gradients as the plain model's (same input on every rank)
    model.train()
    plain.train()
    model.encoder(input_ids=prompt).last_hidden_state.pow(2).sum().backward()
    plain.encoder(input_ids=prompt).last_hidden_state.pow(2).sum().backward()
    for name, p in plain.named_parameters():
        if p.grad is not None:
            got = zs.full_grad(model, model.get_parameter(name))
            assert_close(got, p.grad, rtol=1e-9, atol=1e-12, what=f"gradient of {name}")
    assert not any(u.state.name != "SHARDED" and not u.persistent for u in model.zero_engine.params.units)
    # a call without gradients between a forward and its backward frees only what it gathered
    model.zero_grad()
    plain.zero_grad()
    start = torch.zeros(2, 1, dtype=torch.long)
    out = model(prompt, decoder_input_ids=start).logits
    with torch.no_grad():
        assert_close(model.encoder.block[1](hidden)[0], plain.encoder.block[1](hidden)[0], rtol=1e-12, atol=1e-12,
                     what="a block called between forward and backward")  # fmt: skip
    out.pow(2).sum().backward()
    plain(prompt, decoder_input_ids=start).logits.pow(2).sum().backward()
    for name, p in plain.named_parameters():
        if p.grad is not None:
            got = zs.full_grad(model, model.get_parameter(name))
            assert_close(got, p.grad, rtol=1e-9, atol=1e-12, what=f"gradient of {name} after a call in between")


def case_persistent_parameters_read_outside_forward(rank: int) -> None:
    """Persistent parameters (below ``stage3_param_persistence_threshold``) are never
    partitioned, as in DeepSpeed: read outside forward after initialize, a step or a load they
    hold the current values (Accelerate's own ``test_script.py`` reads ``model.a`` of its 0-dim ``RegressionModel``;
    it read NaN)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.tensor(0.5))
            self.b = nn.Parameter(torch.tensor(-0.25))
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * self.a + self.b

    torch.manual_seed(0)
    ref = Regression().double()
    model = Regression().double()
    model.load_state_dict(ref.state_dict())
    ddp, ref_opt = DDP(ref), torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    assert all(u.persistent for u in model.zero_engine.params.units), "the default threshold keeps these whole"

    def check(when: str) -> None:
        for name, want in ref.named_parameters():
            got = model.get_parameter(name).detach()
            assert_close(got, want.detach(), rtol=1e-12, atol=0.0, what=f"{name} read {when}")

    check("after initialize")
    for step in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        for net, o in ((ddp, ref_opt), (model, opt)):
            net(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        check(f"after step {step}")
    with torch.no_grad():  # a load: every rank loads the same full weights
        for p in ref.parameters():
            p.mul_(0.5)
    zs.load_full_state_dict(model, {k: v.clone() for k, v in ref.state_dict().items()})
    check("after load_full_state_dict")


def _hugging_face_worker(rank: int, world: int) -> int:
    cases = [
        ("persistent reads", lambda: case_persistent_parameters_read_outside_forward(rank), [{}]),
        ("generate", case_gpt2_generate, [{}]),
        ("t5 trains", lambda **kw: case_t5_trains(rank, **kw), [{"persist": 0}]),
        ("pass-through", lambda **kw: case_pass_through_block(rank, **kw), [{"persist": 0}]),
        ("outside calls", lambda **kw: case_t5_outside_calls(rank, **kw), [{"persist": 0}, {"persist": None}]),
    ]
    for label, fn, grid in cases:
        run_subtests(fn, grid, label=label)
    return len(cases)


def test_hugging_face_generate_under_zero3(launch) -> None:
    """GPT-2 and T5 ``generate``, T5 training against DDP (a block passes ``position_bias``
    through), a plain-torch pass-through block, and submodules called outside the forward."""
    assert launch(_hugging_face_worker, 2, timeout=300) == [5, 5]
