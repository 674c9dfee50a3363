"""Model-state memory per rank before a job starts: four formulas side by side.

*Model states* are the parameters, their gradients and the optimizer's state (the ZeRO paper's
term); activations, communication buffers and ZeRO-3's gathered working set come on top. With
``P`` parameters, ``N`` ranks, ``b`` bytes per parameter in the training precision (2 for
fp16/bf16, 4 for fp32) and ``K`` bytes of optimizer state per parameter (AdamW 8, SGD with
momentum 4, plain SGD 0):

- **design notes, section 1.1**: fp16 parameters + gradients + Adam's two moments in the same
  precision, ``b + b + 2b`` (8 B/param in fp16: GPT-3 175B gives 350 + 350 + 700 GB = 1.4 TB),
  partitioned by stage as below.
- **ZeRO paper** (Rajbhandari et al. 2020): ``b`` (params) + ``b`` (grads) + ``K'`` where ``K'``
  is the optimizer's state with the fp32 master copy in mixed precision (``4 + K``: 12 for Adam,
  so 2 + 2 + 12 = 16 B/param). Stage 1 shards ``K'``, stage 2 also the gradients, stage 3 also
  the parameters: 175B on 8 ranks at stage 3 is 16 × 175e9 / 8 = 350 GB per rank.
- **DeepSpeed's estimator** (``estimate_zero2_model_states_mem_needs`` /
  ``estimate_zero3_model_states_mem_needs``, the functions behind ``..._all_live``; here with
  ``zero_init`` and its ``additional_buffer_factor`` 1.5, all ranks on one node): stage 3 without
  offload ``18P/N + 4 × largest layer`` on the device, stage 1/2 ``4P + 16P/N``; with offload the
  node's CPU holds ``16P`` or ``18P`` × 1.5. It assumes mixed precision with Adam.
- **this engine** (zero-strategy's own layout, what ``memory_stats()['model_state']`` reports at
  the step's peak): stage 1/2 keep the full ``b``-byte parameters, fp32 gradient shards (4 B),
  fp32 masters when training in 16 bits (4 B) and the optimizer state, all sharded ``/N``;
  stage 1 also holds the full gradients (``b``) from the backward until the step; stage 3 keeps
  fp32 parameter rows (which are the masters), fp32 gradient shards and the optimizer state, all
  ``/N``. Offloading the optimizer moves masters, gradient shards and its state to the host
  (its state to disk with ``nvme``, masters and gradient shards stay on the host); offloading
  parameters moves the rows too (masters are then views of them).

The design notes' benchmark table (section 3.2) gives 24 GB per GPU for ZeRO-3 on 8 GPUs with
GPT-3 175B; 16 B/param ÷ 8 is 350 GB per rank, so 24 GB cannot hold the model states without
offload (:data:`DESIGN_NOTE`).

This module needs no torch unless ``--model`` counts a model's parameters (:func:`count_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DESIGN_NOTE",
    "OPTIMIZER_BYTES",
    "Estimate",
    "Setup",
    "cache_bytes",
    "count_expert_params",
    "count_model",
    "estimate",
    "format_estimate",
    "gathered_params",
    "moe_selected_share",
]

GB = 1e9  # decimal, as section 1.1 counts (175e9 x 2 bytes = 350 GB)
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "lamb": 8, "adagrad": 4, "rmsprop": 4, "sgd-momentum": 4, "sgd": 0}
PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DESIGN_NOTE = (
    "The design notes' table (section 3.2) gives 24 GB per GPU for ZeRO-3 on 8 GPUs with GPT-3 175B: "
    "16 B/param / 8 ranks is 350 GB of model states per rank, so 24 GB cannot hold without offload "
    "(offload_param + offload_optimizer leave the device only the gathered working set)."
)


@dataclass(frozen=True)
class Setup:
    """What the formulas need. ``largest_layer``: parameters of the largest module (DeepSpeed's
    term; 0 when unknown). ``persistent``: at ZeRO-3, parameters of the units small enough to
    stay gathered on every rank (``stage3_param_persistence_threshold``; this engine's
    ``ShardedParams.units``), counted whole by this engine's formula."""

    params: float
    ranks: int
    stage: int
    precision: str = "fp32"  # the engine's default
    optimizer: str = "adamw"
    offload_optimizer: str = "none"
    offload_param: str = "none"
    largest_layer: float = 0.0
    persistent: float = 0.0  # ZeRO-3: parameters of units at or below stage3_param_persistence_threshold
    cache_budget: float = 0.0  # ZeRO-3: bytes of the cache tier (zero_strategy: memory: cache), 0: none
    moe_experts: int = 0  # MoE: experts per layer (0: a dense model)
    moe_topk: int = 0  # MoE: experts each token is routed to
    tokens: int = 0  # MoE: tokens per micro-batch and rank that the router sees
    expert_params: float = 0.0  # MoE: parameters inside the experts (all layers)

    def __post_init__(self) -> None:
        if self.params <= 0 or self.ranks < 1:
            raise ValueError(f"estimate: --params must be > 0 and --ranks >= 1, got {self.params:g}, {self.ranks}")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"estimate: --stage {self.stage}: use 0 (DDP), 1, 2 or 3")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"estimate: --precision {self.precision!r}: use one of {sorted(PRECISION_BYTES)}")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"estimate: --optimizer {self.optimizer!r}: use one of {sorted(OPTIMIZER_BYTES)}")
        for name in ("offload_optimizer", "offload_param"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(f"estimate: --{name.replace('_', '-')}: use one of {OFFLOAD_DEVICES}")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError("estimate: --offload-param needs --stage 3 (stages 1 and 2 keep the full parameters)")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("estimate: --offload-optimizer needs a ZeRO stage (1-3)")
        if self.cache_budget < 0 or (self.cache_budget and self.stage != 3):
            raise ValueError("estimate: --cache-budget needs --stage 3 (the cache holds ZeRO-3's gathered parameters) "
                             "and bytes >= 0")  # fmt: skip
        if self.moe_experts or self.moe_topk or self.tokens or self.expert_params:
            if self.moe_experts < 1 or self.tokens < 1:
                raise ValueError("estimate: MoE needs --moe-experts E >= 1, --moe-topk k and --tokens T >= 1 together")
            if not 1 <= self.moe_topk <= self.moe_experts:
                raise ValueError(f"estimate: --moe-topk {self.moe_topk}: give 1 to --moe-experts ({self.moe_experts})")
            if not 0 < self.expert_params <= self.params:
                raise ValueError(f"estimate: --expert-params {self.expert_params:g}: the experts' parameters, > 0 and "
                                 f"at most --params ({self.params:g}); --model counts them from module names")  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank for one formula, by tier, and the parts it adds up (name -> bytes)."""

    label: str
    device: float
    host: float
    disk: float
    parts: tuple[tuple[str, float], ...] = ()
    note: str = ""

    @property
    def total(self) -> float:
        return self.device + self.host + self.disk


def _partitioned(s: Setup, params_b: float, grads_b: float, optim_b: float) -> tuple[float, float, float]:
    """Per-rank bytes of (params, grads, optimizer) at ``s.stage``, the paper's partitioning."""
    p, n = s.params, s.ranks
    return (
        params_b * p / (n if s.stage >= 3 else 1),
        grads_b * p / (n if s.stage >= 2 else 1),
        optim_b * p / (n if s.stage >= 1 else 1),
    )


def _place(s: Setup, label: str, params: float, grads: float, optim: float, note: str = "") -> Estimate:
    """The paper-style split by tier: optimizer (and gradients) follow offload_optimizer,
    parameters follow offload_param."""
    tiers = {"none": 0.0, "cpu": 0.0, "nvme": 0.0}
    tiers[s.offload_param] += params
    tiers[s.offload_optimizer] += optim
    tiers["cpu" if s.offload_optimizer != "none" else "none"] += grads
    parts = (("params", params), ("grads", grads), ("optimizer", optim))
    return Estimate(label, tiers["none"], tiers["cpu"], tiers["nvme"], parts, note)


def section_1_1(s: Setup) -> Estimate:
    b = PRECISION_BYTES[s.precision]
    return _place(s, "design notes 1.1 (b + b + 2b)", *_partitioned(s, b, b, 2 * b),
                  note="Adam's moments in the training precision, no fp32 masters")  # fmt: skip


def zero_paper(s: Setup) -> Estimate:
    b = PRECISION_BYTES[s.precision]
    k = OPTIMIZER_BYTES[s.optimizer] + (4 if b < 4 else 0)  # fp32 masters in mixed precision
    return _place(s, f"ZeRO paper ({b} + {b} + {k})", *_partitioned(s, b, b, k))


def deepspeed(s: Setup) -> Estimate:
    """DeepSpeed's estimator (zero_init, buffer factor 1.5, one node). Its CPU figure is for the
    whole node; here divided by the ranks, to compare per rank."""
    p, n, ll, f = s.params, s.ranks, s.largest_layer, 1.5
    off_opt = s.offload_optimizer != "none"
    note = "mixed precision + Adam assumed; host = node total x 1.5 / ranks"
    if s.stage == 0:
        return Estimate("DeepSpeed estimator", float("nan"), float("nan"), float("nan"), note="no stage-0 formula")
    if s.offload_optimizer == "nvme" or s.offload_param == "nvme":
        note = "no nvme formula: computed as cpu; " + note
    if s.stage == 3:
        off_par = s.offload_param != "none"
        if off_opt and off_par:
            dev, node_cpu = 4 * ll, 18 * p * f
        elif off_opt:
            dev, node_cpu = 4 * ll + 2 * p / n, 16 * p * f
        else:
            dev, node_cpu = 4 * ll + 18 * p / n, 4 * ll * n * f
        label = "DeepSpeed estimate_zero3 (18P/N + 4 x largest layer)"
    else:
        if off_opt:
            dev, node_cpu = 2 * p, p * max(4 * n, 16) * f
        else:
            dev, node_cpu = 4 * p + 16 * p / n, 4 * p * n * f
        label = "DeepSpeed estimate_zero2 (4P + 16P/N)"
    return Estimate(label, dev, node_cpu / n, 0.0, note=note)


def this_engine(s: Setup) -> Estimate:
    """zero-strategy's layout (measured kinds of ``memory_stats()``), at the step's peak."""
    p, n = s.params, s.ranks
    b, k = PRECISION_BYTES[s.precision], OPTIMIZER_BYTES[s.optimizer]
    mixed = b < 4
    tiers = {"none": 0.0, "cpu": 0.0, "nvme": 0.0}
    parts: list[tuple[str, float]] = []

    def put(name: str, nbytes: float, tier: str) -> None:
        tiers[tier] += nbytes
        parts.append((name, nbytes))

    opt_host = "cpu" if s.offload_optimizer != "none" else "none"  # masters and grad shards: on the host
    if s.stage == 0:  # plain DDP: full params, full grads, full optimizer state (+ masters in 16 bits)
        put("params", b * p, "none")
        put("grads", b * p, "none")
        put("masters", 4 * p if mixed else 0.0, "none")
        put("optimizer", k * p, "none")
        return Estimate("this engine", tiers["none"], 0.0, 0.0, tuple(parts), "DDP")
    # device-tier gradient shards are freed at zero_grad(set_to_none=True): at ZeRO-1 the full
    # gradients (until the step) and the shards (from the step) are not held at once
    either = s.stage == 1 and opt_host == "none"
    if s.stage < 3:
        put("params", b * p, "none")
        if either:
            put("full grads, then grad shards (fp32)", max(b * p, 4 * p / n), "none")
        else:
            put("full grads (until the step)", b * p if s.stage == 1 else 0.0, "none")
        put("masters", 4 * p / n if (mixed or opt_host != "none") else 0.0, opt_host)
    else:
        put("param rows (fp32)", 4 * p / n, s.offload_param)
        put("persistent units, gathered", b * s.persistent, "none")
        separate_masters = opt_host != "none" and s.offload_param == "none"
        put("masters", 4 * p / n if separate_masters else 0.0, opt_host)
    if not either:
        put("grad shards (fp32)", 4 * p / n, opt_host)
    put("optimizer", k * p / n, s.offload_optimizer)
    put("gather cache (cache tier)", cache_bytes(s), "none")
    return Estimate("this engine", tiers["none"], tiers["cpu"], tiers["nvme"], tuple(parts))


def moe_selected_share(experts: int, topk: int, tokens: int) -> float:
    """The share of an MoE layer's experts that ``tokens`` tokens select when each picks ``topk``
    of ``experts``, taken as independent and uniform: ``1 - (1 - k/E)^T`` (an expert is missed by
    a token with probability ``1 - k/E``)."""
    return 1.0 - (1.0 - topk / experts) ** tokens


def gathered_params(s: Setup) -> float:
    """Parameters a ZeRO-3 step gathers in full: the units that are not persistent, with MoE
    only the selected share of the experts (the MoE issue's selective gather)."""
    share = moe_selected_share(s.moe_experts, s.moe_topk, s.tokens) if s.moe_experts else 1.0
    return s.params - s.persistent - s.expert_params + share * s.expert_params


def cache_bytes(s: Setup) -> float:
    """Device bytes the cache tier holds at its fullest: gathered full parameters (training
    precision) up to the cap, ``min(cache_budget, b x gathered params)``. An upper bound: the
    cache keeps whole units, so a cap between unit sizes holds a little less."""
    if s.stage != 3 or not s.cache_budget:
        return 0.0
    return min(s.cache_budget, PRECISION_BYTES[s.precision] * gathered_params(s))


def estimate(s: Setup) -> list[Estimate]:
    """The four formulas for ``s``, in the order they are printed."""
    return [section_1_1(s), zero_paper(s), deepspeed(s), this_engine(s)]


def _gb(x: float) -> str:
    return "n/a" if x != x else f"{x / GB:,.2f}"


def format_estimate(s: Setup) -> str:
    """The table ``zero-strategy estimate`` prints: per-rank GB (1e9 bytes) by tier, per formula."""
    rows = estimate(s)
    b = PRECISION_BYTES[s.precision]
    out = [
        f"Model states per rank: {s.params:.4g} parameters, {s.ranks} ranks, stage {s.stage}, {s.precision}, "
        f"{s.optimizer}, offload_optimizer={s.offload_optimizer}, offload_param={s.offload_param}"
        + (f", largest layer {s.largest_layer:.4g}" if s.largest_layer else "")
        + (f", persistent {s.persistent:.4g}" if s.persistent else ""),
        "",
        f"{'formula':<56} {'device GB':>12} {'host GB':>12} {'disk GB':>12} {'total GB':>12}",
    ]
    for e in rows:
        out.append(f"{e.label:<56} {_gb(e.device):>12} {_gb(e.host):>12} {_gb(e.disk):>12} {_gb(e.total):>12}")
    out.append("")
    one = section_1_1(Setup(s.params, 1, 0, s.precision, s.optimizer))
    parts = " + ".join(_gb(v) for _, v in one.parts)
    out.append(
        f"unpartitioned (design notes 1.1): {parts} = {_gb(one.total)} GB ({4 * b} B/param: params, grads, Adam)"
    )
    for e in rows:
        if e.parts:
            out.append(f"{e.label}: " + ", ".join(f"{name} {_gb(v)}" for name, v in e.parts if v))
        if e.note:
            out.append(f"{e.label}: {e.note}")
    if s.moe_experts:
        share = moe_selected_share(s.moe_experts, s.moe_topk, s.tokens)
        out.append(
            f"MoE: selected share 1 - (1 - {s.moe_topk}/{s.moe_experts})^{s.tokens} = {share:.4f} of "
            f"{s.expert_params:.4g} expert params; a ZeRO-3 step gathers {gathered_params(s):.4g} params, "
            f"{_gb(b * gathered_params(s))} GB (model states keep every expert)"
        )
    if s.cache_budget:
        out.append(f"cache tier: min(budget {_gb(s.cache_budget)} GB, {b} B x {gathered_params(s):.4g} gathered params) "
                   f"= {_gb(cache_bytes(s))} GB on the device, in this engine's row")  # fmt: skip
    if s.stage == 3 and not s.largest_layer:
        out.append("DeepSpeed's formula adds 4 B x the largest layer's parameters: pass --largest-layer N or --model.")
    if (s.params, s.ranks, s.stage) == (175e9, 8, 3):  # the design notes' case: their table's 24 GB per GPU
        out += ["", DESIGN_NOTE]
    return "\n".join(out) + "\n"


def count_model(spec: str) -> tuple[int, int]:
    """(parameters, largest layer's parameters) of a model built on the meta device: a bundled
    GPT preset or spec (``small``, ``d=256,layers=4``), or a Hugging Face config (a directory
    with ``config.json``, the file itself, or a name already in the local cache). Shared
    parameters count once; the largest layer is the module with the most parameters of its own."""
    model = _meta_model(spec)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return int(total), int(largest)


def count_expert_params(spec: str) -> int:
    """Parameters of ``spec`` (as :func:`count_model`) whose name has a part containing
    ``expert`` (``...mlp.experts.3.w1``, Mixtral's ``block_sparse_moe.experts``): an MoE's experts."""
    model = _meta_model(spec)
    named = {id(p): (n, p.numel()) for n, p in model.named_parameters()}
    return int(sum(k for n, k in named.values() if any("expert" in part for part in n.split(".")[:-1])))


def _meta_model(spec: str) -> Any:
    import torch

    from zero_strategy.bench.presets import gpt_config, is_gpt_spec

    with torch.device("meta"):
        if is_gpt_spec(spec):
            from zero_strategy.models import GPT

            return GPT(gpt_config(spec))
        return _hf_model(spec)


def _hf_model(spec: str) -> Any:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ValueError(f"estimate --model {spec!r}: a Hugging Face config needs `pip install transformers`") from exc
    path = Path(spec)
    if path.is_file():
        cfg = AutoConfig.for_model(**json.loads(path.read_text()))
    else:
        cfg = AutoConfig.from_pretrained(spec)
    try:
        return AutoModelForCausalLM.from_config(cfg)
    except ValueError:  # an encoder or other architecture without a causal-LM head
        from transformers import AutoModel

        return AutoModel.from_config(cfg)
