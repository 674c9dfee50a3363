"""Host memory per rank of a sharded ``from_pretrained`` against loading the model whole.

A ``LlamaForCausalLM`` of about 1 GB of fp32 weights (random, from a config), saved once with
``save_pretrained(max_shard_size=...)`` as several safetensors files. Then, in a fresh pair of
gloo ranks per mode, after a warm-up load of a tiny model (imports):

- ``whole``: ``AutoModelForCausalLM.from_pretrained(path)`` on each rank (Transformers' own);
- ``sharded``: ``zero_strategy.from_pretrained(AutoModelForCausalLM, path)``;

each followed by ``zs.initialize(model, None, stage=3)``. A thread samples ``/proc/self/status``
every 2 ms: the peak growth of ``RssAnon`` (copies) and of ``RssAnon + RssFile`` (also the
mapped file pages a rank touches) during the load and until the end of ``initialize``, the worst
of the two ranks, in MiB and as a multiple of the whole mode's.

    OMP_NUM_THREADS=1 PYTHONPATH=.:integrations python bench/bench_pretrained_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from typing import Any


def _status() -> tuple[int, int]:
    anon = file = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith(b"RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


class Sampler:
    """Peak growth of (RssAnon, RssAnon + RssFile) since ``start``, sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = _status()
        self.peak = [0, 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.mark()
            time.sleep(0.002)

    def mark(self) -> None:
        anon, file = _status()
        self.peak[0] = max(self.peak[0], anon - self.base[0])
        self.peak[1] = max(self.peak[1], anon + file - sum(self.base))

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        self.mark()
        return list(self.peak)


def _config(layers: int, width: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                       num_attention_heads=width // 64, num_key_value_heads=width // 64, tie_word_embeddings=True)  # fmt: skip


def _worker(rank: int, world: int, mode: str, path: str, tiny: str, dtype: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import zero_strategy as zs

    def load(p: str) -> Any:
        if mode == "whole":
            return AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
        return zs.from_pretrained(AutoModelForCausalLM, p, dtype=dtype)

    warm, _ = zs.initialize(load(tiny), None, stage=3)  # imports and first collectives
    warm.zero_engine.close()
    del warm
    torch.distributed.barrier()
    s = Sampler()
    model = load(path)
    loaded = list(s.peak)
    s.mark()
    loaded = [max(a, b) for a, b in zip(loaded, s.peak)]
    model, _ = zs.initialize(model, None, stage=3)
    total = s.stop()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.zero_engine.close()
    return {"load": loaded, "total": total, "model_bytes": nbytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--max-shard-size", default="300MB")
    ap.add_argument("--dtype", default="auto", help="from_pretrained's dtype (bfloat16: fp32 files converted)")
    ap.add_argument("--dir", default=None, help="where to save the model (default: a temporary directory)")
    a = ap.parse_args()
    import torch
    from transformers import LlamaForCausalLM

    from zero_strategy.testing import launch

    root = a.dir or tempfile.mkdtemp(prefix="bench_pretrained_")
    path, tiny = os.path.join(root, "model"), os.path.join(root, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        LlamaForCausalLM(_config(a.layers, a.width)).save_pretrained(path, max_shard_size=a.max_shard_size)
        LlamaForCausalLM(_config(1, 64)).save_pretrained(tiny)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    rows = {}
    for mode in ("whole", "sharded"):
        ranks = launch(_worker, 2, args=(mode, path, tiny, a.dtype), timeout=1800)
        rows[mode] = {k: [max(r[k][i] for r in ranks) for i in range(2)] for k in ("load", "total")}
        rows[mode]["model_bytes"] = ranks[0]["model_bytes"]
    mib = 2**20
    print(f"model: {rows['whole']['model_bytes'] / mib:.0f} MiB of weights, {len(files)} safetensors files")
    print("| mode | load RssAnon MiB | load RSS MiB | to end of initialize RssAnon MiB | RSS MiB |")
    print("|---|---|---|---|---|")
    for mode, r in rows.items():
        w = rows["whole"]
        cells = [f"{r[k][i] / mib:.0f} ({r[k][i] / max(w[k][i], 1):.2f}×)" for k in ("load", "total") for i in range(2)]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
