"""The JAX stage runner reduces a ZeRO 0/1 weight's gradient once a step for every read the tiny GPT makes of its
weights (docs/jax.md, "What the stage programs send for a weight"): the blocks' matmuls and the head as before,
now also the embedding's gather, the RMS norms' scales, the tied embedding's transposed read and weights read through
a cast to bfloat16. On 4 stages of 2 devices, m = 4, the gradients equal the unsharded program's; counted in the
compiled HLO, no micro-batch's backward program sends anything and each stage's one reduction program a step
all-reduces its leaves' local tiles. Also: each per-device read's conditions and terms on meshes of 2 and 2 x 2, and
what JAX 0.9.2 types and refuses."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from test_pipeline_jax import _gpt_loss, _gpt_params, _tokens, _toy

DEVICES = require_8_devices()
M, ROWS = 4, 4  # micro-batches, rows of each (the batch of 16)
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
# the tests that build the tiny GPT's pipeline take 5-10 CPU s each; all but the main count are marked slow


def _gpt_step(tied: bool = False):
    from shardplan.jax.staged import pipeline

    params, batch = _gpt_params(tied=tied), _tokens()
    step = pipeline(_gpt_loss, params, batch, machine=_toy(), sizes=(2,), micro_batches=(M,))
    assert [(s.offset, s.devices) for s in step.plan.stages] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert step.plan.micro_batches == M
    return step, params, batch


def _all_reduced_floats(text: str) -> int:
    """The f32 elements the all-reduces of a compiled program's HLO text send (a combined all-reduce's tuple
    counted element by element)."""
    total = 0
    for shape in re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", text):
        total += sum(math.prod(int(x) for x in dims.split(",") if x) for dims in re.findall(r"f32\[([\d,]*)\]", shape))
    return total


def stage_walk(step, params, batch, rows):
    """Each stage of ``step`` in order with its forward program's arguments (micro-batch 0, of ``rows`` rows) and
    what the forward returned (outputs, vjp, other outputs), each stage's outputs feeding the stages after it."""
    leaves = step._leaves(params, batch)
    values: dict[int, jax.Array] = {}
    for st in step.stages:
        p = tuple(jax.device_put(leaves[i], st.param_put[i]) for i in st.params)
        fi = tuple(jax.device_put(values[v], st.in_sh[v]) for v in st.fin)
        oi = tuple(jax.device_put(values[v], st.in_sh[v]) for v in st.oin)
        d = tuple(jax.device_put(leaves[i][:rows] if i in step.info.batch_leaves else leaves[i], st.leaf_put[i])
                  for i in st.data)
        args = (p, fi, oi, d, {})
        fo, vjp, oo = st.forward(*args)
        values.update(zip(st.fout + st.oout, fo + oo))
        yield st, args, (fo, vjp, oo)


def _sent(step, params, batch, forward=None, rows=None):
    """Per stage, the f32 elements all-reduced by one micro-batch's backward program (micro-batches of ``rows``
    rows; None: this module's ``ROWS`` when called) and by the step's reduction program (0 where the stage defers
    nothing), and the other collectives of the backward programs; ``forward``, a list, gets the f32 elements the
    forward programs all-reduce."""
    backward, once, others = [], [], []
    for st, args, (fo, vjp, _) in stage_walk(step, params, batch, ROWS if rows is None else rows):
        if forward is not None:
            forward.append(_all_reduced_floats(st.forward.lower(*args).compile().as_text()))
        ones = tuple(jnp.ones_like(x) for x in fo)
        text = st.backward.lower(vjp, ones).compile().as_text()
        backward.append(_all_reduced_floats(text))
        others.append(sorted({k for k in COLLECTIVES[1:] if re.search(rf" {k}(?:-start)?\(", text)}))
        if st.defer:
            gp = st.backward(vjp, ones)[0]
            keys = st.reducers["gradient"].keys
            once.append(_all_reduced_floats(st.reducers["gradient"].program.lower(
                tuple(gp[k] for k in keys)).compile().as_text()))
        else:
            once.append(0)
    return backward, once, others


