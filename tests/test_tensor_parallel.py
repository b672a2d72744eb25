"""Tensor parallelism without processes: the weight sharding (each rank's shard, loaded through the
real loader, put back together equals the single-device model's weights, FP8 included), the size
checks, serve's GPU placement, and the clear errors for bad values."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.loader import ModelSpec, RopeConfig, load_model_spec, load_weights
from pagedserve.executor.model import CausalLM
from pagedserve.executor.parallel import TensorParallelError, TPShard, check_tensor_parallel
from pagedserve.supervisor import place_executors
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
from tests.services import REPO

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kv1_bias_dir(tmp_path_factory):
    spec = TinyModelSpec(num_key_value_heads=1, attention_bias=True, seed=3)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-kv1"), spec)


def _load(model_dir, size: int = 1, rank: int = 0, quantization: str | None = None) -> CausalLM:
    """The model (size 1) or rank `rank`'s shard, through the real loader."""
    spec = load_model_spec(model_dir)
    if size == 1:
        model = CausalLM(spec, 128, CPU, torch.float32, quantization)
        load_weights(model, spec, model_dir)
        return model
    shard = TPShard(rank, size)
    model = CausalLM(shard.local_spec(spec), 128, CPU, torch.float32, quantization, all_reduce=lambda t: None)
    load_weights(model, spec, model_dir, shard)
    return model


def _split_qkv(t: torch.Tensor, model: CausalLM) -> tuple[torch.Tensor, ...]:
    spec = model.spec
    return t.split([spec.q_size, spec.kv_size, spec.kv_size], dim=0)


