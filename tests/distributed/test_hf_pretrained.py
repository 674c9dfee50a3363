"""Sharded ``from_pretrained``: a Hugging Face model built in pieces and read row by row from
its files equals a plain ``from_pretrained`` (parameters and buffers), and trains like DDP
(SGD; and ``[Muon(the decoder layers' matrices), AdamW(the rest)]``, ``_case_muon``)."""

from __future__ import annotations

from zero_strategy.testing import assert_close, assert_state_close, run_subtests, subtest_grid
from zero_strategy.testing.lockstep import lockstep_losses


def _save(kind: str, root: str) -> str:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = f"{root}/{kind}"
    if kind == "llama":  # tied embeddings, a padding row, rotary inv_freq (a non-persistent buffer)
        cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, pad_token_id=3, tie_word_embeddings=True)  # fmt: skip
        LlamaForCausalLM(cfg).save_pretrained(path)
    else:  # several files and an index
        cfg = GPT2Config(
            vocab_size=48,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        GPT2LMHeadModel(cfg).save_pretrained(path, max_shard_size="20KB")
    return path


def _worker(rank: int, world: int, root: str) -> dict:
    import torch

    if rank == 0:
        for kind in ("llama", "gpt2"):
            _save(kind, root)
    torch.distributed.barrier()
    run_subtests(lambda kind, via: _case(rank, f"{root}/{kind}", kind, via),
                 subtest_grid(kind=["llama", "gpt2"], via=["function", "context"]))  # fmt: skip
    _case_missing_and_dtype(f"{root}/llama")
    _case_muon(rank, f"{root}/llama")
    return {"ok": True}


def _case(rank: int, path: str, kind: str, via: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import zero_strategy as zs
    from zero_strategy.sharding.pieces import is_placeholder

    if kind == "gpt2":
        import os

        assert os.path.exists(f"{path}/model.safetensors.index.json"), os.listdir(path)
    plain = AutoModelForCausalLM.from_pretrained(path)
    if via == "function":
        model = zs.from_pretrained(AutoModelForCausalLM, path)
    else:
        with zs.sharded_from_pretrained():
            model = AutoModelForCausalLM.from_pretrained(path)
    assert not model.training
    whole = [n for n, p in model.named_parameters() if not is_placeholder(p) and p.numel() > 1]
    assert not whole, f"{kind}: parameters held whole after a sharded from_pretrained: {whole}"
    if kind == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied weights untied"
    buffers = dict(plain.named_buffers())
    for n, b in model.named_buffers():
        assert_close(b, buffers[n], rtol=0, what=f"{kind}: buffer {n}")
    model, opt = zs.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), stage=3,
                               stage3_param_persistence_threshold=0)  # fmt: skip
    reference = plain.state_dict()
    assert_state_close(zs.full_state_dict(model, rank0_only=False), reference, rtol=0.0, what=f"{kind} loaded")
    plain.train()
    model.train()
    ddp = DDP(plain)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    losses = lockstep_losses(
        {"ddp": (ddp, ref_opt), "zero": (model, opt)},
        lambda step: torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank)),
        lambda m, idx: F.cross_entropy(m(input_ids=idx).logits.reshape(-1, 48), idx.reshape(-1)),
    )
    assert_close(losses["zero"], losses["ddp"], rtol=1e-5, what=f"{kind} losses")
    trained = zs.full_state_dict(model, rank0_only=False)
    assert_state_close(trained, plain.state_dict(), rtol=1e-4, atol=1e-6, what=f"{kind} trained")
    model.zero_engine.close()


