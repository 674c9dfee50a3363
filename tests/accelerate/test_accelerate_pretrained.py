"""``from_pretrained`` under ``zero-strategy launch`` at ZeRO-3: an unmodified
``AutoModelForCausalLM.from_pretrained`` builds the model in pieces read from its files (no
parameter whole on any rank), and ``accelerator.prepare(model, optimizer)`` trains it like DDP."""

from __future__ import annotations

from pathlib import Path

from tests.accelerate.test_accelerate_launch import BIN, REL, rel_diff, run_launch

JOB = Path(__file__).with_name("_pretrained_job.py")
ZERO3 = "zero_optimization:\n  stage: 3\n  stage3_param_persistence_threshold: 0\n"


def test_from_pretrained_under_the_launcher_is_sharded_and_equals_ddp(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama", max_shard_size="20KB")
    (tmp_path / "zero3.yaml").write_text(ZERO3)
    front = [str(BIN / "zero-strategy"), "launch", "--zero-config", str(tmp_path / "zero3.yaml")]
    ranks = run_launch(tmp_path, "pretrained", 2, front=front, script=JOB,
                       env={"PRETRAINED_DIR": str(tmp_path / "llama")})  # fmt: skip
    for r in ranks:
        assert r["whole"] == [] and r["engine"], r
        assert rel_diff(r["losses"]["zero"], r["losses"]["ddp"]) < REL, r["losses"]
