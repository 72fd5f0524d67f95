"""Running a pipeline plan with JAX: one jitted program per stage on its sub-mesh (the searched plan), or a
stage axis with ``ppermute`` (uniform stages).

**A searched plan** (:func:`pipeline`, :class:`StagedStep`). The loss
``loss_fn(params, batch)`` is traced (:func:`shardplan.jax.trace`) at the
micro-batch size and the pipeline search
(:func:`shardplan.pipeline.api.pipeline_solve`) finds the stages, their
sub-meshes, m and the schedule. Units are the operators' name scopes (the
first component after the scope every operator shares: ``jax.named_scope``
blocks, or a flax model's submodules, ``M/L0/...`` giving the unit ``L0``).
Execution, for each stage (each chunk of an interleaved plan):

* the program's equations are assigned to stages
  (:func:`shardplan.pipeline.execute.assign_nodes`): an operator's to its
  unit's stage, the rest next to their first reader;
* the stage's equations run as one function, re-run with the sharding
  constraints of the *stage's own intra-stage plan* on both sides of every
  edge (:mod:`shardplan.jax.run`'s hooks), its meshes built over the stage's
  sub-mesh, devices ``[offset, offset + q)``; its parameters live there,
  sharded as the plan's first reader in the stage asks;
* its forward pass is one ``jax.jit`` that returns the outputs and the
  ``jax.vjp`` closure (residuals stay on the stage's devices); its backward
  pass is a second ``jax.jit`` applying that closure to the cotangents;
* the tensors crossing a cut go to the next stage with ``jax.device_put``
  into the sharding its first reader's layout asks for (a redistribution
  between the two stages' layouts), and their cotangents come back the
  same way into the producer's layout; a value read by several later stages
  is sent to each, and its cotangents summed;
* one Python controller issues the m forward and backward passes of every
  stage in the order of the plan's schedule
  (:func:`shardplan.pipeline.execute.issue_order`: 1F1B, GPipe,
  interleaved 1F1B with v chunks per device group, or ZB-H1's order of
  forwards and backwards, each backward whole: the vjp of a stage computes
  its input and weight gradients together, so the W passes are not issued
  apart), the micro-batches being
  consecutive slices of the batch's leading axis; gradients are accumulated
  per stage (a ZeRO 0/1 weight replicated over some of the stage's mesh axes
  and read only by matmuls, gathers or scales that sum over those axes, of the
  weight or of views of it: as each device's partial sums, added locally and
  reduced once a step, :func:`_deferrable`); JAX's
  asynchronous dispatch lets stages on disjoint devices
  overlap, each device running its passes in the order issued.

``step.train_step(optimizer, params)`` (:class:`StagedTrain`) adds an optax
update per stage on that stage's devices, each parameter leaf held as its
stage's ZeRO stage and offload say (optimizer state in shards, gradients
reduce-scattered, stage-3 parameters in shards gathered in the stage's
programs; optimizer state or parameters in ``pinned_host`` between steps):
the one-program :mod:`shardplan.jax.memory` and :mod:`shardplan.jax.offload`
applied to each stage's sub-mesh.

Non-uniform stages (different blocks, different sub-mesh sizes) are fine.
Limits: the loss must be the *mean* over the batch's leading axis (the step
returns the mean of the m micro-batch losses and the gradient of that mean;
``reduction="sum"`` for a summed loss); every batch leaf carries the batch
on axis 0 (other leaves are given whole to every micro-batch); a cut inside
a ``jax.checkpoint`` region or a custom-derivative call is refused; the
order in which XLA actually runs concurrent work on one device is the
runtime's (the controller only fixes the issue order); the stage-to-stage
transfers are ``device_put`` copies issued by the controller when the
consumer's pass is issued, not sends scheduled to overlap the producer's
next pass; a parameter read by several stages (a tied embedding) has a copy
on each, and its gradient is the sum of the copies'. Interleaved plans keep
every chunk's parameters on its group.

**Uniform stages on a stage axis** (:func:`stack_stages`,
:func:`pipeline_forward`; the approach of MaxText's and Praxis's
pipelines): the S stages are uniform, each a stack of the same layer
function; the per-stage parameters are stacked along a leading axis of
length S and sharded over the mesh axis ``stage`` (optionally beside a
``data`` axis that splits each micro-batch). Inside :func:`jax.shard_map`,
every stage runs the same program for ``m + S - 1`` ticks: at tick t stage 0
takes micro-batch t, every stage applies its layers to what it holds, and
``ppermute`` shifts the results one stage on; the last stage's output for
micro-batch ``t - S + 1`` is kept. The backward pass is JAX's transpose of
that loop (ppermute transposes to the opposite shift), so forwards run in
the fill-drain order of GPipe and the backward pass mirrors it; 1F1B's
interleaving of forward and backward and its lower activation memory are not
reproduced (XLA keeps the loop's residuals for all m micro-batches). Limits:
uniform stages only (same layer function, same parameter shapes, layers per
stage = L / S); the embedding and the head run outside the pipeline
(replicated).

Both equal the unsharded program up to float reassociation
(``tests/test_pipeline_jax.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.jax.local_reads import Island, apply_views, to_auto

__all__ = ["stack_stages", "pipeline_forward", "pipeline", "StagedStep", "StagedTrain", "staged_train", "scoped_trace",
           "Tracer", "batch_size", "build_staged"]


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


# ---------------------------------------------------------------------------
# a searched plan: one jitted program per stage on its sub-mesh
# ---------------------------------------------------------------------------
def _unit_names(names: Sequence[str]) -> dict[str, str]:
    """Operator names (in graph order) with the scope every operator shares removed (``M/L0/dot`` ->
    ``L0/dot``), and each block made contiguous.

    An operator directly in the shared scope (``M/add``) keeps its full path with ``.`` for ``/``
    (``M.add``): unscoped, it joins its unscoped neighbours' unit. A block whose operators come back after
    another unit has started (a scope entered twice: a tied embedding that encodes and decodes, a jitted
    helper such as ``jax.nn.one_hot`` called twice) is split into its contiguous runs, the k-th run after
    the first named ``block#k`` (``_one_hot#2/eq``): each run is a unit the stages may cut around.
    """
    scopes = [n.split("/")[:-1] for n in names if "/" in n]
    d = 0
    while scopes and all(len(s) > d for s in scopes) and len({s[d] for s in scopes}) == 1:
        d += 1
    out = {}
    for n in names:
        parts = n.split("/")
        out[n] = n if "/" not in n or d == 0 else ("/".join(parts[d:]) if len(parts) - d >= 2 else ".".join(parts))
    out = _contiguous_blocks(out)
    if len(set(out.values())) != len(out):
        raise ShardplanError("operator names collide once their shared scope is removed")
    return out


def _contiguous_blocks(names: Mapping[str, str]) -> dict[str, str]:
    """``names`` (old -> new, in graph order) with the block prefix (before the first ``/``) of every run after
    the first of a block renamed ``block#k`` (k = 2, 3, ...; skipping prefixes already in use)."""
    prefix = lambda n: n.split("/", 1)[0] if "/" in n else None  # noqa: E731
    used = {prefix(n) for n in names.values()} - {None}
    runs: dict[str, int] = {}
    out: dict[str, str] = {}
    last: str | None = None
    current: str | None = None
    for old, new in names.items():
        key = prefix(new)
        if key is not None and key != last:
            runs[key] = runs.get(key, 0) + 1
            current = key
            if runs[key] > 1:
                k = runs[key]
                while f"{key}#{k}" in used:
                    k += 1
                current = f"{key}#{k}"
                used.add(current)
        last = key
        out[old] = new if key is None or current == key else current + new[len(key):]
    return out


def scoped_trace(loss_fn: Callable[..., Any], params: Any, batch: Any) -> tuple[Any, Any]:
    """:func:`shardplan.jax.trace` of ``loss_fn(params, batch)`` with operators renamed by
    :func:`_unit_names`, so that the units the pipeline search cuts between are the model's blocks."""
    from shardplan.jax.lower import trace

    graph, info = trace(loss_fn, params, batch, params_argnums=(0,))
    ren = _unit_names([op.name for op in graph.operators])
    if all(k == v for k, v in ren.items()):
        return graph, info
    return graph.renamed(ren), info.renamed(ren)


def batch_size(info: Any) -> int:
    sizes = {info.leaf_shapes[i][0] for i in info.batch_leaves}
    if len(sizes) != 1:
        raise ShardplanError(f"the batch leaves must share their leading (batch) axis, got sizes {sorted(sizes)}")
    return int(sizes.pop())


def _shape_tree(tree: Any, batch_leaves: frozenset[int] | None = None, rows: int | None = None,
                offset: int = 0) -> Any:
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        shape = tuple(jax.numpy.shape(x))
        if rows is not None and batch_leaves is not None and i + offset in batch_leaves:
            shape = (rows,) + shape[1:]
        out.append(jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x)))
    return jax.tree_util.tree_unflatten(treedef, out)


