"""MoE at ZeRO-3: only the experts the router selected (the union over the ranks) are gathered,
for Hugging Face experts modules found without a per-model list, against the DDP oracle.

One launch at world size 2 runs every training cell (``run_subtests``): a tiny Mixtral and a
tiny Qwen3-MoE built from configs, top-1 and top-2, stages 2 and 3, accumulation (plain and
``no_sync``), clipping; every cell has steps where some expert is selected by no rank, and the
stage-3 cells check that fewer expert bytes were gathered than whole gathers would move; the
experts' cache cells (``moe_expert_cache``) add evaluation forwards between steps; the owners
cells (``moe_expert_layout: owners``) fetch each rank's own experts from their owners. Then
``generate`` on the ZeRO-3 model against the plain model, gathering only the union per step,
checkpoints resumed at another world size and in the other layout, and the experts' cache
across ``load_checkpoint`` and ``load_full_state_dict`` (kept rows of other weights are
dropped)."""

from __future__ import annotations

import pytest

from zero_strategy.testing import assert_close, run_subtests

VOCAB = 32


def _list_moe(experts: int, top_k: int):
    """A hand-written MoE whose experts are a declared ``nn.ModuleList`` (``zs.declare_experts``),
    its blocks the default policy's units."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import zero_strategy as zs

    d = 16

    class Out(dict):
        @property
        def loss(self):
            return self["loss"]

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(d, 8), nn.Linear(8, d)

        def forward(self, x):
            return self.down(torch.tanh(self.up(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.gate = nn.Linear(d, experts, bias=False)
            self.experts = zs.declare_experts(nn.ModuleList(Expert() for _ in range(experts)))

        def forward(self, x):
            h = self.norm(x).reshape(-1, d)
            weights, idx = F.softmax(self.gate(h), dim=-1).topk(top_k, dim=-1)
            zs.select_experts(self.experts, idx)
            out = torch.zeros_like(h)
            for e in idx.unique().tolist():
                tok, pos = torch.where(idx == e)
                out = out.index_add(0, tok, self.experts[e](h[tok]) * weights[tok, pos, None])
            return x + out.view_as(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(d, VOCAB)

        def forward(self, input_ids, labels):
            x = self.emb(input_ids)
            for b in self.blocks:
                x = b(x)
            loss = F.cross_entropy(self.head(x).view(-1, VOCAB), labels.reshape(-1))
            return Out(loss=loss)  # a dict: DDP finds the loss in it (find_unused_parameters)

    torch.manual_seed(0)
    return Net()


def _build(kind: str, experts: int, top_k: int, experts_impl: str = "eager"):
    import torch
    import transformers

    if kind == "list":
        return _list_moe(experts, top_k)

    common = dict(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64, num_experts_per_tok=top_k, tie_word_embeddings=False,
    )  # fmt: skip
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=8, num_local_experts=experts, **common)
        cls = transformers.MixtralForCausalLM
    elif kind == "gpt_oss":  # transposed stacked weights plus biases, the selection as router_indices
        cfg = transformers.GptOssConfig(
            intermediate_size=8, num_local_experts=experts, head_dim=8, sliding_window=8,
            layer_types=["full_attention", "sliding_attention"], **common,
        )  # fmt: skip
        cls = transformers.GptOssForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=16, moe_intermediate_size=8, num_experts=experts, decoder_sparse_step=1,
            head_dim=8, norm_topk_prob=True, **common,
        )  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    cfg._experts_implementation = experts_impl  # transformers' eager, grouped_mm or batched_mm experts forward
    torch.manual_seed(0)
    return cls(cfg).float()


def _batch(step: int, micro: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (1, 3), generator=g)  # few tokens: some expert is idle on every rank


def _train(
    kind: str,
    experts: int,
    top_k: int,
    mode: str,
    stage: int,
    accum: str,
    clip: float | None,
    rank: int,
    switch: bool,
    cache: int = 0,
    evals: bool = False,
    layout: str = "sharded",
    impl: str = "auto",
    frozen: bool = False,
    extra: dict | None = None,
    experts_impl: str = "eager",
    ckpt: str = "",
    compact: bool = True,
):
    import contextlib

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    model = _build(kind, experts, top_k, experts_impl)
    if ckpt:  # activation checkpointing: DDP's reference recomputes without reentrancy
        model.gradient_checkpointing_enable({"use_reentrant": ckpt == "reentrant" and mode == "zero"})
    for name, p in model.named_parameters():
        if frozen and "experts.down_proj" in name:  # an experts unit with a frozen parameter
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)  # eps: no amplified rounding of tiny grads
    if mode == "ddp":
        net = DDP(model, find_unused_parameters=kind == "list")  # idle ModuleList experts: no gradient
        no_sync = net.no_sync
    else:
        # share 1.0: selective unless padding makes it whole; the switch cell keeps the default
        share = {} if switch else {"moe_full_gather_share": 1.0}
        if cache:  # the experts' cache: bytes per experts layer
            share["moe_expert_cache"] = cache
        if layout != "sharded":  # each expert whole on one rank (sharding/experts/owners.py)
            share["moe_expert_layout"] = layout
        if impl != "auto":  # "native": torch.distributed's own collectives (gloo's all_to_all_single)
            share["collective_impl"] = impl
        if not compact:  # the selected rows in zeroed full-size parameters (sharding/experts/selective.py)
            share["moe_compact_gather"] = False
        cfg = zs.ZeroConfig(stage=stage, stage3_param_persistence_threshold=0, **share, **(extra or {}))
        net, opt = zs.initialize(model, opt, config=cfg)
        no_sync = net.no_sync
    n_micro = 1 if accum == "none" else 2
    losses = []
    for step in range(3):
        for micro in range(n_micro):
            ids = _batch(step, micro, rank)
            quiet = accum == "no_sync" and micro < n_micro - 1
            with no_sync() if quiet else contextlib.nullcontext():
                loss = net(input_ids=ids, labels=ids).loss
                (loss / n_micro).backward()
            losses.append(loss.item())
        if clip is not None:
            losses.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if evals:  # an evaluation forward between steps (the expert cache keeps its rows for the next step)
            model.eval()
            with torch.no_grad():
                ids = _batch(step, 9, rank)
                losses.append(net(input_ids=ids, labels=ids).loss.item())
            model.train()
    stats = net.zero_engine.memory_stats() if mode == "zero" else {}
    with zs.gathered_parameters(model) if mode == "zero" else contextlib.nullcontext():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, stats


def _parity_cell(
    rank: int,
    kind: str,
    experts: int,
    top_k: int,
    stage: int,
    accum: str,
    clip: float | None,
    switch: bool = False,
    **more,
) -> None:
    """DDP's numbers; at stage 3 only the union moved, and (compact gathers, the default for
    stacked experts) each layer held only the union's rows."""
    ref_losses, ref_state, _ = _train(kind, experts, top_k, "ddp", stage, accum, clip, rank, switch, **more)
    losses, state, stats = _train(kind, experts, top_k, "zero", stage, accum, clip, rank, switch, **more)
    assert_close(losses, ref_losses, rtol=1e-5, what=f"rank {rank}: losses (and clip norms) against DDP")
    assert state.keys() == ref_state.keys(), (sorted(state), sorted(ref_state))
    for k, ref in ref_state.items():
        assert_close(state[k], ref, rtol=0.0, atol=1e-5 * float(ref.abs().max()), what=f"rank {rank}: {k}")
    if stage == 3 and switch:  # the cost switch chose whole gathers, placed compactly all the same
        assert stats["moe_full_gathers"] > 0 and stats["moe_gathered_bytes"] <= stats["moe_full_bytes"], stats
        assert stats["moe_compact_gathers"] >= stats["moe_full_gathers"], stats
    elif stage == 3:
        # some expert was selected by no rank in some pass, and only the union moved
        assert 0 < stats["moe_union_experts"] < stats["moe_experts_seen"], stats
        assert stats["moe_full_gathers"] < stats["moe_gathers"] / 4, stats  # whole: the union's rows all on one rank
        assert 0 < stats["moe_gathered_bytes"] < stats["moe_full_bytes"], stats
        assert 0 < stats["moe_reduced_bytes"] < stats["moe_full_reduce_bytes"], stats
        layer = stats["moe_full_bytes"] // stats["moe_gathers"]  # a whole gather's parameters: the full layer
        if more.get("compact", True) and kind != "list":  # [U, ...] parameters: less than the full layer
            assert stats["moe_compact_gathers"] > 0 and 0 < stats["moe_peak_layer_bytes"] < layer, (stats, layer)
        else:  # zeroed full-size parameters (a ModuleList's idle members stay placeholders)
            assert stats["moe_compact_gathers"] == 0 and stats["moe_peak_layer_bytes"] <= layer, (stats, layer)
            assert kind == "list" or stats["moe_peak_layer_bytes"] == layer, (stats, layer)


