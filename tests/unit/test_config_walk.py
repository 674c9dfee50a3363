"""Issue 48's measure of how far the user's config travels: follow ``config`` from
``ZeroEngine.__init__`` along every call that passes it on (as an argument, by position or
keyword, into a function or method of ``zero_strategy`` that the source names), and count the
files it enters (a *stay*: each function it enters) and the *climbs*: a call from a module into
a module of a higher layer (``LAYERS`` in ``test_imports.py``). An object that keeps it
(``self.config = config``) makes every method of its class that reads it a stay; a piece of it
(``config.offload_optimizer``) passed on, or a local name assigned from it, counts as the config. Measured with this walk:
before the composition root (``dadb514``) 16 files, 43 stays; after it, 10 files, 17 stays
(the root, the engine, and the policy builders the root calls); no climb either way: under this
walk the old code passed the config down, never up. (The issue counted 30 files, 76 stays and
22 climbs with a wider walk, whose rules it does not give; this one bounds the files entered and
the calls into a higher layer.)

The walk is static (``ast``): a callee named through an import, a module alias (``C.f``), the
module's own functions, ``self.method`` of the same class, or a class (its ``__init__``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from tests.unit.test_imports import PACKAGES, _from_base, _layer_of, _modules

MAX_FILES, MAX_CLIMBS = 12, 3  # issue 48, item 2


@dataclass
class Walk:
    files: set[str] = field(default_factory=set)
    stays: int = 0
    climbs: list[str] = field(default_factory=list)


class _Index:
    def __init__(self, known: dict[str, Path]) -> None:
        self.trees = {m: ast.parse(p.read_text()) for m, p in known.items()}
        self.known = known

    def imports(self, module: str) -> dict[str, tuple[str, str | None]]:
        """Local name -> (module, attribute or None for a module alias), anywhere in the source."""
        out: dict[str, tuple[str, str | None]] = {}
        is_pkg = self.known[module].name == "__init__.py"
        for node in ast.walk(self.trees[module]):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(module, node, is_pkg)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out[a.asname or a.name] = (sub, None) if sub in self.known else (base, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in self.known:
                        out[a.asname or a.name.split(".")[0]] = (a.name, None)
        return out

    def definition(self, module: str, name: str) -> tuple[str, ast.FunctionDef | None, str | None] | None:
        """(module, the function, its class) for ``name`` defined in ``module`` (a class: its
        ``__init__``), following re-exports through package ``__init__`` imports."""
        if module not in self.trees:
            return None
        for node in self.trees[module].body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return module, node, None
            if isinstance(node, ast.ClassDef) and node.name == name:
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                return module, init, node.name
        target = self.imports(module).get(name)
        if target is not None and target[1] is not None and target[0] != module:
            return self.definition(target[0], target[1])
        return None

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef | None:
        for node in self.trees[module].body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        return None


def _callee(index: _Index, module: str, cls: str | None, call: ast.Call):
    f, imports = call.func, index.imports(module)
    if isinstance(f, ast.Name):
        if f.id in imports:
            mod, attr = imports[f.id]
            return index.definition(mod, attr) if attr is not None else None
        return index.definition(module, f.id)
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.value.id == "self" and cls is not None:
            fn = index.method(module, cls, f.attr)
            return (module, fn, cls) if fn is not None else None
        if f.value.id in imports and imports[f.value.id][1] is None:
            return index.definition(imports[f.value.id][0], f.attr)
    return None


def _tracked(expr: ast.expr, tracked: frozenset[str]) -> bool:
    """``expr`` is the config or a piece of it: a tracked name (``config``, or ``self.config``
    once the object keeps it), or an attribute chain from one (``config.offload_optimizer``)."""
    while isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and f"{expr.value.id}.{expr.attr}" in tracked:
            return True
        expr = expr.value
    return isinstance(expr, ast.Name) and expr.id in tracked


def _received_as(fn: ast.FunctionDef, call: ast.Call, tracked: frozenset[str], bound: bool) -> set[str]:
    """The callee's parameter names that receive the config or a piece of it."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args][1 if bound else 0 :]
    out = {params[i] for i, a in enumerate(call.args) if i < len(params) and _tracked(a, tracked)}
    names = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
    out |= {k.arg for k in call.keywords if k.arg in names and _tracked(k.value, tracked)}
    return out


