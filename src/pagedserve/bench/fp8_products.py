"""Experiment: FP8-KV decode with FP8 tensor-core products instead of widened K/V (on a GPU).

    python -m pagedserve.bench.fp8_products [--result-file F]

Why: the shipped FP8-KV decode kernel widens every e4m3 byte to float16 for its float16 products,
and that widening, not the bytes, holds it at ~0.65x of bf16's bytes/s (README, FP8: the floors).
Triton lowers a decode program's e4m3 product (4 query heads per KV head, padded to 16 rows) to
float16 MMA after widening both operands; padded to **64 rows** it becomes Hopper's wgmma on e4m3
operands straight from shared memory (`QGMMA.64xNx32.F32.E4M3.E4M3`, compiled offline for sm_90):
no widening at all, at the price of 16x the rows of (cheap) products and softmax, q quantized to
e4m3 once per program and p to e4m3 per tile, as FlashAttention-3's FP8 path does.

`fp8_products_decode_kernel` is that loop, alone: whole 64-key tiles, one program per (sequence,
KV head, split), partial results merged by torch (included in the timing). V is read either from
the pool's layout ([blocks, block_size, kv_heads, head_dim]: Triton transposes it through shared
memory) or from a key-major copy ([blocks, kv_heads, head_dim, block_size]: the product's operand
as stored). On the K1 decode shapes it prints, against the shipped bf16 and FP8 kernels in the same
process: time, bytes/s ratio to bf16, and the error of each FP8 kernel against the bf16 kernel over
the dequantized caches (the FP8 products add q and p rounding on top of the cache's).
Not wired into the executor: a measurement to decide whether it should be.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from pagedserve.bench.fp8 import (
    K1_SHAPES,
    _attention,
    _ms,
    _spin_up,
    _sweep_case,
)
from pagedserve.bench.kernels import whole_tile_splits
from pagedserve.kernels import triton_attention as ta

ROWS = 64  # wgmma's rows per warpgroup: the GROUP query heads of a program, padded
BLOCK_N = 64
PROGRAMS_PER_SM = 3  # 166 registers a thread (ptxas, sm_90): three 4-warp programs per SM
P_SCALE = 448.0  # p in [0, 1] is stored as p * 448 in e4m3 (down to ~4e-6 instead of 2e-3)


@triton.jit
def fp8_products_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, acc_ptr, m_ptr, l_ptr, qk_scale, keys_per_split,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_vd, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr, P_SCALE: tl.constexpr, V_KEY_MAJOR: tl.constexpr,
):  # fmt: skip
    """One (sequence, KV head, split): keys split * keys_per_split .. + keys_per_split, whole tiles.
    Stores the unnormalised accumulator (in units of v / P_SCALE), the running max (log2 domain)
    and the denominator of its GROUP query heads for the merge. qk_scale = softmax scale * log2(e)
    * k_scale; q's own scale is applied here."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    q_heads = kv_head * GROUP + rows
    valid = rows < GROUP
    q = tl.load(q_ptr + (seq * tl.num_programs(1) * GROUP + q_heads)[:, None] * HEAD_DIM + d[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)  # fmt: skip
    q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / 448.0, 1e-12)
    q8 = (q / q_scale).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    scale = qk_scale * q_scale
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    first = split * keys_per_split
    for k0 in range(first, first + keys_per_split, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + kpos // PAGE_SIZE).to(tl.int64)
        in_page = kpos % PAGE_SIZE
        k = tl.load(
            k_ptr + (block_ids * stride_kb + in_page * stride_kt + kv_head * stride_kh)[:, None] + d[None, :]
        )
        scores = tl.dot(q8, tl.trans(k))
        m_new = tl.maximum(m_i, tl.max(scores, 1) * scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores * scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_base = block_ids * stride_vb + in_page * stride_vt + kv_head * stride_vh
        p8 = (p * P_SCALE).to(tl.float8e4nv, fp_downcast_rounding="rtne")
        if V_KEY_MAJOR:  # the tile as [head_dim, keys], keys contiguous in runs of PAGE_SIZE
            v_t = tl.load(v_ptr + v_base[None, :] + d[:, None] * stride_vd)
            acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(v_t))
        else:
            v = tl.load(v_ptr + v_base[:, None] + d[None, :] * stride_vd)
            acc = acc * alpha[:, None] + tl.dot(p8, v)
        m_i = m_new
    part = (seq * tl.num_programs(1) * GROUP + q_heads) * tl.num_programs(2) + split
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=valid[:, None])
    tl.store(m_ptr + part, m_i, mask=valid)
    tl.store(l_ptr + part, l_i, mask=valid)


