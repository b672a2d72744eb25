"""The step engine: applies StepPlans to per-request state and the KV pool, runs the model, samples.

It knows nothing of gRPC: `execute(plan) -> StepOutput` is the whole interface (plus `reset` for a
new lease). Each request's state persists between steps: its tokens (prompt, then every token it
sampled itself, so the scheduler never sends decode tokens back), how many of them have their KV in
the pool, its block table and sampling parameters.

A plan is validated in full against the current state before anything is applied, so a bad plan
(`PlanError`) leaves state and pool exactly as they were.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from executor.config import ExecutorConfig
from executor.kv_cache import (
    KVCache,
    KVCacheLayout,
    check_fits,
    cpu_device_num_blocks,
    gpu_num_blocks,
)
from executor.loader import ModelSpec, load_model_spec, load_weights
from executor.model import AttentionMetadata, LlamaModel
from executor.sampler import SamplingParams, sample
from protos import executor_pb2

log = structlog.get_logger(__name__)

SeqId = int


class PlanError(ValueError):
    """A StepPlan that contradicts the executor's state or pool; nothing of it was applied."""


@dataclass(slots=True)
class RequestState:
    """What the executor holds for one sequence between steps."""

    seq_id: SeqId
    token_ids: list[int]  # prompt, then every sampled token (the last one may not be computed yet)
    num_prompt: int  # the leading token_ids that are prompt (min_tokens counts the rest)
    num_computed: int  # tokens whose K/V is in the pool
    block_ids: list[int]  # the block table, in order
    sampling: SamplingParams


@dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_sampled: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    busy_seconds: float = 0.0


@dataclass(frozen=True)
class StepInputs:
    """Device tensors for one forward pass."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


def build_step_inputs(
    chunks: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    needs_logits: Sequence[bool],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Flattens the scheduled sequences into one batch.

    Args:
        chunks: per sequence, the token ids it computes this step (non-empty).
        starts: per sequence, the position of its first new token (= tokens already computed).
        block_tables: per sequence, its block ids (covering every new position).
        needs_logits: per sequence, whether its last new token is sampled from.
    """
    num_seqs = len(chunks)
    q_lens = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=num_seqs)
    starts_np = np.asarray(starts, dtype=np.int64)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), q_lens)
    positions = np.arange(num_tokens) - cu[:-1][seq_of_token] + starts_np[seq_of_token]
    tables = np.zeros((num_seqs, max(len(t) for t in block_tables)), dtype=np.int32)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    slots = (
        tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    input_ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=num_tokens)
    logits_indices = (cu[1:] - 1)[np.asarray(needs_logits, dtype=bool)]

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        block_tables=dev(tables, torch.int32),
        seq_lens=dev(starts_np + q_lens, torch.int32),
        cu_seqlens_q=dev(cu, torch.int32),
    )
    return StepInputs(dev(input_ids, torch.int64), meta, dev(logits_indices, torch.int64))


def sampling_from_proto(s: executor_pb2.Sampling) -> SamplingParams:
    """Proto3 cannot tell an unset top_p from 0, so top_p <= 0 means off, like 1."""
    top_p = s.top_p if 0 < s.top_p < 1 else 1.0
    return SamplingParams(
        temperature=s.temperature,
        top_p=top_p,
        top_k=s.top_k,
        seed=s.seed if s.has_seed else None,
        return_logprobs=s.return_logprobs,
        min_tokens=s.min_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
    )


def resolve_max_model_len(config: ExecutorConfig, spec: ModelSpec) -> int:
    """config.max_model_len, or the model's limit; never beyond what the model supports."""
    limit = spec.max_position_embeddings
    if spec.sliding_window is not None and spec.sliding_window < limit:
        # We attend over the whole context; within the window that is exactly sliding-window attention.
        limit = spec.sliding_window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds what {spec.name} supports ({limit}: "
            "max_position_embeddings, or the sliding window, which is not implemented)"
        )
    return config.max_model_len


@dataclass
class _Scheduled:
    state: RequestState
    num_new: int


