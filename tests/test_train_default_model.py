"""`python -m scripts.train_default_model --device cpu --quick`: the training script end to end on
a tiny model, writing a directory that both transformers and pagedserve's loader read."""

from __future__ import annotations

import json
from pathlib import Path

from pagedserve.bench import corpus
from scripts import train_default_model as train


def test_held_out_split_is_by_file_and_machine_independent():
    """The split depends only on (root, relative path): the same file is held out on any machine."""
    a = corpus.SourceFile("stdlib", "json/decoder.py", Path("/usr/lib/python3.12/json/decoder.py"))
    b = corpus.SourceFile("stdlib", "json/decoder.py", Path("/opt/python3.11/lib/json/decoder.py"))
    assert a.held_out == b.held_out
    assert a.order_key == b.order_key
    files = [corpus.SourceFile("stdlib", f"m{i}.py", Path(f"/x/m{i}.py")) for i in range(4000)]
    share = sum(f.held_out for f in files) / len(files)
    assert abs(share - corpus.HELD_OUT_PER_MILLE / 1000) < 0.01


def test_quick_cpu_run_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve.executor.loader import load_model_spec

    out = tmp_path / "model"
    assert train.main(["--device", "cpu", "--quick", "--train-seconds", "3", "--output", str(out)]) == 0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists(), name
    assert list(out.glob("*.safetensors"))
    assert (out / "loss_curve.png").stat().st_size > 0
    report = json.loads((out / "training.json").read_text())
    figures = report["figures"]
    assert figures["held_out_bytes"] > 0
    assert figures["model_bits_per_byte"] > 0
    assert {"gzip_9_bits_per_byte", "unigram_token_bits_per_byte"} <= figures.keys()
    assert report["training"]["steps"] >= 1
    assert report["hyper"]["vocab_size"] == train.QUICK.vocab_size

    spec = load_model_spec(out)  # pagedserve's loader
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.tie_word_embeddings
    assert spec.num_kv_heads < spec.num_heads  # GQA
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode("def f(x):")
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "### user\nhi\n\n### assistant\n"
    model = AutoModelForCausalLM.from_pretrained(out, dtype="float32")
    assert model.config.vocab_size == spec.vocab_size