def _assert_equal_to_unsharded(step, params, batch, loss_fn=None):
    """The staged step's loss and gradients against the unsharded program's (``loss_fn``, this file's GPT by
    default): the loss to 1e-6, each leaf to 2e-6 of its largest entry."""
    loss, grads = step(params, batch)
    ref_l, ref_g = jax.value_and_grad(_gpt_loss if loss_fn is None else loss_fn)(params, batch)
    assert abs(float(loss) - float(ref_l)) <= 1e-6 * abs(float(ref_l))
    assert jax.tree.structure(grads) == jax.tree.structure(ref_g)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(jnp.abs(w).max()))


@pytest.mark.parametrize("reads, deferred, backward, once", [
    # nothing deferred: every leaf all-reduced by each micro-batch's backward, 4 x 5184 = 20736 floats a step
    pytest.param("none", [0, 0, 0, 0], [1552, 1040, 1040, 1552], [0, 0, 0, 0], marks=pytest.mark.slow),
    # the matmuls only (the runner before): the embedding (512) and the 4 scales (16 each) per micro-batch,
    # 4 x 576 + 4608 = 6912 floats a step
    pytest.param("matmuls", [2, 2, 2, 3], [528, 16, 16, 16], [1024, 1024, 1024, 1536], marks=pytest.mark.slow),
    # every read: nothing per micro-batch, 5184 floats once a step
    ("all", [4, 3, 3, 4], [0, 0, 0, 0], [1552, 1040, 1040, 1552]),
])
def test_the_tiny_gpt_sends_each_gradient_once_a_step(monkeypatch, reads, deferred, backward, once):
    """The tiny GPT (embedding, 4 blocks of RMS norm and MLP, head) on 4 stages of 2 data-parallel devices, m = 4:
    with the runner's per-device reads (the embedding's gather, the norms' scales) all 14 leaves are deferred, no
    backward program sends anything (no collective at all), the forward programs send what they sent before (the
    last stage's loss mean, 1 float), and the step's reduction programs all-reduce 5184 floats, each leaf once; with those reads refused (as before) 9 of 14 are deferred and 6912 floats are sent a
    step, with none deferred 20736. The gradients equal the unsharded program's in every case."""
    import shardplan.jax.local_reads as local_reads
    import shardplan.jax.staged as staged

    if reads != "all":
        monkeypatch.setattr(local_reads, "gather_island", lambda *a, **k: None)
        monkeypatch.setattr(local_reads, "scale_island", lambda *a, **k: None)
    if reads == "none":
        monkeypatch.setattr(staged, "_explicit_reduced", lambda sharding, over=None: None)
    step, params, batch = _gpt_step()
    assert [len(st.defer) for st in step.stages] == deferred and sum(len(st.params) for st in step.stages) == 14
    forward: list[int] = []
    sent, reduced, others = _sent(step, params, batch, forward)
    assert (sent, reduced, others) == (backward, once, [[]] * 4), (sent, reduced, others)
    assert forward == [0, 0, 0, 1]  # the forward programs send the same in every case: the loss's mean, last
    assert M * sum(sent) + sum(reduced) == {"none": 20736, "matmuls": 6912, "all": 5184}[reads]
    _assert_equal_to_unsharded(step, params, batch)


@pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out
def test_a_tied_embeddings_transposed_read_is_deferred():
    """The head tied to the embedding: the last stage reads its copy of the embedding through a transpose (a
    view) into the head's matmul. The transpose passes the Explicit leaf on and the matmul transposes it on
    Explicit axes: that copy is deferred too (14 of 14 stage leaves), no backward sends anything, and the
    gradients (the two copies' summed) equal the unsharded program's."""
    step, params, batch = _gpt_step(tied=True)
    embed = step.info.leaf_names.index("arg0['embed']")
    assert embed in step.stages[0].defer and embed in step.stages[3].defer
    assert [len(st.defer) for st in step.stages] == [len(st.params) for st in step.stages] == [4, 3, 3, 4]
    sent, reduced, others = _sent(step, params, batch)
    assert (sent, reduced, others) == ([0] * 4, [1552, 1040, 1040, 1552], [[]] * 4)
    _assert_equal_to_unsharded(step, params, batch)


