"""The communication device comes from the process group's backends and the model's device,
never from a backend string compared with 'nccl' (issue 31, items 4 and 9).

Without a GPU here, the group is simulated: ``torch.distributed``'s query functions are patched
to answer as a real group of that backend would (``get_backend`` gives the string given to
``init_process_group``, ``get_backend_config`` its device:backend pairs). The real thing runs in
the ``gpu`` tests at the end, whose ``cpu`` variants run in CI (the gloo half of the pair)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zero_strategy.comm import collectives as C


def _fake_group(monkeypatch: pytest.MonkeyPatch, given: str, config: str | None, current: int = 0) -> None:
    """A one-rank default group created with ``init_process_group(given)``, whose backend
    config reads ``config`` (None: a torch without ``get_backend_config``)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: given)
    if config is None:
        monkeypatch.delattr(dist, "get_backend_config", raising=False)
    else:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(C, "group_timeout", lambda group: C.DEFAULT_TIMEOUT)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


CUDA1, CPU = torch.device("cuda", 1), torch.device("cpu")

CASES = [
    # (init_process_group's backend, its config, the model's device, current device) -> (device, impl, timed)
    ("cuda:nccl,cpu:gloo", "cuda:nccl,cpu:gloo", CUDA1, 1, (CUDA1, "native", False)),  # was cpu: refused
    ("cuda:nccl,cpu:gloo", "cuda:nccl,cpu:gloo", CPU, 1, (CPU, "p2p", True)),  # a CPU model on the gloo half
    ("undefined", "cuda:nccl", CUDA1, 1, (CUDA1, "native", False)),  # torch 2.13 with a GPU: was cpu
    ("undefined", "cpu:gloo,cuda:nccl", CUDA1, 1, (CUDA1, "native", False)),  # older torch: both
    ("undefined", None, CUDA1, 1, (CUDA1, "native", False)),  # no get_backend_config: both assumed
    ("cuda:nccl,cpu:gloo", None, CUDA1, 1, (CUDA1, "native", False)),  # parsed from get_backend
    ("nccl", "cuda:nccl", CUDA1, 0, (CUDA1, "native", False)),  # model.to(1) without set_device: was cuda:0
    ("nccl", "cuda:nccl", CPU, 0, (torch.device("cuda", 0), "native", False)),  # CPU model: refused later
    ("nccl", "cuda:nccl", None, 0, (torch.device("cuda", 0), "native", False)),  # no parameters
    ("gloo", "cpu:gloo,cuda:gloo", CUDA1, 1, (CPU, "p2p", True)),  # gloo's CUDA half is not used
    ("gloo", "cpu:gloo,cuda:gloo", CPU, 0, (CPU, "p2p", True)),
    ("gloo", None, CPU, 0, (CPU, "p2p", True)),
]


@pytest.mark.parametrize(("given", "config", "model", "current", "expected"), CASES)
def test_the_device_comes_from_the_group_backends_and_the_model(
    monkeypatch: pytest.MonkeyPatch, given, config, model, current, expected
) -> None:
    _fake_group(monkeypatch, given, config, current)
    ctx = C.make_context(None, None, device=model)
    assert (ctx.device, ctx.impl, ctx.timed_wait) == expected


def test_sharded_init_keeps_the_pieces_on_the_groups_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31, item 6: on an NCCL group a model built on the default CPU device had its pieces
    on the CPU (gathered as CPU tensors into NCCL; ``.to('cuda')`` then materialised the
    placeholders at full size). The pieces and placeholders go to the group's device. Simulated:
    a two-rank group that communicates on the meta device (no GPU here), and the block is told
    the default device (the CPU) to choose the group's backend with."""
    from zero_strategy.sharding import construction
    from zero_strategy.sharding.pieces import is_placeholder, sharded_init_piece

    asked: list[torch.device | None] = []

    def context(group, timeout_s, impl="auto", device=None):
        asked.append(device)
        return C.CommContext(None, 0, 2, C.DEFAULT_TIMEOUT, "native", torch.device("meta"), global_ranks=(0, 1))

    placed: list[torch.device] = []

    def placeholder(shape, dtype, device):  # a CPU parameter takes no meta data (set_data): recorded, made on the CPU
        placed.append(torch.device(device))
        return real_placeholder(shape, dtype, CPU)

    real_placeholder = construction.placeholder
    monkeypatch.setattr(construction.C, "make_context", context)
    monkeypatch.setattr(construction, "placeholder", placeholder)
    with construction.sharded_init():
        model = torch.nn.Linear(4, 3)
    assert asked == [CPU]  # the pair's gloo half for a CPU build, NCCL's GPU without one
    assert placed == [torch.device("meta")] * 2, placed
    for name, p in model.named_parameters():
        piece = sharded_init_piece(p)
        assert piece is not None and piece.device.type == "meta", (name, piece)
        assert is_placeholder(p), name


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # the CPU variant runs in CI, catching stale names


@pytest.mark.parametrize("device", DEVICES)
def test_a_cuda_model_on_the_nccl_and_gloo_pair_communicates_on_its_gpu(tmp_path, device: str) -> None:
    """The real pair: a CUDA model initialises (refused before: 'move the model with
    model.to('cpu')') and its engine communicates on the model's GPU. NCCL needs a GPU: the
    ``cpu`` variant runs the pair's gloo half alone (``cpu:gloo``) with a CPU model, the same
    body otherwise, and its engine communicates on the CPU."""
    import zero_strategy as zs

    backend = "cuda:nccl,cpu:gloo" if device == "cuda" else "cpu:gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        dev = torch.device("cuda", torch.cuda.device_count() - 1) if device == "cuda" else CPU
        model = torch.nn.Linear(4, 4).to(dev)
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
        model(torch.randn(2, 4, device=dev)).sum().backward()
        opt.step()
        assert model.zero_engine.ctx.device == dev  # the public handle (zs.get_engine is no public name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
def test_sharded_init_on_nccl_builds_its_pieces_on_the_gpu(tmp_path, device: str) -> None:
    """The real NCCL group: a model built under sharded_init on the default CPU device is
    initialized without ``.to('cuda')``; its parameters hold only their pieces on the GPU. NCCL
    needs a GPU: the ``cpu`` variant runs the same body on a gloo group, pieces on the CPU."""
    import zero_strategy as zs

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        if device == "cuda":
            torch.cuda.set_device(0)
        with zs.sharded_init():
            model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        assert all(p.device.type == device for p in model.parameters())
        model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
        model(torch.randn(2, 64, device=device)).sum().backward()
        opt.step()
    finally:
        dist.destroy_process_group()
