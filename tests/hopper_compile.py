"""Compiles a decode step's Triton launches for Hopper (sm_90) without a GPU, and runs none.

    python tests/hopper_compile.py   (one JSON line per compiled kernel variant, then the case names)

The interpreter (`TRITON_INTERPRET=1`, what the CPU tests run) executes a kernel's Python body: it
checks the arithmetic, not whether Triton can lower the kernel. A variant that only a GPU takes
(PDL, split plans at a real model's width, the rotating decode launch) could then first fail to
compile inside a serving process. Here the launch wrappers run on CPU tensors against a stand-in
driver that names an sm_90 target; each `kernel[grid](...)` becomes a warm-up (compile, no launch),
so Triton's real pipeline down to the cubin (ptxas included) runs for the constexprs and
specialisations the wrappers choose. Outputs are left unwritten: nothing here checks values.
Run by `tests/test_hopper_compile.py` in a subprocess, since the interpreter is chosen at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET: the kernels must be defined for the compiler")
os.environ["PAGEDSERVE_DECODE_ROTARY"] = "1"  # read at import: the rotating launch may be chosen

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from pagedserve.kernels import pdl, triton_attention, triton_layers  # noqa: E402
from pagedserve.kernels import triton_fp8_gemv as gemv  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class _HopperDriver:
    """What `JITFunction.run` asks of the active driver before it compiles."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return HOPPER

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclasses.dataclass
class CompiledVariant:
    """One compiled kernel variant: its constexprs and ptxas's resource line."""

    kernel: str
    constexprs: dict
    registers: int
    local_bytes: int  # spilled registers (ptxas's LOCAL)


def _resources(cubin: bytes) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = [CUOBJDUMP, "--dump-resource-usage", f.name]
        out = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", out)
    assert found, out
    return int(found[1]), int(found[2])