def _owners_cell(
    rank: int,
    kind: str,
    experts: int,
    top_k: int,
    accum: str,
    clip: float | None,
    impl: str = "auto",
    switch: bool = False,
    frozen: bool = False,
    extra: dict | None = None,
) -> None:
    """The owners layout (each expert whole on one rank; ``experts`` odd: uneven owners): DDP's
    numbers, and each rank fetched only its own selection, fewer bytes than the union's gathers."""
    args = (kind, experts, top_k)
    more = dict(frozen=frozen, extra=extra)
    ref_losses, ref_state, _ = _train(*args, "ddp", 3, accum, clip, rank, False, frozen=frozen)
    _, _, union = _train(*args, "zero", 3, accum, clip, rank, False, **more)
    losses, state, stats = _train(*args, "zero", 3, accum, clip, rank, switch, layout="owners", impl=impl, **more)
    assert_close(losses, ref_losses, rtol=1e-5, what=f"rank {rank}: losses with expert owners against DDP")
    for k, ref in ref_state.items():
        assert_close(state[k], ref, rtol=0.0, atol=1e-5 * float(ref.abs().max()), what=f"rank {rank}: {k}")
    if switch:  # the default share: the busiest rank moves too much, so whole gathers and reductions
        assert stats["moe_full_gathers"] > 0 and stats["moe_reduced_bytes"] == stats["moe_full_reduce_bytes"], stats
        return
    # share 1.0: whole only when the busiest rank would move a whole gather's bytes (few experts: it happens)
    assert 0 <= stats["moe_full_gathers"] < stats["moe_gathers"] / 2, stats
    if not stats["moe_full_gathers"]:
        assert 0 < stats["moe_peak_gather_bytes"] < stats["moe_full_bytes"] / stats["moe_gathers"], stats
    assert 0 < stats["moe_gathered_bytes"] < union["moe_gathered_bytes"], (stats, union)
    assert 0 < stats["moe_reduced_bytes"] < stats["moe_full_reduce_bytes"], stats


