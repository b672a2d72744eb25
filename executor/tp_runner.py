"""Tensor parallelism, the step engine of each rank: the same `ModelRunner`, fed the same plans.

Every rank holds the same request state and the same block ids (each over its own heads of every
KV block), so rank 0 broadcasts each StepPlan as it arrives (`TPDriverRunner.launch`) and every
worker applies it through the same `ModelRunner.launch`: validation, swaps (every rank moves its
share of each block), admission, the host batch, the choice of eager pass or CUDA graph. The ranks
thus run the same forward in lockstep, meeting at its all-reduces. Broadcasting the plan rather
than prepared device inputs keeps everything downstream unchanged: the overlapped step loop (rank
0 launches plan N+1 before finishing step N; a worker's launch returns as soon as its work is
queued), the per-request device state, the graphs. A plan rank 0 refuses (PlanError) is refused
identically by every worker, with nothing applied on any rank.

Only rank 0 computes logits and samples; it broadcasts the sampled token ids over the device group
(`_feed`), and each worker writes them into its `last_token` (the next decode step's input), so
the ranks' state stays identical without a worker ever reading a token on the host.

Masks behind the plan (structured outputs) stay on rank 0: a worker never sees a StepMasks. It
launches a plan with late masks like any other and waits in the token broadcast (on CUDA its stream
does) until rank 0 has the masks and samples; rank 0 refuses the next plan before sending it to the
workers while a step awaits masks, and samples a step whose masks never came before it sends a
reset (`_drop_awaiting`), so the collectives keep one order on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.loader import init_dummy_weights, load_model_spec, load_weights
from pagedserve.executor.model import CausalLM
from pagedserve.executor.parallel import TPShard
from pagedserve.executor.profiling import memory_in_use
from pagedserve.executor.quantization import check_fp8_support
from pagedserve.executor.runner import (
    ModelRunner,
    PendingStep,
    PlanError,
    RequestState,
    resolve_max_model_len,
)
from pagedserve.executor.tp_group import RESET, STEP, STOP, TensorParallelGroup
from pagedserve.executor.transfer import to_device, to_host
from pagedserve.protos import executor_pb2

log = structlog.get_logger(__name__)


class TPDriverRunner(ModelRunner):
    """Rank 0: a ModelRunner that hands every plan, reset and sampled token to the workers."""

    group: TensorParallelGroup
    on_fatal: Callable[[], None]  # ends the group (TensorParallelWorkers.fail)
    accepts_points_in_graphs = False  # `_feed` broadcasts the fed tokens: the eager path feeds them

    def launch(self, plan: executor_pb2.StepPlan) -> PendingStep:
        self._check_not_awaiting(plan)  # before the workers see it: they would run it
        if any(r.num_draft_tokens and not r.draft_token_ids for r in plan.running):
            raise PlanError("a draft model's proposals: the executor has no draft model (tensor parallelism)")
        self.group.send(STEP, plan.SerializeToString())
        try:
            return super().launch(plan)
        except PlanError:
            raise  # refused by every rank, nothing applied anywhere
        except Exception:
            # Applied in part here, maybe in full on the workers: the ranks no longer agree.
            log.exception("executor.tp_step_failed", step_id=plan.step_id)
            self.on_fatal()
            raise

    def apply_masks(self, pending: PendingStep, masks: executor_pb2.StepMasks) -> None:
        try:
            super().apply_masks(pending, masks)
        except PlanError:
            raise  # nothing sampled: the workers still wait for the tokens
        except Exception:
            log.exception("executor.tp_step_failed", step_id=pending.step_id)
            self.on_fatal()
            raise

    def reset(self) -> None:
        self._drop_awaiting()  # its tokens first: the workers wait for them before they read RESET
        self.group.send(RESET)
        super().reset()

    def stop_workers(self) -> None:
        """Tells the workers to leave their loop (they exit 0)."""
        self.group.send(STOP)

    def _feed(self, sample_rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.group.broadcast_tokens(token_ids)
        super()._feed(sample_rows, token_ids)

    def _verified(self, counts: torch.Tensor) -> None:
        self.group.broadcast_tokens(counts)  # the workers advance the verified requests by them


class TPWorkerRunner(ModelRunner):
    """Ranks 1..N-1: runs rank 0's plans; takes rank 0's sampled tokens instead of sampling.

    Speculative decoding (n-gram proposals): rank 0 sends a verification's last tokens (fed like
    sampled ones) and its token counts; a worker advances the verified requests by the counts two
    plans later (`_settle`), never waiting for its device: the scheduler plans a verified request
    again only after its output, which rank 0 sends once the step is done, so the plan right after
    never holds it."""

    group: TensorParallelGroup
    waits_for_late_masks = False  # rank 0 waits for them, then broadcasts the tokens (`_sample`)
    accepts_points_in_graphs = False  # rank 0's tokens and counts come by broadcast (`_verify`)
    # (step id, its verified requests and their proposal counts, the token counts (host), their event)
    _unsettled: list[tuple[int, list[tuple[RequestState, int]], torch.Tensor, torch.cuda.Event | None]]

    def launch(self, plan: executor_pb2.StepPlan) -> PendingStep:
        self._settle(plan.step_id)
        return super().launch(plan)

    def reset(self) -> None:
        self._unsettled = []
        super().reset()

    def _settle(self, step_id: int) -> None:
        """Advances the requests verified two or more plans before `step_id` (their counts are in)."""
        unsettled = getattr(self, "_unsettled", [])
        keep = []
        for entry in unsettled:
            verified_in, verified, counts, copied = entry
            if verified_in > step_id - 2:
                keep.append(entry)
                continue
            if copied is not None:
                copied.synchronize()  # that step's copy only: the steps queued behind it run on
            for (st, num_draft), count in zip(verified, counts.tolist(), strict=True):
                self._advance_verified(st, num_draft, count, 0)  # (n-gram proposals: no lookahead)
        self._unsettled = keep

    def _verify(self, logits, verified, pending, drafted=None, masks=None) -> None:
        slots = to_device([s.state.slot for s in verified], torch.int64, self.device)
        tokens = torch.empty(len(verified), dtype=torch.int64, device=self.device)
        counts = torch.empty(len(verified), dtype=torch.int64, device=self.device)
        self.group.broadcast_tokens(tokens)  # rank 0's _feed
        self.group.broadcast_tokens(counts)  # rank 0's _verified
        self._feed(slots, tokens)
        copied = None
        host_counts = to_host(counts)
        if self.device.type == "cuda":
            copied = torch.cuda.Event()
            copied.record()
        entry = (pending.step_id, [(s.state, s.num_draft) for s in verified], host_counts, copied)
        self._unsettled = [*getattr(self, "_unsettled", []), entry]

    def serve(self) -> None:
        """Runs rank 0's messages until it says stop."""
        while True:
            kind, payload = self.group.recv()
            if kind == STEP:
                plan = executor_pb2.StepPlan.FromString(payload)
                try:
                    self.launch(plan)
                except PlanError as e:  # rank 0 refused it too, with nothing applied
                    log.debug("executor.tp_worker_bad_plan", step_id=plan.step_id, error=str(e))
            elif kind == RESET:
                self.reset()
            elif kind == STOP:
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel control message {kind}")

    def _prompt_logprobs(
        self, logits: torch.Tensor | None, num_sampled: int, targets: torch.Tensor, pending: PendingStep
    ) -> None:
        return None  # no logits here: rank 0 reports prompt logprobs

    def _plan_bitmask(self, plan: executor_pb2.StepPlan) -> None:
        return None  # rank 0 samples, within the masks

    def _token_masks(self, masked_seq_ids: list[int], sampling: list[RequestState], bitmask) -> None:
        return None

    def _sample(
        self,
        logits: torch.Tensor | None,
        sample_rows: torch.Tensor,
        sampling: list[RequestState],
        pending: PendingStep,
        masks: object = None,
    ) -> None:
        tokens = torch.empty(len(sampling), dtype=torch.int64, device=self.device)
        self.group.broadcast_tokens(tokens)
        self._feed(sample_rows, tokens)
        for st in sampling:
            st.num_tokens += 1


