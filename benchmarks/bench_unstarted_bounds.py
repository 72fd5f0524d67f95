"""What a part the search never started could state, and what each candidate costs (JSON; docs/pipeline.md,
*Bounds of the parts not started*).

For one model and machine, with the planner's stage options (memory choices, the zoo model's cutoff), at each
micro-batch count given: the CPU seconds of the solve-free unit bounds on every sub-mesh size
(:class:`~shardplan.pipeline.floors.UnitFloors`, one instance for every count, as the planner shares it), the
step floor m D / p (what an unstarted part states now), the one-stage bound m sum_u l_p(u), the 1F1B and ZB-H1
bubble bounds (against ``--incumbent``) with the unit bounds and with the device-seconds alone (l_q(u) = D_u / q),
and two hypotheses a cheaper bound would rest on, checked on the computed bounds (nothing here uses them):

- *work grows with m*: m l^m_q(u) >= m0 l^m0_q(u) for m0 | m (a floor at the larger micro-batch scaled down);
  ``scaling_min_ratio`` is the least m l^m / (m0 l^m0) over every size and unit (below 1: it fails), and the
  bubble bounds at m computed from the scaled bounds of the smallest count are given as what it would buy, and
  ``scaled_every_count`` gives them (with the work bound m sum_i q_i l_i / p) at every count of the planner;
- *work grows with the size*: q l_q(u) >= q' l_q'(u) for q' | q, both whole nodes; ``size_min_ratio`` the least
  such ratio.

Nothing is solved. Run: ``PYTHONPATH=. python benchmarks/bench_unstarted_bounds.py [--model gpt3-175b]
[-p 1024] [--m 1 48 96 192] [--incumbent 6.0835311280585795] [--out benchmarks/results/unstarted_bounds.json]``.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np

from benchmarks.record import write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("-p", type=int, default=1024)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 48, 96, 192])
    ap.add_argument("--incumbent", type=float, default=6.0835311280585795, help="the best step known (s)")
    ap.add_argument("--out", default="benchmarks/results/unstarted_bounds.json")
    args = ap.parse_args()

    from shardplan.machine import preset
    from shardplan.models import get_model, model_spec
    from shardplan.pipeline.api import seed_model
    from shardplan.pipeline.floors import UnitFloors
    from shardplan.pipeline.search import PipelineSpace, _bubble_bound, _minmax_cuts, _zb_bubble_counts

    load0 = os.getloadavg()
    spec = model_spec(args.model)
    machine = preset("h100", args.p)
    model = seed_model(partial(get_model, args.model), spec.batch, machine, memory_choices=True, cutoff=spec.cutoff)
    floors = UnitFloors(model)
    p, inc = args.p, args.incumbent
    ns = machine.levels[0] if len(machine.levels) > 1 else p
    space = PipelineSpace(num_units=model.num_units, num_devices=p, node_size=ns)
    sizes = [q for q in space.allowed_sizes() if q <= p]
    U = model.num_units

    def bubbles(units: dict[int, np.ndarray], fwd: list[float], m: int) -> dict[str, float]:
        counts = list(range(2, min(U, p, m) + 1))
        t0 = time.process_time()
        one = _bubble_bound(units, None, p, m, inc, "1f1b", ns)
        t1 = time.process_time()
        if not counts:
            return {"one_f_one_b": one, "zb_least_count": float("nan"), "one_f_one_b_cpu_seconds": t1 - t0}
        cut = _minmax_cuts(units, p, counts, granule=ns)
        zb = _zb_bubble_counts(units, fwd, p, m, inc, counts, ns, cut)
        return {"one_f_one_b": one, "zb_least_count": min(zb.values()), "one_f_one_b_cpu_seconds": t1 - t0,
                "zb_cpu_seconds": time.process_time() - t1}

    seen: dict[int, dict[int, np.ndarray]] = {}
    rows = []
    for m in args.m:
        t0 = time.process_time()
        units = {q: np.asarray(floors.unit(q, m)) for q in sizes}
        fwd = floors.forward_units(m)
        t1 = time.process_time()
        dev = np.array([model.device_seconds(m, u, u + 1) for u in range(U)])
        plain = {q: dev / q for q in sizes}
        row = {"model": args.model, "devices": p, "micro_batches": m, "incumbent_seconds": inc, "sizes": len(sizes),
               "units": U, "unit_bounds_cpu_seconds": t1 - t0,
               "step_floor": m * float(dev.sum()) / p,
               "one_stage_bound": m * float(units[p].sum()),
               "least_work_ratio": min(float((q * units[q]).sum() / dev.sum()) for q in sizes),
               "with_unit_bounds": bubbles(units, fwd, m),
               "with_device_seconds": bubbles(plain, fwd, m)}
        t2 = time.process_time()
        row["bubble_cpu_seconds"] = t2 - t1
        earlier = [m0 for m0 in seen if m % m0 == 0 and m0 < m]
        if earlier:
            row["scaling_min_ratio"] = {str(m0): min(float(np.min(m * units[q] / (m0 * seen[m0][q])))
                                                     for q in sizes) for m0 in earlier}
            m0 = min(earlier)
            row["bubbles_from_scaled"] = {"from": m0, **bubbles({q: seen[m0][q] * m0 / m for q in sizes}, fwd, m)}
        # on whole nodes: below a node only the device-seconds term is used, so q l_q = D there (ratio 1)
        ratios = [(float(np.min(q * units[q] / (r * units[r]))), r, q) for q in sizes for r in sizes
                  if ns <= r < q and q % r == 0]
        low = min(ratios)
        row["size_min_ratio"] = {"ratio": low[0], "smaller": low[1], "larger": low[2]}
        seen[m] = units
        rows.append(row)
        print(row, flush=True)
    # every count of the planner, from the first count's bounds scaled (the hypothesis above; not a proof): the
    # 1F1B bubble bound, ZB-H1's over every cut at once (one DP, no per-count layer) and the work bound
    # m sum_i q_i l_i / p (every schedule's step is at least m t_max), each the least over the capped cuts
    from shardplan.planner import micro_batch_counts
    from shardplan.pipeline.search import FAMILY_SAFETY, _capped_sum_cut, _zb_bubble_weights

    m0 = args.m[0]
    scaled = []
    for m in micro_batch_counts(None, spec.batch):
        if m % m0:
            continue
        t0 = time.process_time()
        units = {q: seen[m0][q] * m0 / m for q in sizes}
        fwd = floors.forward_units(m)
        one = _bubble_bound(units, None, p, m, inc, "1f1b", ns)
        zb = float("nan")
        if m >= 2:
            w, lim = _zb_bubble_weights(units, fwd, p, m)
            zb = min(inc, _capped_sum_cut(w, lim, inc / m, p, ns) * FAMILY_SAFETY)
        work = min(inc, _capped_sum_cut({q: m * q * u / p for q, u in units.items()}, units, inc / m, p, ns)
                   * FAMILY_SAFETY)
        scaled.append({"micro_batches": m, "from": m0, "step_floor": model.step_floor(m), "one_f_one_b": one,
                       "zb_every_cut": zb, "work": work, "cpu_seconds": time.process_time() - t0})
        print(scaled[-1], flush=True)
    write_result("bench_unstarted_bounds", args.out, rows, load_average_at_start=load0,
                 load_average_at_end=os.getloadavg(), scaled_every_count=scaled)


if __name__ == "__main__":
    main()
