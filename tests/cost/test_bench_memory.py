"""The benchmark tells a breadth-first DP over its memory limit from a real failure by the error's type."""

from __future__ import annotations

from shardplan.bench import run_table1


def test_bfs_over_memory_limit_is_reported_not_raised() -> None:
    out = run_table1(["alexnet"], [4], bfs_memory=1)
    (row,) = out["rows"]
    assert row["bfs_status"] == "out of memory limit" and row["bfs_seconds"] is None
    assert "out of memory limit" in out["table"]
    ok = run_table1(["alexnet"], [4])["rows"][0]
    assert ok["bfs_status"] == "ok" and ok["bfs_seconds"] is not None
