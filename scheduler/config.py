"""Scheduler configuration: frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.kv_sizing import blocks_per_sequence
from pagedserve.common.speculative import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """What the scheduler needs to know; block counts come from the executor's Attach.

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks: physical KV blocks on the GPU.
        num_cpu_blocks: blocks of the executor's CPU swap pool (0: swap preemption always falls
            back to recompute).
        max_model_len: the longest sequence (prompt + generated tokens).
        max_num_seqs: the most requests running (holding GPU blocks) at once.
        max_num_batched_tokens: the token budget of one step.
        enable_prefix_caching: reuse full blocks whose token chain was computed before.
        preemption_mode: "recompute" (free blocks, compute again later) or "swap" (copy blocks to
            the CPU pool and back).
        sliding_windows: the executor's KV-cache groups: per group None (full attention) or its
            sliding window (see scheduler.kv_cache_manager).
        num_cpu_offload_blocks: of the num_cpu_blocks, the most the prefix cache's CPU tier may
            hold (0: no tier; see scheduler.kv_tier).
        num_disk_offload_blocks: slots of the disk tier below the CPU tier (0: none; it needs the
            CPU tier, whose host blocks stage its reads).
        speculative: speculative decoding (--speculative-config; None: off): the scheduler makes
            the n-gram proposals, reserves KV slots for the proposed tokens and trims what was not
            accepted (see scheduler/core.py).
        late_masks: structured outputs, masks behind the plan: a constrained request is planned
            while its previous token is in flight, and its mask follows the plan once that token
            arrived (the executor says on attach whether it takes them: AttachResponse
            .accepts_late_masks). Off: it is planned only with no token in flight (every other
            plan). See scheduler/core.py.
        shared_mask_rows: structured outputs: each distinct mask of a plan (or of its late masks)
            is sent once, and each request names its row (StepPlan.mask_rows, StepMasks.rows;
            the executor says on attach whether it takes them: AttachResponse
            .accepts_shared_mask_rows). Off: one row per request.
        max_num_loaded_blocks: CPU tier: the most blocks one plan loads back to the GPU (0: no
            limit), so that its loads hide behind its forward (scheduler.kv_tier.load_budget); a
            plan always admits its first tier hit, however many blocks that loads.
    """

    block_size: int = 16
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    sliding_windows: tuple[int | None, ...] = (None,)
    num_cpu_offload_blocks: int = 0
    num_disk_offload_blocks: int = 0
    speculative: SpeculativeConfig | None = None
    late_masks: bool = False
    shared_mask_rows: bool = False
    max_num_loaded_blocks: int = 0

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be a non-negative integer, got {self.num_cpu_blocks!r}")
        if (
            not isinstance(self.num_cpu_offload_blocks, int)
            or not 0 <= self.num_cpu_offload_blocks <= self.num_cpu_blocks
        ):
            raise ValueError(
                f"num_cpu_offload_blocks must be in [0, num_cpu_blocks={self.num_cpu_blocks}], "
                f"got {self.num_cpu_offload_blocks!r}"
            )
        if not isinstance(self.num_disk_offload_blocks, int) or self.num_disk_offload_blocks < 0:
            raise ValueError(
                "num_disk_offload_blocks must be a non-negative integer, "
                f"got {self.num_disk_offload_blocks!r}"
            )
        if not isinstance(self.max_num_loaded_blocks, int) or self.max_num_loaded_blocks < 0:
            raise ValueError(
                f"max_num_loaded_blocks must be a non-negative integer, got {self.max_num_loaded_blocks!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not self.sliding_windows or any(
            w is not None and (not isinstance(w, int) or w < 1) for w in self.sliding_windows
        ):
            raise ValueError(
                f"sliding_windows must hold None or a positive window per group: {self.sliding_windows}"
            )
        # A lone request must always fit, or the scheduler could pre-empt forever.
        needed = blocks_per_sequence(
            self.max_model_len, self.block_size, self.sliding_windows, self.max_num_batched_tokens
        )
        if self.num_gpu_blocks < needed:
            raise ValueError(
                f"num_gpu_blocks = {self.num_gpu_blocks} blocks of {self.block_size} tokens cannot hold "
                f"one sequence of max_model_len = {self.max_model_len} tokens ({needed} blocks)"
            )
