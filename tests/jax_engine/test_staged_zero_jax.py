"""A pipeline plan whose stages shard optimizer state (ZeRO 1/2/3) or keep it in host memory trains on JAX (8
simulated devices, :class:`shardplan.jax.staged.StagedTrain`): one and two Adam steps equal optax's on the
unsharded program, with the state, gradients and parameters held in shards as each operator's stage says."""

from __future__ import annotations

import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from conftest import require_8_devices
from staged_cases import B, D, model, scoped, searched_plan, with_choices

pytestmark = pytest.mark.slow  # see pyproject.toml: make test-fast leaves it out

DEVICES = require_8_devices()
OFFERED = ("activations", "optimizer", "parameters")
# leaf k is read by layer k; L1 to L3 replicate their weight's tile over a sub-mesh axis of 2 (L0's tile is on all 4)
ZERO = {"L1/dot_general": {"state_stage": 1}, "L2/dot_general": {"state_stage": 2},
        "L3/dot_general": {"state_stage": 3}}
OFFLOAD = {"L0/dot_general": {"state_stage": 1, "offload": ("optimizer",)}, "L2/dot_general": {"state_stage": 1},
           "L3/dot_general": {"state_stage": 3, "offload": ("optimizer", "parameters")}}


@pytest.fixture(scope="module")
def searched():
    params, batch = model()
    return params, batch, searched_plan(params, batch)


def pieces(x):
    return math.prod(x.shape) // math.prod(x.sharding.shard_shape(x.shape))


def reference_steps(opt, params, batch, n, loss_fn=scoped):
    """``n`` optax steps on the unsharded program ``loss_fn`` (the full batch's mean: the mean of the
    micro-batches')."""
    state = opt.init(params)
    out = []
    for _ in range(n):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        out.append((float(loss), params))
    return out


def trained_like_optax(step, params, batch, n: int = 2, loss_fn=scoped):
    """``n`` Adam steps of the staged training step, each checked against optax's on the unsharded program (loss
    within 1e-5 relative, parameters by :func:`assert_close`); yields the parameters and state after each."""
    import optax

    opt = optax.adam(1e-2)
    train = step.train_step(opt, params)
    p, state = train.init(params)
    for loss0, want in reference_steps(opt, params, batch, n, loss_fn):
        p, state, loss = train(p, state, batch)
        assert abs(float(loss) - loss0) <= 1e-5 * abs(loss0)
        assert_close(p, want)
        yield p, state


def assert_close(params, want):
    top = max(float(np.abs(np.asarray(w)).max()) for w in jax.tree.leaves(want))
    err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
    assert err <= 1e-5 * top


