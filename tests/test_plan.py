"""`pagedserve plan`: the seed's arithmetic, the executor's own block count on the CPU, the CUDA
estimate against what an H200 measured, the warnings, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import plan
from pagedserve.executor.config import ExecutorConfig
from pagedserve.executor.runner import ModelRunner
from pagedserve.model_shapes import SHAPES

GIB = 1 << 30

# The seed's example: Llama-2-7B (32 layers, hidden 4096, 32 heads of 128, fp16, 4,096 positions).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def run_plan(argv: list[str], capsys) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def write_config(path: Path, **changes) -> Path:
    path.write_text(json.dumps({**LLAMA2_7B, **changes}))
    return path


@pytest.fixture
def llama2(tmp_path) -> Path:
    return write_config(tmp_path / "llama-2-7b.json")


def test_the_seeds_example_2_gib_per_user_64_for_32_and_a_quarter_with_gqa(llama2, tmp_path, capsys):
    base = ["--model", str(llama2), "--dtype", "float16", "--gpu-memory", "80", "--context-len", "4096"]
    one = run_plan([*base, "--concurrency", "1"], capsys)
    assert one["kv_bytes_per_token"] == 2 * 32 * 4096 * 2  # 2 x layers x hidden x fp16 bytes
    assert one["traffic_kv_bytes"] == 2 * GIB
    assert one["num_parameters"] == 6_738_415_616  # Llama-2-7B
    assert one["weight_bytes"] == one["num_parameters"] * 2
    assert one["mha"] is None  # MHA already
    many = run_plan([*base, "--concurrency", "32"], capsys)
    assert many["traffic_kv_bytes"] == 64 * GIB
    assert any("expect pre-emptions" in w and "--max-num-seqs" in w for w in many["warnings"])

    gqa = write_config(tmp_path / "gqa.json", num_key_value_heads=8)
    gqa_one = run_plan(["--model", str(gqa), *base[2:], "--concurrency", "1"], capsys)
    gqa_many = run_plan(["--model", str(gqa), *base[2:], "--concurrency", "32"], capsys)
    assert gqa_one["traffic_kv_bytes"] == one["traffic_kv_bytes"] // 4
    assert gqa_many["traffic_kv_bytes"] == 16 * GIB
    assert gqa_one["mha_kv_bytes_per_token"] == one["kv_bytes_per_token"]  # the seed's comparison
    assert gqa_one["paged"]["sequences"] // 4 == gqa_one["mha"]["sequences"]  # the same memory


def test_contiguous_reservations_fit_fewer_short_sequences(llama2, capsys):
    report = run_plan(
        ["--model", str(llama2), "--dtype", "float16", "--gpu-memory", "80", "--context-len", "512"], capsys
    )
    # A max_model_len (4,096) reservation per sequence vs 512 tokens' blocks: 8x fewer.
    assert report["contiguous"]["bytes_per_sequence"] == 8 * report["paged"]["bytes_per_sequence"]
    assert report["contiguous"]["sequences"] == report["paged"]["sequences"] // 8


@pytest.mark.parametrize(
    "flags",
    [
        ["--cpu-kv-cache-space", "0.0005"],  # the space decides
        [
            "--max-num-seqs",
            "3",
            "--max-model-len",
            "200",
            "--block-size",
            "32",
        ],  # max_num_seqs x max_model_len
        ["--num-gpu-blocks-override", "77", "--swap-space", "0.001"],
    ],
)
def test_the_cpu_block_count_is_the_executors(tiny_model_dir, flags, capsys):
    report = run_plan(["--model", str(tiny_model_dir), "--device", "cpu", *flags], capsys)
    parser = plan.build_parser()
    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", *flags])
    runner = ModelRunner.create(ExecutorConfig.from_args(args, model=str(tiny_model_dir)))
    assert report["num_gpu_blocks"] == runner.kv_cache.num_device_blocks
    assert report["num_cpu_blocks"] == runner.kv_cache.num_cpu_blocks
    assert report["kv_bytes_per_block"] == runner.kv_cache.layout.bytes_per_block
    assert report["weight_bytes"] == sum(p.numel() * p.element_size() for p in runner.model.parameters())


def test_a_sliding_window_model_plans_its_windowed_sequences(tiny_model_dir, tmp_path, capsys):
    """A Mistral with a window of 64: the CPU cap counts each sequence's windowed blocks (its
    sliding group keeps only what the window reaches), as the executor's does."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    model = tmp_path / "mistral"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(json.dumps(config))
    flags = ["--device", "cpu", "--max-num-seqs", "5"]
    report = run_plan(["--model", str(model), *flags], capsys)
    runner = ModelRunner.create(ExecutorConfig(model=str(model), device="cpu", max_num_seqs=5))
    assert report["kv_groups"][0]["sliding_window"] == 64
    assert report["max_model_len"] == runner.max_model_len > 64  # the window no longer caps it
    assert report["num_gpu_blocks"] == runner.kv_cache.num_device_blocks


