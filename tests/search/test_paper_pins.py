"""The four paper models on the paper machine: optimal step time and table checksums pinned.

Values computed on commit 3b074b0, before the cost-table build was made
faster: a speed-up of the build (vectorised edge volumes, shared tiles,
shared tables) must not change any table entry or the optimum. Per case:
(optimal step seconds, candidate layouts over all operators, sum of every
operator's cost over its layouts, sum of every edge matrix). The sums are
of up to 10^6 float entries, so they are compared to 1e-9 relative (the
summation order may change); a single changed entry moves them by far
more for any entry that matters.
"""

from __future__ import annotations

import functools

import pytest

from shardplan.machine import preset
from shardplan.models import MODELS
from shardplan.spmd import solve

PINNED = {
    ("alexnet", 8): (0.008165983520000001, 316, 0.7476851976000001, 4.446669232),
    ("alexnet", 16): (0.004851855888, 635, 1.21951077608, 15.106798295999997),
    ("alexnet", 64): (0.0017559258536, 1801, 2.2995733687536, 82.416553292),
    ("inception_v3", 8): (0.06494540022080005, 7825, 13.399554775011174, 321.3691940959994),
    ("inception_v3", 16): (0.03758749223840001, 16138, 23.87907934145439, 993.196687712),
    ("inception_v3", 64): (0.020934374925599998, 15389, 20.28647756427918, 743.8146426400008),
    ("rnnlm", 8): (0.36369454923776007, 306, 63.56909132890112, 487.326326784),
    ("rnnlm", 16): (0.19086871461888005, 775, 115.93178849525762, 2122.4666009600005),
    ("rnnlm", 64): (0.056226619596800004, 2862, 251.38623469342724, 14926.221567104),
    ("transformer", 8): (0.1186116488806402, 18733, 45.89627245871109, 3170.5409003520026),
    ("transformer", 16): (0.07202953824256009, 17525, 40.52014422581251, 2466.136126463999),
    ("transformer", 64): (0.03181385044480003, 58403, 90.07951434114553, 16792.98045305601),
}


@functools.lru_cache(maxsize=None)
def _plan(name: str, p: int):
    spec = MODELS[name]
    return solve(spec.build(), preset("paper", p), cutoff=spec.cutoff)


@pytest.mark.parametrize("name,p", sorted(PINNED))
def test_paper_model_optimum_and_tables_pinned(name, p):
    cost, n_layouts, op_sum, edge_sum = PINNED[(name, p)]
    plan = _plan(name, p)
    t = plan.tables
    assert plan.solution.optimal
    assert plan.cost == pytest.approx(cost, rel=1e-12, abs=0)
    assert sum(len(lays) for lays in t.layouts) == n_layouts
    assert float(sum(c.total.sum() for c in t.op_costs)) == pytest.approx(op_sum, rel=1e-9, abs=0)
    assert float(sum(m.sum() for m in t.edge_costs)) == pytest.approx(edge_sum, rel=1e-9, abs=0)
