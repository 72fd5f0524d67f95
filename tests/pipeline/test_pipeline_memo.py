"""The 1F1B stage DP over in-flight classes (every stage count in one DP) and the bounded memory of its memo."""

from __future__ import annotations

import gc
import math
import random
import weakref

import pytest

from shardplan.pipeline.search import PipelineSpace, StageCost, _stage_dp, brute_force_pipeline, search_pipeline


def _values(seed: int, U: int, p: int, m: int):
    """A random stage value depending on the units, the size, whether the cuts cross a node, the in-flight count
    min(r, m) and whether the stage is last (what 1F1B's stage values depend on), growing with the extent."""
    rng = random.Random(seed)
    unit = [rng.uniform(0.5, 2.0) for _ in range(U)]
    eff = {q: rng.uniform(0.5, 1.0) for q in range(1, p + 1)}
    extra = {k: rng.uniform(0.0, 0.2) for k in range(1, m + 1)}

    def stage(a, b, o, q, r):
        k = min(r, m)
        if (a * 7 + q + k) % 11 == 0:
            return None  # a stage that cannot be costed
        v = sum(unit[a:b]) / (q * eff[q]) + extra[k] + (0.3 if r == 1 else 0.0) + (0.05 if o % 4 == 0 else 0.0)
        return v

    def between(b, o, q, q2):
        return 0.01 * b / min(q, q2) + (0.1 if (o + q) % 4 == 0 else 0.0)

    return stage, between


@pytest.mark.parametrize("seed", range(8))
def test_class_dp_equals_the_least_over_stage_counts(seed):
    """One DP over the classes min(stages left, m) gives the least over every stage count of the DP with exactly
    n stages, with and without charges between the stages, and its pipeline attains it."""
    U, p, m = 6, 8, [1, 2, 3, 5][seed % 4]
    space = PipelineSpace(U, p, 4)
    sizes = list(space.allowed_sizes())
    stage, between = _values(seed, U, p, m)
    for link in (None, between):
        per_n = [_stage_dp(space, n, sizes, stage, link, {}, "states") for n in range(1, min(U, p) + 1)]
        want = min((g[0] for g in per_n if g is not None), default=math.inf)
        got = _stage_dp(space, 0, sizes, stage, link, {}, "states", classes=m)
        assert got is not None and got[0] == pytest.approx(want, rel=1e-12)
        segs = got[1]
        n = len(segs)
        again = sum(stage(a, b, o, q, n - i) for i, (a, b, o, q) in enumerate(segs))
        if link is not None:
            again += sum(2 * link(segs[i][1], segs[i][2], segs[i][3], segs[i + 1][3]) for i in range(n - 1))
        assert again == pytest.approx(got[0], rel=1e-12)
        assert segs[0][0] == 0 and segs[-1][1] == U and segs[-1][2] + segs[-1][3] == p


@pytest.mark.parametrize("seed", range(6))
def test_search_with_max_stages_or_uniform_equals_brute_force(seed):
    """The 1F1B search with a largest stage count or uniform stages (one DP per count, each with its own floor)
    against brute force over every cut, tiling and m."""
    from tests.pipeline.test_pipeline import _exchange, _random_instance

    U, p, ns = 5, 8, 4
    stage_fn, link_fn = _random_instance(seed + 60, U, p, ns)
    space = PipelineSpace(U, p, ns, micro_batches=(1, 2, 4), budget=[None, 6.0][seed % 2],
                          max_stages=[2, 3, None][seed % 3], uniform=seed >= 3)
    for exchange in (None, _exchange):
        want = brute_force_pipeline(space, stage_fn, link_fn, exchange=exchange)
        got = search_pipeline(space, stage_fn, link_fn, schedules=("1f1b",), exchange=exchange)
        assert got.step_time == pytest.approx(want.step_time, rel=1e-12)
        assert got.num_stages <= (space.max_stages or U)
        if space.uniform:
            assert len({s.devices for s in got.stages}) == 1


def _chain(U: int):
    def stage_fn(a, b, q, m):
        t = (b - a) / q / m + 0.01 * (b - a)
        return StageCost(t / 3, 2 * t / 3, (b - a) / q, 0.2 * (b - a) / q / m, None, 0.01 / q, 0.01 / q, t / 3)

    return stage_fn