_OWNER_CELLS = [
    dict(kind="mixtral", experts=5, top_k=2, accum="none", clip=None),
    dict(kind="mixtral", experts=7, top_k=1, accum="no_sync", clip=0.05),
    dict(kind="qwen3_moe", experts=31, top_k=2, accum="plain", clip=None),
    dict(kind="mixtral", experts=9, top_k=2, accum="no_sync", clip=None, impl="native"),
    dict(kind="gpt_oss", experts=7, top_k=2, accum="no_sync", clip=0.05),
    dict(kind="mixtral", experts=4, top_k=2, accum="plain", clip=0.05, switch=True),
    # a frozen parameter in the experts unit, the optimizer's side on the host
    dict(
        kind="mixtral",
        experts=5,
        top_k=2,
        accum="no_sync",
        clip=0.05,
        frozen=True,
        extra={"offload_optimizer": {"device": "cpu"}},
    ),
]


def _cache_cell(rank: int, kind: str, experts: int, per_expert: int, kept: int) -> None:
    """The experts' cache (``moe_expert_cache``): the same numbers as DDP with accumulation under
    ``no_sync`` and evaluation forwards between steps; rows kept from earlier passes of the step
    are not gathered again (hits, fewer bytes than without the cache), the cap never exceeded."""
    cap = kept * per_expert  # about a pass's union (6 tokens, top-2): kept for its backward, evictions after
    args = (kind, experts, 2)
    ref_losses, ref_state, _ = _train(*args, "ddp", 3, "no_sync", None, rank, False, evals=True)
    _, _, plain = _train(*args, "zero", 3, "no_sync", None, rank, False, evals=True)
    losses, state, stats = _train(*args, "zero", 3, "no_sync", None, rank, False, cache=cap, evals=True)
    assert_close(losses, ref_losses, rtol=1e-5, what=f"rank {rank}: losses with the expert cache against DDP")
    for k, ref in ref_state.items():
        assert_close(state[k], ref, rtol=0.0, atol=1e-5 * float(ref.abs().max()), what=f"rank {rank}: {k}")
    assert stats["moe_cache_hits"] > 0 and stats["moe_cache_misses"] > 0, stats
    assert stats["moe_cache_evictions"] > 0 and stats["moe_bytes_not_moved"] > 0, stats
    assert stats["moe_cache_passes"] > 0, stats  # a pass served from the cache alone: no gather
    assert 0 < stats["moe_cache_peak"] <= cap, (stats["moe_cache_peak"], cap)
    assert stats["moe_gathered_bytes"] < plain["moe_gathered_bytes"], (stats, plain)
    assert plain["moe_cache_hits"] == 0 and plain["moe_cache_peak"] == 0, plain