def test_zero_stages_train_like_the_unsharded_step(searched):
    """Stage 0 runs L0 (ZeRO 0) and L1 (ZeRO 1), stage 1 L2 (ZeRO 2) and L3 (ZeRO 3). The gradient step equals
    jax.value_and_grad with the ZeRO 2/3 gradients in shards; one and two Adam steps equal optax's unsharded ones;
    between steps Adam's state of L1-L3 and L3's parameter are held in 2 shards of their tile (4 pieces of the
    weight), the others in their tile; the compiled forward of stage 1 takes L3's weight in shards (it gathers it
    itself) and its stage runs under jax.checkpoint (the gather done again for the backward), stage 0's does not."""

    import shardplan.jax as sj

    params, batch, plan = searched
    step = sj.apply(with_choices(plan, ZERO), scoped, params, batch, DEVICES).step
    assert [st.zero for st in step.stages] == [{0: 0, 1: 1}, {2: 2, 3: 3}]
    assert [st.remat for st in step.stages] == [False, True]
    loss, grads = step(params, batch)
    loss0, grads0 = jax.value_and_grad(scoped)(params, batch)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert_close(grads, grads0)
    assert [pieces(g) for g in grads["w"]] == [4, 2, 4, 4]
    for p, state in trained_like_optax(step, params, batch):
        pass
    assert [pieces(w) for w in p["w"]] == [4, 2, 2, 4]
    assert [pieces(mu) for s in state for mu in s[0].mu] == [4, 4, 4, 4]
    assert [pieces(nu) for s in state for nu in s[0].nu] == [4, 4, 4, 4]
    assert [set(mu.sharding.device_set) for s in state for mu in s[0].mu] == [set(DEVICES[:4])] * 2 + \
        [set(DEVICES[4:])] * 2
    st = step.stages[1]
    rows = B // 2
    placed = tuple(jax.device_put(x, st.param_put[i]) for i, x in zip(st.params, p["w"][2:]))
    fi = tuple(jax.device_put(jnp.zeros((rows, D)), st.in_sh[v]) for v in st.fin)
    d = tuple(jax.device_put(batch[1][:rows], st.leaf_put[i]) for i in st.data)
    shardings = st.forward.lower(placed, fi, (), d, {}).compile().input_shardings[0][0]
    assert [math.prod(s.shard_shape((D, D))) for s in shardings] == [D * D // 2, D * D // 4]


def test_offloaded_state_and_parameters_live_in_host_memory(searched):
    """L0 (ZeRO 1) keeps Adam's state in host memory, L2 (ZeRO 1) on device, L3 (ZeRO 3) its state and its
    parameter shards in host memory: two Adam steps equal optax's unsharded ones, and between steps each lives in
    the memory its choice says (XLA's CPU backend copies between memory kinds outside a compiled program)."""

    import shardplan.jax as sj

    params, batch, plan = searched
    step = sj.apply(with_choices(plan, OFFLOAD, offload=OFFERED), scoped, params, batch, DEVICES).step
    for p, state in trained_like_optax(step, params, batch):
        assert [w.sharding.memory_kind for w in p["w"]] == ["device"] * 3 + ["pinned_host"]
        assert [mu.sharding.memory_kind for s in state for mu in s[0].mu] == \
            ["pinned_host", "device", "device", "pinned_host"]
        assert [pieces(mu) for s in state for mu in s[0].mu] == [4, 2, 4, 4]


def tied(p, batch):
    """A weight ``e`` read by the first layer and, transposed, by the last: a parameter of both stages."""
    x, y = batch
    for i, w in enumerate([p["e"], *p["w"], None]):
        with jax.named_scope(f"L{i}"):
            x = jnp.tanh(x @ (p["e"].T if w is None else w))
    return jnp.mean((x - y) ** 2)


def test_a_leaf_read_by_two_stages_is_updated_at_its_home(searched):
    """``e`` is read by L0 (stage 0, ZeRO 1) and L3 (stage 1, ZeRO 2): stage 0 is its home, holding its Adam state
    in shards; stage 1 gets a copy before the passes and its gradient (reduced into stage 1's shards) is summed
    into the home's. Two Adam steps equal optax's on the unsharded program."""
    import optax
    from staged_cases import MACHINE

    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    params0, batch, _ = searched
    params = {"e": params0["w"][0], "w": params0["w"][1:3]}
    tracer = Tracer(tied, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), MACHINE, micro_batches=(2,),
                                        sizes=(4,), cutoff=1))
    assert [sorted(s.operators)[:2] for s in plan.stages] == [["L0/dot_general", "L1/dot_general"],
                                                              ["L2/dot_general", "L3/dot_general"]]
    edits = {"L0/dot_general": {"state_stage": 1}, "L3/dot_general": {"state_stage": 2}}
    step = sj.apply(with_choices(plan, edits), tied, params, batch, DEVICES).step
    opt = optax.adam(1e-2)
    train = step.train_step(opt, params)
    assert train.homes == ((0, 1), (2,)) and 0 in step.stages[1].params
    assert (step.stages[0].zero[0], step.stages[1].zero[0]) == (1, 2)
    p, state = train.init(params)
    for loss0, want in reference_steps(opt, params, batch, 2, tied):
        p, state, loss = train(p, state, batch)
        assert abs(float(loss) - loss0) <= 1e-5 * abs(loss0)
        assert_close(p, want)
    assert set(p["e"].sharding.device_set) == set(DEVICES[:4])


