"""Make a tiny Llama, its tokenizer and two small datasets, all offline, for the fine-tuning examples.

``python examples/make_tiny_llama.py DIR`` writes:

- ``DIR/model/``: a 2-layer Llama built from a config (random weights, ``save_pretrained``) and
  a byte-level BPE tokenizer trained here, so ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained`` load it like any Hub checkpoint;
- ``DIR/sft.jsonl``: ``{"text": ...}`` rows for ``SFTTrainer``;
- ``DIR/dpo.jsonl``: ``{"prompt", "chosen", "rejected"}`` rows for ``DPOTrainer``.

The text is the Python standard library's own source (the corpus ``examples/train_gpt.py``
trains on): each function signature with its docstring's first line. In the DPO rows the
chosen answer is the function's own docstring line, the rejected one another function's.
docs/finetuning.md uses it; a layer has more than 100,000 elements, so the built-in ``zero3``
config frees each decoder layer after use (smaller units stay gathered).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path


def functions(count: int) -> list[tuple[str, str]]:
    """``(signature, first docstring line)`` of the first ``count`` documented functions, in sorted file order."""
    found: list[tuple[str, str]] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8", errors="replace"))):
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and not node.name.startswith("_") and doc.strip():
                found.append((f"def {node.name}({ast.unparse(node.args)}):", doc.strip().splitlines()[0]))
                if len(found) == count:
                    return found
    return found


def tokenizer(texts: list[str], vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--rows", type=int, default=64, help="rows per dataset")
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pairs = functions(4 * args.rows)
    texts = [f'{sig}\n    """{doc}"""' for sig, doc in pairs]
    tok = tokenizer(texts, vocab_size=512)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    out = Path(args.out)
    LlamaForCausalLM(config).save_pretrained(out / "model")
    tok.save_pretrained(out / "model")

    rng = random.Random(0)
    sft, dpo = pairs[: args.rows], pairs[args.rows : 2 * args.rows]
    with open(out / "sft.jsonl", "w") as f:
        for sig, doc in sft:
            f.write(json.dumps({"text": f'{sig}\n    """{doc}"""'}) + "\n")
    with open(out / "dpo.jsonl", "w") as f:
        for i, (sig, doc) in enumerate(dpo):
            other = dpo[(i + rng.randrange(1, len(dpo))) % len(dpo)][1]
            f.write(
                json.dumps({"prompt": f"{sig}\n", "chosen": f'    """{doc}"""', "rejected": f'    """{other}"""'})
                + "\n"
            )
    n = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    print(f"wrote {out}/model ({n:,} parameters, vocabulary {len(tok)}), {out}/sft.jsonl, {out}/dpo.jsonl")


if __name__ == "__main__":
    main()
