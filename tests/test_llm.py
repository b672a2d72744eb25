"""The offline API (`from pagedserve import LLM, SamplingParams`) on the CPU with the tiny model:
vLLM's shapes, greedy tokens equal to Hugging Face's, validation, chat, and the seed's example."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pagedserve import LLM, SamplingParams
from tests.services import REPO, hf_greedy

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
# The seed's offline example, as a user writes it (the model left to LLM's default here).
SEED_EXAMPLE = """
from pagedserve import LLM, SamplingParams
prompts = ["Hello, my name is", "The capital of France is"]
llm = LLM(gpu_memory_utilization=0.90, enable_prefix_caching=True, max_num_seqs=256)
outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256))
for o in outputs: print(o.prompt, o.outputs[0].text)
"""


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir), device="cpu", dtype="float32", num_gpu_blocks_override=256, swap_space=0.01
    )
    yield llm
    llm.shutdown()


def test_generate_matches_hf_in_input_order_with_vllm_shapes(llm, hf_model):
    """Strings and token-id dicts, one SamplingParams per prompt; outputs come back in input order
    with vLLM's fields, greedy tokens equal HF generate's, and the text is their decoding."""
    tok = llm.get_tokenizer()
    prompts = ["The scheduler decides", {"prompt_token_ids": [7, 8, 9, 10, 11]}, "Paged attention"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 9, 3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 9, 3]
    assert len({o.request_id for o in outputs}) == 3
    for prompt, params_i, out in zip(prompts, params, outputs, strict=True):
        expected_ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else tok.encode(prompt)
        assert out.prompt == (None if isinstance(prompt, dict) else prompt)
        assert out.prompt_token_ids == expected_ids
        assert out.finished
        completion = out.outputs[0]
        assert completion.finish_reason == "length"
        assert completion.token_ids == hf_greedy(hf_model, expected_ids, params_i.max_tokens)
        assert completion.text == tok.decode(completion.token_ids, skip_special_tokens=True)
        assert completion.logprobs is None


def test_generate_single_prompt_stop_logprobs_and_reuse(llm):
    """One string and the default SamplingParams (16 tokens); a stop token id ends a completion
    with "stop"; logprobs=1 gives one per token; the same LLM serves call after call."""
    [out] = llm.generate("The quick brown fox", use_tqdm=False)
    assert 1 <= len(out.outputs[0].token_ids) <= 16
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.generate("The quick brown fox", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[ids[3]], logprobs=1
    )
    [stopped] = llm.generate("The quick brown fox", stop_at, use_tqdm=True)
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids == ids[: ids.index(ids[3]) + 1]
    assert len(completion.logprobs) == len(completion.token_ids)
    pairs = list(zip(completion.logprobs, completion.token_ids, strict=True))
    assert all(list(lp) == [t] and lp[t].logprob <= 0 for lp, t in pairs)
    assert completion.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in pairs))
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a, b = llm.generate(["Numbers: 1 2 3", "Numbers: 1 2 3"], seeded, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.generate([], use_tqdm=False) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 2}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": 5}, "logprobs"),
    ],
)
def test_sampling_params_refuses_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_vllm_conventions():
    assert SamplingParams().max_tokens == 16
    assert SamplingParams(top_k=-1).to_request([1]).sampling.top_k == 0  # vLLM's -1 = off
    assert SamplingParams(stop="\n").stop_strings == ("\n",)


def test_bad_prompts_raise_value_error_and_nothing_runs(llm):
    """Every prompt is checked before any is submitted; the LLM serves afterwards."""
    ok = SamplingParams(max_tokens=2)
    cases = [
        ([{"prompt_token_ids": []}], ok, "prompt 0: prompt: must not be empty"),
        ([""], ok, "prompt 0: prompt: must not be empty"),  # issue 35: once served from BOS alone
        (["fine", {"prompt_token_ids": [1, 100_000]}], ok, "prompt 1.*vocabulary"),
        (
            ["fine", {"prompt_token_ids": [5] * 1020}],
            SamplingParams(max_tokens=10),
            "prompt 1.*max_model_len",
        ),
        ([42], ok, "prompt 0: prompt: must be a non-empty string"),
        (["a", "b"], [ok], "sampling_params: 1 given for 2 prompts"),
        (["a"], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ]
    for prompts, params, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, params, use_tqdm=False)
    assert llm.generate("still serving", ok, use_tqdm=False)[0].finished
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM("unused", no_such_flag=1)


def test_chat_applies_the_template_and_refuses_without_one(llm):
    conversation = [{"role": "user", "content": "What is a block table?"}]
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [out] = llm.chat(conversation, greedy, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert out.prompt == "<s>user: What is a block table?\n<s>assistant:"
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    two = llm.chat([conversation, conversation], greedy, use_tqdm=False, chat_template=CHAT_TEMPLATE)
    assert len(two) == 2
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(conversation, greedy, use_tqdm=False)


def test_seed_example_runs_unchanged_on_the_default_model():
    """The README's offline example, in a fresh process, on the built-in model (the default);
    importing the scheduler alone does not load the top layer."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lazy = (
        "import sys, pagedserve, pagedserve.scheduler.service\n"
        "assert 'pagedserve.entrypoints' not in sys.modules and 'tqdm' not in sys.modules\n"
    )
    built_in = (
        "from pagedserve.common.default_model import DEFAULT_MODEL_DIR\n"
        "assert llm.executor_config.model == str(DEFAULT_MODEL_DIR), llm.executor_config.model\n"
    )
    script = lazy + textwrap.dedent(SEED_EXAMPLE) + built_in
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Hello, my name is")
    assert any(line.startswith("The capital of France is") for line in lines)
