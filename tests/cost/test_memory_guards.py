"""Memory guards: every memory-hungry phase estimates its peak before allocating, and the estimate holds.

Peaks are measured in a fresh process (tests/memprobe.py: the kernel's
peak-RSS counter reset before the phase), on cases of a few tens to a few
hundred MB so that the interpreter's own noise is small next to them.
"""

from __future__ import annotations

import pytest

import memprobe
from randgraphs import complete, spider
from shardplan.errors import ShardplanError
from shardplan.search import solve_bfs_dp

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out


SPIDER = "from randgraphs import spider\n"
COMPLETE = "from randgraphs import complete\n"


@pytest.mark.parametrize("setup, phase, at_least", [
    (SPIDER + "from shardplan.search import solve_bfs_dp\np = spider(19, 2)",
     "solve_bfs_dp(p, memory_limit_bytes=10**10).stats", 10e6),
    (COMPLETE + "from shardplan.search import solve_dp\np = complete(8, 8)",
     "solve_dp(p, memory_limit_bytes=10**10, prune=False, bounds=False).stats", 50e6),
], ids=["bfs-dp", "dp"])
def test_search_estimate_bounds_its_peak(setup, phase, at_least):
    """The estimate a DP compares with the limit is at least what it really allocates (a case big enough to measure)."""
    r = memprobe.measure(setup, phase)
    assert r["error"] is None
    est = r["result"]["memory_estimate_bytes"]
    assert at_least < r["used"] <= est, (r["used"], est)


def test_bfs_dp_counts_the_argmin_tables_it_keeps():
    """The spider's largest single table fits the limit; with the kept argmin tables it does not."""
    p = spider(12, 2)
    sol = solve_bfs_dp(p, memory_limit_bytes=10**10)
    kept, peak = sol.stats["kept_bytes"], sol.stats["memory_estimate_bytes"]
    assert kept > 0 and peak > kept
    with pytest.raises(ShardplanError, match=r"argmin tables kept from earlier steps.*over the memory limit"):
        solve_bfs_dp(p, memory_limit_bytes=peak - 1)
    assert solve_bfs_dp(p, memory_limit_bytes=peak).cost == sol.cost


def test_bfs_dp_refuses_before_allocating():
    r = memprobe.measure(SPIDER + "from shardplan.search import solve_bfs_dp\np = spider(30, 2)",
                         "solve_bfs_dp(p, memory_limit_bytes=10**9).stats")
    assert "over the memory limit of 954 MiB" in r["error"]
    assert r["used"] < 200e6


BUILD = '''
from shardplan.models import get_model
from shardplan.machine import preset
from shardplan.cost import build_tables
g, m = get_model("alexnet"), preset("paper", 128)
'''


def test_cost_table_build_estimate_bounds_its_peak():
    r = memprobe.measure(BUILD, "build_tables(g, m, divides_p=False, orders='row-major').options")
    assert r["error"] is None
    est = r["result"]["memory_estimate_bytes"]
    assert 10e6 < r["used"] <= est, (r["used"], est)


def test_cost_table_build_is_refused_before_allocating_with_what_would_help():
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import get_model

    g, m = get_model("alexnet"), preset("paper", 128)
    with pytest.raises(ShardplanError, match=r"operator '\w+': building the cost tables needs about .* at the "
                                             r"(edge \w+ -> \w+|costs of \w+) \(\d+( x \d+)? configurations on 128 "
                                             r"devices\), over the memory limit of 95.4 MiB; try not --all-divisors, "
                                             r"a larger --cutoff"):
        build_tables(g, m, divides_p=False, orders="row-major", memory_limit_bytes=10**8)


def test_cli_refuses_a_huge_build_in_one_line(capsys, tmp_path):
    """The issue's case: alexnet on 4096 devices with every divisor, cutoff 1 and every order (12 GiB and more)."""
    from shardplan.cli import main

    code = main(["export-problem", "--model", "alexnet", "-p", "4096", "--all-divisors", "--cutoff", "1",
                 "--orders", "all", "-o", str(tmp_path / "p.json"), "--table-memory", "4e9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "building the cost tables needs about" in err and "over the memory limit of 3.73 GiB" in err
    assert "--orders row-major" in err and "not --all-divisors" in err
    assert not (tmp_path / "p.json").exists()


ILP = '''
import scipy.optimize  # imported before the phase: its import is not the solve
from shardplan.cost import build_tables
from shardplan.machine import preset
from shardplan.models import get_model
from shardplan.search import solve_ilp
p = build_tables(get_model("rnnlm"), preset("paper", 8), cutoff=1).to_problem()
'''


def test_ilp_estimate_bounds_its_peak():
    """RNNLM on 8 devices: the measured program with the most bytes per nonzero (HiGHS's presolve)."""
    r = memprobe.measure(ILP, "solve_ilp(p).stats")
    assert r["error"] is None and r["result"]["status"].startswith("Optimization terminated successfully")
    assert 50e6 < r["used"] <= r["result"]["memory_estimate_bytes"], (r["used"], r["result"]["memory_estimate_bytes"])


def test_ilp_refuses_a_program_over_the_limit():
    from shardplan.errors import TableMemoryError
    from shardplan.search import solve_ilp

    p = spider(12, 2)
    with pytest.raises(TableMemoryError, match=r"ILP: a program of 146 variables and 338 nonzeros needs about "
                                               r"256 MiB .* over the memory limit of 95.4 MiB"):
        solve_ilp(p, memory_limit_bytes=10**8)


def test_dp_limit_counts_what_earlier_steps_keep():
    from shardplan.search import solve_dp

    p = complete(6, 6)
    sol = solve_dp(p, prune=False, bounds=False)
    est, kept = sol.stats["memory_estimate_bytes"], sol.stats["kept_bytes"]
    assert kept > 0
    assert solve_dp(p, prune=False, bounds=False, memory_limit_bytes=est).cost == sol.cost
    with pytest.raises(ShardplanError, match=r"needs about .* with the .* of tables kept from earlier steps, "
                                             r"over the memory limit"):
        solve_dp(p, prune=False, bounds=False, memory_limit_bytes=est - 1)
