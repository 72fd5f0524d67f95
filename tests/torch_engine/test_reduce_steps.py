"""The run's partial-sum reductions, one process: :func:`shardplan.torch.run.reduce_steps` (one redistribution
per reduced dimension) and :func:`shardplan.torch.run.flat_groups` (the mesh axes flattened per dimension), and
the PyTorch path's machine (:func:`shardplan.torch.device.dtensor_machine`). What the 4-process run sends with
them: ``test_dtensor_reductions.py``."""

from __future__ import annotations

import dataclasses

import pytest

from torch.distributed.tensor import Partial, Replicate, Shard

from shardplan.errors import ShardplanError
from shardplan.machine import Machine, preset
from shardplan.torch.device import dtensor_machine
from shardplan.torch.run import flat_groups, reduce_steps

P, R = Partial(), Replicate()


def test_one_reduced_dimension_is_one_redistribution():
    assert reduce_steps((P, P), (R, R), ("k", "k")) == [(R, R)]  # a dim over both axes: one step
    assert reduce_steps((P, Shard(0)), (R, Shard(0)), ("k", "b")) == [(R, Shard(0))]
    assert reduce_steps((Shard(0), R), (R, R), ("b", None)) == [(R, R)]  # nothing partial: one step


def test_several_reduced_dimensions_are_reduced_one_at_a_time_in_mesh_order():
    assert reduce_steps((P, P), (R, R), ("b", "s")) == [(R, P), (R, R)]
    # a dim over two axes, then another; a kept shard and a replica axis untouched until the last step
    src, dst = (R, P, P, Shard(1), P), (R, R, R, Shard(1), Shard(0))
    assert reduce_steps(src, dst, (None, "b", "b", "n", "s")) == [(R, R, R, Shard(1), P), dst]
    # an axis that stays partial (a deferred reduction) is no step of its own
    assert reduce_steps((P, P, P), (R, P, R), ("b", "k", "s")) == [(R, P, P), (R, P, R)]


def test_flat_groups_are_the_axes_of_each_dimension_split_over_several():
    rows = [("k", "k", None), (None, "b", "b"), ("b", "s", None), ("k", "k", "n"), ("n", "n", "n")]
    assert flat_groups(rows) == [(0, 1), (1, 2), (0, 1, 2)]
    assert flat_groups([("b",), (None,)]) == []


def test_the_torch_path_charges_what_dtensor_sends():
    m = dtensor_machine(dataclasses.replace(preset("h100", 8), reduce_per_dim=False))
    assert (m.stepwise_redistribution, m.reduce_per_dim, m.scatter_gathered_grads) == (False, True, True)
    assert preset("h100", 8).scatter_gathered_grads is False and preset("paper", 8).scatter_gathered_grads is False
    with pytest.raises(ShardplanError, match="scatter_gathered_grads"):
        Machine(4, scatter_gathered_grads=1)
