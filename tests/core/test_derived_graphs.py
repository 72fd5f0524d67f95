"""Graphs derived from a graph (a stage's sub-graph, a renamed copy) keep every field of :class:`Graph`.

The pipeline path derives graphs twice: the traced graph renamed into units
(:func:`shardplan.jax.staged.scoped_trace`) and each stage's sub-graph
(:meth:`ModelStages.subgraph`, :meth:`ModelStages.subgraph_of`, the rewired
pieces of :meth:`ModelStages.stage_cost_of_run`). A user's ``jax.checkpoint``
reaches the stage costs only if ``Graph.recomputed`` survives both.
"""

from __future__ import annotations

import dataclasses

import pytest

from shardplan import GraphBuilder, ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph
from shardplan.machine import Machine

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

# the fields a derived graph must carry; a new field of Graph must be carried by Graph.derive and Graph.renamed
CARRIED = {"name", "operators", "graph_inputs", "ties", "recomputed"}


def _hand_made() -> Graph:
    """x -> l1 -> l2 -> l3 -> l4: l1..l3 tied (one description), l2 reads l1's weight, l2 and l3 recomputed."""
    b = GraphBuilder("hand")
    x = b.input("x", (64, 32))
    h = b.add(ops.dense("l1", x, 32))
    l2 = ops.dense("l2", h, 32)
    l2 = dataclasses.replace(l2, weights=(dataclasses.replace(l2.weights[0], owner=("l1", l2.weights[0].name)),))
    h = b.add(l2)
    h = b.add(ops.dense("l3", h, 32))
    b.add(ops.dense("l4", h, 16))
    return dataclasses.replace(b.build(), ties=(("l1", "l2", "l3"),), recomputed=frozenset({"l2", "l3"}))


def _fields(g: Graph, f: str):
    """Field ``f`` of ``g``, operators by their description (Operator compares by identity)."""
    if f == "operators":
        return tuple(tuple(getattr(op, x.name) for x in dataclasses.fields(op)) for op in g.operators)
    return getattr(g, f)


def test_graph_has_no_field_a_derived_graph_would_drop():
    assert {f.name for f in dataclasses.fields(Graph) if f.init} == CARRIED


def test_derive_restricts_every_field_to_the_operators_kept():
    g = _hand_made()
    assert len(g.weight_edges) == 1
    sub = g.derive([g["l2"], g["l3"], g["l4"]], "hand[1:4]")
    assert sub.name == "hand[1:4]"
    assert [op.name for op in sub.operators] == ["l2", "l3", "l4"]
    assert sub.graph_inputs == {"l1": (64, 32)}  # the earlier operator's output becomes an input
    assert sub.ties == (("l2", "l3"),)
    assert sub.recomputed == {"l2", "l3"}
    assert sub["l2"].weights[0].owner is None and not sub.weight_edges  # its owner is outside: its own copy
    tail = g.derive([g["l3"], g["l4"]])
    assert tail.name == "hand" and tail.ties == () and tail.recomputed == {"l3"}  # a one-member tie is no tie
    head = g.derive([g["l1"], g["l2"]])
    assert head.graph_inputs == {"x": (64, 32)} and head.ties == (("l1", "l2"),) and head.recomputed == {"l2"}
    assert head["l2"].weights[0].owner == ("l1", g["l2"].weights[0].name) and len(head.weight_edges) == 1
    whole = g.derive(g.operators)
    for f in CARRIED:
        assert _fields(whole, f) == _fields(g, f), f
    with pytest.raises(ShardplanError, match="no operator 'zz'"):
        g.derive([dataclasses.replace(g["l4"], name="zz")])


