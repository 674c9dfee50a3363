"""``zero-strategy bench --links 2x2``: 4 CPU/gloo ranks as 2 emulated nodes x 2, bytes per step
per link class from the engine's own counters, flat ZeRO-3 against shard groups and FSDP2 HSDP
(and hpZ / the quantized modes where this build has them) in one launch.

Checks: the groups' link classes (shard group intra, replica group and flat world inter); flat
ZeRO-3 moves everything across nodes; shard groups move less across nodes, and their counted
bytes equal FSDP2 HSDP's arithmetic on both links (the same layout); every number finite and
nonzero where it must be, the exact modes' losses equal flat ZeRO-3's; the files written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

SPEC = "d=128,layers=2,heads=4,seq=32"  # blocks above the ZeRO-3 persistence threshold: gathered


def test_bench_links_counts_bytes_per_link_class_on_emulated_nodes(tmp_path: Path) -> None:
    from zero_strategy import cli

    cli.main(["bench", "--links", "2x2", "--model", SPEC, "--steps", "1", "--warmup", "1", "--batch", "2",
              "--launcher", "own", "--out", str(tmp_path)])  # fmt: skip
    data = json.loads((tmp_path / "links.json").read_text())
    modes = {e["mode"]: e for e in data["summary"]}
    assert {"zero3", "shard", "fsdp2_hsdp"} <= {m for m, e in modes.items() if e["status"] == "ok"}, data["status"]
    for e in modes.values():
        assert e["status"] == "ok" or e["status"].startswith("skipped: "), e
    flat, shard, hsdp = modes["zero3"], modes["shard"], modes["fsdp2_hsdp"]
    assert shard["groups"] == {"shard group": "intra", "replica group": "inter", "world": "inter"}
    assert flat["groups"] == {"shard group": "inter", "replica group": "intra", "world": "inter"}
    assert flat["bytes_intra"] == 0 and flat["bytes_inter"] > 0
    assert 0 < shard["bytes_inter"] < 0.5 * flat["bytes_inter"] and shard["bytes_intra"] > 0
    for link in ("intra", "inter"):  # counted (this engine) against computed (FSDP2's arithmetic)
        got, want = shard[f"bytes_{link}"], hsdp[f"bytes_{link}"]
        assert want > 0 and abs(got - want) <= 0.02 * want, (link, got, want)
    for e in modes.values():
        if e["status"] != "ok":
            continue
        assert math.isfinite(e["step_s"]) and e["step_s"] > 0, e
        assert all(math.isfinite(v) for v in e["losses"]) and len(e["losses"]) == 2, e
        assert math.isfinite(e["vs_zero3"]["inter"]) and math.isfinite(e["vs_fsdp2_hsdp"]["step"]), e
        if e["mode"] in ("zero3", "shard", "hpz", "fsdp2_hsdp"):  # exact modes: flat ZeRO-3's numbers
            assert e["loss_vs_zero3"] <= 1e-5, e
    assert modes["shard"]["vs_zero3"]["inter"] == shard["bytes_inter"] / flat["bytes_inter"]
    table = (tmp_path / "links.md").read_text()
    assert "| shard groups (MiCS/HSDP) |" in table and "(computed)" in table, table