def _muon_and_adamw(model):
    """``[Muon(the decoder layers' 2-D matrices), AdamW(the rest)]``: embeddings (tied to the
    head) and norms to AdamW. Chosen by name and ``ndim``: a sharded load's placeholders keep
    their parameters' shapes."""
    import torch

    matrices = [p for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _case_muon(rank: int, path: str) -> None:
    """A Llama loaded with the sharded ``from_pretrained`` at ZeRO-3 (every unit partitioned),
    trained 6 steps with ``[Muon, AdamW]``, equals DDP with the same optimizers on a plain load
    within 1e-6 relative (losses and every weight, fp32); each Muon matrix was stepped whole on
    its owner with its real 2-D shape (the placeholder's, recorded), not a 1-D piece's."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import zero_strategy as zs

    plain = AutoModelForCausalLM.from_pretrained(path)
    shapes = {n: tuple(p.shape) for n, p in plain.named_parameters()}
    ref_opts = _muon_and_adamw(plain)
    model = zs.from_pretrained(AutoModelForCausalLM, path)
    model, opts = zs.initialize(model, _muon_and_adamw(model), stage=3, stage3_param_persistence_threshold=0)
    ddp = DDP(plain.train())
    model.train()
    losses: dict[str, list[float]] = {"ddp": [], "zero": []}
    for step in range(6):
        idx = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
        for name, m, os_ in (("ddp", ddp, ref_opts), ("zero", model, opts)):
            loss = F.cross_entropy(m(input_ids=idx).logits.reshape(-1, 48), idx.reshape(-1))
            loss.backward()
            for o in os_:
                o.step()
                o.zero_grad()
            losses[name].append(loss.item())
    assert_close(losses["zero"], losses["ddp"], rtol=1e-6, atol=1e-7, what="muon llama losses")
    trained = zs.full_state_dict(model, rank0_only=False)
    assert_state_close(trained, plain.state_dict(), rtol=1e-6, atol=1e-7, what="muon llama trained")
    whole = model.zero_engine.whole
    names = {n for n, p in plain.named_parameters() if ".layers." in n and p.ndim == 2}
    assert {e.name for e in whole.entries} == names, sorted(e.name for e in whole.entries)
    for e in whole.entries:
        assert tuple(e.param.shape) == shapes[e.name] and len(shapes[e.name]) == 2, (e.name, tuple(e.param.shape))
    owned = whole.owned()
    assert owned and all(tuple(e.proxy.shape) == shapes[e.name] for e in owned), [
        (e.name, tuple(e.proxy.shape)) for e in owned
    ]
    assert all(tuple(opts[0].state[e.proxy]["momentum_buffer"].shape) == shapes[e.name] for e in owned)
    model.zero_engine.close()


def _case_missing_and_dtype(path: str) -> None:
    """A head the files lack is reported missing and initialised (not NaN); ``dtype`` and
    ``torch_dtype`` give the model that dtype; arguments that place the weights are refused."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    import zero_strategy as zs

    plain, plain_info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3,
                                                                           output_loading_info=True)  # fmt: skip
    with pytest.warns(UserWarning, match="missing keys \\['score.weight'\\]"):
        model, info = zs.from_pretrained(AutoModelForSequenceClassification, path, num_labels=3,
                                         output_loading_info=True)  # fmt: skip
    assert info["missing_keys"] == sorted(plain_info["missing_keys"]) == ["score.weight"], (info, plain_info)
    assert info["unexpected_keys"] == [], info
    model, _ = zs.initialize(model, None, stage=3, stage3_param_persistence_threshold=0)
    got = zs.full_state_dict(model, rank0_only=False)
    assert torch.isfinite(got["score.weight"]).all() and got["score.weight"].std() > 0
    ref = plain.state_dict()
    assert_state_close({k: v for k, v in got.items() if k != "score.weight"},
                       {k: v for k, v in ref.items() if k != "score.weight"}, rtol=0.0, what="seq-cls body")  # fmt: skip
    model.zero_engine.close()
    for kw in ({"dtype": torch.bfloat16}, {"torch_dtype": "bfloat16"}):
        model = zs.from_pretrained(AutoModelForCausalLM, path, **kw)
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, kw
        model, _ = zs.initialize(model, None, stage=3, stage3_param_persistence_threshold=0)
        assert_state_close(zs.full_state_dict(model, rank0_only=False), plain.state_dict(), rtol=0.0, what=f"{kw}")
        model.zero_engine.close()
    with pytest.raises(ValueError, match="device_map cannot be combined with a sharded load"):
        zs.from_pretrained(AutoModelForCausalLM, path, device_map="cpu")


def test_sharded_from_pretrained_equals_plain_and_ddp(launch, tmp_path) -> None:
    for r in launch(_worker, 2, args=(str(tmp_path),), timeout=240):
        assert r == {"ok": True}, r
