"""A step's inputs: built with NumPy on the host, copied to the device without blocking.

Every request the executor holds owns a *slot*: a row of the persistent device block table and an
entry of `last_token`, where the sampler writes the request's newest token on the device. A decode
step's input token is always that token, so it is gathered from `last_token` on the device and step
N+1 can be built and launched before step N's sampled values reach the host. Prompt tokens (and
the tokens a resumed request re-sends) are known on the host and copied with the rest.

The block table is updated with each plan's *new* block ids only (a scatter of a few entries), and a
host mirror of it gives slot mappings without a device round trip. A model with several KV-cache
groups (executor.kv_groups) has one table per group: every table below has a leading group
dimension, as have the slot mappings (each layer writes into its group's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.model import AttentionMetadata
from pagedserve.executor.transfer import int64_to_device


class RequestSlots:
    """Device rows for up to `capacity` held requests: block tables and last sampled token.

    Row `capacity` (`pad_row`) is never handed out: its block table rows stay all zeros (block 0),
    so CUDA-graph padding rows can point at it harmlessly.
    """

    def __init__(
        self, capacity: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1
    ) -> None:
        self.capacity = capacity
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_groups = num_groups
        self.device = device
        self.pad_row = capacity
        shape = (num_groups, capacity + 1, max_blocks_per_seq)
        self.table_host = np.zeros(shape, dtype=np.int32)
        self.table = torch.zeros(shape, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self._free: list[int] = []
        self._updates: list[tuple[int, int, int, Sequence[int]]] = []
        self.reset()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def reset(self) -> None:
        """Frees every slot (a new lease). Stale rows are harmless: kernels read only up to seq_len
        (and, in a sliding-window group, from the window's start)."""
        self._free = list(range(self.capacity - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._updates.clear()

    def allocate(self) -> int:
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def set_blocks(self, slot: int, first: int, block_ids: Sequence[int], group: int = 0) -> None:
        """Records block_ids as entries first, first + 1, ... of the slot's table in `group` (host
        mirror now, device at the next `flush`)."""
        if block_ids:
            self.table_host[group, slot, first : first + len(block_ids)] = block_ids
            self._updates.append((group, slot, first, block_ids))

    def flush(self) -> None:
        """Scatters the recorded new entries into the device tables (one copy, one kernel)."""
        if not self._updates:
            return
        width, rows = self.max_blocks_per_seq, self.capacity + 1
        index = np.concatenate(
            [(g * rows + slot) * width + first + np.arange(len(ids)) for g, slot, first, ids in self._updates]
        )
        values = np.concatenate([np.asarray(ids, dtype=np.int64) for *_, ids in self._updates])
        self._updates.clear()
        index_d, values_d = int64_to_device([index, values], self.device)
        self.table.view(-1).index_copy_(0, index_d, values_d.to(torch.int32))

    def block_tables(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[num_groups, len(rows), width] block tables of the given slots, gathered on the device."""
        return self.table[:, :, :width].index_select(1, rows)

    def input_ids(self, host_ids: torch.Tensor, feed_slots: torch.Tensor) -> torch.Tensor:
        """Each token's id: last_token[feed_slot] where feed_slot >= 0, else the host-known id."""
        fed = self.last_token.index_select(0, feed_slots.clamp(min=0))
        return torch.where(feed_slots >= 0, fed, host_ids)

    def store_sampled(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Writes each sampling row's token into its slot: the next decode step's input."""
        self.last_token.index_copy_(0, slots, token_ids)


@dataclass(frozen=True)
class HostBatch:
    """One step's inputs as NumPy int64 arrays; S sequences, T tokens, R sampling rows.

    Attributes:
        rows: [S] each sequence's block table row (its slot).
        seq_lens: [S] context length including the new tokens.
        cu_seqlens: [S + 1] token ranges of the sequences.
        positions: [T].
        slot_mapping: [G, T], per KV-cache group.
        host_ids: [T] token ids known on the host (0 where the token is fed from the device).
        feed_slots: [T] slot whose last sampled token is this token, -1 for host-known tokens.
        logits_indices: [R] the token rows that are sampled (each sampling sequence's last token).
        sample_rows: [R] the slots of the sampling sequences.
        width: block table columns this step needs.
    """

    rows: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    host_ids: np.ndarray
    feed_slots: np.ndarray
    logits_indices: np.ndarray
    sample_rows: np.ndarray
    width: int

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def decode_only(self) -> bool:
        """Every sequence computes exactly one token and samples: the CUDA-graph shape."""
        return len(self.positions) == len(self.rows) == len(self.logits_indices)


def build_host_batch(
    rows: np.ndarray,
    starts: np.ndarray,
    q_lens: np.ndarray,
    samples: np.ndarray,
    host_chunks: Sequence[np.ndarray],
    table: np.ndarray,
    block_size: int,
    fed_offsets: np.ndarray | None = None,
) -> HostBatch:
    """Flattens the scheduled sequences into one batch, vectorised over tokens.

    Args:
        rows: [S] block table row (slot) of each sequence in `table`.
        starts: [S] position of each sequence's first new token (= tokens already computed).
        q_lens: [S] new tokens per sequence (> 0).
        samples: [S] bool, whether the sequence samples after its last new token.
        host_chunks: per sequence, the host-known ids of its new tokens: a prefix of them. The rest
            (at most one: the token the executor sampled last) comes from `last_token[row]`.
        table: host block tables [G, rows, width], indexed by group and row.
        fed_offsets: speculative decoding: [S] the offset of the one token fed from `last_token`
            (-1: none); the host chunk then holds every other new token (a sequence's proposals
            follow its fed token). None: the default above.
    """
    num_seqs = len(rows)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    offsets = np.arange(num_tokens) - cu[:-1][seq_of_token]
    positions = offsets + starts[seq_of_token]
    token_rows = rows[seq_of_token]
    slot_mapping = table[:, token_rows, positions // block_size].astype(np.int64) * block_size + (
        positions % block_size
    )
    host_lens = np.fromiter((len(c) for c in host_chunks), dtype=np.int64, count=num_seqs)
    if fed_offsets is None:
        from_host = offsets < host_lens[seq_of_token]
    else:
        from_host = offsets != fed_offsets[seq_of_token]
    host_ids = np.zeros(num_tokens, dtype=np.int64)
    if host_lens.any():
        host_ids[from_host] = np.concatenate([c for c in host_chunks if len(c)])
    seq_lens = starts + q_lens
    return HostBatch(
        rows=rows,
        seq_lens=seq_lens,
        cu_seqlens=cu,
        positions=positions,
        slot_mapping=slot_mapping,
        host_ids=host_ids,
        feed_slots=np.where(from_host, -1, token_rows),
        logits_indices=(cu[1:] - 1)[samples],
        sample_rows=rows[samples],
        width=int(-(-seq_lens.max() // block_size)) if num_seqs else 1,
    )


def decode_batch(batch: HostBatch, token_rows: np.ndarray, rows: np.ndarray, block_size: int) -> HostBatch:
    """A decode batch of `batch`'s tokens at `token_rows`, one per sequence (`rows`: their slots),
    each sampled: what `build_host_batch` builds for them, taken from `batch` (a draft model's first
    proposal pass over the tokens its step's verifications start from)."""
    num = len(token_rows)
    positions = batch.positions[token_rows]
    seq_lens = positions + 1
    return HostBatch(
        rows=rows,
        seq_lens=seq_lens,
        cu_seqlens=np.arange(num + 1, dtype=np.int64),
        positions=positions,
        slot_mapping=batch.slot_mapping[:, token_rows],
        host_ids=batch.host_ids[token_rows],
        feed_slots=batch.feed_slots[token_rows],
        logits_indices=np.arange(num, dtype=np.int64),
        sample_rows=rows,
        width=int(-(-seq_lens.max() // block_size)) if num else 1,
    )


@dataclass(frozen=True)
class StepInputs:
    """Device tensors for one eager forward pass."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: torch.Tensor  # slots of the sampling rows, for `RequestSlots.store_sampled`


def stage_batch(batch: HostBatch, slots: RequestSlots) -> StepInputs:
    """Copies `batch` to the device in one non-blocking transfer and gathers ids and block tables."""
    (rows, seq_lens, cu, positions, slot_mapping, host_ids, feed_slots, logits_indices, sample_rows) = (
        int64_to_device(
            [
                batch.rows,
                batch.seq_lens,
                batch.cu_seqlens,
                batch.positions,
                batch.slot_mapping.reshape(-1),
                batch.host_ids,
                batch.feed_slots,
                batch.logits_indices,
                batch.sample_rows,
            ],
            slots.device,
        )
    )
    all_from_host = not (batch.feed_slots >= 0).any()
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=slot_mapping.view(batch.slot_mapping.shape),
        block_tables=slots.block_tables(rows, batch.width),
        seq_lens=seq_lens.to(torch.int32),
        cu_seqlens_q=cu.to(torch.int32),
        decode_only=bool((np.diff(batch.cu_seqlens) == 1).all()),
    )
    input_ids = host_ids if all_from_host else slots.input_ids(host_ids, feed_slots)
    return StepInputs(input_ids, meta, logits_indices, sample_rows)


def build_step_inputs(
    chunks: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    needs_logits: Sequence[bool],
    block_size: int,
    device: torch.device,
    num_groups: int = 1,
) -> StepInputs:
    """Inputs for sequences given by explicit token chunks and block tables (profiling, tests).

    Args:
        chunks: per sequence, the token ids it computes this step (non-empty).
        starts: per sequence, the position of its first new token.
        block_tables: per sequence, its block ids (covering every new position), the same in each of
            the `num_groups` KV-cache groups.
        needs_logits: per sequence, whether its last new token is sampled from.
    """
    num_seqs = len(chunks)
    width = max(len(t) for t in block_tables)
    slots = RequestSlots(num_seqs, width, device, num_groups)
    for row, table in enumerate(block_tables):
        for group in range(num_groups):
            slots.set_blocks(row, 0, list(table), group)
    slots.flush()
    batch = build_host_batch(
        rows=np.arange(num_seqs, dtype=np.int64),
        starts=np.asarray(starts, dtype=np.int64),
        q_lens=np.fromiter((len(c) for c in chunks), dtype=np.int64, count=num_seqs),
        samples=np.asarray(needs_logits, dtype=bool),
        host_chunks=[np.asarray(c, dtype=np.int64) for c in chunks],
        table=slots.table_host,
        block_size=block_size,
    )
    return stage_batch(batch, slots)


@dataclass(frozen=True)
class DecodePassInputs:
    """What changes between a draft model's proposal passes, on the device: [S] positions,
    [1, S] slot mapping (one KV-cache group), [S] int64 context lengths."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor


def next_pass_inputs(
    rows: torch.Tensor,
    base: torch.Tensor,
    limits: torch.Tensor,
    j: int,
    table: torch.Tensor,
    block_size: int,
) -> DecodePassInputs:
    """Proposal pass j's inputs (one token per sequence), computed on the device from pass 0's, so
    the k + 1 passes of a step queue back to back with no host batch between them (a CUDA graph
    can hold them all). A sequence computes position base + j while that is at most its limit (its
    last proposal's position: that pass only writes its KV); past it (fewer proposals than the
    widest, or a graph's padding row, limit -1) it stays at base with slot -1: no KV is written
    and its result is ignored.

    Args:
        rows: [S] slots (block table rows). base: [S] pass 0's positions. limits: [S] int64.
        table: the device block tables [G, rows, width] (`RequestSlots.table`; group 0 is used).
    """
    wanted = base + j
    active = wanted <= limits
    positions = torch.where(active, wanted, base)
    blocks = table[0, rows, positions // block_size].long()
    slots = torch.where(active, blocks * block_size + positions % block_size, -1)
    return DecodePassInputs(positions, slots[None], positions + 1)
