"""Layer 6, the runtime: one :class:`~zero_strategy.runtime.engine.ZeroEngine` per model owns
every hook and state and calls the lifecycle methods of the layers below (the ZeRO-3
``UnitScheduler``, the ``GradReducer``, the parameter storage), which never import it. The
model-side and optimizer-side class swaps (``module``, ``optimizer``) live here too.
``compose.py`` is the composition root: the one module below the public API that reads the
user's ``ZeroConfig``; it builds each layer's policy and runs the engine's construction steps.

May import: every layer below (``reduction``, ``offload``, ``sharding``, ``storage``, ``comm``,
``config``).
"""
