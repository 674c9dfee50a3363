"""The start-up line ``zero_strategy_accelerate.pth`` reaches ``site-packages`` however the
package is built: a wheel from the checkout, and a wheel from the sdist (``pip install`` from an
index builds that way), and so do the built-in configs, which then work by name outside the
checkout. Built with setuptools' own backend, offline, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PTH = "zero_strategy_accelerate.pth"

BUILD = """
import sys
from setuptools import build_meta
kind, out = sys.argv[1], sys.argv[2]
print((build_meta.build_sdist if kind == "sdist" else build_meta.build_wheel)(out))
"""


def _build(kind: str, source: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=source, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out / done.stdout.strip().splitlines()[-1]


OUTSIDE = """
import torch, zero_strategy as zs
from zero_strategy.config import preset_names
assert zs.__file__.startswith(sys.argv[1]), zs.__file__
model, opt = zs.initialize(torch.nn.Linear(4, 2), lambda p: torch.optim.AdamW(p), config="zero3")
from zero_strategy.runtime.module import get_engine
print(get_engine(model).config.stage, ",".join(preset_names()))
"""


def test_the_start_up_line_is_in_the_wheel_built_from_the_sdist(tmp_path: Path) -> None:
    sdist = _build("sdist", ROOT, tmp_path)
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        assert any(n.endswith(f"integrations/{PTH}") for n in names), "MANIFEST.in must include the .pth"
        tar.extractall(tmp_path / "src", filter="data")
    (unpacked,) = (tmp_path / "src").iterdir()
    wheel = _build("wheel", unpacked, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(PTH).decode() == (ROOT / "integrations" / PTH).read_text()
        assert "accelerate_zero/_autostart.py" in zf.namelist()
        zf.extractall(tmp_path / "site")
    # the wheel alone, from a directory that is not the checkout: the presets work by name
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = dict(cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300, check=False)
    done = subprocess.run([sys.executable, "-c", "import sys" + OUTSIDE, str(tmp_path / "site")], **run)
    presets = "zero1,zero2,zero2_offload,zero3,zero3_offload,zero3_offload_nvme"
    assert done.returncode == 0 and done.stdout.split() == ["3", presets], done.stdout + done.stderr[-4000:]
    done = subprocess.run([sys.executable, "-m", "zero_strategy.cli", "check", "zero3"], **run)
    assert done.returncode == 0 and "stage" in done.stdout, done.stdout + done.stderr[-4000:]
