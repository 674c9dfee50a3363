"""Every ``torch.distributed`` call of the engine lives here.

The functions are stateless apart from two process-wide things: the communication counters
(:mod:`zero_strategy.comm.counters`, read by :func:`comm_stats`, per link class by
:func:`comm_stats_by_link`), and a pool of scratch buffers owned by each :class:`CommContext`.
Each collective returns a :class:`Handle`; ``Handle.wait()`` applies the configured timeout and
turns a failure (a dead or diverged peer) into a :class:`CollectiveError` that names the
collective, what it was moving and the rank.

Counting follows the ZeRO paper (see ``counters``); each context's ``link`` ("intra": its
ranks in one node, "inter": across nodes) is decided from its ranks when it is made.

On gloo, ``reduce_scatter_tensor`` is an all-reduce plus copies and ``all_gather_into_tensor``
allocates a full-size temporary on every call. For those two the ``p2p`` implementation
exchanges the pieces with ``batch_isend_irecv`` instead (measured 2.5-3x faster here, see
bench/RESULTS.md). On NCCL the native collectives are used.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zero_strategy.comm import profiling as P
from zero_strategy.comm.counters import (  # re-exported: the counters live in counters.py
    CACHE_COUNTERS,
    comm_report,
    comm_stats,
    comm_stats_by_link,
    count,
    count_cache,
    link_of,
    mark_step,
    reset_comm_stats,
)

__all__ = [
    "CollectiveError",
    "agree_on_failure",
    "all_gather_objects",
    "CommContext",
    "Handle",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "bounded_group",
    "broadcast_coalesced",
    "comm_device",
    "CACHE_COUNTERS",
    "comm_report",
    "comm_stats",
    "comm_stats_by_link",
    "count_cache",
    "group_backends",
    "mark_step",
    "make_context",
    "mesh_groups",
    "reduce_scatter",
    "reset_comm_stats",
    "solo_context",
    "split_groups",
]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: usually a peer rank died or took another code path."""


class _ScratchPool:
    """Reusable flat slabs per (dtype, device). ``get`` hands out a view of a free slab at least
    as large as asked (fresh large CPU buffers cost page faults); ``put`` returns it. The pool
    only ever holds as many slabs as were in use at once, each as large as the largest request."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, str], list[torch.Tensor]] = {}
        self.allocated = 0  # bytes of all slabs alive, in use or free
        self.peak = 0

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.setdefault((dtype, str(device)), [])
        for k, slab in enumerate(free):
            if slab.numel() >= numel:
                return free.pop(k)[:numel]
        if free:  # grow: drop the largest free slab that is too small
            dropped = free.pop()
            self.allocated -= dropped.numel() * dropped.element_size()
        with torch.inference_mode(False):  # a slab first needed in inference mode is reused in training
            slab = torch.empty(numel, dtype=dtype, device=device)
        self.allocated += slab.numel() * slab.element_size()
        self.peak = max(self.peak, self.allocated)
        return slab

    def clear(self) -> None:
        """Drop every free slab (slabs in use stay with their users)."""
        for free in self._free.values():
            for slab in free:
                self.allocated -= slab.numel() * slab.element_size()
        self._free.clear()

    def trim(self, keep: int) -> None:
        """Drop free slabs, largest first, until at most ``keep`` bytes are allocated (the engine
        calls it after each step: a small model does not carry buffers as large as itself)."""
        for free in self._free.values():
            while free and self.allocated > keep:
                dropped = free.pop()
                self.allocated -= dropped.numel() * dropped.element_size()

    def put(self, t: torch.Tensor) -> None:
        slab = t._base if t._base is not None else t
        free = self._free.setdefault((slab.dtype, str(slab.device)), [])
        free.append(slab)
        free.sort(key=lambda x: x.numel())


@dataclass
class CommContext:
    """Where and how to communicate: the group, its size and this rank, the timeout and the
    implementation (``native`` collectives or ``p2p`` exchange) chosen for its backend."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    timeout: timedelta
    impl: str
    device: torch.device
    pool: _ScratchPool = field(default_factory=_ScratchPool)
    # ranks of the group in global numbering, for point-to-point calls
    global_ranks: tuple[int, ...] = ()
    # gloo: Work.wait(timeout) costs nothing; on NCCL it blocks the CPU until the collective
    # completes (no overlap), so there the process group's timeout and watchdog bound the wait
    timed_wait: bool = True
    # "intra" (all ranks in one node) or "inter" (across nodes): the link class its bytes count under
    link: str = "intra"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default process-group timeout


