"""The architecture's import rules, checked on the source (``ast``), so an import hidden inside a
function or under ``if TYPE_CHECKING:`` counts as much as one at the top of a module:

- no cycle among the modules of ``zero_strategy`` or of either front-end;
- the core's packages are layers (``LAYERS``, bottom first): a module imports only its own
  package and the layers below it, never a layer above or a sibling in its own layer;
- the core never imports a front-end framework, and imports with torch alone;
- ``collectives.py`` is the only core module that calls ``torch.distributed``'s collectives;
- below the composition root (``runtime/compose.py`` and the engine it builds), no module
  imports or names ``ZeroConfig``: each layer receives its own small policy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "zero_strategy": ROOT / "zero_strategy",
    "lightning_zero": ROOT / "integrations" / "lightning_zero",
    "accelerate_zero": ROOT / "integrations" / "accelerate_zero",
}

# The core's layers, bottom first: the one place the allowed order is written down. Each entry
# is a package (or a top-level module) of zero_strategy; entries in one tuple are siblings that
# may not import each other. ``zero_strategy`` itself is the package's ``__init__`` (the public
# API), which front-end helpers and the test harness sit above.
LAYERS: list[tuple[str, ...]] = [
    ("_version", "_swap", "_weak"),  # leaves: no imports of ours
    ("config",),  # ZeroConfig, its blocks and value rules
    ("comm",),  # collectives (the only torch.distributed caller), profiling, load-balance scores
    ("storage",),  # offload policies, swap files, disk rows: bytes, not shards
    ("sharding",),  # layouts, groups, units, pieces, precision, sharded_init, setup checks
    ("reduction", "offload"),  # gradient schedules/reducer/compression; disk tier and swapped optimizer state
    ("runtime",),  # the engine, the ZeRO-3 scheduler, the class swaps
    ("api",),  # initialize and the other engine-level public functions
    ("checkpoint",),  # save/load, versioned directories, files, export
    ("zero_strategy",),  # the package's __init__: the public names
    ("frontend", "models"),
    ("testing",),
    ("bench",),  # the bench and the estimator: start ranks with the test harness's launcher
    ("cli",),  # the command line: imports its commands' modules when they run
]


def _layer_of(module: str) -> tuple[int, str]:
    """(layer index, entry) of a module of zero_strategy."""
    parts = module.split(".")
    entry = parts[1] if len(parts) > 1 else "zero_strategy"
    for i, names in enumerate(LAYERS):
        if entry in names:
            return i, entry
    raise AssertionError(f"{module}: its package '{entry}' is not in LAYERS; add it at the layer where it belongs")


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        level, entry = _layer_of(mod)
        for dep in sorted(deps):
            dep_level, dep_entry = _layer_of(dep)
            if dep_entry == entry:
                continue
            if dep_level > level:
                out.append(f"{mod} imports {dep}: layer '{dep_entry}' is above '{entry}'")
            elif dep_level == level:
                out.append(f"{mod} imports {dep}: '{dep_entry}' and '{entry}' are siblings in one layer")
    return out


def _modules(package: str, base: Path | None = None) -> dict[str, Path]:
    """Module name -> source file of ``package`` (under ``base``: another copy of its tree)."""
    base = PACKAGES[package] if base is None else base
    out = {}
    for f in base.rglob("*.py"):
        parts = (package, *f.relative_to(base).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _from_base(name: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    """The absolute module of ``from ... import`` in module ``name`` (relative levels resolved)."""
    base = node.module or ""
    if node.level:
        parts = name.split(".") if is_pkg else name.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return base


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ``known`` that ``name`` imports, anywhere in its source."""
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(name, node, is_pkg)
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name` imports pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package: str) -> None:
    known = _modules(package)
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert _cycles(graph) == [], f"import cycles in {package} (counting function-local and TYPE_CHECKING imports)"


def test_core_packages_import_only_downward() -> None:
    known = _modules("zero_strategy")
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    layered = {_layer_of(m)[1] for m in known}
    assert layered == {e for names in LAYERS for e in names}, "LAYERS names a package that does not exist"
    assert _layer_violations(graph) == []


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {
        "zero_strategy.sharding.unit": {"zero_strategy.runtime.engine", "zero_strategy.sharding.layout"},
        "zero_strategy.reduction.grads": {"zero_strategy.offload.disk_tier"},
        "zero_strategy.comm.collectives": {"zero_strategy.config.values"},
    }
    assert _layer_violations(graph) == [
        "zero_strategy.reduction.grads imports zero_strategy.offload.disk_tier: 'offload' and 'reduction' are "
        "siblings in one layer",
        "zero_strategy.sharding.unit imports zero_strategy.runtime.engine: layer 'runtime' is above 'sharding'",
    ]


def test_the_detector_sees_local_and_type_checking_imports(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from pkg import b\n")
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n")
    known = {"pkg.a": a, "pkg.b": b}
    graph = {m: _imports(m, p, known) for m, p in known.items()}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


# The composition root: the runtime modules that read the user's config (every layer from
# ``config`` up to ``runtime`` below them receives a policy instead).
ROOT_MODULES = {"zero_strategy.runtime.compose", "zero_strategy.runtime.engine"}
BELOW_ROOT = ("comm", "storage", "sharding", "reduction", "offload", "runtime")


def _names_config(path: Path) -> bool:
    """Whether the source imports or names ``ZeroConfig`` (anywhere: functions, TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and any(a.name == "ZeroConfig" for a in node.names):
            return True
        if isinstance(node, ast.Name) and node.id == "ZeroConfig":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "ZeroConfig":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "ZeroConfig":
            return True  # a string annotation
    return False


def _config_readers(known: dict[str, Path]) -> list[str]:
    return sorted(
        m for m, p in known.items() if _layer_of(m)[1] in BELOW_ROOT and m not in ROOT_MODULES and _names_config(p)
    )


def test_below_the_composition_root_no_module_reads_the_config() -> None:
    """Issue 48: each layer takes its own policy (comm/policy.py, storage/offload.py,
    sharding/gather_policy.py, reduction/policy.py, sharding/precision.py, runtime/shard_groups.py),
    built by the composition root, never the whole ``ZeroConfig``."""
    readers = _config_readers(_modules("zero_strategy"))
    assert readers == [], f"these modules import or name ZeroConfig below the composition root: {readers}"


def test_the_config_reader_check_sees_a_hidden_import(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden.py"
    hidden.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zero_strategy.config import ZeroConfig\n"
    )
    quoted = tmp_path / "quoted.py"
    quoted.write_text("def f(c: 'ZeroConfig') -> None: ...\n")
    clean = tmp_path / "clean.py"
    clean.write_text(
        '"""Built from ZeroConfig by the root."""\nfrom zero_strategy.config.comm import CompressionConfig\n'
    )
    known = {
        "zero_strategy.storage.hidden": hidden,
        "zero_strategy.sharding.quoted": quoted,
        "zero_strategy.runtime.compose": hidden,
        "zero_strategy.reduction.clean": clean,
    }
    assert _config_readers(known) == ["zero_strategy.sharding.quoted", "zero_strategy.storage.hidden"]


def test_core_imports_no_frontend_and_distributed_calls_stay_in_collectives() -> None:
    known = _modules("zero_strategy")
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        banned = {
            m
            for m in names
            if m.split(".")[0] in ("lightning", "pytorch_lightning", "accelerate", "lightning_zero", "accelerate_zero")
        }
        assert not banned, f"{name} imports {sorted(banned)}: the core never imports a front-end"
        if name == "zero_strategy.comm.collectives" or name.startswith("zero_strategy.testing"):
            continue
        calls = {
            n.func.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "dist"
        }  # fmt: skip
        collectives = calls & {"all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "reduce_scatter",
                               "send", "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "all_gather_into_tensor"}  # fmt: skip
        assert not collectives, (
            f"{name} calls torch.distributed.{sorted(collectives)}: go through zero_strategy.comm.collectives"
        )


def test_core_imports_with_torch_alone() -> None:
    """Every optional package blocked: ``import zero_strategy`` and its submodules still work."""
    code = """
import importlib, pkgutil, sys
BLOCKED = ("yaml", "jsonargparse", "lightning", "pytorch_lightning", "accelerate", "transformers", "safetensors", "psutil", "deepspeed")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import zero_strategy
for m in pkgutil.walk_packages(zero_strategy.__path__, "zero_strategy."):
    if not m.name.startswith("zero_strategy.testing"):
        importlib.import_module(m.name)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_no_source_file_is_over_800_lines() -> None:
    """Small files that each hold one concept (the counter-example: 4,000-line classes)."""
    roots = [ROOT / "zero_strategy", ROOT / "integrations"]
    long = {
        str(p.relative_to(ROOT)): n
        for r in roots
        for p in r.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, f"split these files: {long}"


def test_every_core_package_is_installed() -> None:
    """``pyproject.toml`` lists packages by name: a package missing there works in an editable
    install (CI's) and is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(("zero_strategy", *f.parent.relative_to(ROOT / "zero_strategy").parts))
        for f in (ROOT / "zero_strategy").rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