_CACHE_CELLS = [  # bytes per expert: Mixtral gate_up_proj [2I, H] + down_proj [H, I]; a list's two Linears
    dict(kind="mixtral", experts=32, per_expert=(16 * 16 + 16 * 8) * 4, kept=10),
    dict(kind="list", experts=8, per_expert=(16 * 8 + 8 + 8 * 16 + 16) * 4, kept=5),
]


def _cells() -> list[dict]:
    # E=4 top-2, the default share: the union is most experts, so the switch gathers (and reduces) whole
    return [
        dict(kind="mixtral", experts=32, top_k=2, stage=3, accum="none", clip=None),
        dict(kind="mixtral", experts=16, top_k=1, stage=3, accum="no_sync", clip=0.05),
        dict(kind="mixtral", experts=32, top_k=2, stage=3, accum="plain", clip=None),
        dict(kind="qwen3_moe", experts=32, top_k=2, stage=3, accum="none", clip=0.05),
        dict(kind="qwen3_moe", experts=32, top_k=1, stage=3, accum="no_sync", clip=None),
        dict(kind="mixtral", experts=4, top_k=2, stage=3, accum="plain", clip=0.05, switch=True),
        dict(kind="list", experts=8, top_k=1, stage=3, accum="none", clip=0.05),
        dict(kind="list", experts=8, top_k=2, stage=3, accum="no_sync", clip=None),
        dict(kind="list", experts=8, top_k=2, stage=2, accum="plain", clip=None),
        dict(kind="mixtral", experts=8, top_k=2, stage=2, accum="no_sync", clip=0.05),
        dict(kind="qwen3_moe", experts=8, top_k=1, stage=2, accum="none", clip=None),
        # compact gathers ([U, ...], experts/compact.py) under transformers' other experts forwards,
        # activation checkpointing (recomputed in the backward, reentrant or not), GPT-OSS's
        # transposed weights with biases, and the full-size placement kept as an option
        dict(kind="mixtral", experts=32, top_k=2, stage=3, accum="no_sync", clip=None, experts_impl="grouped_mm"),
        dict(kind="qwen3_moe", experts=32, top_k=2, stage=3, accum="plain", clip=0.05, experts_impl="batched_mm"),
        dict(kind="mixtral", experts=32, top_k=2, stage=3, accum="plain", clip=None, ckpt="reentrant"),
        dict(kind="qwen3_moe", experts=32, top_k=1, stage=3, accum="no_sync", clip=None, ckpt="plain"),
        dict(kind="gpt_oss", experts=16, top_k=2, stage=3, accum="no_sync", clip=0.05),
        dict(kind="mixtral", experts=32, top_k=2, stage=3, accum="no_sync", clip=0.05, compact=False),
    ]


