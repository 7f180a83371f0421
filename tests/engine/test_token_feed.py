"""`TokenFeed`: the rows of a step that take the step before's sampled tokens, written on the device."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.token_feed import TokenFeed


def test_each_row_takes_its_source_token_and_nothing_else_changes():
    input_ids = torch.tensor([5, 6, -1, 7, -1, -1])
    sampled = torch.tensor([40, 41, 42, 43])
    TokenFeed(rows=(2, 4, 5), sources=(3, 0, 2), tokens=sampled).write(input_ids)
    assert input_ids.tolist() == [5, 6, 43, 7, 40, 42]


def test_an_empty_feed_writes_nothing_and_a_row_without_a_source_is_refused():
    input_ids = torch.tensor([1, 2])
    TokenFeed((), (), torch.tensor([9])).write(input_ids)
    assert input_ids.tolist() == [1, 2]
    with pytest.raises(ValueError, match="one source per row: 2 rows, 1 sources"):
        TokenFeed((0, 1), (0,), torch.tensor([9]))