def _equations():
    """The gather, the scale's broadcast and its multiply of a traced embedding-and-norm (ids (4, 4), a table
    (32, 16), a scale (16,)), as the stage runner sees them."""
    from shardplan.jax.lower import trace

    def loss(p, ids):
        return jnp.sum(p["e"][ids] * p["g"])

    params = {"e": jnp.zeros((32, 16)), "g": jnp.zeros((16,))}
    _, info = trace(loss, params, jnp.zeros((4, 4), jnp.int32))
    eqns = info.program.eqns
    gather = next(e for e in eqns if e.name == "gather")
    view = next(e for e in eqns if e.name == "broadcast_in_dim" and e.out_shapes[0] == (1, 1, 16))
    mul = next(e for e in eqns if e.name == "mul" and view.outvars[0] in e.invars)
    return gather, view, mul


def _mesh(shape):
    from jax.sharding import Mesh

    return Mesh(np.array(DEVICES[:math.prod(shape)]).reshape(shape), ("s", "t", "u")[:len(shape)])


def _summed_terms(island, sharding, leaf, others, slot, forward=0):
    """The island's gradient at ``leaf`` (of ``sum(sin(read))``): each device's term, stacked, then summed. The
    program sends no collective but, where ``forward`` (f32 elements) is not 0, the forward's one all-reduce of
    that size (a vocabulary-parallel gather's sum of the partial outputs)."""
    import shardplan.jax.staged as staged

    def terms(w, *xs):
        def loss(we):
            args = list(xs)
            args.insert(slot, we)
            return jnp.sum(jnp.sin(island(args)[0]))

        return staged._stack_partial_sums(jax.grad(loss)(staged._to_explicit(w, sharding)), sharding)

    program = jax.jit(terms)
    text = program.lower(leaf, *others).compile().as_text()
    assert not any(re.search(rf" {k}(?:-start)?\(", text) for k in COLLECTIVES[1:]), "a term was sent"
    assert _all_reduced_floats(text) == forward and len(re.findall(r" all-reduce(?:-start)?\(", text)) == (
        forward > 0), text
    return program(leaf, *others).sum(axis=0)