def test_fp8_delayed_scaling_trains_with_sharded_state(searched):
    """L1's product in FP8 (delayed scaling) beside L1 at ZeRO 3 and L2 at ZeRO 2: ``train(params, opt_state, batch,
    history)`` returns the next histories; two Adam steps equal optax's on the unsharded program with the same FP8
    product, every micro-batch scaled from the step's histories, the largest amax shifted in."""
    import optax

    import shardplan.jax as sj
    from shardplan.jax.fp8 import init_history, roll_history

    params, batch, plan = searched
    edits = {"L1/dot_general": {"fp8": True, "state_stage": 3}, "L2/dot_general": {"state_stage": 2}}
    step = sj.apply(with_choices(plan, edits), scoped, params, batch, DEVICES).step
    assert step.fp8_names == ("L1/dot_general",)
    opt = optax.adam(1e-2)
    train = step.train_step(opt, params)
    p, state = train.init(params)
    h = step.init_history(8)
    want, ref, h0 = params, opt.init(params), init_history(step.fp8_names, 8)
    parts = [jax.jit(jax.value_and_grad(step.reference(micro=j), argnums=(0, 2))) for j in range(2)]
    for _ in range(2):
        p, state, loss, h = train(p, state, batch, h)
        (l0, (g0, a0)), (l1, (g1, a1)) = (f(want, batch, h0) for f in parts)
        updates, ref = opt.update(jax.tree.map(jnp.add, g0, g1), ref, want)
        want = jax.tree.map(lambda a, u: a + u, want, updates)
        h0 = roll_history(h0, jax.tree.map(jnp.maximum, a0, a1))
        assert abs(float(loss) - float(l0 + l1)) <= 1e-5 * abs(float(l0 + l1))
        assert_close(p, want)
        np.testing.assert_allclose(np.asarray(h["L1/dot_general"]), np.asarray(h0["L1/dot_general"]), rtol=1e-6)
    assert [pieces(w) for w in p["w"]] == [4, 4, 2, 2]


def test_interleaved_chunks_train_with_their_own_state(searched):
    """Interleaved 1F1B over 2 groups of 4 devices, 2 chunks each (4 stages): L0 (ZeRO 3) in chunk 0, L1 (ZeRO 1)
    in chunk 1, L2 (ZeRO 2) and L3 (ZeRO 3) in chunk 2, the loss alone in chunk 3 (no leaves: no state). Two Adam
    steps equal optax's unsharded ones, each leaf kept on its chunk's device group."""
    import optax
    from staged_cases import MACHINE

    import shardplan.jax as sj
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    params, batch, _ = searched
    tracer = Tracer(scoped, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), MACHINE, micro_batches=(2,),
                                        sizes=(4,), interleave=(2,), schedules=("interleaved",), cutoff=1))
    assert (plan.num_stages, plan.chunks, [s.offset for s in plan.stages]) == (4, 2, [0, 4, 0, 4])
    edits = {"L0/dot_general": {"state_stage": 3}, "L1/dot_general": {"state_stage": 1},
             "L2/dot_general": {"state_stage": 2}, "L3/dot_general": {"state_stage": 3}}
    step = sj.apply(with_choices(plan, edits), scoped, params, batch, DEVICES).step
    assert [st.zero for st in step.stages] == [{0: 3}, {1: 1}, {2: 2, 3: 3}, {}]
    opt = optax.adam(1e-2)
    train = step.train_step(opt, params)
    p, state = train.init(params)
    assert state[3] is None
    for (loss0, want), _ in zip(reference_steps(opt, params, batch, 2), range(2)):
        p, state, loss = train(p, state, batch)
        assert abs(float(loss) - loss0) <= 1e-5 * abs(loss0)
        assert_close(p, want)
    assert [set(w.sharding.device_set) for w in p["w"]] == [set(DEVICES[:4]), set(DEVICES[4:])] + \
        [set(DEVICES[:4])] * 2
    assert [pieces(w) for w in p["w"]] == [4, 2, 2, 4]


