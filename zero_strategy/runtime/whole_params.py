"""Optimizers that need a parameter's whole shape (Muon, Shampoo-like): each matrix owned by one rank.

ZeRO hands each rank 1-D pieces of every parameter, which is exact for an element-wise update
(Adam, SGD) and wrong for an update that reads the whole matrix: Muon orthogonalises each
weight matrix's momentum (Newton-Schulz), Shampoo preconditions it from both sides. For such
an optimizer the engine runs the usual distributed-Muon scheme:

- **ownership**: each such parameter is owned by one rank of the shard group, chosen at bind
  time by balancing the cost ``m * n * min(m, n)`` (a Newton-Schulz iteration's work on an
  ``m x n`` matrix; a tensor of more dimensions counts as ``shape[0] x rest``) over the ranks,
  largest first onto the least loaded rank. The same rule runs on every rank, so every rank
  knows every owner without communication;
- **the optimizer's parameter** for an owned matrix is a *whole* tensor of the parameter's
  shape on its owner (the "proxy"), and an empty tensor on the other ranks, which never get a
  gradient there and so never step it. The optimizer's state (Muon's momentum) exists on the
  owner only: per rank about 1/N of DDP's;
- **each step** (after the gradients were reduced into shards, finished and clipped as for any
  optimizer): one ``all_to_all_v`` sends every rank's piece of each matrix's averaged gradient
  and of its master values to the owner, which assembles the whole matrix; the optimizer
  steps (the owner's whole matrices; the other parameters as usual on pieces); a second
  ``all_to_all_v`` sends each rank its piece of the updated values, copied into its master
  piece. The engine's usual work follows (ZeRO-1/2: all-gather the full parameters from the
  masters; ZeRO-3: the masters are views of the unit rows). No rank holds more than its own
  matrices' gradients, and a step exchanges each owned matrix twice (there and back),
  gradient and values: ``3 * numel`` elements against AdamW's nothing extra;
- **accumulation**: the exchange runs inside ``optimizer.step()`` only, on the accumulated,
  averaged gradient, so the momentum advances once per optimizer step, whatever the number of
  micro-batches (where DeepSpeed's ZeRO-3 Muon ran once per micro-batch).

The protocol (``whole_groups``): an optimizer needs whole parameters when

- it is a ``torch.optim.Muon`` (or subclass): every group;
- its class (or instance) has ``zero_whole_params = True``: every group; or
  ``zero_whole_params = "flag"``: the param groups whose dict has a true ``"flag"`` (one
  optimizer with Muon groups and AdamW groups, like ``MuonWithAuxAdam``). The decorator
  :func:`whole_params` sets it. ``zero_whole_params = False`` opts a subclass out.

**Optimizer offload** (``offload_optimizer: {device: cpu}``): the owner's proxy and its
optimizer state live in host memory between steps, beside the host masters. The step itself,
the orthogonalisation included, runs on the compute device: the exchange assembles each whole
matrix's gradient and values on the device already (the all-to-all's output), the owner's
state tensors are copied up for the step, and after it the state and the values are copied
back to the proxy's host tensors. Newton-Schulz is a few matrix products of ``m * n * min(m, n)``
work each, milliseconds on an accelerator and seconds on the host's cores for a large matrix,
while the bytes that move are the state up and down and the values down (``4 * numel`` each in
fp32), against the gradient and values down and the values up for a host step. DeepSpeed does
the same: its ZeRO Muon update runs on the accelerator's gradients, with the momentum read from
and written back to the (offloaded) optimizer partitions. During the step the device holds the
owner's matrices (values, gradient, state) of the optimizer being stepped; between steps none of
it. On a CPU-only machine the compute device is the host and nothing moves.

Refused at ``initialize``: an optimizer that re-runs a closure (L-BFGS: its backward would run
after the reduction, ``optimizer.py``) and optimizer state on disk (``offload_optimizer:
{device: nvme}``: the disk tier plans its swap files over the master pieces, which the
owners' whole matrices are not; ``api.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from zero_strategy.comm import collectives as C
from zero_strategy.runtime.optimizer_set import key

__all__ = ["WHOLE_PARAMS_ATTR", "WholeParams", "assign_owners", "matrix_cost", "whole_groups", "whole_params"]

WHOLE_PARAMS_ATTR = "zero_whole_params"
_T = TypeVar("_T", bound=type)


def whole_params(cls: _T | None = None, *, group_flag: str | None = None) -> Any:
    """Class decorator: declare that an optimizer's update reads each parameter whole (its
    shape, its other elements), so that ``zero_strategy.initialize`` gives each parameter to
    one owner rank that steps it whole. ``@whole_params``: every param group;
    ``@whole_params(group_flag="use_muon")``: the groups whose dict has ``use_muon=True``."""

    def mark(c: _T) -> _T:
        if not (isinstance(c, type) and issubclass(c, torch.optim.Optimizer)):
            raise TypeError(f"whole_params: decorate a torch.optim.Optimizer subclass, not {c!r}")
        setattr(c, WHOLE_PARAMS_ATTR, True if group_flag is None else group_flag)
        return c

    return mark if cls is None else mark(cls)


def declared(optimizer: torch.optim.Optimizer | type) -> bool | str | None:
    """What ``optimizer`` (an instance or a class) declares: True (every group), a group flag's
    name, False (opted out) or None (nothing: the element-wise default)."""
    value = getattr(optimizer, WHOLE_PARAMS_ATTR, None)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if value is None and issubclass(cls, torch.optim.Muon):
        return True
    if value is not None and not isinstance(value, (bool, str)):
        raise TypeError(
            f"{cls.__name__}.{WHOLE_PARAMS_ATTR} = {value!r}: use True (every param group), the name of a "
            "boolean param-group key (the groups that need whole parameters), or False"
        )
    return value


def whole_groups(optimizer: torch.optim.Optimizer) -> list[bool]:
    """For each of ``optimizer``'s param groups, whether its parameters are stepped whole."""
    value = declared(optimizer)
    if isinstance(value, str):
        return [bool(group.get(value, False)) for group in optimizer.param_groups]
    return [bool(value)] * len(optimizer.param_groups)


