"""Flax's attention planned and run with the ring on 8 simulated devices: the linen (``nn.SelfAttention``,
``nn.make_causal_mask``) and nnx (``nnx.MultiHeadAttention``, ``nnx.make_causal_mask``) language models of
flax_attention_cases (one sequence of 64 tokens) and the 3-D ``jax.nn.dot_product_attention`` of test_flax_attention, planned with
``context="ring"`` on the toy machine: every attention's query sequence is split and runs the ring
(collective-permutes in the compiled step), loss and gradients equal to the unsharded program (loss 1e-5
relative, every gradient entry 1e-4 of the largest gradient entry, as the corpus: the keys' bias has
no gradient but rounding's)."""

from __future__ import annotations

import jax
import pytest
from conftest import require_8_devices
from flax_attention_cases import linen_lm, nnx_lm
from jax_attention_cases import TOY
from test_flax_attention import three_d_inputs, three_d_loss
from jax_compare import max_abs, max_abs_diff  # noqa: E402

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
# one sequence of 64 tokens: on the toy machine the plan splits it 4 ways (and the heads 2), which pays
# for the ring and its deal; at 2 x 32 it splits the batch instead
CASES = {"linen": lambda: linen_lm(batch=(1, 64)), "nnx": lambda: nnx_lm(batch=(1, 64)),
         "3-D": lambda: (three_d_loss, *three_d_inputs())}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_ring_runs_equal_to_the_unsharded_program(case):
    import shardplan.jax as sj
    from shardplan.jax.run import ring_hooks

    loss_fn, params, batch = CASES[case]()
    plan = sj.plan(loss_fn, params, batch, DEVICES, TOY, context="ring")
    run = sj.apply(plan, loss_fn, params, batch, DEVICES)
    attn = [op for op in run.plan.graph.operators if op.kind == "attn_flash"]
    assert attn and all(op.causal is not None for op in attn)
    for op in attn:  # the queries' sequence (the causal mask's query dimension) split
        assert run.plan.layouts[op.name].split[[d for d, _ in op.dims].index(op.causal.query)] > 1, op.name
    consume, replace = ring_hooks(run.plan, run.info, DEVICES)
    assert len(replace) == len(attn) and len(consume) == 2 * len(attn)
    step = run.step.lower(params, batch).compile()
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    largest = max(max_abs(r) for r in jax.tree.leaves(ref_grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert max_abs_diff(g, r) <= 1e-4 * largest
    hlo = step.as_text()
    assert hlo.count("collective-permute-start") + hlo.count("collective-permute(") > 0
