"""Running one benchmark row in a child process with a time limit, so a row too slow for this machine is
recorded as skipped instead of holding up the rest."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Callable


def _child(fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except Exception as e:  # noqa: BLE001 - sent to the parent, which records it in the row
        conn.send(("error", f"{type(e).__name__}: {e}"))
    conn.close()


def call_limited(fn: Callable[..., Any], args: tuple, limit: float) -> tuple[str, Any, float]:
    """``fn(*args)`` in a forked child process: ``("ok", result, seconds)``, ``("error", message, seconds)``,
    or ``("timeout", None, seconds)`` when it ran past ``limit`` seconds (the child is then stopped)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=_child, args=(fn, args, child))
    proc.start()
    child.close()
    got = parent.recv() if parent.poll(limit) else None
    proc.join(5)
    if proc.is_alive():
        proc.terminate()
        proc.join()
    seconds = time.perf_counter() - t0
    if got is None:
        return "timeout", None, seconds
    return got[0], got[1], seconds
