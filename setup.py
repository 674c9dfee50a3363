"""Installs the start-up line ``zero_strategy_accelerate.pth`` beside the packages.

Everything else is in ``pyproject.toml``. setuptools has no setting for a file at the root of
``site-packages``, so ``build_py`` copies it into the wheel (``pip install .``) and the editable
wheel (``pip install -e .``) gets it through its install strategy. The line imports nothing
unless ``ZERO_STRATEGY_CONFIG`` is set (``integrations/accelerate_zero/_autostart.py``).
"""

from __future__ import annotations

import os
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "zero_strategy_accelerate.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integrations", PTH)


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)


cmdclass: dict[str, Any] = {"build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable wheels
    pass
else:

    class _StrategyWithPth:
        """Wraps setuptools' editable strategy: its files, and the start-up line."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __enter__(self) -> _StrategyWithPth:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def __call__(self, wheel: Any, files: list[str], mapping: dict[str, str]) -> None:
            self.inner(wheel, files, mapping)
            with open(SOURCE, "rb") as f:
                wheel.writestr(PTH, f.read())

    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
