"""Which modules form ZeRO-3 units (one all-gather for all of a unit's parameters).

Resolution, first match wins:

1. an explicit ``policy`` given to ``initialize``: a set/list/tuple of module classes, or a
   callable ``(module, fqn) -> bool``;
2. classes decorated with :func:`zero_auto_partition`;
3. a Hugging Face model's ``_no_split_modules`` (class names), the convention Accelerate and
   FSDP auto-wrapping use;
4. the default: the children of the *outermost* ``nn.ModuleList``/``nn.Sequential`` whose
   children are all of one class (a transformer's block list). Nested lists, such as the
   experts inside an MoE block, stay inside their block's unit. The default cannot see
   whether every member of such a list runs on every rank (an MoE whose experts are the
   outermost list skips the experts no token picked), so ZeRO-3 checks it as it runs: see
   ``zero3.py``.

A module chosen as a unit owns every parameter below it that no inner unit owns; parameters
outside every unit form the root unit. Units never nest in the default policy; with an
explicit policy an inner match inside an outer match is ignored (the outer unit owns it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from zero_strategy.sharding.experts.detect import ExpertsModule, find_expert_modules

__all__ = ["UnitPlan", "UnitPolicy", "find_units", "is_zero_unit_class", "zero_auto_partition"]

_MARK = "_zero_auto_partition"

UnitPolicy = Callable[[nn.Module, str], bool] | Iterable[type] | None


def zero_auto_partition(cls: type) -> type:
    """Class decorator: every instance of ``cls`` is gathered and released as one ZeRO-3 unit.

    The class is returned unchanged apart from one class attribute, so pickling,
    ``isinstance`` and ``torch.compile`` see the same class."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"@zero_auto_partition decorates nn.Module subclasses, got {cls!r}")
    setattr(cls, _MARK, True)
    return cls


def is_zero_unit_class(cls: type) -> bool:
    return bool(getattr(cls, _MARK, False))


@dataclass(frozen=True)
class UnitPlan:
    """Which modules form units, by which rule, and which of them belong to lists that might run
    conditionally (the default policy's block lists): ZeRO-3 checks, before each such unit
    runs, that every rank is entering the same one (see ``zero3.py``)."""

    units: list[tuple[str, nn.Module]]
    rule: str
    conditional_lists: list[list[str]] = field(default_factory=list)
    # MoE experts modules (``experts/selective.py``): each a unit of its own inside its block's unit,
    # gathered by the router's selection instead of by the unit hooks
    experts: list[ExpertsModule] = field(default_factory=list)

    def storage_units(self) -> list[tuple[str, nn.Module]]:
        """The modules that own ZeRO-3 rows: the units, then the experts modules."""
        return self.units + [(e.fqn, e.module) for e in self.experts]


def _policy_fn(
    root: nn.Module, policy: UnitPolicy
) -> tuple[Callable[[nn.Module, str], bool], str, list[list[nn.Module]]]:
    if policy is not None:
        if callable(policy) and not isinstance(policy, type):
            return policy, "the policy callable", []
        try:
            classes = tuple(policy)  # type: ignore[arg-type]  # a class left here is not iterable: raises below
        except TypeError:
            raise TypeError(
                f"initialize(policy=...): expected a set of nn.Module classes or a callable (module, name) -> bool, got {policy!r}"
            ) from None
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(f"initialize(policy=...): {bad!r} are not nn.Module classes")
        return (lambda m, _n: isinstance(m, classes)), f"policy classes {[c.__name__ for c in classes]}", []
    if any(is_zero_unit_class(type(m)) for m in root.modules()):
        return (lambda m, _n: is_zero_unit_class(type(m))), "@zero_auto_partition", []
    names = set(getattr(root, "_no_split_modules", None) or ())
    if names:
        return (lambda m, _n: type(m).__name__ in names), f"_no_split_modules {sorted(names)}", []
    lists = _outermost_block_lists(root)
    ids = {id(m) for members in lists for m in members}
    return (lambda m, _n: id(m) in ids), "the default (repeated blocks)", lists


def _outermost_block_lists(root: nn.Module) -> list[list[nn.Module]]:
    """The children of the outermost ``ModuleList``/``Sequential`` containers (one list per
    container) whose children are all of one class with parameters."""
    frontier: list[nn.Module] = [root]
    while frontier:
        found: list[list[nn.Module]] = []
        nxt: list[nn.Module] = []
        for m in frontier:
            for child in m.children():
                kids = list(child.children())
                if (
                    isinstance(child, (nn.ModuleList, nn.Sequential))
                    and len(kids) >= 2
                    and len({type(k) for k in kids}) == 1
                ):
                    if any(True for _ in kids[0].parameters()):
                        found.append(kids)
                        continue
                nxt.append(child)
        if found:
            return found
        frontier = nxt
    return []


def find_units(root: nn.Module, policy: UnitPolicy = None) -> UnitPlan:
    """The unit modules (name, module) in registration order, outermost matches only, the rule
    that chose them, and (default policy) the lists they came from."""
    match, how, lists = _policy_fn(root, policy)
    units: list[tuple[str, nn.Module]] = []
    if match(root, ""):
        raise ValueError(
            f"initialize(policy=...): the root module {type(root).__name__} itself matched {how}; "
            "name the blocks inside it instead"
        )
    # depth first, in registration order; a loop, not a recursive closure, which would be a
    # reference cycle holding the modules until Python's cyclic collector ran
    stack = [("", iter(root.named_children()))]
    while stack:
        prefix, children = stack[-1]
        entry = next(children, None)
        if entry is None:
            stack.pop()
            continue
        name, child = entry
        fqn = f"{prefix}.{name}" if prefix else name
        if match(child, fqn) and any(True for _ in child.parameters()):
            units.append((fqn, child))
        else:
            stack.append((fqn, iter(child.named_children())))
    fqn_of = {id(m): fqn for fqn, m in units}
    conditional = [[fqn_of[id(m)] for m in members if id(m) in fqn_of] for members in lists]
    # an experts module that is a unit itself (or holds one) stays as the policy made it
    experts = [
        e for e in find_expert_modules(root) if not any(f"{f}.".startswith(f"{e.fqn}.") for f in fqn_of.values())
    ]
    return UnitPlan(units, how, [c for c in conditional if c], experts)