@contextlib.contextmanager
def compile_only() -> Iterator[list[CompiledVariant]]:
    """Inside, launches compile for sm_90 with PDL on and run nothing; the list yielded receives
    each launch's variant, in launch order."""
    compiled: list[CompiledVariant] = []

    def run(self, *args, grid, warmup, **kwargs):
        kernel = plain_run(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        registers, local = _resources(kernel.asm["cubin"])
        compiled.append(CompiledVariant(self.fn.__name__, constexprs, registers, local))
        return kernel

    plain_run, plain_pdl, plain_driver = JITFunction.run, pdl.pdl_enabled, driver._active
    driver.set_active(_HopperDriver())
    JITFunction.run = run
    pdl.pdl_enabled = gemv.pdl_enabled = lambda device: True  # the GEMV imported it by name
    try:
        yield compiled
    finally:
        JITFunction.run = plain_run
        pdl.pdl_enabled = gemv.pdl_enabled = plain_pdl
        driver.set_active(plain_driver)  # None where no GPU: reset_active would look for one


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """A batch of `num_seqs` sequences of `context` tokens, `new_tokens` of them new (1: decode)."""

    num_seqs: int
    context: int
    new_tokens: int = 1
    heads: tuple[int, int, int] = (32, 8, 128)  # q heads, KV heads, head_dim: the llama-8b shape
    table_blocks: int = 512  # the block table's width (a graph's: max_model_len / 16)
    sm_count: int = 132
    window_cap: bool = False  # Gemma's sliding window and logit soft-cap
    kv_dtype: torch.dtype = torch.bfloat16


def _attention(case: AttentionCase) -> None:
    q_heads, kv_heads, head_dim = case.heads
    page, dtype = 16, torch.bfloat16
    tokens = case.num_seqs * case.new_tokens
    q = torch.zeros(tokens, q_heads, head_dim, dtype=dtype)
    key, value = (torch.zeros(tokens, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    blocks = case.num_seqs * case.table_blocks
    k_cache, v_cache = (torch.zeros(blocks, page, kv_heads, head_dim, dtype=case.kv_dtype) for _ in range(2))
    scales = (torch.ones(1), torch.ones(1)) if case.kv_dtype != dtype else (None, None)
    cos = sin = torch.zeros(case.table_blocks * page, head_dim // 2)
    tables = torch.arange(blocks, dtype=torch.int32).view(case.num_seqs, case.table_blocks)
    seq_lens = torch.full((case.num_seqs,), case.context, dtype=torch.int32)
    cu = torch.arange(case.num_seqs + 1, dtype=torch.int32) * case.new_tokens
    positions = torch.arange(tokens) % case.new_tokens + case.context - case.new_tokens
    slots = torch.arange(tokens)
    window, cap = (case.context // 2, 30.0) if case.window_cap else (None, None)
    triton_attention._sm_count = lambda device: case.sm_count
    triton_attention.rotary_paged_attention(
        positions, q, key, value, cos, sin, k_cache, v_cache, slots, tables, seq_lens, cu, head_dim**-0.5,
        decode_only=case.new_tokens == 1, k_scale=scales[0], v_scale=scales[1], sliding_window=window,
        soft_cap=cap,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GemvCase:
    """A projection of M rows over an [N, K] weight, FP8 (with its scales: `weight_only_linear`,
    which takes the GEMV up to 2 rows and the tiled kernel above) or bf16 (`gemv`), with the
    fusions a llama-8b decode layer takes at one row."""

    m: int
    n: int
    k: int
    fp8: bool = True
    silu_and_mul: bool = False
    norm: bool = False


def _projection(case: GemvCase) -> None:
    x = torch.zeros(case.m, case.k, dtype=torch.bfloat16)
    weight = torch.zeros(case.n, case.k, dtype=gemv.FP8_DTYPE if case.fp8 else torch.bfloat16)
    scale = torch.ones(case.n) if case.fp8 else None
    norm = None
    if case.norm:
        norm = gemv.GemvNorm(
            torch.ones(case.k, dtype=x.dtype), 1e-5, torch.zeros_like(x), torch.zeros_like(x)
        )
    if case.fp8 and not (case.norm or case.silu_and_mul):
        gemv.weight_only_linear(x, weight, scale, None, x.dtype)
    else:
        gemv.gemv(x, weight, scale, None, x.dtype, silu_and_mul=case.silu_and_mul, norm=norm)


def _layers(rows: int) -> None:
    """The layer kernels around them (llama-8b widths): the norm with its residual, rotary, SiLU
    and the greedy sampler's argmax."""
    x = torch.zeros(rows, 4096, dtype=torch.bfloat16)
    triton_layers.rms_norm(x, torch.ones(4096, dtype=x.dtype), 1e-5, residual=torch.zeros_like(x))
    q, k = torch.zeros(rows, 32, 128, dtype=x.dtype), torch.zeros(rows, 8, 128, dtype=x.dtype)
    triton_layers.rotary_embedding(torch.zeros(rows, dtype=torch.int64), q, k, *torch.zeros(2, 8192, 64))
    triton_layers.silu_and_mul(torch.zeros(rows, 28672, dtype=x.dtype))
    triton_layers.argmax(torch.zeros(rows, 128256))


def _cases() -> dict[str, Callable[[], None]]:
    attention = {name: functools.partial(_attention, case) for name, case in ATTENTION.items()}
    projections = {name: functools.partial(_projection, case) for name, case in PROJECTIONS.items()}
    return attention | projections | {"norm, rotary, SiLU and argmax, 8 rows": functools.partial(_layers, 8)}


ATTENTION = {
    "decode, one request": AttentionCase(1, 640),
    "decode, one tile a split": AttentionCase(2, 200, table_blocks=16),
    "decode, unsplit": AttentionCase(64, 4000, table_blocks=256),
    "decode, window and soft-cap, head_dim 256": AttentionCase(4, 900, heads=(16, 8, 256), window_cap=True),
    "decode over an FP8 cache": AttentionCase(8, 640, kv_dtype=torch.float8_e4m3fn),
    "mixed: chunked prefill": AttentionCase(2, 700, new_tokens=300),
    "mixed: speculative verification": AttentionCase(8, 640, new_tokens=5),
}
PROJECTIONS = {
    "FP8 GEMV, one row: norm and qkv": GemvCase(1, 6144, 4096, norm=True),
    "FP8 GEMV, one row: gate_up and SiLU": GemvCase(1, 28672, 4096, silu_and_mul=True),
    "FP8 GEMV, one row: down": GemvCase(1, 4096, 14336),
    "FP8 GEMV, 2 rows: o": GemvCase(2, 4096, 4096),
    "FP8 tiled, 8 rows: o": GemvCase(8, 4096, 4096),
    "FP8 tiled, 32 rows: gate_up": GemvCase(32, 28672, 4096),
    "bf16 GEMV, one row: norm and qkv": GemvCase(1, 6144, 4096, fp8=False, norm=True),
    "bf16 GEMV, one row: gate_up and SiLU": GemvCase(1, 28672, 4096, fp8=False, silu_and_mul=True),
}


def main() -> None:
    cases = _cases()
    with compile_only() as compiled:
        for name, launch in cases.items():
            first = len(compiled)
            launch()
            for variant in compiled[first:]:
                print(json.dumps({"case": name} | dataclasses.asdict(variant), default=str), flush=True)
    print(json.dumps({"cases": list(cases)}))


if __name__ == "__main__":
    main()
