"""The step engine: applies StepPlans to per-request state and the KV pool, runs the model, samples.

It knows nothing of gRPC. `launch(plan) -> PendingStep` queues a step on the device and returns at
once; `finish(pending) -> StepOutput` waits for its sampled tokens. `execute(plan)` does both. The
service launches step N+1 before finishing step N, so the GPU never waits for the host between them.

Masks behind the plan (structured outputs): a plan with `late_masked_seq_ids` was made while its
constrained requests' previous tokens were being sampled, and their masks depend on those tokens.
`launch` queues its forward pass and keeps the sampling (`PendingStep.awaits_masks`) until
`apply_masks` brings the StepMasks, which the scheduler sends once it has the previous step's
output; so the forward overlaps the round trip and the mask computation. At most one step awaits
masks, and nothing else runs until it has sampled: the next plan's forward reads its tokens. A step
whose masks never come is sampled without them when the runner is reset (`_drop_awaiting`; its
output is never sent), so that the device state, and every tensor-parallel rank, stays in step.

Each request's state persists between steps: the token ids the host knows (NewRequest.token_ids),
how many tokens it has (counting those sampled here, whose values stay on the device), how many of
them have their KV in the pool, its slot (device block table row and last sampled token, see
`executor.step_inputs`) and its sampling parameters.

A plan is validated in full against the current state before anything is applied, so a bad plan
(`PlanError`) leaves state and pool exactly as they were.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
import torch

from pagedserve.common.ngram import propose_ngram
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.cuda_graphs import (
    PROPOSAL_GRAPH_MAX_SEQS,
    StepGraphs,
    decode_graph_sizes,
    mixed_graph_sizes,
)
from pagedserve.executor.disk_tier import DiskTierFile
from pagedserve.executor.kv_cache import KVCache, KVCacheLayout, MemoryProfile, check_fits, size_pools
from pagedserve.executor.loader import (
    ModelSpec,
    UnsupportedModelError,
    init_dummy_weights,
    load_model_spec,
    load_weights,
)
from pagedserve.executor.model import AttentionMetadata, CausalLM
from pagedserve.executor.plan_check import PlanError, PlanLimits, mask_words, validate_masks, validate_plan
from pagedserve.executor.profiling import (
    measure_copy_bandwidth,
    measure_host_copy_bandwidth,
    memory_in_use,
    profile_cuda,
)
from pagedserve.executor.quantization import check_fp8_support, kv_cache_torch_dtype
from pagedserve.executor.sampler import (
    SamplingParams,
    TokenMasks,
    exponential_noise,
    prompt_logprobs,
    sample,
)
from pagedserve.executor.spec_decode import (
    VerifyLayout,
    draft_sampling_params,
    probs_processing,
    processed_probs,
    stage_layout,
    verify_draft_model,
    verify_point_mass,
)
from pagedserve.executor.step_inputs import (
    HostBatch,
    RequestSlots,
    build_host_batch,
    build_step_inputs,
    decode_batch,
    next_pass_inputs,
    stage_batch,
)
from pagedserve.executor.step_trace import StepRecord, StepTracer
from pagedserve.executor.transfer import bytes_to_device, int64_to_device, to_device, to_host
from pagedserve.protos import executor_pb2

log = structlog.get_logger(__name__)

SeqId = int

__all__ = ["ModelRunner", "PendingStep", "PlanError", "RequestState", "build_step_inputs"]


@dataclass(slots=True)
class RequestState:
    """What the executor holds for one sequence between steps."""

    seq_id: SeqId
    slot: int  # its row in the device block table and in last_token
    known_ids: np.ndarray  # int64 ids known on the host: the prompt, then any outputs a resume re-sent
    num_tokens: int  # len(known_ids) + tokens sampled here since (their values live on the device)
    num_prompt: int  # the leading tokens that are prompt (min_tokens counts the rest)
    num_computed: int  # tokens whose K/V is in the pool
    table_ends: list[int]  # per KV-cache group, the length of its block table
    sampling: SamplingParams
    # With n-gram speculation (ModelRunner.ngram): the ids of the tokens generated here, as their
    # outputs went out, so that known_ids + outputs are the tokens the scheduler proposes from.
    outputs: list[int] = field(default_factory=list)

    def ngram_tokens(self) -> np.ndarray:
        """The request's tokens as the scheduler knows them once its last output arrives."""
        return np.concatenate([self.known_ids, np.asarray(self.outputs, dtype=np.int64)])


@dataclass(slots=True)
class RunnerStats:
    steps: int = 0
    tokens_computed: int = 0
    tokens_sampled: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    busy_seconds: float = 0.0  # wall time with at least one step in flight (overlaps counted once)
    graph_steps: int = 0  # steps that replayed a CUDA graph
    steps_launched_ahead: int = 0  # verification steps launched before their plan and taken by it
    steps_discarded_ahead: int = 0  # launched ahead, but the plan was another step


@dataclass(slots=True)
class PendingStep:
    """A launched step; its sampled tokens are being copied to pinned host memory behind `done`."""

    step_id: int
    started: float
    seq_ids: list[SeqId] = field(default_factory=list)  # the sampling requests, in output order
    wants_logprobs: list[bool] = field(default_factory=list)
    token_ids: torch.Tensor | None = None  # host tensor, valid once `done` has completed
    logprobs: torch.Tensor | None = None
    # Prompt logprobs (return_prompt_logprobs): (seq_id, index of the first prompt token reported,
    # count) per request, and all their values back to back in `prompt_logprobs`.
    prompt_spans: list[tuple[SeqId, int, int]] = field(default_factory=list)
    prompt_logprobs: torch.Tensor | None = None
    done: torch.cuda.Event | None = None  # None on the CPU (everything ran synchronously)
    trace: StepRecord | None = None  # with --step-trace
    # Speculative decoding: the verified requests and their proposal counts, their emitted tokens
    # ([S, K + 1] host tensors, the first counts[i] of row i valid), and every sampling request's
    # id in plan order (the output's order).
    spec: list[tuple[RequestState, int]] = field(default_factory=list)
    spec_token_ids: torch.Tensor | None = None
    spec_counts: torch.Tensor | None = None
    spec_logprobs: torch.Tensor | None = None
    order: list[SeqId] = field(default_factory=list)
    lookahead: int = 0  # slots past their computed tokens the verified requests' tables keep
    # Masks behind the plan: its sampling, kept until the StepMasks arrives (`apply_masks`).
    deferred: _StepSampling | None = None
    replayed_verification: bool = False  # `_replay_verification` ran it: `launch_ahead` may follow

    @property
    def awaits_masks(self) -> bool:
        """Launched, but not sampled: its late masks have not arrived yet."""
        return self.deferred is not None

    def ready(self) -> bool:
        """Whether finishing it would not block (never while it awaits its masks)."""
        return self.deferred is None and (self.done is None or self.done.query())


def resolve_max_model_len(config: ExecutorConfig, spec: ModelSpec) -> int:
    """config.max_model_len, or the model's limit (max_position_embeddings); never beyond it.

    Sliding windows do not limit it: sliding-window layers attend within their window
    (`kernels.paged_attention`), so a sequence may grow past the window."""
    limit = spec.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise UnsupportedModelError(
            f"max_model_len={config.max_model_len} exceeds what {spec.name} supports ({limit}: "
            "max_position_embeddings)"
        )
    return config.max_model_len


def kv_cache_layout(config: ExecutorConfig, model: CausalLM, draft: CausalLM | None = None) -> KVCacheLayout:
    """One block of `model`'s pool (its KV-cache groups' layers, its local KV heads), with the
    draft model's layers after them (speculative decoding); `pagedserve plan` calls it on a model
    built on the meta device."""
    dtype = model.embed_tokens.weight.dtype
    spec = model.spec
    return KVCacheLayout(
        model.kv_groups.layers_per_block + (0 if draft is None else draft.spec.num_layers),
        config.block_size,
        spec.num_kv_heads,
        spec.head_dim,
        kv_cache_torch_dtype(config.kv_cache_dtype, dtype),
    )


def load_draft_model(config: ExecutorConfig, target: CausalLM) -> CausalLM | None:
    """Speculative decoding's draft model (the draft_model method; None otherwise), loaded by the
    target's rules (dtype, quantization, the loader's checks). Its layers take extra slots of the
    target's KV blocks, so it must have the target's KV heads, head_dim and vocabulary, and both
    must attend in full (one KV-cache group); UnsupportedModelError says which differs."""
    spec_config = config.speculative_config
    if spec_config is None or spec_config.method != "draft_model":
        return None
    assert spec_config.model is not None
    draft_spec = load_model_spec(spec_config.model)
    target_spec = target.spec
    for name in ("num_kv_heads", "head_dim", "vocab_size"):
        mine, theirs = getattr(draft_spec, name), getattr(target_spec, name)
        if mine != theirs:
            raise UnsupportedModelError(
                f"the draft model {spec_config.model} has {name} {mine}, the target {theirs}: its KV "
                "shares the target's blocks and its tokens the target's vocabulary, so they must match"
            )
    device = target.embed_tokens.weight.device
    dtype = target.embed_tokens.weight.dtype
    max_model_len = resolve_max_model_len(config, target_spec)  # the target's limit, as its rotary
    draft = CausalLM(draft_spec, max_model_len, device, dtype, target.quantization)
    if target.kv_groups.num_groups != 1 or draft.kv_groups.num_groups != 1:
        raise UnsupportedModelError(
            "speculative decoding with a draft model needs full-attention target and draft models "
            "(one KV-cache group each); sliding-window layers are not supported with it yet"
        )
    if config.load_format == "dummy":
        init_dummy_weights(draft, draft_spec, seed=1)
    else:
        load_weights(draft, draft_spec, spec_config.model)
    return draft


