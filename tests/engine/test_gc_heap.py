"""`engine.freeze_gc_heap` (a CUDA engine's start-up): what is garbage is collected, what is alive is frozen out of
the cycle collector's reach, and cycles frozen by an earlier start-up that died since are collected by the next."""

from __future__ import annotations

import gc
import weakref

import pytest

from hybridcache.engine.engine import freeze_gc_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


@pytest.fixture(autouse=True)
def _unfrozen():
    yield
    gc.unfreeze()  # leave the process as the other tests expect it


def test_garbage_is_collected_and_the_live_heap_frozen() -> None:
    dead, alive = _Node(), _Node()
    dead_ref = weakref.ref(dead)
    del dead
    freeze_gc_heap()
    assert dead_ref() is None
    assert gc.get_freeze_count() > 0
    assert not any(obj is alive for obj in gc.get_objects())  # frozen: out of every generation


def test_a_cycle_that_died_while_frozen_is_collected_at_the_next_start_up() -> None:
    node = _Node()
    ref = weakref.ref(node)
    freeze_gc_heap()
    del node
    gc.collect()
    assert ref() is not None  # frozen: the collector does not see it
    freeze_gc_heap()
    assert ref() is None
