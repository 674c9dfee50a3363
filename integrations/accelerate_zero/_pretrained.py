"""``from_pretrained`` under the start-up hook at ZeRO-3: the model is built in pieces.

Transformers switches on DeepSpeed's ``zero.Init`` by itself when ``HfDeepSpeedConfig`` says
ZeRO-3; that hook needs DeepSpeed and has no public slot for another engine. So, with
``ZERO_SHARDED_FROM_PRETRAINED=1`` and ``ZERO_STRATEGY_CONFIG`` at stage 3 (without shard
groups), the start-up hook wraps the public
``PreTrainedModel.from_pretrained`` (which every ``AutoModel*.from_pretrained`` calls) when
``transformers.modeling_utils`` is imported: it becomes ``zero_strategy.from_pretrained``,
every parameter cut to this rank's piece and read row by row from the files, so no rank holds
the whole model before ``accelerator.prepare`` (or the ``Trainer``) hands it to the engine.
The process group is Accelerate's (``PartialState()``, created here if it is not yet).

A call that places or converts the weights itself (``device_map``, ``quantization_config``,
``tp_plan``, ...) loads as Transformers does. The routing is opt-in: a script may also call
``from_pretrained`` for a plain model (on one rank, to check what it saved, as
``examples/accelerate_hf_gpt2.py`` does), which must stay a plain model. A model built in pieces that Accelerate is given for evaluation alone
(``prepare_model(model, evaluation_mode=True)``) goes to the engine without an optimizer: its
pieces cannot run as a plain module.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

__all__ = ["SWITCH_ENV", "built_in_pieces", "wrap_from_pretrained"]

SWITCH_ENV = "ZERO_SHARDED_FROM_PRETRAINED"
_MARK = "_zero_strategy_sharded"


def _sharded_load_wanted(kwargs: dict[str, Any]) -> bool:
    from accelerate_zero.plugin import CONFIG_ENV

    if not os.environ.get(CONFIG_ENV) or os.environ.get(SWITCH_ENV, "0").strip().lower() not in (
        "1",
        "true",
        "yes",
        "on",
    ):
        return False
    from zero_strategy.checkpoint.pretrained import PLACING_ARGUMENTS

    if any(kwargs.get(k) is not None for k in PLACING_ARGUMENTS):
        return False
    from accelerate_zero.plugin import ZeroPlugin

    config = ZeroPlugin.from_env().config
    return config.stage == 3 and config.shard_size is None


def wrap_from_pretrained(module: ModuleType) -> None:
    """Wrap ``module.PreTrainedModel.from_pretrained`` (idempotent)."""
    cls = module.PreTrainedModel
    original = cls.__dict__["from_pretrained"]
    if getattr(original.__func__, _MARK, False):
        return

    @functools.wraps(original.__func__)
    def from_pretrained(klass: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        if not _sharded_load_wanted(kwargs):
            return original.__func__(klass, path, *args, **kwargs)
        from accelerate import PartialState

        import zero_strategy as zs

        PartialState()  # Accelerate's process group, which the Accelerator takes later
        return zs.from_pretrained(klass, path, *args, **kwargs)

    setattr(from_pretrained, _MARK, True)
    cls.from_pretrained = classmethod(from_pretrained)


def built_in_pieces(model: Any) -> bool:
    """Whether ``model`` holds parameters cut by ``sharded_init``/``from_pretrained`` and not yet taken by an engine."""
    from zero_strategy.sharding.pieces import sharded_init_piece

    parameters = getattr(model, "parameters", None)
    return callable(parameters) and any(sharded_init_piece(p) is not None for p in parameters())
