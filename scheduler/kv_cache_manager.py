"""Per-request block tables on top of the BlockPool, prefix-cache lookups, and the CPU swap pool.

The manager answers mechanism questions ("does it fit?", "which blocks?") and never decides policy:
``allocate_slots`` returns None when blocks are short and the Scheduler decides whom to pre-empt.

Safety rule for the prefix cache: a block is registered under its hash once every token in it is
known *and* scheduled, by the plan being built or an earlier one. Plans run in order, and within a
step the executor writes every token's KV (``kernels.write_kv``) before any attention of the same
layer reads the cache, so a request admitted later in the same step may already share the block: as
in vLLM V1, requests that arrive together with a common prefix compute it once. The scheduler calls
``cache_full_blocks`` right after it schedules a request's tokens, and never un-schedules a request
whose blocks it registered in the step being built (see ``Scheduler._preempt_lower_priority``).

KV-cache groups (sliding windows). The executor splits a model's layers into groups of one
attention kind each (full attention, or a sliding window of W positions) and reports each group's
window on attach (`executor.kv_groups`). Every block of the pool serves any group (each group's
layers fill the same layer slots of a block), so the pool keeps one free queue and one count, and
each request has one block table per group. Tables are positional: entry i covers positions
[i * block_size, (i + 1) * block_size). A sliding-window layer reads only the last W positions
before each query, so a sliding group's table keeps blocks from the first one its next query can
see (``_first_needed``) and releases the earlier ones as the request advances: its entries before
``first`` are None. A model with one full-attention group (the common case) has one table that is
exactly the old single block table.

Prefix caching with groups: every group has the same hash chain (the same tokens) and registers its
own blocks under it (``BlockPool`` keeps one hash map per group). A hit of L blocks needs all of
blocks [0, L) in each full group, but only blocks [first_needed(L * block_size), L) in each sliding
group, which is what the next query reads: the hit is the longest L every group can serve (what
vLLM's hybrid KV-cache manager does). Out-of-window blocks a sliding group released stay in the
prefix cache's LRU, so a later request with the same prefix can still find them.

CPU tier (`--kv-offloading-size`, scheduler.kv_tier): cached free blocks are copied to the tier
ahead of their eviction (`offload_ahead`: those among the next blocks the pool hands out, as `offload`
moves the executor runs on a copy stream beside the step's forward; the next step, the first that
may reuse them, waits for the copies), so an eviction usually finds its block in the tier already
and costs nothing. When the pool evicts a cached block the tier does not hold yet, its KV is copied
to a host block first (a `swap_out` move of the plan that reuses the GPU block, which the executor
runs before anything writes it, inside the step); a prefix the GPU
pool misses but the tier holds is loaded back (`load` moves into fresh GPU blocks, registered in
the GPU prefix cache at once) instead of computed again. The executor runs loads on a copy stream
beside the step's forward, so no request of the plan that loads a block may read it: the scheduler
starts a request whose hit has such a block in the next plan (`waits_for_loads`). Hits are found in
one pass over the chain, the GPU pool first, then the tier, with the same rules per group
(`CpuBlock` marks a tier hit in a `PrefixHit`).

Disk tier (`--kv-offloading-disk`, below the CPU tier): a block the CPU tier drops (to make room
for an offload, a fetch or a swap-out) is written to a disk slot first (`spill`, host -> disk,
before the plan's other moves), unless the disk holds it already. A prefix block found only on disk
(`DiskBlock`, after the GPU pool and the CPU tier) is read back into a host block of the CPU tier
(`fetch`, disk -> host), which the executor does in the background while the plan's step runs; the
next plan loads it from there like a CPU-tier hit, and the plan after starts the request. Its GPU
block is registered and held from the fetch's plan to the load's, so a request sharing it waits
too, and its host block stays busy. A hit keeps disk blocks only while the CPU tier has a host
block this plan could fetch each into (`_can_fetch`); past that the prefix is computed. The disk
tier's slots a fetch reads are kept from this plan's spills. A spill holds up the launch of the step
that reuses its host block, so at the end of a plan that leaves the CPU tier too little room for
as many insertions again, as many of its oldest blocks not on disk yet are written there beside
the step (`spill_ahead`, as `offload_ahead` does for the GPU pool): the next plan evicts them
without a spill.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pagedserve.scheduler.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from pagedserve.scheduler.kv_tier import TierIndex, TierKey
from pagedserve.scheduler.request import Request, SeqId

# A group's span of a block table on the wire: (table index of the first id, the ids).
BlockSpan = tuple[int, list[int]]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class _Table:
    """One group's blocks of a request: entry i covers positions [i * bs, (i + 1) * bs); entries
    before `first` are None (out of the group's sliding window, released)."""

    blocks: list[Block | None]
    first: int = 0

    def held(self) -> list[Block]:
        return self.blocks[self.first :]  # type: ignore[return-value]  # no None from `first` on


@dataclass(frozen=True, slots=True)
class CpuBlock:
    """A prefix-cache hit in the CPU tier: the host block that holds it."""

    slot: int


@dataclass(frozen=True, slots=True)
class DiskBlock:
    """A prefix-cache hit in the disk tier: the disk slot that holds it."""

    slot: int


_TIER_BLOCKS = (CpuBlock, DiskBlock)  # hits below the GPU pool: each one loaded into a GPU block


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks a waiting request can start from (``get_computed_blocks``): per group, the
    first entries of its table (None before a sliding group's window; a `CpuBlock` where the CPU
    tier holds the block, a `DiskBlock` where only the disk tier does), covering `num_tokens`."""

    tables: tuple[tuple[Block | CpuBlock | DiskBlock | None, ...], ...] = ()
    num_tokens: int = 0

    @property
    def blocks(self) -> Iterator[Block]:
        """Every cached GPU block of the hit, over all groups."""
        return (block for table in self.tables for block in table if isinstance(block, Block))

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the hit the CPU tier holds or fetches from the disk tier (in the first group
        that has any: all groups hold the same positions, each in its own blocks)."""
        return max((sum(isinstance(b, _TIER_BLOCKS) for b in table) for table in self.tables), default=0)

    @property
    def num_disk_blocks(self) -> int:
        """Of `num_cpu_blocks`, those only the disk tier holds."""
        return max((sum(isinstance(b, DiskBlock) for b in table) for table in self.tables), default=0)

    @property
    def num_loads(self) -> int:
        """Host -> GPU block copies that admitting on the hit plans: its tier blocks, all groups."""
        return sum(isinstance(b, _TIER_BLOCKS) for table in self.tables for b in table)


NO_HIT = PrefixHit()


class KVCacheManager:
    """Owns each request's GPU block tables (and CPU tables while swapped out).

    Args:
        block_size: tokens per block.
        num_gpu_blocks: size of the GPU pool.
        num_cpu_blocks: size of the executor's CPU swap pool.
        enable_prefix_caching: look up and register full blocks by hash.
        sliding_windows: one entry per KV-cache group, in the executor's order: None for full
            attention, else the window (the positions a query sees, itself included).
        num_cpu_offload_blocks: the most host blocks the CPU tier may hold (0: no tier); they come
            out of the `num_cpu_blocks` the swap pool also draws on.
        num_disk_offload_blocks: slots of the disk tier below the CPU tier (0: none).
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        sliding_windows: Sequence[int | None] = (None,),
        num_cpu_offload_blocks: int = 0,
        num_disk_offload_blocks: int = 0,
    ) -> None:
        if not sliding_windows or any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError(
                f"sliding_windows must list each group's window (None or >= 1): {sliding_windows}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows = tuple(sliding_windows)
        self.num_groups = len(self.sliding_windows)
        self._full_groups = [g for g, w in enumerate(self.sliding_windows) if w is None]
        self._sliding_groups = [g for g, w in enumerate(self.sliding_windows) if w is not None]
        # One full-attention table: the per-step fast path of allocate_slots applies.
        self._one_full_table = self.sliding_windows == (None,)
        self.block_pool = BlockPool(num_gpu_blocks, enable_prefix_caching, self.num_groups)
        self.num_cpu_blocks = num_cpu_blocks
        self._tables: dict[SeqId, list[_Table]] = {}
        # Leading blocks of each request's tables that are already in the prefix cache (registered
        # by it, or found there at admission): registration resumes after them.
        self._num_cached_blocks: dict[SeqId, int] = {}
        # Hash chain of each live request's full known blocks, kept across preemptions (the tokens
        # never change) and dropped by forget().
        self._hashes: dict[SeqId, list[BlockHash]] = {}
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._cpu_tables: dict[SeqId, list[BlockSpan]] = {}  # per group, while swapped out
        # CPU blocks read by this step's swap_in: the executor runs swap_out before swap_in, so they
        # must not be handed to a swap_out of the same step.
        self._cpu_release_after_step: list[int] = []
        # The CPU tier (None: off), its moves for the plan being built, and the host blocks those
        # moves read or write (no other move of the step may reuse them).
        if num_cpu_offload_blocks and not enable_prefix_caching:
            num_cpu_offload_blocks = 0  # a tier of the prefix cache needs the prefix cache
        if num_cpu_offload_blocks > num_cpu_blocks:
            raise ValueError(
                f"the CPU tier ({num_cpu_offload_blocks}) exceeds the host pool ({num_cpu_blocks})"
            )
        self.tier = TierIndex(num_cpu_offload_blocks) if num_cpu_offload_blocks else None
        self.block_pool.record_evictions = self.tier is not None
        # The disk tier (None: off), its free slots, its moves for the plan being built, and the disk
        # slots this plan's fetches read (no spill of the plan, which runs before them, may take one).
        if num_disk_offload_blocks and self.tier is None:
            num_disk_offload_blocks = 0  # fetched blocks are staged in the CPU tier's host blocks
        self.disk_tier = TierIndex(num_disk_offload_blocks) if num_disk_offload_blocks else None
        self._disk_free: list[int] = list(range(num_disk_offload_blocks - 1, -1, -1))
        self._spills: list[tuple[int, int]] = []  # (host block, disk slot)
        self._fetches: list[tuple[int, int]] = []  # (disk slot, host block)
        self._spills_ahead: list[tuple[int, int]] = []  # (host block, disk slot), beside the step
        self._num_tier_inserts = 0  # blocks the plan being built put into the CPU tier
        # Loads of this plan's fetches, planned in the next plan, and the GPU blocks of the loads the
        # next plan was given (each held once more, from its fetch's plan until its load's is done).
        self._fetched: list[tuple[int, Block]] = []  # (host block, GPU block)
        self._held_for_loads: list[Block] = []
        self._disk_slots_busy: set[int] = set()
        self.num_spilled_blocks = 0  # counters: host -> disk and disk -> host over the manager's life
        self.num_fetched_blocks = 0
        self._offloads: list[tuple[int, int]] = []  # (gpu block, host block)
        self._loads: list[tuple[int, int]] = []  # (host block, gpu block)
        self._loading_block_ids: set[int] = set()  # the GPU blocks of `_loads`
        self._host_blocks_busy: set[int] = set()
        self._offloads_ahead: list[tuple[int, int]] = []  # (gpu block, host block), beside the forward
        self.num_offloaded_blocks = 0  # counters: GPU -> host and host -> GPU over the manager's life
        self.num_loaded_blocks = 0

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first table entry a query at position `num_computed` can read in `group` (0 for
        full attention): a sliding window W sees positions > num_computed - W."""
        window = self.sliding_windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    # ---- queries -------------------------------------------------------------------------------

    def block_ids(self, seq_id: SeqId, group: int = 0) -> list[int]:
        """The ids of the blocks the request holds in `group` (empty if it holds none)."""
        tables = self._tables.get(seq_id)
        return [] if tables is None else [block.block_id for block in tables[group].held()]

    def block_tables(self, seq_id: SeqId) -> list[BlockSpan]:
        """The request's whole tables, per group: (index of the first held entry, the held ids)."""
        return [(t.first, [block.block_id for block in t.held()]) for t in self._tables.get(seq_id, ())]

    def blocks(self, seq_id: SeqId, group: int = 0) -> Sequence[Block | None]:
        """The request's table in `group`, None before its first held entry."""
        tables = self._tables.get(seq_id)
        return () if tables is None else tables[group].blocks

    def num_blocks(self, seq_id: SeqId) -> int:
        """Blocks the request holds, over all groups."""
        return sum(len(t.blocks) - t.first for t in self._tables.get(seq_id, ()))

    def num_empty_slots(self, request: Request) -> int:
        """Slots of the request's held blocks that hold no computed token's KV (its tables' tails:
        a sliding group's released head is no slot of it)."""
        end = request.num_computed_tokens
        return sum(len(t.blocks) * self.block_size - end for t in self._tables.get(request.seq_id, ()))

    def cpu_block_ids(self, seq_id: SeqId) -> list[int]:
        """The CPU blocks of a swapped-out request, over all groups."""
        return [cpu for _, ids in self._cpu_tables.get(seq_id, ()) for cpu in ids]

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def num_cpu_blocks_in_use(self) -> int:
        return self.num_cpu_blocks - len(self._cpu_free) - len(self._cpu_release_after_step)

    # ---- prefix cache --------------------------------------------------------------------------

    def _block_hash(self, request: Request, index: int) -> BlockHash:
        """Hash of the request's block ``index`` (all its tokens must be known); memoized."""
        hashes = self._hashes.setdefault(request.seq_id, [])
        size = self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.token_ids(i * size, (i + 1) * size)))
        return hashes[index]

    def _longest_hit(self, hash_of: Callable[[int], BlockHash], max_blocks: int) -> PrefixHit:
        """The longest prefix of at most `max_blocks` blocks that every group can serve from the
        cache, GPU pool or tiers (see the module doc), with each group's blocks, whose disk blocks
        the CPU tier can stage in this plan. A pure lookup: no ref count or LRU position changes."""
        hit = self._cached_prefix(hash_of, max_blocks)
        while not self._can_fetch(hit):  # (rare: a CPU tier too small for this plan's fetches)
            hit = self._cached_prefix(hash_of, hit.num_tokens // self.block_size - 1)
        return hit

    def _cached_prefix(self, hash_of: Callable[[int], BlockHash], max_blocks: int) -> PrefixHit:
        """`_longest_hit` without the staging check."""
        cached, tier, disk = self.block_pool.get_cached_block, self.tier, self.disk_tier

        def get(block_hash: BlockHash, group: int) -> Block | CpuBlock | DiskBlock | None:
            block = cached(block_hash, group)
            if block is not None or tier is None:
                return block
            key = (group, block_hash)
            if (slot := tier.get(key)) is not None:
                return CpuBlock(slot)
            if disk is not None and (slot := disk.get(key)) is not None:
                return DiskBlock(slot)
            return None

        length = max_blocks
        chains: dict[int, list[Block | CpuBlock | DiskBlock]] = {}
        for group in self._full_groups:  # the whole chain from the first block
            chain: list[Block | CpuBlock | DiskBlock] = []
            for index in range(length):
                block = get(hash_of(index), group)
                if block is None:
                    break
                chain.append(block)
            chains[group] = chain
            length = len(chain)
        # A sliding group needs the blocks its window reaches at the hit's end; a missing one means
        # the hit must end at or before it. `length` only shrinks, so this ends.
        found: dict[tuple[int, int], Block | CpuBlock | DiskBlock | None] = {}
        settled = False
        while not settled and length > 0:
            settled = True
            for group in self._sliding_groups:
                for index in range(length - 1, self._first_needed(group, length * self.block_size) - 1, -1):
                    if (group, index) not in found:
                        found[group, index] = get(hash_of(index), group)
                    if found[group, index] is None:
                        length, settled = index, False
                        break
                if not settled:
                    break
        if length == 0:
            return NO_HIT
        tables: list[tuple[Block | CpuBlock | DiskBlock | None, ...]] = []
        for group in range(self.num_groups):
            if group in chains:
                tables.append(tuple(chains[group][:length]))
            else:
                first = self._first_needed(group, length * self.block_size)
                tables.append((None,) * first + tuple(found[group, i] for i in range(first, length)))
        return PrefixHit(tuple(tables), length * self.block_size)

    def _can_fetch(self, hit: PrefixHit) -> bool:
        """Whether the CPU tier can take each disk block of `hit` in this plan: a host block while
        it has room, then one of its entries that neither the plan's moves nor the hit use."""
        entries = [entry for table in hit.tables for entry in table]
        num_fetches = sum(isinstance(entry, DiskBlock) for entry in entries)
        if not num_fetches:
            return True
        tier = self.tier
        assert tier is not None
        kept = self._host_blocks_busy.union(e.slot for e in entries if isinstance(e, CpuBlock))
        room = min(len(self._cpu_free), tier.capacity - len(tier))
        return num_fetches <= room + len(tier) - len(kept)  # (kept may hold non-tier blocks: fewer)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest prefix of the request's known tokens the cache can serve.

        At least one token is always left to compute (its forward pass produces the next token), so
        the block holding the last known token is never reused: with the whole prompt cached, that
        block is computed again in a fresh block, and no shared block is ever written.

        Returns:
            The cached blocks (not yet held) per group, and the number of tokens they cover.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        max_blocks = (request.num_known_tokens - 1) // self.block_size
        return self._longest_hit(lambda index: self._block_hash(request, index), max_blocks)

    def prompt_block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hash chain of the full blocks `get_computed_blocks` could reuse for a request whose
        known tokens are `token_ids` (all but the block holding the last token)."""
        size = self.block_size
        hashes: list[BlockHash] = []
        for index in range((len(token_ids) - 1) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[index * size : (index + 1) * size]))
        return hashes

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> PrefixHit:
        """The exact hit (GPU and CPU tier) a request whose prompt has the chain `block_hashes` would
        get now. A pure lookup: no ref count, no LRU position changes."""
        if not self.enable_prefix_caching:
            return NO_HIT
        return self._longest_hit(block_hashes.__getitem__, len(block_hashes))

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain `block_hashes` the prefix cache (both tiers) can
        serve now."""
        return self.lookup_prefix(block_hashes).num_tokens // self.block_size

    def cache_full_blocks(self, request: Request) -> bool:
        """Registers the request's blocks that are full of known, scheduled tokens in the prefix
        cache (``num_computed_tokens`` counts the tokens of the plan being built: see the module's
        safety rule), in every group. Returns whether it registered any."""
        if not self.enable_prefix_caching:
            return False
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.seq_id, 0)
        if num_full <= start:
            return False  # the usual case: checked first, it is on every request's every step
        tables = self._tables.get(request.seq_id)
        if not tables:
            return False
        cache_block = self.block_pool.cache_block
        for index in range(start, num_full):
            block_hash = self._block_hash(request, index)
            for group, table in enumerate(tables):
                block = table.blocks[index]
                if block is not None:  # (a released block was registered before it was released)
                    cache_block(block, block_hash, group)
        self._num_cached_blocks[request.seq_id] = num_full
        return True

    # ---- GPU blocks ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_tokens: int, hit: PrefixHit = NO_HIT
    ) -> list[BlockSpan] | None:
        """Grows the request's tables to hold ``num_tokens`` tokens.

        A running request's sliding groups first release the blocks its next query can no longer
        see (whether or not the growth fits: no query of the request reads them again).

        Args:
            request: the request; its tables may be empty (admission) or not (a running request).
            num_tokens: tokens the tables must cover after this step (computed + scheduled).
            hit: prefix-cache hits from ``get_computed_blocks``, which become the first blocks of
                empty tables.

        Returns:
            The newly allocated blocks per group as (table index of the first, ids) — an empty
            list when no group got one — or None if the free blocks (counting evictable cached
            ones) are too few; then nothing else changed.
        """
        tables = self._tables.get(request.seq_id)
        if tables is not None and hit.tables:
            raise ValueError(f"seq {request.seq_id}: cached blocks can only start an empty table")
        if tables is not None and self._one_full_table and request.seq_id not in self._cpu_tables:
            if num_tokens <= len(tables[0].blocks) * self.block_size:
                return []  # the common decode step: the last block still has room
        if tables is not None:
            self._release_out_of_window(request, tables)
        num_needed = self._num_new_blocks(request, num_tokens, hit)
        if num_needed == 0 and not hit.tables and tables is not None:
            return []
        if num_needed > self._num_allocatable_blocks(hit):
            return None
        self.block_pool.touch(hit.blocks)
        if tables is None:
            if hit.tables:
                # The hit's tier slots, all groups, before any fetch makes room in the CPU tier (or
                # spills to the disk tier): none of them may be evicted or overwritten by this plan.
                for entry in (b for table in hit.tables for b in table):
                    if isinstance(entry, CpuBlock):
                        self._host_blocks_busy.add(entry.slot)
                    elif isinstance(entry, DiskBlock):
                        self._disk_slots_busy.add(entry.slot)
                tables = [
                    _Table(self._load_from_tier(request, g, t), _first_held(t))
                    for g, t in enumerate(hit.tables)
                ]
                self._num_cached_blocks[request.seq_id] = hit.num_tokens // self.block_size
            else:
                tables = [_Table([]) for _ in range(self.num_groups)]
            self._tables[request.seq_id] = tables
        end = _cdiv(num_tokens, self.block_size)
        spans: list[BlockSpan] = []
        for table in tables:
            first = len(table.blocks)
            new = self.block_pool.allocate(max(0, end - first))
            table.blocks.extend(new)
            spans.append((first, [block.block_id for block in new]))
        self._offload_evicted()
        return spans if num_needed else []

    def _load_from_tier(
        self, request: Request, group: int, table: Sequence[Block | CpuBlock | DiskBlock | None]
    ) -> list[Block | None]:
        """A hit's table for `group` with each tier hit given a fresh GPU block, its load planned
        (host -> GPU; a disk tier hit fetched into a host block of the CPU tier first, disk -> host)
        and the block registered in the GPU prefix cache: the executor loads it before the step
        reads it. `allocate_slots` has marked the hit's tier slots busy."""
        if not any(isinstance(b, _TIER_BLOCKS) for b in table):
            return list(table)  # type: ignore[arg-type]
        tier = self.tier
        assert tier is not None
        blocks: list[Block | None] = []
        for index, entry in enumerate(table):
            if isinstance(entry, _TIER_BLOCKS):
                key = (group, self._block_hash(request, index))
                (block,) = self.block_pool.allocate(1)
                self.block_pool.cache_block(block, key[1], group)
                if isinstance(entry, DiskBlock):  # loaded by the next plan, once fetched
                    self._fetched.append((self._fetch(key, entry.slot), block))
                    self.block_pool.touch([block])
                else:
                    tier.touch(key)
                    self._loads.append((entry.slot, block.block_id))
                self._loading_block_ids.add(block.block_id)
                self.num_loaded_blocks += 1
                entry = block
            blocks.append(entry)
        return blocks

    def _fetch(self, key: TierKey, disk_slot: int) -> int:
        """Plans the read of `key`'s block from its disk slot into a host block of the CPU tier,
        which then holds it too; returns the host block."""
        assert self.tier is not None and self.disk_tier is not None
        host = self._host_block_for_tier()
        assert host is not None, "the lookup counted a host block for each disk hit (_can_fetch)"
        self._host_blocks_busy.add(host)
        self.tier.insert(key, host)
        self.disk_tier.touch(key)
        self._fetches.append((disk_slot, host))
        self.num_fetched_blocks += 1
        self._num_tier_inserts += 1
        return host

    def _offload_evicted(self) -> None:
        """Plans the copy to the CPU tier of each cached block the pool just evicted that the tier
        does not hold yet (before the block's new owner writes it: swap_out runs first)."""
        evicted = self.block_pool.evicted
        if not evicted:
            return
        assert self.tier is not None
        for block_id, group, block_hash in evicted:
            key = (group, block_hash)
            if key in self.tier:
                continue  # offloaded when it was evicted before: the same KV
            slot = self._host_block_for_tier()
            if slot is None:
                continue  # every host block is busy this step: this one is recomputed if needed
            self.tier.insert(key, slot)
            self._offloads.append((block_id, slot))
            self._host_blocks_busy.add(slot)
            self.num_offloaded_blocks += 1
            self._num_tier_inserts += 1
        evicted.clear()

    def _host_block_for_tier(self) -> int | None:
        """A free host block while the tier has room, else the tier's least recently used one."""
        assert self.tier is not None
        if not self.tier.is_full and self._cpu_free:
            return self._cpu_free.pop()
        return self._evict_from_cpu_tier()

    def _evict_from_cpu_tier(self) -> int | None:
        """Drops the CPU tier's least recently used entry whose host block no move of the plan uses,
        its block spilled to the disk tier first (unless the disk holds it, or no disk slot is
        free of the plan's moves: then it is gone); returns the host block, None if all are busy."""
        assert self.tier is not None
        evicted = self.tier.evict(keep=self._host_blocks_busy)
        if evicted is None:
            return None
        key, host = evicted
        disk = self.disk_tier
        if disk is not None and key not in disk and (slot := self._disk_slot()) is not None:
            disk.insert(key, slot)
            self._spills.append((host, slot))
            self._disk_slots_busy.add(slot)
            self.num_spilled_blocks += 1
        return host

    def _disk_slot(self) -> int | None:
        """A free disk slot while the disk tier has room, else its least recently used one that no
        move of the plan uses; None if all are busy."""
        disk = self.disk_tier
        assert disk is not None
        if not disk.is_full and self._disk_free:
            return self._disk_free.pop()
        evicted = disk.evict(keep=self._disk_slots_busy)
        return None if evicted is None else evicted[1]

    def _take_host_blocks(self, count: int) -> list[int] | None:
        """`count` host blocks for a swap-out: free ones, then the CPU tier's least recently used
        (a pre-empted request's KV before a cached prefix); None (nothing changed) if too few."""
        short = count - len(self._cpu_free)
        if short > 0:
            if self.tier is None:
                return None
            if len(self.tier) - len(self._host_blocks_busy) < short:  # busy ones: counted as kept
                return None
            for _ in range(short):
                slot = self._evict_from_cpu_tier()
                if slot is None:
                    return None
                self._cpu_free.append(slot)
        return [self._cpu_free.pop() for _ in range(count)]

    def offload_ahead(self, num_blocks: int) -> None:
        """Plans the copy to the CPU tier of the cached blocks among the next `num_blocks` the pool
        will hand out that the tier does not hold yet (see the module doc); called once a plan's
        allocations are done, so that the plan itself reuses none of them. A free block's KV is
        final: the copy reads what the steps already launched wrote."""
        if self.tier is None or not num_blocks:
            return
        tier = self.tier
        for block in self.block_pool.cached_free_blocks_ahead(num_blocks):
            key = (block.group, block.block_hash)
            if key in tier:
                continue
            slot = self._host_block_for_tier()
            if slot is None:
                return  # every host block is busy this step
            tier.insert(key, slot)  # type: ignore[arg-type]  # (cached: it has a hash)
            self._offloads_ahead.append((block.block_id, slot))
            self._host_blocks_busy.add(slot)
            self.num_offloaded_blocks += 1
            self._num_tier_inserts += 1

    def take_offloads_ahead(self) -> list[tuple[int, int]]:
        """The `offload_ahead` copies of the plan being built: (GPU block, host block)."""
        moves, self._offloads_ahead = self._offloads_ahead, []
        return moves

    def take_tier_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The CPU tier's moves of the plan being built: (offloads of blocks the plan reuses, GPU ->
        host; loads, host -> GPU)."""
        moves = self._offloads, self._loads
        self._offloads, self._loads = [], []
        self._loading_block_ids.clear()
        return moves

    def spill_ahead(self) -> None:
        """Plans the writing to the disk tier, beside the step, of the CPU tier's least recently
        used blocks that the disk does not hold yet, as many as this plan put into the CPU tier
        less the room it has left: the next plan's insertions evict about as many, whose blocks
        are then on disk already and need no spill before their host blocks are reused (the
        executor writes spills before a plan's other moves, the launch waiting). Called once the
        plan's other moves are planned; their host blocks stay out of the plan's moves (the
        executor reads them beside its step, and waits for that before the next plan's)."""
        disk, tier = self.disk_tier, self.tier
        if disk is None or tier is None:
            return
        count = self._num_tier_inserts - (tier.capacity - len(tier))
        if count <= 0:
            return
        for key, host in itertools.islice(tier.oldest(), 4 * count + 64):  # (a bounded scan)
            if key in disk or host in self._host_blocks_busy:
                continue
            slot = self._disk_slot()
            if slot is None:
                return
            disk.insert(key, slot)
            self._spills_ahead.append((host, slot))
            self._host_blocks_busy.add(host)
            self._disk_slots_busy.add(slot)
            self.num_spilled_blocks += 1
            count -= 1
            if count == 0:
                return

    def take_disk_moves(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The disk tier's moves of the plan being built: spills (host -> disk) and fetches (disk ->
        host), which the executor starts in that order before the plan's other moves, and the
        spills ahead (host -> disk, beside the step)."""
        moves = self._spills, self._fetches, self._spills_ahead
        self._spills, self._fetches, self._spills_ahead = [], [], []
        return moves

    @property
    def num_planned_loads(self) -> int:
        """Host -> GPU block copies of the plan being built so far, and of the next plan's loads
        of this one's fetches: a disk hit's blocks count against the load budget when admitted."""
        return len(self._loads) + len(self._fetched)

    def waits_for_loads(self, hit: PrefixHit) -> bool:
        """Whether a request admitted on `hit` in the plan being built must wait for the plan's
        loads (the executor runs them beside the plan's forward): it loads blocks from the CPU tier,
        or shares a GPU block another request of the plan loads (or fetches, to load next)."""
        return hit.num_cpu_blocks > 0 or any(b.block_id in self._loading_block_ids for b in hit.blocks)

    @property
    def held_for_loads(self) -> list[Block]:
        """GPU blocks held once more than their tables do: fetched from the disk tier, loaded by
        the plan being built (see the module doc)."""
        return self._held_for_loads

    def is_loading(self, seq_id: SeqId) -> bool:
        """Whether a block of the request is loaded by the plan being built (its fetch was planned
        in the one before): a LOADING request starts in a later plan."""
        loading = self._loading_block_ids
        return bool(loading) and any(
            b is not None and b.block_id in loading for t in self._tables.get(seq_id, ()) for b in t.blocks
        )

    def _release_out_of_window(self, request: Request, tables: list[_Table]) -> None:
        """Releases each sliding group's blocks before the first one a query at the request's next
        position can read (registered ones stay findable in the prefix cache's LRU); with
        proposals in flight, the position the next query has if all of them are rejected."""
        for group in self._sliding_groups:
            table = tables[group]
            first = min(self._first_needed(group, _next_position(request)), len(table.blocks))
            if first > table.first:
                released = table.blocks[table.first : first]
                table.blocks[table.first : first] = [None] * (first - table.first)
                table.first = first
                self.block_pool.free(reversed(released))  # type: ignore[arg-type]

    def num_blocks_short(self, request: Request, num_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """How many more free blocks ``allocate_slots`` (or ``swap_in``, for a swapped-out request)
        would need to grow the request to ``num_tokens`` tokens; 0 if it fits."""
        return max(0, -self.num_spare_blocks(request, num_tokens, hit))

    def num_spare_blocks(self, request: Request, num_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Allocatable blocks left once the request's tables grow to ``num_tokens`` tokens (negative:
        that many short), not counting what its window would release."""
        return self._num_allocatable_blocks(hit) - self._num_new_blocks(request, num_tokens, hit)

    def num_reclaimable_blocks(self, seq_ids: Sequence[SeqId], keep: PrefixHit = NO_HIT) -> int:
        """Blocks that releasing all of ``seq_ids`` would make allocatable: those no other request
        holds, except the blocks of ``keep`` (prefix-cache hits the caller is about to take)."""
        holders: dict[Block, int] = {}
        for seq_id in seq_ids:
            for table in self._tables.get(seq_id, ()):
                for block in table.held():
                    holders[block] = holders.get(block, 0) + 1
        kept = set(keep.blocks)
        return sum(1 for block, count in holders.items() if count == block.ref_count and block not in kept)

    def _num_new_blocks(self, request: Request, num_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Blocks to allocate for the request to hold ``num_tokens`` tokens: beyond its tables and
        ``hit`` or, swapped out, whole new tables at least as long as its CPU ones."""
        end = _cdiv(num_tokens, self.block_size)
        cpu_tables = self._cpu_tables.get(request.seq_id)
        if cpu_tables is not None:
            return sum(max(end, first + len(ids)) - first for first, ids in cpu_tables)
        tables = self._tables.get(request.seq_id)
        if tables is not None:
            return sum(max(0, end - len(t.blocks)) for t in tables)
        if hit.tables:
            return hit.num_loads + sum(max(0, end - len(t)) for t in hit.tables)
        return end * self.num_groups

    def _num_allocatable_blocks(self, hit: PrefixHit = NO_HIT) -> int:
        """Free blocks, less the prefix-cache hits sitting in the free queue: they stop being
        allocatable once the request holds them."""
        return self.block_pool.num_free_blocks - sum(1 for block in hit.blocks if block.ref_count == 0)

    def free(self, request: Request) -> None:
        """Releases the request's GPU blocks; its full, computed blocks stay in the prefix cache.

        Blocks are released last first, so the chain's tail is evicted before its prefix.
        """
        self.cache_full_blocks(request)
        tables = self._tables.pop(request.seq_id, None)
        self._num_cached_blocks.pop(request.seq_id, None)
        for table in tables or ():
            self.block_pool.free(reversed(table.held()))

    def trim(self, request: Request, num_tokens: int) -> int:
        """Speculative decoding: frees the blocks of the request's tables (GPU, or CPU while it is
        swapped out) past the one that holds position ``num_tokens - 1``: slots reserved for
        proposals that were rejected (and, swapped out, a sliding window's blocks out of view of
        the query at ``num_tokens``). They were allocated for the proposals alone, so none is
        shared or registered: the prefix cache registers only blocks full of known tokens. Returns
        how many blocks it freed."""
        end = _cdiv(num_tokens, self.block_size)
        cpu_tables = self._cpu_tables.get(request.seq_id)
        if cpu_tables is not None:  # swapped out with its proposals in flight (`_next_position`)
            freed = 0
            for group, (first, ids) in enumerate(cpu_tables):
                keep = max(0, end - first)
                # A window kept what a query reads with every proposal rejected; some were
                # accepted: the blocks before the window of the query now are out of view.
                drop = min(keep, max(0, self._first_needed(group, num_tokens) - first))
                if drop or len(ids) > keep:
                    self._cpu_free.extend(reversed(ids[keep:]))
                    self._cpu_free.extend(reversed(ids[:drop]))
                    freed += len(ids) - keep + drop
                    cpu_tables[group] = (first + drop, ids[drop:keep])
            return freed
        tables = self._tables.get(request.seq_id)
        if not tables:
            return 0
        freed = 0
        for table in tables:
            if len(table.blocks) > end:
                tail = table.blocks[max(end, table.first) :]
                del table.blocks[max(end, table.first) :]
                self.block_pool.free(reversed(tail))  # type: ignore[arg-type]
                freed += len(tail)
        assert self._num_cached_blocks.get(request.seq_id, 0) <= end
        return freed

    def forget(self, seq_id: SeqId) -> None:
        """Drops what is kept for a request across preemptions (its hash chain); on finish."""
        self._hashes.pop(seq_id, None)

    # ---- swap ----------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the KV of the request's computed tokens (in each sliding group, those its next
        query can see) to CPU blocks and frees its GPU blocks.

        Returns:
            (gpu_block_id, cpu_block_id) pairs for the plan's swap_out, or None (nothing changed)
            when the CPU pool is too small.
        """
        tables = self._tables[request.seq_id]
        end = _cdiv(request.num_computed_tokens, self.block_size)  # proposals in flight included
        position = _next_position(request)
        starts = [max(t.first, self._first_needed(g, position)) for g, t in enumerate(tables)]
        host_blocks = self._take_host_blocks(sum(max(0, end - start) for start in starts))
        if host_blocks is None:
            return None
        self._host_blocks_busy.update(host_blocks)
        handed_out = iter(host_blocks)
        moves: list[tuple[int, int]] = []
        cpu_tables: list[BlockSpan] = []
        for table, start in zip(tables, starts, strict=True):
            cpu_ids = [next(handed_out) for _ in range(start, end)]
            held = table.blocks[start:end]
            moves += [(block.block_id, cpu) for block, cpu in zip(held, cpu_ids, strict=True)]  # type: ignore[union-attr]
            cpu_tables.append((start, cpu_ids))
        self._cpu_tables[request.seq_id] = cpu_tables
        self.free(request)
        return moves

    def swap_in(self, request: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Gives a swapped-out request new GPU tables for ``num_tokens`` tokens and copies its KV back.

        Returns:
            (cpu_block_id, gpu_block_id) pairs for the plan's swap_in, or None (nothing changed)
            when the free GPU blocks are too few.
        """
        cpu_tables = self._cpu_tables[request.seq_id]
        if self._num_new_blocks(request, num_tokens) > self.block_pool.num_free_blocks:
            return None
        end = _cdiv(num_tokens, self.block_size)
        tables, moves = [], []
        for first, cpu_ids in cpu_tables:
            gpu_blocks = self.block_pool.allocate(max(end, first + len(cpu_ids)) - first)
            tables.append(_Table([None] * first + gpu_blocks, first))  # type: ignore[operator]
            moves += [(cpu, block.block_id) for cpu, block in zip(cpu_ids, gpu_blocks, strict=False)]
        self._offload_evicted()
        self._tables[request.seq_id] = tables
        del self._cpu_tables[request.seq_id]
        self._cpu_release_after_step.extend(cpu for _, ids in cpu_tables for cpu in ids)
        return moves

    def free_swapped(self, request: Request) -> None:
        """Releases the CPU blocks of a swapped-out request (aborted while swapped)."""
        for _, cpu_ids in reversed(self._cpu_tables.pop(request.seq_id, [])):
            self._cpu_free.extend(reversed(cpu_ids))

    def end_step(self) -> None:
        """Called once a plan is complete (its moves taken): CPU blocks read by its swap_in become
        free, its moves' host blocks may serve the next plan's, and the next plan starts with the
        loads of this one's fetches."""
        self._cpu_free.extend(reversed(self._cpu_release_after_step))
        self._cpu_release_after_step.clear()
        self._host_blocks_busy.clear()
        self._disk_slots_busy.clear()
        self._num_tier_inserts = 0
        self.block_pool.free(self._held_for_loads)  # loaded by the plan just complete
        self._held_for_loads = [block for _, block in self._fetched]
        for host, block in self._fetched:
            self._loads.append((host, block.block_id))
            self._loading_block_ids.add(block.block_id)
            self._host_blocks_busy.add(host)
        self._fetched.clear()


def _next_position(request: Request) -> int:
    """The lowest position the request's next query can have: past its computed tokens, less the
    proposals in flight (speculative decoding), which its output may reject, all of them. A sliding
    window must keep what a query there reads (a block released on the proposals' count was read
    again, empty, once they were rejected)."""
    return request.num_computed_tokens - request.num_draft_tokens


def _first_held(table: Sequence[Block | None]) -> int:
    """Index of a hit table's first block (None entries lead a sliding group's table)."""
    return next((i for i, block in enumerate(table) if block is not None), len(table))
