"""CUDA graphs of the forward pass (embedding -> final norm -> LM head), for every kind of step.

Launched one by one from Python, the 8B model's ~45 kernels per layer cost tens of milliseconds of
host time per step: more than the GPU needs for a decode step, and more than it needs for a step
that mixes decodes with a prefill chunk of a few hundred tokens (what continuous batching runs
whenever a request finishes and another is admitted). A replayed graph launches them all at once.
Two families are captured:

* *decode* graphs, one per padded batch size B (`decode_graph_sizes`): B sequences of one token,
  every row sampled; the attention runs the split-KV decode kernel.
* *mixed* graphs, one per padded token count T (`mixed_graph_sizes`): any batch of up to
  `max_num_seqs` sequences and T tokens (prefill chunks, whole prompts, decodes), laid out as
  `num_seq_slots` sequences so the shape never depends on the batch; the attention runs the varlen
  kernel. Logits are computed for `num_seq_slots` rows (the sampled rows first). Speculative
  decoding's verification steps run here too: their logits rows are the sampled rows and then the
  k + 1 rows of each verified sequence, as long as they number at most `num_seq_slots`.

A graph replays fixed addresses, so its inputs live in one static int64 device buffer (a field per
input), filled by one non-blocking copy per step. Padding cannot disturb anything:

* padding tokens have slot_mapping -1 (`write_kv` skips them, no KV block is written), host id 0
  and feed slot -1 (a valid token id), position 0;
* a decode graph's padding sequences have one token and context length 1 over the pad row of the
  block table (block 0, which always exists); their results are discarded;
* a mixed graph's padding sequences have no tokens, except the last few, which share the padding
  tokens as prompts over the pad row, none longer than a block table row covers (there are always
  enough of them: `num_seq_slots` reserves them beyond `max_num_seqs`); their rows are never
  sampled;
* logits rows past the sampled ones are never read.

Speculative decoding's draft model runs k + 1 one-token passes per verification step, each from
the previous one's proposal (the last only writes the KV of the last proposal). Only pass 0 is
staged from the host (`run`); a later pass rewrites its decode graph's per-token fields from device
tensors (`run_next`, `step_inputs.next_pass_inputs`) and replays it again. For greedy requests the
k + 1 passes, with their argmax, are also captured as one *proposal* graph per small decode size
(`capture_proposals`, `propose`): one replay per step; and their greedy acceptance, read from the
target's logits after its mixed graph (a step of verifications alone, k proposals each), as one
*acceptance* graph per size (`capture_acceptance`, `accept`): the step's tokens and counts, and the
feed of each sequence's last token, without a kernel launched one by one from the host. n-gram
proposals come in the plan as host ids: their greedy acceptance reads them, and each sequence's
rows, from the target's mixed graph's static inputs, as one graph per (size, k) captured when a
step first needs it (`accept_points`).

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

from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.spec_decode import accept_greedy
from pagedserve.executor.step_inputs import DecodePassInputs, HostBatch, RequestSlots, next_pass_inputs
from pagedserve.executor.transfer import aligned_length
from pagedserve.kernels import layers

log = structlog.get_logger(__name__)

# Proposal graphs are captured for decode sizes up to this many sequences: speculation pays at small
# batches (W7 on the H200: 0.81x of no speculation at 16 requests before them), where the host cost
# of k separate passes weighs most; larger batches replay one decode graph per pass.
PROPOSAL_GRAPH_MAX_SEQS = 32

# Device-side input ids of a graph step (`StepGraphs._set_token_ids`): (batch rows, ids), or the
# [S, k] proposals of S sequences of k + 1 tokens each.
TokenIds = tuple[torch.Tensor, torch.Tensor] | torch.Tensor

# What the CPU's static inputs hold where a fill wrote nothing: no token id, slot, row or position.
_POISON = 1 << 40

_TOKEN_FIELDS = ("host_ids", "feed_slots", "positions", "slot_mapping")
# `limits`: draft proposal graphs' per-row last proposal position (`next_pass_inputs`; -1: padding).
_SEQ_FIELDS = ("seq_lens", "rows", "cu_seqlens", "logits_indices", "sample_rows", "limits")


def decode_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every 8 up to 128 and every 16 beyond, capped by (and always ending at)
    max_num_seqs: padding wastes at most 1/9 of a step above 8 sequences."""
    sizes = [1, 2, 4, *range(8, 129, 8), *range(144, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def mixed_graph_sizes(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Token counts of the mixed graphs: every 128 up to 2048, every 256 up to 4096, every 512
    beyond, ending at the most tokens a step can hold. Padding wastes at most ~1/8 of a step above
    1024 tokens (below that a step is bound by reading the weights, so its length matters little).
    """
    largest = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    sizes, size = [], 0
    while size < largest:
        size = min(size + (128 if size < 2048 else 256 if size < 4096 else 512), largest)
        sizes.append(size)
    return sizes


class StepGraphs:
    """Captures and replays the forward pass of decode batches and of mixed batches."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slots: RequestSlots,
        decode_sizes: list[int],
        mixed_sizes: list[int],
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.slots = slots
        self.decode_sizes = sorted(decode_sizes)
        self.mixed_sizes = sorted(mixed_sizes)
        self.max_decode = self.decode_sizes[-1] if self.decode_sizes else 0
        self.max_seqs = slots.capacity
        # Padding tokens form sequences of at most a block table row's worth of tokens; mixed graphs
        # reserve enough sequence slots beyond max_num_seqs for the largest padding. Their count
        # must differ from every token count: equal counts would select the decode kernel.
        block_size = kv_caches[0][0].shape[1]
        self.max_pad_seq_len = slots.max_blocks_per_seq * block_size
        gaps = np.diff([0, *self.mixed_sizes])
        self.num_pad_seqs = max(1, -(-int(gaps.max(initial=1)) // self.max_pad_seq_len))
        self.num_seq_slots = slots.capacity + self.num_pad_seqs
        while self.num_seq_slots in self.mixed_sizes:
            self.num_seq_slots += 1
        device = slots.device
        self._free_at_start = 0
        if device.type == "cuda":  # graph memory counts from here
            torch.cuda.synchronize(device)
            self._free_at_start = torch.cuda.mem_get_info(device)[0]
        # Aligned capacities: the fields start 16-byte aligned (Triton specialises on alignment).
        tokens = max(self.max_decode, self.mixed_sizes[-1] if self.mixed_sizes else 0)
        self._token_capacity = aligned_length(tokens)
        self._seq_capacity = aligned_length(self.num_seq_slots + 1)  # cu_seqlens has one entry more
        self._offsets: dict[str, int] = {}
        offset = 0
        for names, length in ((_TOKEN_FIELDS, self._token_capacity), (_SEQ_FIELDS, self._seq_capacity)):
            for name in names:
                self._offsets[name] = offset
                offset += length * self._rows(name)
        self._static = torch.zeros(offset, dtype=torch.int64, device=device)
        logits_rows = max(self.max_decode, self.num_seq_slots)
        self._logits = torch.empty((logits_rows, model.spec.vocab_size), dtype=torch.float32, device=device)
        # A decode batch's cu_seqlens is 0, 1, ..., size: a prefix of one arange. Everything a graph
        # reads must outlive it; a tensor made for one capture and dropped would be freed and reused.
        self._decode_cu_seqlens = torch.arange(self.max_decode + 1, dtype=torch.int32, device=device)
        self._decode_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._no_batch = _empty_batch(slots.num_groups)  # what a capture fills: padding alone
        # Draft proposals (`capture_proposals`): the proposals, and one graph per decode size of the
        # k + 1 passes (each row's limit is a static field, staged with pass 0's inputs).
        self._proposals = torch.zeros((self.max_decode, 0), dtype=torch.int64, device=device)
        self._proposal_sizes: list[int] = []
        self._proposal_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Greedy acceptance (`capture_acceptance`): the target's logits it reads, its [size, k + 2]
        # output (the k + 1 tokens, then the count) and one graph per size.
        self._accept_logits: torch.Tensor | None = None
        self._accepted = torch.zeros((self.max_decode, 0), dtype=torch.int64, device=device)
        self._acceptance_sizes: list[int] = []
        self._acceptance_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Greedy acceptance of point proposals (n-gram: `accept_points`), per (decode size, k): its
        # [size, k + 2] output and its graph, captured the first time a step needs it, in a pool
        # of their own (None on the CPU, where it runs eagerly).
        self._point_acceptance: dict[tuple[int, int], tuple[torch.Tensor, torch.cuda.CUDAGraph | None]] = {}
        self._point_pool = None
        self._pool = None
        self.device_bytes = 0  # device memory the graphs, their pool and static buffers took
        self.capture_seconds = 0.0

    @property
    def num_graphs(self) -> int:
        return len(self.decode_sizes) + len(self.mixed_sizes)

    @property
    def logits(self) -> torch.Tensor:
        """The float32 buffer every graph writes its logits rows into (a fixed address)."""
        return self._logits

    def _rows(self, name: str) -> int:
        """Rows of a field: one per KV-cache group for the slot mapping, else one."""
        return self.slots.num_groups if name == "slot_mapping" else 1

    def _field(self, name: str, size: int) -> torch.Tensor:
        offset = self._offsets[name]
        if name == "slot_mapping":  # [num_groups, size]
            rows, capacity = self.slots.num_groups, self._token_capacity
            return self._static[offset : offset + rows * capacity].view(rows, capacity)[:, :size]
        return self._static[offset : offset + size]

    def _forward(self, num_tokens: int, mixed: bool) -> None:
        """The captured work: token gather, block table gather, forward pass into the logits buffer."""
        num_seqs = self.num_seq_slots if mixed else num_tokens
        tokens = {name: self._field(name, num_tokens) for name in _TOKEN_FIELDS}
        seqs = {name: self._field(name, num_seqs) for name in _SEQ_FIELDS}
        if mixed:
            cu_seqlens = self._field("cu_seqlens", num_seqs + 1).to(torch.int32)
        else:
            cu_seqlens = self._decode_cu_seqlens[: num_seqs + 1]
        meta = AttentionMetadata(
            positions=tokens["positions"],
            slot_mapping=tokens["slot_mapping"],
            block_tables=self.slots.block_tables(seqs["rows"], self.slots.max_blocks_per_seq),
            seq_lens=seqs["seq_lens"].to(torch.int32),
            cu_seqlens_q=cu_seqlens,
            decode_only=not mixed,
        )
        input_ids = self.slots.input_ids(tokens["host_ids"], tokens["feed_slots"])
        logits_indices = seqs["logits_indices"] if mixed else None
        self.model(input_ids, meta, self.kv_caches, logits_indices, out=self._logits[:num_seqs])

    def _fill(
        self, batch: HostBatch | None, num_tokens: int, mixed: bool, limits: np.ndarray | None = None
    ) -> None:
        """Copies `batch` into the static inputs, padded to `num_tokens` tokens (and, for a mixed
        graph, `num_seq_slots` sequences); all padding if batch is None. `limits`: a proposal
        graph's, per sequence (padding rows get -1); None for the graphs that do not read them.

        Only the prefix of each field that this graph reads is written (`_forward` reads the first
        num_tokens / num_seqs entries): the rest of the staging buffer is left as allocated and
        never read, so a step costs the host O(its tokens), not the fields' capacities (the
        largest mixed graph's, 8,192 tokens by default: ~260 KB zero-padded and packed per fill
        before). One non-blocking copy moves the buffer; on the CPU it is written in place."""
        b = self._no_batch if batch is None else batch
        t, s = len(b.positions), len(b.rows)
        pad_tokens = num_tokens - t
        if mixed:
            pad_seqs = self.num_seq_slots - s  # >= num_pad_seqs
            # Capture spreads its tokens over every slot (none longer than a real sequence); a batch
            # spreads its padding over the last num_pad_seqs slots.
            spread = pad_seqs if batch is None else self.num_pad_seqs
            q_lens = np.zeros(pad_seqs, dtype=np.int64)
            q_lens[pad_seqs - spread :] = pad_tokens // spread
            q_lens[pad_seqs - spread : pad_seqs - spread + pad_tokens % spread] += 1
            seq_lens_pad, cu_pad = q_lens, t + np.cumsum(q_lens)
        else:  # a decode graph reads no cu_seqlens (`_forward`)
            pad_seqs = num_tokens - s
            seq_lens_pad, cu_pad = 1, None
        num_rows = s + pad_seqs - len(b.logits_indices)  # logits rows past the sampled ones
        pad_row = self.slots.pad_row
        on_cpu = self._static.device.type == "cpu"
        if on_cpu:  # (tests: the graphs' layout uncaptured) poisoned where not written, so that a
            self._static.fill_(_POISON)  # graph reading past its fill fails there too
        host = self._static if on_cpu else torch.empty(self._static.shape, dtype=torch.int64, pin_memory=True)
        view, at = host.numpy(), self._offsets
        # Per field: its values, then a padding value (or array) and how many entries it fills.
        _write(view, at["host_ids"], b.host_ids, 0, pad_tokens)
        _write(view, at["feed_slots"], b.feed_slots, -1, pad_tokens)
        _write(view, at["positions"], b.positions, 0, pad_tokens)
        _write(view, at["seq_lens"], b.seq_lens, seq_lens_pad, pad_seqs)
        _write(view, at["rows"], b.rows, pad_row, pad_seqs)
        if cu_pad is not None:
            _write(view, at["cu_seqlens"], b.cu_seqlens, cu_pad, len(cu_pad))
        _write(view, at["logits_indices"], b.logits_indices, 0, num_rows)
        _write(view, at["sample_rows"], b.sample_rows, pad_row, num_rows)
        if limits is not None:
            _write(view, at["limits"], limits, -1, s + pad_seqs - len(limits))
        for group, row in enumerate(b.slot_mapping):  # one row of token_capacity per KV-cache group
            _write(view, at["slot_mapping"] + group * self._token_capacity, row, -1, pad_tokens)
        if not on_cpu:
            self._static.copy_(host, non_blocking=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every graph (largest first) and logs the time and device memory it took."""
        device = self._static.device
        start = time.perf_counter()
        pool = self._pool = torch.cuda.graph_pool_handle()
        todo = [(n, True, self._mixed_graphs) for n in reversed(self.mixed_sizes)]
        todo += [(n, False, self._decode_graphs) for n in reversed(self.decode_sizes)]
        for num_tokens, mixed, graphs in todo:
            self._fill(None, num_tokens, mixed)
            self._forward(num_tokens, mixed)  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(num_tokens, mixed)
            graphs[num_tokens] = graph
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-ups' activations: eager steps get them back as needed
        self.device_bytes = self._free_at_start - torch.cuda.mem_get_info(device)[0]
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "executor.cuda_graphs",
            decode_graphs=len(self.decode_sizes),
            largest_decode=self.max_decode,
            mixed_graphs=len(self.mixed_sizes),
            largest_mixed=self.mixed_sizes[-1] if self.mixed_sizes else 0,
            seconds=round(self.capture_seconds, 2),
            device_gib=round(self.device_bytes / 2**30, 3),
        )

    @torch.inference_mode()
    def capture_proposals(self, num_passes: int, max_size: int) -> None:
        """Captures, for each decode size up to `max_size`, a draft model's `num_passes` greedy
        proposal passes (and the pass that writes the last proposal's KV) as one graph (after
        `capture`, in its memory pool)."""
        device = self._static.device
        start = time.perf_counter()
        self.prepare_proposals(num_passes, max_size)
        for size in reversed(self._proposal_sizes):
            self._fill(None, size, False, np.zeros(0, dtype=np.int64))
            self._propose(size, num_passes)  # warm-up
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._propose(size, num_passes)
            self._proposal_graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info(
            "executor.proposal_graphs",
            sizes=sorted(self._proposal_graphs),
            passes=num_passes,
            seconds=round(time.perf_counter() - start, 2),
        )

    def prepare_proposals(self, num_passes: int, max_size: int) -> None:
        """Sets proposal graphs' sizes and buffer up (`capture_proposals` captures them; tests run
        `propose_uncaptured` after this alone)."""
        self._proposal_sizes = [s for s in self.decode_sizes if s <= max_size]
        device = self._static.device
        self._proposals = torch.zeros((self.max_decode, num_passes), dtype=torch.int64, device=device)

    def _propose(self, size: int, num_passes: int) -> None:
        """The captured proposal work: pass 0 from the static inputs, then each later pass from
        the previous one's argmax, its inputs derived on the device; a last pass, over the last
        proposals, writes their KV alone (the draft then holds the KV of every verified token)."""
        rows = self._field("rows", size)
        base = self._field("positions", size).clone()
        limits = self._field("limits", size)
        block_size = self.kv_caches[0][0].shape[1]
        for j in range(num_passes + 1):
            if j:
                inputs = next_pass_inputs(rows, base, limits, j, self.slots.table, block_size)
                self._set_pass_inputs(size, self._proposals[:size, j - 1], inputs)
            self._forward(size, False)
            if j < num_passes:
                self._proposals[:size, j] = self._logits[:size].argmax(dim=-1)

    def can_propose(self, num_rows: int, num_passes: int) -> bool:
        """Whether a proposal graph runs `num_passes` passes of `num_rows` sequences."""
        return num_passes == self._proposals.shape[1] and self._decode_size(num_rows) in self._proposal_sizes

    def propose(
        self,
        batch: HostBatch,
        token_ids: tuple[torch.Tensor, torch.Tensor] | None,
        limits: np.ndarray,
    ) -> torch.Tensor:
        """Replays the proposal graph for pass 0's `batch` (a decode batch; `token_ids` as in
        `run`) and [S] `limits` (see `next_pass_inputs`: each row's last proposal's position):
        returns the greedy proposals [S, k]."""
        size = self._start_proposals(batch, token_ids, limits)
        self._proposal_graphs[size].replay()
        return self._proposals[: batch.num_seqs]

    @torch.inference_mode()
    def propose_uncaptured(
        self,
        batch: HostBatch,
        token_ids: tuple[torch.Tensor, torch.Tensor] | None,
        limits: np.ndarray,
    ) -> torch.Tensor:
        """Computes what `propose` replays, padding included, without a graph (tests on the CPU)."""
        size = self._start_proposals(batch, token_ids, limits)
        self._propose(size, self._proposals.shape[1])
        return self._proposals[: batch.num_seqs]

    def _start_proposals(
        self, batch: HostBatch, token_ids: tuple[torch.Tensor, torch.Tensor] | None, limits: np.ndarray
    ) -> int:
        """Stages pass 0 and the limits (host arrays, one copy); returns the graph's size."""
        size = self._decode_size(batch.num_seqs)
        self._fill(batch, size, False, limits)
        self._set_token_ids(token_ids)
        return size

    @torch.inference_mode()
    def capture_acceptance(self, logits: torch.Tensor) -> None:
        """Captures, for each proposal graph size whose verification rows fit in `logits` (the
        target's `StepGraphs.logits`), the greedy acceptance of its proposals (after
        `capture_proposals`, in its memory pool)."""
        device = self._static.device
        self.prepare_acceptance(logits)
        for size in reversed(self._acceptance_sizes):
            # Every row padding: the warm-up feeds the pad row alone (`_accept`).
            self._fill(None, size, False, np.zeros(0, dtype=np.int64))
            self._accept(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._accept(size)
            self._acceptance_graphs[size] = graph
        torch.cuda.synchronize(device)
        log.info("executor.acceptance_graphs", sizes=sorted(self._acceptance_graphs))

    def prepare_acceptance(self, logits: torch.Tensor) -> None:
        """Sets the acceptance graphs' sizes and buffers up (`capture_acceptance` captures them;
        tests run `accept_uncaptured` after this alone), after `prepare_proposals`."""
        k = self._proposals.shape[1]
        self._accept_logits = logits
        self._acceptance_sizes = [s for s in self._proposal_sizes if s * (k + 1) <= len(logits)]
        device = self._static.device
        self._accepted = torch.zeros((self.max_decode, k + 2), dtype=torch.int64, device=device)

    def _accept(self, size: int) -> None:
        """The captured acceptance, after a `propose` of `size` rows and the target's mixed graph
        over their k + 1 tokens each (its first size * (k + 1) logits rows): the emitted tokens and
        counts into `_accepted`, each sequence's last token fed to its slot (`rows`, as staged with
        the proposals). A padding row (limit -1) writes the pad row's own token back to it, so the
        rows that share the pad row all write one value."""
        assert self._accept_logits is not None
        k = self._proposals.shape[1]
        logits = self._accept_logits[: size * (k + 1)]
        tokens, counts, last = accept_greedy(logits, self._proposals[:size])
        self._accepted[:size, : k + 1] = tokens
        self._accepted[:size, k + 1] = counts
        rows = self._field("rows", size)
        kept = self.slots.last_token.index_select(0, rows)
        self.slots.store_sampled(rows, torch.where(self._field("limits", size) >= 0, last, kept))

    def can_accept(self, num_rows: int, num_passes: int) -> bool:
        """Whether an acceptance graph takes `num_rows` sequences of `num_passes` proposals."""
        return (
            num_passes == self._proposals.shape[1] and self._decode_size(num_rows) in self._acceptance_sizes
        )

    def accept(self, num_rows: int) -> torch.Tensor:
        """Replays the acceptance graph for the last `propose` (`num_rows` sequences) and the
        target's graph after it: returns [S, k + 2] each sequence's k + 1 tokens (the first
        counts[i] emitted), then its count, on the device, in a buffer the next step overwrites."""
        self._acceptance_graphs[self._decode_size(num_rows)].replay()
        return self._accepted[:num_rows]

    @torch.inference_mode()
    def accept_uncaptured(self, num_rows: int) -> torch.Tensor:
        """Computes what `accept` replays, without a graph (tests on the CPU). A copy: on the CPU
        the output is not copied to the host, and a launched step's must outlive the next step."""
        self._accept(self._decode_size(num_rows))
        return self._accepted[:num_rows].clone()

    def can_accept_points(self, num_rows: int) -> bool:
        """Whether `accept_points` takes `num_rows` sequences."""
        return self._decode_size(num_rows) is not None

    def accept_points(self, num_rows: int, k: int) -> torch.Tensor:
        """The greedy acceptance of point proposals (n-gram's, ids in the plan), after `run` of a
        mixed batch of `num_rows` sequences that each verify up to `k` proposals or decode one
        token, whose logits rows are their token rows (`_accept_points`): [S, k + 2] each
        sequence's k + 1 tokens (the first counts[i] emitted), then its count, in a buffer the
        next step of its size and k overwrites. On CUDA a graph replays it, captured the first
        time its (size, k) comes: that step computes it eagerly (warming its kernels up), then
        captures it, which waits for the device once. The executor does not know n-gram's k (the
        scheduler proposes) and only a few (size, k) ever come, so none is captured at start."""
        size = self._decode_size(num_rows)
        assert size is not None
        out, graph = self._point_acceptance.get((size, k), (None, None))
        if graph is not None:
            graph.replay()
            return out[:num_rows]
        device = self._static.device
        if out is None:
            out = torch.empty((size, k + 2), dtype=torch.int64, device=device)
        self._accept_points(size, k, out)
        if device.type == "cuda":
            if self._point_pool is None:
                self._point_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the service's step watcher may wait on an event meanwhile
            with torch.cuda.graph(graph, pool=self._point_pool, capture_error_mode="thread_local"):
                self._accept_points(size, k, out)
            log.info("executor.point_acceptance_graph", sequences=size, proposals=k)
        self._point_acceptance[(size, k)] = (out, graph)
        # On the CPU a copy: the output is not copied to the host, and must outlive the next step.
        return out[:num_rows] if graph is not None else out[:num_rows].clone()

    def _accept_points(self, size: int, k: int, out: torch.Tensor) -> None:
        """The captured point acceptance: `accept_greedy` over each sequence's rows, with its
        proposals read from the static host ids (row j + 1's input is proposal j) and its layout
        from the static cu_seqlens (sequence i's rows start at cu[i], d_i + 1 of them, d_i <= k),
        so nothing but the mixed graph's fill is staged. Padding sequences (those past the step's,
        over the pad row) compute on clamped rows and feed the pad row its own token back."""
        cu = self._field("cu_seqlens", size + 1)
        starts, num_drafts = cu[:-1], cu[1:] - cu[:-1] - 1
        j = torch.arange(k + 1, device=cu.device)
        # The step's rows number at most the mixed graph's logits rows and tokens: so many suffice.
        num_logits = min(size * (k + 1), len(self._logits), self._token_capacity)
        rows = (starts[:, None] + torch.minimum(j, num_drafts[:, None])).clamp_(0, num_logits - 1)
        targets = layers.argmax(self._logits[:num_logits])[rows]  # [size, k + 1]: each row's argmax
        proposals = self._field("host_ids", num_logits)[rows[:, 1:]]
        matched = (targets[:, :k] == proposals) & (j[:k] < num_drafts[:, None])
        num_accepted = matched.cumprod(dim=1).sum(dim=1)
        out[:, : k + 1] = targets
        out[:, k + 1] = num_accepted + 1
        slots = self._field("rows", size)
        last = targets.gather(1, num_accepted[:, None]).squeeze(1)
        kept = self.slots.last_token.index_select(0, slots)
        self.slots.store_sampled(slots, torch.where(slots == self.slots.pad_row, kept, last))

    def run_next(self, ids: torch.Tensor, inputs: DecodePassInputs) -> torch.Tensor:
        """Replays the decode graph of the previous `run` (a decode batch of S sequences) with its
        rows' input ids, positions, slots and lengths taken from device tensors [S] (a draft
        model's next proposal pass): nothing is staged from the host. Returns the logits [S, vocab]."""
        size = self._set_pass_inputs(None, ids, inputs)
        self._decode_graphs[size].replay()
        return self._logits[: len(ids)]

    @torch.inference_mode()
    def run_next_uncaptured(self, ids: torch.Tensor, inputs: DecodePassInputs) -> torch.Tensor:
        """Computes what `run_next` replays, without a graph (tests on the CPU)."""
        size = self._set_pass_inputs(None, ids, inputs)
        self._forward(size, False)
        return self._logits[: len(ids)]

    def _set_pass_inputs(self, size: int | None, ids: torch.Tensor, inputs: DecodePassInputs) -> int:
        """Writes the first len(ids) rows' per-token inputs of the decode graph of `size` (None:
        the smallest that holds them) into the static fields, on the device; returns the size."""
        num = len(ids)
        size = self._decode_size(num) if size is None else size
        self._field("host_ids", num).copy_(ids)
        self._field("feed_slots", num).fill_(-1)
        self._field("positions", num).copy_(inputs.positions)
        self._field("slot_mapping", num).copy_(inputs.slot_mapping)
        self._field("seq_lens", num).copy_(inputs.seq_lens)
        return size

    def _decode_size(self, num_rows: int) -> int | None:
        """The decode graph size that holds num_rows sequences (None: more than the largest)."""
        return next((s for s in self.decode_sizes if s >= num_rows), None)

    def can_run_decode(self, num_rows: int) -> bool:
        return self._decode_size(num_rows) is not None

    def _plan(self, batch: HostBatch) -> tuple[int, bool] | None:
        """(padded token count, mixed) of the graph that runs `batch`, or None to run it eagerly."""
        num_tokens = len(batch.positions)
        if batch.decode_only and num_tokens <= self.max_decode:
            return next(s for s in self.decode_sizes if s >= num_tokens), False
        if (
            self.mixed_sizes
            and num_tokens <= self.mixed_sizes[-1]
            and batch.num_seqs <= self.max_seqs
            and len(batch.logits_indices) <= self.num_seq_slots
        ):
            return next(s for s in self.mixed_sizes if s >= num_tokens), True
        return None

    def can_run(self, batch: HostBatch) -> bool:
        return self._plan(batch) is not None

    def run(self, batch: HostBatch, token_ids: TokenIds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the graph for `batch`: returns its float32 logits [sampled rows, vocab] and the
        slots of those rows (on the device, for `RequestSlots.store_sampled`). `token_ids`: (batch
        rows, ids) on the device, the input ids of rows whose host id is a placeholder (a draft
        model's proposals)."""
        num_tokens, mixed = self._plan(batch)
        self._fill(batch, num_tokens, mixed)
        self._set_token_ids(token_ids)
        (self._mixed_graphs if mixed else self._decode_graphs)[num_tokens].replay()
        return self._outputs(batch)

    @torch.inference_mode()
    def run_uncaptured(
        self, batch: HostBatch, token_ids: TokenIds | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Computes what `run` replays, padding included, without a graph (tests run it on the CPU)."""
        num_tokens, mixed = self._plan(batch)
        self._fill(batch, num_tokens, mixed)
        self._set_token_ids(token_ids)
        self._forward(num_tokens, mixed)
        return self._outputs(batch)

    def _set_token_ids(self, token_ids: TokenIds | None) -> None:
        """Writes device-side input ids into the static host-id field (after `_fill`'s copy, on the
        same stream); their feed slots are -1, so the graph reads them as host ids. `token_ids`:
        (batch rows, ids); or [S, k] proposals of a batch of S sequences of k + 1 tokens each (a
        verification's last token, then its proposals), written without an index (one kernel)."""
        if isinstance(token_ids, torch.Tensor):
            num, k = token_ids.shape
            self._field("host_ids", num * (k + 1)).view(num, k + 1)[:, 1:].copy_(token_ids)
        elif token_ids is not None:
            rows, ids = token_ids
            self._field("host_ids", self._token_capacity).index_copy_(0, rows, ids)  # (one kernel)

    def _outputs(self, batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        num_sampled = len(batch.logits_indices)
        return self._logits[:num_sampled], self._field("sample_rows", num_sampled)


def _empty_batch(num_groups: int) -> HostBatch:
    """A batch of no sequence (`_fill` pads it whole)."""
    empty = np.zeros(0, dtype=np.int64)
    return HostBatch(
        rows=empty, seq_lens=empty, cu_seqlens=np.zeros(1, dtype=np.int64), positions=empty,
        slot_mapping=np.zeros((num_groups, 0), dtype=np.int64), host_ids=empty, feed_slots=empty,
        logits_indices=empty, sample_rows=empty, width=1,
    )  # fmt: skip


def _write(view: np.ndarray, offset: int, head: np.ndarray, pad: int | np.ndarray, num_pad: int) -> None:
    """Writes `head`, then `num_pad` entries of `pad` (a value, or an array of num_pad values), into
    `view` from `offset`."""
    end = offset + len(head)
    view[offset:end] = head
    if num_pad:
        view[end : end + num_pad] = pad
