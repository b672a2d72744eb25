"""Shared fixtures: tiny models written locally and loaded through the real loader."""

from __future__ import annotations

import pytest

from pagedserve.tiny_model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny GQA Llama (4 query heads, 2 KV heads) with its byte-level BPE tokenizer."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec())


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    """Hugging Face's own implementation of the tiny model: the reference for greedy tokens."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()