@dataclass(frozen=True, slots=True)
class _DraftProposals:
    """The draft model's proposals of one step, on the device: per verification row the proposal
    it checks and the draft distribution q it was drawn from (None: every request is greedy), and
    the proposals again as the input ids of their batch rows (`token_rows`). `layout` (its index
    tensors staged) and `slots` are the verification's, copied to the device with the passes'
    inputs: the step's one copy for its proposals and their acceptance."""

    row_ids: torch.Tensor
    row_probs: torch.Tensor | None
    input_ids: torch.Tensor
    token_rows: torch.Tensor
    layout: VerifyLayout
    slots: torch.Tensor


@dataclass(frozen=True, slots=True)
class _DraftPasses:
    """A step's draft proposal passes, for the device-side derivation of passes 1 .. width
    (`step_inputs.next_pass_inputs`): per verified request its slot, its last token's position
    (pass 0's) and its last proposal's position (limit), on the device; the proposals per request
    (`width`, the widest: width + 1 passes, the last of which only writes the last proposal's KV);
    the block table columns the last pass needs."""

    rows: torch.Tensor
    starts: torch.Tensor
    limits: torch.Tensor
    host_limits: np.ndarray  # the same, on the host (a proposal graph stages them with pass 0)
    width: int
    table_width: int


@dataclass(slots=True)
class _StepSampling:
    """A launched step's sampling, once its forward pass is queued: its logits, the requests that
    sample or verify, and the masks known so far (the late ones are appended by `apply_masks`)."""

    logits: torch.Tensor | None  # None on a tensor-parallel worker
    sample_rows: torch.Tensor
    sampling: list[RequestState]
    verified: list[_Scheduled]
    drafted: _DraftProposals | None
    num_sampled: int  # logits rows of the sampling requests (the verified rows follow)
    masked_seq_ids: list[SeqId]  # one per bitmask row
    bitmask: torch.Tensor | None
    late_seq_ids: list[SeqId]  # the plan's late_masked_seq_ids


@dataclass(slots=True)
class _LaunchedAhead:
    """A verification step launched before its plan (`ModelRunner.launch_ahead`): what the plan
    must be for it to be that plan's step, and what to restore if it is not.

    Attributes:
        pending: the launched step (its step_id set when a plan takes it).
        states: the verified requests, in the order the plan must name them.
        num_drafts: the proposals each verifies (the draft model's: k each; n-gram's: up to k,
            0 for a decode among them).
        drafts: n-gram's proposals, each request's (the plan must propose the same); None: the
            draft model's, made on the device.
        rows: [S] their slots, on the device.
        fed: [S] their slots' last tokens before the step (its acceptance overwrote them).
    """

    pending: PendingStep
    states: list[RequestState]
    num_drafts: list[int]
    drafts: list[list[int]] | None
    rows: torch.Tensor
    fed: torch.Tensor

    def unwind(self) -> None:
        """Takes the step's tokens back out of its requests' state (`_replay_verification` counted
        them at launch): for a plan's validation against the state before it, or for good."""
        for st, num_draft in zip(self.states, self.num_drafts, strict=True):
            st.num_computed -= num_draft + 1
            if not num_draft:  # a decode's token counted at launch
                st.num_tokens -= 1

    def rewind(self) -> None:
        """Undoes `unwind`."""
        for st, num_draft in zip(self.states, self.num_drafts, strict=True):
            st.num_computed += num_draft + 1
            if not num_draft:
                st.num_tokens += 1


@dataclass(slots=True)
class _Scheduled:
    state: RequestState
    num_new: int  # proposals included
    num_draft: int = 0  # speculative decoding: the last num_draft new tokens are proposals
    drafts: np.ndarray | None = None  # their ids (int64; zeros the draft model fills in)
    from_draft_model: bool = False  # proposed here, by the draft model, at the start of the step

    @property
    def samples(self) -> bool:
        """Whether its computed tokens (proposals aside) reach its end: the step samples it."""
        st = self.state
        return st.num_computed + self.num_new - self.num_draft == st.num_tokens


def _plain_greedy(s: _Scheduled) -> bool:
    """Whether a verified request's acceptance is plain argmax matching of its proposals
    (`spec_decode.accept_greedy`): greedy, no logprobs, no token banned at any of its rows (a ban
    lifts as tokens are generated: none at its first row, none after)."""
    st, p = s.state, s.state.sampling
    return p.greedy and not p.return_logprobs and not p.banned_ids(st.num_tokens - st.num_prompt)


def _verify_layout(verified: list[_Scheduled]) -> VerifyLayout:
    """The verification rows of a step's verified requests (in their order, d_i + 1 each)."""
    num_drafts = np.array([s.num_draft for s in verified], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]]).astype(np.int64)
    return VerifyLayout(num_drafts, offsets)


