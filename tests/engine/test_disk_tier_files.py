"""The disk tier's files on their own (`engine/disk_tier.py`, no engine): what is written is found again by a new
`DiskTier` on the same directory and key (a restart), with its exact bytes; another key finds nothing; a corrupt
or partial file is skipped with a warning, never served; a failed write is counted and logged; the size cap
drops the least recently used states and the blocks only they needed."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch

from hybridcache.cache.host_tier import FallOut, FallOutBlock
from hybridcache.cache.trie import chain_hash, root_hash
from hybridcache.engine import disk_tier
from hybridcache.engine.disk_keeper import DiskKeeper
from hybridcache.engine.disk_tier import DiskTier, model_key

B = 4
WORDS = 8


def fall_out(prompt: list[int], step: int) -> FallOut:
    """The fall-out of a checkpoint at `step` of `prompt` (its chain on the device, ids = depth)."""
    blocks, parent = [], root_hash(None)
    for i in range(step // B):
        tokens = tuple(prompt[i * B:(i + 1) * B])
        node_hash = chain_hash(parent, tokens, ())
        blocks.append(FallOutBlock(node_hash, parent, tokens, on_host=False, block_id=i))
        parent = node_hash
    tail = tuple(prompt[step // B * B:step])
    return FallOut(blocks=tuple(blocks), anchor_hash=parent, step=step, tail_ids=tail,
                   tail_hash=chain_hash(parent, tail, ()), reason="finish", num_pages=2,
                   state_host_ids=(0, 1, 2) if tail else (0, 1))


def rows(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, WORDS), dtype=torch.int32, generator=generator)


def make(tmp_path, key="model-a", max_bytes=1 << 30) -> DiskTier:
    return DiskTier(tmp_path, key, page_words=WORDS, word_dtype=torch.int32, max_bytes=max_bytes)


def keep(disk: DiskTier, item: FallOut, seed: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    new_state, missing = disk.wants(item)
    blocks = {i: rows(1, seed + i)[0] for i in missing}
    state = rows(len(item.state_host_ids), seed + 100) if new_state else None
    disk.put(item, blocks, state)
    disk.flush()
    return blocks, state


PROMPT = list(range(10, 40))


def test_a_restarted_tier_finds_what_was_written_with_its_bytes(tmp_path):
    disk = make(tmp_path)
    blocks, state = keep(disk, fall_out(PROMPT, 11), seed=1)  # 2 blocks + a 3-token tail
    assert disk.wants(fall_out(PROMPT, 11)) == (False, ())
    _, deeper_state = keep(disk, fall_out(PROMPT, 16), seed=7)  # one more block, no tail
    assert disk.wants(fall_out(PROMPT, 16)) == (False, ())
    disk.close()

    again = make(tmp_path)
    assert again.stats.num_state_files == 2 and again.stats.num_block_files == 4
    hit = again.find(PROMPT, B, max_step=len(PROMPT) - 1)
    assert hit.state.step == 16 and [b.token_ids for b in hit.blocks] == [tuple(PROMPT[i:i + 4]) for i in (0, 4, 8, 12)]
    shallow = again.find(PROMPT[:15], B, max_step=14)  # 3 full blocks; the state at 16 is past max_step
    assert shallow.state.step == 11 and len(shallow.blocks) == 2
    got_blocks, got_state = again.read(shallow, (0, 1))
    assert torch.equal(got_blocks, torch.stack([blocks[0], blocks[1]])) and torch.equal(got_state, state)
    assert torch.equal(again.read(hit, ())[1], deeper_state)
    assert again.find(PROMPT[:10] + [99] * 10, B, 19) is None  # the tail at 11 differs: no usable state
    assert again.find(PROMPT, B, max_step=10) is None  # both states are deeper than allowed
    assert again.stats.num_promoted_checkpoints == 2
    assert make(tmp_path, key="model-b").find(PROMPT, B, len(PROMPT) - 1) is None


def test_corrupt_and_partial_files_are_skipped_with_a_warning(tmp_path, caplog):
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)
    keep(disk, fall_out([5] * 30, 9), seed=2)
    disk.close()
    flipped = next((disk.dir / "states").glob(f"{fall_out(PROMPT, 11).anchor_hash:016x}-*"))
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0xFF  # a bit flip in the state's bytes: the header still parses
    flipped.write_bytes(bytes(data))
    truncated = next((disk.dir / "states").glob(f"{fall_out([5] * 30, 9).anchor_hash:016x}-*"))
    truncated.write_bytes(truncated.read_bytes()[:-10])  # a partial file
    (disk.dir / "blocks" / "0123456789abcdef.safetensors").write_bytes(b"not a safetensors file")

    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        again = make(tmp_path)
        assert again.find([5] * 30, B, 29) is None  # the partial file was skipped at start-up
        hit = again.find(PROMPT, B, 29)
        assert hit is not None and again.read(hit, (0, 1)) is None  # its checksum fails: not served
        assert again.find(PROMPT, B, 29) is None  # and it is gone from the index
    assert again.stats.num_corrupt == 3
    assert sum("disk tier skips" in r.message for r in caplog.records) == 3
    assert not flipped.exists() and not truncated.exists()


def test_a_file_whose_header_was_changed_is_not_served(tmp_path):
    """The checksum covers the metadata: a state file whose tail tokens changed (bytes and name as written) would
    match another prompt, and is skipped as corrupt when read. (A block file whose tokens or parent changed is a
    miss anyway: `find` looks blocks up by the prompt's own chained hash and compares both.)"""
    from safetensors import safe_open
    from safetensors.torch import save_file

    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)  # 2 blocks + the tail PROMPT[8:11]
    disk.close()

    def rewrite(path, change):
        with safe_open(str(path), "pt") as f:
            metadata, data = dict(f.metadata()), f.get_tensor("data")
        change(metadata)
        save_file({"data": data}, str(path), metadata=metadata)

    (state_file,) = (disk.dir / "states").glob("*.safetensors")
    rewrite(state_file, lambda m: m.update(tail=json.dumps(PROMPT[8:10] + [99])))
    other = PROMPT[:10] + [99] + PROMPT[11:]
    again = make(tmp_path)
    hit = again.find(other, B, len(other) - 1)
    assert hit is not None and hit.state.step == 11  # the header says so
    assert again.read(hit, (0, 1)) is None and again.stats.num_corrupt == 1  # the checksum says otherwise
    assert again.find(other, B, len(other) - 1) is None and again.find(PROMPT, B, len(PROMPT) - 1) is None


