"""Running a staged plan with JAX: a stage axis of the mesh, stacked layers, activations shifted by ppermute.

Mechanism (the approach of MaxText's and Praxis's pipelines): the S stages
are uniform, each a stack of the same layer function; the per-stage
parameters are stacked along a leading axis of length S and sharded over the
mesh axis ``stage`` (optionally beside a ``data`` axis that splits each
micro-batch). Inside :func:`jax.shard_map`, every stage runs the same
program for ``m + S - 1`` ticks: at tick t stage 0 takes micro-batch t,
every stage applies its layers to what it holds, and ``ppermute`` shifts the
results one stage on; the last stage's output for micro-batch ``t - S + 1``
is kept. The backward pass is JAX's transpose of that loop (ppermute
transposes to the opposite shift), so forwards run in the fill-drain order of
GPipe and the backward pass mirrors it; 1F1B's interleaving of forward and
backward and its lower activation memory are not reproduced (XLA keeps the
loop's residuals for all m micro-batches).

Limits: uniform stages only (same layer function, same parameter shapes,
layers per stage = L / S); the embedding and the head run outside the
pipeline (replicated), and the micro-batch count must be at least 1. The
numerics equal the unsharded program up to float reassociation
(``tests/test_pipeline_jax.py``).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["stack_stages", "pipeline_forward"]


def stack_stages(layer_params: list[Any], num_stages: int) -> Any:
    """Stack L layers' parameter trees into one tree with leading axes (S, L/S)."""
    import jax
    import jax.numpy as jnp

    from shardplan.errors import ShardplanError

    n = len(layer_params)
    if num_stages < 1 or n % num_stages:
        raise ShardplanError(f"{n} layers cannot be split into {num_stages} equal stages")
    per = n // num_stages
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs).reshape((num_stages, per) + xs[0].shape), *layer_params)


def pipeline_forward(layer_fn: Callable[[Any, Any], Any], stacked: Any, xs: Any, mesh: Any,
                     stage_axis: str = "stage", data_axis: str | None = None) -> Any:
    """Outputs of all micro-batches ``xs`` (m, micro-batch, ...) through the S-stage pipeline.

    ``layer_fn(params, x) -> x`` is one layer; ``stacked`` has leading axes (S, layers per stage)
    (:func:`stack_stages`); ``mesh`` has an axis ``stage_axis`` of size S (and ``data_axis`` splitting
    each micro-batch's batch dimension, if given). Differentiable.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    S = mesh.shape[stage_axis]
    m = xs.shape[0]
    perm = [(i, (i + 1) % S) for i in range(S)]

    def stage_program(params, xs_local):
        params = jax.tree_util.tree_map(lambda p: p[0], params)
        idx = jax.lax.axis_index(stage_axis)

        def apply_stage(x):
            def body(h, layer):
                return layer_fn(layer, h), None

            return jax.lax.scan(body, x, params)[0]

        def tick(carry, t):
            state, outputs = carry
            inp = jnp.where(idx == 0, xs_local[jnp.minimum(t, m - 1)], state)
            out = apply_stage(inp)
            j = t - (S - 1)
            keep = (idx == S - 1) & (j >= 0)
            outputs = jnp.where(keep, outputs.at[jnp.clip(j, 0, m - 1)].set(out), outputs)
            return (jax.lax.ppermute(out, stage_axis, perm), outputs), None

        # the carry varies over stages (each holds its own micro-batch): say so to shard_map's type check
        init = jax.tree_util.tree_map(lambda z: jax.lax.pcast(z, (stage_axis,), to="varying"),
                                      (jnp.zeros_like(xs_local[0]), jnp.zeros_like(xs_local)))
        (_, outputs), _ = jax.lax.scan(tick, init, jnp.arange(m + S - 1))
        return jax.lax.psum(jnp.where(idx == S - 1, outputs, jnp.zeros_like(outputs)), stage_axis)

    x_spec = P(None, data_axis) if data_axis else P()
    param_spec = jax.tree_util.tree_map(lambda _: P(stage_axis), stacked)
    return jax.shard_map(stage_program, mesh=mesh, in_specs=(param_spec, x_spec), out_specs=x_spec)(stacked, xs)