def test_renamed_renames_every_field():
    g = _hand_made()
    ren = {"l1": "A/l1", "l2": "A/l2", "l3": "B/l3", "x": "data"}
    r = g.renamed(ren)
    assert r.name == "hand" and g.renamed(ren, "other").name == "other"
    assert [op.name for op in r.operators] == ["A/l1", "A/l2", "B/l3", "l4"]
    assert r.graph_inputs == {"data": (64, 32)}
    assert [t.src for op in r.operators for t in op.inputs] == ["data", "A/l1", "A/l2", "B/l3"]
    assert r["A/l2"].weights[0].owner == ("A/l1", g["l2"].weights[0].name)
    assert r.ties == (("A/l1", "A/l2", "B/l3"),)
    assert r.recomputed == {"A/l2", "B/l3"}
    assert r.edges == g.edges and r.weight_edges == g.weight_edges
    for f in CARRIED - {"name"}:  # every field that names operators is renamed, none left at its default
        assert getattr(r, f), f
    back = r.renamed({v: k for k, v in ren.items()})
    for f in CARRIED:
        assert _fields(back, f) == _fields(g, f), f


# ---------------------------------------------------------------------------
# the stage search sees a user's jax.checkpoint
# ---------------------------------------------------------------------------
def _chain_model(batch: int) -> Graph:
    """Five equal blocks L0..L4 of one dense layer each; L2's operator is recomputed by the program."""
    b = GraphBuilder("chain")
    h = b.input("x", (batch, 64))
    for i in range(5):
        h = b.add(ops.dense(f"L{i}/fc", h, 64))
    return dataclasses.replace(b.build(), recomputed=frozenset({"L2/fc"}))


def test_a_recomputed_block_is_not_costed_as_its_saving_twin():
    """L2 (recomputed) and L3 (saving) differ only in Graph.recomputed, and so do their neighbours: their
    stages are costed apart, not shared as segments of one description."""
    from shardplan.pipeline.stages import ModelStages

    st = ModelStages(_chain_model, 16, Machine(2, peak_flops=32e9, bandwidth=16e9), {"cutoff": 1})
    assert st.subgraph(2, 3, 1).recomputed == {"L2/fc"} and not st.subgraph(3, 4, 1).recomputed
    rec, plain = st.stage_cost(2, 3, 2, 1), st.stage_cost(3, 4, 2, 1)
    assert rec.activation_bytes == 0.0 < plain.activation_bytes
    assert rec.detail.graph.recomputed == {"L2/fc"} and not plain.detail.graph.recomputed
    assert st.solves == 2


def _ckpt_loss(blocks: frozenset[int], outer: str | None = None):
    """The tiny language model of test_pipeline_jax with the blocks ``blocks`` under jax.checkpoint, all of it
    inside the name scope ``outer`` if given (then :func:`scoped_trace` renames every operator)."""
    import contextlib

    import jax
    import jax.numpy as jnp

    def block(h, blk):
        z = h * blk["g"] / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return h + jnp.tanh(z @ blk["w1"]) @ blk["w2"]

    def loss(p, batch):
        ids, y = batch
        with jax.named_scope(outer) if outer else contextlib.nullcontext():
            with jax.named_scope("embed"):
                h = p["embed"][ids]
            for i, blk in enumerate(p["blocks"]):
                with jax.named_scope(f"L{i}"):
                    h = (jax.checkpoint(block) if i in blocks else block)(h, blk)
            with jax.named_scope("head"):
                lp = jax.nn.log_softmax(h @ p["head"])
                return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))

    return loss


def _stages(blocks: frozenset[int], memory_choices: bool = False, outer: str | None = "model"):
    from test_pipeline_jax import B, _gpt_params, _tokens, _toy

    from shardplan.jax.staged import Tracer
    from shardplan.pipeline.stages import ModelStages

    tracer = Tracer(_ckpt_loss(blocks, outer), _gpt_params(), _tokens())
    return ModelStages(tracer, B, _toy(), {"cutoff": 1, "divides_p": True}, memory_choices=memory_choices)


