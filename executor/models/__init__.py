"""The model families: each a small description (`common.Family`) over the shared layers.

A family reads its Hugging Face config into the traits of a `ModelSpec` (norm kind, MLP kind,
per-layer attention windows and rotary embeddings, soft-caps, q/k norms, embedding scale, experts)
and says how its checkpoint names map onto the canonical ones (`common.CANONICAL_LAYER_MODULES`);
`executor.model` builds every family's forward from the same layers and `executor.loader` loads
every checkpoint through the same code. One file per family, as vLLM keeps them.
"""

from __future__ import annotations

from pagedserve.executor.models.common import Family
from pagedserve.executor.models.gemma import GEMMA2, GEMMA3, GEMMA3_MULTIMODAL
from pagedserve.executor.models.llama import LLAMA, MISTRAL, QWEN2
from pagedserve.executor.models.mixtral import MIXTRAL
from pagedserve.executor.models.phi3 import PHI3
from pagedserve.executor.models.qwen3 import QWEN3, QWEN3_MOE

FAMILIES: dict[str, Family] = {
    arch: family
    for family in (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, GEMMA2, GEMMA3, GEMMA3_MULTIMODAL, PHI3)
    for arch in family.architectures
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family"]
