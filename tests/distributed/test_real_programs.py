"""Model patterns from programs other people write, against the DDP oracle: classes with ABC
bases, metaclasses, ``__slots__`` or their own ``__call__``; models set up without an
optimizer; a top-2 MoE whose experts are the outermost list; a frozen backbone built under
``sharded_init``; loading weights into a model whose small units are already gathered.

Two launches: world size 2 runs every case (``run_subtests``), world size 3 the MoE and a
reload of the frozen-backbone checkpoint the world-2 run saved."""

from __future__ import annotations

from pathlib import Path

from zero_strategy.testing import assert_close, run_subtests, subtest_grid

V, D = 16, 8


# --------------------------------------------------------------------------- models


def _models():
    """Model classes of the shapes users write (built inside the worker: classes must not be
    pickled across processes)."""
    import abc

    from torch import nn

    class Base(abc.ABC, nn.Module):  # `class ParityModel(ABC, nn.Module)`: FSDP2 fails on it
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2))
            self.head = nn.Linear(D, V)

        @abc.abstractmethod
        def mix(self, x): ...

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = self.mix(b(x))
            return self.head(x)

    class WithABC(Base):
        def mix(self, x):
            return x * 0.9

    class Meta(type(nn.Module)):
        def __new__(mcs, name, bases, ns, **kw):
            cls = super().__new__(mcs, name, bases, ns, **kw)
            cls.built_by_meta = True
            return cls

    class WithMeta(WithABC, metaclass=type("ABCMetaMeta", (Meta, abc.ABCMeta), {})):
        pass

    class Slotted(nn.Module):
        __slots__ = ("note",)

    class WithSlots(Slotted, WithABC):
        pass

    class WithCall(WithABC):
        def __call__(self, *args, **kwargs):  # its own __call__, which calls the base's
            self.calls = getattr(self, "calls", 0) + 1
            return super().__call__(*args, **kwargs)

    return {"abc": WithABC, "metaclass": WithMeta, "slots": WithSlots, "call": WithCall}


def _finetune():
    from torch import nn

    class FineTune(nn.Module):
        """A frozen backbone (an embedding) and a trainable head."""

        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Embedding(64, 32)
            self.backbone.weight.requires_grad_(False)
            self.head = nn.Linear(32, V)

        def forward(self, idx):
            return self.head(self.backbone(idx))

    return FineTune


def _batch(step: int, rank: int, n: int = 6):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, V, (n, 3), generator=g)