def _generate_case(rank: int) -> None:
    import copy

    import torch

    import zero_strategy as zs

    plain = _build("mixtral", 16, 2).eval()
    with torch.no_grad():  # a sharper head: the greedy ids depend on the weights, not on rounding
        plain.lm_head.weight.mul_(4.0)
    model, _ = zs.initialize(
        copy.deepcopy(plain), lambda p: torch.optim.SGD(p, lr=0.1),
        config=zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, moe_full_gather_share=1.0),
    )  # fmt: skip
    model.eval()
    prompt = torch.tensor([[1, 2, 3, 4]])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    before = model.zero_engine.memory_stats()
    with torch.no_grad():
        got, ref = model.generate(prompt, **kw), plain.generate(prompt, **kw)
    assert got.tolist() == ref.tolist() and got.shape == (1, 9), (got.tolist(), ref.tolist())
    after = model.zero_engine.memory_stats()
    moved = after["moe_gathered_bytes"] - before["moe_gathered_bytes"]
    whole = after["moe_full_bytes"] - before["moe_full_bytes"]
    assert 0 < moved < whole / 2, (moved, whole)  # one token per decode step: 2 of 16 experts per rank

    def generated(**setting) -> dict:
        """``generate`` on a ZeRO-3 copy with ``setting``: the plain model's ids; its counters."""
        cfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, moe_full_gather_share=1.0, **setting)
        other, _ = zs.initialize(copy.deepcopy(plain), lambda p: torch.optim.SGD(p, lr=0.1), config=cfg)
        other.eval()
        with torch.no_grad():
            again = other.generate(prompt, **kw)
        assert again.tolist() == ref.tolist(), (setting, again.tolist(), ref.tolist())
        return other.zero_engine.memory_stats()

    # with the experts' cache, decoding keeps the experts earlier tokens selected (nothing changes the weights)
    stats = generated(moe_expert_cache="64KiB")
    assert stats["moe_cache_hits"] > 0 and 0 < stats["moe_gathered_bytes"] < moved, (stats, moved)
    # expert owners: each rank fetches the experts its tokens selected from their owners
    stats = generated(moe_expert_layout="owners")
    assert stats["moe_full_gathers"] == 0 and 0 < stats["moe_gathered_bytes"] <= moved, (stats, moved)