def create_runner(config: ExecutorConfig, group: TensorParallelGroup) -> ModelRunner:
    """This rank's runner: loads its shard of the model, sizes the pools (the smallest over the
    ranks) and captures its graphs. Every rank calls it at once (the profiling passes and the
    graphs' warm-ups run the forward, all-reduces included, on all ranks together)."""
    device = group.device
    check_fp8_support(config.quantization, config.kv_cache_dtype, device)
    in_use_at_start = 0
    if device.type == "cuda" and config.num_gpu_blocks_override is None:
        in_use_at_start = memory_in_use(device)[0]
    spec = load_model_spec(config.model)
    shard = TPShard(group.rank, group.size)
    model = CausalLM(
        shard.local_spec(spec),
        resolve_max_model_len(config, spec),
        device,
        config.torch_dtype(device),
        config.quantization,
        all_reduce=group.all_reduce,
        computes_logits=group.rank == 0,
        hybrid_kv_cache=not config.disable_hybrid_kv_cache_manager,
    )
    if config.load_format == "dummy":
        init_dummy_weights(model, spec, seed=group.rank)
    else:
        load_weights(model, spec, config.model, shard)
    cls = TPDriverRunner if group.rank == 0 else TPWorkerRunner
    runner = cls.from_model(
        config, model, in_use_at_start=in_use_at_start, min_over_ranks=group.min_over_ranks
    )
    runner.group = group
    runner.tensor_parallel_size = group.size
    log.info(
        "executor.tp_rank_ready",
        rank=group.rank,
        tensor_parallel_size=group.size,
        device=str(device),
        heads=list(shard.q_heads(spec)),
        kv_heads=list(shard.kv_heads(spec)),
    )
    return runner
