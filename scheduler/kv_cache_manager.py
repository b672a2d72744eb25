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
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.block_pool import Block, BlockHash, BlockPool, hash_block_tokens
from pagedserve.scheduler.request import Request, SeqId


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns each request's GPU block table (and CPU block table while swapped out).

    Args:
        block_size: tokens per block.
        num_gpu_blocks: size of the GPU pool.
        num_cpu_blocks: size of the executor's CPU swap pool.
        enable_prefix_caching: look up and register full blocks by hash.
    """

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_prefix_caching)
        self.num_cpu_blocks = num_cpu_blocks
        self._tables: dict[SeqId, list[Block]] = {}
        # Leading blocks of each table that are already in the prefix cache (registered by it, or
        # found there at admission): registration resumes after them.
        self._num_cached_blocks: dict[SeqId, int] = {}
        # Hash chain of each live request's full known blocks, kept across preemptions (the tokens
        # never change) and dropped by forget().
        self._hashes: dict[SeqId, list[BlockHash]] = {}
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))  # pop() hands out 0 first
        self._cpu_tables: dict[SeqId, list[int]] = {}
        # CPU blocks read by this step's swap_in: the executor runs swap_out before swap_in, so they
        # must not be handed to a swap_out of the same step.
        self._cpu_release_after_step: list[int] = []

    # ---- queries -------------------------------------------------------------------------------

    def block_ids(self, seq_id: SeqId) -> list[int]:
        """The request's whole GPU block table (empty if it holds none)."""
        return [block.block_id for block in self._tables.get(seq_id, ())]

    def blocks(self, seq_id: SeqId) -> Sequence[Block]:
        return self._tables.get(seq_id, ())

    def num_blocks(self, seq_id: SeqId) -> int:
        return len(self._tables.get(seq_id, ()))

    def cpu_block_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._cpu_tables.get(seq_id, ()))

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

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest chain of cached blocks matching the request's known tokens.

        At least one token is always left to compute (its forward pass produces the next token), so
        the block holding the last known token is never reused: with the whole prompt cached, that
        block is computed again in a fresh block, and no shared block is ever written.

        Returns:
            The cached blocks (not yet held) and the number of tokens they cover.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_known_tokens - 1) // self.block_size
        hits: list[Block] = []
        for index in range(max_blocks):
            block = self.block_pool.get_cached_block(self._block_hash(request, index))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def prompt_block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hash chain of the full blocks `get_computed_blocks` could reuse for a request whose
        known tokens are `token_ids` (all but the block holding the last token)."""
        size = self.block_size
        hashes: list[BlockHash] = []
        for index in range((len(token_ids) - 1) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[index * size : (index + 1) * size]))
        return hashes

    def num_cached_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the chain `block_hashes` are in this pool's prefix cache: the
        exact hit a request with this chain would get now. A pure lookup: no ref count, no LRU
        position changes."""
        if not self.enable_prefix_caching:
            return 0
        get = self.block_pool.get_cached_block
        for index, block_hash in enumerate(block_hashes):
            if get(block_hash) is None:
                return index
        return len(block_hashes)

    def cache_full_blocks(self, request: Request) -> bool:
        """Registers the request's blocks that are full of known, scheduled tokens in the prefix
        cache (``num_computed_tokens`` counts the tokens of the plan being built: see the module's
        safety rule). Returns whether it registered any."""
        if not self.enable_prefix_caching:
            return False
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.seq_id, 0)
        if num_full <= start:
            return False  # the usual case: checked first, it is on every request's every step
        table = self._tables.get(request.seq_id)
        if not table:
            return False
        for index in range(start, num_full):
            self.block_pool.cache_block(table[index], self._block_hash(request, index))
        self._num_cached_blocks[request.seq_id] = num_full
        return True

    # ---- GPU blocks ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_tokens: int, cached_blocks: Sequence[Block] = ()
    ) -> list[int] | None:
        """Grows the request's table to hold ``num_tokens`` tokens.

        Args:
            request: the request; its table may be empty (admission) or not (a running request).
            num_tokens: tokens the table must cover after this step (computed + scheduled).
            cached_blocks: prefix-cache hits from ``get_computed_blocks``, which become the first
                blocks of an empty table.

        Returns:
            The ids of the newly allocated blocks (not the cached ones), or None if the free blocks
            (counting evictable cached ones) are too few; then nothing changed.
        """
        table = self._tables.get(request.seq_id)
        if table and not cached_blocks and num_tokens <= len(table) * self.block_size:
            if request.seq_id not in self._cpu_tables:
                return []  # the common decode step: the last block still has room
        if cached_blocks and table:
            raise ValueError(f"seq {request.seq_id}: cached blocks can only start an empty table")
        num_needed = self._num_new_blocks(request, num_tokens, cached_blocks)
        if num_needed == 0 and not cached_blocks:
            return []
        if num_needed > self._num_allocatable_blocks(cached_blocks):
            return None
        self.block_pool.touch(cached_blocks)
        new_blocks = self.block_pool.allocate(num_needed)
        if table is None:
            table = self._tables[request.seq_id] = []
        if cached_blocks:
            table.extend(cached_blocks)
            self._num_cached_blocks[request.seq_id] = len(cached_blocks)
        table.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def num_blocks_short(self, request: Request, num_tokens: int, cached_blocks: Sequence[Block] = ()) -> int:
        """How many more free blocks ``allocate_slots`` (or ``swap_in``, for a swapped-out request)
        would need to grow the request to ``num_tokens`` tokens; 0 if it fits."""
        num_needed = self._num_new_blocks(request, num_tokens, cached_blocks)
        return max(0, num_needed - self._num_allocatable_blocks(cached_blocks))

    def num_reclaimable_blocks(self, seq_ids: Sequence[SeqId], keep: Sequence[Block] = ()) -> int:
        """Blocks that releasing all of ``seq_ids`` would make allocatable: those no other request
        holds, except ``keep`` (prefix-cache hits the caller is about to take)."""
        holders: dict[Block, int] = {}
        for seq_id in seq_ids:
            for block in self._tables.get(seq_id, ()):
                holders[block] = holders.get(block, 0) + 1
        kept = set(keep)
        return sum(1 for block, count in holders.items() if count == block.ref_count and block not in kept)

    def _num_new_blocks(self, request: Request, num_tokens: int, cached_blocks: Sequence[Block] = ()) -> int:
        """Blocks to allocate for the request to hold ``num_tokens`` tokens: beyond its table and
        ``cached_blocks`` or, swapped out, a whole new table at least as long as its CPU one."""
        cpu_ids = self._cpu_tables.get(request.seq_id)
        if cpu_ids is not None:
            return max(_cdiv(num_tokens, self.block_size), len(cpu_ids))
        num_held = len(self._tables.get(request.seq_id, ()))
        return max(0, _cdiv(num_tokens, self.block_size) - num_held - len(cached_blocks))

    def _num_allocatable_blocks(self, cached_blocks: Sequence[Block] = ()) -> int:
        """Free blocks, less the prefix-cache hits sitting in the free queue: they stop being
        allocatable once the request holds them."""
        return self.block_pool.num_free_blocks - sum(1 for block in cached_blocks if block.ref_count == 0)

    def free(self, request: Request) -> None:
        """Releases the request's GPU blocks; its full, computed blocks stay in the prefix cache.

        Blocks are released last first, so the chain's tail is evicted before its prefix.
        """
        self.cache_full_blocks(request)
        table = self._tables.pop(request.seq_id, None)
        self._num_cached_blocks.pop(request.seq_id, None)
        if table:
            self.block_pool.free(reversed(table))

    def forget(self, seq_id: SeqId) -> None:
        """Drops what is kept for a request across preemptions (its hash chain); on finish."""
        self._hashes.pop(seq_id, None)

    # ---- swap ----------------------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the KV of the request's computed tokens to CPU blocks and frees its GPU blocks.

        Returns:
            (gpu_block_id, cpu_block_id) pairs for the plan's swap_out, or None (nothing changed)
            when the CPU pool is too small.
        """
        table = self._tables[request.seq_id]
        num_blocks = _cdiv(request.num_computed_tokens, self.block_size)
        if num_blocks > len(self._cpu_free):
            return None
        cpu_ids = [self._cpu_free.pop() for _ in range(num_blocks)]
        moves = [(block.block_id, cpu_id) for block, cpu_id in zip(table, cpu_ids, strict=False)]
        self._cpu_tables[request.seq_id] = cpu_ids
        self.free(request)
        return moves

    def swap_in(self, request: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Gives a swapped-out request a new GPU table for ``num_tokens`` tokens and copies its KV back.

        Returns:
            (cpu_block_id, gpu_block_id) pairs for the plan's swap_in, or None (nothing changed)
            when the free GPU blocks are too few.
        """
        cpu_ids = self._cpu_tables[request.seq_id]
        num_needed = self._num_new_blocks(request, num_tokens)
        if num_needed > self.block_pool.num_free_blocks:
            return None
        gpu_blocks = self.block_pool.allocate(num_needed)
        self._tables[request.seq_id] = gpu_blocks
        del self._cpu_tables[request.seq_id]
        self._cpu_release_after_step.extend(cpu_ids)
        return [(cpu_id, block.block_id) for cpu_id, block in zip(cpu_ids, gpu_blocks, strict=False)]

    def free_swapped(self, request: Request) -> None:
        """Releases the CPU blocks of a swapped-out request (aborted while swapped)."""
        self._cpu_free.extend(reversed(self._cpu_tables.pop(request.seq_id, [])))

    def end_step(self) -> None:
        """Called once a plan is complete: CPU blocks read by its swap_in become free."""
        self._cpu_free.extend(reversed(self._cpu_release_after_step))
        self._cpu_release_after_step.clear()
