"""Sharded construction, gathered_parameters and loading full weights into a ZeRO-3 model."""

from __future__ import annotations

import pytest

from zero_strategy.testing import assert_close, assert_state_close, run_subtests, subtest_grid
from zero_strategy.testing.lockstep import lockstep_losses


def _cfg():
    from zero_strategy.models import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layer=2, n_head=4)


def _init_worker(rank: int, world: int, tmpdir: str) -> dict:
    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT

    out = {}
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in GPT(_cfg()).state_dict().items()}
    for stage in (3, 2):
        torch.manual_seed(0)
        with zs.sharded_init():
            model = GPT(_cfg())
        # sharded: every parameter is a placeholder that holds no memory and refuses writes
        assert all(p.stride() == (0,) * p.dim() and p.untyped_storage().nbytes() <= 4 for p in model.parameters())
        with pytest.raises(RuntimeError, match="refers to a single memory location"):
            torch.nn.init.normal_(model.head.weight)
        if stage == 2:  # a fill cannot raise at once; initialize names the parameter instead
            with torch.no_grad():
                model.ln_f.bias.zero_()
            with pytest.raises(RuntimeError, match="'ln_f.bias' was written while it was sharded"):
                zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=stage))
            torch.manual_seed(0)
            with zs.sharded_init():
                model = GPT(_cfg())
        model, opt = zs.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=stage)
        )
        with zs.gathered_parameters(model):
            got = {k: v.clone() for k, v in model.state_dict().items()}
        out[f"init{stage}"] = all(torch.equal(got[k], reference[k]) for k in reference)

        # modifier_rank: rank 0's change reaches every rank's shards and masters
        with zs.gathered_parameters(model.ln_f.weight, modifier_rank=0):
            if rank == 0:
                model.ln_f.weight.data.fill_(3.0)
        with zs.gathered_parameters(model):
            out[f"modified{stage}"] = bool((model.ln_f.weight == 3.0).all())
        master = model.zero_engine.master_of(model.ln_f.weight)
        out[f"master{stage}"] = master.numel() > 0 and bool((master == 3.0).all())

        # full weights from a .safetensors file, and strict checking
        if stage == 3:
            from safetensors.torch import save_file

            torch.manual_seed(1)
            other = GPT(_cfg())
            path = f"{tmpdir}/w.safetensors"
            if rank == 0:
                sd = {k: v.contiguous() for k, v in other.state_dict().items() if k != "head.weight"}  # tied
                save_file(sd, path)
            torch.distributed.barrier()
            zs.load_full_state_dict(model, path, strict=False)
            with zs.gathered_parameters(model):
                out["loaded"] = all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
            zs.load_full_state_dict(model, path)  # strict: head.weight is tok.weight (tied), written once
            lacking = {k: v for k, v in other.state_dict().items() if k not in ("head.weight", "tok.weight")}
            with pytest.raises(ValueError, match="missing \\['head.weight', 'tok.weight'\\]"):
                zs.load_full_state_dict(model, lacking)
            bad = dict(other.state_dict())
            bad["ln_f.weight"] = torch.zeros(5)
            with pytest.raises(ValueError, match="'ln_f.weight' has shape \\(5,\\)"):
                zs.load_full_state_dict(model, bad)
        model.zero_engine.close()
    # torch's layers at 2 and 3 ranks (uneven pieces); a Hugging Face model at 2 (its import is slow)
    kinds = ["torch", "llama"] if world == 2 else ["torch"]
    run_subtests(lambda kind: case_parent_writes_children(rank, world, kind), subtest_grid(kind=kinds))
    run_subtests(lambda stage: case_copies_and_kept_views(rank, stage), subtest_grid(stage=[2, 3]))
    return out


def case_copies_and_kept_views(rank: int, stage: int) -> None:
    """``nn.TransformerEncoder`` deep-copies its layer: the copies are pieces, so no more than one
    layer is ever whole (counted at every cut). A view written at the block's level, then
    ``initialize`` inside the block: the write is kept and the engine's parameters stay whole
    (stage 2) or pieces it owns (stage 3) when the block exits."""
    import torch
    from torch import nn

    import zero_strategy as zs
    from zero_strategy.sharding import construction
    from zero_strategy.sharding.pieces import is_placeholder

    whole: list[int] = []
    cut_tree = construction._Construction.cut_tree

    def counting(self, m):  # how many elements are whole when a module's __init__ returns
        with self.pause():
            whole.append(sum(p.numel() for p in m.parameters() if p.numel() > 1 and not is_placeholder(p)))
        return cut_tree(self, m)

    construction._Construction.cut_tree = counting
    try:
        with zs.sharded_init():
            layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0)
            nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)
    finally:
        construction._Construction.cut_tree = cut_tree
    one = sum(p.numel() for p in nn.TransformerEncoderLayer(32, 2, 64).parameters())
    assert whole and max(whole) <= one, f"whole elements at the cuts {whole}; one layer has {one}"

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
        model[0].weight.data[0].zero_()  # a view written at the block's level (a padding row)
        return model

    plain = build()
    with zs.sharded_init():
        model, _ = zs.initialize(build(), lambda p: torch.optim.SGD(p, lr=0.1), stage=stage,
                                 stage3_param_persistence_threshold=0)  # fmt: skip
    idx = torch.tensor([[0, 1, 2]])
    assert_close(model(idx), plain(idx), rtol=0, atol=0, what=f"stage {stage}: forward after the block")
    model.zero_engine.close()


