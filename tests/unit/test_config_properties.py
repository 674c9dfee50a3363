"""Property test of the config reader (hypothesis): whatever a config file holds (mutated types,
values and nesting of a valid DeepSpeed-style config), reading it gives a valid ZeroConfig or a
ValueError/TypeError whose message names the offending field; never another exception."""

from __future__ import annotations

import copy
import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zero_strategy import ZeroConfig

BASE = {
    "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 5e6, "overlap_comm": True, "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e9, "offload_optimizer": {"device": "none", "pin_memory": False},
    },
    "bf16": {"enabled": False},
    "fp16": {"enabled": False, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2},
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 2,
    "communication_data_type": "fp32",
    "zero_strategy": {"comm_timeout": 60, "prefetch": 1, "collective_impl": "auto"},
    "train_batch_size": "auto",
}  # fmt: skip

SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
    | st.sampled_from(["auto", "1e9", "1e400", "-1", "bf16", "fp16", "cpu", "nvme", "true", "3", "0.5"])
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _paths(d: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out.extend(_paths(v, (*prefix, k)))
    return out


PATHS = _paths(BASE)


@st.composite
def mutated_configs(draw: st.DrawFn) -> tuple[dict, tuple[str, ...]]:
    d = copy.deepcopy(BASE)
    path = draw(st.sampled_from(PATHS))
    parent = d
    for key in path[:-1]:
        parent = parent[key]
    action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
    if action == "replace":
        parent[path[-1]] = draw(VALUES)
    elif action == "delete":
        del parent[path[-1]]
    else:
        parent[draw(st.text(min_size=1, max_size=6))] = draw(VALUES)
    return d, path


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_configs())
def test_any_mutation_reads_or_names_the_field(case: tuple[dict, tuple[str, ...]]) -> None:
    d, path = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = ZeroConfig.from_dict(d)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            named = any(str(part) in message for part in path) or "unknown key" in message or "conflicts" in message
            assert named, f"{type(exc).__name__} does not name the field {'.'.join(map(str, path))}: {message}"
            return
    assert isinstance(cfg, ZeroConfig)
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg  # what it read can be written and read back


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["stage", "reduce_bucket_size", "comm_timeout", "prefetch", "precision", "loss_scale", "offload_param",
                        "gradient_clipping", "collective_impl", "stage3_max_reuse_distance"]), VALUES)  # fmt: skip
def test_any_keyword_value_is_accepted_or_names_the_field(field: str, value: object) -> None:
    try:
        ZeroConfig(**{field: value})
    except (ValueError, TypeError) as exc:
        assert field in str(exc), f"{type(exc).__name__} does not name {field}: {exc}"


def test_numbers_that_would_overflow_name_the_field() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"comm_timeout: must be <= 1000000000.0, got 1000000000000000.0"):
        ZeroConfig.from_dict({"zero_strategy": {"comm_timeout": 1e15}})
    with pytest.raises(ValueError, match=r"fp16.initial_scale_power: must be <= 64, got 2000"):
        ZeroConfig.from_dict({"fp16": {"enabled": True, "initial_scale_power": 2000}})
