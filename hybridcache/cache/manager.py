"""`PrefixCache`: the one facade the scheduler (and the simulator) drives. See docs/cache.md.

One step of the engine, as the cache sees it::

    m = cache.match(req)                  # pins the checkpoint it would restore
    a = cache.admit(m, n, token_ids)      # runtime slot + blocks; restore copies queued (or None: no room);
                                          # token_ids: the caller's token list, which the cache reads, never copies
    cache.ensure_capacity(rid, n)         # grow the block list to hold n tokens (False: no room, no trace)
    cache.reserve_save(rid, step, reason) # slot (+ frozen block) for a save at the end of this step's chunk
    copies = cache.commit_step(fed)       # the forward is being queued: insert full blocks, publish saves,
                                          # release restore pins, return this step's CopyPlan
    # engine, on one stream: restore copies -> forward -> save copies, before any later cache call
    rollback = cache.accept(acc)          # once the step's tokens are known: the value of each fed PENDING_TOKEN
                                          # (async scheduling), the kept prefix of each row's drafts (speculative
                                          # decoding); full blocks join the trie, STATE_ROLLBACK copies returned
    cache.finish(rid)                     # the slot and partial block become a FINISH checkpoint

Locking rules: single-threaded (one caller at a time). Pins are taken by `match` and by `reserve_save` and
dropped by `release_match` or by the next `commit_step`; nothing pinned is evicted or released. A match that
pins a host-tier checkpoint also holds the block of the deepest device node above it (its *frontier*), so the
chain it will be promoted onto stays on the device until `admit` or `release_match`.

Who does what: this facade keeps the per-sequence bookkeeping (`RunningSeq`: how many of its tokens are fed,
blocks, trie nodes, slot, pending restores and saves; the token list itself is the caller's) and the pending
matches, reads the trie to match, and asks the admission policy (`_decline_cause`) whether a save is worth
making. `Lifecycle` (lifecycle.py) owns the pools, the checkpoints' states and every change to the trie; its
`Evictor` (evictor.py) picks eviction victims.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import xxhash

from hybridcache.cache.admission import LearnedAdmission
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.events import CacheEvent, CacheEventLog, EventKind
from hybridcache.cache.host_tier import TierBehind
from hybridcache.cache.integrity import check_integrity
from hybridcache.cache.lifecycle import Lifecycle, checkpoint_event
from hybridcache.cache.matching import divergence, find_deepest, walk_prompt
from hybridcache.cache.plan import CopyKind, CopyPlan, PlanBuilder
from hybridcache.cache.policy import make_admission_policy
from hybridcache.cache.request import Admitted, CacheRequest, MatchResult, Probe, SaveReason
from hybridcache.cache.sequence import PENDING_TOKEN, RunningSeq
from hybridcache.cache.stats import CacheStats, DeclineCause, StatsCounter
from hybridcache.cache.trie import HashFn, Node, Trie, chain_hash, path_to, prompt_block_hashes


class PrefixCache:
    """Block trie + exact-step state checkpoints for hybrid models; deals only in ids, emits copy plans.

    `hash_fn` replaces the chained block hash (tests use it to force collisions). `tier_behind`: a tier behind
    the host tier (host_tier.py, `TierBehind`: the engine's disk tier).
    """

    def __init__(
        self, config: CacheConfig, cost_model: CostModel | None = None, *, hash_fn: HashFn = chain_hash,
        tier_behind: TierBehind | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.cost_model = cost_model or CostModel()
        self._trie = Trie(hash_fn)
        self._stats = StatsCounter()
        self._life = Lifecycle(config, self.cost_model, self._trie, self._stats)
        if tier_behind is not None:
            self._life.attach_behind(tier_behind)
        self._admission = make_admission_policy(config)
        self._learner = (
            LearnedAdmission(
                capacity=config.checkpoint_capacity,
                cheap_tokens=config.state_pages * config.block_size if config.state_pages else float("inf"),
            )
            if config.admission == "learned" else None
        )
        if self._learner is not None:
            learner = self._learner
            self._life.on_waste = lambda ckpt: learner.wasted(ckpt.reason, ckpt.adapter)
        self._seqs: dict[Hashable, RunningSeq] = {}
        self._matches: dict[int, tuple[CacheRequest, Checkpoint | None, list[Node]]] = {}
        self._next_match_id = 0
        self._finish_saves: list[tuple[Checkpoint, int]] = []  # paged: (checkpoint, freed runtime slot)
        self._host_holds: dict[int, Node] = {}  # match id -> device node whose block a host hit holds
        self._skips: set[int] = set()  # match ids whose deeper host hit did not pay for its copy

    # ---- admission ---------------------------------------------------------------------------------------

    def match(self, request: CacheRequest, max_step: int | None = None) -> MatchResult:
        """Find the deepest usable checkpoint for `request` and pin it. Changes nothing else.

        Walks the trie from the request's root (its adapter and cache salt) with the prompt's full blocks (exact
        tokens and spans), then takes the deepest published checkpoint on that path with step <= `max_step`
        (default and upper bound: `max_match_step(request)`), at a safe boundary, whose tail equals the prompt
        there. The result must go to `admit` or `release_match` exactly once. With `full_prompt_hits`,
        `cached_len == prompt_len` is a zero-prefill hit: the restored slot holds the last prompt position's hidden
        state, and the caller samples from it. `max_step=0` asks for a miss (a caller whose hit found no room: a
        hit holds its pinned path and frozen tail next to a private copy of the tail, so it can need one block more).
        `request.skip_reading`: always a miss (the divergence step is still found, for a branch-point save).
        """
        size = self.block_size
        max_step = self.max_match_step(request) if max_step is None else min(max_step, self.max_match_step(request))
        if max_step < 0:
            raise ValueError(f"max_step must be >= 0, got {max_step}")
        path = walk_prompt(self._trie, request, size)
        ckpt = find_deepest(self._trie, path, request, size, max_step) if path and not request.skip_reading else None
        match_id = self._next_match_id
        self._next_match_id += 1
        host = self._life.host
        hosts = host.continuation(path, request, size) if host is not None else []
        if host is not None and path and not request.skip_reading:
            deeper = host.find(path, hosts, request, size, max_step)
            start = ckpt.step if ckpt is not None else 0
            if deeper is not None and deeper.step > start:
                copy_bytes = self._life.promote_need(deeper) * self._life.block_bytes
                if self.cost_model.promotion_pays(copy_bytes, start, deeper.step):
                    ckpt = deeper
                    self._hold(match_id, host.chain(deeper)[0])
                else:
                    self._skips.add(match_id)
        cached_len = ckpt.step if ckpt is not None else 0
        if host is None:
            found = [divergence(self._trie, path, request, size, max_step)]
        elif hosts:  # the host nodes continue the path: the host tier's divergence lies deeper
            found = [divergence(self._trie, path, request, size, max_step),
                     host.divergence(path, hosts, request, size, max_step)]
        else:  # the path's last node in both tiers
            found = [host.divergence(path, hosts, request, size, max_step)]
        branch_len = max(cached_len, *(d.step for d in found))
        branch_count = max(1, sum(d.num_continuations for d in found if d.step == branch_len))
        if ckpt is not None:
            self._life.pin(ckpt)
        self._matches[match_id] = (request, ckpt, path)
        return MatchResult(
            match_id=match_id,
            request_id=request.request_id,
            cached_len=cached_len,
            block_ids=tuple(n.block_id for n in path[1:cached_len // size + 1]),
            checkpoint_id=None if ckpt is None else ckpt.ckpt_id,
            checkpoint_reason=None if ckpt is None else ckpt.reason,
            divergence_len=branch_len,
            divergence_count=branch_count,
            routed_experts=None if ckpt is None else ckpt.routed_experts,
        )

    def probe(self, request: CacheRequest) -> Probe:
        """What `match` would find for `request` now, as a dry run: no pin, no hold, no match entry, no recency
        change (LRU order, stats and `check_integrity` are as before). `kv_len`: tokens of the prompt's full
        blocks in the device trie; `cached_len`: the step of the deepest usable checkpoint (what a hit would
        skip), a host-tier one where `match` would take it (deeper than the device's and its promotion pays).
        A tier behind the host (the disk) is not read: `match` may still find a deeper hit there."""
        size = self.block_size
        max_step = self.max_match_step(request)
        path = walk_prompt(self._trie, request, size)
        ckpt = find_deepest(self._trie, path, request, size, max_step) if path and not request.skip_reading else None
        cached_len = 0 if ckpt is None else ckpt.step
        host = self._life.host
        if host is not None and path and not request.skip_reading:
            # match's host step without `find`'s fault-in from the tier behind (which would change the host tier)
            deeper = host._find(path, host.continuation(path, request, size), request, size, max_step)
            if deeper is not None and deeper.step > cached_len and self.cost_model.promotion_pays(
                    self._life.promote_need(deeper) * self._life.block_bytes, cached_len, deeper.step):
                cached_len = deeper.step
        return Probe(kv_len=max(len(path) - 1, 0) * size, cached_len=cached_len)

    def enable_events(self, capacity: int = 65536) -> CacheEventLog:
        """Start telling what the trie and the checkpoints store and drop into a new bounded log (events.py),
        and return it. Events start now: a reader first takes `snapshot_events` (same thread as the cache)."""
        self._life.events = CacheEventLog(capacity)
        return self._life.events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no one holds now (growth up to them evicts nothing)."""
        return self._life.blocks.num_free

    @property
    def events(self) -> CacheEventLog | None:
        return self._life.events

    def snapshot_events(self) -> list[CacheEvent]:
        """Everything the cache holds now as stored events, parents before children: replaying them into an
        empty index gives what the events since would have built from the start."""
        events = []
        for node in self._trie.iter_nodes():
            if not node.is_root:
                events.append(CacheEvent(EventKind.BLOCK_STORED, block_hash=node.hash, parent_hash=node.parent.hash,
                                         depth=node.depth, adapter=node.adapter))
            events.extend(checkpoint_event(EventKind.CHECKPOINT_STORED, c) for c in node.iter_checkpoints())
        return events

    def max_match_step(self, request: CacheRequest) -> int:
        """The deepest step a match may return: prompt_len with `full_prompt_hits`, else prompt_len - 1."""
        return request.prompt_len - (0 if self.config.full_prompt_hits else 1)

    def admit(self, match: MatchResult, num_tokens: int = 0, token_ids: list[int] | None = None) -> Admitted | None:
        """Start a running sequence from `match`: a runtime slot, the shared full blocks, and when the hit is
        partial one private block that the frozen tail is restored into (copies queued for the next
        `commit_step`), plus private blocks so that it holds `num_tokens` tokens in all (its first chunk).
        `token_ids`: the sequence's token list, owned by the caller (it must start with the prompt): the cache
        keeps this very list, reads its first `num_computed` entries and writes none the caller holds (see
        `RunningSeq`); None: the cache makes one from the prompt, and `commit_step` appends the fed tokens past it.
        Evicts under pressure. Returns None when there is no room; then nothing changed and the match is
        still pinned (retry later or `release_match`)."""
        entry = self._matches.get(match.match_id)
        if entry is None:
            raise ValueError(f"match {match.match_id} was already admitted or released")
        request, ckpt, path = entry
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id!r} is already running")
        if token_ids is None:
            token_ids = list(request.prompt_ids)
        elif tuple(token_ids[:request.prompt_len]) != request.prompt_ids:
            raise ValueError(f"the token list given for {request.request_id!r} does not start with its prompt")
        life = self._life
        cached_len = match.cached_len
        partial = cached_len % self.block_size != 0
        num_shared = cached_len // self.block_size
        num_blocks = max(-(-num_tokens // self.block_size), num_shared + partial)
        from_host = ckpt is not None and ckpt.on_host
        if from_host and not life.can_promote(ckpt):
            return None
        if not life.make_room(num_blocks - num_shared + (life.promote_need(ckpt) if from_host else 0), 1):
            return None
        del self._matches[match.match_id]
        if match.match_id in self._skips:
            self._skips.discard(match.match_id)
            self._stats.num_promotions_skipped += 1
        if from_host:
            life.promote(ckpt, life.tick())
        self._unhold(match.match_id)  # the pinned checkpoint is on the device now and protects its chain
        if from_host:
            self._rehome_holds()
            self._stats.num_host_hits += 1
            self._stats.num_host_hit_tokens += cached_len
        seq = RunningSeq(request=request, token_ids=token_ids,
                         slot=life.take_slot(RunningSeq.slot_owner_of(request.request_id)))
        now = life.tick()
        self._stats.num_queries += 1
        self._stats.num_query_tokens += request.prompt_len
        if ckpt is not None:
            seq.nodes = path_to(ckpt.anchor)
            seq.block_ids = [n.block_id for n in seq.nodes]
            if tuple(seq.block_ids[:len(match.block_ids)]) != match.block_ids:
                raise AssertionError(f"match {match.match_id} blocks changed while pinned")
            life.share_path(seq.nodes, ckpt, now)
            if partial:
                seq.block_ids.extend(life.take_blocks(1))
                seq.restore_copies.append((CopyKind.KV_RESTORE, ckpt.frozen_block, seq.block_ids[-1]))
            seq.restore_copies.extend(
                (CopyKind.STATE_RESTORE, saved, runtime) for runtime, saved in self._state_pairs(seq.slot, ckpt)
            )
            seq.restore = ckpt
            seq.num_computed = cached_len
            self._stats.num_hits += 1
            self._stats.num_hit_tokens += cached_len
            self._stats.hits_by_reason[ckpt.reason.value] += 1
            if self._learner is not None and not ckpt.was_hit:
                self._learner.used(ckpt.reason, ckpt.adapter, cached_len)
            ckpt.was_hit = True
            life.set_shadowed(ckpt, False)  # it serves more than its chain: not first to go any more
            if ckpt.reason.is_turn_end:
                seq.shadows = ckpt
        if self._learner is not None and path:
            keys = [(request.root_key, d, node.hash if d else 0) for d, node in reversed(list(enumerate(path)))]
            self._learner.ghost_hit(keys, request.prompt_ids, self.block_size, cached_len,
                                    self.max_match_step(request))
        seq.block_ids.extend(life.take_blocks(num_blocks - len(seq.block_ids)))
        self._seqs[request.request_id] = seq
        return Admitted(request.request_id, seq.slot, tuple(seq.block_ids), seq.num_computed)

    def release_match(self, match: MatchResult) -> None:
        """Give up a match that will not be admitted: drops its pin; nothing else had changed."""
        entry = self._matches.pop(match.match_id, None)
        if entry is None:
            raise ValueError(f"match {match.match_id} was already admitted or released")
        self._skips.discard(match.match_id)
        self._unhold(match.match_id)
        if entry[1] is not None:
            self._life.unpin(entry[1])

    # ---- host-tier holds ---------------------------------------------------------------------------------

    def _hold(self, match_id: int, frontier: Node) -> None:
        """A match pinned a host checkpoint below `frontier`: hold the frontier's block (a root has none)."""
        if not frontier.is_root:
            self._life.blocks.incref(frontier.block_id)
            self._host_holds[match_id] = frontier

    def _unhold(self, match_id: int) -> None:
        frontier = self._host_holds.pop(match_id, None)
        if frontier is not None:
            self._life.blocks.decref(frontier.block_id)

    def _rehome_holds(self) -> None:
        """A promotion or a device insert turned host nodes into device nodes: every pending host hit holds the
        deepest device node above its checkpoint again (the old frontier is an ancestor of the new one)."""
        host = self._life.host
        for match_id in list(self._host_holds):
            ckpt = self._matches[match_id][1]
            frontier = host.chain(ckpt)[0] if ckpt.on_host else None  # None: another match's admission promoted it
            if frontier is not self._host_holds[match_id]:
                self._unhold(match_id)
                if frontier is not None:
                    self._hold(match_id, frontier)

    # ---- per step ----------------------------------------------------------------------------------------

    def ensure_capacity(self, request_id: Hashable, num_tokens: int) -> bool:
        """Grow the sequence's block list to hold `num_tokens` tokens in all (new blocks are private),
        evicting under pressure. False when there is no room; then nothing changed."""
        seq = self._seq(request_id)
        need = -(-num_tokens // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        if not self._life.make_room(need, 0):
            return False
        seq.block_ids.extend(self._life.take_blocks(need))
        return True

    def reserve_save(
        self, request_id: Hashable, step: int, reason: SaveReason | str, routed_experts: Any = None,
    ) -> bool:
        """Reserve a checkpoint at `step`, which must be where this step's chunk of the sequence ends.

        Takes a slot, and a frozen block when `step % B != 0`, evicting under pressure. Returns False
        (counted in `stats.declined_saves`) when the step is inside a multimodal span, when the tail is
        partial and the request wants routed experts but `routed_experts` (the tail's history) is None,
        when the admission policy declines, or when there is no room. Published by the next `commit_step`.
        """
        seq = self._seq(request_id)
        reason = SaveReason(reason)
        size = self.block_size
        if not seq.num_computed < step <= len(seq.block_ids) * size:
            raise ValueError(
                f"save step {step} of {request_id!r} not in ({seq.num_computed}, {len(seq.block_ids) * size}]"
            )
        if reason is SaveReason.DECODE_INTERVAL and step % size:
            raise ValueError(f"decode-interval save at step {step} is not block-aligned")
        if reason in (SaveReason.FINISH, SaveReason.PREEMPT):
            raise ValueError(f"{reason.value} checkpoints are made by finish() / preempt()")
        request = seq.request
        if any(c.step == step for c in seq.saves):
            cause = DeclineCause.DUPLICATE
        else:
            cause = self._decline_cause(seq, step, reason, routed_experts, key_needed=True)
        if cause is None:
            ckpt = self._life.reserve(request.root_key, step, reason, routed_experts, request.request_id)
            if ckpt is not None:
                seq.saves.append(ckpt)
                return True
            cause = DeclineCause.NO_ROOM
        self._stats.declined(cause)
        return False

    def _decline_cause(
        self, seq: RunningSeq, step: int, reason: SaveReason, routed_experts: Any, *, key_needed: bool,
    ) -> DeclineCause | None:
        """Why a save at `step` must not be made, checked in this order; None when it may be.

        The admission point: the policy (policy.py) sees the reason and, when it asks for one (`needs_key`)
        and `key_needed`, the identity of the prompt prefix [0, step) (finish/preempt pass no key). With
        `admission='learned'` the learner decides per reason and adapter, and remembers what it declines, but
        only when the save would displace something: a save that fits in free memory is always made (on a
        server with room to spare, traffic that never reuses its finish checkpoints must not cost an agent
        its next turn's hit).
        """
        request = seq.request
        if not request.is_safe(step):
            return DeclineCause.UNSAFE
        if step % self.block_size and request.routed_experts and routed_experts is None:
            return DeclineCause.ROUTED_EXPERTS
        key = self._prefix_key(request, step) if key_needed and self._admission.needs_key else None
        if not self._admission.admit(reason, key):
            return DeclineCause.POLICY
        learner = self._learner
        if learner is not None and not self._fits_free_memory() and not learner.admit(reason, request.adapter):
            ghost = self._ghost(seq, step)
            if ghost is not None:
                learner.declined(reason, request.adapter, *ghost)
            return DeclineCause.POLICY
        return None

    def saves_branch_point(self, step: int, count: int = 1) -> bool:
        """Whether a branch point at `step` (where a prompt diverges from cached content) is worth a checkpoint:
        when the prefill it would have saved the `count` cached continuations that leave the prompt there
        (`MatchResult.divergence_count`), `step x count`, reaches `config.min_branch_point_step`, the tokens whose
        KV weighs one state. A 1,000-token system prompt is saved by the fifth conversation on it when a state
        weighs 3,200 tokens (4 x 1,000 >= 3,200); `count` 1 (a hint step, or one cached continuation) asks for
        `step` alone to reach it. The scheduler ends no chunk (and saves nothing) at one that is not; in-flight
        forks, which a waiting sequence will restore, are not judged by it."""
        return step * count >= self.config.min_branch_point_step

    def _fits_free_memory(self) -> bool:
        """Whether one more checkpoint fits without evicting: k free pages and a frozen block (two pools: a
        free slot and a free block)."""
        free = self._life.blocks.num_free
        if self.config.paged:
            return free > self.config.state_pages
        return free > 0 and self._life.slots.num_free > 0

    def _ghost(self, seq: RunningSeq, step: int) -> tuple[tuple, int, tuple[int, ...]] | None:
        """(ghost key, step, tail tokens) of a save at `step` (None past the prompt before its blocks are in
        the trie: not remembered)."""
        size, request = self.block_size, seq.request
        q = step // size
        if step <= request.prompt_len:
            anchor = prompt_block_hashes(request, size, self._trie.hash_fn)[q - 1] if q else 0
            tokens: Sequence[int] = request.prompt_ids
        elif len(seq.nodes) >= q and seq.num_computed >= step:
            anchor = seq.nodes[q - 1].hash if q else 0
            tokens = seq.token_ids
        else:
            return None
        return (request.root_key, q, anchor), step, tuple(tokens[q * size:step])

    def _prefix_key(self, request: CacheRequest, step: int) -> Hashable:
        """Identity of the prompt prefix [0, step) for admission bookkeeping (branch points only)."""
        h = xxhash.xxh64(array("q", request.prompt_ids[:step]).tobytes())
        h.update(repr(request.spans_in(0, step)).encode())
        return (request.root_key, step, h.intdigest())

    def commit_step(
        self, fed: Mapping[Hashable, Sequence[int]], drafts: Mapping[Hashable, int] | None = None,
    ) -> CopyPlan:
        """The forward of this step is being queued; `fed` maps each scheduled sequence to its new tokens, which
        must equal its token list where the list holds them (the prompt; with a caller's list, every token: the
        scheduler feeds from that list) and are appended to it past its end.
        `drafts` (speculative decoding) maps a decoding sequence to how many of its fed tokens, at the end, are
        drafts (1 .. `num_speculative_tokens`): they are not its tokens yet (no block fills with them, nothing is
        saved at them, they are not compared with nor put in its list; their KV lands in its private blocks)
        until `accept` keeps a prefix of them, which must come before the next `commit_step`.

        In order: every block that became full is inserted into the trie (deduplicated onto an identical
        node: the sequence's own block is freed and it shares the canonical one from the next step on),
        the step's saves are published (their STATE_SAVE / KV_SAVE copies emitted), restore pins and save
        pins are dropped. Paged: the state copies of sequences retired since the last commit with a checkpoint
        (`finish`, `preempt`) come first, as STATE_FINISH; those checkpoints stay pinned until the plan is built,
        since a demotion in this plan would queue a HOST_SAVE of their pages, and host ops run before STATE_FINISH.
        A decoding sequence may feed `PENDING_TOKEN` as its last token (async scheduling:
        the previous step's sample is still on the device) when it saves nothing in this step; a block that
        fills with it joins the trie at `accept`, which gives its value. Returns this step's copies: restores
        queued by `admit` since the last commit, and the saves. The caller must enqueue restore copies, the
        forward, then save copies, on one stream, before its next cache call: that ordering is what makes freeing
        a deduplicated block and dropping the pins safe here (any later writer of those ids is queued after).
        """
        drafts = drafts or {}
        self._check_fed(fed, drafts)
        builder = PlanBuilder(paged_states=self.config.paged)
        finishing: list[Checkpoint] = []
        for ckpt, slot in self._finish_saves:
            if ckpt.state is not CheckpointState.RELEASED:  # released since (evicted, a duplicate): nothing to save
                kind = CopyKind.HOST_FINISH if ckpt.on_host else CopyKind.STATE_FINISH  # demoted since: to the host
                for chunk, page in self._state_pairs(slot, ckpt):
                    builder.add(kind, chunk, page)
                    if ckpt.on_host:  # the host page holds the state only once this plan has run
                        self._life.host.finishing(page)
                if not ckpt.on_host:  # this plan's host ops run before its STATE_FINISH: no demotion until built
                    self._life.pin(ckpt)
                    finishing.append(ckpt)
            ckpt.unwritten = False  # written before anything later in this plan reads its pages
        self._finish_saves = []
        for seq in self._seqs.values():
            for kind, src, dst in seq.restore_copies:
                builder.add(kind, src, dst)
        for rid, tokens in fed.items():
            seq = self._seqs[rid]
            num_drafts = drafts.get(rid, 0)
            end = seq.num_computed + len(tokens) - num_drafts
            seq.token_ids.extend(tokens[len(seq.token_ids) - seq.num_computed:len(tokens) - num_drafts])
            seq.num_computed = end
            seq.pending = tokens[len(tokens) - num_drafts - 1] == PENDING_TOKEN
            seq.num_drafts = num_drafts
            self._insert_full_blocks(seq)
        published: list[Checkpoint] = []
        for seq in self._seqs.values():
            for ckpt in seq.saves:
                if self._publish_save(seq, ckpt, builder):
                    published.append(ckpt)
            seq.saves = []
        for seq in self._seqs.values():
            self._drop_restore(seq)
        for ckpt in (*published, *finishing):
            self._life.unpin(ckpt)
        if self._life.host is not None:  # demotions and promotions since the last plan, saves first
            saves, loads = self._life.host.end_step()
            for device_block, host_block in saves:
                builder.add(CopyKind.HOST_SAVE, device_block, host_block)
            for host_block, device_block in loads:
                builder.add(CopyKind.HOST_LOAD, host_block, device_block)
        self._life.prune_roots()
        return builder.build()

    def _check_fed(self, fed: Mapping[Hashable, Sequence[int]], drafts: Mapping[Hashable, int]) -> None:
        """Raise `ValueError` (before anything changes) unless every fed sequence has room for its tokens,
        they equal its token list where it holds them (drafts excepted), a `PENDING_TOKEN` is only the last token
        of a decoding sequence that saves nothing, no sequence feeds before its previous pending token's value
        is given, every reserved save is at the end of its chunk, no sequence has drafts still to be judged, and
        drafts are fed only by decoding sequences that save nothing and feed a token before them."""
        size = self.block_size
        unjudged = [rid for rid, seq in self._seqs.items() if seq.num_drafts]
        if unjudged:
            raise ValueError(f"{unjudged!r} have drafts not judged yet (accept comes before the next step)")
        for rid, num_drafts in drafts.items():
            tokens = fed.get(rid)
            seq = self._seq(rid)
            if tokens is None or not 0 < num_drafts < len(tokens) or num_drafts > self.config.num_speculative_tokens:
                raise ValueError(f"{rid!r}: {num_drafts} drafts in {0 if tokens is None else len(tokens)} fed tokens "
                                 f"(at most num_speculative_tokens = {self.config.num_speculative_tokens}, after "
                                 "at least one token)")
            if seq.num_computed < seq.request.prompt_len or seq.saves or PENDING_TOKEN in tokens:
                raise ValueError(f"{rid!r} feeds drafts but is not a decoding sequence that saves nothing")
        for rid, tokens in fed.items():
            seq = self._seq(rid)
            if seq.pending:
                raise ValueError(f"{rid!r} feeds again before its pending token's value is given (accept)")
            new_len = seq.num_computed + len(tokens)
            if not tokens or new_len > len(seq.block_ids) * size:
                raise ValueError(f"{rid!r} feeds {len(tokens)} tokens, room for {len(seq.block_ids) * size}")
            held = seq.token_ids[seq.num_computed:new_len - drafts.get(rid, 0)]
            if tuple(tokens[:len(held)]) != tuple(held):
                raise ValueError(f"{rid!r} feeds tokens that differ from its prompt or token list")
            overlap = seq.request.prompt_len - seq.num_computed  # > 0: the chunk is in the prompt
            if PENDING_TOKEN in tokens and (tokens.index(PENDING_TOKEN) != len(tokens) - 1 or overlap > 0
                                            or seq.saves):
                raise ValueError(f"{rid!r} feeds a pending token other than as the last one of a decode step "
                                 "that saves nothing")
        for rid, seq in self._seqs.items():
            for ckpt in seq.saves:
                if rid not in fed or ckpt.step != seq.num_computed + len(fed[rid]):
                    raise ValueError(f"save at step {ckpt.step} of {rid!r} is not the end of its chunk")

    def _insert_full_blocks(self, seq: RunningSeq) -> None:
        """Put every block of `seq` that became full into the trie (deduplicated onto identical nodes); none
        when the cache keeps no blocks (`CacheConfig.keeps_blocks`: prefix caching off)."""
        if not self.config.keeps_blocks:
            return
        size, trie = self.block_size, self._trie
        request = seq.request
        parent = seq.nodes[-1] if seq.nodes else trie.root(request.adapter, request.cache_salt)
        num_full = seq.num_trie_blocks(size)
        if len(seq.nodes) >= num_full:  # no block became full (most decode steps): nothing to insert or re-index;
            return  # the last node is unchanged since it was inserted and indexed
        now = self._life.tick()
        prompt_hashes = prompt_block_hashes(request, size, trie.hash_fn)
        while len(seq.nodes) < num_full:
            i = len(seq.nodes)
            spans = request.spans_in(i * size, (i + 1) * size)
            if i < len(prompt_hashes):  # a prompt block: commit_step checked that the fed tokens are the prompt's
                tokens = request.prompt_ids[i * size:(i + 1) * size]
                node_hash = prompt_hashes[i]
            else:
                tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
                node_hash = trie.hash_fn(parent.hash, tokens, spans)
            node = self._life.insert_block(parent, node_hash, tokens, spans, seq.block_ids[i], now)
            seq.block_ids[i] = node.block_id
            seq.nodes.append(node)
            parent = node
        self._life.leaf_changed(seq.nodes[-1])  # every node inserted above but the last has a child now
        if self._host_holds:  # an insert may have absorbed a host node on a pending host hit's chain
            self._rehome_holds()

    def accept(self, accepted: Mapping[Hashable, Sequence[int]]) -> CopyPlan:
        """Once per step, when its sampled tokens are known: the tokens of the positions a sequence fed before
        their values were known. `accepted[rid]`, per running sequence:

        * drafts to judge (speculative decoding): the prefix of them it keeps, 0 .. n of its n drafts. They join
          its tokens; the others are dropped (their KV stays in its private blocks, overwritten when those
          positions are fed again). Drafts of a sequence not given stay unjudged: the next `commit_step` refuses
          to run until they are.
        * a pending last fed token (async scheduling, `PENDING_TOKEN`): its value, one token.
        * neither (a synchronous step's sample: the next step feeds it), or not running: nothing to take.

        The sequence's token list must hold each token, or `PENDING_TOKEN`, or end before it: the owner of the
        list writes it first and the cache checks; in a list the cache made, the cache writes them. Blocks that
        are now full of known tokens join the trie (deduplicated as in `commit_step`: the sequence's own copy is
        freed, which is safe for the same reason: every later writer of the id is queued after the forward that
        wrote it). Returns the `STATE_ROLLBACK` copies that make each slot hold the state after its last kept
        token (a sequence that keeps a < n drafts: its draft state a; keeping all n: nothing to copy), to run
        after the verify forward and before anything reads the slots. Raises ValueError, changing nothing, when
        a sequence keeps more drafts than it fed, a pending token is not given exactly one value, a token is
        negative, or a token differs from the one its list holds."""
        taken: list[tuple[RunningSeq, int, Sequence[int]]] = []
        for rid, tokens in accepted.items():
            seq = self._seqs.get(rid)
            if seq is None or not (seq.num_drafts or seq.pending):
                continue
            start = seq.num_computed if seq.num_drafts else seq.num_computed - 1
            if (len(tokens) > seq.num_drafts if seq.num_drafts else len(tokens) != 1) or any(t < 0 for t in tokens):
                what = f"{seq.num_drafts} drafts" if seq.num_drafts else "its pending token"
                raise ValueError(f"{rid!r}: {list(tokens)} cannot be the tokens of {what}")
            if not seq.check_tokens(start, tokens):
                raise ValueError(f"{rid!r} takes {list(tokens)} at {start}, where its token list holds others")
            taken.append((seq, start, tokens))
        builder = PlanBuilder(paged_states=self.config.paged)
        k = self.config.num_speculative_tokens
        for seq, start, tokens in taken:
            seq.put_tokens(start, tokens)
            if seq.num_drafts:
                if len(tokens) < seq.num_drafts:
                    builder.add(CopyKind.STATE_ROLLBACK, seq.slot * k + len(tokens), seq.slot)
                seq.num_computed += len(tokens)
                seq.num_drafts = 0
            seq.pending = False
            self._insert_full_blocks(seq)
        return builder.build()

    def _anchor_and_tail(self, seq: RunningSeq, step: int) -> tuple[Node, tuple[int, ...], tuple]:
        q = step // self.block_size
        anchor = seq.nodes[q - 1] if q else self._trie.root(seq.request.adapter, seq.request.cache_salt)
        base = q * self.block_size
        return anchor, tuple(seq.token_ids[base:step]), seq.request.spans_in(base, step)

    def _state_pairs(self, slot: int, ckpt: Checkpoint) -> list[tuple[int, int]]:
        """(runtime id, checkpoint id) pairs of a state copy between runtime slot `slot` and `ckpt`: paged, the
        slot's k chunks `slot * k + j` and the checkpoint's pages, in order (plan.py); else the two slots."""
        k = self.config.state_pages
        if k is None:
            return [(slot, ckpt.slot)]
        return list(zip(range(slot * k, slot * k + k), ckpt.pages))

    def _publish_save(self, seq: RunningSeq, ckpt: Checkpoint, builder: PlanBuilder) -> bool:
        anchor, tail, spans = self._anchor_and_tail(seq, ckpt.step)
        if not self._life.publish(ckpt, anchor, tail, spans):
            return False
        self._shadow_source(seq)
        for runtime, saved in self._state_pairs(seq.slot, ckpt):
            builder.add(CopyKind.STATE_SAVE, runtime, saved)
        if ckpt.frozen_block is not None:
            builder.add(CopyKind.KV_SAVE, seq.block_ids[ckpt.step // self.block_size], ckpt.frozen_block)
        if ckpt.reason is SaveReason.DECODE_INTERVAL:
            if seq.decode_ckpt is not None:
                self._life.replace_decode_checkpoint(seq.decode_ckpt)
            seq.decode_ckpt = ckpt
        return True

    # ---- end of a sequence -------------------------------------------------------------------------------

    def finish(self, request_id: Hashable, routed_experts: Any = None) -> bool:
        """The sequence is done (after its last forward was queued): save a FINISH checkpoint at the exact
        step of all fed tokens by taking over its runtime slot and private partial block (zero copies;
        paged: pages are taken and the slot's copy into them is queued for the next plan, STATE_FINISH), and
        drop its other blocks. `routed_experts` is the tail's routed-expert history, if known.
        Returns whether a checkpoint was published (False: declined or identical one already cached)."""
        seq = self._seq(request_id)
        if seq.has_pending_work:
            raise ValueError(f"finish of {request_id!r} with uncommitted restores or saves, or drafts not judged")
        if seq.pending:
            raise ValueError(f"finish of {request_id!r} before its pending token's value is given (accept)")
        return self._retire(seq, SaveReason.FINISH, routed_experts, keep=True)

    def preempt(self, request_id: Hashable, keep_checkpoint: bool = True) -> bool:
        """Stop a running sequence and release what it holds; it may be called while a step is being
        planned (its reservations and queued restores are cancelled). With `keep_checkpoint`, its slot and
        partial block become a PREEMPT checkpoint at its computed step (as in `finish`), so the re-queued
        request hits; skipped when it was admitted in the step being planned (its slot is not restored
        yet). Returns whether a checkpoint was published."""
        seq = self._seq(request_id)
        restored_now = seq.restore is not None
        self._cancel_pending(seq)
        return self._retire(seq, SaveReason.PREEMPT, None, keep=keep_checkpoint and not restored_now)

    def abort(self, request_id: Hashable) -> None:
        """Drop a running sequence and everything it holds (pending restores and saves included)."""
        seq = self._seq(request_id)
        self._cancel_pending(seq)
        self._retire(seq, SaveReason.PREEMPT, None, keep=False)

    def _cancel_pending(self, seq: RunningSeq) -> None:
        seq.num_drafts = 0  # its draft KV lies in its private blocks, dropped with them
        for ckpt in seq.saves:
            self._life.cancel(ckpt)
        seq.saves = []
        self._drop_restore(seq)

    def _drop_restore(self, seq: RunningSeq) -> None:
        """The restore queued at admission is committed or cancelled: drop its pin and copies."""
        if seq.restore is not None:
            self._life.unpin(seq.restore)
            seq.restore = None
            seq.restore_copies = []

    def _shadow_source(self, seq: RunningSeq) -> None:
        """`seq` just published a checkpoint: the one it was restored from (a turn end), on the same chain and
        shallower, is shadowed by it (`Checkpoint.shadowed`)."""
        if seq.shadows is not None:
            self._life.set_shadowed(seq.shadows, True)
            seq.shadows = None

    def _retire(self, seq: RunningSeq, reason: SaveReason, routed_experts: Any, keep: bool) -> bool:
        """Drop a sequence; with `keep`, its slot and partial block become a `reason` checkpoint at its
        computed step (when one is allowed there). Returns whether that checkpoint was published."""
        life, size = self._life, self.block_size
        step = seq.num_computed
        request = seq.request
        if keep and step > 0:
            cause = self._decline_cause(seq, step, reason, routed_experts, key_needed=False)
            if cause is not None:
                self._stats.declined(cause)
                keep = False
        published = False
        blocks = list(seq.block_ids)
        ckpt = None
        if keep and step > 0 and life.paged:  # a duplicate would take k pages (and evict) only to be discarded
            anchor, tail, spans = self._anchor_and_tail(seq, step)
            key = life.checkpoint_key(anchor, step, tail, spans)
            if life.absorb_duplicate(anchor, key, tail, spans, routed_experts):
                self._stats.declined(DeclineCause.DUPLICATE)
                keep = False
        if keep and step > 0:
            frozen = blocks[step // size] if step % size else None
            ckpt = life.adopt(
                request.root_key, step, reason, seq.slot, frozen, routed_experts, request.request_id
            )
            if ckpt is None:
                self._stats.declined(DeclineCause.NO_ROOM)
            else:
                if frozen is not None:
                    blocks.pop(step // size)
                anchor, tail, spans = self._anchor_and_tail(seq, step)
                published = life.publish(ckpt, anchor, tail, spans)
                if published:
                    self._shadow_source(seq)
                    if self.config.paged:
                        self._finish_saves.append((ckpt, seq.slot))
                        ckpt.unwritten = True
        if ckpt is None or self.config.paged:
            life.free_slot(seq.slot)
        life.drop_blocks(blocks)
        del self._seqs[request.request_id]
        return published

    # ---- queries and maintenance -------------------------------------------------------------------------

    def _seq(self, request_id: Hashable) -> RunningSeq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not running")
        return seq

    def block_ids(self, request_id: Hashable) -> tuple[int, ...]:
        """The sequence's blocks in order (block i holds positions [i*B, (i+1)*B))."""
        return tuple(self._seq(request_id).block_ids)

    def slot(self, request_id: Hashable) -> int:
        return self._seq(request_id).slot

    def num_computed(self, request_id: Hashable) -> int:
        """Tokens the sequence has in the cache (its cached prefix plus everything fed)."""
        return self._seq(request_id).num_computed

    def running_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def clear(self) -> None:
        """Drop every cached thing that is not pinned and not held by a running sequence, and what the tier behind
        the host keeps (the disk tier's files: `TierBehind.clear`)."""
        self._life.clear()

    def keep_behind(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Hand every checkpoint the cache holds, the host tier's then the device pool's published ones (deepest
        first), to the tier behind the host (`tier_behind`), which keeps what it can; the cache is unchanged. For
        shutdown: without it, only what the host's own eviction dropped would be behind. `progress(done, total)`
        after each. Returns how many were handed (0 without a host tier or a tier behind)."""
        host = self._life.host
        if host is None:
            return 0
        device = sorted((c for c in self._life.published() if not c.on_host), key=lambda c: -c.step)
        return host.hand_behind(device, progress)

    @property
    def stats(self) -> CacheStats:
        host = self._life.host
        return self._stats.snapshot(
            **self._life.usage(), num_nodes=self._trie.num_nodes, num_running=len(self._seqs),
            num_host_dropped=0 if host is None else host.num_dropped,
        )

    def check_integrity(self) -> None:
        """Recompute every count from scratch; raise `IntegrityError` with a precise message on a mismatch."""
        check_integrity(self._life, self._seqs, [ckpt for _request, ckpt, _path in self._matches.values()],
                        list(self._host_holds.values()))
