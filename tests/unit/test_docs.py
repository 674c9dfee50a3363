"""Every fenced code block in README.md, CONTRIBUTING.md and docs/*.md is run, or says why not.

How a block is checked (the convention is written down in CONTRIBUTING.md, "Code blocks in
the docs"):

- ``python``: executed in a fresh namespace, in a fresh temporary directory that links the
  repository's ``examples/`` (not ``configs/``: the docs name the built-in configs), with the repository on ``PYTHONPATH``. Blocks that
  do not import Lightning, Accelerate or transformers share one subprocess (torch is imported
  once), Lightning blocks a second, Accelerate/transformers blocks a third (Accelerate's
  process-wide state is reset between blocks). A marker ``<!-- run with: NAME -->`` right before
  the block runs the prelude ``NAME`` of :data:`PRELUDES` first (a small model, an optimizer, a
  loader), for a fragment that continues a set-up the page describes.
- ``bash``: every command must be a ``zero-strategy`` call this test can make in-process
  (``check FILE``, ``estimate ...``, ``--help``); it runs through ``zero_strategy.cli.main`` and must exit 0.
- ``yaml``: a config (DeepSpeed or flat keys at the top) is read by ``ZeroConfig.from_dict``.
- Anything else, or a block these rules cannot run, needs ``<!-- not run: REASON -->`` on the
  line right before it (blank lines between are allowed), with a reason of three words or more,
  such as the test that runs the same thing. An unmarked block that cannot run fails the test.

The README's set-up and test commands must be the ones ``.ci/run`` runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|run with)\s*:\s*(?P<value>.*?)\s*-->\s*$")
_FRAMEWORKS = re.compile(r"^\s*(from|import)\s+(lightning|pytorch_lightning|lightning_zero|accelerate|accelerate_zero|transformers)\b", re.M)  # fmt: skip
_CONFIG_TOP_KEYS = ("zero_optimization", "zero_strategy", "bf16", "fp16", "stage", "gradient_clipping")

# Set-ups a fragment may continue (``<!-- run with: NAME -->``). Each defines what such
# fragments use and nothing else; a fragment that needs more is a fragment to rewrite.
PRELUDES = {
    # a user's model before initialize: a small transformer-like stack, a loader of batches
    "model": """
import torch
import torch.nn as nn
import zero_strategy as zs
from types import SimpleNamespace

class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
    def forward(self, x):
        return x + self.ff(x)

class MyModel(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)
    def forward(self, batch):
        x, y = batch
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(loss=nn.functional.mse_loss(self.head(x), y))

torch.manual_seed(0)
loader = [(torch.randn(4, 16), torch.randn(4, 1)) for _ in range(4)]
""",
}
PRELUDES["engine"] = (  # the same model after initialize at ZeRO-3, one step taken
    PRELUDES["model"]
    + """
model = MyModel()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = zs.initialize(model, optimizer, stage=3)
model(loader[0]).loss.backward()
optimizer.step()
optimizer.zero_grad()
"""
)


@dataclasses.dataclass(frozen=True)
class Block:
    file: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "not run" or "run with"
    value: str  # the reason, or the prelude's name

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def framework(self) -> str:
        """The framework process this block runs in: "" (torch only), "lightning" or "accelerate"."""
        found = _FRAMEWORKS.search(self.code) if self.lang == "python" else None
        if found is None:
            return ""
        return "lightning" if "lightning" in found[2] else "accelerate"


def extract_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The fenced blocks of one Markdown file, with the marker on the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[end]):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path.relative_to(root)}:{i + 1}: a code fence that is never closed")
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _MARKER.match(lines[before]) if before >= 0 else None
        blocks.append(Block(str(path.relative_to(root)), i + 1, lang, "\n".join(body) + "\n",
                            marker["kind"] if marker else None, marker["value"] if marker else ""))  # fmt: skip
        i = end + 1
    return blocks


def _commands(code: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped,
    ``&&`` chains split."""
    joined = re.sub(r"[ \t]*\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"\s+#.*$", "", line)
        out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def _runnable_cli(command: str) -> bool:
    words = shlex.split(command)
    if not words or words[0] != "zero-strategy":
        return False
    return words[1:2] in (["check"], ["estimate"]) or words[-1] in ("--help", "-h")


def why_not_runnable(block: Block) -> str | None:
    """None if the rules above can run the block, else why not."""
    if block.lang == "python":
        return None
    if block.lang in ("bash", "sh", "shell"):
        bad = [c for c in _commands(block.code) if not _runnable_cli(c)]
        return f"commands this test cannot run: {bad}" if bad else None
    if block.lang in ("yaml", "yml"):
        import yaml

        data = yaml.safe_load(block.code)
        if isinstance(data, dict) and any(key in data for key in _CONFIG_TOP_KEYS):
            return None
        return "a YAML block that is not a zero_strategy config"
    return f"a {block.lang or 'plain'} block"


def all_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in extract_blocks(path)]


