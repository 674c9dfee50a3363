"""The communication counters per link class (``zero_strategy/comm/counters.py``): a context's
link from its ranks and the node size, and bytes counted per (link, kind) beside the per-kind
totals that ``comm_stats`` has always given."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import zero_strategy as zs
from zero_strategy.comm import collectives as C
from zero_strategy.comm import counters


@pytest.mark.parametrize(
    ("ranks", "per_node", "want"),
    [
        ((0, 1), 2, "intra"),  # a shard group of 2 inside a 2-rank node
        ((2, 3), 2, "intra"),
        ((1, 2), 2, "inter"),  # contiguous but straddling two nodes
        ((0, 2), 2, "inter"),  # a replica group: the same index in every node
        ((0, 1, 2, 3), 2, "inter"),  # flat over two nodes
        ((0, 1, 2, 3), 4, "intra"),  # flat inside one node
        ((0, 8, 16), 8, "inter"),
        ((5,), 2, "intra"),  # one rank moves nothing across a link
    ],
)
def test_link_of_ranks_and_node_size(ranks: tuple[int, ...], per_node: int, want: str) -> None:
    assert counters.link_of(ranks, per_node) == want


def test_node_size_reads_our_variable_then_the_launchers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(counters.NODE_SIZE_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert counters.node_size() is None and counters.link_of((0, 7)) == "intra"  # unknown: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert counters.node_size() == 4 and counters.link_of((0, 4)) == "inter"
    monkeypatch.setenv(counters.NODE_SIZE_ENV, "8")  # an emulated layout overrides the launcher's
    assert counters.node_size() == 8 and counters.link_of((0, 4)) == "intra"
    monkeypatch.setenv(counters.NODE_SIZE_ENV, "two")
    with pytest.raises(ValueError, match="ZERO_STRATEGY_NODE_SIZE='two'"):
        counters.node_size()


def _ctx(link: str) -> C.CommContext:
    return C.CommContext(None, 0, 1, timedelta(seconds=5), "native", torch.device("cpu"), link=link)


def test_bytes_are_counted_per_link_and_kind_beside_the_kind_totals() -> None:
    zs.reset_comm_stats()
    intra, inter = _ctx("intra"), _ctx("inter")
    a = torch.zeros(6)  # fp32: 4 bytes an element
    C.all_gather(intra, a, a, what="test").wait()  # 6 elements
    C.all_gather(inter, a, a, what="test").wait()
    C.all_reduce(inter, torch.zeros(5, dtype=torch.float16), what="test").wait()  # 2 x 5 elements, 2 bytes
    C.reduce_scatter(intra, torch.zeros(3), torch.zeros(3), what="test").wait()
    C.mark_step()
    by_link = zs.comm_stats_by_link()
    assert set(by_link) == {"intra", "inter"}
    assert {k: (v["calls"], v["elements"], v["bytes"]) for k, v in by_link["intra"].items()} == {
        "all_gather": (1, 6, 24), "reduce_scatter": (1, 3, 12)}  # fmt: skip
    assert {k: (v["calls"], v["elements"], v["bytes"]) for k, v in by_link["inter"].items()} == {
        "all_gather": (1, 6, 24), "all_reduce": (1, 10, 20)}  # fmt: skip
    totals = zs.comm_stats()
    assert (totals["all_gather"]["calls"], totals["all_gather"]["bytes"]) == (2, 48)  # unchanged meaning
    report = zs.comm_report()
    assert report["steps"] == 1
    assert (report["bytes_intra"], report["bytes_inter"], report["bytes"]) == (36, 44, 80)
    zs.reset_comm_stats()
    assert zs.comm_stats_by_link() == {"intra": {}, "inter": {}} and zs.comm_stats() == {}


def test_a_context_made_without_a_process_group_is_intra() -> None:
    assert C.make_context(None, None).link == "intra"
    assert C.solo_context(_ctx("inter")).link == "intra"