def test_a_failed_write_is_counted_and_logged(tmp_path, caplog, monkeypatch):
    disk = make(tmp_path)

    def failing(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(disk_tier, "_save", failing)
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        keep(disk, fall_out(PROMPT, 11), seed=1)
    assert disk.stats.num_write_errors == 1 and "disk full" in caplog.text
    assert disk.find(PROMPT, B, 29) is None and disk.wants(fall_out(PROMPT, 11)) == (True, (0, 1))
    disk.close()


def test_the_size_cap_drops_the_least_recently_used_states_and_their_blocks(tmp_path):
    disk = make(tmp_path)
    prompts = [[i] * 30 for i in range(3)]
    keep(disk, fall_out(prompts[0], 9), seed=1)
    one = disk.stats.num_bytes  # one state of 3 rows and its 2 blocks
    disk.close()
    capped = make(tmp_path, max_bytes=int(2.5 * one))
    keep(capped, fall_out(prompts[1], 9), seed=2)
    assert capped.read(capped.find(prompts[0], B, 29), ()) is not None  # now the most recently used
    keep(capped, fall_out(prompts[2], 9), seed=3)  # past the cap: prompts[1]'s state goes, then its blocks
    assert capped.stats.num_evicted_states == 1 and capped.stats.num_bytes <= 2.5 * one
    assert capped.find(prompts[1], B, 29) is None
    assert capped.find(prompts[0], B, 29) is not None and capped.find(prompts[2], B, 29) is not None
    assert capped.stats.num_block_files == 4 and capped.stats.num_state_files == 2
    capped.close()


def test_a_restarted_tier_keeps_the_order_of_use_not_of_writing(tmp_path):
    disk = make(tmp_path)
    prompts = [[i] * 30 for i in range(3)]
    keep(disk, fall_out(prompts[0], 9), seed=1)
    one = disk.stats.num_bytes
    old = time.time() - 3600
    for path in (tmp_path / "model-a" / "states").iterdir():
        os.utime(path, (old, old))  # written an hour ago
    keep(disk, fall_out(prompts[1], 9), seed=2)
    assert disk.read(disk.find(prompts[0], B, 29), ()) is not None  # the oldest write, used last
    disk.close()
    capped = make(tmp_path, max_bytes=int(2.5 * one))
    keep(capped, fall_out(prompts[2], 9), seed=3)  # past the cap: the least recently used goes, prompts[1]'s
    assert capped.stats.num_evicted_states == 1
    assert capped.find(prompts[1], B, 29) is None and capped.find(prompts[0], B, 29) is not None
    capped.close()


def test_the_model_key_changes_with_the_weights_and_the_geometry(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 1000)
    key = model_key(tmp_path, {"block_size": 64})
    assert model_key(tmp_path, {"block_size": 64}) == key
    assert model_key(tmp_path, {"block_size": 32}) != key
    weights.write_bytes(b"\0" * 999 + b"\1")
    assert model_key(tmp_path, {"block_size": 64}) != key


def test_the_size_cap_keeps_the_blocks_a_queued_state_chains_through(tmp_path):
    """A state queued behind a write that goes past the cap: its chain's blocks are already on disk (so not queued
    again) and belong to the state the cap drops first; they must stay, or the queued state is written unreachable."""
    disk = make(tmp_path)
    other = [7] * 30
    keep(disk, fall_out(PROMPT, 9), seed=1)  # state A at 9 and PROMPT's two blocks
    one = disk.stats.num_bytes
    disk.close()
    capped = make(tmp_path, max_bytes=int(1.5 * one))
    deeper, filler = fall_out(PROMPT, 11), fall_out(other, 9)
    wants_deeper, wants_filler = capped.wants(deeper), capped.wants(filler)
    assert wants_deeper == (True, ())  # PROMPT's blocks are on disk: only the state is written
    capped.put(filler, {i: rows(1, 10 + i)[0] for i in wants_filler[1]}, rows(3, 20))  # drops A when written
    capped.put(deeper, {}, rows(3, 30))
    capped.flush()
    hit = capped.find(PROMPT, B, 29)
    assert hit is not None and hit.state.step == 11
    assert capped.read(hit, ()) is not None
    capped.close()


def test_a_hit_whose_files_the_size_cap_dropped_since_is_a_miss_not_corrupt(tmp_path):
    """find() then read() of a state the writer's cap deleted in between: a plain miss (None), no corruption
    counted, no warning."""
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 9), seed=1)
    one = disk.stats.num_bytes
    disk.close()
    capped = make(tmp_path, max_bytes=int(1.5 * one))
    hit = capped.find(PROMPT, B, 29)
    assert hit is not None
    keep(capped, fall_out([7] * 30, 9), seed=2)  # past the cap: the found state, least recently used, goes
    assert capped.stats.num_evicted_states == 1
    assert capped.read(hit, ()) is None
    assert capped.stats.num_corrupt == 0
    capped.close()


