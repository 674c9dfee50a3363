"""DeepSpeed's ``optimizer`` block when its type is Muon: the line that builds it here.

zero_strategy builds no optimizer from a config (the training loop or front-end owns the
``optimizer`` key, reported with the other such keys). For ``optimizer: {type: Muon}`` that
report alone would leave a migrating run on whatever the loop builds (the ``Trainer``'s AdamW,
for one), so the warning names the line that builds what DeepSpeed built: DeepSpeed
(``runtime/engine.py``, ``MUON_OPTIMIZER = 'muon'``, matched case-insensitively) builds a
``MuonWithAuxAdam`` with Muon on every trainable parameter of 2 or more dimensions whose name has
neither ``embed`` nor ``lm_head``, and Adam on the rest, from ``lr``, ``momentum``,
``weight_decay``, ``muon_lr`` (Muon's lr), ``betas``, ``eps`` and ``adam_lr`` (Adam's lr), with
its defaults for the keys not given (Muon: lr 0.02, momentum 0.95, weight decay 0; Adam: lr 3e-4,
betas (0.9, 0.95), eps 1e-10, weight decay 0). ``torch.optim.Muon`` (Nesterov momentum, 5
quintic Newton-Schulz steps, lr scaled by ``max(1, rows/cols)**0.5``, decoupled weight decay)
and ``torch.optim.AdamW`` make the same update; the line spells every value out, since torch's
defaults differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zero_strategy.config.values import is_auto

__all__ = ["MUON_TYPES", "muon_line", "muon_note"]

# DeepSpeed's name (lower-cased, as its config reader does), and the class it builds for it
MUON_TYPES = frozenset({"muon", "muonwithauxadam"})
_MUON = (("lr", ("muon_lr", "lr"), 0.02), ("momentum", ("momentum",), 0.95), ("weight_decay", ("weight_decay",), 0.0))
_ADAMW = (
    ("lr", ("adam_lr", "lr"), 3e-4),
    ("betas", ("betas",), (0.9, 0.95)),
    ("eps", ("eps",), 1e-10),
    ("weight_decay", ("weight_decay",), 0.0),
)


def _is_muon(block: Any) -> bool:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        return False
    return block["type"].lower().replace("_", "").replace("-", "") in MUON_TYPES


def _args(params: Mapping[str, Any], table: tuple[tuple[str, tuple[str, ...], Any], ...]) -> str:
    out = []
    for name, keys, default in table:
        value = next((params[k] for k in keys if params.get(k) is not None), default)
        if isinstance(value, list):
            value = tuple(value)
        out.append(f"{name}=..." if is_auto(value) else f"{name}={value!r}")
    return ", ".join(out)


def muon_line(params: Mapping[str, Any] | None) -> str:
    """``torch.optim.Muon(matrices, ...)`` beside ``torch.optim.AdamW(rest, ...)`` with the
    values of DeepSpeed's ``optimizer.params`` (``...`` where one is "auto")."""
    params = params if isinstance(params, Mapping) else {}
    return f"torch.optim.Muon(matrices, {_args(params, _MUON)}) beside torch.optim.AdamW(rest, {_args(params, _ADAMW)})"


def muon_note(block: Any, source: str) -> str | None:
    """The warning for an ``optimizer`` block of type Muon (None for any other block)."""
    if not _is_muon(block):
        return None
    return (
        f"optimizer: {{type: {block['type']}}} in {source}: zero_strategy builds no optimizer from the config; "
        f"the training loop builds it: {muon_line(block.get('params'))}, where matrices are the parameters "
        "DeepSpeed gives Muon (every trainable one of 2 or more dimensions whose name has neither 'embed' nor "
        "'lm_head') and rest every other trainable parameter. Pass both to zero_strategy.initialize, return them "
        "from configure_optimizers (manual optimization) or prepare them with the model; for one optimizer (the "
        "transformers Trainer) declare the groups with @zero_strategy.whole_params(group_flag=...) (docs/muon.md)"
    )
