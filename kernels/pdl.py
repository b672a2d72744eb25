"""Programmatic dependent launch (PDL) for the kernels of a small-batch decode step.

Why: a one-request decode step of the llama-8b shape is ~300 kernels in a CUDA graph, most of them
a few microseconds long. Between two kernels the GPU drains the first grid, then launches and
ramps up the next: ~0.5-1 us a boundary that no fusion of ours removes, and a GEMV that starts
cold spends its first microseconds with few weight bytes in flight (issue 33: the qkv and o GEMVs
reach only 0.6-0.7 of the copy bandwidth). With PDL (Hopper's `griddepcontrol`, CUDA's
programmatic stream serialization) a kernel launched with `launch_pdl=True` may start while its
predecessor in the stream is still running; it blocks in `griddepcontrol.wait` until that
predecessor has completed and its writes are visible. What it does before the wait overlaps the
predecessor's tail: its launch, its address arithmetic, and (the GEMV, with
PAGEDSERVE_GEMV_PREFETCH=1) prefetching its weights, which no kernel of a step writes.

The rule every kernel launched with `launch_pdl=pdl_enabled(...)` follows (`begin`): it waits
before its first access to memory that an earlier kernel of the step may write or still read
(activations, KV cache, scratch; so also before every store), and it lets its own dependent launch
right after that wait. A kernel may read before the wait only what no kernel of the stream ever
writes (weights). Waiting first and releasing the dependent after keeps at most one kernel
launched ahead: the dependent cannot start before this kernel's predecessor has completed, so it
too may read anything written before that. Kernels launched without the flag (torch's, cuBLAS's,
ours with PDL off) keep full stream order, and `griddepcontrol` is a no-op in a kernel launched
without it, so one compiled kernel serves both.

On by default where the hardware has it (compute capability 9.0+) and the kernels are compiled;
`PAGEDSERVE_PDL=0` turns it off (comparisons, and a way out should a driver misbehave). Under
`TRITON_INTERPRET=1` it is always off: the interpreter runs no inline PTX.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["PDL_ENV", "begin", "launch_args", "pdl_enabled"]

PDL_ENV = "PAGEDSERVE_PDL"
# Read once: @triton.jit chose the interpreter or the compiler at import time as well.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (their `USE_PDL` and `launch_pdl`)."""
    if _INTERPRETED or device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _supported(device)


def launch_args(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel whose first statement is `begin(USE_PDL)`."""
    use = pdl_enabled(device)
    return {"USE_PDL": use, "launch_pdl": use}


@triton.jit
def begin(USE_PDL: tl.constexpr):
    """Waits for the stream's previous kernel to complete, then lets the next one launch (see the
    module docstring); nothing without PDL."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