def test_a_stray_file_in_the_folder_is_skipped_not_fatal(tmp_path, caplog):
    """A file whose name is no hash or key ('._<hash>.safetensors', as a Mac leaves beside a copied file) is
    skipped at start-up with a warning; parsing its name raised and the engine did not start (helper 100's hunt)."""
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)
    disk.close()
    block = next((disk.dir / "blocks").glob("*.safetensors"))
    state = next((disk.dir / "states").glob("*.safetensors"))
    (block.parent / f"._{block.name}").write_bytes(block.read_bytes())
    (state.parent / f"copy of {state.name}").write_bytes(state.read_bytes())
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        again = make(tmp_path)
    assert again.stats.num_corrupt == 2 and again.find(PROMPT, B, 29) is not None
    assert sum("disk tier skips" in r.message for r in caplog.records) == 2


def test_the_writer_outlives_an_error_after_its_write_and_files_it_cannot_delete(tmp_path, caplog, monkeypatch):
    """An error after a write (the cap deleting a file of a read-only folder, a file another engine removed before
    it was counted) ended the writer thread: every later fall-out stayed queued and `close()` waited forever.
    Now the writer logs it and goes on, and a file that cannot be deleted is forgotten with a warning."""
    disk = make(tmp_path)
    calls = []

    def failing_cap():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cap failed")

    monkeypatch.setattr(disk, "_enforce_cap", failing_cap)
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        keep(disk, fall_out(PROMPT, 11), seed=1)
        keep(disk, fall_out([5] * 30, 9), seed=2)  # written by the same thread after the error
    assert disk.find([5] * 30, B, 29) is not None and disk.stats.num_write_errors == 1 and len(calls) == 2
    path = next((disk.dir / "states").glob("*.safetensors"))

    def read_only(self, missing_ok=False):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(type(path), "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        disk._drop_corrupt(path, ValueError("checksum mismatch"))
    assert "cannot delete" in caplog.text
    disk.close()  # returns: the writer is alive


def test_hits_are_the_usable_states_deepest_first(tmp_path):
    """`hits`: every state a prompt can use, deepest first (the host tier takes the deepest it has room for);
    `find` is the first of them."""
    disk = make(tmp_path)
    for step, seed in ((9, 1), (11, 2), (16, 3), (22, 4)):
        keep(disk, fall_out(PROMPT, step), seed)
    hits = disk.hits(PROMPT, B, max_step=20)
    assert [hit.state.step for hit in hits] == [16, 11, 9] and [len(hit.blocks) for hit in hits] == [4, 2, 2]
    assert disk.find(PROMPT, B, 20) == hits[0]
    assert disk.hits(PROMPT[:10] + [99] * 10, B, 19) == [hits[2]]  # the tail at 11 differs
    disk.close()


def test_clear_deletes_every_file_and_resets_the_counters(tmp_path):
    """`clear` (the cache's reset: `LLM.reset_prefix_cache`) waits for the writer, forgets every state and block
    and deletes their files: a restarted tier finds nothing either."""
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)
    item = fall_out([5] * 30, 9)
    new_state, missing = disk.wants(item)
    disk.put(item, {i: rows(1, i)[0] for i in missing}, rows(3, 9))  # queued, not waited for
    disk.clear()
    assert disk.find(PROMPT, B, 29) is None and disk.find([5] * 30, B, 29) is None
    stats = disk.stats
    assert (stats.num_bytes, stats.num_block_files, stats.num_state_files) == (0, 0, 0)
    assert not list(disk.dir.glob("*/*.safetensors*"))
    assert disk.wants(fall_out(PROMPT, 11)) == (True, (0, 1))  # written again when it falls out again
    disk.close()
    assert make(tmp_path).stats.num_state_files == 0


