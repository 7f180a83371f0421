"""The disk tier: what falls out of the host tier, kept in files that a restarted engine finds again.

Behind the host tier (`EngineConfig.disk_cache_dir`; docs/cache.md, "The disk tier"). When the host tier's own
eviction drops a checkpoint (`HostTier.fall_out`), its state and every block of its chain that the disk does not
hold yet are read (host blocks from the host pool, device blocks from the pool) and handed to a writer thread;
a match whose usable checkpoints on disk (`hits`, deepest first) are deeper than what the device and host tiers
hold gets the deepest one the host tier has room for read back into the host tier (`Lifecycle.adopt_stored`,
through `engine/disk_keeper.DiskKeeper`), and promotes it as any host hit::

    DIR/<model key>/model.json                       what the key was made of (for people; never read back)
    DIR/<model key>/blocks/<hash>.safetensors        one full block: "data" [1, page_words]
    DIR/<model key>/states/<anchor>-<step>-<tail>.safetensors   one checkpoint: "data" [k (+1), page_words],
                                                     its k pages, then its frozen tail when the step is not
                                                     block-aligned

A block file is named by the chained hash the trie already computes (`trie.chain_hash`), a state file by its
anchor's hash, its step and its tail's hash; each file's metadata holds what rebuilding the trie needs (parent
hash and tokens; tail tokens, reason, pages) and an xxh64 checksum of its bytes and that metadata (what a match
trusts, the tail's tokens, is checked with the bytes before they are served). The model key (`model_key`)
hashes config.json, the weights' identity, the block and page geometry and the dtypes, so another model (or the
same one cut differently) never reads these files. A file that cannot be parsed, whose bytes or metadata do not
match, or that is not the record the match found under its name, is skipped with a warning (and deleted), never
served. Files are written to a temporary name unique to the write (`_temp_name`) and renamed, so a crash leaves no
partial file under a real name; the writer holds an flock on the temporary file while it writes, and the start-up
scan deletes only the temporary files of writes cut short (`_is_stale`: one of this machine that no process holds
locked, even when a live process has the writer's pid, as a restarted container's PID 1 has), so that engines
sharing the folder leave each other's writes in flight alone. A read-only folder is read (what cannot be written or
deleted is a warning). `clear` drops everything (the cache's reset).

The writer thread takes one fall-out at a time (its blocks, then its state) and indexes it once written; a write
that fails is logged and counted (`num_write_errors`), never dropped silently; the queue is unbounded (the engine
never waits for the disk). `max_bytes` caps the files: past it the least recently used states go first, then the
blocks no remaining state's chain needs. Tensor parallelism is not supported (each rank would keep its shard).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from hybridcache.cache.host_tier import FallOut, StoredCheckpoint
from hybridcache.cache.trie import chain_hash, root_hash

FORMAT = "hybridcache-disk-2"  # 2: the checksum covers the metadata too
STALE_TEMP_SECONDS = 3600  # a temporary file older than this is a write cut short, whoever's it was
# `_temp_name`'s `<name>.tmp<pid>.<process token>-<uuid>[.locked]@<host>`; no token and no lock mark: an older
# version's name (`.locked`: the writer holds an flock on the file while it writes; not on a file system without it)
_TEMP = re.compile(r"\.tmp(?P<pid>\d+)(?:\.(?P<token>[0-9a-f]{8}))?-[0-9a-f]{32}(?P<locked>\.locked)?@(?P<host>.+)$")
# this process instance among those that have its pid (a restarted container's PID 1 has the killed one's): made
# once at import and never changed
_PROCESS_TOKEN = uuid.uuid4().hex[:8]
_logger = logging.getLogger("hybridcache.disk")


@dataclass(frozen=True)
class DiskBlock:
    """A block file's record: its chained hash, its parent's, its tokens."""

    hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class DiskState:
    """A state file's record: anchor hash, step, tail tokens and hash, reason, pages, frozen tail or not."""

    anchor_hash: int
    step: int
    tail_ids: tuple[int, ...]
    tail_hash: int
    reason: str
    num_pages: int
    has_frozen: bool

    @property
    def key(self) -> tuple[int, int, int]:
        return self.anchor_hash, self.step, self.tail_hash