def test_the_cuda_estimate_reproduces_what_an_h200_measured(tmp_path, capsys):
    """llama-8b shape, bf16, 8,192 batched tokens: benchmarks/results/2026-11-29-h200*/ logged
    peaks of 16.213 GiB (256 sequences, max_model_len 2048), 16.216 (8192) and 17.439 (512, 2048),
    CUDA-graph reserves of 2.411 and 2.909 GiB, and 54,539 blocks at 0.90 of 139.8 GiB."""
    model = tmp_path / "llama-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPES["llama-8b"].hf_config(1, 2)))
    base = ["--model", str(model), "--gpu-memory", "139.8", "--dtype", "bfloat16"]
    for seqs, max_len, peak, graphs in (
        (256, 2048, 16.213, 2.411),
        (256, 8192, 16.216, 2.411),
        (512, 2048, 17.439, 2.909),
    ):
        report = run_plan([*base, "--max-num-seqs", str(seqs), "--max-model-len", str(max_len)], capsys)
        estimate = report["memory_estimate"]
        assert estimate["peak_bytes"] / GIB == pytest.approx(peak, abs=0.005)
        assert estimate["graph_reserve_bytes"] / GIB == pytest.approx(graphs, abs=0.005)
        assert estimate["non_torch_bytes"] / GIB == pytest.approx(0.671, abs=0.001)
    report = run_plan([*base, "--max-model-len", "8192"], capsys)
    assert report["num_gpu_blocks"] == pytest.approx(54_539, rel=0.001)
    assert report["weight_bytes"] / GIB == pytest.approx(14.958, abs=0.001)
    # FP8 weights, eager, 512 sequences at 0.85 (2026-12-01-h200-s5): a peak of 10.945 GiB, 54,894 blocks.
    eager = [*base, "--max-num-seqs", "512", "--max-model-len", "2048", "--enforce-eager"]
    report = run_plan([*eager, "--quantization", "fp8", "--gpu-memory-utilization", "0.85"], capsys)
    assert report["memory_estimate"]["peak_bytes"] / GIB == pytest.approx(10.945, abs=0.005)
    assert report["memory_estimate"]["graph_reserve_bytes"] == 0
    assert report["num_gpu_blocks"] == pytest.approx(54_894, rel=0.001)