def _checkpoint_case(rank: int, tmp: str, saved: str = "sharded", loaded: str = "sharded", experts: int = 32) -> None:
    """Save at world size 2 after two steps with the ``saved`` expert layout, resume at world
    size 1 and at world size 2 with the ``loaded`` layout and at ZeRO-2 (and the uninterrupted
    run goes on):
    the same losses and weights; ``full_state_dict`` and ``load_full_state_dict`` round-trip the
    experts."""
    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    groups = {n: dist.new_group(list(range(n))) for n in (1, 2)}

    def build(world: int, layout: str = saved, stage: int = 3):
        model = _build("mixtral", experts, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
        share = {"moe_expert_layout": layout} if stage == 3 else {}
        cfg = zs.ZeroConfig(stage=stage, stage3_param_persistence_threshold=0, **share)
        return zs.initialize(model, opt, config=cfg, process_group=groups[world])

    def run(model, opt, world: int, steps: range) -> list[float]:
        out = []
        for step in steps:
            data = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(step))
            ids = data.chunk(world)[rank]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total, group=groups[world])
            out.append(total.item() / world)
        return out

    path = f"{tmp}/moe_{saved}_{loaded}"
    model, opt = build(2)
    run(model, opt, 2, range(2))
    zs.save_checkpoint(path, model, opt)
    full = zs.full_state_dict(model, rank0_only=False)
    ref = run(model, opt, 2, range(2, 4))
    with zs.gathered_parameters(model):
        ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def resumed(m, o, world: int) -> None:
        zs.load_checkpoint(path, m, o)
        got = run(m, o, world, range(2, 4))
        assert_close(got, ref, rtol=1e-5, what=f"losses after resuming at world size {world} ({saved} -> {loaded})")
        with zs.gathered_parameters(m):
            for k, v in m.state_dict().items():
                assert_close(v, ref_state[k], rtol=0.0, atol=1e-5 * float(ref_state[k].abs().max()), what=k)

    if rank == 0:  # the resumed run, alone
        resumed(*build(1, loaded), 1)
    dist.barrier()
    if loaded != saved:  # another layout at the same world size, and ZeRO-2 (every expert whole)
        resumed(*build(2, loaded), 2)
        resumed(*build(2, stage=2), 2)
    m2, _ = build(2, loaded)
    zs.load_full_state_dict(m2, full)
    with zs.gathered_parameters(m2):
        for k, v in m2.state_dict().items():
            assert_close(v, full[k], rtol=0.0, atol=0.0, what=f"load_full_state_dict: {k}")
    assert any("experts.gate_up_proj" in k for k in full), sorted(full)


def _cache_checkpoint_case(rank: int, tmp: str) -> None:
    """The experts' cache across loads: rows kept at other weights are dropped by
    ``load_checkpoint`` and by ``load_full_state_dict``, so an evaluation forward after the load
    gives the loss of the checkpointed weights (the same engine right after the save, and the
    plain model with those weights); the cache keeps serving passes after a load."""
    import torch

    import zero_strategy as zs

    plain = _build("mixtral", 32, 2)
    model = _build("mixtral", 32, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.3)  # large steps: kept rows of other weights show
    cfg = zs.ZeroConfig(stage=3, stage3_param_persistence_threshold=0, moe_expert_cache="64KiB")  # all 32 kept
    model, opt = zs.initialize(model, opt, config=cfg)
    ids = _batch(0, 9, rank)

    def train(step: int) -> None:
        model.train()
        batch = _batch(step, 0, rank)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids, labels=ids).loss.item()

    def kept() -> int:
        return model.zero_engine.memory_stats()["moe_cache_bytes"]

    train(0)
    saved = evaluate()  # the rows of this forward's union are kept at the saved weights
    zs.save_checkpoint(f"{tmp}/cache", model, opt)
    full = zs.full_state_dict(model, rank0_only=False)
    plain.load_state_dict(full)
    with torch.no_grad():
        ref = plain.eval()(input_ids=ids, labels=ids).loss.item()
    assert_close(saved, ref, rtol=1e-5, what=f"rank {rank}: loss after the save against the plain model")
    for load in ("load_checkpoint", "load_full_state_dict"):
        train(1 if load == "load_checkpoint" else 2)  # other weights, and their rows kept by the evaluation
        moved = evaluate()
        assert abs(moved - saved) > 0.01 * abs(saved), (load, moved, saved)  # the step changed this loss
        assert kept() > 0, load
        if load == "load_checkpoint":
            zs.load_checkpoint(f"{tmp}/cache", model, opt)
        else:
            zs.load_full_state_dict(model, full)
        hits = model.zero_engine.memory_stats()["moe_cache_hits"]
        for again in range(2):  # the second pass is served from rows kept after the load
            got = evaluate()
            assert_close(got, saved, rtol=1e-6, what=f"rank {rank}: loss after {load} (pass {again})")
            assert_close(got, ref, rtol=1e-5, what=f"rank {rank}: loss after {load} against the plain model")
        assert model.zero_engine.memory_stats()["moe_cache_hits"] > hits, load


