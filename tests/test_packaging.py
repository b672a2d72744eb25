"""The package installs under one import name, and the import layers are enforced.

The checkout keeps protos/, scheduler/, executor/ and kernels/ at its root; they install as
pagedserve.protos, .scheduler, .executor and .kernels (pyproject's package-dir mapping), beside
src/pagedserve. Nothing else may land in site-packages: those four names belong to other PyPI
packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.services import REPO

SUBPACKAGES = ("scheduler", "executor", "kernels", "protos")
IMPORTS = "import pagedserve.scheduler, pagedserve.executor, pagedserve.kernels, pagedserve.protos"


def _pip(*args: str, cwd: Path = REPO) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
    )


def _where(module: str, cwd: Path, env: dict[str, str] | None = None) -> Path:
    """The file `module` is imported from by a fresh interpreter started in `cwd`."""
    code = f"{IMPORTS}; import {module} as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, "."],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("pagedserve-*.whl")
    return path


def test_wheel_holds_only_the_pagedserve_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"pagedserve", wheel.name.split("-py3")[0] + ".dist-info"}
    for sub in SUBPACKAGES:
        assert f"pagedserve/{sub}/__init__.py" in names
    protos = {n for n in names if n.endswith(".proto")}
    expected = {f"pagedserve/protos/pagedserve/v1/{n}.proto" for n in ("generation", "executor", "admin")}
    assert protos == expected
    assert "pagedserve/kernels/fp8_decode.cu" in names  # compiled at run time (kernels.cuda_decode)
    assert "pagedserve/executor/models/gemma.py" in names  # a sub-package of a mapped folder
    for model in ("default", "default_draft"):  # the built-in model and its speculative draft
        assert f"pagedserve/models/{model}/model.safetensors.index.json" in names or (
            f"pagedserve/models/{model}/model.safetensors" in names
        )
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]


# The maintainers' microbenchmarks and the built-in model's training tool live in the checkout
# (benchmarks/, scripts/), not in what users install; `pagedserve bench` is what stays.
MAINTAINER_MODULES = (
    "ahead_plans", "breakdown", "failover", "fp8", "fp8_quality", "gateway_load", "hotpath", "kernels",
    "step", "train_default_model",
)  # fmt: skip


def test_wheel_ships_no_maintainer_benchmarks(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    modules = {Path(n).stem for n in names if n.startswith("pagedserve/bench/") or n.count("/") == 1}
    assert not modules & set(MAINTAINER_MODULES), sorted(modules & set(MAINTAINER_MODULES))
    assert "pagedserve/bench/cli.py" in names


def test_regular_install_imports_from_anywhere(wheel, tmp_path):
    """A regular install (here into a target directory) serves `pagedserve.*` from outside the
    checkout and from its root alike: the root's folders do not shadow the installed package."""
    site = tmp_path / "site"
    _pip("--target", str(site), str(wheel))
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) in (
        ["pagedserve"],
        ["bin", "pagedserve"],
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    for cwd in (tmp_path, REPO):
        assert _where("pagedserve.scheduler", cwd, env).is_relative_to(site)
        assert _where("pagedserve.protos.generation_pb2", cwd, env).is_relative_to(site)


def test_editable_install_imports_from_anywhere(tmp_path):
    """The test environment's own install is editable (`make install`): modules come from the
    checkout's folders, from any working directory."""
    for cwd in (tmp_path, REPO):
        assert _where("pagedserve.scheduler.core", cwd) == REPO / "scheduler" / "core.py"
        assert _where("pagedserve.cli", cwd) == REPO / "src" / "pagedserve" / "cli.py"


def _copy_checkout(dest: Path) -> Path:
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, dest / name)
    for name in ("src", *SUBPACKAGES, "scripts", "benchmarks"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def test_lint_imports_keeps_the_layers_and_catches_a_violation(tmp_path):
    checkout = _copy_checkout(tmp_path)
    script = [str(checkout / "scripts" / "lint-imports.sh"), sys.executable]
    clean = subprocess.run(script, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    core = checkout / "scheduler" / "core.py"
    core.write_text(core.read_text() + "\nimport pagedserve.executor.runner  # noqa: E402,F401\n")
    broken = subprocess.run(script, capture_output=True, text=True)
    assert broken.returncode != 0
    assert "pagedserve.scheduler.core -> pagedserve.executor.runner" in broken.stdout