@pytest.mark.parametrize("mesh, tile, indices, out, ok", [
    ((2,), (None, None), (None, "s", None), (None, "s", None), True),
    ((2, 2), (None, "t"), ("s", None, None), ("s", None, "t"), True),  # the table's features split: local slices
    ((2,), (None, None), (None, None, None), (None, None, None), False),  # every row on both replicas
    ((2,), (None, None), (None, "s", None), (None, None, None), False),  # the output not split as the rows
    # the indexed (vocabulary) axis split: each device gathers its rows' range, the outputs summed over t
    ((2, 2), ("t", None), ("s", None, None), ("s", None, None), True),
    ((2, 2, 2), (("t", "u"), None), ("s", None, None), ("s", None, None), True),  # over two axes (4 ranges)
    ((2, 2), ("t", None), ("s", "t", None), ("s", "t", None), False),  # the ids split over the vocabulary's axis
])
def test_an_embedding_gather_is_deferred_where_its_rows_split_over_the_replicas(mesh, tile, indices, out, ok):
    """``gather_island`` takes a gather of a table replicated over R (the axes its tile leaves free) when the
    indices' rows are split over exactly R, the table's indexed axis whole and the output split as the rows and
    the table: then the terms its backward leaves on the devices (nothing sent) sum to the unsharded gather's
    gradient. Otherwise it refuses, and the leaf's gradient is all-reduced by every micro-batch's backward."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import shardplan.jax.staged as staged
    from shardplan.jax.local_reads import gather_island

    gather, _, _ = _equations()
    mesh = _mesh(mesh)
    tile = NamedSharding(mesh, P(*tile))
    sharding = staged._explicit_reduced(tile)
    island = gather_island(gather, (32, 16), tile, sharding, tile, NamedSharding(mesh, P(*indices)),
                          NamedSharding(mesh, P(*out)))
    assert (island is not None) == ok
    if not ok:
        return
    table = jax.random.normal(jax.random.key(0), (32, 16))
    idx = jax.random.randint(jax.random.key(1), (4, 4, 1), 0, 32)
    vocab = tile.spec[0] is not None  # the forward sums the partial outputs: one all-reduce of the local block
    got = _summed_terms(island, sharding, jax.device_put(table, tile),
                        [jax.device_put(idx, NamedSharding(mesh, P(*indices)))], 0, forward=128 if vocab else 0)
    want = jax.grad(lambda t: jnp.sum(jnp.sin(gather.primitive.bind(t, idx, **gather.params))))(table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mesh, tile, x, ok", [
    ((2,), (None,), (None, "s", None), True),
    ((2, 2), ("t",), ("s", None, "t"), True),  # the features split as the scale's tile
    ((2,), (None,), (None, None, "s"), False),  # the features split over the replicas
    ((2,), (None,), (None, None, None), False),  # the rows on both replicas
])
def test_a_norm_scale_is_deferred_where_its_rows_split_over_the_replicas(mesh, tile, x, ok):
    """``scale_island`` takes ``x * broadcast(g)`` when the broadcast (size-1) axes of ``g`` are split over
    exactly R in ``x`` and the output, the others as ``g``'s tile: the terms sum to the unsharded gradient, nothing
    sent. Otherwise it refuses."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import shardplan.jax.staged as staged
    from shardplan.jax.local_reads import scale_island

    _, view, mul = _equations()
    mesh = _mesh(mesh)
    tile = NamedSharding(mesh, P(*tile))
    sharding = staged._explicit_reduced(tile)
    slot = mul.invars.index(view.outvars[0])
    xs = NamedSharding(mesh, P(*x))
    island = scale_island(mul, slot, view, (4, 4, 16), 1, tile, sharding, xs, xs)
    assert (island is not None) == ok
    if not ok:
        return
    g = 1 + 0.1 * jax.random.normal(jax.random.key(0), (16,))
    h = jax.random.normal(jax.random.key(1), (4, 4, 16))
    got = _summed_terms(island, sharding, jax.device_put(g, tile), [jax.device_put(h, xs)], slot)
    want = jax.grad(lambda g: jnp.sum(jnp.sin(h * g)))(g)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