class ModelRunner:
    """Holds the model, the KV pool and every request's state; runs one StepPlan at a time.

    Not thread-safe: the service serialises calls.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.stats = RunnerStats()
        self._requests: dict[SeqId, RequestState] = {}
        self._layer_caches = kv_cache.layer_caches()

    @classmethod
    def create(cls, config: ExecutorConfig) -> ModelRunner:
        """Loads the model and sizes and allocates the KV pools (profiling first on CUDA)."""
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        spec = load_model_spec(config.model)
        max_model_len = resolve_max_model_len(config, spec)
        model = LlamaModel(spec, max_model_len, device, dtype)
        load_weights(model, spec, config.model)
        layout = KVCacheLayout(spec.num_layers, config.block_size, spec.num_kv_heads, spec.head_dim, dtype)
        if config.num_gpu_blocks_override is not None:
            num_blocks, why = config.num_gpu_blocks_override, "--num-gpu-blocks-override"
        elif device.type == "cuda":
            peak, non_torch, total = _profile_cuda(model, layout, config, max_model_len)
            num_blocks = gpu_num_blocks(layout, total, config.gpu_memory_utilization, peak, non_torch)
            why = (
                f"{config.gpu_memory_utilization:.2f} of {total / 2**30:.1f} GiB minus a peak of "
                f"{peak / 2**30:.2f} GiB and {non_torch / 2**30:.2f} GiB outside torch"
            )
        else:
            num_blocks = cpu_device_num_blocks(
                layout, config.cpu_kv_cache_bytes, config.max_num_seqs, max_model_len
            )
            why = f"--cpu-kv-cache-space {config.cpu_kv_cache_space} GiB"
        check_fits(layout, num_blocks, max_model_len, why=why)
        num_cpu_blocks = config.swap_space_bytes // layout.bytes_per_block
        kv_cache = KVCache(layout, num_blocks, num_cpu_blocks, device)
        log.info(
            "executor.loaded",
            model=config.model,
            architecture=spec.architecture,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_gpu_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            kv_pool_gib=round(num_blocks * layout.bytes_per_block / 2**30, 3),
            swap_pool_gib=round(num_cpu_blocks * layout.bytes_per_block / 2**30, 3),
            weights_gib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3),
            sizing=why,
        )
        return cls(
            model,
            kv_cache,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
        )

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def reset(self) -> None:
        """Forgets every request (a new lease); the pool's contents become meaningless."""
        self._requests.clear()

    def execute(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        """Applies `plan` (swap_out, removed, swap_in, new, running), runs one forward pass over the
        scheduled tokens and samples for every request whose tokens are now all computed.

        Raises:
            PlanError: the plan is inconsistent; nothing was applied.
        """
        start = time.perf_counter()
        new_params = self._validate(plan)
        kv = self.kv_cache
        kv.swap_out([m.src for m in plan.swap_out], [m.dst for m in plan.swap_out])
        for seq_id in plan.removed_seq_ids:
            self._requests.pop(seq_id, None)
        kv.swap_in([m.src for m in plan.swap_in], [m.dst for m in plan.swap_in])

        scheduled: list[_Scheduled] = []
        for req, params in zip(plan.new_requests, new_params, strict=True):
            tokens = list(req.token_ids)
            state = RequestState(
                seq_id=req.seq_id,
                token_ids=tokens,
                num_prompt=req.num_prompt_tokens or len(tokens),  # proto3: 0 = unset = all prompt
                num_computed=req.num_computed_tokens,
                block_ids=list(req.block_ids),
                sampling=params,
            )
            self._requests[req.seq_id] = state
            scheduled.append(_Scheduled(state, req.num_new_tokens))
        for req in plan.running:
            state = self._requests[req.seq_id]
            state.block_ids.extend(req.new_block_ids)
            scheduled.append(_Scheduled(state, req.num_new_tokens))

        output = executor_pb2.StepOutput(step_id=plan.step_id)
        scheduled = [s for s in scheduled if s.num_new > 0]
        if scheduled:
            self._run(scheduled, output)
        elapsed = time.perf_counter() - start
        output.step_seconds = elapsed
        stats = self.stats
        stats.steps += 1
        stats.tokens_computed += sum(s.num_new for s in scheduled)
        stats.tokens_sampled += len(output.seq_ids)
        stats.swap_out_blocks += len(plan.swap_out)
        stats.swap_in_blocks += len(plan.swap_in)
        stats.busy_seconds += elapsed
        return output

    @torch.inference_mode()
    def _run(self, scheduled: list[_Scheduled], output: executor_pb2.StepOutput) -> None:
        ends = [s.state.num_computed + s.num_new for s in scheduled]
        samples = [end == len(s.state.token_ids) for s, end in zip(scheduled, ends, strict=True)]
        inputs = build_step_inputs(
            [s.state.token_ids[s.state.num_computed : end] for s, end in zip(scheduled, ends, strict=True)],
            [s.state.num_computed for s in scheduled],
            [s.state.block_ids for s in scheduled],
            samples,
            self.block_size,
            self.device,
        )
        for s, end in zip(scheduled, ends, strict=True):
            s.state.num_computed = end
        logits = self.model(inputs.input_ids, inputs.meta, self._layer_caches, inputs.logits_indices)
        sampling = [s.state for s, wants in zip(scheduled, samples, strict=True) if wants]
        if not sampling:
            return
        banned = [st.sampling.banned_ids(len(st.token_ids) - st.num_prompt) for st in sampling]
        result = sample(
            logits,
            [st.sampling for st in sampling],
            [len(st.token_ids) for st in sampling],
            banned if any(banned) else None,
        )
        token_ids = result.token_ids.tolist()  # the one host sync of a step
        logprobs = result.logprobs.tolist() if result.logprobs is not None else [0.0] * len(token_ids)
        for st, token, logprob in zip(sampling, token_ids, logprobs, strict=True):
            st.token_ids.append(token)
            output.seq_ids.append(st.seq_id)
            output.token_ids.append(token)
            output.logprobs.append(logprob if st.sampling.return_logprobs else 0.0)

    # --- validation -------------------------------------------------------------------------------

    def _validate(self, plan: executor_pb2.StepPlan) -> list[SamplingParams]:
        """Checks the whole plan against current state; returns the new requests' sampling params."""
        nb, ncpu = self.kv_cache.num_device_blocks, self.kv_cache.num_cpu_blocks
        _check_moves("swap_out", plan.swap_out, nb, ncpu)
        _check_moves("swap_in", plan.swap_in, ncpu, nb)
        # Removing a sequence we do not hold is allowed (idempotent), e.g. an abort racing its finish.
        held = set(self._requests).difference(plan.removed_seq_ids)
        seen: set[SeqId] = set()
        total_tokens = 0
        params: list[SamplingParams] = []
        for req in plan.new_requests:
            where = f"new request seq_id={req.seq_id}"
            if req.seq_id in held:
                raise PlanError(f"{where}: already held by the executor (not removed first)")
            if req.seq_id in seen:
                raise PlanError(f"{where}: appears twice in the plan")
            seen.add(req.seq_id)
            if not req.token_ids:
                raise PlanError(f"{where}: has no token_ids")
            self._check_request_tokens(where, req)
            self._check_span(
                where,
                req.num_computed_tokens,
                req.num_new_tokens,
                len(req.token_ids),
                num_blocks=len(req.block_ids),
                unchecked_blocks=req.block_ids,
            )
            try:
                params.append(sampling_from_proto(req.sampling))
            except ValueError as e:
                raise PlanError(f"{where}: {e}") from None
            total_tokens += req.num_new_tokens
        for req in plan.running:
            where = f"running seq_id={req.seq_id}"
            if req.seq_id not in held:
                raise PlanError(f"{where}: unknown to the executor (never added, or removed)")
            if req.seq_id in seen:
                raise PlanError(f"{where}: appears twice in the plan")
            seen.add(req.seq_id)
            state = self._requests[req.seq_id]
            self._check_span(
                where,
                state.num_computed,
                req.num_new_tokens,
                len(state.token_ids),
                num_blocks=len(state.block_ids) + len(req.new_block_ids),
                unchecked_blocks=req.new_block_ids,  # the held ones were checked when they came
            )
            total_tokens += req.num_new_tokens
        if total_tokens > self.max_num_batched_tokens:
            raise PlanError(
                f"plan computes {total_tokens} tokens > max_num_batched_tokens {self.max_num_batched_tokens}"
            )
        if len(seen) > self.max_num_seqs:
            raise PlanError(f"plan schedules {len(seen)} sequences > max_num_seqs {self.max_num_seqs}")
        return params

    def _check_request_tokens(self, where: str, req: executor_pb2.NewRequest) -> None:
        vocab = self.spec.vocab_size
        if max(req.token_ids) >= vocab:
            raise PlanError(f"{where}: token id {max(req.token_ids)} >= vocab_size {vocab}")
        if req.num_prompt_tokens > len(req.token_ids):
            raise PlanError(
                f"{where}: num_prompt_tokens {req.num_prompt_tokens} > its {len(req.token_ids)} tokens"
            )
        stop_ids = req.sampling.stop_token_ids
        if stop_ids and max(stop_ids) >= vocab:
            raise PlanError(f"{where}: stop token id {max(stop_ids)} >= vocab_size {vocab}")

    def _check_span(
        self,
        where: str,
        num_computed: int,
        num_new: int,
        num_tokens: int,
        *,
        num_blocks: int,
        unchecked_blocks: Sequence[int],
    ) -> None:
        end = num_computed + num_new
        if end > num_tokens:
            raise PlanError(
                f"{where}: num_computed {num_computed} + num_new_tokens {num_new} exceeds its {num_tokens} "
                "known tokens (decode steps compute exactly the one token sampled last)"
            )
        if end > self.max_model_len:
            raise PlanError(
                f"{where}: computes up to position {end - 1}, max_model_len is {self.max_model_len}"
            )
        if num_blocks * self.block_size < end:
            raise PlanError(
                f"{where}: {num_blocks} blocks of {self.block_size} tokens cannot hold {end} tokens"
            )
        if unchecked_blocks and max(unchecked_blocks) >= self.kv_cache.num_device_blocks:
            limit = self.kv_cache.num_device_blocks
            raise PlanError(
                f"{where}: block id {max(unchecked_blocks)} out of range (num_gpu_blocks={limit})"
            )


def _check_moves(what: str, moves: Sequence[executor_pb2.BlockMove], num_src: int, num_dst: int) -> None:
    for move in moves:
        if move.src >= num_src or move.dst >= num_dst:
            raise PlanError(
                f"{what}: move {move.src}->{move.dst} out of range (source pool {num_src} blocks, "
                f"destination pool {num_dst} blocks)"
            )
    if len({m.dst for m in moves}) != len(moves):
        raise PlanError(f"{what}: several moves write the same destination block")


def _profile_cuda(
    model: LlamaModel, layout: KVCacheLayout, config: ExecutorConfig, max_model_len: int
) -> tuple[int, int, int]:
    """Runs the worst step the config allows and measures memory.

    The step is max_num_batched_tokens tokens spread over up to max_num_seqs prefills, all sampled
    with top-k/top-p (the sampler's sort is the largest temporary). Its scratch KV pool is
    subtracted from the peak, as the real pool is sized separately.

    Returns:
        (peak bytes allocated by torch, bytes used outside torch, total device bytes).
    """
    device = next(model.parameters()).device
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens))
    per_seq = min(max_model_len, -(-config.max_num_batched_tokens // num_seqs))
    lens = [per_seq] * num_seqs
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + layout.blocks_for(n))))
        next_block += layout.blocks_for(n)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(layout, next_block, 0, device)
    scratch_bytes = scratch.device_pool.numel() * scratch.device_pool.element_size()
    inputs = build_step_inputs(
        [[0] * n for n in lens], [0] * num_seqs, tables, [True] * num_seqs, layout.block_size, device
    )
    with torch.inference_mode():
        logits = model(inputs.input_ids, inputs.meta, scratch.layer_caches(), inputs.logits_indices)
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_seqs
        sample(logits, params, lens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    del scratch, inputs, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    log.info(
        "executor.profiled",
        tokens=sum(lens),
        seqs=num_seqs,
        peak_gib=round(peak / 2**30, 3),
        non_torch_gib=round(non_torch / 2**30, 3),
    )
    return peak, non_torch, total