@dataclass(frozen=True)
class DiskHit:
    """The deepest usable state on disk for a prompt, with the blocks of its chain (root's child first)."""

    blocks: tuple[DiskBlock, ...]
    state: DiskState

    def stored(self) -> StoredCheckpoint:
        s = self.state
        return StoredCheckpoint(chain=tuple((b.hash, b.token_ids) for b in self.blocks), step=s.step,
                                tail_ids=s.tail_ids, reason=s.reason, num_pages=s.num_pages, has_frozen=s.has_frozen)


@dataclass
class DiskStats:
    """The disk tier's counters: what it holds (`num_bytes`, files), what it took from the host tier
    (`num_demoted_*`: written), what went back (`num_promoted_*`: read into the host tier, each checkpoint a disk
    hit), and what went wrong (`num_corrupt`: files skipped, `num_write_errors`)."""

    num_bytes: int = 0
    num_block_files: int = 0
    num_state_files: int = 0
    num_demoted_checkpoints: int = 0
    num_demoted_blocks: int = 0
    num_promoted_checkpoints: int = 0
    num_promoted_blocks: int = 0
    num_evicted_states: int = 0
    num_corrupt: int = 0
    num_write_errors: int = 0


def model_key(model_path: Path, geometry: dict[str, Any]) -> str:
    """A hex key of the model and how its bytes are laid out: config.json's text, each weight file's name, size,
    header and four 64 KiB samples of its data (reading whole files would cost minutes on large models), and
    `geometry` (block size, page layout, dtypes, load format...)."""
    digest = hashlib.sha256()
    digest.update((model_path / "config.json").read_bytes())
    for path in sorted(model_path.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for offset in (0, size // 4, size // 2, max(size - (1 << 16), 0)):
                f.seek(offset)
                digest.update(f.read(1 << 16))
    digest.update(json.dumps(geometry, sort_keys=True).encode())
    return digest.hexdigest()[:24]


class DiskTier:
    """The files under `root / key` (see the module docstring), their index, and the writer thread. `page_words`
    and `word_dtype`: one block's layout in the host pool (`PagedStates`); `max_bytes`: the cap on the files."""

    def __init__(self, root: Path, key: str, *, page_words: int, word_dtype: torch.dtype, max_bytes: int,
                 describe: dict[str, Any] | None = None) -> None:
        self.dir = Path(root) / key
        (self.dir / "blocks").mkdir(parents=True, exist_ok=True)
        (self.dir / "states").mkdir(parents=True, exist_ok=True)
        try:
            (self.dir / "model.json").write_text(json.dumps({"key": key, **(describe or {})}, indent=1, default=str))
        except OSError as error:  # a read-only folder (a pre-filled cache): it is read, its writes fail and are counted
            _logger.warning("hybridcache: disk tier cannot write %s (%s)", self.dir / "model.json", error)
        self.page_words, self.word_dtype, self.max_bytes = page_words, word_dtype, max_bytes
        self.stats = DiskStats()
        self._lock = threading.Lock()  # the index and stats: the writer thread adds, the engine's thread reads
        self._blocks: dict[int, DiskBlock] = {}
        self._states: OrderedDict[tuple[int, int, int], DiskState] = OrderedDict()  # least recently used first
        self._by_anchor: dict[int, list[DiskState]] = {}
        self._sizes: dict[Path, int] = {}
        self._queued: set[Any] = set()  # block hashes and state keys handed to the writer, not written yet
        self._pinned: Counter[int] = Counter()  # the chains of wanted fall-outs not written yet: the cap keeps them
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="hybridcache-disk-writer", daemon=True)
        self._writer.start()

    # ---- what the host tier drops ------------------------------------------------------------------------

    def wants(self, fall_out: FallOut) -> tuple[bool, tuple[int, ...]]:
        """(whether its state is new to the disk, the indices of its blocks the disk neither holds nor queued).
        When it wants anything, the fall-out's whole chain is pinned from then on (the size cap keeps the blocks
        on disk that it did not ask for) until its write is done: the caller must `put` it."""
        s = fall_out
        with self._lock:
            key = (s.anchor_hash, s.step, s.tail_hash)
            new_state = key not in self._states and key not in self._queued
            blocks = tuple(i for i, b in enumerate(s.blocks)
                           if b.hash not in self._blocks and b.hash not in self._queued)
            if new_state or blocks:
                self._pinned.update(b.hash for b in s.blocks)
        return new_state, blocks

    def put(self, fall_out: FallOut, blocks: dict[int, torch.Tensor], state: torch.Tensor | None) -> None:
        """Queue the files of `fall_out`: `blocks` (index in its chain -> [page_words] CPU tensor) and its state
        ([k (+1), page_words], None when the disk holds it). Returns at once (the writer thread writes)."""
        s = fall_out
        with self._lock:
            self._queued.update(s.blocks[i].hash for i in blocks)
            if state is not None:
                self._queued.add((s.anchor_hash, s.step, s.tail_hash))
        self._queue.put((fall_out, blocks, state))

    def flush(self) -> None:
        """Wait until every queued fall-out is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (idempotent)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # ---- what a prompt finds -----------------------------------------------------------------------------

    def hits(self, prompt_ids: Sequence[int], block_size: int, max_step: int,
             hashes: Sequence[int] | None = None) -> list[DiskHit]:
        """The states on disk usable by a prompt of the base model without multimodal spans, deepest first: each
        one's chain is the prompt's full blocks (exact tokens), its tail the prompt's next tokens, its step <=
        `max_step`. `hashes`: the chained hashes of the prompt's full blocks when the caller has them (else
        computed)."""
        if hashes is None:
            hashes, parent = [], root_hash(None)
            for i in range(len(prompt_ids) // block_size):
                parent = chain_hash(parent, tuple(prompt_ids[i * block_size:(i + 1) * block_size]), ())
                hashes.append(parent)
        found = []
        with self._lock:
            chain: list[DiskBlock] = []
            anchor = root_hash(None)
            for h in hashes:
                block = self._blocks.get(h)
                start = len(chain) * block_size
                if (block is None or block.parent_hash != anchor
                        or block.token_ids != tuple(prompt_ids[start:start + block_size])):
                    break
                chain.append(block)
                anchor = h
            for depth in range(len(chain), -1, -1):
                anchor = chain[depth - 1].hash if depth else root_hash(None)
                usable = [state for state in self._by_anchor.get(anchor, ())
                          if state.step // block_size == depth and state.step <= max_step
                          and tuple(prompt_ids[depth * block_size:state.step]) == state.tail_ids]
                found += [DiskHit(tuple(chain[:depth]), state)
                          for state in sorted(usable, key=lambda state: -state.step)]
        return found

    def find(self, prompt_ids: Sequence[int], block_size: int, max_step: int,
             hashes: Sequence[int] | None = None) -> DiskHit | None:
        """The deepest of `hits`, or None."""
        return next(iter(self.hits(prompt_ids, block_size, max_step, hashes)), None)

    def read(self, hit: DiskHit, block_indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([len(block_indices), page_words] the bytes of those blocks of `hit`'s chain, [k (+1), page_words] its
        state's), checked against their checksums and against the records `hit` matched (a file is served only
        when it is the record its name says: hash, parent and tokens; anchor, step, tail and pages); None when a
        file is missing, corrupt or another record's (it is dropped from the index, with a warning) or the size
        cap deleted it since the match (a plain miss). The state becomes the most recently used, here and for a
        restarted tier (its file's mtime is set to now)."""
        blocks = []
        for i in block_indices:
            b = hit.blocks[i]
            data = self._load(self._block_path(b.hash), 1, _block_metadata(b))
            if data is None:
                return None
            blocks.append(data)
        state = hit.state
        data = self._load(self._state_path(state.key), state.num_pages + state.has_frozen, _state_metadata(state))
        if data is None:
            return None
        with self._lock:
            if state.key in self._states:
                self._states.move_to_end(state.key)
            self.stats.num_promoted_checkpoints += 1
            with contextlib.suppress(OSError):  # the start-up scan's LRU order is the files' mtimes
                _stamp(self._state_path(state.key))
            self.stats.num_promoted_blocks += len(blocks)
        empty = torch.empty((0, self.page_words), dtype=self.word_dtype)
        return (torch.cat(blocks) if blocks else empty), data

    def clear(self) -> None:
        """Drop everything this tier holds (`LLM.reset_prefix_cache`, through `PrefixCache.clear`): wait for the
        writer, then forget every state and block and delete their files (a file the folder does not let go is
        forgotten with a warning, left on the disk). Files another engine on the folder wrote since this one
        started are not this one's (it never indexed them) and stay."""
        self.flush()
        with self._lock:
            for path in list(self._sizes):
                self._remove_file(path)
            self._blocks.clear()
            self._states.clear()
            self._by_anchor.clear()

    # ---- files -------------------------------------------------------------------------------------------

    def _block_path(self, node_hash: int) -> Path:
        return self.dir / "blocks" / f"{node_hash:016x}.safetensors"

    def _state_path(self, key: tuple[int, int, int]) -> Path:
        anchor, step, tail = key
        return self.dir / "states" / f"{anchor:016x}-{step}-{tail:016x}.safetensors"

    def _load(self, path: Path, num_rows: int, record: dict[str, str]) -> torch.Tensor | None:
        """The data of `path`, when its shape, checksum and metadata are right: `record`, the metadata of the
        record a match found under that name (a valid file of another record is not it)."""
        try:
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata() or {}
                data = f.get_tensor("data")
            if data.shape != (num_rows, self.page_words) or data.dtype != self.word_dtype:
                raise ValueError(f"data {tuple(data.shape)} {data.dtype}, expected ({num_rows}, {self.page_words}) "
                                 f"{self.word_dtype}")
            if metadata.get("checksum") != _checksum(data, metadata):
                raise ValueError("checksum mismatch")
            if any(metadata.get(name) != value for name, value in record.items()):
                raise ValueError("its record is not the one matched")
            return data
        except Exception as error:  # noqa: BLE001 (whatever is wrong with the file, it is not served)
            with self._lock:
                dropped = path not in self._sizes  # by the size cap, since the match found it: a plain miss
            if not dropped:
                self._drop_corrupt(path, error)
            return None

    def _drop_corrupt(self, path: Path, error: BaseException) -> None:
        """Skip a file that cannot be served: warn, count, forget it (a name that parses as no hash or key was in
        no index) and delete it where the folder allows."""
        _logger.warning("hybridcache: disk tier skips %s (%s)", path, error)
        with self._lock:
            self.stats.num_corrupt += 1
            name = path.name.removesuffix(".safetensors")
            try:
                if path.parent.name == "blocks":
                    self._blocks.pop(int(name, 16), None)
                else:
                    anchor, step, tail = name.split("-")
                    self._forget_state((int(anchor, 16), int(step), int(tail, 16)))
            except ValueError:  # a stray file (e.g. '._<hash>.safetensors' copied from a Mac)
                pass
            self._remove_file(path)

    def _scan(self) -> None:
        """Index the files a previous engine left (headers only); skip (and delete) what cannot be parsed, and the
        temporary files of writes cut short (`_is_stale`; another engine's write in flight stays)."""
        now = time.time()
        for path in sorted((self.dir / "blocks").glob("*.tmp*")) + sorted((self.dir / "states").glob("*.tmp*")):
            if _is_stale(path, now):
                self._remove_file(path)
        for path in sorted((self.dir / "blocks").glob("*.safetensors")):
            try:
                meta = _metadata(path, "block")
                block = DiskBlock(int(meta["hash"]), int(meta["parent"]), tuple(json.loads(meta["tokens"])))
                if path != self._block_path(block.hash):
                    raise ValueError("its name is not its hash")
            except Exception as error:  # noqa: BLE001
                self._drop_corrupt(path, error)
                continue
            self._blocks[block.hash] = block
            self._count(path)
        states = []
        for path in (self.dir / "states").glob("*.safetensors"):
            try:
                meta = _metadata(path, "state")
                state = DiskState(int(meta["anchor"]), int(meta["step"]), tuple(json.loads(meta["tail"])),
                                  int(meta["tail_hash"]), meta["reason"], int(meta["num_pages"]),
                                  meta["frozen"] == "1")
                if path != self._state_path(state.key):
                    raise ValueError("its name is not its key")
            except Exception as error:  # noqa: BLE001
                self._drop_corrupt(path, error)
                continue
            states.append((path.stat().st_mtime_ns, path, state))
        for _mtime, path, state in sorted(states, key=lambda item: item[0]):  # oldest first: the LRU order
            self._add_state(state)
            self._count(path)

    def _count(self, path: Path) -> None:
        try:
            size = path.stat().st_size
        except OSError:  # gone since it was written (another engine on the folder): not counted
            return
        self._sizes[path] = size
        self.stats.num_bytes += size
        self.stats.num_block_files += path.parent.name == "blocks"
        self.stats.num_state_files += path.parent.name == "states"

    def _remove_file(self, path: Path) -> None:
        size = self._sizes.pop(path, None)
        if size is not None:
            self.stats.num_bytes -= size
            self.stats.num_block_files -= path.parent.name == "blocks"
            self.stats.num_state_files -= path.parent.name == "states"
        try:
            path.unlink(missing_ok=True)
        except OSError as error:  # a read-only folder: forgotten here, left on the disk
            _logger.warning("hybridcache: disk tier cannot delete %s (%s)", path, error)

    def _add_state(self, state: DiskState) -> None:
        self._states[state.key] = state
        self._by_anchor.setdefault(state.anchor_hash, []).append(state)

    def _forget_state(self, key: tuple[int, int, int]) -> None:
        state = self._states.pop(key, None)
        if state is not None:
            bucket = self._by_anchor[state.anchor_hash]
            bucket.remove(state)
            if not bucket:
                del self._by_anchor[state.anchor_hash]

    # ---- the writer thread -------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        """Write what falls out until `None` comes. No error ends the thread (a dead writer would leave every
        later fall-out queued, unwritten, and `close` waiting for it forever)."""
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # noqa: BLE001 (the write's own errors are counted in `_write`)
                _logger.exception("hybridcache: disk tier's writer failed after a write; it goes on")
                with self._lock:
                    self.stats.num_write_errors += 1
            finally:
                self._queue.task_done()

    def _write(self, fall_out: FallOut, blocks: dict[int, torch.Tensor], state: torch.Tensor | None) -> None:
        s = fall_out
        written: list[tuple[Path, DiskBlock | DiskState]] = []
        try:
            for i, data in blocks.items():
                b = s.blocks[i]
                record = DiskBlock(b.hash, b.parent_hash, b.token_ids)
                path = self._block_path(b.hash)
                _save(path, data.reshape(1, -1), _block_metadata(record))
                written.append((path, record))
            if state is not None:
                record = DiskState(s.anchor_hash, s.step, s.tail_ids, s.tail_hash, s.reason, s.num_pages,
                                   len(s.state_host_ids) > s.num_pages)
                path = self._state_path(record.key)
                _save(path, state, _state_metadata(record))
                written.append((path, record))
        except Exception as error:  # noqa: BLE001 (counted and logged, never silent; the engine goes on)
            _logger.warning("hybridcache: disk tier failed to write a checkpoint at step %d: %s", s.step, error)
            with self._lock:
                self.stats.num_write_errors += 1
        with self._lock:
            for path, record in written:
                if isinstance(record, DiskBlock):
                    self._blocks[record.hash] = record
                    self.stats.num_demoted_blocks += 1
                else:
                    self._add_state(record)
                    self.stats.num_demoted_checkpoints += 1
                self._count(path)
            self._queued.difference_update(b.hash for b in s.blocks)
            self._queued.discard((s.anchor_hash, s.step, s.tail_hash))
            self._pinned.subtract(b.hash for b in s.blocks)
            self._pinned += Counter()  # drops the zero counts
            self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Past `max_bytes`: drop the least recently used states, then the blocks no remaining state's chain
        nor a queued fall-out's chain (written or not: its blocks on disk are not queued again) needs. Under the
        lock."""
        if self.stats.num_bytes <= self.max_bytes:
            return
        while self.stats.num_bytes > self.max_bytes and self._states:
            key = next(iter(self._states))
            self._forget_state(key)
            self._remove_file(self._state_path(key))
            self.stats.num_evicted_states += 1
            needed = set(self._queued) | set(self._pinned)
            for state in self._states.values():
                h = state.anchor_hash
                while h in self._blocks and h not in needed:
                    needed.add(h)
                    h = self._blocks[h].parent_hash
            for h in [h for h in self._blocks if h not in needed]:
                del self._blocks[h]
                self._remove_file(self._block_path(h))


