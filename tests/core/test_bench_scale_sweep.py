"""The default-search sweep's rows and its growth fit (benchmarks/bench_scale_pipeline.py --sweep)."""

from __future__ import annotations

import math

from benchmarks.bench_scale_pipeline import SWEEP, growth_exponent, sweep_rows


def test_every_axis_varies_one_thing_and_shares_the_base_row() -> None:
    rows = sweep_rows(list(SWEEP))
    assert len(rows) == sum(len(xs) for _, xs in SWEEP.values())
    base = [r for r in rows if r[0] == "base"]
    assert [r[1] for r in base] == ["devices", "layers", "width"]
    assert all(r[3] == base[0][3] and r[4] == () for r in base)  # one command, run once
    for name, axis, x, spec, extra in rows:
        if name == "base":
            continue
        if axis == "devices":
            assert spec["p"] == x and extra == ()
        elif axis == "layers":
            assert spec["p"] == 1024 and extra == ("--set", f"layers={x}")
        else:
            assert spec["p"] == 1024 and extra == ("--set", f"d_model={x}", "--set", f"heads={x // 128}",
                                                   "--set", f"d_ff={4 * x}")


def test_growth_exponent_recovers_a_power_law() -> None:
    xs = [64.0, 256.0, 1024.0, 4096.0]
    assert math.isclose(growth_exponent(xs, [3.0 * x ** 0.75 for x in xs]), 0.75, rel_tol=1e-12)
    assert growth_exponent([64.0, 64.0], [1.0, 2.0]) is None  # one distinct x: no fit
    assert growth_exponent(xs, [None, 2.0, None, None]) is None
