"""CUDA graphs of the decode forward pass (embedding -> final norm -> LM head), one per padded size.

A decode step of the 8B model launches ~20 kernels per layer; launched one by one from Python that
is several milliseconds of host time per step, and at small batches more than the GPU needs to run
them. A replayed graph launches them all at once.

A graph replays fixed addresses, so its inputs live in static device buffers: one int64 buffer
with a field of `capacity` entries per input (host ids, feed slots, positions, slot mapping, context
lengths, slots), filled by one non-blocking copy per step. A batch of b sequences replays the
smallest graph of size B >= b; rows b..B-1 are padding that cannot disturb anything:

* slot_mapping -1: `write_kv` skips the row, so no KV block is written;
* context length 1 over the pad row of the block table (block 0): attention reads key 0 of block 0,
  which always exists, and its result is discarded;
* feed slot -1 with host id 0: a valid token id;
* their logits rows are never sampled.

The Triton kernels choose grids and splits from tensor *shapes* only, and a graph's block tables
always have the full `max_blocks_per_seq` columns, so every launch parameter is fixed at capture.
All graphs share one memory pool and are captured largest first, so the smaller ones reuse the
largest one's activation memory; their logits go to one shared float32 buffer.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from executor.model import AttentionMetadata, LlamaModel
from executor.step_inputs import HostBatch, RequestSlots
from executor.transfer import pack_int64

log = structlog.get_logger(__name__)

_FIELDS = ("host_ids", "feed_slots", "positions", "slot_mapping", "seq_lens", "rows")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8 up to 128 and every 16 beyond, capped by (and always ending at)
    max_num_seqs: padding wastes at most 1/9 of a step above 8 sequences."""
    sizes = [1, 2, 4, *range(8, 129, 8), *range(144, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """Captures and replays the decode forward pass for a set of padded batch sizes."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: RequestSlots,
        sizes: list[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.slots = slots
        self.sizes = sorted(sizes)
        self.capacity = self.sizes[-1]
        device = slots.device
        self._free_at_start = 0
        if device.type == "cuda":  # graph memory counts from here
            torch.cuda.synchronize(device)
            self._free_at_start = torch.cuda.mem_get_info(device)[0]
        self._static = torch.zeros(len(_FIELDS) * self.capacity, dtype=torch.int64, device=device)
        self._logits = torch.empty((self.capacity, model.spec.vocab_size), dtype=torch.float32, device=device)
        # A decode batch's cu_seqlens is 0, 1, ..., size: a prefix of one arange. Everything a graph
        # reads must outlive it; a tensor made for one capture and dropped would be freed and reused.
        self._cu_seqlens = torch.arange(self.capacity + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.device_bytes = 0  # device memory the graphs, their pool and static buffers took
        self.capture_seconds = 0.0

    def _field(self, name: str, size: int) -> torch.Tensor:
        offset = _FIELDS.index(name) * self.capacity
        return self._static[offset : offset + size]

    def _forward(self, size: int) -> None:
        """The captured work: token gather, block table gather, forward pass into the logits buffer."""
        f = {name: self._field(name, size) for name in _FIELDS}
        meta = AttentionMetadata(
            positions=f["positions"],
            slot_mapping=f["slot_mapping"],
            block_tables=self.slots.block_tables(f["rows"], self.slots.max_blocks_per_seq),
            seq_lens=f["seq_lens"].to(torch.int32),
            cu_seqlens_q=self._cu_seqlens[: size + 1],
        )
        input_ids = self.slots.input_ids(f["host_ids"], f["feed_slots"])
        self.model(input_ids, meta, self.kv_caches, None, out=self._logits[:size])

    def _fill(self, batch: HostBatch | None) -> None:
        """Copies a batch into the static inputs, padding rows after it (all rows if None)."""
        n = 0 if batch is None else batch.num_seqs
        pad = self.capacity - n
        fill = {"host_ids": 0, "feed_slots": -1, "positions": 0, "slot_mapping": -1, "seq_lens": 1}
        fill["rows"] = self.slots.pad_row
        arrays = []
        for name in _FIELDS:
            head = [] if batch is None else getattr(batch, name)
            arrays.append(_concat(head, fill[name], pad))
        host, _ = pack_int64(arrays, self._static.device, field_len=self.capacity)
        self._static.copy_(host, non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size (largest first) and logs the time and device memory it took."""
        device = self._static.device
        start = time.perf_counter()
        self._fill(None)
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' activations: eager steps get them back as needed
        self.device_bytes = self._free_at_start - torch.cuda.mem_get_info(device)[0]
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "executor.cuda_graphs",
            sizes=len(self.sizes),
            largest=self.capacity,
            seconds=round(self.capture_seconds, 2),
            device_gib=round(self.device_bytes / 2**30, 3),
        )

    def can_run(self, batch: HostBatch) -> bool:
        return batch.decode_only and batch.num_seqs <= self.capacity

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, batch: HostBatch) -> torch.Tensor:
        """Replays the smallest graph that holds `batch`; returns its float32 logits [b, vocab]."""
        self._fill(batch)
        self._graphs[self.padded_size(batch.num_seqs)].replay()
        return self._logits[: batch.num_seqs]

    @torch.inference_mode()
    def run_uncaptured(self, batch: HostBatch) -> torch.Tensor:
        """Computes what `run` replays, padding included, without a graph (tests run it on the CPU)."""
        self._fill(batch)
        self._forward(self.padded_size(batch.num_seqs))
        return self._logits[: batch.num_seqs]

    def sample_rows(self, num_seqs: int) -> torch.Tensor:
        """The slots of a replayed batch's rows (all of them sample), already on the device."""
        return self._field("rows", num_seqs)


def _concat(head, value: int, pad: int) -> np.ndarray:
    return np.concatenate((np.asarray(head, dtype=np.int64), np.full(pad, value, dtype=np.int64)))