def _train(model, opt, wrapped, steps: int, rank: int) -> list[float]:
    import torch.nn.functional as F

    losses = []
    for step in range(steps):
        idx = _batch(step, rank)
        loss = F.cross_entropy(wrapped(idx).reshape(-1, V), idx.flip(1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _state(model, zero: bool) -> dict:
    import torch

    import zero_strategy as zs

    with zs.gathered_parameters(model) if zero else torch.no_grad():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- cases


def case_class_swap(rank: int, world: int, kind: str, stage: int) -> None:
    """The swapped class keeps the model's layout whatever its bases, and the mixin's methods
    run in front of the class's own: the root hooks see the call, zero_grad is the engine's."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    cls = _models()[kind]
    torch.manual_seed(0)
    ref = cls().double()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = _train(ref, ref_opt, DDP(ref), 4, rank)
    torch.manual_seed(0)
    model = cls().double()
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    assert isinstance(model, cls) and type(model).__mro__[1] is cls, type(model).__mro__
    eng = model.zero_engine
    depths, zero_grads = [], []
    model.head.register_forward_pre_hook(lambda m, a: depths.append(eng.sync_state.root_depth))
    inner = eng.zero_grad
    eng.zero_grad = lambda set_to_none=True, **kw: (
        zero_grads.append(set_to_none),
        inner(set_to_none=set_to_none, **kw),
    )[1]
    losses = _train(model, opt, model, 4, rank)
    model.zero_grad()  # the model's own zero_grad is the engine's too
    assert depths == [1, 1, 1, 1], f"the mixin's __call__ did not run: root depth seen in forward {depths}"
    assert zero_grads == [True] * 5, zero_grads
    if kind == "metaclass":
        assert type(model).built_by_meta and type(type(model)).__name__ == "ABCMetaMeta"
    if kind == "call":
        assert model.calls == 4
    assert_close(losses, ref_losses, rtol=1e-9, what=f"{kind} stage {stage} losses")
    for k, v in _state(ref, False).items():
        assert_close(_state(model, True)[k], v, rtol=1e-6, atol=1e-12, what=f"{kind} stage {stage} {k}")


def case_setup_leaves_rng_as_ddp(rank: int, world: int, stage: int) -> None:
    """initialize() draws no random number: every stream is where DDP(model) leaves it."""
    import random

    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    def digest() -> tuple:
        return (torch.get_rng_state().sum().item(), torch.rand(1).item(), random.random(), float(np.random.rand()))

    cls = _models()["abc"]
    out = []
    for wrap in ("ddp", "zero"):
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)
        model = cls()
        if wrap == "ddp":
            DDP(model)
        else:
            zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
        out.append(digest())
    assert out[0] == out[1], out


def case_model_only(rank: int, world: int, stage: int) -> None:
    """initialize(model, None): at ZeRO-1/2 p.grad behaves as DDP's (full average at sync
    points, local inside no_sync, decided when the forward runs, sync_next_backward as
    Accelerate's trigger_sync_in_backward); at ZeRO-3 the model is sharded for evaluation."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()

    def x(i: int) -> torch.Tensor:
        return torch.randn(3, 4, dtype=torch.double, generator=torch.Generator().manual_seed(10 * i + rank))

    ref, model = net(), net()
    ddp = DDP(ref)
    model, opt = zs.initialize(model, None, stage=stage, stage3_param_persistence_threshold=0)
    assert opt is None
    if stage == 3:
        with torch.no_grad():
            assert_close(model(x(0)), ref(x(0)), rtol=1e-12, what="model-only ZeRO-3 output")
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())  # sharded
        return

    def grads(m) -> list:
        return [p.grad.clone() for p in m.parameters()]

    def same() -> bool:
        return all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(grads(model), grads(ddp)))

    checks = []
    # 1: forward+backward inside no_sync: local; 2: outside: averaged; 3: forward inside, backward
    # outside: local (DDP decides at forward); 4: forward outside, backward inside: averaged
    for i, (fwd_quiet, bwd_quiet) in enumerate([(True, True), (False, False), (True, False), (False, True)]):
        for m in (ddp, model):
            with m.no_sync() if fwd_quiet else torch.enable_grad():
                out = m(x(i)).sum()
            with m.no_sync() if bwd_quiet else torch.enable_grad():
                out.backward()
        checks.append(same())
    assert checks == [True] * 4, checks
    # several forwards inside no_sync, their backwards outside, the last one triggered (Accelerate's test_sync)
    model.zero_grad()
    ddp.zero_grad()
    outs = []
    for m in (ddp, model):
        with m.no_sync():
            outs.append([m(x(20 + k)).sum() for k in range(3)])
    for k in range(3):
        if k == 2:
            model.zero_engine.sync_next_backward()
            ddp.require_backward_grad_sync = True
            ddp.require_forward_param_sync = True
            ddp.reducer.prepare_for_backward([])
        outs[0][k].backward()
        outs[1][k].backward()
        assert same(), f"backward {k}: gradients differ from DDP's"
    # a model whose parameters are all frozen sets up too (Accelerate prepares such models)
    frozen = net().requires_grad_(False)
    frozen, _ = zs.initialize(frozen, None, stage=stage)
    with torch.no_grad():
        assert_close(frozen(x(0)), ref(x(0)), rtol=1e-12, what="all-frozen model output")


def case_frozen_zero3(rank: int, world: int, root: str) -> None:
    """A frozen embedding and a trainable head built under sharded_init at ZeRO-3: equal to DDP,
    the frozen bytes split across ranks, and a checkpoint that holds them (reloaded on 3 ranks)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    FineTune = _finetune()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        ref = FineTune()
        torch.manual_seed(0)
        with zs.sharded_init():
            model = FineTune()
    finally:
        torch.set_default_dtype(torch.float32)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model, opt = zs.initialize(
        model, lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-2), stage=3
    )
    frozen_bytes = model.zero_engine.memory_stats()["param_shards"]
    full = sum(p.numel() * 8 for p in ref.parameters())
    assert frozen_bytes <= 1.05 * full / world + 64, (frozen_bytes, full)
    for step in range(4):
        idx = _batch(step, rank)
        for m, o in ((ddp, ref_opt), (model, opt)):
            loss = F.cross_entropy(m(idx).reshape(-1, V), idx.reshape(-1))
            loss.backward()
            o.step()
            o.zero_grad()
            if m is model:
                assert torch.isfinite(loss), "frozen parameters built under sharded_init read as NaN"
    for k, v in _state(ref, False).items():
        assert_close(_state(model, True)[k], v, rtol=1e-9, atol=1e-12, what=f"frozen fine-tune {k}")
    zs.save_checkpoint(root, model, opt, extra={"reference": {k: v.tolist() for k, v in _state(ref, False).items()}})


def case_stale_after_load(rank: int, world: int) -> None:
    """Persistent (small) ZeRO-3 units stay gathered after use; loading new weights must refresh
    them: an eval forward, a load, an eval forward that equals the loaded weights'."""
    import torch

    import zero_strategy as zs

    cls = _models()["abc"]
    torch.manual_seed(0)
    model = cls()
    torch.manual_seed(1)
    other = cls()
    model, _ = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                             stage3_param_persistence_threshold=10**6)  # fmt: skip
    idx = _batch(0, rank)
    model.eval()
    with torch.no_grad():
        model(idx)  # every unit is now gathered and kept
        assert all(u.persistent for u in model.zero_engine.params.units)
        zs.load_full_state_dict(model, other.state_dict())
        assert_close(model(idx), other(idx), rtol=1e-6, what="output after load_full_state_dict")


