"""The KV pool: paged K/V blocks on the device, a swap pool of the same layout in CPU memory.

Both pools are one tensor each, [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim], so a swap of any set of blocks across every layer is a single gather and a single
scatter; `layer_caches()` hands the kernels each layer's contiguous K and V views.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

log = structlog.get_logger(__name__)


class KVCacheTooSmallError(RuntimeError):
    """The pool cannot hold one sequence of max_model_len; the message says what would fit."""


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape and dtype of one block, shared by the device and CPU pools."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def cpu_device_num_blocks(
    layout: KVCacheLayout, space_bytes: int, max_num_seqs: int, max_model_len: int
) -> int:
    """Pool size when the model runs on the CPU: `space_bytes` worth of blocks, but never more than
    max_num_seqs full-length sequences could use (more would only cost RAM)."""
    cap = max_num_seqs * layout.blocks_for(max_model_len)
    return min(space_bytes // layout.bytes_per_block, cap)


def gpu_num_blocks(
    layout: KVCacheLayout, total_bytes: int, utilization: float, peak_bytes: int, non_torch_bytes: int
) -> int:
    """Pool size on CUDA: what is left of utilization * total after the profiled peak usage.

    Args:
        total_bytes: the device's total memory.
        peak_bytes: torch's peak allocation during the profiling pass (weights + activations).
        non_torch_bytes: memory used outside torch's allocator (CUDA context, libraries).
    """
    available = int(total_bytes * utilization) - peak_bytes - non_torch_bytes
    return max(available, 0) // layout.bytes_per_block


def check_fits(layout: KVCacheLayout, num_blocks: int, max_model_len: int, *, why: str) -> None:
    """Fails at startup when one max_model_len sequence cannot fit, naming the largest that can."""
    if num_blocks * layout.block_size < max_model_len:
        raise KVCacheTooSmallError(
            f"the KV pool has {num_blocks} blocks of {layout.block_size} tokens ({why}), which cannot "
            f"hold one sequence of max_model_len={max_model_len}; the largest length that fits is "
            f"{num_blocks * layout.block_size}: lower --max-model-len or give the pool more memory"
        )


class KVCache:
    """Owns the device KV pool and the CPU swap pool, and copies blocks between them."""

    def __init__(
        self, layout: KVCacheLayout, num_device_blocks: int, num_cpu_blocks: int, device: torch.device
    ) -> None:
        self.layout = layout
        self.device = device
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # Zeroed so kernels that read a partly filled block's tail (masked later) never see NaNs.
        self.device_pool = torch.zeros(
            layout.pool_shape(num_device_blocks), dtype=layout.dtype, device=device
        )
        # Pinned on CUDA so block copies run at full PCIe bandwidth; only swapped-out blocks are ever
        # read back, so no need to initialise it.
        self.cpu_pool = torch.empty(
            layout.pool_shape(num_cpu_blocks), dtype=layout.dtype, pin_memory=device.type == "cuda"
        )

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each a contiguous [num_blocks, block_size, num_kv_heads, head_dim] view."""
        return [(self.device_pool[i, 0], self.device_pool[i, 1]) for i in range(self.layout.num_layers)]

    def swap_out(self, src_device_blocks: list[int], dst_cpu_blocks: list[int]) -> None:
        """Copies device blocks to CPU blocks, all layers at once."""
        if not src_device_blocks:
            return
        src = torch.tensor(src_device_blocks, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_cpu_blocks, dtype=torch.int64)
        self.cpu_pool.index_copy_(2, dst, self.device_pool.index_select(2, src).cpu())

    def swap_in(self, src_cpu_blocks: list[int], dst_device_blocks: list[int]) -> None:
        """Copies CPU blocks to device blocks, all layers at once."""
        if not src_cpu_blocks:
            return
        src = torch.tensor(src_cpu_blocks, dtype=torch.int64)
        dst = torch.tensor(dst_device_blocks, dtype=torch.int64, device=self.device)
        self.device_pool.index_copy_(2, dst, self.cpu_pool.index_select(2, src).to(self.device))
