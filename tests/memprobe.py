"""Peak memory of one phase, measured in a fresh Python process (Linux).

``measure(setup, phase)`` runs ``setup`` (statements), resets the kernel's
peak-RSS counter (``/proc/self/clear_refs``), runs the expression ``phase``
and reports the resident set before the phase, the peak during it and
``phase``'s JSON-able result. ``peak - before`` is what the phase itself
allocated at its worst moment (plus allocator slack): the number a memory
estimate must bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

__all__ = ["measure", "available"]

_CHILD = """
import json, re, sys
def _status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
{setup}
import gc
gc.collect()
before = _status("VmRSS")
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
try:
    result = {phase}
    error = None
except Exception as exc:
    result, error = None, f"{{type(exc).__name__}}: {{exc}}"
peak = _status("VmHWM")
print(json.dumps({{"before": before, "peak": peak, "result": result, "error": error}}))
"""


def available() -> bool:
    """Whether this system can reset and read the peak RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return "VmHWM" in open("/proc/self/status").read()
    except OSError:
        return False


def measure(setup: str, phase: str, timeout: float = 120.0) -> dict:
    """Run ``setup`` then ``phase`` in a child interpreter; returns before/peak bytes, result, error."""
    code = _CHILD.format(setup=textwrap.dedent(setup), phase=phase)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                         os.path.dirname(__file__)])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory probe failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["used"] = out["peak"] - out["before"]
    return out