def _moe():
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

        def forward(self, x):
            return self.out(torch.tanh(self.fc(x)))

    class TopTwoMoE(nn.Module):
        """Top-2 routing; the experts are the model's outermost ModuleList, and an expert no
        token picked is skipped, so ranks run different experts."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.router = nn.Linear(D, 4)
            self.experts = nn.ModuleList(Expert() for _ in range(4))
            self.head = nn.Linear(D, V)
            self.used: list[int] = []

        def forward(self, idx):
            flat = self.emb(idx).reshape(-1, D)
            w, sel = self.router(flat).softmax(-1).topk(2, dim=-1)
            out = torch.zeros_like(flat)
            self.used = []
            for e, expert in enumerate(self.experts):
                rows, slot = (sel == e).nonzero(as_tuple=True)
                if rows.numel():
                    self.used.append(e)
                    out = out.index_add(0, rows, w[rows, slot, None] * expert(flat[rows]))
            return self.head(flat + out).reshape(*idx.shape, V)

    return TopTwoMoE


def _ddp_then_zero3(cls):
    """("ddp", DDP(find_unused_parameters), model, AdamW), then ("zero", the ZeRO-3 model under the
    default policy, model, optimizer): the same float64 model, seeded alike."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    for mode in ("ddp", "zero"):
        torch.manual_seed(0)
        model = cls().double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if mode == "ddp":
            yield mode, DDP(model, find_unused_parameters=True), model, opt
        else:
            net, opt = zs.initialize(model, opt, stage=3, stage3_param_persistence_threshold=0)
            yield mode, net, model, opt


def case_moe_default_policy(rank: int, world: int, accum: bool) -> dict:
    """The default policy makes each expert a unit; ranks that skip experts must not diverge.
    Routing is the same on every rank until step 5 (all experts picked), then differs."""
    import torch
    import torch.nn.functional as F

    TopTwoMoE = _moe()

    def tokens(step: int, micro: int) -> torch.Tensor:
        if step < 5:  # many tokens: every expert is picked on every rank
            return _batch(10 * step + micro, rank, n=12)
        return torch.tensor([[(rank * 5 + step + micro) % V, 3]])  # two tokens: some experts skipped

    runs = {}
    for mode, net, model, opt in _ddp_then_zero3(TopTwoMoE):
        if mode == "zero":
            assert [u.label for u in model.zero_engine.params.units] == [f"experts.{e}" for e in range(4)] + ["<root>"]
        losses, used = [], []
        for step in range(8):
            for micro in range(2 if accum else 1):
                quiet = accum and micro == 0
                with net.no_sync() if quiet else torch.enable_grad():
                    idx = tokens(step, micro)
                    loss = F.cross_entropy(net(idx).reshape(-1, V), idx.flip(1).reshape(-1))
                    (loss / (2 if accum else 1)).backward()
                losses.append(loss.item())
                used.append(list(model.used))
            opt.step()
            opt.zero_grad()
        runs[mode] = (losses, used, _state(model, mode == "zero"))
        if mode == "zero":
            runs["pinned"] = sorted(model.zero_engine.zero3.pinned)
    (ref_losses, ref_used, ref_state), (losses, used, state) = runs["ddp"], runs["zero"]
    assert used == ref_used
    assert_close(losses, ref_losses, rtol=1e-9, what="MoE losses")
    for k, v in ref_state.items():
        assert_close(state[k], v, rtol=1e-6, atol=1e-12, what=f"MoE {k}")
    return {"used": used, "pinned": runs["pinned"]}