def _to_run(framework: str) -> list[Block]:
    """The blocks to run (an unrunnable unmarked block fails test_every_block_is_run_or_says_why_not)."""
    return [b for b in all_blocks() if b.marker != "not run" and b.framework == framework and not why_not_runnable(b)]


# --------------------------------------------------------------------------- the tests


def test_every_block_is_run_or_says_why_not() -> None:
    problems = []
    for block in all_blocks():
        if block.marker == "not run":
            if len(block.value.split()) < 3:
                problems.append(f"{block.where}: 'not run' needs a reason of three words or more, got {block.value!r}")
            continue
        if block.marker == "run with" and block.value not in PRELUDES:
            problems.append(f"{block.where}: no prelude {block.value!r}; PRELUDES has {sorted(PRELUDES)}")
        reason = why_not_runnable(block)
        if reason:
            problems.append(f"{block.where}: {reason}; run it or mark it <!-- not run: why -->")
    assert not problems, "\n".join(problems)


def _run_in_subprocess(blocks: list[Block], timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "blocks.json"
        spec.write_text(json.dumps([dataclasses.asdict(b) for b in blocks]))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "integrations")]),
               "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # fmt: skip
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ZERO_STRATEGY_CONFIG"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, __file__, str(spec)], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=tmp)  # fmt: skip
        results_file = Path(tmp) / "results.json"
        results = json.loads(results_file.read_text()) if results_file.exists() else None
    assert results is not None, (
        f"the runner died (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    failed = [f"{r['where']}:\n{r['error']}" for r in results if r["error"]]
    assert len(results) == len(blocks) and not failed, "\n\n".join(failed) or proc.stderr[-3000:]


@pytest.mark.parametrize("framework", ["", "lightning", "accelerate"], ids=["torch", "lightning", "accelerate"])
def test_blocks_run(framework: str) -> None:
    """Every runnable block, in one subprocess per framework (blocks that import neither Lightning
    nor Accelerate/transformers share the torch-only one)."""
    blocks = _to_run(framework)
    assert blocks, f"no runnable {framework or 'torch'} block found: the extraction is broken"
    _run_in_subprocess(blocks, timeout=240)


def test_readme_setup_and_test_commands_are_what_ci_runs() -> None:
    """CI runs exactly the README's two commands; the README block must stay equal to .ci/run."""
    readme = [b for b in extract_blocks(ROOT / "README.md") if 'pip install -e ".[dev]"' in b.code]
    assert len(readme) == 1, "the README must show the set-up and test commands in one block"

    def normal(command: str) -> str:
        command = re.sub(r"^python(3)? -m (?=pip|venv)", "", command.strip())
        return re.sub(r"\s-q\b(?= )", "", command) if command.startswith("pip install") else command

    shown = [normal(c) for c in _commands(readme[0].code)]
    shown = [c for c in shown if c.startswith(("pip install", "ruff", "mypy", "python -m pytest"))]
    ci = [normal(c) for c in _commands((ROOT / ".ci" / "run").read_text())]
    ci = [c for c in ci if c.startswith(("pip install torch", "pip install -e", "ruff", "mypy", "python -m pytest"))]
    assert shown == ci and len(ci) == 6, f"README: {shown}\n.ci/run: {ci}"


def test_config_reference_names_every_key() -> None:
    """docs/config.md lists every key the config reader knows: honoured, mapped or ignored."""
    from zero_strategy.config import blocks, comm
    from zero_strategy.config import zero_config as zc
    from zero_strategy.config.values import settings_of

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    keys = {key for table in zc._DS_KEYS.values() for key in table}
    keys |= {*zc._ZERO_BLOCK_LEGACY, *zc._ZERO_BLOCK_IGNORED, *zc._BF16_IGNORED, *zc._FP16_IGNORED}
    keys |= {*zc._FP16_KEYS, *zc._FRONTEND_KEYS, *(key for _, key in zc._REDUCE_DTYPE_KEYS)}
    keys |= {*zc._TOP_IGNORED, *zc._OFFLOAD_OPTIMIZER_IGNORED}
    for cls in (blocks.OffloadConfig, blocks.PrecisionConfig, blocks.LossScaleConfig, comm.CompressionConfig,
                comm.LoadBalanceConfig):  # fmt: skip
        keys |= set(settings_of(cls))
    keys |= set(zc._FIELD_NAMES)
    missing = sorted(key for key in keys if not re.search(rf"[`.]{re.escape(key)}`", text))  # `key` or `block.key`
    assert len(keys) > 80 and not missing, f"docs/config.md does not name: {missing}"


# Files other branches write; a link to one is allowed until it exists. Once it exists the
# entry must go (the test fails), so the list cannot outlive the merge.
PENDING: set[str] = set()


def test_links_between_the_docs_resolve() -> None:
    problems = []
    for path in DOC_FILES:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            rel = os.path.relpath(resolved, ROOT)
            if not resolved.exists() and rel not in PENDING:
                problems.append(f"{path.relative_to(ROOT)}: link to {target} ({rel}) does not resolve")
    problems += [f"{rel} exists now: remove it from PENDING in tests/unit/test_docs.py" for rel in sorted(PENDING)
                 if (ROOT / rel).exists()]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 260, f"README.md has {lines} lines; move detail to docs/ (the issue asks for about 250)"


def test_the_extraction_sees_markers_indents_and_unclosed_fences(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "- item\n\n  <!-- not run: needs two processes -->\n\n  ```bash\n  torchrun x.py\n  ```\n\n"
        "<!-- run with: model -->\n```python\nprint(1)\n```\n\n```yaml\nzero_optimization: {stage: 2}\n```\n"
    )
    a, b, c = extract_blocks(page, tmp_path)
    (tmp_path / "bad.md").write_text("```python\nprint(1)\n")
    with pytest.raises(AssertionError, match="never closed"):
        extract_blocks(tmp_path / "bad.md", tmp_path)
    assert (a.lang, a.code, a.marker, a.value) == ("bash", "torchrun x.py\n", "not run", "needs two processes")
    assert (b.marker, b.value, c.marker, c.line) == ("run with", "model", None, 14)
    assert why_not_runnable(a) is not None and why_not_runnable(c) is None
    assert why_not_runnable(dataclasses.replace(a, code="zero-strategy check zero3\n")) is None
    assert _commands("a \\\n  b && c  # x\n# d\n") == ["a b", "c"]


# --------------------------------------------------------------------------- the runner


def _run_cli(command: str) -> None:
    from zero_strategy import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            cli.main(shlex.split(command)[1:])
            code: object = 0
        except SystemExit as exc:
            code = exc.code
    if code not in (0, None):
        raise RuntimeError(f"`{command}` exited {code}:\n{out.getvalue()[-2000:]}")


def _run_block(block: Block) -> None:
    if block.lang == "python":
        namespace: dict[str, object] = {"__name__": "__main__"}
        if block.marker == "run with":
            exec(compile(PRELUDES[block.value], f"<prelude {block.value}>", "exec"), namespace)
        exec(compile(block.code, block.where, "exec"), namespace)
    elif block.lang in ("yaml", "yml"):
        import yaml

        from zero_strategy.config import ZeroConfig

        ZeroConfig.from_dict(yaml.safe_load(block.code), source=block.where)
    else:
        for command in _commands(block.code):
            _run_cli(command)


def _main(spec: str) -> None:
    import gc

    results = []
    out_dir = Path(spec).parent
    for raw in json.loads(Path(spec).read_text()):
        block = Block(**raw)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            for name in ("examples",):  # not configs/: the docs name the built-in presets, from any directory
                os.symlink(ROOT / name, Path(work) / name)
            os.chdir(work)
            try:
                _run_block(block)
                error = ""
            except BaseException:  # every failure is reported with its block
                error = traceback.format_exc()
            finally:
                os.chdir(out_dir)
                if "accelerate.state" in sys.modules:  # Accelerate's state is a process-wide singleton
                    sys.modules["accelerate.state"].AcceleratorState._reset_state(True)
                gc.collect()
        results.append({"where": block.where, "error": error})
        print(f"{block.where}: {'FAILED' if error else 'ok'} ({time.perf_counter() - start:.1f} s)", flush=True)
    (out_dir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _main(sys.argv[1])