def key_major(v: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, kv_heads, head_dim] -> the same values stored [blocks, kv_heads,
    head_dim, block_size], returned as a view with the original shape (strides say where)."""
    return v.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


def fp8_products_attention(
    q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, tables: torch.Tensor, context: int,
    k_scale: float, v_scale: float, splits: int, v_key_major: bool,
) -> torch.Tensor:  # fmt: skip
    """Decode attention of q [batch, q_heads, head_dim] over `context` keys of every sequence
    (a multiple of BLOCK_N) in the FP8 caches, through the kernel and a torch merge of its splits."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k8.shape[2]
    parts = batch * q_heads * splits
    acc = torch.empty(parts, head_dim, dtype=torch.float32, device=q.device)
    maxima, denominators = (torch.empty(parts, dtype=torch.float32, device=q.device) for _ in "ml")
    fp8_products_decode_kernel[(batch, k8.shape[2], splits)](
        q, k8, v8, tables, acc, maxima, denominators, head_dim**-0.5 * ta._LOG2E * k_scale, context // splits,
        k8.stride(0), k8.stride(1), k8.stride(2), v8.stride(0), v8.stride(1), v8.stride(2), v8.stride(3),
        tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, PAGE_SIZE=k8.shape[1], ROWS=ROWS, P_SCALE=P_SCALE,
        V_KEY_MAJOR=v_key_major, num_warps=4, num_stages=2,
    )  # fmt: skip
    maxima, denominators = maxima.view(-1, splits), denominators.view(-1, splits)
    weight = torch.exp2(maxima - maxima.amax(1, keepdim=True))
    out = (acc.view(-1, splits, head_dim) * weight[..., None]).sum(1)
    out = out / (denominators * weight).sum(1)[:, None] * (v_scale / P_SCALE)
    return out.view(batch, q_heads, head_dim).to(q.dtype)


def bench(shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(2)
    scale = torch.full((1,), 0.02, device="cuda")
    sm_count = ta._sm_count(torch.device("cuda"))
    _spin_up()
    for batch, context in shapes:
        q, k, v, k8, v8, args, want, fp8_bytes = _sweep_case(batch, context, gen)
        v8_key_major = key_major(v8)
        splits = whole_tile_splits(batch, context, BLOCK_N, PROGRAMS_PER_SM, sm_count)
        row: dict = {"batch": batch, "context": context, "splits": splits}
        bf16_us = 1e3 * _ms(partial(_attention, q, k, v, args))
        row["bf16_us"] = bf16_us
        variants = {
            "fp8_shipped": partial(_attention, q, k8, v8, args, k_scale=scale, v_scale=scale),
            "fp8_products": partial(
                fp8_products_attention, q, k8, v8, args[0], context, 0.02, 0.02, splits, False
            ),
            "fp8_products_v_key_major": partial(
                fp8_products_attention, q, k8, v8_key_major, args[0], context, 0.02, 0.02, splits, True
            ),
        }  # fmt: skip
        for label, run in variants.items():
            err = (run().float() - want.float()).abs()
            us = 1e3 * _ms(run)
            row[label] = dict(
                us=us, bw_ratio=bf16_us / us / 2, max_err=err.max().item(), mean_err=err.mean().item()
            )
        rows.append(row)
        print(
            f"decode ({batch}, {context}) bf16 {bf16_us:.1f} us | "
            + " | ".join(
                f"{label} {row[label]['us']:.1f} us, bw ratio {row[label]['bw_ratio']:.2f}, "
                f"err max {row[label]['max_err']:.2g} mean {row[label]['mean_err']:.2g}"
                for label in variants
            ),
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--result-file", type=Path, default=None)
    args = parser.parse_args(argv)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    shapes = [(b, c) for b, c in K1_SHAPES if c % BLOCK_N == 0 and b >= 8]
    rows = bench(shapes)
    if args.result_file:
        args.result_file.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