def test_a_file_replaced_by_another_records_file_is_not_served(tmp_path, caplog):
    """A read checks that each file is the record the match found (the metadata the name stands for), not only its
    checksum: a valid file of another record under a matched name (copied or renamed in the folder after the
    start-up scan) is a miss with a warning, never served."""
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)
    keep(disk, fall_out(PROMPT[:8] + [7] * 22, 11), seed=2)  # the same 2 blocks, another tail
    keep(disk, fall_out([5] * 30, 9), seed=3)
    hit = disk.find(PROMPT, B, 29)
    state_file = disk._state_path(hit.state.key)
    state_file.write_bytes(disk._state_path(disk.find(PROMPT[:8] + [7] * 22, B, 29).state.key).read_bytes())
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        assert disk.read(hit, ()) is None
    assert "not the one matched" in caplog.text and disk.stats.num_corrupt == 1
    assert disk.find(PROMPT, B, 29) is None  # dropped from the index
    other = disk.find([5] * 30, B, 29)
    block_file = disk._block_path(other.blocks[0].hash)
    block_file.write_bytes(disk._block_path(other.blocks[1].hash).read_bytes())  # [5]*4 twice: the parent differs
    assert disk.read(other, (0, 1)) is None and disk.stats.num_corrupt == 2
    disk.close()


