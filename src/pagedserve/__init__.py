"""pagedserve: LLM serving with PagedAttention, split into a scheduler and an executor service.

`from pagedserve import LLM, SamplingParams` is the offline API (pagedserve.entrypoints). The names
are resolved on first use (PEP 562), so a service process that imports `pagedserve.scheduler` does
not pull in the top layer (torch, the executor, tqdm) through this package's __init__.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.entrypoints.outputs import CompletionOutput, RequestOutput
    from pagedserve.entrypoints.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "SamplingParams": "pagedserve.entrypoints.sampling_params",
    "StructuredOutputsParams": "pagedserve.entrypoints.sampling_params",
    "RequestOutput": "pagedserve.entrypoints.outputs",
    "CompletionOutput": "pagedserve.entrypoints.outputs",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value