def _collectives(text: str) -> dict[str, list[str]]:
    """The all-reduces, reduce-scatters and all-gathers of a compiled program's HLO text (each instruction's result
    shape, e.g. ``f32[16,8]``; a combined all-reduce's tuple shape)."""
    import re

    out: dict[str, list[str]] = {}
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        out[kind] = re.findall(rf"= (\S+) {kind}(?:-start)?\(", text)
    return out


@pytest.mark.parametrize("zero", [0, 1])
def test_zero_0_and_1_gradients_are_reduced_once_a_step(searched, zero):
    """Stage 0 holds L0 (its tile on all 4 devices: nothing to reduce) and L1 at ZeRO ``zero`` (its tile
    ``P('x', None)`` replicated over the axis ``b`` of 2; its one read a matmul whose rows are split over ``b``, so
    the runner defers it and runs that matmul on Explicit axes). Each micro-batch's backward program sends
    nothing: L1's gradient comes back as its two devices' terms, one row each of an array (2, 16, 16) split over
    ``b``, the m = 2 micro-batches' are added locally, and the step's one reduction program all-reduces L1's local
    tile (``f32[8,16]``) once: into the tile for the gradient step (and for ZeRO 0's update), into the shards for
    ZeRO 1's update (on XLA:CPU the all-reduce and a ``dynamic-slice`` of the shard, ``f32[4,16]``: no
    ``reduce-scatter`` instruction is formed), whose update program then all-gathers the updated shard
    (``f32[8,16]``) and sends nothing else. The forward program's one all-reduce (``f32[8,16]``) is L1's
    product's, its tile contracting over ``x``, as before."""
    import re

    import optax

    import shardplan.jax as sj

    params, batch, plan = searched
    step = sj.apply(with_choices(plan, ZERO if zero else {}), scoped, params, batch, DEVICES).step
    st = step.stages[0]
    assert st.zero == {0: 0, 1: zero} and step.plan.micro_batches == 2 and list(st.defer) == [1]
    assert [tuple(st.grad_put[i].spec) for i in st.params] == [(None, ("s", "s~1")), ("x", None)]
    rows = B // 2
    placed = tuple(jax.device_put(params["w"][i], st.param_put[i]) for i in st.params)
    d = tuple(jax.device_put(batch[0][:rows], st.leaf_put[i]) for i in st.data)
    forward = _collectives(st.forward.lower(placed, (), (), d, {}).compile().as_text())
    assert forward == {"all-reduce": ["f32[8,16]{1,0}"], "reduce-scatter": [], "all-gather": []}, forward
    fo, vjp, _ = st.forward(placed, (), (), d, {})
    ones = tuple(jnp.ones_like(x) for x in fo)
    backward = _collectives(st.backward.lower(vjp, ones).compile().as_text())
    assert backward == {"all-reduce": [], "reduce-scatter": [], "all-gather": []}, backward
    gp = st.backward(vjp, ones)[0]
    assert gp[1].shape == (2, D, D) and tuple(gp[1].sharding.spec) == ("b", "x") and gp[0].shape == (D, D)
    d1 = tuple(jax.device_put(batch[0][rows:], st.leaf_put[i]) for i in st.data)
    gp = jax.tree.map(jnp.add, gp, st.backward(st.forward(placed, (), (), d1, {})[1], ones)[0])  # local sums
    assert gp[1].sharding == st.backward(vjp, ones)[0][1].sharding
    slices = {}
    for into in ("gradient", "update"):
        text = st.reducers[into].program.lower((gp[1],)).compile().as_text()
        assert _collectives(text) == {"all-reduce": ["f32[8,16]{1,0}"], "reduce-scatter": [], "all-gather": []}
        slices[into] = re.findall(r"= (f32\S+) dynamic-slice\(", text)
    assert slices == {"gradient": [], "update": ["f32[4,16]{1,0}"] if zero else []}, slices
    reduced = st.reduce_grads(gp, "update")
    assert [g.sharding for g in reduced] == [st.update_put[i] for i in st.params]
    assert pieces(reduced[1]) == (4 if zero else 2)
    opt = optax.adam(1e-2)
    train = step.train_step(opt, params)
    state = jax.device_put(opt.init(placed), train.state_device[0])
    update = _collectives(train.updates[0].lower(placed, state, reduced).compile().as_text())
    gathers = ["f32[8,16]{1,0}"] if zero else []
    assert update == {"all-reduce": [], "reduce-scatter": [], "all-gather": gathers}, update


