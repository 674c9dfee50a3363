"""ZeRO-3 gather tags travel in the unit's compute dtype: every tag a model can have must read
back exactly in bf16 and fp16 (which count integers exactly only to 256 and 2048)."""

from __future__ import annotations

import pytest
import torch

from zero_strategy.sharding.gather_checks import MAX_TAG, TAG, check_unit_count, read_tags, write_tag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_tag_reads_back_exactly_in_each_dtype(dtype: torch.dtype) -> None:
    tags = list(range(1, 5000)) + [MAX_TAG - 1, MAX_TAG]
    rows = torch.empty(len(tags), TAG, dtype=dtype)
    for i, t in enumerate(tags):
        write_tag(rows[i], 0, t)
    got = read_tags(rows)
    assert got.dtype == torch.int64
    assert got.tolist() == tags
    # the old read (digits summed in the dtype itself) lost tags in 16-bit: this check can fail
    naive = (rows[:, 0].float() + 256 * rows[:, 1]).to(dtype).round().long().tolist()
    assert (naive == tags) == (dtype == torch.float32)


def test_more_units_than_a_tag_names_is_refused_with_the_fix() -> None:
    check_unit_count(MAX_TAG)
    with pytest.raises(ValueError, match="more than the 65535.*zero_auto_partition"):
        check_unit_count(MAX_TAG + 1)