def case_two_lists(rank: int, world: int, extra_on: int) -> None:
    """Two lists under the default policy: ``blocks`` always runs, ``experts`` is conditional, and
    one rank runs one more expert at the very end of its forward. That rank's last agreement
    meets the others' end of forward: every list must be pinned then, or the longer rank asks
    for an agreement nobody joins (a collective mismatch)."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
            self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

        def forward(self, x, n_experts: int):
            for b in self.blocks:
                x = torch.tanh(b(x))
            for e in self.experts[:n_experts]:
                x = x + e(x)
            return x.square().mean()

    runs = {}
    for mode, net, model, opt in _ddp_then_zero3(Net):
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            n = 1 + (step >= 1) + (step >= 1 and rank == extra_on)  # all equal at step 0
            loss = net(torch.randn(3, D, generator=g, dtype=torch.float64), n)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[mode] = (losses, _state(model, mode == "zero"))
        if mode == "zero":
            labels = [u.label for u in model.zero_engine.params.units]
            assert labels == ["blocks.0", "blocks.1", "experts.0", "experts.1", "experts.2"], (
                labels
            )  # no root parameters
            assert model.zero_engine.zero3.pinned == {1, 2, 3, 4, 5}, model.zero_engine.zero3.pinned
    assert_close(runs["zero"][0], runs["ddp"][0], rtol=1e-9, what="two-list losses")
    for k, v in runs["ddp"][1].items():
        assert_close(runs["zero"][1][k], v, rtol=1e-6, atol=1e-12, what=f"two-list {k}")


def case_gpt_default_units(rank: int, world: int) -> None:
    """A transformer under the default policy: one unit per block, and the per-block check
    never pins the list (every rank runs every block)."""
    import torch
    import torch.nn.functional as F

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=3, n_head=2)
    model = GPT(cfg)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    labels = [u.label for u in model.zero_engine.params.units]
    assert labels == ["blocks.0", "blocks.1", "blocks.2", "<root>"], labels
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, step, seed=rank)
        F.cross_entropy(model(x).view(-1, 32), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    assert model.zero_engine.zero3.pinned == set()


# --------------------------------------------------------------------------- launches


def _world2(rank: int, world: int, root: str) -> dict:
    run_subtests(lambda **kw: case_class_swap(rank, world, **kw),
                 subtest_grid(kind=["abc", "metaclass", "slots", "call"], stage=[2, 3]), label="class swap")  # fmt: skip
    run_subtests(
        lambda **kw: case_setup_leaves_rng_as_ddp(rank, world, **kw), subtest_grid(stage=[1, 2, 3]), label="rng"
    )
    run_subtests(lambda **kw: case_model_only(rank, world, **kw), subtest_grid(stage=[1, 2, 3]), label="model only")
    case_frozen_zero3(rank, world, root)
    case_stale_after_load(rank, world)
    case_gpt_default_units(rank, world)
    run_subtests(lambda **kw: case_two_lists(rank, world, **kw), subtest_grid(extra_on=[0, 1]), label="two lists")
    moe = {}
    run_subtests(lambda accum: moe.update({accum: case_moe_default_policy(rank, world, accum)}),
                 subtest_grid(accum=[False, True]), label="moe")  # fmt: skip
    return moe


def _world3(rank: int, world: int, root: str) -> dict:
    import torch

    import zero_strategy as zs

    moe = case_moe_default_policy(rank, world, accum=True)
    # the world-2 frozen fine-tune's checkpoint, loaded on 3 ranks at ZeRO-3 and ZeRO-1
    out = {"moe": moe}
    FineTune = _finetune()
    for stage in (3, 1):
        torch.manual_seed(99)
        model = FineTune().double()
        model, opt = zs.initialize(
            model, lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad], lr=1e-2), stage=stage
        )
        extra = zs.load_checkpoint(root, model, opt)
        for k, v in _state(model, True).items():
            assert_close(
                v, torch.tensor(extra["reference"][k], dtype=v.dtype), rtol=1e-12, what=f"reloaded stage {stage} {k}"
            )
        out[stage] = True
    return out


def test_real_model_patterns_equal_ddp(launch, tmp_path: Path) -> None:
    root = str(tmp_path / "frozen")
    for r in launch(_world2, 2, args=(root,), timeout=600):
        for accum, moe in r.items():
            assert any(len(u) < 4 for u in moe["used"]), moe["used"]  # some expert was skipped on some rank
            first = next(i for i, u in enumerate(moe["used"]) if len(u) < 4)
            assert first == (10 if accum else 5), (accum, moe["used"])  # routing first diverged at step 5
            assert moe["pinned"] == [1, 2, 3, 4], moe  # the expert list now stays gathered
    for r in launch(_world3, 3, args=(root,), timeout=600):
        assert r[3] and r[1]
        assert any(len(u) < 4 for u in r["moe"]["used"]) and r["moe"]["pinned"] == [1, 2, 3, 4]