@pytest.mark.parametrize("read, split, factor, all_reduces", [("dot", True, 1, 0), ("dot", False, 2, 0),
                                                              ("twice", True, 2, 0), ("scale", True, 2, 1)])
def test_an_unreduced_cotangent_is_whatever_the_partitioner_left_on_each_device(read, split, factor, all_reduces):
    """Why the stage runner defers a ZeRO 0/1 gradient only through reads it types itself (docs/jax.md, "What the
    stage programs send"): the gradient of a weight replicated over an axis of 2, taken as JAX 0.9.2 offers to defer its
    reduction (the weight an Explicit-axes value ``reduced`` over the axis, read through an Auto copy, so its
    cotangent is ``unreduced``: per device a term of the sum), on a stage body of Auto axes. The sum of the two
    devices' terms is the gradient only where the partitioner leaves a partial sum at that point: a matmul with
    the batch split (``factor`` 1, nothing sent). With the batch replicated each device already holds the whole
    gradient, and for a per-feature scale the partitioner all-reduces first: each device's term is the whole
    gradient, the sum twice it. So the runner does not convert an Auto cotangent: it defers only a leaf whose every
    read is a matmul summing over the replicas run on Explicit axes (the previous test), or a gather or scale run
    per device in a ``check_vma`` shard_map (``shardplan.jax.local_reads``, tests/jax_engine/test_staged_defer_jax.py),
    where JAX's type rules, not the partitioner, make the terms (``staged._deferrable``)."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard, use_abstract_mesh

    devices = np.array(DEVICES[:2])
    auto, explicit = Mesh(devices, ("s",)), Mesh(devices, ("s",), axis_types=(AxisType.Explicit,))
    shape = (D,) if read == "scale" else (D, D)
    kw, kx = jax.random.split(jax.random.PRNGKey(0))
    w = jax.device_put(jax.random.normal(kw, shape) / D**0.5, NamedSharding(auto, P()))
    x = jax.device_put(jax.random.normal(kx, (8, D)), NamedSharding(auto, P("s" if split else None)))

    def loss(w, x):
        h = x * w if read == "scale" else x @ w
        return jnp.sum(jnp.tanh(jnp.tanh(h) @ w if read == "twice" else h))

    def to_auto(v):
        with use_abstract_mesh(auto.abstract_mesh):
            return reshard(v, P())

    def terms(w, x):  # each device's term of the deferred gradient, side by side: (2, *shape), nothing sent
        with use_abstract_mesh(explicit.abstract_mesh):
            we = reshard(w, P(reduced={"s"}))
        g = jax.grad(lambda v: loss(to_auto(v), x))(we)
        stacked = jax.shard_map(lambda t: t[None], mesh=explicit, in_specs=P(unreduced={"s"}), out_specs=P("s"),
                                check_vma=False)(g)
        return jax.lax.with_sharding_constraint(to_auto(stacked), NamedSharding(auto, P("s")))

    program = jax.jit(terms)
    assert len(_collectives(program.lower(w, x).compile().as_text())["all-reduce"]) == all_reduces
    want = jax.grad(loss)(w, x)
    got = program(w, x).sum(axis=0)
    np.testing.assert_allclose(np.asarray(got), factor * np.asarray(want), rtol=1e-5, atol=1e-6)
