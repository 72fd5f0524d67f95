"""A plan searched with overlapped tensor-parallel collectives (``overlap_tp=True``) runs on 8 simulated devices
with the unsharded program's loss and gradients.

The residual MLP of test_partial_jax (two column- then row-parallel pairs, RMS norms), planned by ``sj.plan``
on the toy machine: without the overlap the search mixes data and tensor parallelism with nothing partial;
with it the products can hide their gathers and reduce-scatters, and the optimum is Megatron-LM's sequence
parallelism (partial layouts, the norms and additions split over the sequence), the hidden edges counted in
the plan. The run is the plan's layouts: the overlap is a cost the search weighs (the chunked collective
matmul is XLA's or the runtime's schedule, not a different program), so what must hold is that the plan it
picks computes the same step.
"""

from __future__ import annotations

import jax
import pytest

from conftest import require_8_devices
from jax_compare import max_abs, max_abs_diff  # noqa: E402
from test_partial_jax import B, D, S, TOY, init, loss_fn  # noqa: E402  (the same residual MLP)

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()


def test_the_plan_searched_with_overlap_is_sequence_parallel_and_runs_as_unsharded():
    import shardplan.jax as sj

    params = init(jax.random.PRNGKey(0))
    batch = (jax.random.normal(jax.random.PRNGKey(1), (B, S, D)), jax.random.normal(jax.random.PRNGKey(2), (B, S, D)))
    plain = sj.plan(loss_fn, params, batch, DEVICES, TOY, fit=False, stages=False)
    plan = sj.plan(loss_fn, params, batch, DEVICES, TOY, fit=False, stages=False, overlap_tp=True)
    chosen = {n: c.layout for n, c in plan.stages[0].operators.items()}
    assert not any(c.layout.partial for c in plain.stages[0].operators.values())
    assert sum(lay.partial for lay in chosen.values()) == 3  # two row-parallel outputs, one input gradient
    assert plan.stats["overlap_tp"]["edges"] == 3 and plan.stats["overlap_tp"]["hidden_seconds"] > 0
    assert plan.step_time < plain.step_time
    # every operator that is not a product splits the sequence 8 ways (the norms, additions and the loss)
    for name, lay in chosen.items():
        if not name.startswith("dot_general"):
            assert lay.split[1] == 8, (name, lay.describe())
    run = sj.apply(plan, loss_fn, params, batch, DEVICES)
    loss, grads = run.step(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for k in params:
        assert max_abs_diff(grads[k], ref_grads[k]) <= 1e-5 * max_abs(ref_grads[k]), k