def _tied_moe(calls: int, as_list: bool):
    """A block that calls one transformers ``MixtralExperts`` module ``calls`` times (two routers),
    optionally with its selection as a Python list (a call whose selection the engine cannot read:
    the union is every expert)."""
    import torch
    import torch.nn.functional as F
    import transformers
    from torch import nn
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    d, e = 16, 8
    cfg = transformers.MixtralConfig(hidden_size=d, intermediate_size=8, num_local_experts=e, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"

    class Out(dict):
        @property
        def loss(self):
            return self["loss"]

    class Experts(MixtralExperts):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            if isinstance(top_k_index, list):
                top_k_index = torch.tensor(top_k_index)
            return super().forward(hidden_states, top_k_index, top_k_weights)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.gates = nn.ModuleList(nn.Linear(d, e, bias=False) for _ in range(calls))
            self.experts = Experts(cfg)
            self.head = nn.Linear(d, VOCAB)

        def forward(self, input_ids, labels=None):
            h = self.emb(input_ids).view(-1, d)
            for gate in self.gates:
                w, idx = F.softmax(gate(h), -1).topk(2, -1)
                h = h + self.experts(h, idx.tolist() if as_list else idx, w)
            logits = self.head(h)
            return Out(loss=F.cross_entropy(logits, labels.view(-1)), logits=logits)

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        for p in net.experts.parameters():
            p.normal_(0, 0.3)
    return net


def _placement_case(
    rank: int,
    calls: int = 1,
    as_list: bool = False,
    threshold: int = 0,
    evals: bool = False,
    inside: bool = False,
    raised: bool = False,
    compact: bool = True,
) -> None:
    """Compact placements in the corners: a persistent experts unit (``threshold``: the default
    keeps a small one gathered whole), a call whose selection is unreadable (gathered whole, its
    backward too), one module called twice per forward, an evaluation forward between a forward
    and its backward, a training step inside ``gathered_parameters`` (``inside``), a forward
    whose experts call raised after the engine placed its selection (``raised``: a user's
    pre-hook registered later; with ``compact`` off the rows are placed full-size), and a forward
    inside ``gathered_parameters`` after the steps (no stale slots): the weights of SGD on both
    ranks' batches in one process, and its logits."""
    import contextlib
    import copy

    import torch

    import zero_strategy as zs

    ref = _tied_moe(calls, as_list)
    model = copy.deepcopy(ref)
    start = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(2):
        for micro in range(2):
            for r in range(2):
                ids = _batch(step, micro, r)
                (ref(input_ids=ids, labels=ids).loss / 4).backward()
        ropt.step()
        ropt.zero_grad()
    cfg = zs.ZeroConfig(
        stage=3, stage3_param_persistence_threshold=threshold, moe_full_gather_share=1.0, moe_compact_gather=compact
    )
    net, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), config=cfg)
    if raised:  # the engine's pre-hook placed the selected rows, then the call raised

        def refuse(module, args):
            raise ValueError("refused by a later pre-hook")

        handle = model.experts.register_forward_pre_hook(refuse)
        ids = _batch(5, 5, rank)
        with pytest.raises(ValueError, match="refused"):
            net(input_ids=ids, labels=ids)
        handle.remove()
        with torch.no_grad(), zs.gathered_parameters(model):  # the whole experts, not the placed rows
            for k, v in model.state_dict().items():
                assert tuple(v.shape) == tuple(start[k].shape), f"rank {rank}: {k} is {tuple(v.shape)} after a raise"
                assert_close(v, start[k], rtol=0.0, atol=0.0, what=f"rank {rank}: {k} after a raise")
    for step in range(2):
        for micro in range(2):
            ids = _batch(step, micro, rank)
            with zs.gathered_parameters(model) if inside else contextlib.nullcontext():
                loss = net(input_ids=ids, labels=ids).loss
                if evals:  # a no-grad forward of other tokens before the backward
                    with torch.no_grad():
                        more = _batch(step, 7, rank)
                        net(input_ids=more, labels=more)
                with net.no_sync() if micro == 0 else contextlib.nullcontext():
                    (loss / 2).backward()
        opt.step()
        opt.zero_grad()
    probe = _batch(9, 9, rank)
    with torch.no_grad(), zs.gathered_parameters(model):
        got = net(input_ids=probe, labels=probe)["logits"]
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = ref(input_ids=probe, labels=probe)["logits"]
    for k, v in ref.state_dict().items():
        assert_close(state[k], v, rtol=0.0, atol=1e-5 * float(v.abs().max()), what=f"rank {rank}: {k}")
    assert_close(got, want, rtol=1e-5, atol=1e-6, what=f"rank {rank}: logits inside gathered_parameters")
    stats = net.zero_engine.memory_stats()
    if threshold == 0 and not as_list and not inside:  # placed compactly, or full-size when asked
        assert (stats["moe_compact_gathers"] > 0) == compact, stats


