"""Host memory that setting a model up takes: ``zs.initialize`` against FSDP2 and DDP, and an HF
model loaded with ``from_pretrained`` under ``accelerate launch`` against ``zero-strategy launch``.

Every row is the growth of the process's anonymous resident memory (``RssAnon`` of
``/proc/self/status``, sampled by a thread every 2 ms), the worst of 2 gloo ranks, as a multiple
of the model's bytes:

- plain model: ``--layers`` ``nn.Linear(--width, --width)`` in fp32, built whole on each rank,
  then one of: DDP (``DistributedDataParallel`` + AdamW); FSDP2 (``fully_shard`` per Linear,
  then the root, then AdamW); ``zs.initialize`` at stages 1, 2, 3 and stages 2, 3 with
  ``offload_optimizer: {device: cpu}``. Each in a fresh pair of processes, after a warm-up set-up
  of a tiny model (the first set-up of a process imports modules), measured from just before
  the set-up call to its end.
- HF: a ``LlamaForCausalLM`` from a config with random weights, saved with
  ``save_pretrained(max_shard_size=...)`` as several safetensors files, then loaded on each rank
  with an unmodified ``from_pretrained`` and ``Accelerator.prepare(model, optimizer)``: once under
  ``accelerate launch`` (DDP), once under ``zero-strategy launch --zero-config`` at each stage.
  ``load``: growth during ``from_pretrained`` (transformers maps the files: little); ``prepare``:
  growth during ``prepare``; ``total``: from before the load to after ``prepare``. A tiny model
  is prepared first (imports, first collectives).

    OMP_NUM_THREADS=1 PYTHONPATH=.:integrations python bench/bench_init_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("ddp", "fsdp2", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line (Linux only)")


class Sampler:
    """The highest RssAnon a thread saw since :meth:`start`, every 2 ms."""

    def __enter__(self) -> Sampler:
        self.start = self.peak = rss_anon()
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon())
            self._done.wait(0.002)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()
        self.end = rss_anon()
        self.peak = max(self.peak, self.end)

    @property
    def grew(self) -> int:
        return self.peak - self.start


def _zero_config(engine: str) -> dict[str, Any]:
    stage = int(engine[4])
    z: dict[str, Any] = {"stage": stage}
    if engine.endswith("_offload"):
        z["offload_optimizer"] = {"device": "cpu"}
    return {"zero_optimization": z}


def _set_up(engine: str, model: Any) -> Any:
    import torch
    import torch.distributed as dist

    if engine == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        return wrapped, torch.optim.AdamW(wrapped.parameters())
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters())
    import zero_strategy as zs

    return zs.initialize(model, torch.optim.AdamW(model.parameters()), config=_zero_config(engine))


def _plain_worker(rank: int, world: int, engine: str, layers: int, width: int) -> dict[str, Any]:
    import torch

    _set_up(engine, torch.nn.Sequential(torch.nn.Linear(4, 4)))  # warm-up: imports, first collectives
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with Sampler() as s:
        held = _set_up(engine, model)
    out = {"model_bytes": nbytes, "grew": s.grew, "end": s.end - s.start}
    if engine.startswith("zero"):
        out["reported"] = held[0].zero_engine.memory_stats()["initialize_host_peak"]
    return out


def plain_rows(layers: int, width: int) -> list[dict[str, Any]]:
    from zero_strategy.testing import launch

    rows = []
    for engine in ENGINES:
        ranks = launch(_plain_worker, 2, args=(engine, layers, width), timeout=900)
        nbytes = ranks[0]["model_bytes"]
        worst = max(r["grew"] for r in ranks)
        row = {"engine": engine, "model_MiB": nbytes / 2**20, "grew_MiB": worst / 2**20, "x_model": worst / nbytes,
               "end_MiB": max(r["end"] for r in ranks) / 2**20}  # fmt: skip
        if "reported" in ranks[0]:
            row["reported_x"] = max(r["reported"] for r in ranks) / nbytes
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# -- HF ----------------------------------------------------------------------------------------


def _hf_rank_job(model_dir: str, out_dir: str) -> None:
    """Run on each rank under a launcher: a warm-up ``prepare`` of a tiny model, then load,
    prepare, and write this rank's numbers."""
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator()
    tiny = torch.nn.Linear(4, 4)  # warm-up: the set-up path's imports and first collectives
    accelerator.prepare(tiny, torch.optim.AdamW(tiny.parameters()))
    with Sampler() as total:
        with Sampler() as load:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        with Sampler() as prep:
            model, opt = accelerator.prepare(model, opt)
    rank = accelerator.process_index
    result = {"model_bytes": nbytes, "load": load.grew, "prepare": prep.grew, "total": total.grew}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hf_rows(size: str, shard: str) -> list[dict[str, Any]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, vocab = {"small": (512, 1408, 6, 16000), "medium": (768, 2048, 8, 32000)}[size]
    tmp = Path(tempfile.mkdtemp(prefix="bench_init_memory_"))
    try:
        cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=8, vocab_size=vocab)  # fmt: skip
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(tmp / "model", max_shard_size=shard)
        files = sorted(p.name for p in (tmp / "model").glob("*.safetensors"))
        print(f"HF Llama saved as {len(files)} safetensors files", flush=True)
        accel_cfg = ROOT / "configs" / "accelerate_cpu.yaml"
        bin_dir = Path(sys.executable).parent  # the venv's entry points
        runs = {"accelerate launch (DDP)": [str(bin_dir / "accelerate"), "launch"]}
        for stage in (1, 2, 3):
            zcfg = ROOT / "configs" / f"zero{stage}.yaml"
            runs[f"zero-strategy launch, ZeRO-{stage}"] = [
                str(bin_dir / "zero-strategy"), "launch", "--zero-config", str(zcfg)]  # fmt: skip
        rows = []
        for name, front in runs.items():
            out = tmp / f"out{len(rows)}"
            out.mkdir()
            cmd = [*front, "--config_file", str(accel_cfg), "--num_processes", "2",
                   "--main_process_port", str(_free_port()), __file__, "--hf-rank-job", str(tmp / "model"), str(out)]  # fmt: skip
            env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
            if len(ranks) != 2:
                raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
            nbytes = ranks[0]["model_bytes"]
            row = {"run": name, "model_MiB": nbytes / 2**20, "files": len(files)}
            for key in ("load", "prepare", "total"):
                row[f"{key}_MiB"] = max(r[key] for r in ranks) / 2**20
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hf", choices=("small", "medium", "none"), default="small")
    ap.add_argument("--max-shard-size", default="100MB")
    ap.add_argument("--skip-plain", action="store_true", help="only the HF rows")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hf-rank-job", nargs=2, metavar=("MODEL_DIR", "OUT_DIR"))
    a = ap.parse_args()
    if a.hf_rank_job:
        _hf_rank_job(*a.hf_rank_job)
        return
    rows = {} if a.skip_plain else {"plain": plain_rows(a.layers, a.width)}
    if a.hf != "none":
        rows["hf"] = hf_rows(a.hf, a.max_shard_size)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