def _checksum(data: torch.Tensor, metadata: dict[str, str]) -> str:
    """xxh64 of `data`'s bytes and of `metadata` (its "checksum" entry left out), so that a file whose header
    was changed (a tail token, a parent hash) fails as one whose bytes were."""
    digest = xxhash.xxh64(data.contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    return digest.hexdigest()


def _block_metadata(block: DiskBlock) -> dict[str, str]:
    """A block file's metadata of its record (`_write` writes it, `read` checks it; `_save` adds the rest)."""
    return {"kind": "block", "hash": str(block.hash), "parent": str(block.parent_hash),
            "tokens": json.dumps(list(block.token_ids))}


def _state_metadata(state: DiskState) -> dict[str, str]:
    """A state file's metadata of its record (`_write` writes it, `read` checks it; `_save` adds the rest)."""
    return {"kind": "state", "anchor": str(state.anchor_hash), "step": str(state.step),
            "tail": json.dumps(list(state.tail_ids)), "tail_hash": str(state.tail_hash), "reason": state.reason,
            "num_pages": str(state.num_pages), "frozen": "1" if state.has_frozen else "0"}


def _metadata(path: Path, kind: str) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT or metadata.get("kind") != kind:
        raise ValueError(f"not a {FORMAT} {kind} file")
    return metadata


def _save(path: Path, data: torch.Tensor, metadata: dict[str, str]) -> None:
    """Write `path` atomically (a temporary name, `_temp_name`, then a rename), with the format and checksum in its
    metadata; the temporary file is held under an flock until renamed (`_is_stale`: a lock no process holds is a
    write cut short), and deleted when the write fails."""
    data = data.contiguous()
    metadata = {"format": FORMAT, **metadata}
    tmp, fd = _create_temp(path)
    try:
        save_file({"data": data}, str(tmp), metadata={**metadata, "checksum": _checksum(data, metadata)})
        os.replace(tmp, path)
        _stamp(path)
    except BaseException:
        with contextlib.suppress(OSError):  # (a read-only folder: the write's own error goes on)
            tmp.unlink()
        raise
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock (after the rename: the temporary name is gone by then)


def _stamp(path: Path) -> None:
    """Set `path`'s mtime to now from the fine clock (`time.time_ns`). The kernel stamps a write with its coarse
    clock (one tick, ~4 ms, on ext4), so a write and a later read's touch could tie and the restarted tier's LRU
    order would fall to the listing's; every mtime the tier sets comes from here instead."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _create_temp(path: Path) -> tuple[Path, int | None]:
    """The temporary file a write of `path` goes to, created and locked (`LOCK_EX`) under `_temp_name(name, True)`,
    with the descriptor that holds the lock; on a file system without flock, the name without the lock's mark and
    no descriptor (`_is_stale` then goes by the writer's pid and process token)."""
    tmp = path.with_name(_temp_name(path.name, locked=True))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh name: no one else holds it
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        return path.with_name(_temp_name(path.name, locked=False)), None
    return tmp, fd


def _temp_name(name: str, locked: bool) -> str:
    """The temporary name a write of file `name` goes to: `<name>.tmp<pid>.<process token>-<uuid>[.locked]@<host>`,
    unique to the write (two engines of one process, or of two machines on a shared folder, never share one) and
    telling `_is_stale` which process instance writes it (its pid and `_PROCESS_TOKEN`, on which host) and whether
    it holds an flock on it while it writes."""
    lock_mark = ".locked" if locked else ""
    return f"{name}.tmp{os.getpid()}.{_PROCESS_TOKEN}-{uuid.uuid4().hex}{lock_mark}@{socket.gethostname()}"


def _is_stale(path: Path, now: float) -> bool:
    """Whether temporary file `path` is a write cut short, to delete at start-up. Of this machine (`_temp_name`'s
    host), unless it is this process's own (pid and process token): one written under a lock that no process holds
    now (the kernel drops a killed writer's locks, whatever process has its pid since: the PID 1 of a restarted
    container, same pid and hostname, holds none), or, where the lock cannot tell (a name without the lock's mark,
    a file system without flock, an empty file), one whose writer's pid is this process's under another token (a
    previous life of this pid) or no live process. Any other (another machine's, held locked, a name of an older
    version with a live pid): older than `STALE_TEMP_SECONDS`. Another engine's write in flight on a shared folder
    (Ray Serve replicas; an engine of this process too) stays."""
    match = _TEMP.search(path.name)
    if match is not None and match["host"] == socket.gethostname():
        pid, token = int(match["pid"]), match["token"]
        own = pid == os.getpid() and token == _PROCESS_TOKEN
        unheld = None if own or not match["locked"] else _lock_unheld(path)
        if unheld or (unheld is None and not own and (
                (pid == os.getpid() and token is not None) or not _process_alive(pid))):
            return True
    try:
        return now - path.stat().st_mtime > STALE_TEMP_SECONDS
    except OSError:  # renamed or deleted by its writer since the listing
        return False


def _lock_unheld(path: Path) -> bool | None:
    """Whether no process holds an flock on `path` (True: its writer is gone); None when that cannot be told (a
    file system without flock; an empty file, which its writer may have created and not locked yet)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # renamed or deleted by its writer since the listing
        return False
    try:
        if os.fstat(fd).st_size == 0:
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return False if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)  # (releases the lock it took)
    return True


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