_PLACEMENT_CELLS = [
    dict(threshold=100_000),  # the default threshold: the experts unit stays gathered whole
    dict(as_list=True),  # every call gathered whole, and so are the backwards
    dict(calls=2, evals=True),
    dict(inside=True),
    dict(raised=True),
    dict(raised=True, compact=False),
]


def _worker(rank: int, world: int, tmp: str) -> int:
    cells = _cells()
    run_subtests(lambda **kw: _parity_cell(rank, **kw), cells, label="moe parity")
    run_subtests(lambda **kw: _cache_cell(rank, **kw), _CACHE_CELLS, label="moe expert cache")
    run_subtests(lambda **kw: _owners_cell(rank, **kw), _OWNER_CELLS, label="moe expert owners")
    run_subtests(lambda **kw: _placement_case(rank, **kw), _PLACEMENT_CELLS, label="moe compact placements")
    _generate_case(rank)
    _checkpoint_case(rank, tmp)
    _checkpoint_case(rank, tmp, "owners", "sharded", experts=5)  # uneven owners: 3 + 2 experts
    _checkpoint_case(rank, tmp, "sharded", "owners", experts=5)
    _cache_checkpoint_case(rank, tmp)
    return len(cells)


def test_moe_selected_experts_match_ddp(launch, tmp_path) -> None:
    counts = launch(_worker, 2, args=(str(tmp_path),), timeout=120)
    assert counts == [len(_cells())] * 2


_THREE_RANK_CELLS = [  # 7 experts on 3 ranks: owners of 3, 2 and 2; the world-size factor 1/3 is inexact
    dict(kind="mixtral", experts=7, top_k=2, accum="no_sync", clip=0.05),
    dict(kind="qwen3_moe", experts=16, top_k=1, accum="plain", clip=None),
]


def _three_rank_worker(rank: int, world: int) -> int:
    run_subtests(lambda **kw: _owners_cell(rank, **kw), _THREE_RANK_CELLS, label="moe expert owners, 3 ranks")
    return len(_THREE_RANK_CELLS)


def test_expert_owners_at_three_ranks(launch) -> None:
    """Every rank both owns experts others fetch and fetches from two owners."""
    assert launch(_three_rank_worker, 3, timeout=120) == [len(_THREE_RANK_CELLS)] * 3
