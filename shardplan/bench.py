"""Measurements behind ``shardplan bench`` (the paper's Table I) and ``shardplan compare`` (its Fig. 6).

Solve times are wall-clock seconds of the search itself (``solve_seconds``);
building the cost tables is reported separately (``build_seconds``).
"""

from __future__ import annotations

import platform
import time
from typing import Any, Sequence, TextIO

from shardplan.errors import ShardplanError, TableMemoryError
from shardplan.table import format_table

__all__ = ["run_table1", "run_compare"]


def _say(log: TextIO | None, msg: str) -> None:
    if log is not None:
        log.write(msg + "\n")
        log.flush()


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    m, s = divmod(t, 60.0)
    return f"{int(m)}:{s:06.3f}"


def _format(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Benchmark tables: the first column left-aligned, the others right-aligned, no rule."""
    return format_table(rows, header, right=range(1, len(header)), rule=False)


def run_table1(models: Sequence[str], procs: Sequence[int], machine: str = "paper", orders: str = "auto",
               bfs: bool = True, bfs_memory: float = 2e9, log: TextIO | None = None) -> dict[str, Any]:
    """Time to find the optimal strategy per model and device count, DP and (optionally) breadth-first DP.

    The breadth-first-order DP runs under a table memory limit of
    ``bfs_memory`` bytes and is reported as "out of memory limit" where the
    guard stops it, as the paper reports its naive order running out of memory.
    """
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.search import solve_bfs_dp, solve_dp

    rows: list[dict[str, Any]] = []
    for name in models:
        spec = model_spec(name)
        g = spec.build()
        for p in procs:
            m = preset(machine, p)
            t0 = time.perf_counter()
            tables = build_tables(g, m, cutoff=spec.cutoff, orders=orders)
            build = time.perf_counter() - t0
            problem = tables.to_problem()
            sol = solve_dp(problem)
            row: dict[str, Any] = {
                "model": spec.name, "p": p, "vertices": len(g.operators), "edges": len(g.edges),
                "configurations": int(sum(problem.sizes)), "build_seconds": build,
                "dp_seconds": sol.solve_seconds, "cost_seconds": sol.cost,
                "max_dependent_set": sol.stats.get("max_dependent_set"),
                "total_table_entries": sol.stats.get("total_table_entries"),
                "largest_table": sol.stats.get("largest_table"),
                "configs_after_bounds": (sol.stats.get("bounds") or {}).get("configs_after"),
            }
            if bfs:
                try:
                    b = solve_bfs_dp(problem, memory_limit_bytes=int(bfs_memory))
                except TableMemoryError:
                    row["bfs_seconds"] = None
                    row["bfs_status"] = "out of memory limit"
                else:
                    row["bfs_seconds"] = b.solve_seconds
                    row["bfs_status"] = "ok"
                    if abs(b.cost - sol.cost) > 1e-9 * max(1.0, abs(sol.cost)):
                        raise ShardplanError(f"{name} p={p}: breadth-first DP cost {b.cost} != DP cost {sol.cost}")
            rows.append(row)
            _say(log, f"{spec.name:14s} p={p:3d}  build {build:7.3f} s  DP {sol.solve_seconds:7.3f} s"
                      + (f"  BFS {row['bfs_status'] if row.get('bfs_seconds') is None else _fmt_time(row['bfs_seconds'])}"
                         if bfs else ""))
    head = ["model", "p", "DP solve", "cost tables", "configs", "after bounds", "max |D|", "table entries"]
    if bfs:
        head.append("BFS-order DP")
    table = []
    for r in rows:
        line = [r["model"], str(r["p"]), _fmt_time(r["dp_seconds"]), _fmt_time(r["build_seconds"]),
                str(r["configurations"]), str(r["configs_after_bounds"]), str(r["max_dependent_set"]),
                f"{r['total_table_entries']:.3g}"]
        if bfs:
            line.append(_fmt_time(r["bfs_seconds"]) if r.get("bfs_seconds") is not None else r["bfs_status"])
        table.append(line)
    return {"machine": machine, "orders": orders, "host": platform.node(), "python": platform.python_version(),
            "rows": rows, "table": _format(head, table)}


def run_compare(model: str, procs: Sequence[int], machines: Sequence[str], batch: int | None = None,
                sizes: dict[str, Any] | None = None, cutoff: int | None = None, orders: str = "auto",
                mcmc_seed: int = 0, log: TextIO | None = None, fit: bool = False,
                memory: float | None = None) -> dict[str, Any]:
    """Predicted step time of data parallel, the expert strategy, MCMC and the DP, per device count.

    MCMC starts from the expert strategy, as the paper ran FlexFlow. With
    ``fit`` (or a ``memory`` budget in bytes, overriding the preset's) the
    exact DP is the unconstrained optimum and a row is added for the fastest
    plan within the budget (:func:`shardplan.fit.solve_fit`); every row
    states its peak memory per device.
    """
    from dataclasses import replace
    from shardplan.baselines import baseline_plans
    from shardplan.cost import build_tables
    from shardplan.machine import preset
    from shardplan.models import model_spec
    from shardplan.plan import Plan, solve_tables
    from shardplan.search import solve_mcmc

    spec = model_spec(model)
    g = spec.build(batch, **(sizes or {}))
    cut = spec.cutoff if cutoff is None else cutoff
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for mname in machines:
        for p in procs:
            m = preset(mname, p)
            fit_on = fit or memory is not None
            if memory is not None:
                m = replace(m, memory_bytes=float(memory))
            tables = build_tables(g, replace(m, memory_bytes=None) if fit_on else m, cutoff=cut, orders=orders)
            tables = replace(tables, machine=m)
            base = baseline_plans(tables, spec.expert)
            dp = solve_tables(tables)
            expert_name = spec.expert
            expert = base[expert_name]
            problem = tables.to_problem()
            mc = solve_mcmc(problem, init=list(expert.assignment), seed=mcmc_seed)
            mcmc = Plan(tables, tuple(int(a) for a in mc.assignment), mc, "mcmc")
            dpar = base["data_parallel"]
            strategies = [("data parallel", dpar, 0.0), (expert_name, expert, 0.0),
                          ("mcmc", mcmc, mc.solve_seconds), ("shardplan (exact DP)", dp, dp.solve_seconds)]
            if fit_on:
                from shardplan.fit import solve_fit
                from shardplan.units import fmt_bytes

                fp = solve_fit(g, m, tables=tables)
                label = f"shardplan fit <= {fmt_bytes(m.memory_bytes or 0)}" + ("" if fp.solution.optimal else
                                                                             " (not proven)")
                strategies.append((label, fp, fp.solve_seconds))
            for label, plan, secs in strategies:
                tag = label if len(machines) == 1 else f"{label} [{mname}]"
                row = {"machine": mname, "p": p, "strategy": label, "cost_seconds": plan.cost,
                       "speedup_vs_data_parallel": dpar.cost / plan.cost, "solve_seconds": secs,
                       "peak_bytes": plan.memory["peak_bytes"]}
                rows.append(row)
                points.append({"p": p, "strategy": tag, "speedup": row["speedup_vs_data_parallel"]})
            if mcmc.cost < dp.cost * (1 - 1e-9):
                raise ShardplanError(f"MCMC found {mcmc.cost} below the DP optimum {dp.cost}: solver bug")
            _say(log, f"{mname} p={p}: data parallel {dpar.cost * 1e3:.3f} ms, {expert_name} "
                      f"{expert.cost * 1e3:.3f} ms, mcmc {mcmc.cost * 1e3:.3f} ms, DP {dp.cost * 1e3:.3f} ms")
    head = ["machine", "p", "strategy", "step time", "speedup vs data parallel", "solve", "peak memory"]
    table = []
    from shardplan.units import fmt_bytes as _fb

    for r in rows:
        table.append([r["machine"], str(r["p"]), r["strategy"], f"{r['cost_seconds'] * 1e3:.3f} ms",
                      f"{r['speedup_vs_data_parallel']:.2f}x", _fmt_time(r["solve_seconds"]), _fb(r["peak_bytes"])])
    title = f"{spec.name}: predicted speedup over data parallelism"
    return {"model": spec.name, "machines": list(machines), "rows": rows, "points": points, "title": title,
            "table": _format(head, table)}