def _layers_model(kind: str):
    """Models whose ``__init__`` writes or copies parameters of children that are already built:
    torch's ``MultiheadAttention`` fills ``out_proj.bias``, ``TransformerEncoder`` deep-copies a
    layer, a parent fills a child's one-element parameter, and a Hugging Face model's
    ``post_init`` initialises every descendant (also a row of the embedding, through a view,
    for the padding token)."""
    import torch
    from torch import nn

    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, pad_token_id=3)  # fmt: skip
        return LlamaForCausalLM(cfg), lambda m, idx: m(input_ids=idx).logits

    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = nn.Parameter(torch.zeros(1))

    class TorchLayers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.dec = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 32)
            self.gate = Gate()
            with torch.no_grad():
                self.gate.g.fill_(0.5)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx)
            mem = self.enc(x)
            y = self.dec(x, mem)
            return self.head(y + self.gate.g * self.attn(y, mem, mem, need_weights=False)[0])

    return TorchLayers(), lambda m, idx: m(idx)


def case_parent_writes_children(rank: int, world: int, kind: str) -> None:
    """Under sharded_init, equal to a normal construction with the same seed, every parameter
    cut once construction ends; then three SGD steps at ZeRO-3 (every unit freed) equal DDP (not
    Adam: the key biases' gradients are rounding noise, which Adam turns into full-size steps)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    torch.manual_seed(0)
    ref, fwd = _layers_model(kind)
    reference = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(0)

    def setup(model):
        return zs.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), stage=3,
                             stage3_param_persistence_threshold=0)  # fmt: skip

    with zs.sharded_init():
        model, _ = _layers_model(kind)
        held = [n for n, p in model.named_parameters() if p.numel() > 1 and p.untyped_storage().nbytes() > 4]
        assert not held, f"{kind}: parameters left whole after sharded_init: {held}"
        if kind == "torch":  # set up inside the block too: initialize takes the pieces as they are
            model, opt = setup(model)
    if kind != "torch":
        model, opt = setup(model)
    built = zs.full_state_dict(model, rank0_only=False)
    assert_state_close({k: built[k] for k in reference}, reference, rtol=0.0, what=f"{kind} built sharded")
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    losses = lockstep_losses(
        {"ddp": (ddp, ref_opt), "zero": (model, opt)},
        lambda step: torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank)),
        lambda m, idx: F.cross_entropy(fwd(m, idx).reshape(-1, 32), idx.reshape(-1)),
    )
    assert_close(losses["zero"], losses["ddp"], rtol=1e-5, what=f"{kind} losses")
    trained = zs.full_state_dict(model, rank0_only=False)
    assert_state_close(
        {k: trained[k] for k in reference}, ref.state_dict(), rtol=1e-4, atol=1e-6, what=f"{kind} trained"
    )
    model.zero_engine.close()


def test_sharded_init_gathered_parameters_and_loading(launch, tmp_path) -> None:
    for world in (2, 3):
        for r in launch(_init_worker, world, args=(str(tmp_path),), timeout=180):
            assert r == {
                "init3": True,
                "modified3": True,
                "master3": True,
                "loaded": True,
                "init2": True,
                "modified2": True,
                "master2": True,
            }, r


def _memory_cap_worker(rank: int, world: int) -> dict:
    import resource

    import torch

    import zero_strategy as zs
    from zero_strategy.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=4096, seq_len=64, d_model=2048, n_layer=8, n_head=16, tie_embeddings=False)
    full_bytes = 4 * (8 * (12 * 2048 * 2048 + 13 * 2048) + 2 * 4096 * 2048 + 64 * 2048 + 2 * 2048)

    def vm_size() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

    limit = vm_size() + int(0.6 * full_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = {"full_gib": full_bytes / 2**30}
    try:
        GPT(cfg)
        out["plain"] = "built"
    except (RuntimeError, MemoryError) as e:
        out["plain"] = f"failed: {type(e).__name__}"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    with zs.sharded_init():
        model = GPT(cfg)
    out["sharded"] = "built"
    out["params"] = sum(p.numel() for p in model.parameters())
    out["rss_delta"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    out["full_bytes"] = full_bytes
    return out


def test_sharded_init_builds_a_model_larger_than_the_memory_cap(launch) -> None:
    results = launch(_memory_cap_worker, 3, timeout=300, env={"MALLOC_ARENA_MAX": "2"})
    for r in results:
        assert r["full_gib"] >= 1.5
        assert r["plain"].startswith("failed"), r
        assert r["sharded"] == "built" and r["params"] * 4 == r["full_bytes"], r
        assert r["rss_delta"] <= 0.6 * r["full_bytes"], r


def test_zero3_initialize_finds_the_unit_members_once(monkeypatch) -> None:
    """The units' parameters (``unit_members``) are found once at ZeRO-3 initialize: the
    placement (``ratio: auto``) and the unit storage use the same list. World of one, in process."""
    import sys

    import torch

    import zero_strategy as zs
    import zero_strategy.runtime.engine
    import zero_strategy.sharding.unit  # imported: the modules that look it up are patched below
    from zero_strategy.models import GPT
    from zero_strategy.sharding import members

    real, calls = members.unit_members, []

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    patched = [m for m in list(sys.modules.values()) if getattr(m, "unit_members", None) is real]
    for module in patched:  # every module that looks it up (the engine, the unit storage)
        monkeypatch.setattr(module, "unit_members", counted)
    assert members in patched and len(patched) >= 2
    torch.manual_seed(0)
    model = GPT(_cfg())
    zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config=zs.ZeroConfig(stage=3))
    assert len(calls) == 1, f"unit_members ran {len(calls)} times at initialize"
    assert len(model.zero_engine.params.units) == len(real(model, calls[0], list(model.named_parameters())))
