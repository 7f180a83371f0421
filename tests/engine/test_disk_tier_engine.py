"""The disk tier in the engine (`disk_cache_dir`): behind a host tier of 12 blocks and a device pool of 30, most of
what the cache-equivalence workload saves falls out to disk. A restarted engine on the same model and directory
hits what the first one wrote (more hit tokens than the first run of the same workload, which started empty),
with the tokens and logits of an uncached run; another model finds none of it; corrupt state files are skipped
and never served (the outputs stay those of the uncached run; slow: `test_disk_tier_files.py` checks the files
themselves in the default suite)."""

from __future__ import annotations

import shutil

import pytest

from hybridcache.cache.host_tier import HostTier
from hybridcache.config import EngineConfig
from hybridcache.engine import disk_keeper
from hybridcache.engine.disk_tier import DiskTier
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams

from .model_folders import write_tiny_model
from .test_cache_equivalence import REL_TOL, assert_same, make_engine, run_workload

HOST_BLOCKS = 12
REPLY_LENS = (3, 10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.fixture(scope="module")
def uncached(model_dir):
    engine = make_engine(model_dir, caching=False)
    return engine, run_workload(engine, seed=1, reply_lens=REPLY_LENS)


def disk_engine(model_dir, disk_dir, block_bytes: int, **options) -> LLMEngine:
    return make_engine(model_dir, num_blocks=30, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256,
                       host_cache_gib=HOST_BLOCKS * block_bytes / (1 << 30), disk_cache_dir=str(disk_dir), **options)


@pytest.fixture(scope="module")
def written(model_dir, uncached, tmp_path_factory):
    """A disk directory a first engine filled running the workload (closed: its writes are done), and the hit
    tokens of that run."""
    disk_dir = tmp_path_factory.mktemp("disk")
    engine = disk_engine(model_dir, disk_dir, uncached[0].memory_plan.block_bytes)
    assert engine.num_host_blocks == HOST_BLOCKS
    out = run_workload(engine, seed=1, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    engine.check_integrity()
    stats = engine.stats()
    engine.close()
    disk = stats["disk"]
    assert disk["num_demoted_checkpoints"] > 0 and disk["num_write_errors"] == 0, disk
    return disk_dir, stats["cache"].num_hit_tokens


def test_a_restarted_engine_hits_what_the_first_one_wrote(model_dir, uncached, written, tmp_path):
    disk_dir = tmp_path / "disk"
    shutil.copytree(written[0], disk_dir)
    engine = disk_engine(model_dir, disk_dir, uncached[0].memory_plan.block_bytes)
    assert engine.stats()["disk"]["num_state_files"] > 0
    out = run_workload(engine, seed=1, check_every_step=True, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    stats = engine.stats()
    assert stats["disk"]["num_promoted_checkpoints"] > 0 and stats["cache"].num_host_hits > 0, stats["disk"]
    assert stats["cache"].num_hit_tokens > written[1]  # the first run started with nothing on disk
    engine.close()


def test_another_cache_mode_reads_nothing(model_dir, written, uncached, tmp_path):
    """The baseline modes hit at block boundaries only; on files the hybridcache mode wrote they served its exact-
    step checkpoints (a shared folder inflated a baseline's hits; helper 100's hunt). The mode is in the key."""
    disk_dir = tmp_path / "disk"
    shutil.copytree(written[0], disk_dir)
    (first,) = (p for p in disk_dir.iterdir() if p.is_dir())
    engine = disk_engine(model_dir, disk_dir, uncached[0].memory_plan.block_bytes, cache_mode="block-aligned")
    assert engine.disk.disk.dir != first and engine.stats()["disk"]["num_state_files"] == 0
    engine.close()


def test_another_model_reads_nothing(written, uncached, tmp_path):
    (first,) = (p for p in written[0].iterdir() if p.is_dir())  # the first model's key
    other = write_tiny_model(tmp_path / "other", "qwen3_next", seed=1)  # same shapes, other weights
    engine = disk_engine(other, written[0], uncached[0].memory_plan.block_bytes)
    assert engine.disk.disk.dir.parent == written[0] and engine.disk.disk.dir != first
    assert engine.stats()["disk"]["num_state_files"] == 0
    engine.close()


def test_what_the_host_tier_holds_at_shutdown_is_kept(model_dir, uncached, tmp_path):
    """A host tier large enough that nothing falls out of it: the run writes nothing to disk, the shutdown hands
    the host's checkpoints over, and a restarted engine hits them, with the tokens and logits of the uncached run
    (without the handing over at shutdown the directory stays empty)."""
    block_bytes = uncached[0].memory_plan.block_bytes
    first = make_engine(model_dir, num_blocks=30, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256,
                        host_cache_gib=2000 * block_bytes / (1 << 30), disk_cache_dir=str(tmp_path / "disk"))
    out = run_workload(first, seed=1, reply_lens=REPLY_LENS)
    assert_same(first, uncached[0], out, uncached[1])
    stats = first.stats()
    assert stats["cache"].num_demoted_checkpoints > 0 and stats["cache"].num_host_checkpoints > 0
    assert stats["disk"]["num_state_files"] == 0  # nothing fell out of the host tier during the run
    first.close()
    engine = disk_engine(model_dir, tmp_path / "disk", block_bytes)
    assert engine.stats()["disk"]["num_state_files"] > 0
    out = run_workload(engine, seed=1, check_every_step=True, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    assert engine.stats()["disk"]["num_promoted_checkpoints"] > 0
    engine.close()


def test_what_the_device_pool_holds_at_shutdown_is_kept(model_dir, uncached, tmp_path, monkeypatch):
    """A device pool large enough that nothing is ever demoted: the host tier and the disk stay empty during the
    run, and the shutdown writes the device pool's checkpoints and their chains (the finish checkpoints of the
    requests that finished in the last step too). A restarted engine on the same
    directory hits them (from disk, through the host tier), with the tokens and logits of the uncached run."""
    block_bytes = uncached[0].memory_plan.block_bytes

    def engine_on_disk() -> LLMEngine:
        return make_engine(model_dir, num_blocks=400, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256,
                           host_cache_gib=400 * block_bytes / (1 << 30), disk_cache_dir=str(tmp_path / "disk"))

    first = engine_on_disk()
    out = run_workload(first, seed=1, reply_lens=REPLY_LENS)
    assert_same(first, uncached[0], out, uncached[1])
    first.check_integrity()
    stats = first.stats()
    assert stats["cache"].num_demoted_checkpoints == 0 and stats["cache"].num_host_checkpoints == 0
    assert stats["disk"]["num_state_files"] == 0 and stats["disk"]["num_block_files"] == 0
    held, first_hits = stats["cache"].num_checkpoints, stats["cache"].num_hit_tokens
    monkeypatch.setattr(disk_keeper, "SHUTDOWN_WRITE_BYTES", 1)  # wait for the writer after every checkpoint
    flushes = []
    writer = first.disk.disk
    monkeypatch.setattr(writer, "flush", lambda: (flushes.append(1), type(writer).flush(writer)))
    first.close()
    disk = first.disk.stats()
    # every checkpoint is kept, the finish checkpoints of the last step's requests too (their state copies run
    # at close); a state file per distinct checkpoint
    assert disk["num_not_kept"] == 0 and disk["num_write_errors"] == 0, disk
    assert 0 < disk["num_state_files"] <= held, (disk, held)
    assert len(flushes) > disk["num_state_files"]  # paced: a wait per checkpoint written, and the last one
    assert disk["num_block_files"] > 0

    engine = engine_on_disk()
    assert engine.stats()["disk"]["num_state_files"] == disk["num_state_files"]
    # each conversation's last turn, continued: it hits that turn's finish checkpoint (all but its last token),
    # the last-finishing ones' included, with the tokens and logits of an uncached engine
    last_turns = {rid: o.prompt_token_ids + o.outputs[0].token_ids for rid, o in out.items() if rid.endswith("turn2")}
    nexts = {f"{rid}-next": tokens + [1, 2, 3] for rid, tokens in last_turns.items()}
    continued = run_requests(engine, nexts)
    fresh = make_engine(model_dir, caching=False)
    want = run_requests(fresh, nexts)
    for rid, tokens in last_turns.items():
        got = continued[f"{rid}-next"]
        assert got.outputs[0].token_ids == want[f"{rid}-next"].outputs[0].token_ids, rid
        assert got.num_cached_tokens == len(tokens) - 1, (rid, got.num_cached_tokens, len(tokens))
    assert fresh.logits.keys() == engine.logits.keys()
    for key, logits in fresh.logits.items():
        assert (engine.logits[key] - logits).abs().max() / logits.abs().max() <= REL_TOL, key
    engine.logits = {}
    out = run_workload(engine, seed=1, check_every_step=True, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    stats = engine.stats()
    assert stats["disk"]["num_promoted_checkpoints"] > 0 and stats["cache"].num_host_hits > 0, stats["disk"]
    assert stats["cache"].num_hit_tokens > first_hits  # the first run started with nothing cached
    engine.check_integrity()
    engine.close()


def run_requests(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict:
    """Greedy 3-token completions of `prompts` (request id -> prompt), all queued at once; the finished outputs."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


@pytest.mark.slow
def test_corrupt_state_files_are_skipped_never_served(model_dir, uncached, written, tmp_path, caplog):
    disk_dir = tmp_path / "disk"
    shutil.copytree(written[0], disk_dir)
    for path in disk_dir.glob("*/states/*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    engine = disk_engine(model_dir, disk_dir, uncached[0].memory_plan.block_bytes)
    out = run_workload(engine, seed=1, check_every_step=True, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    disk = engine.stats()["disk"]
    assert disk["num_corrupt"] > 0 and "disk tier skips" in caplog.text, disk
    engine.check_integrity()
    engine.close()


@pytest.mark.parametrize("options, message", [
    (dict(host_cache_gib=0), "without a host tier"),
    (dict(host_cache_gib=1, tensor_parallel_size=2), "with tensor parallelism"),
    (dict(host_cache_gib=1, disk_cache_gib=0), "disk_cache_gib must be"),
])
def test_a_disk_tier_is_refused_where_it_cannot_work(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(disk_cache_dir=str(tmp_path), **options)


def test_resetting_the_prefix_cache_drops_the_disk_tier(model_dir, uncached, written, tmp_path):
    """`LLMEngine.clear_cache` (`LLM.reset_prefix_cache`, `POST /reset_prefix_cache`) drops the disk tier's entries
    and files too, as its docstring promises (benchmarks reset between runs): the same workload then hits exactly
    what the first run, which started with nothing on disk, hit. (The disk tier was left as it was: the next
    identical prompt was a disk hit.)"""
    disk_dir = tmp_path / "disk"
    shutil.copytree(written[0], disk_dir)
    engine = disk_engine(model_dir, disk_dir, uncached[0].memory_plan.block_bytes)
    assert engine.stats()["disk"]["num_state_files"] > 0
    engine.clear_cache()
    disk = engine.stats()["disk"]
    assert (disk["num_state_files"], disk["num_block_files"], disk["num_bytes"]) == (0, 0, 0)
    assert not list(disk_dir.glob("*/*/*.safetensors"))
    out = run_workload(engine, seed=1, reply_lens=REPLY_LENS)
    assert_same(engine, uncached[0], out, uncached[1])
    assert engine.stats()["cache"].num_hit_tokens == written[1]
    engine.close()


def test_a_prompt_whose_deepest_disk_checkpoint_exceeds_the_host_tier_hits_a_shallower_one(model_dir, tmp_path):
    """After a restart, a long prompt's deepest state on disk needs more host blocks than the host tier has (its
    chain and its state at once): the match takes the deepest one that fits (it got no disk hit at all), with the
    tokens of an uncached run."""
    block_bytes = make_engine(model_dir, caching=False, num_blocks=40, max_model_len=400).memory_plan.block_bytes
    prompt = [(7 * i + 3) % 251 for i in range(250)]

    def engine_on_disk() -> LLMEngine:  # chunks of 96 tokens: states at 96 and 192 (6 and 12 blocks), then 250
        return make_engine(model_dir, num_blocks=100, max_model_len=400, max_num_batched_tokens=96,
                           host_cache_gib=12 * block_bytes / (1 << 30), disk_cache_dir=str(tmp_path / "disk"))

    first = engine_on_disk()
    run_requests(first, {"a": prompt})
    first.close()
    engine = engine_on_disk()
    assert engine.num_host_blocks == 12
    steps = sorted(state.step for state in engine.disk.disk._states.values())
    assert steps[0] == 96 and steps[-1] >= 250
    got = run_requests(engine, {"b": prompt + [1, 2, 3]})["b"]
    assert got.num_cached_tokens == 96 and engine.stats()["disk"]["num_promoted_checkpoints"] == 1
    engine.check_integrity()
    engine.close()
    want = run_requests(make_engine(model_dir, caching=False, max_model_len=400), {"b": prompt + [1, 2, 3]})["b"]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_fall_out_through_a_node_demoted_in_its_pass_is_kept_and_served_with_the_uncached_outputs(
        model_dir, tmp_path, monkeypatch):
    """The host tier's own eviction drops a checkpoint whose chain runs through a node demoted in the same
    scheduling pass (its HOST_SAVE still in the plan being built): it was not kept (hunt 184). It is now, that
    block read from the device block the save reads; four workloads on one engine keep such fall-outs and write
    such blocks, and a restarted engine serves one of them, each workload with the tokens and logits of an
    uncached run (deterministic on this workload; `test_host_tier.py` checks the bytes themselves on the fake
    device)."""
    seeds = range(4)
    uncached = make_engine(model_dir, caching=False)
    want = []
    for seed in seeds:
        uncached.logits = {}
        want.append((run_workload(uncached, seed=seed, reply_lens=REPLY_LENS), uncached.logits))
    pending, written, served = set(), set(), set()  # block hashes
    fall_out, put, read = HostTier.fall_out, DiskTier.put, DiskTier.read

    def fall_out_seen(host, ckpt):
        result = fall_out(host, ckpt)
        if result is not None:
            pending.update(n.hash for n in host.chain(ckpt)[1] if n.host_block in host._saves)
        return result

    def put_seen(disk, item, blocks, state):
        written.update(item.blocks[i].hash for i in blocks if item.blocks[i].hash in pending)
        return put(disk, item, blocks, state)

    def read_seen(disk, hit, block_indices):
        served.update(hit.blocks[i].hash for i in block_indices)
        return read(disk, hit, block_indices)

    monkeypatch.setattr(HostTier, "fall_out", fall_out_seen)
    monkeypatch.setattr(DiskTier, "put", put_seen)
    monkeypatch.setattr(DiskTier, "read", read_seen)

    def run(engine: LLMEngine, check: bool) -> None:
        for seed, (out_uncached, logits) in zip(seeds, want, strict=True):
            engine.logits, uncached.logits = {}, logits
            out = run_workload(engine, seed=seed, check_every_step=check, reply_lens=REPLY_LENS)
            assert_same(engine, uncached, out, out_uncached)
        engine.check_integrity()

    first = disk_engine(model_dir, tmp_path / "disk", uncached.memory_plan.block_bytes)
    run(first, check=False)
    first.close()
    assert pending, "no fall-out through a node demoted in its pass was kept"
    assert written, "none of their blocks was new to the disk"
    engine = disk_engine(model_dir, tmp_path / "disk", uncached.memory_plan.block_bytes)
    run(engine, check=True)
    assert written & served, "no block read from a pending save's device block was served after the restart"
    engine.close()
