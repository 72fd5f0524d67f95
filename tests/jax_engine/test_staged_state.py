"""What the JAX stage runner holds for a pipeline plan whose stages shard optimizer state (ZeRO 1/2/3) or keep it in
host memory, without compiling anything: per parameter leaf its stage's ZeRO stage and the shards of its state,
gradient and parameter on the stage's sub-mesh, its home stage and where its state lives between steps; a stage
rebuilt without the choices its operators are given is refused."""

from __future__ import annotations

import math

import pytest

import jax

from conftest import require_8_devices
from shardplan.errors import ShardplanError
from staged_cases import model, scoped, searched_plan, with_choices

DEVICES = require_8_devices()
# the searched layouts (4 devices per stage): L0 splits its weight 4 ways (no replicas: nothing to shard), L1 and L2
# split it 2 ways over one mesh axis and L3 over another, each replicated over the other axis of 2
ZERO = {"L0/dot_general": {"state_stage": 3}, "L1/dot_general": {"state_stage": 1},
        "L2/dot_general": {"state_stage": 2},
        "L3/dot_general": {"state_stage": 3, "offload": ("optimizer", "parameters")}}
OFFERED = ("activations", "optimizer", "parameters")


@pytest.fixture(scope="module")
def searched():
    params, batch = model()
    return params, batch, searched_plan(params, batch)


def pieces(sharding, shape):
    return math.prod(shape) // math.prod(sharding.shard_shape(shape))


def test_stage_leaves_hold_their_zero_stage_and_offload(searched):
    """Leaf k is read by layer k: its ZeRO stage is its reader's; its state is cut over the replicas of its tile
    (2 pieces beside the tile's 2, none for L0 whose tile is on every device), its gradient for stages 2 and 3, the
    parameter for stage 3; L3's state and parameter shards live in host memory between steps, and a stage-3
    stage gathers its weights again for the backward pass (it runs under jax.checkpoint)."""
    import optax

    import shardplan.jax as sj

    params, batch, plan = searched
    step = sj.apply(with_choices(plan, ZERO, offload=OFFERED), scoped, params, batch, DEVICES).step
    assert [st.zero for st in step.stages] == [{0: 3, 1: 1}, {2: 2, 3: 3}]
    assert [st.host for st in step.stages] == [{0: (), 1: ()}, {2: (), 3: ("optimizer", "parameters")}]
    shape = (16, 16)
    got = {i: (pieces(st.leaf_put[i], shape), pieces(st.param_put[i], shape), pieces(st.grad_put[i], shape),
               pieces(st.state_put[i], shape)) for st in step.stages for i in st.params}
    # (tile, parameter, gradient, state) pieces
    assert got == {0: (4, 4, 4, 4), 1: (2, 2, 2, 4), 2: (2, 2, 4, 4), 3: (2, 4, 4, 4)}
    assert [st.remat for st in step.stages] == [True, True]
    train = step.train_step(optax.adam(1e-2), params)
    assert train.homes == ((0, 1), (2, 3))
    assert [sh.memory_kind for homes in train.param_homes for sh in homes] == ["device"] * 3 + ["pinned_host"]
    mu = [s[0].mu for s in train.state_homes]
    assert [sh.memory_kind for sh in jax.tree.leaves(mu)] == ["device"] * 3 + ["pinned_host"]
    assert [pieces(sh, shape) for sh in jax.tree.leaves(mu)] == [4, 4, 4, 4]


def test_a_stage_rebuilt_without_its_choices_is_refused(searched):
    """A stage whose plan lacks the ZeRO stages (or recomputation, FP8, offload) its operators are given would run
    without them: refused."""
    import shardplan.jax as sj

    params, batch, plan = searched
    for edit in ({"state_stage": 1}, {"recompute": True}):
        with pytest.raises(ShardplanError, match="does not carry the recomputation, FP8 products, offload or ZeRO"):
            sj.apply(with_choices(plan, {"L1/dot_general": edit}, listed=False), scoped, params, batch, DEVICES)