ELEMENTWISE = {"add": lambda x, b: x + b, "sub": lambda x, b: b - x, "div": lambda x, b: x / b}


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
def test_a_bias_and_other_elementwise_reads_are_deferred(op):
    """A broadcast weight added (a bias), subtracted from (the broadcast as the first operand) or dividing: the
    same per-device read as a scale (any elementwise operation is local), the terms summing to the unsharded
    gradient with nothing sent."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import shardplan.jax.staged as staged
    from shardplan.jax.local_reads import scale_island
    from shardplan.jax.lower import trace

    f = ELEMENTWISE[op]
    _, info = trace(lambda p, x: jnp.sum(f(x, p["b"])), {"b": jnp.ones((16,))}, jnp.ones((4, 4, 16)))
    view = next(e for e in info.program.eqns if e.name == "broadcast_in_dim" and e.out_shapes[0] == (1, 1, 16))
    e = next(e for e in info.program.eqns if view.outvars[0] in e.invars)
    assert e.name == op
    mesh = _mesh((2,))
    tile = NamedSharding(mesh, P(None))
    sharding = staged._explicit_reduced(tile)
    slot = e.invars.index(view.outvars[0])
    xs = NamedSharding(mesh, P(None, "s", None))
    island = scale_island(e, slot, view, (4, 4, 16), 1, tile, sharding, xs, xs)
    b = 1 + 0.1 * jax.random.normal(jax.random.key(0), (16,))
    h = jax.random.normal(jax.random.key(1), (4, 4, 16))
    got = _summed_terms(island, sharding, jax.device_put(b, tile), [jax.device_put(h, xs)], slot)
    want = jax.grad(lambda b: jnp.sum(jnp.sin(f(h, b))))(b)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


@pytest.mark.parametrize("read", ["take", "index", "scale"])
@pytest.mark.parametrize("check_vma, factor, all_reduces", [(True, 1, 0), (False, 2, 1)])
def test_a_per_device_reads_terms_are_the_gradient_only_with_check_vma(read, check_vma, factor, all_reduces):
    """Why the per-device reads run in a ``shard_map`` with ``check_vma=True`` (JAX 0.9.2): the weight enters
    ``reduced`` over the axis of 2 its tile leaves free, the other operand's rows split over it. With the
    varying-axes check, the cast that meets the weight with the rows (inserted by ``jnp``, explicit in
    ``shardplan.jax.local_reads``) transposes into each device's own term, ``unreduced``: their sum is the
    gradient and nothing is sent. Without it, the transpose all-reduces the terms and still types the result
    ``unreduced``: the sum of the devices' copies is twice the gradient. (Outside a ``shard_map`` JAX 0.9.2 types
    neither read: a gather of a reduced table asks for ``.at[...].get(out_sharding=)``, which runs it on Auto
    axes, and the multiply is refused, "Inputs cannot be sharded on the same axes that another input is reduced
    on".)"""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard, use_abstract_mesh

    devices = np.array(DEVICES[:2])
    auto, explicit = Mesh(devices, ("s",)), Mesh(devices, ("s",), axis_types=(AxisType.Explicit,))
    k0, k1 = jax.random.split(jax.random.key(3))
    if read == "scale":
        w, x = 1 + 0.1 * jax.random.normal(k0, (16,)), jax.random.normal(k1, (4, 4, 16))
        local = lambda w, x: x * w  # noqa: E731
    else:
        w, x = jax.random.normal(k0, (32, 16)), jax.random.randint(k1, (4, 4), 0, 32)
        local = (lambda w, i: jnp.take(w, i, axis=0)) if read == "take" else (lambda w, i: w[i])  # noqa: E731
    w = jax.device_put(w, NamedSharding(auto, P()))
    x = jax.device_put(x, NamedSharding(auto, P("s")))

    def to_auto(v):
        with use_abstract_mesh(auto.abstract_mesh):
            return reshard(v, P())

    def terms(w, x):
        with use_abstract_mesh(explicit.abstract_mesh):
            we, xe = reshard(w, P(reduced={"s"})), reshard(x, P("s"))

        def loss(we):
            y = jax.shard_map(local, mesh=explicit, in_specs=(P(reduced={"s"}), P("s")), out_specs=P("s"),
                              check_vma=check_vma)(we, xe)
            return jnp.sum(jnp.sin(to_auto(y)))

        g = jax.grad(loss)(we)
        stacked = jax.shard_map(lambda t: t[None], mesh=explicit, in_specs=P(unreduced={"s"}), out_specs=P("s"),
                                check_vma=False)(g)
        return jax.lax.with_sharding_constraint(to_auto(stacked), NamedSharding(auto, P("s")))

    program = jax.jit(terms)
    text = program.lower(w, x).compile().as_text()
    assert len(re.findall(r" all-reduce(?:-start)?\(", text)) == all_reduces
    want = jax.grad(lambda w: jnp.sum(jnp.sin(local(w, x))))(w)
    np.testing.assert_allclose(np.asarray(program(w, x).sum(axis=0)), factor * np.asarray(want), rtol=1e-6,
                               atol=1e-6)


def _gpt_with_choices(edits, params, batch):
    """The tiny GPT's staged step (4 stages of 2 devices, m = 4) with the per-operator choices ``edits``."""
    from staged_cases import with_choices

    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    tracer = Tracer(_gpt_loss, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), _toy(), micro_batches=(M,), sizes=(2,),
                                        cutoff=1))
    assert [(s.offset, s.devices) for s in plan.stages] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    return sj.apply(with_choices(plan, edits), _gpt_loss, params, batch, DEVICES).step


@pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out
def test_zero_1_embedding_and_scales_train_like_optax():
    """The embedding (its gather) and two RMS-norm scales at ZeRO 1 (Adam's state in 2 shards of the tile): they are
    deferred, their terms reduced once a step into the shards, and two Adam steps equal optax's on the unsharded
    program."""
    from test_staged_zero_jax import trained_like_optax

    params, batch = _gpt_params(), _tokens()
    step = _gpt_with_choices({n: {"state_stage": 1} for n in ("embed/gather", "L0/mul", "L3/mul")}, params, batch)
    names = step.info.leaf_names
    ones = {i for st in step.stages for i, z in st.zero.items() if z == 1}
    assert sorted(names[i] for i in ones) == ["arg0['blocks'][0]['g']", "arg0['blocks'][3]['g']", "arg0['embed']"]
    assert all(i in st.defer for st in step.stages for i in st.params)
    steps = list(trained_like_optax(step, params, batch, 2, _gpt_loss))  # each step checked as it is taken
    assert len(steps) == 2


@pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out
def test_recomputed_reads_stay_deferred():
    """Stages 0 and 3 recompute the embedding's gather, L0's scale and product and L3's scale (their bodies run under
    ``jax.checkpoint``, the per-device reads inside it), stage 1 holds L1's scale at ZeRO 3 (not deferred: its
    gradient goes into its shards each micro-batch). The other 13 leaves are deferred, the recomputing stages'
    backward programs send nothing, and the gradients equal the unsharded program's."""
    params, batch = _gpt_params(), _tokens()
    edits = {n: {"recompute": True} for n in ("embed/gather", "L0/mul", "L0/mul_2", "L3/mul")}
    step = _gpt_with_choices({**edits, "L1/mul": {"state_stage": 3}}, params, batch)
    assert [st.remat for st in step.stages] == [True, True, False, True]
    assert [len(st.defer) for st in step.stages] == [4, 2, 3, 4]
    sent, reduced, others = _sent(step, params, batch)
    assert (sent[0], sent[2], sent[3]) == (0, 0, 0) and (reduced[0], reduced[3]) == (1552, 1552), (sent, reduced)
    _assert_equal_to_unsharded(step, params, batch)