def test_the_seeds_warnings(llama2, tmp_path, capsys):
    base = ["--model", str(llama2), "--dtype", "float16", "--gpu-memory", "80"]
    high = run_plan([*base, "--gpu-memory-utilization", "0.95"], capsys)
    assert any("above 0.85-0.92" in w for w in high["warnings"])
    low = run_plan([*base, "--gpu-memory-utilization", "0.5"], capsys)
    assert any("below 0.85-0.92" in w for w in low["warnings"])
    assert not any("0.85-0.92" in w for w in run_plan(base, capsys)["warnings"])
    tight = run_plan([*base, "--gpu-memory", "16"], capsys)  # weights leave no room for one sequence
    assert any("cannot hold one sequence of max_model_len=4096" in w for w in tight["warnings"])
    text_lines = []
    assert plan.main(base + ["--concurrency", "64", "--context-len", "4096"]) == 0
    text_lines = capsys.readouterr().out.splitlines()
    assert text_lines[0] == "== pagedserve plan =="
    assert any(line.startswith("warning: 64 sequences of 4,096 tokens") for line in text_lines)


def test_a_request_log_gives_the_traffic_shape_and_its_prefix_sharing(llama2, tmp_path, capsys):
    from tests.test_request_log import record

    unique = tmp_path / "unique.jsonl"
    lines = [record(i, 1000.0 + i, 600, 200, [f"{i}-{b}" for b in range(37)]).to_json() for i in range(20)]
    unique.write_text("\n".join(lines))
    report = run_plan(
        ["--model", str(llama2), "--dtype", "float16", "--gpu-memory", "80", "--traffic", str(unique)], capsys
    )
    assert report["context_len"] == 800 and report["concurrency"] == 1  # each ends before the next arrives
    assert report["traffic"]["block_reuse"] == 0.0
    assert any("prefix caching only pays when prefixes repeat" in w for w in report["warnings"])

    shared = tmp_path / "shared.jsonl"
    chain = [f"p-{b}" for b in range(37)]
    shared.write_text("".join(record(i, 1000.0, 600, 200, chain).to_json() + "\n" for i in range(20)))
    report = run_plan(
        ["--model", str(llama2), "--dtype", "float16", "--gpu-memory", "80", "--traffic", str(shared)], capsys
    )
    assert report["concurrency"] == 20
    assert report["traffic"]["block_reuse"] == pytest.approx(19 / 20)
    assert not any("prefix caching" in w for w in report["warnings"])


def _error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert sum(line.startswith("pagedserve plan: error:") for line in err.splitlines()) == 1
    return err


def test_bad_input_is_one_error_line(llama2, tmp_path, capsys):
    base = ["--model", str(llama2), "--gpu-memory", "80"]
    assert "--block-size must be a positive multiple of 16" in _error([*base, "--block-size", "17"], capsys)
    assert "no such directory" in _error(["--model", str(tmp_path / "nowhere")], capsys)
    assert "--concurrency must be a positive integer" in _error([*base, "--concurrency", "0"], capsys)
    assert "--gpu-memory must be a positive" in _error([*base[:2], "--gpu-memory", "-1"], capsys)
    bad_log = tmp_path / "bad.jsonl"
    bad_log.write_text('{"v": 1, "prompt_len": 3}\n')
    assert f"{bad_log}:1: missing" in _error([*base, "--traffic", str(bad_log)], capsys)
    too_long = _error([*base, "--max-model-len", "9000"], capsys)
    assert "max_model_len=9000 exceeds" in too_long
    not_llama = write_config(tmp_path / "gpt2.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    assert "is not supported" in _error(["--model", str(not_llama), "--gpu-memory", "80"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: its memory is the default")
def test_without_a_gpu_the_gpu_memory_must_be_given(llama2, capsys):
    err = _error(["--model", str(llama2)], capsys)
    assert "no GPU is visible" in err and "--gpu-memory" in err and "--device cpu" in err


def test_measure_loads_the_executor_and_reports_its_pool(tiny_model_dir, capsys):
    """On the CPU the measured pool is the plan's exactly (on CUDA, scripts/plan_check.py prints
    both at three utilizations)."""
    report = run_plan(
        ["--model", str(tiny_model_dir), "--device", "cpu", "--max-num-seqs", "7", "--measure"], capsys
    )
    assert report["measured"]["num_gpu_blocks"] == report["num_gpu_blocks"]
    assert report["measured"]["error"] == 0.0