def test_scoped_trace_keeps_the_users_checkpoint():
    from test_pipeline_jax import _gpt_params, _tokens

    from shardplan.jax.lower import trace
    from shardplan.jax.staged import _unit_names, scoped_trace

    loss, params, batch = _ckpt_loss(frozenset({0, 1, 2, 3}), outer="model"), _gpt_params(), _tokens()
    raw, _ = trace(loss, params, batch, params_argnums=(0,))
    scoped, _ = scoped_trace(loss, params, batch)
    ren = _unit_names([op.name for op in raw.operators])
    assert all(n.startswith("model/") for n in raw.index) and not any(n.startswith("model") for n in scoped.index)
    assert raw.recomputed, "the blocks' operators inside jax.checkpoint are recomputed"
    assert scoped.recomputed == {ren[n] for n in raw.recomputed}
    assert {n.split("/")[0] for n in scoped.recomputed} == {"L0", "L1", "L2", "L3"}


@pytest.mark.parametrize("outer", [None, "model"])
def test_stage_costs_honour_the_users_checkpoint(outer):
    """Stage sub-graphs keep Graph.recomputed; a checkpointed stage saves fewer activation bytes, and its
    memory-constrained plan recomputes those operators and pays for it in the backward. ``outer``: with a
    shared name scope the traced graph is renamed into units first (:func:`scoped_trace`)."""
    every = frozenset({0, 1, 2, 3})
    ck, plain = _stages(every, True, outer), _stages(frozenset(), True, outer)
    g = ck.graph(1)[0]
    assert g.recomputed
    sub = ck.subgraph(1, 3, 1)  # blocks L0, L1
    assert sub.recomputed == {op.name for op in sub.operators if op.name in g.recomputed}
    assert {n.split("/")[0] for n in sub.recomputed} == {"L0", "L1"}
    assert not plain.subgraph(1, 3, 1).recomputed

    c, p = ck.stage_cost(1, 3, 2, 1), plain.stage_cost(1, 3, 2, 1)
    assert c.detail.graph.recomputed == sub.recomputed
    assert c.activation_bytes < p.activation_bytes
    assert c.weight_bytes == p.weight_bytes and c.forward == pytest.approx(p.forward)

    fc, fp = ck.fit_cost(1, 3, 2, 1, 1, 1e12), plain.fit_cost(1, 3, 2, 1, 1, 1e12)
    plan = fc.detail
    marked = {op.name for i, op in enumerate(plan.graph.operators) if plan.memory_choices.recompute(i)}
    assert sub.recomputed <= marked
    assert not any(fp.detail.memory_choices.recompute(i) for i in range(len(fp.detail.graph.operators)))
    assert plan.breakdown["recompute"] > 0.0 and fc.backward > fp.backward
    assert fc.activation_bytes < fp.activation_bytes

    # the rewired pieces of a cut run (the units after the cut read the last kept one) keep them too
    cut = ck.stage_cost_of_run(0, 6, 1, 5, 2, 2, 1)
    names = {op.name for op in cut.detail.graph.operators}
    assert cut.detail.graph.recomputed == names & g.recomputed
    assert cut.activation_bytes < plain.stage_cost_of_run(0, 6, 1, 5, 2, 2, 1).activation_bytes
    # a device group's chunks (interleaved schedule)
    two = ck.subgraph_of(((1, 2), (3, 4)), 1)
    assert {n.split("/")[0] for n in two.recomputed} == {"L0", "L2"}


def test_searched_pipeline_with_checkpointed_blocks_runs():
    """The searched pipeline's stage plans keep the checkpointed operators and the staged step equals the
    unsharded one."""
    from test_pipeline_jax import _assert_equal_to_unsharded, _gpt_params, _tokens, _toy

    from conftest import require_8_devices
    from shardplan.jax.staged import pipeline

    require_8_devices()
    loss, params, batch = _ckpt_loss(frozenset({0, 1, 2, 3}), outer="model"), _gpt_params(), _tokens()
    step = pipeline(loss, params, batch, machine=_toy(), sizes=(4,), micro_batches=(2,))
    assert step.plan.num_stages == 2
    rec = [st.plan.graph.recomputed for st in step.stages]
    assert all(rec), "each stage holds checkpointed blocks"
    for st, r in zip(step.stages, rec):
        assert r == {op.name for op in st.plan.graph.operators} & step.graph.recomputed
    _assert_equal_to_unsharded(step, loss, params, batch)
