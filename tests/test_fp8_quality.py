"""The FP8 quality tool (`python -m benchmarks.fp8_quality`): its comparisons, and one CPU run
of all four variants on the tiny model through the FP8 references (PAGEDSERVE_FP8_REFERENCE=1)."""

from __future__ import annotations

import json

import pytest

from benchmarks import fp8_quality


def test_agreement_counts_tokens_up_to_the_first_divergence():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    outputs = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    agree = fp8_quality.agreement(outputs, reference)
    assert (agree.identical_sequences, agree.sequences) == (1, 3)
    assert agree.tokens_before_divergence == 4 + 2 + 0  # the 8 after the divergence does not count
    assert agree.token_agreement == pytest.approx(6 / 12)
    assert agree.mean_first_divergence == pytest.approx(2.0)
    assert fp8_quality.agreement([[1, 2]], [[1, 2, 3]]).identical_sequences == 0  # shorter: not identical


def test_greedy_prompts_are_whole_lines_file_openings_first():
    texts = ["import os\nimport sys\nx = 1\n", "def f():\n    return 2\n"]
    prompts = fp8_quality.greedy_prompts(texts, 4, 16)
    assert prompts == ["import os\n", "def f():\n", "import sys\n", "    return 2\n"]
    with pytest.raises(ValueError, match="only"):
        fp8_quality.greedy_prompts(texts, 50, 16)


def test_cpu_run_of_all_variants(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FP8_REFERENCE", "1")
    result_file = tmp_path / "quality.json"
    args = f"--model {tiny_model_dir} --device cpu --dtype float32 --held-out-bytes 2000 --window 48 "
    args += f"--prompts 2 --prompt-chars 50 --max-tokens 3 --num-gpu-blocks 64 --result-file {result_file}"
    assert fp8_quality.main(args.split()) == 0
    result = json.loads(result_file.read_text())
    rows = result["variants"]
    assert list(rows) == list(fp8_quality.VARIANTS)
    assert rows["bf16"]["bpb_rel_diff_vs_bf16"] == 0 and rows["bf16"]["identical_sequences"] == 2
    for row in rows.values():
        assert row["bits_per_byte"] > 0 and row["tokens"] > 0
        assert abs(row["bpb_rel_diff_vs_bf16"]) < 0.05  # FP8 moves a tiny random model's loss a little
        assert 0 <= row["token_agreement_before_divergence"] <= 1
