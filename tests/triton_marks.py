"""Where the Triton tests run: compiled on a CUDA device, else under the interpreter, which
tests/conftest.py switches on before any kernel module is imported."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not HAS_CUDA and not INTERPRETED, reason="Triton needs CUDA or TRITON_INTERPRET=1 (set too late?)"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