def group_timeout(group: dist.ProcessGroup | None) -> timedelta:
    """The timeout ``group`` (None: the default group) was created with."""
    if not dist.is_available() or not dist.is_initialized():
        return DEFAULT_TIMEOUT
    pg = group if group is not None else dist.group.WORLD
    if pg is None:  # not reached once initialised; as a group without a readable timeout
        return DEFAULT_TIMEOUT
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:
            continue
    return DEFAULT_TIMEOUT


def group_backends(group: dist.ProcessGroup | None) -> dict[str, str]:
    """The backend ``group`` uses for each device type: ``{'cuda': 'nccl', 'cpu': 'gloo'}`` for a
    group made with ``'cuda:nccl,cpu:gloo'``, ``{'cuda': 'nccl'}`` for ``'nccl'``, ``{'cpu': 'gloo',
    'cuda': 'gloo'}`` for ``'gloo'``. Read from ``get_backend_config`` (its device:backend pairs;
    it resolves ``init_process_group()`` without a backend too); a torch without it: parsed from
    ``get_backend``, where no backend (``'undefined'``) is torch's default pair."""
    try:
        text = str(dist.get_backend_config(group))
    except Exception:  # an older torch, or a group the call does not describe
        text = str(dist.get_backend(group))
    pairs: dict[str, str] = {}
    for part in (p.strip() for p in text.lower().split(",") if p.strip()):
        device, sep, name = part.partition(":")
        if sep:
            pairs[device] = name
        elif part == "undefined":
            pairs |= {"cpu": "gloo", "cuda": "nccl"}
        else:
            pairs |= {"cuda": part} if part == "nccl" else {"cpu": part}
    return pairs


def comm_device(backends: dict[str, str], model: torch.device | None) -> torch.device:
    """Where the engine communicates: the model's device where the group has a backend for its
    type (so a model moved with ``model.to(local_rank)`` talks on its own GPU, whatever
    ``torch.cuda.current_device()`` says), else the group's GPU, else the CPU. The engine never
    sends CUDA tensors through gloo: a gloo group communicates on the CPU."""
    usable = {d for d, b in backends.items() if not (d == "cuda" and b == "gloo")}
    if model is not None and model.type in usable:
        if model.type == "cuda" and model.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return model
    if "cuda" in usable:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_context(
    group: dist.ProcessGroup | None, timeout_s: float | None, impl: str = "auto", device: torch.device | None = None
) -> CommContext:
    """Describe ``group`` (None: the default group; without an initialised process group, a
    single-rank context whose collectives are no-ops, on ``device``). ``device``: the model's
    (its first parameter's), which chooses among the group's backends (:func:`comm_device`).
    ``timeout_s`` None: the group's own timeout, so a healthy job that the process group would
    tolerate is never cut."""
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else group_timeout(group)
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise RuntimeError(
                "initialize(process_group=...) was given a group but torch.distributed is not "
                "initialised; call torch.distributed.init_process_group() first"
            )
        return CommContext(None, 0, 1, timeout, "native", device or torch.device("cpu"), global_ranks=(0,))
    backends = group_backends(group)
    where = comm_device(backends, device)
    backend = backends.get(where.type, "")
    if impl == "auto":
        impl = "p2p" if backend == "gloo" else "native"
    if impl not in ("native", "p2p"):
        raise ValueError(f"collective_impl={impl!r} is not one of 'auto', 'native', 'p2p'")
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    return CommContext(
        group, dist.get_rank(group), dist.get_world_size(group), timeout, impl, where, global_ranks=ranks,
        timed_wait=backend != "nccl", link=link_of(ranks),
    )  # fmt: skip


# (the default group it was made under, the group): a group outlives neither the default group
# nor a re-initialisation in the same process
_BOUNDED: dict[tuple[tuple[int, ...], timedelta], tuple[Any, dist.ProcessGroup]] = {}


