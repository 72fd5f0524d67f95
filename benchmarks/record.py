"""One benchmark JSON: rows with where they were measured (commit, host, CPUs, load average)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def write_result(benchmark: str, out: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    """Write ``{"benchmark", "commit", "host", "cpus", **extra, "rows"}`` to ``out`` (its folder made) and say so."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"benchmark": benchmark, "commit": commit, "host": platform.node(), "cpus": os.cpu_count(), **extra,
              "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
