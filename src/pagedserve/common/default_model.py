"""Where the built-in model lives: package data of pagedserve, so every install has it.

The weights were trained by `python -m scripts.train_default_model` (in a checkout: a ~12.6M-parameter
Llama on Python source; see training.json beside them) and committed once. The services take `--model` as
optional and fall back to this directory, so `pagedserve serve`, `LLM()` and the compose file serve
a model that writes Python-looking text without any download.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
# Its draft for speculative decoding (`"method": "draft_model"`): a 3.3M-parameter Llama trained the
# same way on the same text with the same tokenizer and KV shape (`--draft-of`; training.json beside it).
DEFAULT_DRAFT_MODEL_DIR = DEFAULT_MODEL_DIR.parent / "default_draft"


def resolve_model(value: str | None) -> str:
    """A --model flag's value: empty or missing means the built-in model, so a compose file can
    pass `--model=${MODEL_DIR:-}`. Used as argparse's `type=` (it also converts the default)."""
    return value or str(DEFAULT_MODEL_DIR)
