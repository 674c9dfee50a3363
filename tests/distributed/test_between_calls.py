"""ZeRO-3 calls made while a step is open, against DDP and the plain model.

- A forward of the whole model without gradients between a forward and its backward (TRL's
  ``DPOTrainer`` without a ``ref_model`` computes the reference log-probs so, under
  ``disable_adapter()``): it frees only what it gathered, and leaves the recorded unit order,
  the prefetch schedule and the deferred gather checks of the pending backward alone, also
  when it runs the units in another order or on one rank only (from the cache, no collective).
- ``generate`` when the ranks' prompts reach EOS at different steps: the ranks keep stepping
  together (``synced_gpus``), each rank's ids are those of the plain model's ``generate``.
"""

from __future__ import annotations

from tests.distributed.test_zero3 import _ddp_against_zero3
from zero_strategy.testing import run_subtests


def _gpt2(vocab: int = 64):
    """A tiny GPT-2 (no download), float64, dropout off: the same weights on every call."""
    import torch
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double()


def _gathered(model) -> set[str]:
    """The units gathered now that are not persistent (what a call may leave behind)."""
    return {u.label for u in model.zero_engine.zero3.all_units if u.state.name != "SHARDED" and not u.persistent}


def case_gpt2_no_grad_forward_between(rank: int, persist: int | None, checks: str) -> None:
    """DPO's pattern on a GPT-2: the policy's forward, the whole model again under ``no_grad``
    (the reference), then the backward of a loss that uses both."""
    import torch

    def step_of(net, step: int, rank: int):
        zero = hasattr(net, "zero_engine")
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(2, 64, (2, 6), generator=g)
        out = net(input_ids=ids, labels=ids)
        before = _gathered(net) if zero else set()
        with torch.no_grad():
            reference = net(input_ids=ids.flip(1)).logits
        if zero:  # only what the backward needs stays gathered (the root unit), the order is kept
            assert _gathered(net) == before, (before, _gathered(net))
        return out.loss + 0.1 * (out.logits * reference.softmax(-1)).sum(-1).mean()

    model = _ddp_against_zero3(_gpt2, step_of, rank, persist, config={"gather_checks": checks})
    sched = model.zero_engine.zero3
    assert sched.order is not None and len(sched.order) == 2, sched.order  # recorded despite the call between
    assert not _gathered(model), _gathered(model)  # nothing left gathered after the steps


def _blocks_net():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
            self.out = nn.Linear(8, 2)

        def forward(self, x, order=(0, 1, 2)):
            h = self.inp(x)
            for i in order:
                h = self.blocks[i](h)
            return self.out(h)

    torch.manual_seed(0)
    return Net().double()


def case_no_grad_forward_in_another_order(rank: int, cache: bool) -> None:
    """The call between runs the units in reverse (and, with a cache holding every unit, on rank
    0 only: nothing is gathered, no collective). The backward keeps the recorded order and its
    prefetch; deferred gather checks stay pending for the step's flags on every rank (a check
    read by rank 0 alone made its flags all-reduce shorter than rank 1's)."""
    import torch

    from zero_strategy.runtime.module import get_engine

    order: list[list[int]] = []

    def step_of(net, step: int, rank: int):
        zero = hasattr(net, "zero_engine")
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)
        out = net(x)
        plain = net.module if hasattr(net, "module") else net
        if zero:
            sched = get_engine(net).zero3
            before, pending = _gathered(net), sched.checks.flag() is not None
        if not cache or rank == 0:
            with torch.no_grad():
                reference = plain(x, order=(2, 1, 0))
                plain.blocks[1](plain.inp(x))  # a block alone (an outside call) too
        else:
            reference = torch.zeros_like(out)
        if zero:
            assert _gathered(net) == before, (before, _gathered(net))
            assert (sched.checks.flag() is not None) == pending  # the step's flags read them, on every rank
            order.append(list(sched.order or []))
        return out.pow(2).mean() + 0.1 * (out * reference).mean()

    memory = {"budget": 10**9, "persistent": 0.0, "cache": 10**6, "working": 0.1}
    config = {"gather_checks": "deferred", "prefetch": 2} | ({"memory": memory} if cache else {})
    blocks = lambda m, name: name.startswith("blocks.")  # declared units: no list agreement
    model = _ddp_against_zero3(_blocks_net, step_of, rank, None if cache else 0, 4, config=config, policy=blocks)
    names = {u.tag: u.label for u in model.zero_engine.zero3.all_units}
    assert [[names[t] for t in o] for o in order[1:]] == [[f"blocks.{i}" for i in range(3)]] * 3, order


