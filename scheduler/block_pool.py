"""Physical GPU KV blocks: reference counts, the free queue and the prefix-cache hash map.

The pool is the only owner of this state. The free queue serves two purposes at once: it is the
list of blocks that can be handed out, and the LRU of *cached* free blocks (blocks no request holds
any more but whose KV is still valid and findable by hash). Allocation takes from the head:

* freed blocks without a hash go to the head, so they are reused before any cached block;
* freed blocks with a hash go to the tail, so cached blocks are evicted least recently freed first.

Callers free a request's blocks last block first, so that the tail of a chain (the part least
likely to be shared) is evicted before its prefix.

Models whose layers attend differently (full attention and sliding windows) split their layers into
KV-cache groups (see scheduler.kv_cache_manager): every block of the pool can serve any group, but
a block holds one group's layers, so the prefix cache keeps one hash map per group.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_ROOT_HASH = BlockHash(bytes(32))


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block, chained from its parent block's hash (None for the first block).

    A cryptographic digest, not Python's ``hash()``: a silent collision would serve another
    request's KV. The parent hash makes equal blocks at different prefixes distinct.
    """
    digest = hashlib.blake2b(parent if parent is not None else _ROOT_HASH, digest_size=32)
    digest.update(array("I", token_ids).tobytes())
    return BlockHash(digest.digest())


class Block:
    """One physical block. ``prev``/``next`` link it into the free queue while it is free."""

    __slots__ = ("block_id", "ref_count", "block_hash", "group", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.group = 0  # the KV-cache group whose hash map holds it (while block_hash is set)
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"Block({self.block_id}, ref={self.ref_count}{cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) push at both ends, pop at the head and removal
    from the middle (a cached free block that gets reused by a prefix hit)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)  # sentinels: no None checks on the hot path
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = block
        nxt.prev = block
        self._len += 1

    def append(self, block: Block) -> None:
        """Pushes at the tail (evicted last)."""
        assert self._tail.prev is not None
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: Block) -> None:
        """Pushes at the head (handed out first)."""
        assert self._head.next is not None
        self._link(block, self._head, self._head.next)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        block = self._head.next
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block


class BlockPool:
    """All GPU blocks of one executor.

    Invariants: a block is in the free queue iff its ref_count is 0; a block has a hash iff its
    group's hash map maps that hash to it; ``num_free_blocks + num_blocks_in_use == num_blocks``,
    and ``num_cached_free_blocks`` counts the free blocks that have a hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.enable_caching = enable_caching
        self.blocks: tuple[Block, ...] = tuple(Block(i) for i in range(num_blocks))
        self._free = FreeBlockQueue(self.blocks)
        self._cached: list[dict[BlockHash, Block]] = [{} for _ in range(num_groups)]
        self._num_cached_free = 0
        # With a CPU tier below the prefix cache, each cached block that `allocate` evicts is
        # recorded here as (block id, group, hash), for the KV-cache manager to offload.
        self.record_evictions = False
        self.evicted: list[tuple[int, int, BlockHash]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not: what an allocation can take."""
        return len(self._free)

    @property
    def num_blocks_in_use(self) -> int:
        return len(self.blocks) - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, held or free."""
        return sum(len(cached) for cached in self._cached)

    def free_queue(self) -> list[Block]:
        """The free queue from head (next handed out) to tail; for tests and debugging."""
        return list(self._free)

    def cached_free_blocks_ahead(self, num_blocks: int) -> Iterator[Block]:
        """The cached blocks among the next `num_blocks` that `allocate` would hand out, in that
        order. Uncached free blocks enter the queue at its head and cached ones at its tail, so the
        queue is its uncached blocks, then its cached ones: with at least `num_blocks` uncached, none
        (and no walk)."""
        num_uncached = len(self._free) - self._num_cached_free
        if num_uncached >= num_blocks:
            return
        for index, block in enumerate(self._free):
            if index >= num_blocks:
                return
            if block.block_hash is not None:
                yield block

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        return self._cached[group].get(block_hash)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Takes ``num_blocks`` blocks from the head of the free queue, evicting their hashes.

        Raises:
            ValueError: not enough free blocks (callers check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                del self._cached[block.group][block.block_hash]
                if self.record_evictions:
                    self.evicted.append((block.block_id, block.group, block.block_hash))
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Adds a holder to each block (a prefix-cache hit), taking free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drops one holder of each block, in the order given; a block whose last holder left goes
        back to the free queue (tail if cached, head if not)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"{block} freed more often than held")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.appendleft(block)
                else:
                    self._free.append(block)
                    self._num_cached_free += 1

    def cache_block(self, block: Block, block_hash: BlockHash, group: int = 0) -> bool:
        """Registers a held, full block of KV-cache group `group` under its hash so later requests
        can reuse it.

        Returns False (and changes nothing) when caching is off, the block already has a hash, or
        another block already holds this hash (two requests computed the same prefix at once; the
        first one stays the canonical copy, the other is freed uncached later).
        """
        cached = self._cached[group]
        if not self.enable_caching or block.block_hash is not None or block_hash in cached:
            return False
        assert block.ref_count > 0, "only held blocks get cached"
        block.block_hash = block_hash
        block.group = group
        cached[block_hash] = block
        return True
