"""A plan's ring on 8 simulated devices: the one-layer attention of jax_attention_cases (written with
``jax.nn.dot_product_attention``, causal, grouped-query), planned with ``context="ring"`` on the toy machine
(the attention's queries split 8 ways), run by ``sj.apply``: loss and gradients equal to the unsharded
program, and the compiled step passes keys and values around the ring (collective-permutes) where the same
layouts run without the ring all-gather them."""

from __future__ import annotations

import jax
import pytest

from conftest import require_8_devices
from jax_attention_cases import TOY, attention_loss, inputs
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()


def assert_equal_to_unsharded(loss, grads, params, batch):
    """Loss within 1e-5 relative and each gradient within 1e-4 of its largest entry of the unsharded program's."""
    ref_loss, ref_grads = jax.value_and_grad(attention_loss)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for name, r in ref_grads.items():
        assert max_abs_diff(grads[name], r) <= 1e-4 * max_abs(r), name


def test_the_planned_ring_runs_equal_to_the_unsharded_program_and_gathers_nothing():
    import shardplan.jax as sj
    from shardplan.jax.run import constrained_fn, ring_hooks
    from shardplan.jax.shardings import plan_shardings

    params, batch = inputs()
    plan = sj.plan(attention_loss, params, batch, DEVICES, TOY, context="ring")
    run = sj.apply(plan, attention_loss, params, batch, DEVICES)
    consume, replace = ring_hooks(run.plan, run.info, DEVICES)
    assert len(replace) == 1 and len(consume) == 2  # the attention runs the ring, keys and values read split
    step = run.step.lower(params, batch).compile()
    loss, grads = step(params, batch)
    assert_equal_to_unsharded(loss, grads, params, batch)
    hlo = step.as_text()
    assert "all-gather" not in hlo
    assert hlo.count("collective-permute-start") + hlo.count("collective-permute(") >= 2 * 7  # forward, backward
    # the deal (cost-model.md, "Dealt at the attention"): k, v in and dk, dv back, two half blocks each (the
    # ring passes whole blocks); the model charges 2 p2p(block / 2) per tensor
    from shardplan.jax.hlo import parse_collectives

    block = 1 * 128 * 2 * 8 * 4 // 8  # a device's block of keys: batch x sequence / 8 x 2 heads x 8 features, fp32
    halves = [c for c in parse_collectives(hlo, 8) if c.kind == "collective-permute" and c.nbytes == block // 2]
    assert len(halves) == 8 and sum(c.sent for c in halves) == 8 * block // 2

    sh = plan_shardings(run.plan, run.info, DEVICES)  # the same layouts, the keys and values gathered
    plain = jax.jit(jax.value_and_grad(constrained_fn(run.info, sh))).lower(params, batch).compile()
    assert "all-gather" in plain.as_text()
    ref_loss = float(attention_loss(params, batch))
    assert abs(float(plain(params, batch)[0]) - ref_loss) <= 1e-5 * abs(ref_loss)


def test_a_ring_over_two_levels_runs_over_both_mesh_axes():
    """On a two-level machine (2 nodes of 4) the attention's sequence is split over both levels (mesh axes
    ``s_node`` and ``s_device``); the ring the tables charge runs over the 8 devices of the two axes, row-major,
    rather than falling back to the all-gather: loss and gradients equal to the unsharded program, no
    all-gather in the compiled step."""
    from dataclasses import replace

    import shardplan.jax as sj
    from shardplan.jax.run import ring_charged, ring_hooks

    params, batch = inputs()
    plan = sj.plan(attention_loss, params, batch, DEVICES, replace(TOY, node_size=4, inter_bandwidth=16e9),
                   context="ring")
    run = sj.apply(plan, attention_loss, params, batch, DEVICES)
    (attn,) = [op for op in run.plan.graph.operators if op.kind == "attn_flash"]
    lay = run.plan.layouts[attn.name]
    assert lay.levels == (4, 2) and lay.dim_axes("s") == ("s_node", "s_device") and ring_charged(run.plan, attn.name)
    consume, replace_ = ring_hooks(run.plan, run.info, DEVICES)
    assert len(replace_) == 1 and len(consume) == 2
    step = run.step.lower(params, batch).compile()
    loss, grads = step(params, batch)
    assert_equal_to_unsharded(loss, grads, params, batch)
    hlo = step.as_text()
    assert "all-gather" not in hlo
    assert hlo.count("collective-permute-start") + hlo.count("collective-permute(") >= 2 * 7


def test_the_ring_runs_in_the_memory_choices_step_too():
    """Under a budget the plan carries memory choices (sharded state) and runs by :mod:`shardplan.jax.memory`'s
    step, which runs the ring as well: loss and gradients equal to the unsharded program."""
    import shardplan.jax as sj

    params, batch = inputs()
    free = sj.plan(attention_loss, params, batch, DEVICES, TOY, context="ring", fit=False)
    plan = sj.plan(attention_loss, params, batch, DEVICES, TOY, context="ring", budget=0.7 * free.memory["peak_bytes"])
    run = sj.apply(plan, attention_loss, params, batch, DEVICES)
    assert run.plan.memory_choices is not None
    assert [c.layout.split[1] for c in plan.operators.values() if c.kind == "attn_flash"] == [8]
    loss, grads = run.step(params, batch)
    assert_equal_to_unsharded(loss, grads, params, batch)


def test_pipeline_stages_run_their_ring():
    """Two attention layers, the pipeline search with ``context="ring"`` on sub-meshes of 4 (two stages, two
    micro-batches of one sequence): each stage splits its attention's queries 4 ways and its step runs the ring
    (on the stage's prime-factor mesh); loss and gradients equal to the unsharded program."""
    from jax_attention_cases import check_two_layer_pipeline

    check_two_layer_pipeline(DEVICES, 4, context="ring")
