"""The failover benchmark end to end, once: one kill -9 of a busy executor among two, on the tiny
model in float32, loses, duplicates and changes no token."""

from __future__ import annotations

from benchmarks import failover


def test_one_kill_loses_and_duplicates_nothing(tiny_model_dir, capsys):
    argv = ["--model", str(tiny_model_dir), "--executors", "2", "--kills", "1", "--streams", "2"]
    assert failover.main([*argv, "--max-tokens", "48"]) == 0
    out = capsys.readouterr().out
    assert "kill 1: executor" in out
    assert "duplicated tokens 0, lost tokens 0, tokens differing in value 0" in out