class ModelRunner:
    """Holds the model, the KV pool and every request's state; runs StepPlans.

    `tensor_parallel_size`: ranks of the group this runner is rank 0 of (1: the whole model here;
    see executor.tp_runner).

    Not thread-safe: the service serialises calls. Steps run in launch order on one CUDA stream, so
    step N+1 may be launched while step N runs: it reads only what N leaves on the device.
    """

    tensor_parallel_size = 1
    # Whether a plan's late masks are awaited before sampling (a tensor-parallel worker samples
    # nothing: it takes rank 0's tokens, whenever rank 0 sends them).
    waits_for_late_masks = True
    # Whether a greedy n-gram verification may replay its acceptance as a graph (a tensor-parallel
    # rank sends or takes the fed tokens and counts instead: `_feed`, `_verified`, `_verify`).
    accepts_points_in_graphs = True

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        cuda_graphs: bool = False,
        draft: CausalLM | None = None,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.device
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.stats = RunnerStats()
        self._requests: dict[SeqId, RequestState] = {}
        self._awaiting: PendingStep | None = None  # the launched step that awaits its late masks
        self._ahead: _LaunchedAhead | None = None  # a verification launched before its plan
        self.kv_groups = model.kv_groups
        self._layer_caches = kv_cache.layer_caches(self.kv_groups.layer_slot)
        # Speculative decoding's draft model: its layers' KV in the slots after the target's.
        self.draft = draft
        self._draft_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if draft is not None:
            first = model.kv_groups.layers_per_block
            self._draft_caches = kv_cache.layer_caches([first + i for i in range(draft.spec.num_layers)])
        self.slots = RequestSlots(
            max_num_seqs, self.max_blocks_per_seq, self.device, self.kv_groups.num_groups
        )
        self._limits = PlanLimits(
            vocab_size=self.spec.vocab_size,
            max_model_len=max_model_len,
            block_size=self.block_size,
            max_blocks_per_seq=self.max_blocks_per_seq,
            num_device_blocks=kv_cache.num_device_blocks,
            num_cpu_blocks=kv_cache.num_cpu_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_held_requests=self.slots.capacity,
            sliding_windows=self.kv_groups.sliding_windows,
            has_draft_model=draft is not None,
            num_disk_blocks=kv_cache.num_disk_blocks,
        )
        self._busy_until = 0.0
        self.graph_reserve_bytes = 0  # what the KV sizing set aside for the graphs (from_model)
        # Of the host pool (kv_cache.num_cpu_blocks), the share the CPU tier may hold (from_model).
        self.num_cpu_offload_blocks = 0
        self.memory_profile: MemoryProfile | None = None  # what from_model measured on CUDA
        # A device-to-device copy's bytes/s (read + write), measured by from_model on CUDA (0 off it):
        # with `weight_read_bytes` and `kv_bytes_per_token`, a step's read floor (AttachResponse).
        self.copy_bytes_per_s = 0.0
        self.host_copy_bytes_per_s = 0.0  # with a CPU tier: pinned host -> device, measured at start
        self.tracer: StepTracer | None = None  # from_model sets it for --step-trace
        self.graphs: StepGraphs | None = None
        self.calibrate_kv_scales = False  # the next step sets the FP8 KV scales (eagerly)
        # Speculative decoding's draft model, as AttachResponse reports it ("" / 0: none).
        self.draft_model_dir = ""
        self.num_speculative_tokens = 0
        self.num_lookahead_slots = 0  # SpeculativeConfig.num_lookahead_slots, with a draft model
        # n-gram speculation, as the scheduler's --speculative-config gives it (the executor's own
        # flag): the runner keeps each request's outputs to propose as the scheduler does and
        # launches the next verification ahead of its plan (`launch_ahead`). None: off.
        self.ngram: SpeculativeConfig | None = None
        if cuda_graphs:
            self.graphs = StepGraphs(
                model, self._layer_caches, self.slots, decode_graph_sizes(max_num_seqs),
                mixed_graph_sizes(max_num_batched_tokens, max_num_seqs, max_model_len),
            )  # fmt: skip
            self.graphs.capture()
        self.draft_graphs: StepGraphs | None = None  # the draft model's, bound to the same slots
        if cuda_graphs and draft is not None:
            self.draft_graphs = StepGraphs(
                draft, self._draft_caches, self.slots, decode_graph_sizes(max_num_seqs),
                mixed_graph_sizes(max_num_batched_tokens, max_num_seqs, max_model_len),
            )  # fmt: skip
            self.draft_graphs.capture()

    @classmethod
    def create(cls, config: ExecutorConfig) -> ModelRunner:
        """Loads the model, then `from_model` (one device: tensor parallelism is
        `executor.tp_workers`, which `ExecutorServer` starts for --tensor-parallel-size > 1)."""
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"ModelRunner.create runs on one device; tensor_parallel_size={config.tensor_parallel_size} "
                "needs executor.tp_workers.TensorParallelWorkers (ExecutorServer starts it)"
            )
        device = config.torch_device()
        check_fp8_support(config.quantization, config.kv_cache_dtype, device)
        in_use_at_start = 0
        if device.type == "cuda" and config.num_gpu_blocks_override is None:
            in_use_at_start = memory_in_use(device)[0]
        spec = load_model_spec(config.model)
        model = CausalLM(
            spec,
            resolve_max_model_len(config, spec),
            device,
            config.torch_dtype(device),
            config.quantization,
            hybrid_kv_cache=not config.disable_hybrid_kv_cache_manager,
        )
        if config.load_format == "dummy":
            init_dummy_weights(model, spec)
        else:
            load_weights(model, spec, config.model)
        draft = load_draft_model(config, model)
        return cls.from_model(config, model, in_use_at_start=in_use_at_start, draft=draft)

    @classmethod
    def from_model(
        cls,
        config: ExecutorConfig,
        model: CausalLM,
        *,
        in_use_at_start: int = 0,
        min_over_ranks: Callable[[int], int] | None = None,
        draft: CausalLM | None = None,
    ) -> ModelRunner:
        """Sizes and allocates the KV pools for a loaded model (profiling first on CUDA), then
        captures the CUDA graphs (on CUDA, unless enforce_eager).

        Args:
            in_use_at_start: device memory in use before the model was loaded (other processes,
                the CUDA context): outside this executor's budget (see executor.profiling).
            min_over_ranks: tensor parallelism: the smallest of a value over the group's ranks
                (each rank sizes its pools for its own shard; block ids must mean the same on all).
            draft: speculative decoding's draft model (`load_draft_model`): its layers' KV in
                extra slots of every block.
        """
        spec = model.spec
        device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        check_fp8_support(model.quantization, config.kv_cache_dtype, device)
        max_model_len = resolve_max_model_len(config, spec)
        layout = kv_cache_layout(config, model, draft)
        kv_dtype = layout.dtype
        windows = model.kv_groups.sliding_windows
        cuda_graphs = device.type == "cuda" and not config.enforce_eager
        copy_bytes_per_s = measure_copy_bandwidth(device)  # before the pool: it needs 512 MiB free
        memory = None
        if config.num_gpu_blocks_override is None and device.type == "cuda":
            memory = profile_cuda(model, layout, config, max_model_len, cuda_graphs, in_use_at_start)
        graph_reserve = 0 if memory is None else memory.graph_reserve_bytes
        sizing = size_pools(layout, config, max_model_len, device.type, windows, memory, in_use_at_start)
        num_blocks, num_cpu_blocks, why = sizing.num_gpu_blocks, sizing.num_cpu_blocks, sizing.why
        num_offload, num_disk = sizing.num_cpu_offload_blocks, sizing.num_disk_offload_blocks
        if min_over_ranks is not None:
            num_blocks, num_cpu_blocks = min_over_ranks(num_blocks), min_over_ranks(num_cpu_blocks)
            num_offload = min(min_over_ranks(num_offload), num_cpu_blocks)
            num_disk = min_over_ranks(num_disk)
            why += ", the smallest over the tensor-parallel ranks"
        check_fits(
            layout, num_blocks, max_model_len, why=why, sliding_windows=windows,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )  # fmt: skip
        host_copy_bytes_per_s = measure_host_copy_bandwidth(device) if num_offload else 0.0
        kv_cache = KVCache(layout, num_blocks, num_cpu_blocks, device)
        if num_disk:
            assert config.kv_offloading_disk is not None
            kv_cache.disk = DiskTierFile(config.kv_offloading_disk, num_disk, layout.bytes_per_block)
        log.info(
            "executor.loaded",
            model=config.model,
            architecture=spec.architecture,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            quantization=model.quantization,
            kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
            max_model_len=max_model_len,
            block_size=config.block_size,
            kv_cache_groups=[w or 0 for w in windows],
            num_gpu_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
            num_cpu_offload_blocks=num_offload,
            num_disk_offload_blocks=num_disk,
            kv_pool_gib=round(num_blocks * layout.bytes_per_block / 2**30, 3),
            host_pool_gib=round(num_cpu_blocks * layout.bytes_per_block / 2**30, 3),
            weights_gib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 3),
            cuda_graphs=cuda_graphs,
            sizing=why,
        )
        runner = cls(
            model,
            kv_cache,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            cuda_graphs=cuda_graphs,
            draft=draft,
        )
        if draft is not None:
            assert config.speculative_config is not None and config.speculative_config.model is not None
            runner.draft_model_dir = config.speculative_config.model
            runner.num_speculative_tokens = config.speculative_config.num_speculative_tokens
            runner.num_lookahead_slots = config.speculative_config.num_lookahead_slots
            if runner.draft_graphs is not None and runner.graphs is not None:
                runner.draft_graphs.capture_proposals(runner.num_speculative_tokens, PROPOSAL_GRAPH_MAX_SEQS)
                runner.draft_graphs.capture_acceptance(runner.graphs.logits)
        elif config.speculative_config is not None and runner.accepts_points_in_graphs:
            runner.ngram = config.speculative_config  # n-gram (tensor-parallel ranks never launch ahead)
        runner.graph_reserve_bytes = graph_reserve
        runner.memory_profile = memory
        runner.copy_bytes_per_s = copy_bytes_per_s
        runner.host_copy_bytes_per_s = host_copy_bytes_per_s
        runner.num_cpu_offload_blocks = num_offload
        if config.step_trace:
            runner.tracer = StepTracer(config.step_trace, device)
        # An FP8 pool without scales from the checkpoint takes them from the first real step.
        runner.calibrate_kv_scales = model.needs_kv_calibration(config.kv_cache_dtype)
        if runner.graphs is not None and graph_reserve and runner.graphs.device_bytes > graph_reserve:
            log.warning(
                "executor.graph_reserve_exceeded",
                reserved_gib=round(graph_reserve / 2**30, 3),
                used_gib=round(runner.graphs.device_bytes / 2**30, 3),
            )
        return runner

    @property
    def weight_read_bytes(self) -> int:
        """Bytes of weights every decode step reads (`CausalLM.decode_read_bytes`; this rank's)."""
        return self.model.decode_read_bytes()

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V (what attention reads per context token
        of full-attention layers; sliding-window layers read at most their window)."""
        layout = self.kv_cache.layout
        per_layer = layout.bytes_per_block // (layout.layers_per_block * layout.block_size)
        return per_layer * self.spec.num_layers

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def reset(self) -> None:
        """Forgets every request (a new lease); the pool's contents become meaningless."""
        self._drop_awaiting()
        self._ahead = None
        self._requests.clear()
        self.slots.reset()
        self.kv_cache.wait_for_disk_io()  # (a fetch left running would write a host block later)

    def execute(self, plan: executor_pb2.StepPlan) -> executor_pb2.StepOutput:
        """Runs one plan to completion (`launch`, then `finish`)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: executor_pb2.StepPlan) -> PendingStep:
        """Applies `plan` (swap_out, removed, swap_in, new, running) and queues one forward pass over
        the scheduled tokens plus sampling for every request whose tokens are then all computed; the
        CPU tier's offloads and loads go on the copy stream beside it (executor.kv_cache).
        Returns without waiting for the device.

        Raises:
            PlanError: the plan is inconsistent, or a step still awaits its masks; nothing was applied.
        """
        self._check_not_awaiting(plan)
        if self._ahead is not None and (ahead := self._take_ahead(plan)) is not None:
            return ahead
        pending = PendingStep(plan.step_id, time.perf_counter())
        if self.tracer is not None:
            pending.trace = self.tracer.begin(
                plan.step_id,
                copied_beside=len(plan.offload) + len(plan.load),
                swapped=len(plan.swap_out) + len(plan.swap_in),
            )
        new_params = validate_plan(plan, self._requests, self._limits)
        kv = self.kv_cache
        kv.spill_and_fetch(
            *([(m.src, m.dst) for m in moves] for moves in (plan.spill, plan.fetch, plan.spill_ahead))
        )
        kv.wait_for_copies()  # the previous plan's tier copies: this step may touch their blocks
        kv.swap_out([m.src for m in plan.swap_out], [m.dst for m in plan.swap_out])
        for seq_id in plan.removed_seq_ids:
            state = self._requests.pop(seq_id, None)
            if state is not None:
                self.slots.release(state.slot)
        kv.swap_in([m.src for m in plan.swap_in], [m.dst for m in plan.swap_in])
        if plan.offload or plan.load:  # beside this step's forward, which touches none of them
            kv.copy_beside([(m.src, m.dst) for m in plan.offload], [(m.src, m.dst) for m in plan.load])
        scheduled = [s for s in self._admit(plan, new_params) if s.num_new > 0]
        if scheduled:
            self._launch_forward(scheduled, pending, plan)
        stats = self.stats
        stats.steps += 1
        stats.tokens_computed += sum(s.num_new for s in scheduled)
        stats.swap_out_blocks += len(plan.swap_out) + len(plan.offload)
        stats.swap_in_blocks += len(plan.swap_in) + len(plan.load)
        if pending.trace is not None:
            self.tracer.launched(pending.trace)
        return pending

    @torch.inference_mode()
    def launch_ahead(self, finished: PendingStep) -> None:
        """Launches, before its plan arrives, the verification step that most likely follows
        `finished`, a greedy verification step that `_replay_verification` ran and whose output
        went out: the same requests, each with the proposals the scheduler will make, in the
        blocks they hold already. A verification step's plan waits for the step before it (the
        scheduler must know how many proposals were accepted), so without this the GPU idles for
        the whole round trip and the scheduler's work; with it, the step runs meanwhile, and the
        plan, when it is that step (`_take_ahead`), only has its output collected.

        The proposals: the draft model's k from each request's newest token (made on the device;
        the scheduler reserves each verification's next slots with its own where they fit), or
        n-gram's, made here by the scheduler's own search (`propose_ngram`) over the request's
        tokens as the scheduler knows them now (its outputs included); a request without a
        proposal decodes beside the others, and a step of decodes alone is left to its plan. Anything
        else in the plan (a new request, a finished one, other proposals, as near max_tokens)
        discards it: its KV writes lie past every request's computed tokens, where the plan's own
        step writes again, and the last tokens it fed are restored (`_roll_back`).
        Does nothing where that step cannot be launched so (a proposal past the blocks the
        request holds, or past max_model_len)."""
        if not finished.replayed_verification or self._ahead is not None or self._awaiting is not None:
            return
        if self.draft is None and self.ngram is None:  # the scheduler alone proposes (no flag here)
            return
        states = [st for st, _ in finished.spec]
        k = self.num_speculative_tokens
        drafts: list[list[int]] | None = None
        if self.ngram is None:
            num_drafts = [k] * len(states)
        else:
            spec = self.ngram
            assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
            drafts = [
                propose_ngram(st.ngram_tokens(), spec.num_speculative_tokens, spec.prompt_lookup_min,
                              spec.prompt_lookup_max)
                for st in states
            ]  # fmt: skip
            num_drafts = [len(d) for d in drafts]
            if not any(num_drafts):
                return
        max_len = self._limits.max_model_len
        for st, num_draft in zip(states, num_drafts, strict=True):
            last = st.num_computed + num_draft  # the position of its last proposal
            if (
                self._requests.get(st.seq_id) is not st
                or last >= max_len
                or any(end * self.block_size <= last for end in st.table_ends)
            ):
                return
        if drafts is None:
            zeros = np.zeros(k, dtype=np.int64)
            scheduled = [_Scheduled(st, k + 1, k, zeros, True) for st in states]
        else:
            scheduled = [
                _Scheduled(st, len(d) + 1, len(d), np.asarray(d, dtype=np.int64))
                for st, d in zip(states, drafts, strict=True)
            ]
        batch = self._host_batch(scheduled)
        rows = int64_to_device([batch.rows], self.device)[0]
        fed = self.slots.last_token.index_select(0, rows)  # queued before the step overwrites them
        self.kv_cache.wait_for_copies()  # as `launch` does
        pending = PendingStep(-1, time.perf_counter())
        if self.tracer is not None:
            pending.trace = self.tracer.begin(-1)
            pending.trace.ahead = True
        if not self._replay_verification(scheduled, batch, pending):
            return
        pending.order = [st.seq_id for st in states]
        self._ahead = _LaunchedAhead(pending, states, num_drafts, drafts, rows, fed)
        if pending.trace is not None:
            self.tracer.launched(pending.trace)

    def _take_ahead(self, plan: executor_pb2.StepPlan) -> PendingStep | None:
        """The step launched ahead, if `plan` is exactly it (nothing but its requests, in order,
        each with the proposals it verifies: the draft model's k, or n-gram's very tokens; new
        blocks only past the step's slots); else rolls it back."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        same = len(plan.running) == len(ahead.states) and all(
            field.name in ("step_id", "running") for field, _ in plan.ListFields()
        )
        drafts = ahead.drafts or [[]] * len(ahead.states)
        same = same and all(
            req.seq_id == st.seq_id
            and req.num_new_tokens == num_draft + 1
            and req.num_draft_tokens == num_draft
            and list(req.draft_token_ids) == draft
            for req, st, num_draft, draft in zip(
                plan.running, ahead.states, ahead.num_drafts, drafts, strict=True
            )
        )
        appends = same and any(table.block_ids for req in plan.running for table in req.new_blocks)
        if not same or (appends and not self._valid_before(plan, ahead)):
            self._roll_back(ahead)
            return None
        if appends:  # past every slot the step reads: the table's device copy follows it
            for req, st in zip(plan.running, ahead.states, strict=True):
                self._append_blocks(st, req)
            self.slots.flush()
        pending = ahead.pending
        pending.step_id = plan.step_id
        if pending.trace is not None:
            pending.trace.step_id = plan.step_id
            pending.trace.plan_at_ms = self.tracer.now_ms()
        self.stats.steps += 1
        self.stats.tokens_computed += sum(ahead.num_drafts) + len(ahead.states)
        self.stats.steps_launched_ahead += 1
        return pending

    def _valid_before(self, plan: executor_pb2.StepPlan, ahead: _LaunchedAhead) -> bool:
        """Whether `plan` is valid for the state `ahead` was launched from (a plan with new
        blocks; if not, it goes the usual way, whose validation says what is wrong)."""
        ahead.unwind()
        try:
            validate_plan(plan, self._requests, self._limits)
        except PlanError:
            return False
        finally:
            ahead.rewind()
        return True

    def _roll_back(self, ahead: _LaunchedAhead) -> None:
        """Undoes a step launched ahead that no plan took: its requests' computed tokens and the
        last tokens it fed (after it on the stream, so its own writes come first)."""
        ahead.unwind()
        self.slots.last_token.index_copy_(0, ahead.rows, ahead.fed)
        self.stats.graph_steps -= 1
        self.stats.steps_discarded_ahead += 1

    @torch.inference_mode()
    def apply_masks(self, pending: PendingStep, masks: executor_pb2.StepMasks) -> None:
        """Samples a launched step that awaits its late masks: the requests of `masks` within their
        rows, the other late ones without a mask (they finished: their tokens are discarded).

        Raises:
            PlanError: `pending` awaits no masks, or these are not its masks; nothing was sampled.
        """
        work = pending.deferred
        if work is None or pending is not self._awaiting:
            raise PlanError(f"masks for step {masks.step_id}, but step {pending.step_id} awaits none")
        vocab = self.spec.vocab_size
        validate_masks(masks, pending.step_id, work.late_seq_ids, vocab)
        if masks.seq_ids:
            late = self._masks_to_device(masks.token_bitmask, len(masks.seq_ids), masks.rows)
            work.bitmask = late if work.bitmask is None else torch.cat([work.bitmask, late])
            work.masked_seq_ids += masks.seq_ids
        self._resume(pending)

    def _resume(self, pending: PendingStep) -> None:
        """Samples the step that awaited its masks, with what it has of them."""
        work, pending.deferred, self._awaiting = pending.deferred, None, None
        assert work is not None
        self._sample_step(work, pending)

    def _drop_awaiting(self) -> None:
        """A step whose masks will never come (its stream ended, a new lease): sampled without
        them, its output never sent, so that what later steps read on the device is consistent."""
        if self._awaiting is not None:
            log.info("executor.late_masks_dropped", step_id=self._awaiting.step_id)
            with torch.inference_mode():
                self._resume(self._awaiting)

    def drop_awaiting(self, pending: PendingStep) -> None:
        """`pending`'s stream ended while it awaited its masks (no-op if it awaits none)."""
        if pending is self._awaiting:
            self._drop_awaiting()

    def _check_not_awaiting(self, plan: executor_pb2.StepPlan) -> None:
        """A plan's forward reads the tokens of the step before: none may await its masks."""
        if self._awaiting is not None:
            raise PlanError(
                f"plan {plan.step_id} arrived while step {self._awaiting.step_id} awaits its late masks"
            )

    def finish(self, pending: PendingStep) -> executor_pb2.StepOutput:
        """Waits for a launched step's sampled tokens and reports them, in plan order."""
        if pending.deferred is not None:
            raise RuntimeError(f"step {pending.step_id} awaits its late masks: nothing sampled yet")
        if pending.done is not None:
            pending.done.synchronize()
        if pending.spec:
            output = self._finish_spec(pending)
        else:
            output = executor_pb2.StepOutput(step_id=pending.step_id, seq_ids=pending.seq_ids)
        if pending.seq_ids and not pending.spec:
            output.token_ids.extend(pending.token_ids.tolist())
            if pending.logprobs is None:
                output.logprobs.extend([0.0] * len(pending.seq_ids))
            else:
                logprobs = pending.logprobs.tolist()
                output.logprobs.extend(
                    lp if want else 0.0 for lp, want in zip(logprobs, pending.wants_logprobs, strict=True)
                )
        if pending.prompt_spans:
            values, offset = pending.prompt_logprobs.tolist(), 0
            for seq_id, start, count in pending.prompt_spans:
                chunk = values[offset : offset + count]
                output.prompt_logprobs.add(seq_id=seq_id, start=start, logprobs=chunk)
                offset += count
        if self.ngram is not None:
            self._record_outputs(output)
        now = time.perf_counter()
        output.step_seconds = now - pending.started
        self.stats.busy_seconds += max(0.0, now - max(pending.started, self._busy_until))
        self._busy_until = now
        if pending.trace is not None:
            self.tracer.finished(pending.trace)
        return output

    def _record_outputs(self, output: executor_pb2.StepOutput) -> None:
        """n-gram speculation: each request's tokens in `output` join its outputs, the tokens
        `launch_ahead` proposes from (one each, or `num_tokens` each after a verification)."""
        requests = self._requests  # (a request a plan launched meanwhile removed is not there)
        if not output.num_tokens:  # one token each: ~0.2 us a request (W1 runs 512 at once)
            for seq_id, token in zip(output.seq_ids, output.token_ids, strict=True):
                if (st := requests.get(seq_id)) is not None:
                    st.outputs.append(token)
            return
        tokens, offset = list(output.token_ids), 0
        for seq_id, count in zip(output.seq_ids, output.num_tokens, strict=True):
            if (st := requests.get(seq_id)) is not None:
                st.outputs.extend(tokens[offset : offset + count])
            offset += count

    def _finish_spec(self, pending: PendingStep) -> executor_pb2.StepOutput:
        """The output of a step that verified proposals: each request's tokens in plan order, with
        their counts. The verified requests' state advances by what was accepted, and their tables
        end at the block of their last computed token, as the scheduler trims its copy."""
        runs: dict[SeqId, tuple[list[int], list[float]]] = {}
        if pending.seq_ids:
            logprobs = pending.logprobs.tolist() if pending.logprobs is not None else None
            sampled = pending.token_ids.tolist()
            for i, (seq_id, token) in enumerate(zip(pending.seq_ids, sampled, strict=True)):
                want = pending.wants_logprobs[i] and logprobs is not None
                runs[seq_id] = ([token], [logprobs[i] if want else 0.0])
        counts = pending.spec_counts.tolist()
        tokens = pending.spec_token_ids.tolist()
        spec_logprobs = None if pending.spec_logprobs is None else pending.spec_logprobs.tolist()
        for i, ((st, num_draft), count) in enumerate(zip(pending.spec, counts, strict=True)):
            lps = spec_logprobs[i][:count] if spec_logprobs and st.sampling.return_logprobs else [0.0] * count
            runs[st.seq_id] = (tokens[i][:count], lps)
            self.stats.tokens_sampled += count  # (launch counted the other sampling rows)
            if num_draft:  # (a decode among them advanced at launch: `_replay_verification`)
                self._advance_verified(st, num_draft, count, pending.lookahead)
        output = executor_pb2.StepOutput(step_id=pending.step_id)
        for seq_id in pending.order:
            run_tokens, run_logprobs = runs[seq_id]
            output.seq_ids.append(seq_id)
            output.num_tokens.append(len(run_tokens))
            output.token_ids.extend(run_tokens)
            output.logprobs.extend(run_logprobs)
        return output

    def _advance_verified(self, st: RequestState, num_draft: int, count: int, lookahead: int) -> None:
        """A verified request got `count` tokens (count - 1 of its `num_draft` proposals accepted):
        its state advances by them, and its tables end at the block of its last computed token
        or, with `lookahead` slots kept past it, of the last of those (as the scheduler's do)."""
        st.num_tokens += count
        st.num_computed -= num_draft - (count - 1)
        end = -(-(st.num_computed + lookahead) // self.block_size)
        st.table_ends = [min(e, end) for e in st.table_ends]

    def _admit(self, plan: executor_pb2.StepPlan, new_params: list[SamplingParams]) -> list[_Scheduled]:
        """Creates the new requests' state, appends the running ones' new blocks, updates the
        device block table; returns every scheduled request in plan order."""
        scheduled: list[_Scheduled] = []
        for req, params in zip(plan.new_requests, new_params, strict=True):
            known = np.fromiter(req.token_ids, dtype=np.int64, count=len(req.token_ids))
            state = RequestState(
                seq_id=req.seq_id,
                slot=self.slots.allocate(),
                known_ids=known,
                num_tokens=len(known),
                num_prompt=req.num_prompt_tokens or len(known),  # proto3: 0 = unset = all prompt
                num_computed=req.num_computed_tokens,
                table_ends=[t.first_index + len(t.block_ids) for t in req.block_tables],
                sampling=params,
            )
            for group, table in enumerate(req.block_tables):
                self.slots.set_blocks(state.slot, table.first_index, table.block_ids, group)
            self._requests[req.seq_id] = state
            scheduled.append(_Scheduled(state, req.num_new_tokens))
        for req in plan.running:
            state = self._requests[req.seq_id]
            self._append_blocks(state, req)
            if req.num_draft_tokens and not req.draft_token_ids:  # the draft model proposes them
                drafts = np.zeros(req.num_draft_tokens, dtype=np.int64)
                scheduled.append(_Scheduled(state, req.num_new_tokens, req.num_draft_tokens, drafts, True))
            elif req.num_draft_tokens:
                drafts = np.fromiter(req.draft_token_ids, dtype=np.int64, count=len(req.draft_token_ids))
                scheduled.append(_Scheduled(state, req.num_new_tokens, req.num_draft_tokens, drafts))
            else:
                scheduled.append(_Scheduled(state, req.num_new_tokens))
        self.slots.flush()
        return scheduled

    def _append_blocks(self, state: RequestState, req: executor_pb2.RunningRequest) -> None:
        """A running request's new blocks, appended at each table's end (checked), on the host;
        the device copy at the next `slots.flush()`."""
        for group, table in enumerate(req.new_blocks):
            self.slots.set_blocks(state.slot, table.first_index, table.block_ids, group)
            state.table_ends[group] += len(table.block_ids)

    def _host_batch(self, scheduled: list[_Scheduled]) -> HostBatch:
        """The step's inputs on the host: one cheap pass per sequence, then NumPy over tokens."""
        rows, starts, q_lens, samples, chunks = [], [], [], [], []
        fed: list[int] | None = None
        empty = np.zeros(0, dtype=np.int64)
        for s in scheduled:
            st = s.state
            start, known = st.num_computed, len(st.known_ids)
            end = start + s.num_new - s.num_draft  # proposals aside
            rows.append(st.slot)
            starts.append(start)
            q_lens.append(s.num_new)
            samples.append(end == st.num_tokens and not s.num_draft)  # verified rows: `_spec_rows`
            chunk = st.known_ids[start : min(end, known)] if start < known else empty
            if s.num_draft:
                if fed is None:
                    fed = [len(c) if q > len(c) else -1 for c, q in zip(chunks, q_lens, strict=False)]
                fed.append(len(chunk) if end - start > len(chunk) else -1)
                chunk = np.concatenate([chunk, s.drafts])
            elif fed is not None:
                fed.append(len(chunk) if s.num_new > len(chunk) else -1)
            chunks.append(chunk)
        return build_host_batch(
            rows=np.array(rows, dtype=np.int64),
            starts=np.array(starts, dtype=np.int64),
            q_lens=np.array(q_lens, dtype=np.int64),
            samples=np.array(samples, dtype=bool),
            host_chunks=chunks,
            table=self.slots.table_host,
            block_size=self.block_size,
            fed_offsets=None if fed is None else np.array(fed, dtype=np.int64),
        )

    @staticmethod
    def _spec_rows(scheduled: list[_Scheduled], batch: HostBatch) -> np.ndarray:
        """The token rows of the verified requests' last num_draft + 1 tokens, in plan order."""
        ends = batch.cu_seqlens[1:]
        return np.concatenate(
            [
                ends[i] - 1 - s.num_draft + np.arange(s.num_draft + 1)
                for i, s in enumerate(scheduled)
                if s.num_draft
            ]
        ).astype(np.int64)

    def _prompt_logprob_rows(
        self, scheduled: list[_Scheduled], batch: HostBatch, pending: PendingStep
    ) -> tuple[np.ndarray, np.ndarray]:
        """For requests that asked for prompt logprobs: the batch rows whose logits predict a prompt
        token (positions p computed this step with p + 1 still prompt) and those tokens (p + 1).
        Records each request's span in `pending`. Called before num_computed advances."""
        rows, targets = [], []
        for i, s in enumerate(scheduled):
            st = s.state
            if not st.sampling.return_prompt_logprobs:
                continue
            start = st.num_computed
            end = min(start + s.num_new, st.num_prompt - 1)
            if end <= start:
                continue
            rows.append(batch.cu_seqlens[i] + np.arange(end - start))
            targets.append(st.known_ids[start + 1 : end + 1])
            pending.prompt_spans.append((st.seq_id, start + 1, end - start))
        if not rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(rows).astype(np.int64), np.concatenate(targets).astype(np.int64)

    def _launch_forward(
        self, scheduled: list[_Scheduled], pending: PendingStep, plan: executor_pb2.StepPlan
    ) -> None:
        """Queues the forward pass (a CUDA graph replay when one fits), the sampler, the
        device-side token feed and the copy of the sampled tokens to the host."""
        batch = self._host_batch(scheduled)
        sampling: list[RequestState] = []  # they sample one token
        verified: list[_Scheduled] = []  # they verify proposals (speculative decoding)
        for s in scheduled:
            st = s.state
            if st.num_computed + s.num_new - s.num_draft == st.num_tokens:
                if s.num_draft:
                    verified.append(s)
                else:
                    sampling.append(st)
        if verified:
            pending.order = [s.state.seq_id for s in scheduled if s.samples]
        if verified and self._verify_in_graphs(scheduled, verified, batch, pending, plan):
            return
        spec_rows = self._spec_rows(scheduled, batch) if verified else np.zeros(0, dtype=np.int64)
        prompt_rows, prompt_targets = self._prompt_logprob_rows(scheduled, batch, pending)
        calibrate, self.calibrate_kv_scales = self.calibrate_kv_scales, False
        drafted = None
        draft_batch = batch  # what the draft runs over for its KV (None: nothing)
        if self.draft is not None and any(s.from_draft_model for s in verified):
            drafted = self._draft_proposals(verified, spec_rows, batch)
            if not calibrate:  # the proposal passes wrote the verified tokens' draft KV
                draft_batch = self._draft_rest(scheduled, verified)
        for s in scheduled:
            s.state.num_computed += s.num_new
        # Prompt logprobs and verification need logits at more rows than the graphs compute: those
        # steps run eagerly, as does the step that calibrates the FP8 KV scales.
        graph_batch = batch
        if verified and self.graphs is not None:  # the graph's logits rows: sampled, then verified
            graph_batch = replace(
                batch,
                logits_indices=np.concatenate([batch.logits_indices, spec_rows]),
                sample_rows=np.concatenate([batch.sample_rows, np.full(len(spec_rows), self.slots.pad_row)]),
            )
        graph = (
            not calibrate
            and self.graphs is not None
            and not len(prompt_rows)
            and self.graphs.can_run(graph_batch)
        )
        if pending.trace is not None:
            self.tracer.forward_starts(pending.trace, batch, graph, len(verified))
        if graph:
            token_ids = None if drafted is None else (drafted.token_rows, drafted.input_ids)
            logits, sample_rows = self.graphs.run(graph_batch, token_ids)
            sample_rows = sample_rows[: len(batch.logits_indices)]
            self.stats.graph_steps += 1
            if self.draft is not None and draft_batch is not None:  # the draft's KV, before the feed
                self._draft_pass(draft_batch, token_ids if draft_batch is batch else None)
        else:
            inputs = stage_batch(batch, self.slots)
            input_ids = inputs.input_ids
            if drafted is not None:  # the draft model's proposals, in their rows of the batch
                input_ids = input_ids.clone()
                input_ids[drafted.token_rows] = drafted.input_ids
            indices = None if batch.decode_only else inputs.logits_indices
            if calibrate:
                self.model.set_kv_calibration(True)
            if len(prompt_rows) or verified:
                rows = np.concatenate([spec_rows, prompt_rows])
                extra, targets = int64_to_device([rows, prompt_targets], self.device)
                indices = torch.cat([inputs.logits_indices, extra])
            logits = self.model(input_ids, inputs.meta, self._layer_caches, indices)
            if calibrate:
                self.model.set_kv_calibration(False)
            if self.draft is not None and draft_batch is not None:
                token_ids = None if drafted is None else (drafted.token_rows, drafted.input_ids)
                token_ids = token_ids if draft_batch is batch else None
                self._draft_pass(draft_batch, token_ids, calibrate=calibrate)
            sample_rows = inputs.sample_rows
            if len(prompt_rows):
                num_rows = len(batch.logits_indices) + len(spec_rows)
                logits = self._prompt_logprobs(logits, num_rows, targets, pending)
        work = _StepSampling(
            logits, sample_rows, sampling, verified, drafted, len(batch.logits_indices),
            list(plan.masked_seq_ids), self._plan_bitmask(plan), list(plan.late_masked_seq_ids),
        )  # fmt: skip
        if work.late_seq_ids and self.waits_for_late_masks:
            pending.deferred, self._awaiting = work, pending  # sampled by apply_masks
            return
        self._sample_step(work, pending)

    def _verify_in_graphs(
        self,
        scheduled: list[_Scheduled],
        verified: list[_Scheduled],
        batch: HostBatch,
        pending: PendingStep,
        plan: executor_pb2.StepPlan,
    ) -> bool:
        """A greedy step of verifications alone, all of the draft model's (k proposals each) or
        all n-gram's, these maybe among one-token decodes, where the graphs hold it
        (`_replay_verification`). Returns False, having done nothing, where this does not apply."""
        if plan.masked_seq_ids or plan.late_masked_seq_ids:
            return False
        if len(verified) != len(scheduled) and (
            any(s.from_draft_model for s in verified)
            or not all(s.num_draft or (s.num_new == 1 and s.samples) for s in scheduled)
        ):
            return False
        return self._replay_verification(scheduled, batch, pending)

    def _replay_verification(self, steps: list[_Scheduled], batch: HostBatch, pending: PendingStep) -> bool:
        """Replays, for `steps` (a greedy step of verifications alone or, for n-gram proposals,
        of verifications and one-token decodes: every token row a logits row, staged by one fill
        per graph), the draft's proposal graph (draft-model proposals), the target's mixed graph
        (the proposals written into its input ids) and an acceptance graph (tokens, counts, the
        feed): the draft's (`StepGraphs.accept`, k proposals each), or for n-gram's, up to k each
        (a decode: none), the target's (`StepGraphs.accept_points`). The general path
        (`_draft_proposals`, `_sample`, `_verify`) launches ~15 to ~60 torch operations a step
        from the host besides (index tensors, acceptance kernels, views): on the H200 a
        draft-model step of one request was bound by them, and on an H100 an n-gram step took
        1.18 ms of launch and 0.80 ms of GPU against a decode step's 0.61 and 0.35 (2026-12-06).
        Returns False, having done nothing, where the graphs do not hold the step."""
        graphs, draft_graphs = self.graphs, self.draft_graphs
        if graphs is None or self.calibrate_kv_scales or not all(_plain_greedy(s) for s in steps):
            return False
        num, k = len(steps), max(s.num_draft for s in steps)
        by_draft = all(s.from_draft_model for s in steps)  # else none may be (n-gram's alone)
        if by_draft:
            held = (
                draft_graphs is not None
                and k == self.num_speculative_tokens
                and all(s.num_draft == k for s in steps)
                and draft_graphs.can_accept(num, k)
            )
        else:
            held = (
                self.accepts_points_in_graphs
                and not any(s.from_draft_model for s in steps)
                and graphs.can_accept_points(num)
            )
        if not held:
            return False
        # The target graph's logits rows are every token row, in order; their sample rows unused.
        rows = np.arange(len(batch.positions), dtype=np.int64)
        graph_batch = replace(batch, logits_indices=rows, sample_rows=np.full(len(rows), self.slots.pad_row))
        if not graphs.can_run(graph_batch):
            return False
        proposals = None
        if by_draft:
            assert draft_graphs is not None
            first = decode_batch(batch, rows[:: k + 1], batch.rows, self.block_size)  # pass 0
            proposals = draft_graphs.propose(first, None, first.positions + k)
        for s in steps:
            s.state.num_computed += s.num_new
            if not s.num_draft:  # a decode: its token counts now, as `_sample`'s do
                s.state.num_tokens += 1
        if pending.trace is not None:
            self.tracer.forward_starts(pending.trace, batch, True, sum(1 for s in steps if s.num_draft))
        graphs.run(graph_batch, proposals)
        self.stats.graph_steps += 1
        if by_draft:
            assert draft_graphs is not None
            emitted = draft_graphs.accept(num)
        else:
            emitted = graphs.accept_points(num, k)
        pending.replayed_verification = True  # `launch_ahead` may follow
        self._verified(emitted[:, -1])
        spec = [(s.state, s.num_draft) for s in steps]
        self._copy_verified(pending, spec, emitted, lookahead=self.num_lookahead_slots if by_draft else 0)
        return True

    def _sample_step(self, work: _StepSampling, pending: PendingStep) -> None:
        """Queues the sampler (within the masks) and the verification of a launched step."""
        logits, num_sampled = work.logits, work.num_sampled
        if work.sampling:
            masks = self._token_masks(work.masked_seq_ids, work.sampling, work.bitmask)
            rows = logits[:num_sampled] if work.verified and logits is not None else logits
            self._sample(rows, work.sample_rows, work.sampling, pending, masks)
        if work.verified:
            masks = self._verify_masks(work.masked_seq_ids, work.verified, work.bitmask)
            rows = None if logits is None else logits[num_sampled:]
            self._verify(rows, work.verified, pending, work.drafted, masks)
        if not work.sampling and not work.verified and pending.prompt_spans:
            self._record_done(pending)

    def _draft_rest(self, scheduled: list[_Scheduled], verified: list[_Scheduled]) -> HostBatch | None:
        """The batch of a step's requests whose tokens the draft still has to run over for their
        KV: all but the verified ones, whose proposal passes wrote it (None: no other request, as
        in a step of verifications alone, where the draft's pass over the step is skipped: its
        staging, a graph replay and its GPU time). Called before num_computed advances."""
        done = {id(s) for s in verified}
        rest = [s for s in scheduled if id(s) not in done]
        return self._host_batch(rest) if rest else None

    def _draft_pass(
        self,
        batch: HostBatch,
        token_ids: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        logits: bool = False,
        calibrate: bool = False,
    ) -> torch.Tensor | None:
        """Runs the draft model over `batch` (its CUDA graph when one fits, else eagerly), with
        `token_ids` (device rows, ids) replacing those rows' host placeholders. Over a step's tokens
        it runs for their KV alone: it must hold the KV of every token the target does, prompts and
        chunks included. With `logits`: returns each row's (a decode batch of the proposals)."""
        assert self.draft is not None
        graphs = self.draft_graphs
        if graphs is not None and not calibrate and graphs.can_run(batch):
            out, _ = graphs.run(batch, token_ids)
            return out if logits else None
        inputs = stage_batch(batch, self.slots)
        input_ids = inputs.input_ids
        if token_ids is not None:
            input_ids = input_ids.clone()
            input_ids[token_ids[0]] = token_ids[1]
        if calibrate:
            self.draft.set_kv_calibration(True)
        out = self.draft(input_ids, inputs.meta, self._draft_caches, None if logits else input_ids[:0])
        if calibrate:
            self.draft.set_kv_calibration(False)
        return out

    def _draft_proposals(
        self, verified: list[_Scheduled], spec_rows: np.ndarray, batch: HostBatch
    ) -> _DraftProposals:
        """The draft model's proposals for the verified requests: d_i decode passes of the draft
        from each one's last token (its KV is the draft's for every earlier token), each sampling
        the next proposal from the draft's processed distribution q (the request's temperature,
        top-k and top-p; greedy: its argmax) with its own per-(seed, position) noise. Called before
        the target's forward, which then computes the proposals with the rest of the step.

        Only pass 0 is built on the host (the rows of `batch`, the step's, where the verifications
        start: `spec_rows` are their batch rows); every later pass's inputs are derived on the device
        (`step_inputs.next_pass_inputs`), so the passes queue back to back without host work
        between them: one replay of a proposal graph for greedy requests, else one decode graph
        replay per pass (or eager passes without graphs). A last pass over each request's last
        proposal writes its KV, so the passes leave the draft's KV of every token the target
        verifies and the draft need not run over the verified requests' tokens again
        (`_launch_forward`)."""
        assert self.draft is not None
        states = [s.state for s in verified]
        num = len(verified)
        layout = _verify_layout(verified)
        num_drafts = layout.num_drafts
        width = int(num_drafts.max())
        starts = np.array([st.num_computed for st in states], dtype=np.int64)  # the last token's position
        slots = np.array([st.slot for st in states], dtype=np.int64)
        # Pass 0: each verified request's last token (on the host if it was sent, else fed from
        # last_token), the first of its verification rows in the step's batch.
        first = decode_batch(batch, spec_rows[layout.offsets], slots, self.block_size)
        # Per verification row (j = 0 .. d_i of request i): the proposal it checks, as an index into
        # the [S, width] proposals flattened (the last row's, clamped, is ignored), and its q's row
        # of the [S, width + 1] distributions; per proposal, the batch row it is the input token of
        # (proposal j is that of verification row j + 1; `spec_rows`: their batch rows). Indexing
        # the proposals so needs no padded copy of them.
        seq_index = np.repeat(np.arange(num), num_drafts + 1)
        j_index = np.concatenate([np.arange(d + 1) for d in num_drafts.tolist()])
        checks = seq_index * width + np.minimum(j_index, width - 1)
        inputs = checks[j_index < num_drafts[seq_index]]
        token_rows = spec_rows[j_index >= 1]
        q_rows = seq_index * (width + 1) + j_index
        limits = starts + num_drafts
        layout, (slots_d, starts_d, limits_d, checks_d, inputs_d, token_rows_d, q_rows_d) = stage_layout(
            layout, self.device, [slots, starts, limits, checks, inputs, token_rows, q_rows]
        )
        table_width = -(-int(limits.max() + 1) // self.block_size)
        passes = _DraftPasses(slots_d, starts_d, limits_d, limits, width, table_width)
        params = [st.sampling for st in states]
        vocab, device = self.spec.vocab_size, self.device
        row_probs = None  # greedy: proposals are the draft's argmax, q is not needed
        if all(p.greedy for p in params):
            proposals = self._greedy_proposals(first, passes)
        else:
            probs = torch.zeros((num, width + 1, vocab), dtype=torch.float32, device=device)
            proposals = self._sampled_proposals(first, passes, params, starts, probs)
            row_probs = probs.view(-1, vocab)[q_rows_d]
        flat = proposals.reshape(-1)
        return _DraftProposals(flat[checks_d], row_probs, flat[inputs_d], token_rows_d, layout, slots_d)

    def _greedy_proposals(self, batch: HostBatch, passes: _DraftPasses) -> torch.Tensor:
        """[S, width] greedy proposals: one replay of the proposal graph when one fits."""
        graphs = self.draft_graphs
        if graphs is not None and graphs.can_propose(batch.num_seqs, passes.width):
            return graphs.propose(batch, None, passes.host_limits)
        return self._proposal_passes(batch, passes, lambda logits, j: logits.argmax(dim=-1))

    def _sampled_proposals(
        self,
        batch: HostBatch,
        passes: _DraftPasses,
        params: list[SamplingParams],
        starts: np.ndarray,
        probs: torch.Tensor,
    ) -> torch.Tensor:
        """[S, width] proposals sampled from the draft's processed distributions q, written into
        `probs` [S, width + 1, vocab]. Each pass's noise is that of its (seed, position), drawn for
        all passes at once before the first (noise does not depend on the logits)."""
        num, width, vocab = batch.num_seqs, passes.width, self.spec.vocab_size
        processing = probs_processing(params, vocab, self.device)
        positions = [int(p) + j + 1 for j in range(width) for p in starts]
        shape = torch.empty((width * num, vocab), dtype=torch.float32, device=self.device)
        noise = exponential_noise(shape, draft_sampling_params(params) * width, positions)
        noise = noise.view(width, num, vocab)

        def choose(logits: torch.Tensor, j: int) -> torch.Tensor:
            q = processed_probs(logits, params, processing)
            probs[:, j] = q
            return (q / noise[j]).argmax(dim=-1)

        return self._proposal_passes(batch, passes, choose)

    def _proposal_passes(
        self,
        batch: HostBatch,
        passes: _DraftPasses,
        choose: Callable[[torch.Tensor, int], torch.Tensor],
    ) -> torch.Tensor:
        """Runs the width + 1 passes (pass 0 from `batch`, staged; the others' inputs derived on
        the device from pass 0's) and returns [S, width] proposals, `choose(logits, j)` of passes
        0 .. width - 1 (the last pass writes the last proposal's KV; its logits are not used)."""
        assert self.draft is not None
        graphs = self.draft_graphs
        graph = graphs is not None and graphs.can_run_decode(batch.num_seqs)  # pass 0 ran its decode graph
        out = torch.empty((batch.num_seqs, passes.width), dtype=torch.int64, device=self.device)
        logits = self._draft_pass(batch, None, logits=True)
        cu_seqlens = None
        for j in range(passes.width + 1):
            if j:
                inputs = next_pass_inputs(
                    passes.rows, passes.starts, passes.limits, j, self.slots.table, self.block_size
                )
                if graph:
                    logits = graphs.run_next(out[:, j - 1], inputs)
                else:
                    if cu_seqlens is None:
                        cu_seqlens = torch.arange(batch.num_seqs + 1, dtype=torch.int32, device=self.device)
                    meta = AttentionMetadata(
                        positions=inputs.positions,
                        slot_mapping=inputs.slot_mapping,
                        block_tables=self.slots.block_tables(passes.rows, passes.table_width),
                        seq_lens=inputs.seq_lens.to(torch.int32),
                        cu_seqlens_q=cu_seqlens,
                        decode_only=True,
                    )
                    ids = out[:, j - 1]
                    logits = self.draft(ids, meta, self._draft_caches, None if j < passes.width else ids[:0])
            if j < passes.width:
                out[:, j] = choose(logits, j)
        return out

    def _verify(
        self,
        logits: torch.Tensor,
        verified: list[_Scheduled],
        pending: PendingStep,
        drafted: _DraftProposals | None = None,
        masks: TokenMasks | None = None,
    ) -> None:
        """Speculative decoding: accepts each verified request's proposals (`executor.spec_decode`),
        feeds its last emitted token to its next step on the device and starts copying the runs to
        the host. Its state advances in `finish`, once the counts are known there: the scheduler
        plans its next step only after this output (scheduler/core.py)."""
        states = [s.state for s in verified]
        banned = [
            st.sampling.banned_ids(st.num_tokens - st.num_prompt + j)
            for s, st in zip(verified, states, strict=True)
            for j in range(s.num_draft + 1)
        ]
        params, positions = [st.sampling for st in states], [st.num_tokens for st in states]
        if drafted is not None:  # the layout and slots came to the device with the proposal passes
            slots = drafted.slots
            result = verify_draft_model(
                logits, drafted.row_ids, drafted.row_probs, params, positions, drafted.layout,
                banned if any(banned) else None,
            )  # fmt: skip
        else:  # one copy for everything acceptance reads: the layout's indices, proposals, slots
            draft_rows = np.concatenate([np.append(s.drafts[: s.num_draft], -1) for s in verified])
            layout, (draft_ids, slots) = stage_layout(
                _verify_layout(verified), self.device, [draft_rows, np.array([st.slot for st in states])]
            )
            result = verify_point_mass(
                logits, draft_ids, params, positions, layout, banned if any(banned) else None, masks
            )
        self._feed(slots, result.last_token)
        self._verified(result.counts)
        logprobs = None
        if any(st.sampling.return_logprobs for st in states):
            logprobs = result.logprobs
        self._copy_verified(
            pending,
            [(st, s.num_draft) for st, s in zip(states, verified, strict=True)],
            torch.cat([result.token_ids, result.counts[:, None]], dim=1),
            logprobs,
            self.num_lookahead_slots if drafted is not None else 0,
        )

    def _copy_verified(
        self,
        pending: PendingStep,
        spec: list[tuple[RequestState, int]],
        emitted: torch.Tensor,
        logprobs: torch.Tensor | None = None,
        lookahead: int = 0,
    ) -> None:
        """Starts copying a verification's results to the host: `emitted` [S, K + 2], each verified
        request's tokens and its count in the last column (one copy), and its [S, K + 1] logprobs
        (None: none asked); `spec`: the requests and their proposal counts; `lookahead`: the slots
        their tables keep for the next verification (the draft model's: `num_lookahead_slots`)."""
        pending.spec, pending.lookahead = spec, lookahead
        host = to_host(emitted)
        pending.spec_token_ids, pending.spec_counts = host[:, :-1], host[:, -1]
        if logprobs is not None:
            pending.spec_logprobs = to_host(logprobs)
        self._record_done(pending)

    def _verified(self, counts: torch.Tensor) -> None:
        """Hook: a verification's token counts are on the device (tensor parallelism sends them to
        the other ranks)."""

    def _plan_bitmask(self, plan: executor_pb2.StepPlan) -> torch.Tensor | None:
        """The plan's packed next-token masks (structured outputs) on the device, one row per
        masked_seq_ids entry (None without any)."""
        if not plan.masked_seq_ids:
            return None
        return self._masks_to_device(plan.token_bitmask, len(plan.masked_seq_ids), plan.mask_rows)

    def _masks_to_device(self, packed: bytes, num_masks: int, rows: Sequence[int]) -> torch.Tensor:
        """Packed masks (validated) on the device, one row per mask: with shared rows
        (StepPlan.mask_rows, StepMasks.rows) each distinct row is copied once, then gathered
        there."""
        words = mask_words(self.spec.vocab_size)
        if not rows:
            return bytes_to_device(packed, torch.int32, (num_masks, words), self.device)
        distinct = bytes_to_device(packed, torch.int32, (len(packed) // (4 * words), words), self.device)
        return distinct[to_device(list(rows), torch.int64, self.device)]

    def _token_masks(
        self, masked_seq_ids: list[SeqId], sampling: list[RequestState], bitmask: torch.Tensor | None
    ) -> TokenMasks | None:
        """The masks (row i is masked_seq_ids[i]'s) lined up with the sampling rows they belong to
        (validated: each masked request samples in this step)."""
        if bitmask is None:
            return None
        first: dict[int, int] = {}
        for i, seq_id in enumerate(masked_seq_ids):
            first.setdefault(seq_id, i)
        rows = [i for i, st in enumerate(sampling) if st.seq_id in first]
        if not rows:
            return None
        order = [first[sampling[i].seq_id] for i in rows]
        if order != list(range(len(bitmask))):
            bitmask = bitmask[to_device(order, torch.int64, self.device)]
        return TokenMasks(to_device(rows, torch.int64, self.device), bitmask)

    def _verify_masks(
        self, masked_seq_ids: list[SeqId], verified: list[_Scheduled], bitmask: torch.Tensor | None
    ) -> TokenMasks | None:
        """A constrained verified request's masks (one per position it is verified at, in order),
        lined up with its verification rows."""
        if bitmask is None:
            return None
        first: dict[int, int] = {}
        for i, seq_id in enumerate(masked_seq_ids):
            first.setdefault(seq_id, i)
        rows: list[int] = []
        order: list[int] = []
        offset = 0
        for s in verified:
            seq_id = s.state.seq_id
            if seq_id in first:
                rows += range(offset, offset + s.num_draft + 1)
                order += range(first[seq_id], first[seq_id] + s.num_draft + 1)
            offset += s.num_draft + 1
        if not rows:
            return None
        index, order_d = int64_to_device([np.array(rows), np.array(order)], self.device)
        return TokenMasks(index, bitmask[order_d])

    def _prompt_logprobs(
        self, logits: torch.Tensor, num_sampled: int, targets: torch.Tensor, pending: PendingStep
    ) -> torch.Tensor:
        """Starts copying the prompt logprobs (the logits rows past the sampled ones) to the host;
        returns the sampled rows' logits."""
        pending.prompt_logprobs = to_host(prompt_logprobs(logits[num_sampled:], targets))
        return logits[:num_sampled]

    def _sample(
        self,
        logits: torch.Tensor,
        sample_rows: torch.Tensor,
        sampling: list[RequestState],
        pending: PendingStep,
        masks: TokenMasks | None = None,
    ) -> None:
        """Samples each sampling request's next token (within its mask, if it has one), feeds it
        to its next step on the device and starts copying the tokens to the host."""
        banned = [st.sampling.banned_ids(st.num_tokens - st.num_prompt) for st in sampling]
        result = sample(
            logits,
            [st.sampling for st in sampling],
            [st.num_tokens for st in sampling],  # the position each sampled token takes
            banned if any(banned) else None,
            masks,
        )
        self._feed(sample_rows, result.token_ids)
        for st in sampling:
            st.num_tokens += 1
        self.stats.tokens_sampled += len(sampling)
        pending.seq_ids = [st.seq_id for st in sampling]
        pending.wants_logprobs = [st.sampling.return_logprobs for st in sampling]
        pending.token_ids = to_host(result.token_ids)
        pending.logprobs = None if result.logprobs is None else to_host(result.logprobs)
        self._record_done(pending)

    def _record_done(self, pending: PendingStep) -> None:
        """Marks the end of a launched step's device work (CUDA). A spinning event: the thread
        that waits for it (the service's step watcher, `finish`) holds a core but wakes at once;
        a blocking one sleeps and may wake late, on the critical path of a step nothing is planned
        ahead of (with one, W7 without speculation ran 1.57 ms a token on an H100, 2026-12-05,
        against 1.08 ms on the H200 before; different cards, so a hint, not a measurement)."""
        if self.device.type == "cuda":
            pending.done = torch.cuda.Event()
            pending.done.record()

    def _feed(self, sample_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Writes the sampled tokens where the next decode step reads its input (`RequestSlots`)."""
        self.slots.store_sampled(sample_rows, token_ids)
