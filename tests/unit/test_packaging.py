"""The start-up line ``zero_strategy_accelerate.pth`` reaches ``site-packages`` however the
package is built: a wheel from the checkout, and a wheel from the sdist (``pip install`` from an
index builds that way). Built with setuptools' own backend, offline, in a subprocess."""

from __future__ import annotations

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