def matrix_cost(shape: Sequence[int]) -> int:
    """The work of orthogonalising a parameter of ``shape``: ``m * n * min(m, n)`` for its
    matrix view (``shape[0] x rest``); a vector costs its length."""
    if len(shape) < 2:
        return max(1, int(shape[0]) if shape else 1)
    m = int(shape[0])
    n = 1
    for d in shape[1:]:
        n *= int(d)
    return max(1, m * n * min(m, n))


def assign_owners(costs: Sequence[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """The owner rank of each item: largest cost first onto the least loaded rank (ties: the
    lower rank; equal costs keep their order). ``loads`` (per rank, updated in place) carries the
    load of earlier assignments, so several optimizers are balanced together. Deterministic:
    every rank computes the same owners."""
    loads = [0] * world_size if loads is None else loads
    owners = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owners[k] = r
        loads[r] += costs[k]
    return owners


@dataclass
class _Entry:
    """One parameter stepped whole: where its pieces are and who owns it."""

    param: torch.Tensor  # the model parameter
    group: Any  # its ShardGroup (layout.local_range gives every rank's piece)
    index: int  # its index in the group
    owner: int  # rank in the shard group
    proxy: torch.Tensor  # what the optimizer steps: whole on the owner, empty elsewhere
    opt_key: int  # optimizer_set.key of the optimizer it belongs to
    name: str

    @property
    def master(self) -> torch.Tensor:
        """This rank's 1-D master piece (looked up each time: a group may replace its masters)."""
        return self.group.masters[self.index]

    def piece(self, rank: int) -> tuple[int, int]:
        return self.group.layout.local_range(self.index, rank)


@dataclass
class _Lifted:
    """An owner's proxy held in host memory (``offload_optimizer``), moved to the compute device
    for one step: its host tensors, to take the updated values and state back."""

    proxy: torch.Tensor
    values: torch.Tensor  # the proxy's host tensor
    state: dict[str, Any]  # the optimizer's state of the proxy (the same dict)
    host_state: dict[str, torch.Tensor]  # the host tensors of the state values moved up

    def lift(self, device: torch.device) -> None:
        """The proxy and its state's tensors (not scalars: a step count stays where the
        optimizer keeps it) onto ``device``; the values are written by the exchange."""
        self.proxy.data = torch.empty(self.values.shape, dtype=self.values.dtype, device=device)
        for k, v in self.state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != device:
                self.host_state[k] = v
                self.state[k] = v.to(device, non_blocking=v.is_pinned())

    def lower(self, copy: bool) -> None:
        """Back to the host tensors, with the updated values and state when ``copy`` (after a
        step; a failed one leaves the host tensors as they were). State the step created on the
        device (a first step's momentum) moves to new host tensors."""
        if copy:
            self.values.copy_(self.proxy.data)
        self.proxy.data = self.values
        for k, v in list(self.state.items()):
            if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.device != self.values.device):
                continue
            host = self.host_state.get(k)
            if host is None or host.shape != v.shape or host.dtype != v.dtype:  # nothing to fall back to
                host = torch.empty(
                    v.shape, dtype=v.dtype, device=self.values.device, pin_memory=self.values.is_pinned()
                )
                host.copy_(v)
            elif copy:  # after a failed step the others keep their values
                host.copy_(v)
            self.state[k] = host
        self.host_state.clear()


class WholeParams:
    """The whole-stepped parameters of one engine: their owners, proxies and exchanges."""

    def __init__(self, ctx: C.CommContext, locate: Any, names: dict[int, str]) -> None:
        self.ctx = ctx
        self._locate = locate  # reducer.locate: parameter -> (group, index)
        self._names = names
        self.entries: list[_Entry] = []
        self._loads = [0] * ctx.world_size
        self._pending: dict[int, list[_Entry]] = {}  # gathered for a step in progress, by optimizer key
        self._lifted: dict[int, list[_Lifted]] = {}  # host proxies on the device for that step, by optimizer key

    def bind(self, opt_key: int, params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Owners for ``params`` (one optimizer's whole-stepped parameters, in its order) and the
        proxy the optimizer steps for each one."""
        owners = assign_owners([matrix_cost(p.shape) for p in params], self.ctx.world_size, self._loads)
        proxies = []
        for p, m, owner in zip(params, masters, owners):
            group, index = self._locate(p)
            if owner == self.ctx.rank:  # beside its master (host memory under offload_optimizer)
                proxy = torch.zeros(p.shape, dtype=m.dtype, device=m.device, pin_memory=m.is_pinned())
            else:
                proxy = torch.empty((0, *p.shape[1:]), dtype=m.dtype, device=m.device)
            name = self._names.get(id(p), str(tuple(p.shape)))
            self.entries.append(_Entry(p, group, index, owner, proxy, opt_key, name))
            proxies.append(proxy)
        return proxies

    def keep(self, opt_keys: set[int]) -> None:
        """Forget the entries of optimizers no longer bound (``replace_optimizer``)."""
        self.entries = [e for e in self.entries if e.opt_key in opt_keys]
        self._loads = [0] * self.ctx.world_size
        for e in self.entries:
            self._loads[e.owner] += matrix_cost(e.param.shape)
        self.forget()

    def proxy_params(self) -> dict[int, int]:
        """Proxy id -> model parameter id (the optimizer's scope counts proxies as masters)."""
        return {id(e.proxy): id(e.param) for e in self.entries}

    def owned(self, opt_key: int | None = None) -> list[_Entry]:
        """This rank's entries (of one optimizer)."""
        me = self.ctx.rank
        return [e for e in self.entries if e.owner == me and (opt_key is None or e.opt_key == opt_key)]

    def _exchange(self, entries: list[_Entry], to_owner: bool, what: str) -> torch.Tensor | None:
        """One ``all_to_all_v``: to the owners (each rank's gradient and value pieces) or back
        (each rank's piece of the updated values). Returns what this rank received."""
        n, me = self.ctx.world_size, self.ctx.rank
        per = 2 if to_owner else 1  # gradient and value there, value back

        def size(e: _Entry, r: int) -> int:
            lo, hi = e.piece(r)
            return per * (hi - lo)

        if to_owner:
            send = [sum(size(e, me) for e in entries if e.owner == j) for j in range(n)]
            recv = [sum(size(e, j) for e in entries if e.owner == me) for j in range(n)]
        else:
            send = [sum(size(e, j) for e in entries if e.owner == me) for j in range(n)]
            recv = [sum(size(e, me) for e in entries if e.owner == j) for j in range(n)]
        if not entries:
            return None
        dtype = entries[0].master.dtype
        inp = torch.empty(sum(send), dtype=dtype, device=self.ctx.device)
        off = 0
        for j in range(n):
            for e in entries:
                if to_owner and e.owner == j:
                    k = e.master.numel()
                    if e.master.grad is None:
                        raise RuntimeError(f"rank {me}: {what}: '{e.name}' has no gradient piece here")
                    inp[off : off + k].copy_(e.master.grad.reshape(-1))
                    inp[off + k : off + 2 * k].copy_(e.master.reshape(-1))
                    off += 2 * k
                elif not to_owner and e.owner == me:
                    lo, hi = e.piece(j)
                    inp[off : off + hi - lo].copy_(e.proxy.detach().reshape(-1)[lo:hi])
                    off += hi - lo
        out = torch.empty(sum(recv), dtype=dtype, device=self.ctx.device)
        C.all_to_all_v(self.ctx, out, inp, send, recv, what=what).wait()
        return out

    def gather(self, optimizer: torch.optim.Optimizer, label: str) -> None:
        """Before ``optimizer`` steps: each owner assembles the whole averaged gradient (the
        proxy's ``.grad``) and master values (the proxy) of its matrices, on the compute device
        (a proxy in host memory and its state are moved there for the step: module docstring).
        Parameters without a gradient on any rank are left out (their proxy has no gradient: the
        optimizer skips them, as under DDP). Collective over the shard group."""
        opt_key = key(optimizer)
        entries = [e for e in self.entries if e.opt_key == opt_key and e.master.grad is not None]
        for e in self.entries:
            if e.opt_key == opt_key:
                e.proxy.grad = None
        if not entries:
            return
        for e in entries:
            if e.master.numel() != e.piece(self.ctx.rank)[1] - e.piece(self.ctx.rank)[0]:
                raise RuntimeError(
                    f"rank {self.ctx.rank}: whole-parameter step of '{e.name}': its master piece has "
                    f"{e.master.numel()} elements, its layout says {e.piece(self.ctx.rank)}"
                )
        out = self._exchange(entries, True, f"whole parameters to their owners ({label})")
        self._pending[opt_key] = entries
        if out is None:
            return
        me, off = self.ctx.rank, 0
        mine = [e for e in entries if e.owner == me]
        lifted = [_Lifted(e.proxy, e.proxy.data, optimizer.state[e.proxy], {}) for e in mine
                  if e.proxy.device != out.device]  # fmt: skip
        self._lifted[opt_key] = lifted
        for x in lifted:
            x.lift(out.device)
        grads = {id(e.proxy): torch.empty(e.param.numel(), dtype=e.proxy.dtype, device=e.proxy.device) for e in mine}
        for j in range(self.ctx.world_size):
            for e in mine:
                lo, hi = e.piece(j)
                k = hi - lo
                grads[id(e.proxy)][lo:hi].copy_(out[off : off + k])
                e.proxy.detach().view(-1)[lo:hi].copy_(out[off + k : off + 2 * k])
                off += 2 * k
        for e in mine:
            e.proxy.grad = grads[id(e.proxy)].view(e.proxy.shape)

    def scatter(self, optimizer: torch.optim.Optimizer, label: str) -> None:
        """After the step: every rank's master piece takes its piece of the owner's updated
        values; the proxies' gradients are dropped, and proxies lifted to the device for the step
        go back to host memory with their state. Collective over the shard group."""
        opt_key = key(optimizer)
        entries = self._pending.pop(opt_key, [])
        if not entries:
            return
        out = self._exchange(entries, False, f"whole parameters from their owners ({label})")
        for e in entries:
            e.proxy.grad = None
        for x in self._lifted.pop(opt_key, []):
            x.lower(copy=True)
        if out is None:
            return
        off = 0
        with torch.no_grad():
            for j in range(self.ctx.world_size):  # each owner's matrices, in entry order
                for e in entries:
                    if e.owner != j:
                        continue
                    k = e.master.numel()
                    e.master.view(-1).copy_(out[off : off + k])
                    off += k

    def forget(self) -> None:
        """A step that raised: no exchange is pending and no proxy keeps a gradient."""
        for entries in self._pending.values():
            for e in entries:
                e.proxy.grad = None
        self._pending.clear()
        for lifted in self._lifted.values():
            for x in lifted:
                x.lower(copy=False)
        self._lifted.clear()
