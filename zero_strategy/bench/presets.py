"""The bench's model sizes: named presets of the bundled GPT, or a spec such as
``d=256,layers=4,heads=4,seq=64``. Vocabulary 256: the bench trains on the bundled byte-level
text (the standard library's source, :func:`zero_strategy.models.stdlib_corpus`).

Torch is imported only when a config is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_strategy.models import GPTConfig

__all__ = ["PRESETS", "gpt_config", "is_gpt_spec"]

# name -> GPTConfig fields (untied embeddings, as GPTConfig.bench())
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "d_model": 128,
        "n_layer": 2,
        "n_head": 4,
        "seq_len": 32,
    },  # ~0.5M: the test's size (blocks above the ZeRO-3 persistence threshold)
    "small": {"d_model": 256, "n_layer": 4, "n_head": 4, "seq_len": 64},  # ~3.3M
    "medium": {"d_model": 512, "n_layer": 8, "n_head": 8, "seq_len": 128},  # ~25M
    "large": {"d_model": 768, "n_layer": 12, "n_head": 12, "seq_len": 128},  # ~85M
}
_SPEC_KEYS = {"d": "d_model", "layers": "n_layer", "heads": "n_head", "seq": "seq_len", "vocab": "vocab_size"}


def is_gpt_spec(spec: str) -> bool:
    return spec in PRESETS or ("=" in spec and all(p.split("=")[0].strip() in _SPEC_KEYS for p in spec.split(",")))


def gpt_config(spec: str) -> GPTConfig:
    """The GPT config of a preset name or a ``key=value,...`` spec (keys: d, layers, heads, seq,
    vocab; the rest from ``small``)."""
    from zero_strategy.models import GPTConfig

    fields: dict[str, int] = {"vocab_size": 256}
    if spec in PRESETS:
        fields.update(PRESETS[spec])
    elif is_gpt_spec(spec):
        fields.update(PRESETS["small"])
        for part in spec.split(","):
            key, _, value = part.partition("=")
            try:
                fields[_SPEC_KEYS[key.strip()]] = int(value)
            except ValueError:
                raise ValueError(f"--model {spec!r}: {key}={value!r} is not an integer") from None
    else:
        raise ValueError(
            f"--model {spec!r}: use one of {sorted(PRESETS)} or a spec like 'd=256,layers=4,heads=4,seq=64'"
        )
    return GPTConfig(
        vocab_size=fields["vocab_size"], seq_len=fields["seq_len"], d_model=fields["d_model"],
        n_layer=fields["n_layer"], n_head=fields["n_head"], tie_embeddings=False,
    )  # fmt: skip
