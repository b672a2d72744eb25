"""Shared fixtures: tiny models written locally and loaded through the real loader.

Without a GPU, Triton kernels run under its interpreter. TRITON_INTERPRET must be set before any
module defines a kernel (@triton.jit picks the interpreter then), so it is set here, before pytest
imports a test module; the CPU executor ignores it (CPU tensors take the plain-torch paths).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