def _kept_on_self(fn: ast.FunctionDef, tracked: frozenset[str]) -> set[str]:
    """``self.x`` attributes assigned the config (or a piece) in ``fn``."""
    return {
        f"self.{t.attr}"
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign) and _tracked(n.value, tracked)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def _derived(fn: ast.FunctionDef, tracked: frozenset[str]) -> frozenset[str]:
    """``tracked`` and the local names ``fn`` assigns from it (``cfg = config``,
    ``block = config.offload_optimizer``, ``a, b = config.x, config.y``), to a fixed point."""
    out = set(tracked)
    while True:
        more = set()
        for n in ast.walk(fn):
            if not isinstance(n, ast.Assign):
                continue
            pairs = [(t, n.value) for t in n.targets]
            pairs += [
                (t, v) for t in n.targets if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple)
                for t, v in zip(t.elts, n.value.elts)
            ]  # fmt: skip
            more |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _tracked(v, frozenset(out))}
        if more <= out:
            return frozenset(out)
        out |= more


def _reads(fn: ast.FunctionDef, attrs: set[str]) -> bool:
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and f"{n.value.id}.{n.attr}" in attrs
        for n in ast.walk(fn)
    )


def walk_config(root: Path, start: tuple[str, str, str] = ("zero_strategy.runtime.engine", "ZeroEngine", "__init__")):
    known = _modules("zero_strategy", root)
    index, out, seen = _Index(known), Walk(), set()
    module, cls, name = start
    first = index.method(module, cls, name)
    if first is None:
        raise LookupError(f"{module}.{cls}.{name} not found under {root}")
    todo = [(module, first, cls, frozenset({"config"}))]
    while todo:
        module, fn, cls, tracked = todo.pop()
        if (module, fn.name, cls, tracked) in seen:
            continue
        seen.add((module, fn.name, cls, tracked))
        out.files.add(module)
        out.stays += 1
        tracked = _derived(fn, tracked)
        kept = _kept_on_self(fn, tracked) if cls is not None else set()
        if kept:  # the object keeps it: every method of its class that reads it is a stay
            for node in index.trees[module].body:
                if isinstance(node, ast.ClassDef) and node.name == cls:
                    methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and m is not fn]
                    todo += [(module, m, cls, frozenset(kept)) for m in methods if _reads(m, kept)]
            tracked = tracked | frozenset(kept)
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            if not any(_tracked(a, tracked) for a in [*call.args, *(k.value for k in call.keywords)]):
                continue
            found = _callee(index, module, cls, call)
            if found is None or found[1] is None:
                continue
            mod, callee, callee_cls = found
            receivers = _received_as(callee, call, tracked, bound=callee_cls is not None)
            if not receivers:
                continue
            if _layer_of(mod)[0] > _layer_of(module)[0]:
                out.climbs.append(f"{module} -> {mod}.{callee.name}")
            todo.append((mod, callee, callee_cls, frozenset(receivers)))
    return out


def test_the_config_enters_few_files_and_climbs_little() -> None:
    walk = walk_config(PACKAGES["zero_strategy"])
    assert len(walk.files) <= MAX_FILES and len(walk.climbs) <= MAX_CLIMBS, (sorted(walk.files), walk.climbs)
    assert "zero_strategy.runtime.compose" in walk.files  # the root is on the path


def test_the_walk_follows_calls_across_modules_and_sees_a_climb(tmp_path: Path) -> None:
    pkg = tmp_path / "zero_strategy"
    for sub in ("runtime", "sharding", "checkpoint"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "engine.py").write_text(
        "from zero_strategy.sharding import unit\n"
        "class ZeroEngine:\n"
        "    def __init__(self, module, config):\n"
        "        unit.build(module, cfg=config)\n"
        "        self._more(config)\n"
        "        self.kept = config\n"
        "    def _more(self, c):\n"
        "        unit.other(1)\n"
        "    def _later(self):\n"
        "        unit.other(self.kept.memory)\n"
    )
    (pkg / "sharding" / "unit.py").write_text(
        "def build(m, cfg):\n    from zero_strategy.checkpoint.files import up\n    up(cfg)\ndef other(x): ...\n"
    )
    (pkg / "checkpoint" / "files.py").write_text("def up(settings): ...\n")
    walk = walk_config(pkg)
    assert walk.files == {
        "zero_strategy.runtime.engine", "zero_strategy.sharding.unit", "zero_strategy.checkpoint.files"
    }  # fmt: skip
    assert walk.stays == 6 and walk.climbs == ["zero_strategy.sharding.unit -> zero_strategy.checkpoint.files.up"]