def test_on_explicit_axes_jax_types_a_batched_product_but_not_a_scale_or_a_gather():
    """JAX 0.9.2 on Explicit axes, a weight ``reduced`` over an axis of 2 and the rows split over it: the scale
    ``x * g`` is refused ("cannot be sharded on the same axes that another input is reduced on") and so is the
    gather ``e[ids]`` (it asks for ``.at[...].get(out_sharding=)``, which runs on Auto axes); the same scale as a
    ``dot_general`` with the feature axis a batch dimension and nothing contracted (one product per element, as
    the multiply) is typed, its weight gradient ``unreduced``: the devices' terms, nothing sent, sum to the
    gradient. (The runner runs scales per device instead, with the gather's code: docs/jax.md.)"""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard, use_abstract_mesh

    devices = np.array(DEVICES[:2])
    auto, explicit = Mesh(devices, ("s",)), Mesh(devices, ("s",), axis_types=(AxisType.Explicit,))
    k0, k1 = jax.random.split(jax.random.key(4))
    g = jax.device_put(1 + 0.1 * jax.random.normal(k0, (16,)), NamedSharding(auto, P()))
    x = jax.device_put(jax.random.normal(k1, (4, 4, 16)), NamedSharding(auto, P("s")))
    table = jax.device_put(jnp.zeros((32, 16)), NamedSharding(auto, P()))
    ids = jax.device_put(jnp.zeros((4, 4), jnp.int32), NamedSharding(auto, P("s")))

    def explicit_types(*pairs):
        with use_abstract_mesh(explicit.abstract_mesh):
            return [reshard(v, spec) for v, spec in pairs]

    def to_auto(v):
        with use_abstract_mesh(auto.abstract_mesh):
            return reshard(v, P())

    def scale(g, x):
        ge, xe = explicit_types((g, P(reduced={"s"})), (x, P("s")))
        with use_abstract_mesh(explicit.abstract_mesh):
            return xe * ge

    def gather(t, i):
        te, ie = explicit_types((t, P(reduced={"s"})), (i, P("s")))
        with use_abstract_mesh(explicit.abstract_mesh):
            return te[ie]

    with pytest.raises(Exception, match="cannot be sharded on the same axes that another input is reduced on"):
        jax.jit(scale).lower(g, x)
    with pytest.raises(Exception, match=r"\.at\[\.\.\.\]\.get\(out_sharding=\)"):
        jax.jit(gather).lower(table, ids)

    def terms(g, x):
        ge, xe = explicit_types((g, P(reduced={"s"})), (x, P("s")))

        def loss(ge):
            with use_abstract_mesh(explicit.abstract_mesh):
                y = jax.lax.dot_general(xe, ge, (((), ()), ((2,), (0,))), out_sharding=P(None, "s", None))
            return jnp.sum(jnp.sin(to_auto(y)))

        grad = jax.grad(loss)(ge)
        assert jax.typeof(grad).sharding.spec.unreduced == {"s"}
        stacked = jax.shard_map(lambda t: t[None], mesh=explicit, in_specs=P(unreduced={"s"}), out_specs=P("s"),
                                check_vma=False)(grad)
        return jax.lax.with_sharding_constraint(to_auto(stacked), NamedSharding(auto, P("s")))

    program = jax.jit(terms)
    assert not re.search(r" all-reduce(?:-start)?\(", program.lower(g, x).compile().as_text())
    want = jax.grad(lambda g: jnp.sum(jnp.sin(x * g)))(g)
    np.testing.assert_allclose(np.asarray(program(g, x).sum(axis=0)), np.asarray(want), rtol=1e-6, atol=1e-6)


def _gpt_loss_bf16(p, batch):
    """:func:`_gpt_loss` with every weight kept in float32 and read in bfloat16 (a cast in its block's scope)."""
    bf = jnp.bfloat16
    ids, y = batch
    with jax.named_scope("embed"):
        h = p["embed"].astype(bf)[ids]
    for i, blk in enumerate(p["blocks"]):
        with jax.named_scope(f"L{i}"):
            z = h * blk["g"].astype(bf) / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
            h = h + jnp.tanh(z @ blk["w1"].astype(bf)) @ blk["w2"].astype(bf)
    with jax.named_scope("head"):
        lp = jax.nn.log_softmax((h @ p["head"].astype(bf)).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(lp, y[..., None], -1))


@pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out
def test_weights_read_in_bfloat16_are_deferred():
    """Every weight read through a cast to bfloat16 (mixed precision): the casts pass the Explicit leaf on and the
    reads apply them (on Explicit axes before a matmul, per device before a gather or a broadcast), so all 14
    leaves are deferred, no backward program sends anything and the float32 terms are all-reduced once a step
    (5184 floats). The gradients equal the unsharded program's to bfloat16's precision: within 3e-2 of each leaf's
    largest entry (measured 1.8e-2; the runner with nothing deferred is as far, 1.9e-2: the rounding of each
    micro-batch's and each device's bfloat16 sums)."""
    from shardplan.jax.staged import pipeline

    params, batch = _gpt_params(), _tokens()
    step = pipeline(_gpt_loss_bf16, params, batch, machine=_toy(), sizes=(2,), micro_batches=(M,))
    assert [len(st.defer) for st in step.stages] == [len(st.params) for st in step.stages] == [4, 3, 3, 4]
    sent, reduced, others = _sent(step, params, batch)
    assert (sent, reduced, others) == ([0] * 4, [1552, 1040, 1040, 1552], [[]] * 4)
    loss, grads = step(params, batch)
    ref_l, ref_g = jax.value_and_grad(_gpt_loss_bf16)(params, batch)
    assert abs(float(loss) - float(ref_l)) <= 1e-6 * abs(float(ref_l))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_g)):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=3e-2 * float(jnp.abs(w).max()))