def case_generate_with_eos_at_different_steps(rank: int, synced: bool | None) -> None:
    """Rank 0's prompt reaches EOS after 2 new tokens, rank 1's never within ``max_new_tokens``:
    rank 0 must keep running forwards (whose gathers rank 1 waits on) until rank 1 is done. Each
    rank's ids equal the plain model's. An explicit ``synced_gpus=False`` would hang: it is not
    followed where a forward communicates (it is where none does: every unit persistent)."""
    import copy

    import torch

    import zero_strategy as zs

    plain = _gpt2().eval()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)

    def greedy(prompt: list[int], **more) -> list[int]:
        with torch.no_grad():
            return plain.generate(torch.tensor([prompt]), **kw, **more)[0, len(prompt) :].tolist()

    # prompts and an EOS token found from the plain model alone (the same on every rank)
    for seed in range(100):
        prompts = torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(seed)).tolist()
        first, second = greedy(prompts[0]), greedy(prompts[1])
        eos = first[1]
        if eos not in first[:1] and eos not in second:
            break
    else:
        raise AssertionError("no prompts found whose EOS steps differ")
    prompt = prompts[rank]
    want = greedy(prompt, eos_token_id=eos)
    assert len(want) == (2 if rank == 0 else 8), want  # the ranks stop at different steps
    model = copy.deepcopy(plain)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, comm_timeout=30)
    model, _ = zs.initialize(model, opt, config=cfg)
    assert not any(u.persistent for u in model.zero_engine.params.units), "units must be freed"
    more = {} if synced is None else {"synced_gpus": synced}
    with torch.no_grad():
        got = model.generate(torch.tensor([prompt]), eos_token_id=eos, **kw, **more)[0, len(prompt) :].tolist()
    assert got == want, (got, want)
    kept = copy.deepcopy(plain)
    kept, _ = zs.initialize(kept, torch.optim.SGD(kept.parameters(), lr=0.1), stage=3)
    assert all(u.persistent for u in kept.zero_engine.params.units)  # the default threshold keeps these whole
    assert kept.zero_engine.zero3.synced_generation(False) is False  # no forward collective: False is safe
    assert kept.zero_engine.zero3.synced_generation(None) is True and model.zero_engine.zero3.synced_generation(False)


def _worker(rank: int, world: int) -> int:
    cases = [
        ("gpt2 no-grad forward between", lambda **kw: case_gpt2_no_grad_forward_between(rank, **kw),
         [{"persist": 0, "checks": "immediate"}, {"persist": None, "checks": "deferred"}]),
        ("another order", lambda **kw: case_no_grad_forward_in_another_order(rank, **kw),
         [{"cache": False}, {"cache": True}]),
        ("generate, EOS apart", lambda **kw: case_generate_with_eos_at_different_steps(rank, **kw),
         [{"synced": None}, {"synced": False}]),
    ]  # fmt: skip
    for label, fn, grid in cases:
        run_subtests(fn, grid, label=label)
    return len(cases)


def test_no_grad_forwards_between_forward_and_backward_and_generate_at_eos_apart(launch) -> None:
    assert launch(_worker, 2, timeout=300) == [3, 3]
