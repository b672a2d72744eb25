"""What `executor.profiling.profile_cuda` will measure, estimated from the model's shape alone.

`pagedserve plan` has no GPU run to profile, so it estimates the three things the executor measures
on CUDA before it sizes its KV pool, and hands them to the executor's own `kv_cache.size_pools`: its
block count then differs from the executor's only by this estimate's error.

* **The worst eager step's peak** (`peak_bytes`): the parameters and buffers, plus the larger of
  - the forward pass of `max_num_batched_tokens` tokens. Its peak is in one layer's MLP: the
    gate/up output [T, 2I] and the SiLU-and-mul output [T, I] live beside four [T, H] tensors
    (the previous layer's output and residual, which the model's loop still holds, and this
    layer's normed input and new residual: the fused norm writes a new residual, it does not add
    in place). Attention's q/k/v [T, q + 2kv] and output [T, q] are smaller for every model we run,
    but are counted the same way;
  - the LM head and the sampler over the `min(max_num_seqs, max_num_batched_tokens)` rows the
    profiling pass samples with top-k/top-p: float32 logits [S, V] and the sort's temporaries, 40
    bytes per logit in all (the raw and the temperature-scaled logits, 4 bytes each; the sort's
    values 4, indices 8, its index input 8 and cub's double buffers 12), plus 32 MiB of
    allocator rounding. Measured on an H200 (llama-8b shape, vocab 128,256): 1.254 GiB above the
    weights at 256 rows, 2.480 GiB at 512: 40.1 bytes per logit and 29 MiB.
  With the llama-8b shape the sampler's peak (S x V logits) is the larger from about 190 rows up;
  below, the MLP's (0.91 GiB at 8,192 tokens, which the H200's graph pass measured exactly).
* **The CUDA-graph reserve**: the larger of a decode pass of `max_num_seqs` rows and a pass of the
  worst step, each writing float32 logits for every row into an output buffer (as the graphs do):
  that buffer plus the larger of the forward's peak and the head's (bf16 logits and the final
  [T, H] tensors), plus `profiling.GRAPH_OVERHEAD_BYTES` per captured graph. The H200 measured
  2.411 GiB at max_num_seqs 256 (59 graphs); this gives 2.411 GiB.
* **Memory outside torch** (cuBLAS/cuBLASLt workspaces, loaded kernels): a constant, the 0.671 GiB
  every one-GPU run on the H200 measured (torch 2.11), whatever the model.

What the estimate leaves out: memory other processes hold on the GPU (the executor counts it as not
its own; `plan` assumes a GPU with only this executor's CUDA context on it), NCCL's buffers under
tensor parallelism (more outside torch), and kernels' workspaces that change with a torch release.
`pagedserve plan --measure` loads the model as the executor does and prints both figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.kv_cache import MemoryProfile
from pagedserve.executor.profiling import GRAPH_OVERHEAD_BYTES, num_cuda_graphs, worst_step_lens

if TYPE_CHECKING:  # the spec's fields used: hidden/intermediate sizes, head counts, head_dim, vocab
    from pagedserve.executor.loader import ModelSpec

# See the module doc: the sampler's bytes per logit row element and its fixed part, and the memory
# outside torch's allocator, as measured on one H200 (torch 2.11, llama-8b shape).
SAMPLER_BYTES_PER_LOGIT = 40
SAMPLER_FIXED_BYTES = 32 << 20
NON_TORCH_BYTES = int(0.671 * 2**30)
# A CUDA context on a Hopper GPU: what the executor finds in use before it loads anything on an
# otherwise empty device. It only matters when --gpu-memory-utilization leaves less than it free.
CUDA_CONTEXT_BYTES = 512 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate, part by part (bytes); `profile()` is what `size_pools` takes.

    Attributes:
        static_bytes: parameters and buffers of the executor's model (weights, rotary tables).
        forward_peak_bytes: activations of the worst step's forward pass.
        head_peak_bytes: the LM head's temporaries over the sampled rows.
        sampler_peak_bytes: logits and the sampler's temporaries over the sampled rows.
        graph_pass_bytes: the larger of the two graph passes (see the module doc).
        num_graphs: CUDA graphs the runner captures (0 with --enforce-eager).
        non_torch_bytes: memory outside torch's allocator.
        total_bytes: the device's memory.
        step_tokens, step_seqs: the worst step profiled: its tokens and sampled rows.
    """

    static_bytes: int
    forward_peak_bytes: int
    head_peak_bytes: int
    sampler_peak_bytes: int
    graph_pass_bytes: int
    num_graphs: int
    non_torch_bytes: int
    total_bytes: int
    step_tokens: int
    step_seqs: int

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.head_peak_bytes, self.sampler_peak_bytes)

    @property
    def graph_reserve_bytes(self) -> int:
        return self.graph_pass_bytes + GRAPH_OVERHEAD_BYTES * self.num_graphs if self.num_graphs else 0

    def profile(self) -> MemoryProfile:
        return MemoryProfile(
            peak_bytes=self.static_bytes + self.activation_peak_bytes,
            non_torch_bytes=self.non_torch_bytes,
            total_bytes=self.total_bytes,
            graph_reserve_bytes=self.graph_reserve_bytes,
        )


