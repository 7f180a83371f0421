"""`serve --data-parallel-size N`'s replica environments: one GPU each, or an equal share of the CPU cores each."""

import os

import pytest

from hybridcache.router.cli import replica_env


def test_gpu_replicas_each_see_one_device_of_the_visible_ones():
    base = {"CUDA_VISIBLE_DEVICES": "4,6,7", "PATH": "/bin"}
    assert [replica_env(base, i, 3, on_cpu=False)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["4", "6", "7"]
    assert replica_env({}, 1, 2, on_cpu=False)["CUDA_VISIBLE_DEVICES"] == "1"
    assert replica_env(base, 0, 3, on_cpu=False)["PATH"] == "/bin" and "OMP_NUM_THREADS" not in replica_env(
        base, 0, 3, on_cpu=False)
    with pytest.raises(ValueError, match="--data-parallel-size 3 x --tensor-parallel-size 1 needs 3 devices; "
                                         "CUDA_VISIBLE_DEVICES lists 2"):
        replica_env({"CUDA_VISIBLE_DEVICES": "0,1"}, 0, 3, on_cpu=False)


def test_gpu_replicas_of_several_ranks_each_see_their_ranks_devices():
    """--data-parallel-size 2 -tp 2 gave each replica one device while its engine asked for two (it could not
    start: 'needs devices up to cuda:1; this machine has 1'); as vLLM's DP engines, each owns TP GPUs."""
    base = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [replica_env(base, i, 2, False, tensor_parallel_size=2)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == [
        "4,5", "6,7"]
    assert replica_env({}, 1, 2, False, tensor_parallel_size=2)["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ValueError, match="--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 devices"):
        replica_env({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 0, 2, False, tensor_parallel_size=2)


def test_cpu_replicas_share_the_cores_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [replica_env({}, i, 2, on_cpu=True)["OMP_NUM_THREADS"] for i in range(2)] == ["4", "4"]
    assert replica_env({}, 0, 3, on_cpu=True)["OMP_NUM_THREADS"] == "2"
    assert replica_env({}, 0, 16, on_cpu=True)["OMP_NUM_THREADS"] == "1"
    assert replica_env({"OMP_NUM_THREADS": "3"}, 0, 2, on_cpu=True)["OMP_NUM_THREADS"] == "3"
    # CUDA_VISIBLE_DEVICES means nothing to a CPU replica: neither set nor checked
    assert replica_env({"CUDA_VISIBLE_DEVICES": "0"}, 1, 2, on_cpu=True)["CUDA_VISIBLE_DEVICES"] == "0"


def test_each_replica_is_told_its_index_for_its_log_lines():
    """Replicas' log lines could not be told apart: each gets its index in $HYBRIDCACHE_REPLICA_INDEX."""
    assert [replica_env({}, i, 2, on_cpu=False)["HYBRIDCACHE_REPLICA_INDEX"] for i in range(2)] == ["0", "1"]
    assert [replica_env({}, i, 3, on_cpu=True)["HYBRIDCACHE_REPLICA_INDEX"] for i in range(3)] == ["0", "1", "2"]