@pytest.mark.parametrize("m", [1, 2])
def test_memo_is_bounded_by_the_classes_not_the_stage_counts(m):
    """The DP's memo holds at most (units + 1) x (offsets) x m classes x (sizes + 1) states per bound, however
    many stage counts the units allow (one layer per stage count would hold up to min(U, p) of them), and at
    most two memos are held at once (the unbounded one and the current bound's): a closed bound's memo is
    released. The answer is brute force's."""
    U, p, ns = 12, 8, 4
    stage_fn = _chain(U)
    space = PipelineSpace(U, p, ns, micro_batches=(m,))
    got = search_pipeline(space, stage_fn, lambda *a: 0.0, schedules=("1f1b",), exchange=lambda x, inter: x)
    sizes = space.allowed_sizes()
    held = got.stats["dp_memos_held_max"]
    assert 1 <= held <= 2
    # one DP layer per stage count (up to 8 here) would hold 1,203 states at m = 1, over this bound (585)
    assert got.stats["dp_memo_peak_entries"] <= held * (U + 1) * (p + 1) * m * (len(sizes) + 1)
    want = brute_force_pipeline(space, stage_fn, lambda *a: 0.0, exchange=lambda x, inter: x)
    assert got.step_time == pytest.approx(want.step_time, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_memo_keeps_only_states_that_can_start(seed):
    """A state whose first stage cannot be placed at its offset, or leaves the stages after it too few devices,
    or is a last stage not ending at the last device, is worth infinity: the DP (exactly n stages, and the
    classes) never keeps it, and still answers the least over every stage count of brute force's optimum."""
    from shardplan.pipeline.search import _placeable

    U, p, ns, m = 6, 8, 4, [1, 2, 3][seed % 3]
    space = PipelineSpace(U, p, ns)
    sizes = list(space.allowed_sizes())
    stage, between = _values(seed, U, p, m)
    for link in (None, between):
        per_n = []
        for n, classes in [(k, None) for k in range(1, min(U, p) + 1)] + [(0, m)]:
            memo: dict = {}
            got = _stage_dp(space, n, sizes, stage, link, {}, "s", memo, classes=classes)
            if classes is None:
                per_n.append(math.inf if got is None else got[0])
            else:
                assert got is not None and got[0] == min(per_n)
            for key in memo:
                if len(key) == 4:
                    _, o, r, q = key
                    last = r == 1 and (classes is None or m > 1)
                    assert _placeable(o, q, p, ns) and o + q + (r - 1) * min(sizes) <= p
                    assert o + q == p or not last
            assert any(len(key) == 4 for key in memo)


@pytest.mark.parametrize("seed", range(6))
def test_class_dp_leaves_out_states_without_completion(seed):
    """The class DP with the device-seconds test (``reachable``: the units left need more device-seconds than the
    devices left give under a limit that every stage taken respects) answers the same value and stages as without
    it, keeps no state it rules out and no state whose class asks for more stages than units are left, and holds
    fewer states than without the test (the 1F1B floor at m = 96 on GPT-3 175B on 1,024 h100 held 3.8 GB
    without it: docs/pipeline.md, *The memo's memory*)."""
    from shardplan.pipeline.search import _BREAK

    U, p, ns, m = 8, 16, 4, [2, 3, 5][seed % 3]
    space = PipelineSpace(U, p, ns)
    sizes = list(space.allowed_sizes())
    stage, between = _values(seed, U, p, m)
    rng = random.Random(seed)
    unit = [rng.uniform(0.5, 2.0) for _ in range(U)]
    lower = {q: [x / q for x in unit] for q in sizes}  # a bound per unit and size: device-seconds over q
    limit = sum(unit) / p * rng.uniform(1.2, 2.5)
    work = [min(q * lower[q][u] for q in sizes) for u in range(U)]
    left = [sum(work[a:]) for a in range(U + 1)]

    def floor(a, b, q):
        lo = sum(lower[q][a:b])
        return _BREAK if lo > limit else lo

    def capped(a, b, o, q, r):
        v = stage(a, b, o, q, r)
        return v if v is None or sum(lower[q][a:b]) <= limit else _BREAK

    def reachable(a, o):
        return left[a] <= (p - o) * limit * (1 + 1e-9)

    for link in (None, between):
        got = {}
        memos = {}
        for test in (None, reachable):
            memos[test] = memo = {}
            stats: dict = {}
            got[test] = _stage_dp(space, 0, sizes, capped, link, stats, "s", memo, classes=m, floor=floor,
                                  reachable=test)
        assert got[reachable] == got[None]
        assert len(memos[reachable]) < len(memos[None])
        for key in memos[reachable]:
            assert key[0] + key[2] <= U and reachable(key[0], key[1])


class _Memo(dict):
    """A memo that a weak reference can watch."""


def test_memo_is_freed_when_the_dp_returns():
    """The stage DP's memo (ZB-H1's per box, 1F1B's per bound) goes as soon as its last holder drops it, by
    reference counting alone, also after an interrupt from inside the DP: the DP's recursive closures would
    otherwise keep it in a reference cycle until a full cyclic collection, which a memo of untracked tuples
    rarely triggers (GPT-3 175B on 1,024 h100 grew by the memo of every box, 6 GB in 120 CPU s;
    docs/pipeline.md, *The memo's memory*). ZB-H1's DP, whose memo is its own, leaves nothing to collect."""
    from shardplan.pipeline.search import _StagePool, _zb_dp
    from tests.pipeline.test_pipeline_floors import _instance

    U, p, m = 6, 8, 3
    space = PipelineSpace(U, p, 4)
    sizes = list(space.allowed_sizes())
    stage, between = _values(0, U, p, m)

    calls = [0]

    def stopping(after: int):
        """The stage values, with an interrupt (as Ctrl-C) at the call ``after`` (0: never); counts the calls."""
        calls[0] = 0

        def stage_or_stop(a, b, o, q, r):
            calls[0] += 1
            if calls[0] == after:
                raise KeyboardInterrupt
            return stage(a, b, o, q, r)
        return stage_or_stop

    gc.collect()
    gc.disable()
    try:
        for n, classes in ((3, None), (0, m)):
            for link in (None, between):
                whole = 0
                for interrupt in (False, True):
                    memo = _Memo()
                    ref = weakref.ref(memo)
                    try:
                        got = _stage_dp(space, n, sizes, stopping(whole // 2 if interrupt else 0), link, {}, "s",
                                        memo, classes=classes)
                        assert got is not None and not interrupt
                        whole = calls[0]
                    except KeyboardInterrupt:
                        assert interrupt
                    assert len(memo) > 0
                    del memo
                    assert ref() is None
        stage_fn, fit_fn, link_fn, lower = _instance(1, U, p)
        pool = _StagePool(stage_fn, fit_fn, 8, math.inf, {}, stage_lower=lower)
        stats: dict = {}
        assert _zb_dp(pool, space, 3, None, link_fn, None, math.inf, 0.0, 0.0, stats) is not None
        assert stats["zb_dp_states"] > 0
        assert gc.collect() == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("seed", range(12))
def test_minmax_cuts_share_one_dp_and_granules_relax(seed):
    """The min-max cut of every stage count from one DP equals each count's own (a direct enumeration over
    cuts and size sequences), and counting devices in granules gives a lower bound of it."""
    import itertools

    from shardplan.pipeline.search import _minmax_cuts, submesh_sizes

    rng = random.Random(seed)
    U, p = rng.randint(1, 6), rng.choice([4, 8])
    sizes = [q for q in submesh_sizes(p, rng.choice([2, 4])) if rng.random() < 0.8] or [p]
    units = {q: [rng.uniform(0.0, 1.0) / q for _ in range(U)] for q in sizes}
    counts = range(1, 6)
    got = _minmax_cuts(units, p, counts)
    coarse = _minmax_cuts(units, p, counts, granule=2)
    for n in counts:
        want = math.inf
        for cuts in itertools.combinations(range(1, U), n - 1):
            bounds = (0, *cuts, U)
            for qs in itertools.product(sizes, repeat=n):
                if sum(qs) == p:
                    want = min(want, max(sum(units[q][bounds[i]:bounds[i + 1]]) for i, q in enumerate(qs)))
        assert got[n] == pytest.approx(want, rel=1e-12) if math.isfinite(want) else got[n] == math.inf
        assert coarse[n] <= want * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_min_sum_cut_of_two_or_more_runs(seed):
    """The least sum of unit seconds over cuts into two or more runs whose sizes sum to p equals enumeration;
    counting devices in granules gives a lower bound of it."""
    import itertools

    from shardplan.pipeline.search import _min_sum_cut, submesh_sizes

    rng = random.Random(100 + seed)
    U, p = rng.randint(1, 6), rng.choice([4, 8])
    sizes = [q for q in submesh_sizes(p, rng.choice([2, 4])) if rng.random() < 0.8] or [p]
    units = {q: [rng.uniform(0.0, 1.0) / q for _ in range(U)] for q in sizes}
    want = math.inf
    for n in range(2, U + 1):
        for cuts in itertools.combinations(range(1, U), n - 1):
            bounds = (0, *cuts, U)
            for qs in itertools.product(sizes, repeat=n):
                if sum(qs) == p:
                    want = min(want, sum(sum(units[q][bounds[i]:bounds[i + 1]]) for i, q in enumerate(qs)))
    got = _min_sum_cut(units, p)
    assert got == pytest.approx(want, rel=1e-12) if math.isfinite(want) else got == math.inf
    assert _min_sum_cut(units, p, granule=2) <= want * (1 + 1e-12)
