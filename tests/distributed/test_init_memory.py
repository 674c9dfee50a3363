"""Host memory during ``initialize``: the model is converted unit by unit, never copied whole.

A thread samples the process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``)
while ``initialize`` runs; its growth must stay a small fraction of the model's bytes (FSDP2's
``fully_shard`` per layer grows by a few percent). The values must still be rank 0's (the
initial broadcast, now bucket by bucket and, at ZeRO-3, unit by unit)."""

from __future__ import annotations

import os
import sys

from zero_strategy.testing import run_subtests

LAYERS, WIDTH = 52, 1024  # 52 Linear(1024, 1024): 218 MB of fp32 parameters
BOUND = 0.15  # growth / model bytes


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("/proc/self/status has no RssAnon line")


def _peak_growth(fn):
    """Run ``fn()`` while a thread samples RssAnon every 2 ms; (its result, peak growth in bytes)."""
    import threading

    start = _rss_anon()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            done.wait(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        result = fn()
    finally:
        done.set()
        t.join()
    return result, max(peak[0], _rss_anon()) - start


def _model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _mapped_model(path: str):
    """The seed-0 model with every parameter a view of a private mapping of a file holding its
    values (as ``from_pretrained`` maps safetensors): reading it costs file pages, not anonymous
    memory; writing it would copy the pages it touches."""
    import torch

    model = _model(seed=0)
    params = list(model.parameters())
    torch.cat([p.detach().reshape(-1) for p in params]).numpy().tofile(path)
    total = sum(p.numel() for p in params)
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=total * 4)
    offset = 0
    for p in params:
        p.data = torch.empty(0).set_(storage, offset, p.shape)
        offset += p.numel()
    return model


def _memory_worker(rank: int, world: int, tmpdir: str) -> dict:
    import gc

    import torch

    import zero_strategy as zs

    out: dict = {}
    # the first initialize imports modules (tens of MB, once per process): not what is measured here
    warm = torch.nn.Linear(4, 4)
    zs.initialize(warm, torch.optim.AdamW(warm.parameters()), config={"zero_optimization": {"stage": 3}})
    warm.zero_engine.close()

    def case(stage: int, offload: bool = False, mapped: bool = False) -> None:
        # each rank its own values (initialize must give rank 0's), or mapped from a file of rank 0's
        built = _mapped_model(os.path.join(tmpdir, f"weights{rank}.bin")) if mapped else _model(seed=rank)
        nbytes = sum(p.numel() * p.element_size() for p in built.parameters())
        cfg: dict = {"zero_optimization": {"stage": stage}}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        gc.collect()
        (model, opt), grew = _peak_growth(
            lambda: zs.initialize(built, torch.optim.AdamW(built.parameters(), lr=1e-3), config=cfg)
        )
        reported = model.zero_engine.memory_stats()["initialize_host_peak"]
        del opt
        reference = _model(seed=0)
        with zs.gathered_parameters(model):
            same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        model.zero_engine.close()
        del model, reference
        gc.collect()
        # mapped weights are file pages: at ZeRO-3 this rank's rows are new anonymous memory
        allowed = BOUND + (1 / world if mapped and stage == 3 else 0)
        name = f"stage{stage}{'-offload' if offload else ''}{'-mapped' if mapped else ''}"
        out[name] = (grew / nbytes, reported / nbytes, same, allowed)

    run_subtests(
        case,
        [{"stage": 2}, {"stage": 3}, {"stage": 3, "offload": True}, {"stage": 2, "mapped": True},
         {"stage": 3, "mapped": True}],
    )  # fmt: skip
    return out


def test_initialize_grows_host_memory_by_a_unit_not_a_model(launch, tmp_path) -> None:
    # CI runs on Linux: the measurement reads RssAnon from /proc/self/status
    assert os.path.exists("/proc/self/status"), f"this test needs /proc/self/status (Linux), not on {sys.platform}"
    results = launch(_memory_worker, 2, args=(str(tmp_path),), timeout=600)
    for rank, out in enumerate(results):
        for name, (grew, reported, same, allowed) in out.items():
            assert same, f"rank {rank} {name}: the parameters are not rank 0's after initialize"
            assert grew <= allowed, f"rank {rank} {name}: RssAnon grew by {grew:.2f}x the model during initialize"
            # the reported peak is read at the conversion's own high points
            assert 0 <= reported <= allowed, f"rank {rank} {name}: initialize_host_peak {reported:.2f}x the model"
