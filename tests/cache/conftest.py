from __future__ import annotations

import random

import pytest

from hybridcache.cache import CacheConfig, PrefixCache
from tests.cache.checked_evictor import check_picks
from tests.cache.fake_engine import Driver


def make_driver(**overrides) -> Driver:
    params = dict(block_size=16, num_blocks=256, num_slots=32, max_checkpoints_per_anchor=4)
    params.update(overrides)
    cache = check_picks(PrefixCache(CacheConfig(**params)))  # every eviction victim is checked against a full scan
    return Driver(cache)


def tokens(n: int, seed: int = 0, vocab: int = 1000) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(vocab) for _ in range(n))


@pytest.fixture
def driver() -> Driver:
    return make_driver()