def bounded_group(ctx: CommContext) -> dist.ProcessGroup | None:
    """The group for collectives that obey only their group's timeout (DCP's): ``ctx.group``
    itself when comm_timeout is the group's timeout, else a gloo group of the same ranks created
    with comm_timeout (once per ranks and timeout; only the members take part). Created on first
    use, after ``initialize`` checked that every rank has the same comm_timeout, so every rank
    creates it or none does."""
    if not ctx.distributed or ctx.timeout == group_timeout(ctx.group):
        return ctx.group
    key, world = (ctx.global_ranks, ctx.timeout), dist.distributed_c10d._get_default_group()
    made = _BOUNDED.get(key)
    if made is None or made[0] is not world:
        made = (
            world,
            dist.new_group(list(ctx.global_ranks), timeout=ctx.timeout, backend="gloo", use_local_synchronization=True),
        )
        _BOUNDED[key] = made
    return made[1]


# (the default group it was made under, the group) by global ranks: made once per process
_SPLIT: dict[tuple[int, ...], tuple[Any, dist.ProcessGroup]] = {}


def split_groups(ctx: CommContext, shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's two subgroups of ``ctx``'s group for shard groups of ``shard_size`` ranks:
    its shard group (group ranks ``[g*s, (g+1)*s)``) and its replica group (the ranks with the
    same index in every shard group). Collective over ``ctx``'s group: every member makes its
    shard group first, then its replica group (one global order, as torch asks of groups made
    with local synchronisation); each group is made once per process and default group."""
    s, n = shard_size, ctx.world_size
    if n % s:
        raise ValueError(f"split_groups: shard_size {s} does not divide the group's {n} ranks")
    mine = ctx.rank
    shard = ctx.global_ranks[mine - mine % s : mine - mine % s + s]
    replica = ctx.global_ranks[mine % s :: s]
    world = dist.distributed_c10d._get_default_group()
    timeout = group_timeout(ctx.group)
    if ctx.world_size == dist.get_world_size():
        # over the whole world: every rank makes every group, in one order (torch's plain
        # new_group), so the groups' names agree whatever groups each rank made before
        every = [ctx.global_ranks[g : g + s] for g in range(0, n, s)] + [ctx.global_ranks[i::s] for i in range(s)]
        for ranks in every:
            if ranks not in _SPLIT or _SPLIT[ranks][0] is not world:
                _SPLIT[ranks] = (world, dist.new_group(list(ranks), timeout=timeout))
        return _SPLIT[shard][1], _SPLIT[replica][1]
    out = []  # a subgroup of the world: local synchronisation (names hashed from the ranks and the
    for ranks in (shard, replica):  # process's group count: ranks must have made as many groups before)
        made = _SPLIT.get(ranks)
        if made is None or made[0] is not world:
            made = (world, dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True))
            _SPLIT[ranks] = made
        out.append(made[1])
    return out[0], out[1]


def mesh_groups(mesh: Any) -> list[dist.ProcessGroup] | None:
    """This rank's process group along each dim of ``mesh``, in dim order, when it is a
    ``torch.distributed.device_mesh.DeviceMesh`` (None otherwise). Made by the mesh: no collective."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch built without distributed support
        return None
    return [mesh.get_group(d) for d in range(mesh.ndim)] if isinstance(mesh, DeviceMesh) else None


def solo_context(ctx: CommContext) -> CommContext:
    """A one-rank context beside ``ctx`` (same device, timeout and buffers): its collectives
    are no-ops (the replica group of a flat layout)."""
    me = ctx.global_ranks[ctx.rank] if ctx.global_ranks else 0
    return CommContext(None, 0, 1, ctx.timeout, ctx.impl, ctx.device, ctx.pool, global_ranks=(me,),
                       timed_wait=ctx.timed_wait)  # fmt: skip


class Handle:
    """Pending collective. ``wait()`` blocks (bounded by the context's timeout) and then runs
    the completion step, if any (the local sum of a p2p reduce-scatter, for instance)."""

    def __init__(
        self,
        ctx: CommContext,
        kind: str,
        what: str,
        works: Sequence[dist.Work],
        elements: int,
        element_size: int,
        issue_seconds: float,
        finish: Callable[[], None] | None = None,
        peers: Sequence[int] | None = None,
    ) -> None:
        self._ctx, self.kind, self.what = ctx, kind, what
        self._works, self._finish = list(works), finish
        # point-to-point: the group rank each work exchanges with, to name a missing peer
        self._peers = list(peers) if peers is not None and len(peers) == len(self._works) else [None] * len(self._works)
        self._elements, self._element_size, self._seconds = elements, element_size, issue_seconds
        self.done = False

    @property
    def local(self) -> bool:
        """Nothing in flight: a group of one rank, whose collective moved nothing."""
        return not self._works

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` at the end of :meth:`wait` too: a device-side wait for a stream that the
        collective was not ordered after (a group of one rank issues no work to order it)."""
        first = self._finish

        def both() -> None:
            if first is not None:
                first()
            step()

        self._finish = both

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        peer: int | None = None
        blocked = P.open_range("zero: wait", self.kind, self.what)
        try:
            for w, peer in zip(self._works, self._peers):  # noqa: B007  (peer: named in the error below)
                if not self._ctx.timed_wait:
                    w.wait()  # NCCL: the process group's timeout and watchdog bound it
                elif not w.wait(timeout=self._ctx.timeout):
                    raise TimeoutError(f"no completion within {self._ctx.timeout.total_seconds():.0f}s")
        except Exception as e:  # gloo raises RuntimeError on a closed peer, or times out
            who = (
                f"rank {peer} of the group (global rank {self._ctx.global_ranks[peer]}) did not complete its part"
                if peer is not None
                else "another rank probably died or took a different code path"
            )
            raise CollectiveError(
                f"rank {self._ctx.rank}: {self.kind} of {self.what} failed after "
                f"{time.perf_counter() - t0:.1f}s (group of {self._ctx.world_size} ranks, "
                f"comm_timeout={self._ctx.timeout.total_seconds():.0f}s): {e}. {who[0].upper()}{who[1:]}; look at the "
                "other ranks' errors. A rank that is only slow (a long callback, a slow save) needs a longer "
                "comm_timeout: `zero_strategy: {comm_timeout: SECONDS}` in the config (default: the process "
                "group's timeout)."
            ) from e
        finally:
            P.close_range(blocked)
        exposed = time.perf_counter() - t0
        if self._finish is not None:
            self._finish()
        self.done = True
        seconds = self._seconds + time.perf_counter() - t0
        count(self.kind, self._ctx.link, self._elements, self._element_size, seconds, exposed)


def _done_handle(ctx: CommContext, kind: str, what: str, elements: int, element_size: int) -> Handle:
    return Handle(ctx, kind, what, [], elements, element_size, 0.0)


def _issue(
    ctx: CommContext, kind: str, what: str, fn: Callable[[], list[dist.Work]], peers: Sequence[int] = ()
) -> list[dist.Work]:
    """Start a collective; a peer whose connection is already closed fails it here (gloo), and
    the error names the peer when there is only one it could be."""
    try:
        with P.span("zero:", kind, what):
            return fn()
    except Exception as e:
        others = sorted(set(peers))
        who = (
            f"Rank {others[0]} of the group (global rank {ctx.global_ranks[others[0]]}) did not complete its part"
            if len(others) == 1
            else f"One of ranks {others} of the group probably died"
            if others
            else "Another rank probably died or took a different code path"
        )
        raise CollectiveError(
            f"rank {ctx.rank}: {kind} of {what} could not be issued: {e}. {who}; look at the other ranks' errors."
        ) from e


def _native_all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _native_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=True)


def all_gather(ctx: CommContext, out: torch.Tensor, inp: torch.Tensor, *, what: str) -> Handle:
    """Gather every rank's ``inp`` (S elements) into ``out`` (world_size * S, rank-major).

    ``inp`` may already be ``out``'s own row, which saves a copy."""
    n, s = ctx.world_size, inp.numel()
    if out.numel() != n * s:
        raise AssertionError(f"rank {ctx.rank}: all_gather of {what}: out has {out.numel()} elements, expected {n}x{s}")
    t0 = time.perf_counter()
    rows = out.view(n, s)
    if rows[ctx.rank].data_ptr() != inp.data_ptr():
        rows[ctx.rank].copy_(inp)
    if not ctx.distributed:
        return _done_handle(ctx, "all_gather", what, out.numel(), out.element_size())
    if ctx.impl == "native":
        works = _issue(ctx, "all_gather", what, lambda: [_native_all_gather(out, rows[ctx.rank], ctx.group)])
        peers = None
    else:
        peers = [j for j in range(n) if j != ctx.rank for _ in range(2)]  # a send and a receive each

        def p2p() -> list[dist.Work]:
            ops = []
            for j in range(n):
                if j != ctx.rank:
                    peer = ctx.global_ranks[j]
                    ops.append(dist.P2POp(dist.isend, rows[ctx.rank], peer, ctx.group))
                    ops.append(dist.P2POp(dist.irecv, rows[j], peer, ctx.group))
            return dist.batch_isend_irecv(ops)

        works = _issue(ctx, "all_gather", what, p2p, peers)
    return Handle(
        ctx, "all_gather", what, works, out.numel(), out.element_size(), time.perf_counter() - t0, peers=peers
    )


def reduce_scatter(ctx: CommContext, out: torch.Tensor, inp: torch.Tensor, *, what: str) -> Handle:
    """Sum ``inp`` (world_size * S, rank-major) over ranks; this rank receives its row in ``out``."""
    n, s = ctx.world_size, out.numel()
    if inp.numel() != n * s:
        raise AssertionError(
            f"rank {ctx.rank}: reduce_scatter of {what}: inp has {inp.numel()} elements, expected {n}x{s}"
        )
    t0 = time.perf_counter()
    rows = inp.view(n, s)
    if not ctx.distributed:
        if out.data_ptr() != rows[0].data_ptr():
            out.copy_(rows[0])
        return _done_handle(ctx, "reduce_scatter", what, inp.numel(), inp.element_size())
    if ctx.impl == "native":
        works = _issue(ctx, "reduce_scatter", what, lambda: [_native_reduce_scatter(out, inp, ctx.group)])
        return Handle(ctx, "reduce_scatter", what, works, inp.numel(), inp.element_size(), time.perf_counter() - t0)

    recv = ctx.pool.get((n - 1) * s, inp.dtype, inp.device).view(n - 1, s)
    peers = [j for j in range(n) if j != ctx.rank]

    def p2p() -> list[dist.Work]:
        ops = []
        for k, j in enumerate(peers):
            peer = ctx.global_ranks[j]
            ops.append(dist.P2POp(dist.isend, rows[j], peer, ctx.group))
            ops.append(dist.P2POp(dist.irecv, recv[k], peer, ctx.group))
        return dist.batch_isend_irecv(ops)

    def finish() -> None:
        # Sum in rank order so the result does not depend on which rank computes it.
        parts = [rows[j] if j == ctx.rank else recv[j if j < ctx.rank else j - 1] for j in range(n)]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
        ctx.pool.put(recv)

    works = _issue(ctx, "reduce_scatter", what, p2p, peers)
    peer_list = [j for j in peers for _ in range(2)]  # a send and a receive each
    return Handle(
        ctx, "reduce_scatter", what, works, inp.numel(), inp.element_size(), time.perf_counter() - t0, finish, peer_list
    )


def all_to_all(ctx: CommContext, out: torch.Tensor, inp: torch.Tensor, *, what: str) -> Handle:
    """Exchange equal rows: row ``j`` of ``inp`` (world_size * S, rank-major) goes to rank ``j``,
    which receives it as row ``rank`` of its ``out``. Used by top-k compression, whose rows are
    (index, value) pairs for each destination's shard."""
    n = ctx.world_size
    if out.numel() != inp.numel() or inp.numel() % n:
        raise AssertionError(
            f"rank {ctx.rank}: all_to_all of {what}: inp has {inp.numel()} and out {out.numel()} elements; "
            f"both must be {n} equal rows"
        )
    rows = [inp.numel() // n] * n
    return all_to_all_v(ctx, out, inp, rows, rows, what=what)


def all_to_all_v(
    ctx: CommContext, out: torch.Tensor, inp: torch.Tensor, send: Sequence[int], recv: Sequence[int], *, what: str
) -> Handle:
    """Exchange uneven chunks: ``inp`` holds, side by side in rank order, ``send[j]`` elements
    for rank ``j``; ``out`` receives ``recv[j]`` elements from rank ``j`` in the same way. Every
    rank's ``send[j]`` must equal rank ``j``'s ``recv[rank]`` (the MoE expert owners derive both
    from the same agreed selections). Empty chunks are not sent."""
    n, me = ctx.world_size, ctx.rank
    if len(send) != n or len(recv) != n or sum(send) != inp.numel() or sum(recv) != out.numel():
        raise AssertionError(
            f"rank {ctx.rank}: all_to_all_v of {what}: sizes {list(send)} -> {list(recv)} do not match "
            f"{n} ranks, inp of {inp.numel()} and out of {out.numel()} elements"
        )
    t0 = time.perf_counter()
    s_off = [sum(send[:j]) for j in range(n)]
    r_off = [sum(recv[:j]) for j in range(n)]
    if send[me] != recv[me]:
        raise AssertionError(f"rank {me}: all_to_all_v of {what}: sends itself {send[me]} elements, expects {recv[me]}")
    out[r_off[me] : r_off[me] + recv[me]].copy_(inp[s_off[me] : s_off[me] + send[me]])
    if not ctx.distributed:
        return _done_handle(ctx, "all_to_all", what, inp.numel(), inp.element_size())
    if ctx.impl == "native":

        def native() -> list[dist.Work]:
            return [dist.all_to_all_single(out, inp, list(recv), list(send), group=ctx.group, async_op=True)]

        works = _issue(ctx, "all_to_all", what, native)
        return Handle(ctx, "all_to_all", what, works, inp.numel(), inp.element_size(), time.perf_counter() - t0)
    ops_peers: list[int] = []

    def p2p() -> list[dist.Work]:
        ops = []
        for j in range(n):
            if j == me:
                continue
            peer = ctx.global_ranks[j]
            if send[j]:
                ops.append(dist.P2POp(dist.isend, inp[s_off[j] : s_off[j] + send[j]], peer, ctx.group))
                ops_peers.append(j)
            if recv[j]:
                ops.append(dist.P2POp(dist.irecv, out[r_off[j] : r_off[j] + recv[j]], peer, ctx.group))
                ops_peers.append(j)
        return dist.batch_isend_irecv(ops) if ops else []

    works = _issue(ctx, "all_to_all", what, p2p, [j for j in range(n) if j != me])
    return Handle(
        ctx, "all_to_all", what, works, inp.numel(), inp.element_size(), time.perf_counter() - t0, peers=ops_peers
    )


def all_reduce(ctx: CommContext, t: torch.Tensor, *, op: str = "sum", what: str) -> Handle:
    """In-place all-reduce of ``t`` with ``op`` in ("sum", "max")."""
    if op not in ("sum", "max"):
        raise AssertionError(
            f"rank {ctx.rank}: all_reduce of {what} with op={op!r}; the engine only uses 'sum' and 'max'"
        )
    if not ctx.distributed:
        return _done_handle(ctx, "all_reduce", what, 2 * t.numel(), t.element_size())
    t0 = time.perf_counter()
    red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    works = _issue(ctx, "all_reduce", what, lambda: [dist.all_reduce(t, op=red, group=ctx.group, async_op=True)])
    return Handle(ctx, "all_reduce", what, works, 2 * t.numel(), t.element_size(), time.perf_counter() - t0)


def all_gather_objects(ctx: CommContext, obj: Any, *, what: str) -> list[Any]:
    """Every rank's ``obj`` (small, JSON-encodable: tuples come back as lists), in rank order.

    Sent as bytes over the group's own tensor collectives, so each rank's wait is bounded by its
    comm_timeout (torch's object collectives obey only the group's timeout) and nothing a peer
    sends is unpickled."""
    if not ctx.distributed:
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj).encode()
    sizes = torch.zeros(ctx.world_size, dtype=torch.int64, device=ctx.device)
    sizes[ctx.rank] = len(data)
    all_gather(ctx, sizes, sizes[ctx.rank : ctx.rank + 1], what=f"{what} (sizes)").wait()
    width = max(int(sizes.max()), 1)
    out = torch.zeros(ctx.world_size * width, dtype=torch.uint8, device=ctx.device)
    rows = out.view(ctx.world_size, width)
    if data:
        rows[ctx.rank, : len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    all_gather(ctx, out, rows[ctx.rank], what=what).wait()
    host = rows.cpu()
    return [json.loads(bytes(host[r, : int(n)].tolist()).decode()) for r, n in enumerate(sizes.tolist())]


BROADCAST_BUCKET_BYTES = 16 << 20  # the most one broadcast_coalesced message (and its copy) holds
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def broadcast_coalesced(
    ctx: CommContext,
    tensors: Sequence[torch.Tensor],
    *,
    src: int = 0,
    what: str,
    bucket_bytes: int = BROADCAST_BUCKET_BYTES,
    keep_equal: bool = False,
    on_bucket: Callable[[], None] | None = None,
) -> None:
    """Copy rank ``src``'s values of ``tensors`` to every rank, in flat messages of one dtype and
    at most ``bucket_bytes`` (a tensor is cut along its first dimension to fit; one row larger
    than a bucket is a message of its own), so the copy it makes is one bucket, never the whole
    set. ``src``'s tensors are only read. With ``keep_equal`` a receiving rank writes only the
    pieces that differ bit for bit from its own, so tensors that already hold ``src``'s values
    (weights every rank mapped from the same file) are never written, and stay file pages.
    ``on_bucket`` is called after each message, while its copy is alive (a memory probe)."""
    if not ctx.distributed or not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t.detach())
    src_global = ctx.global_ranks[src]
    for dtype, ts in by_dtype.items():
        limit = max(1, bucket_bytes // ts[0].element_size())
        scratch = torch.empty(min(limit, sum(t.numel() for t in ts)), dtype=dtype, device=ctx.device)
        bucket: list[torch.Tensor] = []
        size = 0
        for seg in _segments(ts, limit):
            if bucket and size + seg.numel() > limit:
                _broadcast_bucket(ctx, bucket, size, scratch, src, src_global, what, keep_equal)
                if on_bucket is not None:
                    on_bucket()
                bucket, size = [], 0
            bucket.append(seg)
            size += seg.numel()
        _broadcast_bucket(ctx, bucket, size, scratch, src, src_global, what, keep_equal)
        if on_bucket is not None:
            on_bucket()


def _segments(ts: Sequence[torch.Tensor], limit: int) -> Iterator[torch.Tensor]:
    """The tensors, each cut along its first dimension into views of at most ``limit`` elements
    (a single larger row stays whole)."""
    for t in ts:
        if t.dim() == 0 or t.numel() <= limit:
            yield t
            continue
        per = max(1, limit // (t.numel() // t.shape[0]))
        for i in range(0, t.shape[0], per):
            yield t[i : i + per]


def _broadcast_bucket(
    ctx: CommContext,
    segs: Sequence[torch.Tensor],
    numel: int,
    scratch: torch.Tensor,
    src: int,
    src_global: int,
    what: str,
    keep_equal: bool,
) -> None:
    flat = scratch[:numel] if numel <= scratch.numel() else torch.empty(numel, dtype=scratch.dtype, device=ctx.device)
    sending = ctx.rank == src
    with torch.no_grad():
        if sending:
            offset = 0
            for seg in segs:
                flat[offset : offset + seg.numel()].view(seg.shape).copy_(seg)
                offset += seg.numel()
        t0 = time.perf_counter()

        def start(flat: torch.Tensor = flat) -> list[dist.Work]:
            return [dist.broadcast(flat, src_global, group=ctx.group, async_op=True)]

        work = _issue(ctx, "broadcast", what, start)
        Handle(ctx, "broadcast", what, work, flat.numel(), flat.element_size(), time.perf_counter() - t0).wait()
        if sending:
            return
        offset = 0
        for seg in segs:
            got = flat[offset : offset + seg.numel()].view(seg.shape)
            offset += seg.numel()
            if not (keep_equal and _same_bits(got, seg)):
                seg.copy_(got)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaN payloads and signed zeros included)."""
    if a.device != b.device:
        return False
    as_int = _SAME_SIZE_INT.get(a.element_size())
    if as_int is None or a.dtype == torch.bool:
        return bool(torch.equal(a, b))
    return bool(torch.equal(a.view(as_int), b.view(as_int)))


def agree_on_failure(ctx: CommContext, error: BaseException | None, *, what: str, call: str) -> None:
    """Every rank learns whether any rank failed at ``what`` (one small all-reduce; the messages
    only then): a rank's local failure raises on every rank, naming the rank, instead of leaving
    the others in the next collective until the timeout. Collective."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=ctx.device)
    all_reduce(ctx, flag, op="max", what=f"{what} agreement").wait()
    if int(flag.item()):
        text = None if error is None else f"{type(error).__name__}: {error}"
        texts = all_gather_objects(ctx, text, what=f"{what} agreement")
        if error is not None:
            raise error
        rank, first = next((r, t) for r, t in enumerate(texts) if t is not None)
        raise RuntimeError(f"{call}: rank {rank} failed ({what}): {first}")
