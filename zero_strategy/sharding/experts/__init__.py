"""Mixture-of-experts at ZeRO-3: gather only the experts the router selected (``docs/moe.md``).

A block's ZeRO-3 gather moves all its parameters, although each token of an MoE layer uses only
``k`` of its ``E`` experts. Here an experts module is a unit of its own, inside its block's
unit, whose rows are gathered by selection:

- **Detection** (``detect.py``). An *experts module* holds its experts' weights stacked along
  dimension 0 and takes the router's selection as a ``forward`` argument, as Hugging Face
  transformers' experts modules do; found by shape and signature, with no per-model list. A
  hand-written ``nn.ModuleList`` of experts is declared (``declare_experts``) and told its
  selection (``select_experts``).
- **Selected experts** (``selective.py``, ``ExpertRows``). Before the module's forward the
  ranks agree on the *union* of the experts their tokens selected (one all-reduce of an
  ``E``-element mask), and one all-gather moves only the union's rows; the backward gathers the
  same union again, and the reduction reduce-scatters only the union's gradient rows. The rows
  keep the ordinary flat layout, so checkpoints and everything else see ordinary parameters.
  When a selective gather would move most of a whole one (``moe_full_gather_share``), the unit
  is gathered whole instead.
- **Compact gathers** (``compact.py``, ``moe_compact_gather``). The union's rows are placed as
  parameters of shape ``[U, ...]`` and the module is called with slots instead of expert
  indices, so a layer's gathered memory follows the union, not ``E``.
- **Owners** (``owners.py``, ``moe_expert_layout: owners``). Each expert lives whole on one
  rank, which steps it; a rank fetches from the owners only the experts its own tokens selected
  (an all-to-all), and sends their gradients back to them.
- **The experts' cache** (``cache.py``, ``moe_expert_cache``). Rows gathered by a step's
  earlier passes are kept per layer under a cap in bytes until the parameters change, so a
  later pass gathers only its union minus the kept experts. What is kept depends only on agreed
  values, so every rank keeps the same experts.

The package's ``__init__`` imports none of its modules: ``sharding/partition.py`` imports
``detect.py`` (which imports torch only) to find the experts without the units that gather
them; the runtime imports ``selective.py`` and ``owners.py``. The modules import the rest of
``sharding`` (layouts, groups, units), which does not import them back.
"""