def forward_peak_bytes(spec: ModelSpec, num_tokens: int, element: int, fp8: bool) -> int:
    """Peak activation bytes of a forward pass over `num_tokens` tokens (see the module doc).

    Args:
        spec: the rank's spec (its heads and MLP rows under tensor parallelism).
        element: bytes of the model dtype.
        fp8: --quantization fp8: the norms and SiLU-and-mul hand FP8 activations (1 byte, plus a
            float32 scale per token) to the projections after them.
    """
    t, h, i = num_tokens, spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    stream = t * h * element  # one [T, H] tensor in the model dtype

    def quantized(width: int) -> int:  # a projection's input, in FP8 or the model dtype
        return t * width + 4 * t if fp8 else t * width * element

    held = 3 * stream + quantized(h)  # previous output and residual, new residual, normed input
    mlp = held + 2 * t * i * element + quantized(i)
    attention = held + t * (q + 2 * kv) * element + t * q * element + (quantized(q) if fp8 else 0) + stream
    return max(mlp, attention)


def head_peak_bytes(spec: ModelSpec, num_tokens: int, rows: int, element: int, float_logits: bool) -> int:
    """The LM head over `rows` of a step of `num_tokens` tokens: the final output and residual, the
    gathered rows, normed, and the logits in the model dtype (then in float32 beside them, eagerly)."""
    stream = num_tokens * spec.hidden_size * element
    gathered = 0 if rows == num_tokens else 2 * rows * spec.hidden_size * element
    logits = rows * spec.vocab_size * element
    return (
        2 * stream
        + gathered
        + 2 * rows * spec.hidden_size * element
        + logits
        + (4 * rows * spec.vocab_size if float_logits else 0)
    )


def sampler_peak_bytes(spec: ModelSpec, rows: int) -> int:
    """The sampler's peak over `rows` rows sampled with top-k/top-p (see the module doc)."""
    return SAMPLER_BYTES_PER_LOGIT * rows * spec.vocab_size + SAMPLER_FIXED_BYTES


def _graph_pass_bytes(spec: ModelSpec, num_tokens: int, rows: int, element: int, fp8: bool) -> int:
    """`profiling._graph_pass_bytes`: the float32 output buffer plus the forward's or the head's peak."""
    out = 4 * rows * spec.vocab_size
    forward = forward_peak_bytes(spec, num_tokens, element, fp8)
    return out + max(forward, head_peak_bytes(spec, num_tokens, rows, element, float_logits=False))


def estimate_memory(
    spec: ModelSpec,
    config: ExecutorConfig,
    max_model_len: int,
    *,
    static_bytes: int,
    element: int,
    total_bytes: int,
    cuda_graphs: bool,
) -> MemoryEstimate:
    """The estimate of `profile_cuda(model, layout, config, max_model_len, cuda_graphs)` on rank 0
    (under tensor parallelism the pools are the smallest over the ranks: rank 0's, which samples).

    Args:
        spec: the rank's spec (`TPShard.local_spec` under tensor parallelism).
        static_bytes: the model's parameters and buffers (a model built on the meta device).
        element: bytes of the model dtype.
    """
    fp8 = config.quantization == "fp8"
    lens = worst_step_lens(config, max_model_len)
    tokens, rows = sum(lens), len(lens)
    graph_pass = num_graphs = 0
    if cuda_graphs:
        num_graphs = num_cuda_graphs(config, max_model_len)
        graph_pass = max(
            _graph_pass_bytes(spec, config.max_num_seqs, config.max_num_seqs, element, fp8),
            _graph_pass_bytes(spec, tokens, rows, element, fp8),
        )
    return MemoryEstimate(
        static_bytes=static_bytes,
        forward_peak_bytes=forward_peak_bytes(spec, tokens, element, fp8),
        head_peak_bytes=head_peak_bytes(spec, tokens, rows, element, float_logits=True),
        sampler_peak_bytes=sampler_peak_bytes(spec, rows),
        graph_pass_bytes=graph_pass,
        num_graphs=num_graphs,
        non_torch_bytes=NON_TORCH_BYTES,
        total_bytes=total_bytes,
        step_tokens=tokens,
        step_seqs=rows,
    )
