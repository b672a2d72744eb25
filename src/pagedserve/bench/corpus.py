"""The built-in model's corpus: the Python source installed on this machine, split by file.

Files are listed in sorted order and split into training and held-out sets BY FILE with a seeded
hash of each file's path relative to its root, so the split of a given file is the same on every
machine and Python version. The training tool (`scripts/train_default_model.py`, in a checkout)
learns from the training files; `pagedserve bench --log-likelihood` scores the held-out ones.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# --- corpus -----------------------------------------------------------------------------------
# Installed packages (import names) whose source and docs join the standard library. Packages
# missing on a machine are skipped and listed in the report; all of these come with torch or
# transformers, so the GPU image and a dev checkout both have nearly all of them.
SITE_PACKAGES = (
    "torch",
    "transformers",
    "numpy",
    "sympy",
    "networkx",
    "mpmath",
    "jinja2",
    "markupsafe",
    "triton",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "filelock",
    "fsspec",
    "tqdm",
    "yaml",
    "packaging",
    "setuptools",
    "pip",
    "scipy",
    "pandas",
    "sklearn",
    "matplotlib",
    "pygments",
    "rich",
    "_pytest",
    "hypothesis",
    "requests",
    "urllib3",
    "click",
    "grpc",
    "google",
)
SUFFIXES = (".py", ".pyi", ".md", ".rst")
# Test suites are full of generated data and odd strings; transformers/models is ~90% of that package
# and mostly near-copies of one modeling file ("Copied from"), which would leak into the held-out set.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"})
EXCLUDED_PREFIXES = ("transformers/models/",)
MAX_FILE_BYTES = 256 * 1024  # larger files are generated tables, not prose or code
SPLIT_SEED = 16
HELD_OUT_PER_MILLE = 30  # 3% of files, chosen by a hash of (seed, root name, relative path)
HELD_OUT_EVAL_BYTES = 1 << 20  # held-out Python source the final figures are computed on
TOKENIZER_TRAIN_BYTES = 24 << 20  # the BPE merges are learnt on this prefix of the shuffled files


@dataclass(frozen=True)
class SourceFile:
    root: str  # "stdlib" or a package's import name
    relative: str  # path under the root, "/"-separated
    path: Path

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(f"{SPLIT_SEED}:{self.root}:{self.relative}".encode()).digest()
        return int.from_bytes(digest[:8], "big") % 1000 < HELD_OUT_PER_MILLE

    @property
    def order_key(self) -> bytes:
        """A seeded shuffle of the files (what the byte caps take a prefix of)."""
        return hashlib.sha256(f"order:{SPLIT_SEED}:{self.root}:{self.relative}".encode()).digest()


def corpus_roots(packages: tuple[str, ...] = SITE_PACKAGES) -> tuple[list[tuple[str, Path]], list[str]]:
    """(name, directory) of the standard library and each installed package; and those missing."""
    roots = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    missing = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            missing.append(name)
            continue
        roots.append((name, Path(locations[0])))
    return roots, missing


def list_files(roots: list[tuple[str, Path]]) -> list[SourceFile]:
    """Every corpus file, sorted by (root, relative path): the list is a function of the machine."""
    files = []
    for name, root in roots:
        prefix = "" if name == "stdlib" else f"{name}/"
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root).as_posix()
            parts = relative.split("/")
            if path.suffix not in SUFFIXES or EXCLUDED_DIRS.intersection(parts[:-1]):
                continue
            if (prefix + relative).startswith(EXCLUDED_PREFIXES) or not path.is_file():
                continue
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            files.append(SourceFile(name, relative, path))
    return files


def read_texts(files: list[SourceFile], cap: int | None) -> Iterator[tuple[SourceFile, str]]:
    """UTF-8 texts of `files` (undecodable and empty ones skipped), up to `cap` bytes in all."""
    total = 0
    for file in files:
        if cap is not None and total >= cap:
            return
        try:
            text = file.path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            total += len(text.encode())
            yield file, text


def held_out_texts(max_bytes: int, packages: tuple[str, ...] = SITE_PACKAGES) -> list[str]:
    """The held-out Python source of this machine, in the seeded file order, up to `max_bytes`: what
    the training run's final figures and `pagedserve bench --log-likelihood` score."""
    roots, _ = corpus_roots(packages)
    files = sorted(list_files(roots), key=lambda f: f.order_key)
    held = [f for f in files if f.held_out and f.path.suffix == ".py"]
    return [text for _, text in read_texts(held, max_bytes)]


def gzip_bits_per_byte(data: bytes) -> float:
    return len(gzip.compress(data, compresslevel=9)) * 8 / len(data)
