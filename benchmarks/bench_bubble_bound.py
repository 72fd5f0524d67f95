"""The part bounds with and without the pipeline's fill and drain (JSON; docs/pipeline.md, *Bubble bounds*).

For one model, machine and micro-batch count, with the planner's stage options (memory choices, the zoo model's
cutoff) and an incumbent step: the solve-free unit bounds on every sub-mesh size, then 1F1B's part bound (the old
family bound and the bubble bound against the incumbent) and ZB-H1's per stage count (the old m B_0 and the
bubble bound), the counts each leaves open, and the CPU seconds of each step. Nothing is solved.

Run: ``PYTHONPATH=. python benchmarks/bench_bubble_bound.py [--model gpt3-175b] [-p 1024] [--m 96]
[--incumbent 6.0835311280585795] [--out benchmarks/results/bubble_bound.json]``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial

from benchmarks.record import write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("-p", type=int, default=1024)
    ap.add_argument("--m", type=int, default=96)
    ap.add_argument("--incumbent", type=float, default=6.0835311280585795, help="the best step known (s)")
    ap.add_argument("--out", default="benchmarks/results/bubble_bound.json")
    args = ap.parse_args()

    from shardplan.machine import preset
    from shardplan.models import get_model, model_spec
    from shardplan.pipeline.api import seed_model
    from shardplan.pipeline.floors import UnitFloors
    from shardplan.pipeline.search import (FAMILY_SAFETY, PipelineSpace, _bubble_bound, _minmax_cuts,
                                           _one_f_one_b_family_bound, _zb_bubble_counts)

    load0 = os.getloadavg()
    spec = model_spec(args.model)
    machine = preset("h100", args.p)
    model = seed_model(partial(get_model, args.model), spec.batch, machine, memory_choices=True, cutoff=spec.cutoff)
    floors = UnitFloors(model)
    ns = machine.levels[0] if len(machine.levels) > 1 else args.p  # devices per node (innermost level)
    space = PipelineSpace(num_units=model.num_units, num_devices=args.p, node_size=ns)
    sizes = [q for q in space.allowed_sizes() if q <= args.p]
    m, inc = args.m, args.incumbent
    t0 = time.process_time()
    units = {q: floors.unit(q, m) for q in sizes}
    fwd = floors.forward_units(m)
    t1 = time.process_time()
    old_1f1b = _one_f_one_b_family_bound(units, args.p, m, ns)
    t2 = time.process_time()
    new_1f1b = _bubble_bound(units, None, args.p, m, inc, "1f1b", ns)
    t3 = time.process_time()
    counts = list(range(2, min(model.num_units, args.p, m) + 1))
    cut = _minmax_cuts(units, args.p, counts, granule=ns)
    t4 = time.process_time()
    bubble = _zb_bubble_counts(units, fwd, args.p, m, inc, counts, ns, cut)
    t5 = time.process_time()
    old_zb = {n: m * cut[n] * FAMILY_SAFETY for n in counts}
    new_zb = {n: max(min(old_zb[n], inc), bubble[n]) for n in counts}
    rows = [{
        "model": args.model, "devices": args.p, "micro_batches": m, "incumbent_seconds": inc,
        "sizes": len(sizes), "units": model.num_units, "cutoff": spec.cutoff,
        "one_f_one_b_old": old_1f1b, "one_f_one_b_bubble": max(min(old_1f1b, inc), new_1f1b),
        "zb_part_old": min(old_zb.values()), "zb_part_bubble": min(new_zb.values()),
        "zb_counts_open_old": [n for n in counts if old_zb[n] < inc * (1 - 1e-12)],
        "zb_counts_open_bubble": [n for n in counts if new_zb[n] < inc * (1 - 1e-12)],
        "zb_count_old": {str(n): v for n, v in old_zb.items() if math.isfinite(v)},
        "zb_count_bubble": {str(n): v for n, v in new_zb.items()},
        "cpu_seconds": {"unit_bounds": t1 - t0, "one_f_one_b_old": t2 - t1, "one_f_one_b_bubble": t3 - t2,
                        "zb_minmax_cuts": t4 - t3, "zb_bubble_counts": t5 - t4},
    }]
    write_result("bench_bubble_bound", args.out, rows, load_average_at_start=load0, load_average_at_end=os.getloadavg())


if __name__ == "__main__":
    main()
