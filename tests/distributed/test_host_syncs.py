"""Host synchronisations per steady-state step, counted at world size 2 (issue 13, part 2).

On CUDA every value read on the host (``tolist``, ``item``, ``bool(t)``, ...) waits for the
device. The engine may make only the documented ones per optimizer step (docs/advanced.md, "Host
synchronisation"): one for the used-gradient flags, one for fp16's overflow check, and the
default policy's routing agreements (one per unit of a list that might run conditionally,
plus one at the end of the forward). None per unit or per parameter: ZeRO-3's gather tags and
placeholder checks are compared on the device after the first step and reported with the
gradient flags. MoE at ZeRO-3 adds its experts' union, one read per experts layer per forward,
and nothing per rank or per parameter (no mask indexing, no host-built index tensor: issue 31,
item 7). On CPU the calls cost nothing, so they are counted (``zero_strategy.testing.syncs``,
which also counts the calls that wait for the device without reading a value)."""

from __future__ import annotations

import pytest

from zero_strategy.testing import run_subtests

WARMUP, STEPS = 2, 3
LAYERS = 3
MOE_LAYERS = 2  # the tiny Mixtral's (tests/distributed/test_moe_fetch.py)


def _cells() -> list[dict]:
    cells = []
    for stage in (1, 2, 3):
        cells += [
            {"stage": stage, "precision": "fp32", "clip": None},
            {"stage": stage, "precision": "fp32", "clip": 0.5},
            {"stage": stage, "precision": "fp16", "clip": 0.5},
            {"stage": stage, "precision": "bf16", "clip": None, "accum": 2},
        ]
    cells.append({"stage": 3, "precision": "fp32", "clip": 0.5, "policy": "default"})
    # top-k compression selects, exchanges and adds on the device: no read of its own
    cells += [{"stage": s, "precision": p, "clip": 0.5, "topk": True} for s, p in ((1, "fp32"), (2, "fp16"))]
    # the deferred checks still report: a write into a sharded parameter on rank 0 after the warm-up
    cells += [{"stage": 3, "precision": "fp32", "clip": None, "write": w} for w in ("step", "eval")]
    # a 2-layer Mixtral's experts, selectively gathered from shards or fetched from their owners
    cells += [{"stage": 3, "precision": "fp32", "clip": None, "moe": m} for m in ("sharded", "owners")]
    return cells


def _expected(c: dict) -> int:
    """The documented list, per optimizer step."""
    n = 1  # the used-gradient flag agreement (carries ZeRO-3's deferred gather checks too)
    n += c["precision"] == "fp16"  # the overflow check
    if c.get("policy") == "default":  # the default policy's routing agreements, per forward
        n += (LAYERS + 1) * c.get("accum", 1)
    if c.get("moe"):  # the experts' union, per experts layer per forward
        n += MOE_LAYERS
    return n


def _run(c: dict, rank: int, world: int) -> dict:
    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig, synthetic_batch
    from zero_strategy.models.gpt import Block
    from zero_strategy.testing.syncs import HostSyncCounter

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=LAYERS, n_head=2)
    torch.manual_seed(0)
    zero = {"stage": c["stage"], "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
    conf: dict = {"zero_optimization": zero, "zero_strategy": {"gather_checks": "deferred"}}  # as on a GPU
    if c.get("topk"):
        conf["zero_strategy"]["compression"] = {"type": "topk", "ratio": 0.01}
    if c["clip"] is not None:
        conf["gradient_clipping"] = c["clip"]
    if c["precision"] != "fp32":
        conf[c["precision"]] = {"enabled": True}
    accum = c.get("accum", 1)
    if c.get("moe"):
        from tests.distributed.test_moe_fetch import _batch, _build

        own = conf["zero_strategy"]
        if c["moe"] != "sharded":
            own["moe_expert_layout"] = c["moe"]
        own["moe_full_gather_share"] = 1.0  # selective: the path that built indices per rank and parameter
        model, opt = zs.initialize(_build("mixtral", 4, 2), lambda p: torch.optim.AdamW(p, lr=1e-3), config=conf)

        def loss_of(step: int, micro: int):
            ids = _batch(step, micro, rank)
            return model(input_ids=ids, labels=ids).loss
    else:
        policy = None if c.get("policy") == "default" else {Block}
        model, opt = zs.initialize(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3), config=conf, policy=policy)

        def loss_of(step: int, micro: int):
            x, y = synthetic_batch(cfg, 2, step * accum + micro, seed=rank)
            return model.loss(x, y)

    if c.get("write"):
        return _written_after_warmup(c, model, opt, cfg, rank)
    counts, losses = [], []
    for step in range(WARMUP + STEPS):
        counter = HostSyncCounter()
        with counter:
            for micro in range(accum):
                loss = loss_of(step, micro)
                zs.backward(loss, model=model)
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        counts.append(counter)
    steady = counts[WARMUP:]
    want = _expected(c)
    for k, counter in enumerate(steady):
        if counter.total != want:
            raise AssertionError(
                f"{c}: step {WARMUP + k} made {counter.total} host syncs, the documented list allows {want}: "
                f"{dict(counter.calls)}"
            )
    values = torch.stack(losses).tolist()
    if not all(v == v and abs(v) < 1e3 for v in values):
        raise AssertionError(f"{c}: losses not finite: {values}")
    # zero_grad(set_to_none=True) frees the gradient shards, as DDP's p.grad = None does (issue 45, item 6)
    held = model.zero_engine.memory_stats()["grad_shards"]
    if held:
        raise AssertionError(f"{c}: {held} bytes of gradient shards kept after zero_grad(set_to_none=True)")
    return {"counts": [s.total for s in steady]}