class Tracer:
    """``build(rows)`` for :class:`~shardplan.pipeline.stages.ModelStages`: the loss traced at ``rows`` examples."""

    def __init__(self, loss_fn: Callable[..., Any], params: Any, batch: Any) -> None:
        import jax

        self.loss_fn = loss_fn
        self.params = _shape_tree(params)
        self.batch = batch
        _, self.full_info = scoped_trace(loss_fn, self.params, _shape_tree(batch))
        self.offset = len(jax.tree_util.tree_leaves(params))
        self.cache: dict[int, tuple[Any, Any]] = {}

    def traced(self, rows: int) -> tuple[Any, Any]:
        if rows not in self.cache:
            b = _shape_tree(self.batch, self.full_info.batch_leaves, rows, self.offset)
            self.cache[rows] = scoped_trace(self.loss_fn, self.params, b)
        return self.cache[rows]

    def __call__(self, rows: int) -> Any:
        return self.traced(rows)[0]


def _top_ancestor(prog: Any) -> Callable[[int], int]:
    """Equation index -> the top-level equation that runs it (itself, its remat call, its custom call)."""
    from shardplan.jax.flatten import TOP

    call_eqn = {e.call_id: k for k, e in enumerate(prog.eqns) if e.call_id is not None}

    def top(k: int) -> int:
        while True:
            e = prog.eqns[k]
            if e.parent == TOP:
                return k
            if e.parent is None:  # a custom-derivative body: its call follows it
                k += 1
                while prog.eqns[k].parent is None:
                    k += 1
            else:
                k = call_eqn[e.parent]

    return top


class _Stage:
    """One stage's program on its sub-mesh: its equations, what crosses its cuts, shardings, two jits."""

    def __init__(self, index: int, spec: Any, plan: Any, info: Any, eqns: list[int], devices: Sequence[Any],
                 leaf_dtypes: Sequence[Any], readers: Mapping[int, set[int]], loss_var: int | None) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec

        from shardplan.jax.fp8 import fp8_equations, fp8_operators, with_history
        from shardplan.jax.memory import param_views
        from shardplan.jax.run import constrain_both_ways, constrain_forward, evaluate_eqns, ring_hooks
        from shardplan.jax.shardings import _axis_dims, layout_sharding, replicated

        self.index, self.spec, self.plan, self.eqns = index, spec, plan, eqns
        self.devices = tuple(devices)
        prog = info.program
        leaf_of = {v: i for i, v in enumerate(prog.invars)}
        dtype_of: dict[int, Any] = {}
        for e in prog.eqns:
            for v, dt in zip(e.outvars, e.out_dtypes):
                dtype_of[v] = dt
        names = {op.name for op in plan.graph.operators}
        lays = plan.layouts
        out_sh = {info.op_vars[n]: layout_sharding(lays[n], _axis_dims(plan.graph[n].output), self.devices)
                  for n in names if n in info.op_vars}
        read_sh = {(k, s): layout_sharding(lays[n], dims, self.devices)
                   for n in names for k, s, dims in info.reads.get(n, ())}
        # constrained on prime-factor meshes: JAX names the shardings XLA chose for the jits' results (the vjp's
        # residuals) on the mesh of the constraint the value's type carries, and refuses a tiling that mesh
        # cannot express (IndivisibleError: a 2 x 2 tiling on a 1-D mesh of 4), which prime-factor axes can
        produce = {v: constrain_both_ways(_factored(s)) for v, s in out_sh.items()}
        consume = {key: constrain_both_ways(_factored(s)) for key, s in read_sh.items()}
        ring_consume, ring_replace = ring_hooks(plan, info, self.devices, _factored)  # a ring plan's attentions
        self.replace = {**fp8_equations(plan, info), **ring_replace}
        self.rep = _factored(replicated(self.devices))
        own = {v for k in eqns for v in prog.eqns[k].outvars}
        leaves: list[int] = []
        ins: list[int] = []
        in_sh: dict[int, Any] = {}
        for k in eqns:
            for slot, a in enumerate(prog.eqns[k].invars):
                if not isinstance(a, int) or a in own:
                    continue
                if a in leaf_of:
                    if leaf_of[a] not in leaves:
                        leaves.append(leaf_of[a])
                elif a not in in_sh:
                    ins.append(a)
                    in_sh[a] = _factored(read_sh[(k, slot)]) if (k, slot) in read_sh else self.rep
        self.in_sh = in_sh
        self.leaf_sh = {}
        views = param_views(info)
        # a leaf no operator reads itself (read only through views an operator's access cannot express: a weight
        # reshaped to merge axes) stays replicated, on the mesh of the first read of a view of it: the mesh its
        # reads' layouts use, so that its reads can be deferred (_deferrable)
        viewed: dict[int, Any] = {}
        for (k, slot), sh in sorted(read_sh.items(), key=lambda kv: kv[0]):
            a = prog.eqns[k].invars[slot]
            if isinstance(a, int) and views.get(a) is not None and a != prog.invars[views[a]]:
                viewed.setdefault(views[a], NamedSharding(sh.mesh, PartitionSpec()))
        for i in leaves:
            uses = [(n, d) for n, d in info.leaf_uses.get(i, ()) if n in names]
            self.leaf_sh[i] = (layout_sharding(lays[uses[0][0]], uses[0][1], self.devices) if uses else
                               viewed.get(i, self.rep))
        self.leaf_put = {i: _factored(sh) for i, sh in self.leaf_sh.items()}  # the same, as the jits take them
        inexact = lambda dt: jnp.issubdtype(dt, jnp.inexact)  # noqa: E731
        self.params = [i for i in leaves if i in info.param_leaves and inexact(leaf_dtypes[i])]
        self.data = [i for i in leaves if i not in self.params]
        self._hold_state(plan, info, names)
        # a ZeRO 0/1 leaf whose tile has replicas and whose every read sums over them (a matmul, a gather, a scale:
        # :func:`_deferrable`) enters as an Explicit-axes value marked reduced over them, each read run on Explicit
        # axes or per device, so its gradient comes back unreduced (each device's partial sum): summed locally over
        # the micro-batches, reduced once a step (:meth:`reduce_grads`); in a stage that offloads activations too
        # (the forward program's Explicit-typed residuals leave it on Auto axes: :func:`_residuals`)
        shapes = {v: tuple(sh) for e in prog.eqns for v, sh in zip(e.outvars, e.out_shapes)}
        shapes.update({prog.invars[i]: tuple(info.leaf_shapes[i]) for i in self.params})
        exported = frozenset(v for v in own if readers.get(v, set()) - {index})
        self.defer, islands = _deferrable(prog, set(eqns), self.params, shapes, self.zero, self.param_put,
                                          self.replace, {key: _factored(sh) for key, sh in read_sh.items()},
                                          {v: _factored(sh) for v, sh in out_sh.items()}, exported)
        passed = set()  # a deferred leaf's views and broadcasts pass the Explicit leaf on: no constraint on them
        for k, run_k in islands.items():
            if isinstance(run_k, (_PassThrough, _Carry)):
                passed.update(prog.eqns[k].outvars)
                for v in prog.eqns[k].outvars:
                    produce.pop(v, None)
        for (k, slot), sh in read_sh.items():  # a read of a stage >= 2 leaf: its gradient straight into the shards
            a = prog.eqns[k].invars[slot]
            i = views.get(a) if isinstance(a, int) else None
            if i is not None and self.zero.get(i, 0) >= 2:
                whole = a == prog.invars[i]
                consume[(k, slot)] = constrain_forward(_factored(sh), self.grad_put[i] if whole else None)
            elif i in self.defer or a in passed:  # a deferred leaf arrives Explicit-typed (_deferrable)
                consume.pop((k, slot), None)
        consume.update(ring_consume)
        policy = _name_saved(plan, info, eqns, produce, gather=3 in self.zero.values())
        self.fin = [v for v in ins if inexact(dtype_of[v])]
        self.oin = [v for v in ins if v not in self.fin]
        outs = sorted(v for v in own if readers.get(v, set()) - {index})
        if loss_var is not None:
            outs = [loss_var]
        self.fout = [v for v in outs if inexact(dtype_of[v])]
        self.oout = [v for v in outs if v not in self.fout]
        self.out_sh = {v: _factored(out_sh[v]) if v in out_sh else self.rep for v in outs}
        self.loss_dtype = dtype_of[loss_var] if loss_var is not None else None
        fin, oin, data, params, fout, oout = self.fin, self.oin, self.data, self.params, self.fout, self.oout
        replace = {**self.replace, **islands}

        names = self.fp8_names = fp8_operators(plan, info)

        def run(p: tuple, fi: tuple, oi: tuple, d: tuple, h: dict) -> tuple[tuple, tuple]:
            env: dict[int, Any] = {}
            for i, x in zip(params, p):
                env[prog.invars[i]] = x
            for i, x in zip(data, d):
                env[prog.invars[i]] = x
            env.update(zip(fin, fi))
            env.update(zip(oin, oi))
            evaluate_eqns(info, eqns, env, produce, consume, replace=with_history(replace, names, h or None))
            return tuple(env[v] for v in fout), tuple(env[v] for v in oout)

        body = run if policy is None else jax.checkpoint(run, policy=policy)
        self.remat = policy is not None
        deferred = [self.defer.get(i) for i in params]
        explicit = lambda p: tuple(x if sh is None else _to_explicit(x, sh) for x, sh in zip(p, deferred))  # noqa: E731
        # (params, float inputs, other inputs, data, histories) -> (float outputs, other outputs); histories: the
        # amax histories of the stage's FP8 operators (delayed scaling), or {} (current scaling); the params as
        # placed (Auto axes), the deferred ones made Explicit first
        self.body = lambda p, fi, oi, d, h: body(explicit(p), fi, oi, d, h)

        def forward(p: tuple, fi: tuple, oi: tuple, d: tuple, h: dict) -> tuple:
            # the vjp is taken at the Explicit leaves, so their cotangents stay unreduced; its Explicit-typed
            # residuals leave the program on Auto axes (_Residuals)
            out, vjp, aux = jax.vjp(lambda p_, fi_, h_: body(p_, fi_, oi, d, h_), explicit(p), fi, h, has_aux=True)
            return out, _residuals(vjp), aux

        self.forward = jax.jit(forward)
        self.update_put = {i: self.state_put[i] if self.zero[i] == 1 else self.grad_put[i] for i in params}
        self.reducers = {into: _reducer([self.defer.get(i) for i in params], [put[i] for i in params])
                         for into, put in (("gradient", self.grad_put), ("update", self.update_put))}
        gput = [self.grad_put[i] if self.zero[i] >= 2 else None for i in params]

        def backward(vjp: Any, g: tuple) -> tuple:
            gp, gfi, gh = vjp()(g)
            gp = tuple(x if sh is None else jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(gp, gput))
            gp = tuple(x if sh is None else _stack_partial_sums(x, sh) for x, sh in zip(gp, deferred))
            return gp, gfi, gh

        self.backward = jax.jit(backward)

    def reduce_grads(self, grads: tuple, into: str = "gradient") -> tuple:
        """The stage's gradients (one per leaf of ``params``) with each deferred leaf's partial sums reduced: into
        its ``grad_put`` sharding (``into="gradient"``: an all-reduce over the tile's replicas) or its
        ``update_put`` sharding (``into="update"``: the shards of a ZeRO-1 leaf, a reduce-scatter; on XLA:CPU an
        all-reduce and a ``dynamic-slice``); the other leaves as they are."""
        return grads if not self.defer else self.reducers[into](grads)

    def _hold_state(self, plan: Any, info: Any, names: set[str]) -> None:
        """Per parameter leaf of the stage, from its first reader in the stage (as
        :func:`shardplan.jax.memory.leaf_states` and :func:`shardplan.jax.offload.leaf_offloads` take it from its
        first reader): ``zero`` its ZeRO stage, ``host`` the parts kept in host memory (``optimizer``,
        ``parameters``), and the shardings (on prime-factor meshes) of the parameter between steps
        (``param_put``: the shards for stage 3), of its gradient (``grad_put``: the shards for stages 2, 3) and of
        its optimizer state (``state_put``: the shards for stages 1 to 3); the shards divide the tile over the
        sub-mesh axes the tile does not use (:func:`shardplan.jax.memory.shard_over_replicas`)."""
        from shardplan.jax.memory import shard_over_replicas

        mc = getattr(plan, "memory_choices", None)
        index = plan.graph.index
        self.zero: dict[int, int] = {}
        self.host: dict[int, tuple[str, ...]] = {}
        self.param_put: dict[int, Any] = {}
        self.grad_put: dict[int, Any] = {}
        self.state_put: dict[int, Any] = {}
        for i in self.params:
            uses = [n for n, _ in info.leaf_uses.get(i, ()) if n in names]
            z, parts = 0, ()
            if mc is not None and uses:
                z = int(mc.stage(index[uses[0]]))
                parts = tuple(p for p in mc.offload(index[uses[0]]) if p != "activations")
            tile = self.leaf_sh[i]
            shards = shard_over_replicas(tile, info.leaf_shapes[i])[0] if z else tile
            self.zero[i], self.host[i] = z, parts
            self.param_put[i] = _factored(shards if z == 3 else tile)
            self.grad_put[i] = _factored(shards if z >= 2 else tile)
            self.state_put[i] = _factored(shards if z >= 1 else tile)


