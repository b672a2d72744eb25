"""Checks on committed artifacts: the generated stubs and the admin stats (docker-compose.yml and the
other deployment files: tests/test_deploy.py)."""

from __future__ import annotations

from pagedserve.protos.generate import PROTO_ROOT, generate


def test_committed_stubs_match_the_proto_files():
    for name, text in generate().items():
        assert (PROTO_ROOT / name).read_text() == text, (
            f"{name} is stale: run python -m pagedserve.protos.generate"
        )


def test_admin_stats_cover_the_scheduler_core_stats():
    """AdminService copies the core's stats by field name: a renamed field must not vanish silently."""
    import dataclasses

    from pagedserve.protos import admin_pb2
    from pagedserve.scheduler.core import SchedulerStats

    proto_fields = set(admin_pb2.SchedulerStats.DESCRIPTOR.fields_by_name)
    # Set by AdminService itself: the engine's totals and steps in flight, and the process's CPU time.
    service_fields = {
        "steps",
        "tokens_generated",
        "num_active_requests",
        "num_steps_in_flight",
        "process_cpu_seconds",
    }
    core_fields = {f.name for f in dataclasses.fields(SchedulerStats)}
    assert proto_fields - service_fields <= core_fields
