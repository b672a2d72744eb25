"""A decode step's Triton launches (attention, GEMVs, layer kernels) compile for Hopper (sm_90)
with PDL on any machine: `hopper_compile.py` runs the launch wrappers against an sm_90 target and
compiles each variant they choose down to the cubin, which the interpreter-run tests never do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("hopper_compile.py")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[list[dict], list[str]]:
    """(every kernel variant compiled, the case names) of one run of the script."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))  # compile, not reuse
    done = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    *variants, cases = [json.loads(line) for line in done.stdout.splitlines()]
    return variants, cases["cases"]


@pytest.fixture(scope="module")
def variants(compiled) -> list[dict]:
    return compiled[0]


def _decode(variants: list[dict], case: str) -> dict:
    (found,) = [v["constexprs"] for v in variants if v["case"] == case and v["kernel"] == "decode_kernel"]
    return found


def test_every_case_compiles_with_pdl_and_no_spills(compiled):
    variants, cases = compiled
    assert {v["case"] for v in variants} == set(cases)
    assert all(v["constexprs"].get("USE_PDL", True) for v in variants)
    spilled = [(v["case"], v["kernel"]) for v in variants if v["local_bytes"]]
    assert not spilled, f"registers spilled to local memory: {spilled}"


def test_decode_steps_compile_the_rotating_launch_in_each_split_mode(variants):
    one_request = _decode(variants, "decode, one request")
    assert one_request["ROTARY"] and one_request["FIT_SPLITS"]
    assert _decode(variants, "decode, one tile a split")["SINGLE_TILE"]
    assert not _decode(variants, "decode, unsplit")["SPLIT"]
    gemma = _decode(variants, "decode, window and soft-cap, head_dim 256")
    assert gemma["ROTARY"] and gemma["WINDOW"] and gemma["SOFT_CAP"]
    assert not _decode(variants, "decode over an FP8 cache")["ROTARY"]


def test_mixed_steps_rotate_apart_and_take_the_varlen_kernel(variants):
    for case in ("mixed: chunked prefill", "mixed: speculative verification"):
        kernels = {v["kernel"] for v in variants if v["case"] == case}
        assert {"rotary_write_kv_kernel", "varlen_kernel"} <= kernels


def test_decode_projections_compile_with_their_fusions(variants):
    def kernels(case: str) -> list[tuple[str, dict]]:
        return [(v["kernel"], v["constexprs"]) for v in variants if v["case"] == case]

    for weights in ("FP8", "bf16"):
        ((kernel, meta),) = kernels(f"{weights} GEMV, one row: norm and qkv")
        assert kernel == "_gemv_kernel" and meta["NORM"]
        ((kernel, meta),) = kernels(f"{weights} GEMV, one row: gate_up and SiLU")
        assert kernel == "_gemv_kernel" and meta["GLU"]
    assert kernels("FP8 GEMV, 2 rows: o")[0][0] == "_gemv_kernel"
    assert kernels("FP8 tiled, 8 rows: o")[0][0] == "_weight_only_kernel"


def test_layer_kernels_compile(variants):
    kernels = {v["kernel"] for v in variants if v["case"].startswith("norm, rotary")}
    assert {"_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_argmax_chunk_kernel"} <= kernels