def _written_after_warmup(c: dict, model, opt, cfg, rank: int) -> dict:
    """After the warm-up the gather checks are deferred; a write into a sharded parameter is
    still named: at the step's gradient flags on every rank (the writer names the parameter),
    or at the end of a forward without gradients on the rank that wrote."""
    import torch

    import zero_strategy as zs
    from zero_strategy.models import synthetic_batch

    for step in range(WARMUP):
        x, y = synthetic_batch(cfg, 2, step, seed=rank)
        zs.backward(model.loss(x, y), model=model)
        opt.step()
        opt.zero_grad()
    if not model.zero_engine.params.checks.deferred:
        raise AssertionError("after the warm-up the gather checks should be deferred")
    if rank == 0:
        with torch.no_grad():
            model.blocks[1].ln1.bias.fill_(1.0)  # a placeholder: the fill changes its one element
    x, y = synthetic_batch(cfg, 2, WARMUP, seed=rank)
    try:
        if c["write"] == "eval":
            with torch.no_grad():
                model(x)
        else:
            zs.backward(model.loss(x, y), model=model)
            opt.step()
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "no error"
    want = "'blocks.1.ln1.bias' was written while it was sharded" if rank == 0 else "another rank found"
    if c["write"] == "eval" and rank == 1:
        want = "no error"  # without a backward nothing is agreed: the rank that wrote raises
    if want not in msg:
        raise AssertionError(f"{c} rank {rank}: expected {want!r}, got {msg!r}")
    return {"message": msg}


def _worker(rank: int, world: int) -> int:
    cells = _cells()
    run_subtests(lambda **kw: _run(kw, rank, world), cells, label="host syncs per step")
    return len(cells)


def test_host_syncs_per_step_are_the_documented_ones(launch) -> None:
    assert launch(_worker, 2, timeout=300) == [len(_cells())] * 2


def _diverging_worker(rank: int, world: int, checks: str) -> str:
    """Rank 1 skips the first unit after the warm-up (a unit order every rank recorded)."""
    import torch
    from torch import nn

    import zero_strategy as zs
    from zero_strategy.comm.collectives import CollectiveError

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(x).tanh()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 1)
            self.blocks = nn.ModuleList(Blk() for _ in range(3))

        def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
            x = self.inp(x)
            for k, b in enumerate(self.blocks):
                if k != skip:
                    x = b(x)
            return self.out(x)

    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_strategy": {"gather_checks": checks, "comm_timeout": 10}}  # fmt: skip
    model, opt = zs.initialize(Net(), lambda p: torch.optim.SGD(p, lr=0.1), config=config, policy={Blk})
    try:
        for step in range(3):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            model(x, skip=0 if (step == 2 and rank == 1) else None).sum().backward()
            opt.step()
            opt.zero_grad()
    except zs.UnitDivergence as e:
        return f"UnitDivergence: {e}"
    except CollectiveError as e:
        return f"CollectiveError: {e}"
    return "no error"


@pytest.mark.parametrize("checks", ["immediate", "deferred"])
def test_a_divergence_after_the_warm_up_stops_every_rank(launch, checks: str) -> None:
    """Immediate checks (the default on CPU): every rank raises the same UnitDivergence.
    Deferred (the default on a GPU): the rank that left the recorded order raises it at once;
    the others, which cannot know without a host read, fail in their next collective within
    ``comm_timeout`` instead of training on with the wrong unit. Nothing hangs."""
    # after a failed collective the process group cannot be torn down cleanly: the ranks may
    # exit non-zero once their result is written
    messages = launch(_diverging_worker, 2, args=(checks,), timeout=120, may_die={0, 1})
    assert messages[1].startswith("UnitDivergence") and "unit 'blocks.0'" in messages[1], messages
    if checks == "immediate":
        assert messages[0].startswith("UnitDivergence") and "ranks [1]" in messages[0], messages
    else:
        assert messages[0].startswith(("UnitDivergence", "CollectiveError")), messages
