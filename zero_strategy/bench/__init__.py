"""The benchmark table and the memory estimator, as commands (``zero-strategy bench`` and
``zero-strategy estimate``; see ``docs/bench.md``).

- :mod:`~zero_strategy.bench.estimate`: model-state bytes per rank from four formulas (design
  notes 1.1, the ZeRO paper, DeepSpeed's estimator, this engine's layout); no torch needed.
- :mod:`~zero_strategy.bench.presets`: the bundled GPT's sizes for the bench.
- :mod:`~zero_strategy.bench.worker`: one row on one rank (started by the shared launcher).
- :mod:`~zero_strategy.bench.harness`: starts the ranks of every row and rank count, with progress.
- :mod:`~zero_strategy.bench.report`: the Markdown table, JSON, PNG plots, ``bench/RESULTS.md``'s
  generated section.

This package sits above ``testing`` (it starts ranks with the shared launcher) and below the CLI.
Nothing here is imported by the engine.
"""