def _explicit_reduced(sharding: Any, over: frozenset[str] | None = None) -> Any:
    """``sharding`` on its mesh with every axis ``Explicit``, marked ``reduced`` over ``over`` (default: the axes of
    size > 1 its spec does not name, the tile's replicas); None when there are none. A value of this type has as
    cotangent the same sharding ``unreduced`` over those axes: each device holds its own partial sum, no
    collective."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    mesh = sharding.mesh
    free = _free_axes(sharding) if over is None else frozenset(over)
    if not free:
        return None
    explicit = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))
    return NamedSharding(explicit, PartitionSpec(*sharding.spec, reduced=free))


def _free_axes(sharding: Any) -> frozenset[str]:
    """The mesh axes of size > 1 that ``sharding``'s spec does not name: the tile's replicas."""
    mesh = sharding.mesh
    used = {a for e in sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    return frozenset(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)


def _replica_choices(sharding: Any) -> list[Any]:
    """The Explicit types a leaf tiled ``sharding`` may enter a stage as (:func:`_explicit_reduced`): reduced over
    all its replicas R first, then over each smaller nonempty subset of them (largest first, in mesh order). A
    read whose rows split over only some replica axes S leaves the others replicated: each device's term is then
    summed over S alone, the copies over R - S equal (docs/jax.md)."""
    from itertools import combinations

    full = _explicit_reduced(sharding)
    if full is None:
        return []
    axes = [a for a in sharding.mesh.axis_names if a in full.spec.reduced]
    subsets = [frozenset(c) for n in range(len(axes) - 1, 0, -1) for c in combinations(axes, n)]
    return [full] + [_explicit_reduced(sharding, c) for c in subsets]


# views a deferred leaf may be read through: each passes the Explicit leaf on, its reader applies it, on Explicit
# axes before a matmul (these two, which JAX 0.9.2 types on a reduced value) or per device (any, local_reads)
_VIEW_READS = frozenset({"transpose", "convert_element_type"})
_LOCAL_VIEWS = frozenset({"reshape", "squeeze", "slice"})  # and dynamic_slice, split: :func:`_views`
_RUNTIME_VIEWS = frozenset({"dynamic_slice"})  # views whose other operands are values: :class:`_Carry`


def _deferrable(prog: Any, eqns: set[int], params: Sequence[int], shapes: Mapping[int, tuple[int, ...]],
                zero: Mapping[int, int], tiles: Mapping[int, Any], taken: Mapping[int, Any],
                reads: Mapping[tuple[int, int], Any], outs: Mapping[int, Any],
                exported: frozenset[int] = frozenset()) -> tuple[dict[int, Any], dict[int, Island]]:
    """The stage's leaves whose gradient reduction waits for the step's end, and what runs their reads.

    A ZeRO 0/1 leaf ``i`` (``params``, of shape ``shapes[i]``, ``zero``) whose tile (``tiles[i]``) is replicated
    over some mesh axes R is deferred when every equation of the stage (``eqns``, their remat bodies included)
    that reads it, none ``taken`` by an FP8 or ring hook, is one of (the other operands' and outputs' shardings:
    ``reads``, ``outs``, the plan's, on prime-factor meshes, all on the tile's mesh; the leaf read in its tile):

    * a ``dot_general`` whose other operand's free axes (those the weight gradient sums over) are split over
      exactly R, in the operand and in the output (:func:`_island`: run on Explicit axes, JAX's sharding-in-types
      rules type the weight gradient ``unreduced`` over R);
    * a ``gather`` of the leaf (an embedding, a vocabulary-parallel one too) by indices whose batch dimensions are
      split over exactly R (:func:`shardplan.jax.local_reads.gather_island`);
    * a ``broadcast_in_dim`` of the leaf read only by ``mul`` (``add``, ``sub``, ``div``) equations whose other
      operand has the broadcast (size-1) dimensions split over exactly R (a norm's scale, a bias:
      :func:`shardplan.jax.local_reads.scale_island`);
    * a view (``transpose``: a tied embedding read as the head; ``convert_element_type``: a weight read in a
      lower precision) whose every read is one of these: the view passes the Explicit leaf on and its readers
      apply it (:func:`_viewed_island`);
    * a view that moves data within the leaf (``reshape``, ``slice``, ``squeeze``, a ``dynamic_slice`` at constant
      or traced starts, ``split``: :func:`_views`), local (:func:`shardplan.jax.local_reads.local_view`), whose
      every read is one of
      these: the readers apply the views per device, a matmul too
      (:func:`shardplan.jax.local_reads.product_island`).

    R is the tile's replica axes or, failing that, the largest subset of them (:func:`_replica_choices`) for which
    every read meets these conditions: the reads then name no other replica axis, which replicates them.
    A view's or broadcast's result must not be sent to another stage (``exported``). The per-device reads run in a
    ``shard_map`` that JAX's varying-axes typing makes hand back each device's term, ``unreduced`` over R. In each
    case the terms sum to the gradient (docs/jax.md, "What the stage programs send for a weight"). Returns
    ``({leaf: its Explicit sharding reduced over R}, {equation: what runs it})``.
    """
    top = _top_ancestor(prog)
    readers: dict[int, list[tuple[int, int]]] = {}
    for k, e in enumerate(prog.eqns):
        if e.parent is None or top(k) not in eqns:
            continue
        for slot, v in enumerate(e.invars):
            if isinstance(v, int):
                readers.setdefault(v, []).append((k, slot))
    hidden = frozenset(v for e in prog.eqns if e.parent is None for v in e.invars if isinstance(v, int))
    defer: dict[int, Any] = {}
    islands: dict[int, Island] = {}
    cx = _Context(readers, hidden, exported, taken, shapes, reads, outs)
    meshes = list({id(sh.mesh): sh.mesh for sh in reads.values() if sh is not None}.values())
    for i in params:
        for tile in _tile_meshes(tiles[i], meshes) if zero[i] <= 1 else ():
            for sh in _replica_choices(tile):
                runs = _read_islands(prog, prog.invars[i], (), _Leaf(tuple(shapes[prog.invars[i]]), tile, sh), cx)
                if runs is not None:
                    defer[i] = sh
                    islands.update(runs)
                    break
            if i in defer:
                break
    return defer, islands


def _tile_meshes(tile: Any, meshes: Sequence[Any]) -> list[Any]:
    """The tile ``tile`` of a leaf, then, where it is replicated (its spec names no axis), the same replicated
    tile on each other mesh of ``meshes`` over the same devices in the same order: a leaf whose first reader runs
    replicated (a ``dynamic_slice`` at traced starts owns a stacked weight) is then read per device on the mesh
    of the products that read its views, with its replicas the axes they split their rows over."""
    from jax.sharding import NamedSharding, PartitionSpec

    out = [tile]
    if any(e is not None for e in tile.spec):
        return out
    devices = list(tile.mesh.devices.flat)
    for m in meshes:
        if m != tile.mesh and list(m.devices.flat) == devices:
            out.append(NamedSharding(m, PartitionSpec()))
    return out


@dataclass(frozen=True)
class _Leaf:
    """A deferred leaf as its reads see it: its shape, its tile and its Explicit sharding reduced over R."""

    shape: tuple[int, ...]
    tile: Any
    sharding: Any


@dataclass(frozen=True)
class _Context:
    """What :func:`_read_islands` looks up (:func:`_deferrable`'s arguments): the stage's readers of each variable
    (equation, operand slot), the variables custom-derivative bodies read, those sent to other stages, the
    equations FP8 or ring hooks replace, every variable's shape, the plan's read and output shardings."""

    readers: Mapping[int, list[tuple[int, int]]]
    hidden: frozenset[int]
    exported: frozenset[int]
    taken: Mapping[int, Any]
    shapes: Mapping[int, tuple[int, ...]]
    reads: Mapping[tuple[int, int], Any]
    outs: Mapping[int, Any]


def _read_islands(prog: Any, v: int, chain: tuple[Any, ...], leaf: _Leaf, cx: _Context) -> dict[int, Island] | None:
    """What runs each read of ``v``, the leaf seen through the views ``chain``
    (:class:`shardplan.jax.local_reads.View`, :func:`_deferrable`'s cases); None when some read is none of them."""
    from shardplan.jax.local_reads import ELEMENTWISE, gather_island, local_views, product_island, scale_island

    uses = cx.readers.get(v, [])
    if not uses or v in cx.hidden or v in cx.exported or any(k in cx.taken for k, _ in uses):
        return None
    local = local_views(chain, leaf.shape, leaf.tile)  # (shape, tile, views of the blocks) of the viewed leaf
    runs: dict[int, Island] = {}
    for k, slot in uses:
        e = prog.eqns[k]
        out = cx.outs.get(e.outvars[0]) if len(e.outvars) == 1 else None
        run: Island | None = None
        views = _views(e, slot, cx.shapes.get(v))
        if views is not None:
            for var, view in views:
                more = _read_islands(prog, var, chain + (view,), leaf, cx)
                if more is None or more.keys() & runs.keys():  # an equation reading two views of the leaf
                    return None
                runs.update(more)
            run = _Carry() if any(view.operands for _, view in views) else _PassThrough(len(views))
        elif e.name == "dot_general" and all(c.name in _VIEW_READS for c in chain):
            run = _viewed_island(e, slot, chain, leaf, cx.reads.get((k, slot)), cx.reads.get((k, 1 - slot)), out)
        elif e.name == "dot_general" and local is not None:
            run = product_island(e, slot, *local[:2], leaf.sharding, cx.reads.get((k, slot)),
                                 cx.reads.get((k, 1 - slot)), out, local[2])
        elif e.name == "gather" and slot == 0 and local is not None:
            run = gather_island(e, *local[:2], leaf.sharding, cx.reads.get((k, 0)), cx.reads.get((k, 1)), out,
                                local[2])
        elif e.name in ELEMENTWISE and local is not None and len(e.invars) == 2:
            other = e.invars[1 - slot]  # the (viewed) leaf with unit axes, broadcast by the operation itself
            run = None if not isinstance(other, int) else scale_island(
                e, slot, None, cx.shapes[other], len(local[0]), local[1], leaf.sharding, cx.reads.get((k, 1 - slot)),
                out, local[2], viewed=local[0])
        elif e.name == "broadcast_in_dim" and local is not None and len(e.outvars) == 1:
            scaled = cx.readers.get(e.outvars[0], [])
            ok = bool(scaled) and e.outvars[0] not in cx.hidden and e.outvars[0] not in cx.exported
            for k2, s2 in scaled if ok else ():
                e2 = prog.eqns[k2]
                other = e2.invars[1 - s2] if len(e2.invars) == 2 else None
                scale = None if k2 in cx.taken or not isinstance(other, int) else scale_island(
                    e2, s2, e, cx.shapes[other], len(local[0]), local[1], leaf.sharding, cx.reads.get((k2, 1 - s2)),
                    cx.outs.get(e2.outvars[0]), local[2])
                if scale is None or k2 in runs:
                    return None
                runs[k2] = scale
            run = _PassThrough(1) if ok else None
        if run is None or k in runs:  # none, or an equation reading the leaf (or its views) twice
            return None
        runs[k] = run
    return runs


def _views(e: Any, slot: int, shape: tuple[int, ...] | None) -> list[tuple[int, Any]] | None:
    """For an equation ``e`` reading a deferred leaf (or a view of it, of shape ``shape``) as operand ``slot``:
    its results, each with the view of the operand it is (:class:`shardplan.jax.local_reads.View`), when ``e`` is
    a view (a transpose, a cast, a reshape, a squeeze, a slice, a ``dynamic_slice`` at constant starts -- clamped
    into the operand as XLA clamps them -- or at traced ones, its starts then run-time operands of the view
    (:class:`_Carry`), or a ``split``: a slice per result); None otherwise."""
    from shardplan.jax.flatten import Const
    from shardplan.jax.local_reads import slice_view, view_of

    if slot != 0 or not e.outvars:
        return None
    if e.name in _VIEW_READS | _LOCAL_VIEWS and len(e.invars) == 1 and len(e.outvars) == 1:
        return [(e.outvars[0], view_of(e))]
    if shape is None:
        return None
    if e.name == "dynamic_slice" and len(e.outvars) == 1 and all(isinstance(a, Const) for a in e.invars[1:]):
        sizes = tuple(e.params["slice_sizes"])
        lo = [min(max(int(a.value), 0), n - z) for a, n, z in zip(e.invars[1:], shape, sizes)]
        return [(e.outvars[0], slice_view(lo, [a + z for a, z in zip(lo, sizes)]))]
    if e.name in _RUNTIME_VIEWS and len(e.outvars) == 1 and len(e.invars) == len(shape) + 1:
        return [(e.outvars[0], view_of(e))]
    if e.name == "split" and len(e.invars) == 1:
        axis, out = int(e.params["axis"]), []
        start = 0
        for var, n in zip(e.outvars, e.params["sizes"]):
            lo = [0] * len(shape)
            hi = list(shape)
            lo[axis], hi[axis] = start, start + int(n)
            out.append((var, slice_view(lo, hi)))
            start += int(n)
        return out
    return None


def _viewed_island(e: Any, slot: int, chain: tuple[Any, ...], leaf: _Leaf, read: Any, other: Any,
                   out: Any) -> Island | None:
    """The ``dot_general`` equation ``e`` reading, as operand ``slot``, a deferred leaf seen through the views
    ``chain`` (transposes and casts, each passing the Explicit leaf on): the views applied on Explicit axes (the
    value still reduced over R: they move nothing between devices) and the result read as :func:`_island` reads a
    leaf, with the tile transposed as the views transpose it. None unless that read is deferrable."""
    from jax.sharding import NamedSharding, PartitionSpec, use_abstract_mesh

    tile = leaf.tile
    rank = len(leaf.shape)
    for c in chain:
        if c.name == "transpose":
            entries = list(tile.spec) + [None] * (rank - len(tile.spec))
            tile = NamedSharding(tile.mesh, PartitionSpec(*(entries[d] for d in c.params["permutation"])))
    sharding = _explicit_reduced(tile, leaf.sharding.spec.reduced)
    product = _island(e, slot, rank, tile, sharding, read, other, out)
    if product is None or not chain:
        return product

    def run(args: list[Any]) -> list[Any]:
        args = list(args)
        with use_abstract_mesh(sharding.mesh.abstract_mesh):
            args[slot] = apply_views(args[slot], chain)
        return product(args)

    return run




@dataclass(frozen=True)
class _PassThrough:
    """What a deferred leaf's view or broadcast runs: nothing, handing the Explicit leaf on to its readers (as each
    of its ``results``), which apply the view on Explicit axes (:func:`_viewed_island`) or per device, with the
    broadcast (:mod:`shardplan.jax.local_reads`)."""

    results: int

    def __call__(self, args: list[Any]) -> list[Any]:
        return [args[0]] * self.results


@dataclass(frozen=True)
class _Carry:
    """What a deferred leaf's view with run-time operands (a ``dynamic_slice`` at traced starts) runs: nothing but
    handing the leaf on with those operands' values (:class:`shardplan.jax.local_reads.Carried`), which its
    per-device readers apply to each device's block (:func:`shardplan.jax.local_reads.apply_views`)."""

    def __call__(self, args: list[Any]) -> list[Any]:
        from shardplan.jax.local_reads import Carried

        leaf = args[0] if isinstance(args[0], Carried) else Carried(args[0])
        return [leaf.then(args[1:])]


def _spec_axes(spec: Any, dims: Sequence[int]) -> frozenset[str]:
    """The mesh axes a partition spec splits the tensor axes ``dims`` over."""
    entries = list(spec)
    out: set[str] = set()
    for d in dims:
        e = entries[d] if d < len(entries) else None
        out.update(() if e is None else (e,) if isinstance(e, str) else e)
    return frozenset(out)


def _island(e: Any, slot: int, rank: int, tile: Any, sharding: Any, read: Any, other: Any,
            out: Any) -> Callable[[list[Any]], list[Any]] | None:
    """The ``dot_general`` equation ``e`` that reads a deferred leaf (rank ``rank``, tile ``tile``, Explicit
    ``sharding`` reduced over R) as operand ``slot`` (read in ``read``), run on Explicit axes: the other operand
    (read in ``other``) resharded into that type, the product made in the output sharding ``out``, and returned
    on Auto axes. None unless ``e`` is such a read, all three shardings are on the tile's mesh, the leaf is
    read in its tile, and the other operand's free axes are split over exactly R in ``other`` and ``out``."""
    import jax
    from jax.sharding import PartitionSpec, use_abstract_mesh

    if e.name != "dot_general" or None in (read, other, out) or len(e.outvars) != 1:
        return None
    if not (read.mesh == other.mesh == out.mesh == tile.mesh) or not read.is_equivalent_to(tile, rank):
        return None
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    contract, batch = (lc, lb) if slot == 0 else (rc, rb)
    w_free = rank - len(contract) - len(batch)
    out_rank = len(e.out_shapes[0])
    o_free = out_rank - len(batch) - w_free
    o_rank = o_free + len(contract) + len(batch)
    o_contract, o_batch = (rc, rb) if slot == 0 else (lc, lb)
    free = [d for d in range(o_rank) if d not in o_contract and d not in o_batch]
    at = range(len(batch), len(batch) + o_free) if slot == 1 else range(out_rank - o_free, out_rank)
    replicas = sharding.spec.reduced
    if _spec_axes(other.spec, free) != replicas or _spec_axes(out.spec, at) != replicas:
        return None
    named = replicas | _spec_axes(tile.spec, range(rank))  # no axis the leaf is replicated over but not reduced
    if not (_spec_axes(other.spec, range(o_rank)) | _spec_axes(out.spec, range(out_rank))) <= named:
        return None
    mesh = sharding.mesh.abstract_mesh
    dn, precision = e.params["dimension_numbers"], e.params.get("precision")
    preferred = e.params.get("preferred_element_type")

    def run(args: list[Any]) -> list[Any]:
        args = list(args)
        with use_abstract_mesh(mesh):
            args[1 - slot] = jax.sharding.reshard(args[1 - slot], PartitionSpec(*other.spec))
            y = jax.lax.dot_general(args[0], args[1], dn, precision=precision, preferred_element_type=preferred,
                                    out_sharding=PartitionSpec(*out.spec))
        return [to_auto(y, sharding)]

    return run


def _to_explicit(x: Any, sharding: Any) -> Any:
    """``x`` (a value on the Auto axes of ``sharding``'s devices, replicated over its replicas) as a value of
    ``sharding``'s Explicit type (:func:`_explicit_reduced`); no data moves."""
    from jax.sharding import reshard, use_abstract_mesh

    with use_abstract_mesh(sharding.mesh.abstract_mesh):
        return reshard(x, sharding.spec)






@dataclass(frozen=True)
class _Residuals:
    """Rebuilds a stage's ``jax.vjp`` closure from its residuals (``tree``), each ``typed`` one (its Explicit
    sharding; None: left as it was) handed back to that type: ``Partial(_Residuals(...), *leaves)()`` is the
    closure (:func:`_residuals`)."""

    tree: Any
    typed: tuple[Any, ...]

    def __call__(self, *leaves: Any) -> Any:
        import jax

        return jax.tree.unflatten(self.tree, [x if t is None else _retyped(x, t) for x, t in zip(leaves, self.typed)])


def _retyped(x: Any, sharding: Any) -> Any:
    """``x`` resharded to ``sharding`` (a type on an abstract mesh: Explicit axes, or Auto axes and the spec
    ``P()``, which leaves the tiling to the partitioner); for a value already tiled so, no data moves."""
    from jax.sharding import reshard, use_abstract_mesh

    with use_abstract_mesh(sharding.mesh):
        return reshard(x, sharding.spec)


def _residuals(vjp: Any) -> Any:
    """A ``jax.vjp`` closure as a ``Partial`` whose leaves have no Explicit-typed value: each residual typed on a
    mesh with an Explicit axis (a deferred leaf ``reduced`` over its replicas, a read's operand) goes out on the
    same devices' Auto axes with the same tiling, and :class:`_Residuals` types it back in the backward program.
    A result whose type carries a concrete sharding gets a memory kind; in a program with host-memory results (a
    stage offloading activations) JAX then marks it with XLA's ``annotate_device_placement``, a side-effecting
    custom call, which the SPMD partitioner refuses on a value replicated over some devices ("Side-effect ops
    cannot be replicated"): Auto-typed results carry none."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from shardplan.jax.local_reads import auto_mesh

    leaves, tree = jax.tree.flatten(vjp)
    typed, out = [], []
    for x in leaves:
        sh = getattr(getattr(x, "aval", None), "sharding", None)
        if not isinstance(sh, NamedSharding) or AxisType.Explicit not in tuple(sh.mesh.axis_types):
            typed.append(None)
            out.append(x)
            continue
        typed.append(sh)
        out.append(_retyped(x, NamedSharding(auto_mesh(sh), PartitionSpec())))  # unconstrained: the same tiles
    return jax.tree_util.Partial(_Residuals(tree, tuple(typed)), *out)


def _replicas(sharding: Any) -> tuple[str, ...]:
    """The mesh axes of ``sharding`` (an :func:`_explicit_reduced` one) its tile is replicated over, in mesh order."""
    return tuple(a for a in sharding.mesh.axis_names if a in sharding.spec.reduced)


def _stacked_sharding(sharding: Any) -> Any:
    """Where a deferred leaf's partial sums live between programs: an array ``(R, *shape)`` (R the number of
    replicas), on the Auto axes of ``sharding``'s devices, row r of it on the devices of replica r, each row
    tiled as the leaf (:func:`_stack_partial_sums`)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = sharding.mesh
    return NamedSharding(Mesh(mesh.devices, mesh.axis_names), PartitionSpec(_replicas(sharding), *sharding.spec))


def _stack_partial_sums(g: Any, sharding: Any) -> Any:
    """A gradient ``g`` unreduced over the replicas of ``sharding`` (each device's partial sum) as the array
    ``(R, *shape)`` of :func:`_stacked_sharding`: every device's partial sum in its own row, nothing sent (a
    ``shard_map`` over the Explicit mesh that only adds the axis)."""
    import jax
    from jax.sharding import PartitionSpec

    spec = sharding.spec
    stacked = jax.shard_map(lambda x: x[None], mesh=sharding.mesh,
                            in_specs=PartitionSpec(*spec, unreduced=spec.reduced),
                            out_specs=PartitionSpec(_replicas(sharding), *spec), check_vma=False)(g)
    return jax.lax.with_sharding_constraint(to_auto(stacked, sharding), _stacked_sharding(sharding))


@dataclass(frozen=True, eq=False)
class _Reducer:
    """``grads -> grads`` of one stage: the stacked partial sums at ``keys`` (:func:`_stack_partial_sums`)
    summed by the jitted ``program``, the others passed through untouched (outside the program)."""

    keys: tuple[int, ...]
    program: Any

    def __call__(self, grads: tuple) -> tuple:
        done = dict(zip(self.keys, self.program(tuple(grads[k] for k in self.keys))))
        return tuple(done.get(k, g) for k, g in enumerate(grads))


def _reducer(deferred: Sequence[Any], targets: Sequence[Any]) -> _Reducer:
    """The :class:`_Reducer` that sums over the leading (replica) axis each gradient whose ``deferred`` entry is a
    sharding (the gradient arrives stacked, :func:`_stack_partial_sums`) into its ``targets`` sharding: the tile
    (an all-reduce over the replicas) or the shards of the tile (a reduce-scatter)."""
    import jax

    keys = tuple(k for k, sh in enumerate(deferred) if sh is not None)
    program = jax.jit(lambda gs: tuple(g.sum(axis=0) for g in gs),
                      in_shardings=(tuple(_stacked_sharding(deferred[k]) for k in keys),),
                      out_shardings=tuple(targets[k] for k in keys))
    return _Reducer(keys, program)


def _factored(sharding: Any) -> Any:
    """The same sharding (same devices, same tiles) on a mesh whose every axis is cut into its prime factors
    (axis ``a`` of size 12: ``a`` of 2, ``a~1`` of 2, ``a~2`` of 3, row-major, so the devices keep their order), the
    partition spec naming the factors of each axis it named."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    names: list[str] = []
    sizes: list[int] = []
    parts: dict[str, tuple[str, ...]] = {}
    for a, n in sharding.mesh.shape.items():
        fs, f, k = [], 2, int(n)
        while f * f <= k:
            while k % f == 0:
                fs.append(f)
                k //= f
            f += 1
        fs += [k] if k > 1 else []
        fs = fs or [1]
        parts[a] = tuple(a if i == 0 else f"{a}~{i}" for i in range(len(fs)))
        names += parts[a]
        sizes += fs
    mesh = Mesh(sharding.mesh.devices.reshape(sizes), tuple(names))
    spec = []
    for e in sharding.spec:
        if e is None:
            spec.append(None)
        else:
            spec.append(tuple(x for a in ((e,) if isinstance(e, str) else e) for x in parts[a]))
    return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def stage_choices(plan: Any) -> tuple[frozenset[str], frozenset[str]]:
    """Of a stage's intra-stage plan: the operators it recomputes and those whose activations live in host memory
    (none recomputing: a recomputed operator keeps nothing); both empty for a plan without memory choices. (Its
    ZeRO stages and offloaded optimizer state or parameters are the stage's leaves', :meth:`_Stage._hold_state`.)
    """
    mc = getattr(plan, "memory_choices", None)
    if mc is None:
        return frozenset(), frozenset()
    names = [op.name for op in plan.graph.operators]
    recs = frozenset(n for i, n in enumerate(names) if mc.recompute(i)) - plan.graph.recomputed
    offl = frozenset(n for i, n in enumerate(names) if "activations" in mc.offload(i)) - recs
    return recs, offl


def _name_saved(plan: Any, info: Any, eqns: Sequence[int], produce: dict[int, Any], gather: bool = False) -> Any:
    """The checkpoint policy of a stage whose plan recomputes or offloads or that holds stage-3 parameters
    (``gather``; None: none of these), after naming, in ``produce``, what each of the stage's equations ``eqns``
    produces: ``shardplan_saved`` for an operator that neither recomputes nor offloads, ``shardplan_offloaded``
    for one that offloads, nothing for one that recomputes (:func:`shardplan.jax.memory.checkpointed_fn`,
    applied to one stage: the stage's inputs are the checkpoint's arguments, always kept; a stage-3
    parameter's gathered copy is no equation's output, so it is not saved and is gathered again for the
    backward pass)."""
    import jax

    from shardplan.jax.memory import OFFLOADED, SAVED, _compose, _saved_name, equation_owners, param_views

    recs, offl = stage_choices(plan)
    if not recs and not offl and not gather:
        return None
    name, down = _saved_name(SAVED), _saved_name(OFFLOADED)
    views = param_views(info, params_only=False)
    owners = equation_owners(info)
    for k in eqns:
        if owners[k] in recs:
            continue
        for var in info.program.eqns[k].outvars:
            if var not in views:  # a view of an argument is redone from the argument, never saved
                produce[var] = _compose(produce.get(var), down if owners[k] in offl else name)
    if offl:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[SAVED], names_which_can_be_offloaded=[OFFLOADED],
            offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(SAVED)


@dataclass(eq=False)
class StagedStep:
    """A searched pipeline plan for ``loss_fn(params, batch)``, runnable: ``loss, grads = step(params, batch)``.

    Attributes:
        result: the pipeline search's answer (:class:`~shardplan.pipeline.api.PipelineResult`).
        graph, info: the loss traced at the micro-batch size (units renamed, :func:`scoped_trace`).
        devices: all devices; stage i runs on ``devices[offset_i : offset_i + q_i]``.
        schedule: the schedule the passes are issued in (the plan's, or GPipe for a 1F1B plan).
        reduction: "mean" (the loss is a mean over the batch) or "sum".
        stages: per stage (chunk) its program (:class:`_Stage`).
    """

    result: Any
    graph: Any
    info: Any
    devices: tuple
    schedule: str
    reduction: str
    stages: list

    @property
    def plan(self) -> Any:
        return self.result.plan

    def order(self) -> list[tuple[str, int, int]]:
        """The passes in the order they are issued (:func:`shardplan.pipeline.execute.issue_order`)."""
        from shardplan.pipeline.execute import issue_order

        return issue_order(self.plan, self.schedule)

    def reference(self, micro: int | None = None) -> Callable[..., Any]:
        """``loss(params, batch, history=None)``: the unsharded program with the stages' FP8 products, run on each
        of the m micro-batches (consecutive slices of the batch's leading axis, as the step takes them) and
        averaged (summed for ``reduction="sum"``): what the staged step must equal, loss and gradients. With
        current scaling each product scales by its own micro-batch's amax, so this is not the FP8 program of the
        whole batch; with ``history``, delayed scaling from it (its gradient: the amaxes). ``micro``: micro-batch
        ``micro``'s term alone (its loss / m for a mean), whose history gradient is that micro-batch's amaxes as
        the step's backward sees them."""
        import jax

        from shardplan.jax.fp8 import with_history
        from shardplan.jax.run import evaluate

        info, m = self.info, self.plan.micro_batches
        replace = {k: f for st in self.stages for k, f in st.replace.items()}
        names = {n: k for st in self.stages for n, k in st.fp8_names.items()}
        rows = info.leaf_shapes[min(info.batch_leaves)][0] if info.batch_leaves else 0

        def loss(params: Any, batch: Any, history: Any = None) -> Any:
            leaves, tree = jax.tree_util.tree_flatten((params, batch))
            if tree != info.in_tree:
                raise ShardplanError(f"arguments have structure {tree}, the traced loss had {info.in_tree}")
            total = 0.0
            for j in range(m) if micro is None else (micro,):
                part = [x[j * rows:(j + 1) * rows] if i in info.batch_leaves else x for i, x in enumerate(leaves)]
                total = total + evaluate(info, part, replace=with_history(replace, names, history))[0]
            return total / m if self.reduction == "mean" else total

        return loss

    @property
    def fp8_names(self) -> tuple[str, ...]:
        """The operators the stages run in FP8, stage by stage."""
        return tuple(n for st in self.stages for n in st.fp8_names)

    def init_history(self, length: int | None = None) -> dict[str, Any]:
        """The FP8 amax histories before the first step (:func:`shardplan.jax.fp8.init_history`), each on its
        stage's devices, replicated there."""
        import jax

        from shardplan.jax.fp8 import AMAX_HISTORY, init_history

        return {n: jax.device_put(h, st.rep) for st in self.stages
                for n, h in init_history(st.fp8_names, length or AMAX_HISTORY).items()}

    def __call__(self, params: Any, batch: Any, history: Any = None) -> Any:
        """``loss, grads``; with ``history`` (the FP8 amax histories, :meth:`init_history`): delayed scaling,
        ``loss, grads, history`` with the next step's histories (every micro-batch scaled from ``history``, the
        largest amax of the step's micro-batches shifted in: :mod:`shardplan.jax.fp8`). A stage-3 parameter is
        sent to its stage in shards, and a stage 2 or 3 gradient comes back in shards."""
        import jax
        import jax.numpy as jnp

        leaves = self._leaves(params, batch)
        placed = [tuple(jax.device_put(leaves[i], st.param_put[i]) for i in st.params) for st in self.stages]
        loss, grads, hist = self._passes(placed, leaves, history)
        out: list[Any] = [None] * len(leaves)
        for st, g in zip(self.stages, grads):
            for i, x in zip(st.params, g):
                out[i] = x if out[i] is None else out[i] + jax.device_put(x, out[i].sharding)
        n_params = len(jax.tree_util.tree_leaves(params))
        full = [out[i] if out[i] is not None else jnp.zeros_like(leaves[i]) for i in range(n_params)]
        grad_tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), full)
        return (loss, grad_tree) if history is None else (loss, grad_tree, hist)

    def _leaves(self, params: Any, batch: Any) -> list[Any]:
        """The argument leaves, checked against the traced structure and the plan's m micro-batches."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten((params, batch))
        if tree != self.info.in_tree:
            raise ShardplanError(f"arguments have structure {tree}, the traced loss had {self.info.in_tree}")
        m = self.plan.micro_batches
        rows = self.info.leaf_shapes[min(self.info.batch_leaves)][0] if self.info.batch_leaves else 0
        for i in self.info.batch_leaves:
            if tuple(leaves[i].shape) != (rows * m,) + tuple(self.info.leaf_shapes[i][1:]):
                raise ShardplanError(f"batch leaf {self.info.leaf_names[i]} has shape {tuple(leaves[i].shape)}; the "
                                     f"plan is for {m} micro-batches of {self.info.leaf_shapes[i]}")
        return leaves

    def _passes(self, placed: list[tuple], leaves: list[Any], history: Any,
                into: str = "gradient") -> tuple[Any, list[Any], Any]:
        """The m forward and backward passes of every stage in the schedule's order: ``(loss, grads, history)``,
        ``grads[s]`` stage s's gradients (summed over the micro-batches, one per leaf of ``st.params``, in its
        ``grad_put`` shardings, or ``update_put`` for ``into="update"``), ``history`` the next amax histories
        (None without ``history``). ``placed[s]``: stage s's parameters on its devices. A deferred leaf's
        (:attr:`_Stage.defer`) micro-batch gradients are partial sums per device, added locally, and reduced
        once after the passes (:meth:`_Stage.reduce_grads`)."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from shardplan.jax.fp8 import roll_history

        m = self.plan.micro_batches
        rows = self.info.leaf_shapes[min(self.info.batch_leaves)][0] if self.info.batch_leaves else 0

        def micro(i: int, j: int) -> Any:
            x = leaves[i]
            return x[j * rows:(j + 1) * rows] if i in self.info.batch_leaves else x

        scale = 1.0 / m if self.reduction == "mean" else 1.0
        producer = {v: st.index for st in self.stages for v in st.out_sh}
        values: dict[tuple[int, int], Any] = {}
        cot: dict[tuple[int, int], Any] = {}
        vjps: dict[tuple[int, int], Any] = {}
        grads: list[Any] = [None] * len(self.stages)
        amax: list[Any] = [None] * len(self.stages)
        if history is not None and set(history) != set(self.fp8_names):
            raise ShardplanError(f"the histories are for operators {sorted(history)}; the stages run "
                                 f"{sorted(self.fp8_names)} in FP8")
        hist = [{} if history is None else {n: jax.device_put(history[n], st.rep) for n in st.fp8_names}
                for st in self.stages]
        losses = []
        last = len(self.stages) - 1
        for kind, s, j in self.order():
            st = self.stages[s]
            if kind == "F":
                fi = tuple(jax.device_put(values[(v, j)], st.in_sh[v]) for v in st.fin)
                oi = tuple(jax.device_put(values[(v, j)], st.in_sh[v]) for v in st.oin)
                d = tuple(jax.device_put(micro(i, j), st.leaf_put[i]) for i in st.data)
                fo, vjp, oo = st.forward(placed[s], fi, oi, d, hist[s])
                vjps[(s, j)] = vjp
                for v, x in zip(st.fout + st.oout, fo + oo):
                    values[(v, j)] = x
                if s == last:
                    losses.append(fo[0])
                continue
            if s == last:
                g = (jax.device_put(np.asarray(scale, dtype=st.loss_dtype), st.rep),)
            else:
                g = tuple(cot.pop((v, j)) for v in st.fout)
            gp, gfi, gh = st.backward(vjps.pop((s, j)), g)
            grads[s] = gp if grads[s] is None else jax.tree_util.tree_map(jnp.add, grads[s], gp)
            amax[s] = gh if amax[s] is None else jax.tree_util.tree_map(jnp.maximum, amax[s], gh)
            for v, gv in zip(st.fin, gfi):
                p = self.stages[producer[v]]
                gv = jax.device_put(gv, p.out_sh[v])
                cot[(v, j)] = gv if (v, j) not in cot else cot[(v, j)] + gv
        grads = [g if g is None else st.reduce_grads(g, into) for st, g in zip(self.stages, grads)]
        loss = sum(losses[1:], losses[0]) * (1.0 / m if self.reduction == "mean" else 1.0)
        if history is None:
            return loss, grads, None
        return loss, grads, {n: h for h, a in zip(hist, amax) for n, h in roll_history(h, a).items()}

    def train_step(self, optimizer: Any, params: Any) -> "StagedTrain":
        """``train(params, opt_state, batch) -> (params, opt_state, loss)`` with an optax ``optimizer``
        (:class:`StagedTrain`; ``params`` gives the shapes); :meth:`init` makes the first ``opt_state``."""
        return staged_train(self, optimizer, params)

    def init(self, optimizer: Any, params: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` placed as the stages hold them between steps (:meth:`StagedTrain.init`)."""
        return staged_train(self, optimizer, params).init(params)


@dataclass(frozen=True, eq=False)
class StagedTrain:
    """A training step of a :class:`StagedStep` with an optax optimizer:
    ``params, opt_state, loss = train(params, opt_state, batch)`` (``train(params, opt_state, batch, history)``
    with FP8 delayed scaling returns the next histories fourth).

    Every parameter leaf has one *home*: the first stage (chunk) that reads it; a leaf read by several stages (a
    tied embedding) is sent from its home to the others before the passes, their gradients are sent back and
    summed, and it is updated at home. Each stage holds the optimizer state of its own leaves,
    ``optimizer.init`` of the tuple of them (``opt_state[s]``, None for a stage without leaves), on its devices:
    an optimizer whose update couples all the parameters (a global-norm clip) sees one stage's at a time. Per
    leaf, as its ZeRO stage z says (:mod:`shardplan.jax.memory`): the state in shards for z >= 1, the gradient
    reduced into the shards for z >= 2 (the stage's backward; for a deferred z = 1 leaf, once a step after the
    passes, :meth:`_Stage.reduce_grads`), the parameter held in shards for z = 3 (gathered
    by each read in the stage's forward, and again before its backward); the update is computed on the shards
    and, for z = 1, 2, gathered back to the tile by the update's output sharding. A leaf whose home stage offloads
    its ``optimizer`` state or ``parameters`` keeps them in ``pinned_host`` between steps, fetched before the
    passes / the update and put back after (:mod:`shardplan.jax.offload`: copies between programs).

    Attributes:
        step: the :class:`StagedStep`.
        optimizer: the optax optimizer.
        homes: per stage, the leaves it updates (a subset of its ``params``).
        param_homes, state_homes: per stage, the shardings of its leaves and of its optimizer state between steps.
        state_device: per stage, its optimizer state's shardings in device memory.
        updates: per stage, jitted ``update(params, opt_state, grads) -> (params, opt_state)`` (None: no leaves).
    """

    step: StagedStep
    optimizer: Any
    homes: tuple
    param_homes: tuple
    state_homes: tuple
    state_device: tuple
    updates: tuple

    def init(self, params: Any) -> tuple[Any, Any]:
        """``(params, opt_state)``: every parameter leaf at its home, the optimizer state of each stage."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten(params)
        states = []
        for st, own, ph, dev, home in zip(self.step.stages, self.homes, self.param_homes, self.state_device,
                                          self.state_homes):
            if not own:
                states.append(None)
                continue
            p = tuple(jax.device_put(leaves[i], st.param_put[i]) for i in own)
            states.append(jax.device_put(jax.jit(self.optimizer.init, out_shardings=dev)(p), home))
            for i, x, sh in zip(own, p, ph):
                leaves[i] = jax.device_put(x, sh)
        return jax.tree_util.tree_unflatten(tree, leaves), tuple(states)

    def __call__(self, params: Any, opt_state: Any, batch: Any, history: Any = None) -> tuple:
        import jax

        leaves = self.step._leaves(params, batch)
        stages = self.step.stages
        placed = [tuple(jax.device_put(leaves[i], st.param_put[i]) for i in st.params) for st in stages]
        loss, grads, hist = self.step._passes(placed, leaves, history, into="update")
        at = {(s, i): k for s, st in enumerate(stages) for k, i in enumerate(st.params)}
        home = {i: s for s, own in enumerate(self.homes) for i in own}
        total = {i: grads[s][at[(s, i)]] for i, s in home.items()}
        for s, st in enumerate(stages):
            for k, i in enumerate(st.params):
                if home[i] != s:  # a copy's gradient, summed into the home's
                    total[i] = total[i] + jax.device_put(grads[s][k], stages[home[i]].update_put[i])
        new = list(leaves[:len(jax.tree_util.tree_leaves(params))])
        states = list(opt_state)
        for s, (st, own) in enumerate(zip(stages, self.homes)):
            if not own:
                continue
            p = tuple(placed[s][at[(s, i)]] for i in own)
            state = jax.device_put(opt_state[s], self.state_device[s])  # offloaded state fetched
            p, state = self.updates[s](p, state, tuple(total[i] for i in own))
            states[s] = jax.device_put(state, self.state_homes[s])
            for i, x, sh in zip(own, p, self.param_homes[s]):
                new[i] = jax.device_put(x, sh)
        out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new)
        return (out, tuple(states), loss) if history is None else (out, tuple(states), loss, hist)


def staged_train(step: StagedStep, optimizer: Any, params: Any) -> StagedTrain:
    """The :class:`StagedTrain` of ``step`` with an optax ``optimizer`` (``params`` gives the shapes)."""
    import jax
    import optax

    from shardplan.jax.offload import HOST, host_memory_kind

    leaves = jax.tree_util.tree_leaves(params)
    seen: set[int] = set()
    homes, param_homes, state_homes, state_device, updates = [], [], [], [], []
    for st in step.stages:
        own = tuple(i for i in st.params if i not in seen)
        seen.update(own)
        homes.append(own)
        if not own:
            param_homes.append(())
            state_homes.append(None)
            state_device.append(None)
            updates.append(None)
            continue
        if any(st.host[i] for i in own):
            host_memory_kind(st.devices)
        on_host = lambda sh, yes: sh.with_memory_kind(HOST) if yes else sh  # noqa: E731
        p_sh = tuple(st.param_put[i] for i in own)
        g_sh = tuple(st.update_put[i] for i in own)
        s_sh = tuple(st.state_put[i] for i in own)
        shapes = jax.eval_shape(optimizer.init, tuple(jax.ShapeDtypeStruct(jax.numpy.shape(leaves[i]),
                                                                           jax.numpy.result_type(leaves[i]))
                                                      for i in own))
        dev = optax.tree_map_params(optimizer, lambda _, sh: sh, shapes, s_sh, transform_non_params=lambda _: st.rep)
        home = optax.tree_map_params(optimizer, lambda _, sh, yes: on_host(sh, yes), shapes, s_sh,
                                     tuple("optimizer" in st.host[i] for i in own),
                                     transform_non_params=lambda _: st.rep)
        param_homes.append(tuple(on_host(st.param_put[i], "parameters" in st.host[i]) for i in own))
        state_homes.append(home)
        state_device.append(dev)

        def update(p: Any, state: Any, g: Any, s_sh: tuple = s_sh) -> tuple[Any, Any]:
            g = jax.lax.with_sharding_constraint(g, s_sh)
            p_sh = jax.lax.with_sharding_constraint(p, s_sh)
            upd, state = optimizer.update(g, state, p_sh)
            return optax.apply_updates(p_sh, upd), state

        updates.append(jax.jit(update, in_shardings=(p_sh, dev, g_sh), out_shardings=(p_sh, dev)))
    return StagedTrain(step, optimizer, tuple(homes), tuple(param_homes), tuple(state_homes), tuple(state_device),
                       tuple(updates))


def build_staged(result: Any, tracer: Tracer, devices: Sequence[Any], schedule: str | None = None,
                 reduction: str = "mean") -> StagedStep:
    """The runnable form of a pipeline ``result`` whose model ``tracer`` traced (see :func:`pipeline`)."""
    import jax

    from shardplan.jax.flatten import TOP
    from shardplan.pipeline.execute import assign_nodes, issue_order, ops_by_stage, stage_plan, stage_specs

    if reduction not in ("mean", "sum"):
        raise ShardplanError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    plan = result.plan
    m = plan.micro_batches
    graph, info = tracer.traced(result.stages.batch // m)
    prog = info.program
    specs = stage_specs(plan)
    op_stage = ops_by_stage(graph, specs)
    top = _top_ancestor(prog)
    producer: dict[int, int] = {}
    for k, e in enumerate(prog.eqns):
        for v in e.outvars:
            producer.setdefault(v, k)
    fixed: dict[int, int] = {}
    for name, s in op_stage.items():
        ks = [k for k, _, _ in info.reads.get(name, ())]
        if not ks and name in info.op_vars and info.op_vars[name] in producer:
            ks = [producer[info.op_vars[name]]]
        for k in {top(k) for k in ks}:
            if fixed.setdefault(k, s) != s:
                raise ShardplanError(f"equation {k} ({prog.eqns[k].name}, {prog.eqns[k].where}) holds operators of "
                                     f"stages {fixed[k]} and {s}: a stage cut inside a checkpoint or "
                                     "custom-derivative call cannot run")
    order = [k for k, e in enumerate(prog.eqns) if e.parent == TOP]
    top_producer = {v: k for k in order for v in prog.eqns[k].outvars}
    inputs = {k: [top_producer[a] for a in prog.eqns[k].invars if isinstance(a, int) and a in top_producer]
              for k in order}
    if len(prog.outvars) != 1 or not isinstance(prog.outvars[0], int) or prog.outvars[0] not in top_producer:
        raise ShardplanError("the pipelined loss must return one scalar computed from its arguments")
    loss_var = prog.outvars[0]
    last = len(specs) - 1
    stage_of = assign_nodes(order, inputs, fixed, last, outputs=[top_producer[loss_var]])
    if stage_of[top_producer[loss_var]] != last:
        raise ShardplanError("the loss is computed before the last stage; the pipeline cannot return it")
    readers: dict[int, set[int]] = {}
    for k in order:
        for a in prog.eqns[k].invars:
            if isinstance(a, int) and a in top_producer:
                readers.setdefault(a, set()).add(stage_of[k])
    leaf_dtypes = [jax.numpy.result_type(x) for x in jax.tree_util.tree_leaves((tracer.params, tracer.batch))]
    stages = []
    for spec in specs:
        eqns = [k for k in order if stage_of[k] == spec.index]
        sub = list(devices)[spec.offset:spec.offset + spec.devices]
        stages.append(_Stage(spec.index, spec, stage_plan(result, spec.index), info, eqns, sub, leaf_dtypes,
                             readers, loss_var if spec.index == last else None))
    step = StagedStep(result, graph, info, tuple(devices), schedule or plan.schedule, reduction, stages)
    issue_order(plan, step.schedule)  # refuse an impossible schedule now
    return step


def pipeline(loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
             machine: Any = None, *, micro_batches: Sequence[int] = (1, 2, 4, 8), max_stages: int | None = None,
             uniform: bool = False, interleave: Sequence[int] = (), schedules: Sequence[str] = ("1f1b", "interleaved"),
             sizes: Sequence[int] | None = None, budget: float | None = None, periodic: bool = True,
             schedule: str | None = None, reduction: str = "mean", cutoff: int = 1,
             **solve_options: Any) -> StagedStep:
    """Search the pipeline of ``loss_fn(params, batch)`` on ``devices`` and return it runnable.

    ``loss, grads = pipeline(...)(params, batch)`` equals ``jax.value_and_grad(loss_fn)(params, batch)``
    (the loss a mean over the batch, see the module docstring). ``machine`` defaults to the reference
    machine with ``len(devices)`` devices; ``micro_batches`` .. ``periodic`` go to
    :func:`shardplan.pipeline.api.pipeline_solve` (``sizes``: the sub-mesh sizes allowed, e.g. ``(2, 4)``
    to force at least two stages on 8 devices); ``schedule="gpipe"`` issues a 1F1B plan's passes in GPipe's
    order; ``solve_options`` go to each intra-stage solve (configurations dividing the sub-mesh only, so
    every layout is a mesh).
    """
    from shardplan.jax.shardings import devices_and_machine
    from shardplan.pipeline.api import pipeline_solve

    if reduction not in ("mean", "sum"):
        raise ShardplanError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    devices, machine = devices_and_machine(devices, machine)
    tracer = Tracer(loss_fn, params, batch)
    rows = batch_size(tracer.full_info)
    solve_options.setdefault("divides_p", True)
    result = pipeline_solve(tracer, rows, machine, micro_batches=micro_batches, max_stages=max_stages,
                            uniform=uniform, interleave=interleave, schedules=schedules, budget=budget,
                            periodic=periodic, sizes=sizes, cutoff=cutoff, **solve_options)
    return build_staged(result, tracer, devices, schedule, reduction)