@pytest.mark.parametrize("which", ["gqa", "kv1_bias"])
def test_shards_reassemble_to_the_full_weights(which, tiny_model_dir, kv1_bias_dir):
    model_dir = tiny_model_dir if which == "gqa" else kv1_bias_dir
    full = _load(model_dir)
    shards = [_load(model_dir, 2, r) for r in range(2)]
    spec = full.spec
    for i, layer in enumerate(full.layers):
        attn = [s.layers[i].self_attn for s in shards]
        mlp = [s.layers[i].mlp for s in shards]
        # Column-parallel qkv: q split by heads; k/v split by heads, or (1 KV head) the same on both.
        names = ["weight"] + (["bias"] if spec.qkv_bias else [])
        for name in names:
            q, k, v = _split_qkv(getattr(layer.self_attn.qkv_proj, name), full)
            parts = [_split_qkv(getattr(a.qkv_proj, name), s) for a, s in zip(attn, shards, strict=True)]
            assert torch.equal(torch.cat([p[0] for p in parts]), q)
            for j, full_kv in ((1, k), (2, v)):
                if spec.num_kv_heads >= 2:
                    assert torch.equal(torch.cat([p[j] for p in parts]), full_kv)
                else:
                    assert all(torch.equal(p[j], full_kv) for p in parts)  # replicated
        # Row-parallel o_proj: columns split, bias whole on every rank (added once, after the reduce).
        o = layer.self_attn.o_proj
        assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), o.weight)
        if spec.o_bias:
            assert all(torch.equal(a.o_proj.bias, o.bias) for a in attn)
        # gate_up: gate rows and up rows split separately, re-fused per rank; down: columns split.
        inter = spec.intermediate_size
        gate, up = layer.mlp.gate_up_proj.weight.split([inter, inter])
        local = [m.gate_up_proj.weight.split([inter // 2, inter // 2]) for m in mlp]
        assert torch.equal(torch.cat([g for g, _ in local]), gate)
        assert torch.equal(torch.cat([u for _, u in local]), up)
        assert torch.equal(torch.cat([m.down_proj.weight for m in mlp], dim=1), layer.mlp.down_proj.weight)
    for name in ("embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        full_param = dict(full.named_parameters())[name]
        assert all(torch.equal(dict(s.named_parameters())[name], full_param) for s in shards)  # replicated
    if full.lm_head is not None:
        assert all(torch.equal(s.lm_head, full.lm_head) for s in shards)


def test_fp8_shards_keep_their_scales(tiny_model_dir):
    """Quantized at load: column-parallel rows keep the single-device weights and per-row scales
    exactly; row-parallel columns are quantized with per-row scales of their own (the all-reduce
    sums the rescaled partial products), and dequantized they put back the original weight."""
    full = _load(tiny_model_dir, quantization="fp8")
    shards = [_load(tiny_model_dir, 2, r, quantization="fp8") for r in range(2)]
    layer, parts = full.layers[0], [s.layers[0] for s in shards]
    inter = full.spec.intermediate_size
    gate_up = layer.mlp.gate_up_proj
    for half in range(2):  # gate rows, then up rows
        rows = slice(half * inter, (half + 1) * inter)
        local = slice(half * inter // 2, (half + 1) * inter // 2)
        w = torch.cat([p.mlp.gate_up_proj.weight[local].view(torch.uint8) for p in parts])
        scale = torch.cat([p.mlp.gate_up_proj.weight_scale[local] for p in parts])
        assert torch.equal(w, gate_up.weight[rows].view(torch.uint8))
        assert torch.equal(scale, gate_up.weight_scale[rows])

    def dequantized(linear) -> torch.Tensor:
        return linear.weight.float() * linear.weight_scale[:, None]

    # e4m3 keeps 3 mantissa bits: round to nearest is within 1/16 of the value (the tiny weights of
    # this model stay clear of the subnormals at these scales).
    original = _load(tiny_model_dir).layers[0]
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        reassembled = torch.cat([dequantized(p.get_submodule(name)) for p in parts], dim=1)
        torch.testing.assert_close(reassembled, original.get_submodule(name).weight, rtol=1 / 16, atol=1e-5)


def test_kv_heads_follow_the_query_heads():
    spec = spec_like(num_heads=8, num_kv_heads=2)
    # 4 ranks, 2 KV heads: ranks 0, 1 hold KV head 0 (query heads 0-3), ranks 2, 3 KV head 1.
    assert [list(TPShard(r, 4).kv_heads(spec)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(TPShard(r, 4).q_heads(spec)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(TPShard(r, 2).kv_heads(spec)) for r in range(2)] == [[0], [1]]
    local = TPShard(3, 4).local_spec(spec)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (
        2,
        1,
        spec.intermediate_size // 4,
    )


def spec_like(num_heads: int, num_kv_heads: int, intermediate_size: int = 128) -> ModelSpec:
    """A ModelSpec of the given heads (no checkpoint needed for the shard arithmetic)."""
    return ModelSpec(
        name="t", architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
        intermediate_size=intermediate_size, num_layers=1, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=8, rms_norm_eps=1e-5, rope=RopeConfig(theta=1e4),
        max_position_embeddings=128, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
        sliding_window=None, layer_types=("full_attention",), eos_token_ids=(2,),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "size", "message"),
    [
        (4, 2, 128, 3, "num_attention_heads 4 is not divisible by it"),
        (8, 3, 128, 2, "num_key_value_heads 3 neither divides it"),
        (4, 4, 130, 4, "intermediate_size 130 is not divisible by it"),
        (4, 2, 128, 0, "must be at least 1"),
    ],
)
def test_sizes_that_do_not_fit_the_model_are_refused(heads, kv, inter, size, message):
    with pytest.raises(TensorParallelError, match=message):
        check_tensor_parallel(spec_like(heads, kv, inter), size)


def test_bad_tensor_parallel_flags_fail_at_start(tiny_model_dir):
    """One argparse line, exit status 2, before any process or model load."""
    for value, message in (("3", "num_attention_heads 4 is not divisible by it"), ("0", "at least 1")):
        cmd = [sys.executable, "-m", "pagedserve.executor", f"--model={tiny_model_dir}", "--device=cpu",
               "-tp", value]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


def test_more_ranks_than_gpus_is_refused(tiny_model_dir, monkeypatch):
    from pagedserve.executor import tp_workers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = ExecutorConfig(model=str(tiny_model_dir), device="cuda", tensor_parallel_size=2)
    with pytest.raises(TensorParallelError, match="needs GPUs 0..1, but 1 are visible"):
        tp_workers.check_config(config)


def test_serve_places_each_tensor_parallel_group_on_its_own_gpus():
    placements = place_executors(
        2,
        base_port=100,
        gpu_memory_utilization=0.9,
        num_gpus=4,
        visible_devices="4,5,6,7",
        tensor_parallel_size=2,
    )
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["4,5", "6,7"]
    assert [p.port for p in placements] == [100, 101]
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 are visible"):
        place_executors(3, base_port=100, gpu_memory_utilization=0.9, num_gpus=4, tensor_parallel_size=2)
    cpu = place_executors(
        1, base_port=100, gpu_memory_utilization=0.9, num_gpus=0, num_cpus=4, tensor_parallel_size=2
    )
    assert cpu[0].env.get("OMP_NUM_THREADS", "2") == "2"  # unless the environment sets it


def test_llm_refuses_tensor_parallelism(tiny_model_dir):
    from pagedserve import LLM

    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2"):
        LLM(str(tiny_model_dir), device="cpu", tensor_parallel_size=2)


def test_serve_forwards_tensor_parallelism_to_each_executor(tiny_model_dir, monkeypatch, capsys):
    """`serve -tp 2` starts each executor with --tensor-parallel-size 2 (on the GPUs of its group),
    and refuses, as a usage error, a group larger than the visible GPUs."""
    import argparse

    from pagedserve import cli, supervisor

    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    args = parser.parse_args(["--device", "cpu", "-tp", "2", "--data-parallel-size", "2"])
    executors = [c for c in cli.serve_children(args, tiny_model_dir) if c.name.startswith("executor")]
    assert len(executors) == 2
    for child in executors:
        argv = list(child.argv)
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    monkeypatch.setattr(supervisor, "visible_gpu_count", lambda device: 2)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", str(tiny_model_dir), "-tp", "2", "--data-parallel-size", "2"])
    assert exit_info.value.code == 2
    assert (
        "--data-parallel-size 2 x --tensor-parallel-size 2 needs 4 GPUs, 2 are visible"
        in capsys.readouterr().err
    )