def test_a_read_only_folder_is_read_with_warnings(tmp_path, caplog, monkeypatch):
    """A folder the engine may read but not write (a pre-filled cache on a read-only volume): `model.json` cannot be
    rewritten and a stale temporary file cannot be deleted; both are warnings, not a failed start (the engine did
    not start), and what is there is served."""
    disk = make(tmp_path)
    keep(disk, fall_out(PROMPT, 11), seed=1)
    disk.close()
    stale = disk.dir / "states" / "0123456789abcdef-11-0123456789abcdef.safetensors.tmp4242"
    stale.write_bytes(b"cut short")
    os.utime(stale, (0, 0))  # long ago: a write cut short

    def read_only(*_args, **_kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(pathlib.Path, "write_text", read_only)
    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        again = make(tmp_path)
    assert "cannot write" in caplog.text and "cannot delete" in caplog.text
    hit = again.find(PROMPT, B, 29)
    assert hit is not None and again.read(hit, (0, 1)) is not None
    again.close()


def test_a_second_tier_on_the_folder_leaves_a_write_in_flight_alone(tmp_path, monkeypatch):
    """Two engines on one folder (Ray Serve replicas share --disk-cache-dir; here two in one process): one starting
    while the other writes deleted the writer's temporary file (every '*.tmp*' was taken for a write cut short, and
    the temporary name was only the process id), so the write failed and the checkpoint was lost. Temporary names
    are unique to a write; the start-up scan deletes only those of a dead process of this machine, or old ones."""
    a = make(tmp_path)
    in_write, go_on = threading.Event(), threading.Event()
    real = disk_tier.save_file

    def slow_save_file(tensors, path, metadata=None):  # a's writer thread, part-way through a write
        real(tensors, path, metadata=metadata)
        in_write.set()
        assert go_on.wait(30)

    monkeypatch.setattr(disk_tier, "save_file", slow_save_file)
    item = fall_out(PROMPT, 11)
    _, missing = a.wants(item)
    a.put(item, {i: rows(1, i)[0] for i in missing}, rows(3, 100))
    try:
        assert in_write.wait(30)
        (temporary,) = (a.dir / "blocks").glob("*.tmp*")
        b = make(tmp_path)
        assert temporary.exists()
    finally:
        monkeypatch.setattr(disk_tier, "save_file", real)
        go_on.set()
    a.flush()
    assert a.stats.num_write_errors == 0 and a.find(PROMPT, B, 29).state.step == 11
    a.close()
    b.close()


def test_the_scan_deletes_temporary_files_of_dead_writers_and_old_ones(tmp_path):
    disk = make(tmp_path)
    disk.close()
    blocks = disk.dir / "blocks"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = socket.gethostname()
    files = {
        "dead": f"0000000000000001.safetensors.tmp{gone.pid}-{'a' * 32}@{here}",  # its writer exited
        "alive": f"0000000000000002.safetensors.tmp{os.getpid()}-{'b' * 32}@{here}",  # this process writes it
        "elsewhere": f"0000000000000003.safetensors.tmp{gone.pid}-{'c' * 32}@another-host",  # unknown: young
        "old": f"0000000000000004.safetensors.tmp{gone.pid}-{'d' * 32}@another-host",
        "old format": "0000000000000005.safetensors.tmp4242",
    }
    for name in files.values():
        (blocks / name).write_bytes(b"partial")
    for old in ("old", "old format"):
        past = time.time() - disk_tier.STALE_TEMP_SECONDS - 60
        os.utime(blocks / files[old], (past, past))
    make(tmp_path).close()
    assert sorted(p.name for p in blocks.iterdir()) == sorted([files["alive"], files["elsewhere"]])


def test_a_host_tier_too_small_for_any_disk_checkpoint_is_warned_of(tmp_path, caplog):
    """A checkpoint comes back from disk only with its k state pages and a block (of its chain, or its frozen tail)
    in the host tier at once: a smaller host tier makes the disk tier write-only, which the keeper says at start-up
    (it was accepted silently)."""
    disk = make(tmp_path)
    paged = SimpleNamespace(k=3)
    with caplog.at_level(logging.WARNING, logger="hybridcache.disk"):
        DiskKeeper(disk, paged, SimpleNamespace(num_blocks=4))
        assert "cannot take back" not in caplog.text
        DiskKeeper(disk, paged, SimpleNamespace(num_blocks=3))
    assert "a host tier of 3 blocks cannot take back any disk checkpoint" in caplog.text
    disk.close()


_WRITER = """
import os, sys, time
from pathlib import Path
from hybridcache.engine import disk_tier
tmp, fd = disk_tier._create_temp(Path(sys.argv[1]) / "0000000000000007.safetensors")
os.write(fd, b"partial")
print(tmp.name, flush=True)
time.sleep(60)
"""


def test_the_scan_deletes_a_killed_writers_temporary_file_whatever_process_has_its_pid_since(tmp_path):
    """A server killed mid-write (SIGKILL) and restarted in its container has the same pid (PID 1) and hostname: the
    scan took the pid's live process for the writer and kept the partial file (a state file, ~75 MB, per kill) for
    an hour. A temporary file is held under an flock while written and names its writer's process instance (pid and
    process token): one no process holds locked is deleted, whoever has the pid now (here: this process, and a live
    process that is not the writer); the write in flight of a live process, or of this one, stays."""
    disk = make(tmp_path)
    disk.close()
    blocks = disk.dir / "blocks"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(blocks)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        in_flight = writer.stdout.readline().strip()  # the live writer holds its lock
        assert in_flight.endswith(f".locked@{socket.gethostname()}")
        own = disk_tier._create_temp(blocks / "0000000000000008.safetensors")  # this process's write in flight
        os.write(own[1], b"partial")
        here, token = socket.gethostname(), "0123abcd"
        assert token != disk_tier._PROCESS_TOKEN
        pid = os.getpid()
        files = {  # as a killed writer named them
            "this pid's previous life": f"0000000000000001.safetensors.tmp{pid}.{token}-{'a' * 32}.locked@{here}",
            "unlocked, this pid's previous life": f"0000000000000002.safetensors.tmp{pid}.{token}-{'b' * 32}@{here}",
            "a live pid, not the writer": f"0000000000000003.safetensors.tmp{writer.pid}.{token}-{'c' * 32}.locked@"
                                          f"{here}",
        }
        for name in files.values():
            (blocks / name).write_bytes(b"partial")
        make(tmp_path).close()
        assert sorted(p.name for p in blocks.iterdir()) == sorted([in_flight, own[0].name])
        writer.kill()  # SIGKILL: its lock goes with it
        writer.wait()
        os.close(own[1])  # (this process's write ended without its rename: its file stays an hour, as any)
        make(tmp_path).close()
        assert sorted(p.name for p in blocks.iterdir()) == [own[0].name]
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    disk = make(tmp_path)

    def failing(tensors, path, metadata=None):
        pathlib.Path(path).write_bytes(b"partial")
        raise OSError("no space left on device")

    monkeypatch.setattr(disk_tier, "save_file", failing)
    item = fall_out(PROMPT, 11)
    _, missing = disk.wants(item)
    disk.put(item, {i: rows(1, i)[0] for i in missing}, rows(3, 100))
    disk.flush()
    assert disk.stats.num_write_errors == 1
    assert not list((disk.dir / "blocks").iterdir()) and not list((disk.dir / "states").iterdir())
    disk.close()
