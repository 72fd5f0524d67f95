"""A fit plan's memory-saving choices in the JAX step: ZeRO / FSDP shardings, recomputation, micro-batches.

A plan from :func:`shardplan.fit.solve_fit` (or
:func:`shardplan.fit.plan_with_choices`) carries, beside each operator's
layout, a ZeRO stage, a recomputation flag, and one micro-batch count k.
:func:`fit_step` turns them into a training step:

* **State sharding.** A parameter leaf takes the stage of its first consumer
  (the operator whose layout it already follows). Its *tile* sharding is that
  layout's (as :func:`~shardplan.jax.shardings.plan_shardings` gives it); its
  *sharded* state divides the tile further over the mesh axes the tile does
  not use: the devices that hold copies of the same tile, the data-parallel
  group G of the model (:func:`shard_over_replicas`). Per stage s, the arrays
  with the sharded layout are: s >= 1 the optimizer state, s >= 2 also the
  gradients (reduced straight into shards: a reduce-scatter), s = 3 also the
  parameters themselves; in the step a stage-3 parameter is gathered to its
  tile by the read constraint of each consumer (the all-gather before use, in
  the forward and again for the backward), and a stage 1/2 update is computed
  on the shards and gathered back to the tile by the output sharding of the
  new parameters (:meth:`FitStep.train_step`).
* **Recomputation.** When some operator recomputes, the loss is run under
  ``jax.checkpoint`` with the policy ``save_only_these_names("shardplan_saved")``:
  every value produced by an equation of an operator that does not recompute
  is named ``shardplan_saved`` (``checkpoint_name``), the values of the
  recomputing operators are not, so the backward pass recomputes them from
  the nearest saved values, and saves none of them: the model's "output not
  saved, forward run again". An equation belongs to the operator whose own
  equation (the one it was lowered from) is the last at or before it in
  program order: its fused elementwise tail and the views that follow it.
  Views of the arguments (transposes, a layer's slice of a stacked
  parameter, a transposed image batch) are never saved: they are redone
  from the argument. A stage-3 parameter
  also puts the loss under ``jax.checkpoint`` (with nothing recomputing, only
  the gathered copies are not saved): its gather is done again before the
  backward pass, as the model charges.
  Operators inside the user's own ``jax.checkpoint`` / ``nn.remat``
  (:attr:`shardplan.ir.Graph.recomputed`) recompute under that call, which
  the step keeps: the plan marks them recomputing and the step adds nothing.
* **Micro-batches.** The loss is traced again at the micro-batch shape and
  planned with the same operator layouts (the two traces must give the same
  operators; :class:`~shardplan.errors.ShardplanError` otherwise). The step
  splits every batch leaf along axis 0 into k micro-batches by stride (micro
  batch i holds rows i, i + k, ...: each device keeps its own rows, no data
  moves) and runs ``jax.lax.scan`` over them, accumulating the gradients in
  their stage's sharding. The loss is taken to be a mean over the batch
  (``reduce="mean"``: the step's loss is the mean of the micro-batch losses
  and the gradient their mean) or a sum (``reduce="sum"``).
* **FP8 products.** The product equation of each operator the plan runs in
  FP8 is bound as an FP8 product (:mod:`shardplan.jax.fp8`).
* **Master weights.** Under the precision rule ``master_weights`` (the
  plan's, or ``fit_step(master_weights=True)``) the parameters the step keeps,
  and so the optimizer state, are float32, sharded as the stage says; each
  step casts them to the dtypes the program was traced in and runs the
  program on that copy (:func:`~shardplan.jax.run.compute_cast`): the
  gradients come back float32, w.r.t. the master weights.
* **Host offload.** The values kept by an operator that offloads its
  activations are named ``shardplan_offloaded`` (not ``shardplan_saved``) and
  the checkpoint policy sends them to host memory; optimizer state and
  parameters offloaded live in host memory between steps, and
  :meth:`FitStep.train_step` is then an
  :class:`~shardplan.jax.offload.OffloadStep` (:mod:`shardplan.jax.offload`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from shardplan.errors import ShardplanError
from shardplan.jax.flatten import TOP
from shardplan.jax.fp8 import (AMAX_HISTORY, Fp8TrainState, fp8_equations, fp8_operators, init_history, roll_history,
                               with_history)
from shardplan.jax.lower import TraceInfo, trace
from shardplan.jax.run import (compute_cast, constrain_both_ways, constrain_forward, evaluate, master_copy,
                               plan_master_weights, ring_hooks)
from shardplan.jax.shardings import plan_shardings, replicated

__all__ = ["SAVED", "OFFLOADED", "LeafState", "Fp8TrainState", "shard_over_replicas", "leaf_states", "equation_owners", "checkpointed_fn",
           "fit_step", "FitStep", "states_summary"]

SAVED = "shardplan_saved"
OFFLOADED = "shardplan_offloaded"


@dataclass(frozen=True)
class LeafState:
    """How one argument leaf is held: its stage, its tile sharding and the sharding of its sharded state.

    ``factor``: the number of pieces ``sharded`` cuts the tile into (the
    model's group G when every replica axis found a tensor axis it divides).
    ``group``: G, the devices holding copies of the tile.
    """

    stage: int
    tile: Any
    sharded: Any
    factor: int
    group: int

    @property
    def param(self) -> Any:
        """Sharding of the parameter between steps (sharded for stage 3)."""
        return self.sharded if self.stage == 3 else self.tile

    @property
    def grad(self) -> Any:
        """Sharding of the gradient (reduce-scattered for stages 2 and 3)."""
        return self.sharded if self.stage >= 2 else self.tile

    @property
    def state(self) -> Any:
        """Sharding of the optimizer state (sharded for stages 1 to 3)."""
        return self.sharded if self.stage >= 1 else self.tile


def shard_over_replicas(sharding: Any, shape: Sequence[int]) -> tuple[Any, int]:
    """``sharding`` further divided over its mesh axes that no tensor axis uses; (new sharding, pieces).

    Each unused mesh axis of size > 1 (largest first) is appended to the spec
    of the first tensor axis whose local extent it divides (so the shard of
    device q is a contiguous block of its tile); an axis that divides none is
    left out (the state stays replicated over it).
    """
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    entries: list[list[str]] = [[] if s is None else [s] if isinstance(s, str) else list(s) for s in spec]
    used = {a for e in entries for a in e}
    local = [int(n) // math.prod(mesh.shape[a] for a in e) for n, e in zip(shape, entries)]
    free = sorted((a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1), key=lambda a: -mesh.shape[a])
    pieces = 1
    for a in free:
        n = mesh.shape[a]
        for i, ext in enumerate(local):
            if ext % n == 0:
                entries[i].append(a)
                local[i] = ext // n
                pieces *= n
                break
    new = PartitionSpec(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])
    return NamedSharding(mesh, new), pieces


def _replica_group(sharding: Any) -> int:
    used = {a for s in sharding.spec if s is not None for a in ([s] if isinstance(s, str) else s)}
    return math.prod(n for a, n in sharding.mesh.shape.items() if a not in used)


def leaf_states(plan: Any, info: TraceInfo, leaves: Sequence[Any]) -> tuple[LeafState, ...]:
    """Per argument leaf: its stage (its first consumer's; 0 for data and unread leaves) and shardings.

    ``leaves``: the tile shardings (``plan_shardings(...).leaves``).
    """
    mc = plan.memory_choices
    index = plan.graph.index
    out = []
    for i, tile in enumerate(leaves):
        uses = info.leaf_uses.get(i, ())
        stage = 0
        if i in info.param_leaves and uses and mc is not None:
            stage = mc.stage(index[uses[0][0]])
        sharded, pieces = shard_over_replicas(tile, info.leaf_shapes[i]) if stage else (tile, 1)
        out.append(LeafState(stage, tile, sharded, pieces, _replica_group(tile)))
    return tuple(out)


def equation_owners(info: TraceInfo) -> list[str | None]:
    """Per equation of the flat program, the operator it belongs to (see the module): None before the first."""
    first = {}
    for name, rs in info.reads.items():
        if rs:
            first.setdefault(min(k for k, _, _ in rs), name)
    owner: str | None = None
    out: list[str | None] = []
    for k in range(len(info.program.eqns)):
        owner = first.get(k, owner)
        out.append(owner)
    return out


def _saved_name(label: str = SAVED) -> Callable[[Any], Any]:
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def name(x: Any) -> Any:
        return checkpoint_name(x, label) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x

    return name


def _compose(first: Callable[[Any], Any] | None, then: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return then if first is None else (lambda x: then(first(x)))


_VIEWS = frozenset({"transpose", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type",
                    "copy", "copy_p", "slice", "reduce_precision"})


def param_views(info: TraceInfo, params_only: bool = True) -> dict[int, int]:
    """Variable -> argument leaf, for the leaves themselves and the views of them (transposes, slices, casts...).

    Parameter leaves only, unless ``params_only`` is False (then the data leaves too).
    """
    prog = info.program
    out = {var: i for i, var in enumerate(prog.invars) if i in info.param_leaves or not params_only}
    for e in prog.eqns:
        if e.name in _VIEWS and len(e.invars) == 1 and isinstance(e.invars[0], int) and e.invars[0] in out:
            for var in e.outvars:
                out[var] = out[e.invars[0]]
    return out


def checkpointed_fn(plan: Any, info: TraceInfo, devices: Sequence[Any], stages: Sequence[int] | None = None,
                    shards: Sequence[Any] | None = None, delayed: bool = False) -> tuple[Callable[..., Any], bool]:
    """The traced function with the plan's constraints, recomputation and stage-3 gathers (see the module).

    ``stages``: per argument leaf its ZeRO stage (default all 0); ``shards``:
    per leaf the sharding of its sharded state. Reads of a leaf of stage >= 2
    constrain the forward value to the reader's layout and the gradient to
    the leaf's shards when the read is the leaf itself, leave it free when it
    is a view of it (:func:`constrain_forward`).
    When an operator recomputes or a leaf has stage 3 the function runs under
    ``jax.checkpoint`` saving only what the operators that do not recompute
    produce: a stage-3 weight's gather is then not saved but done again
    before the backward pass. Returns ``(fn, remat)``: ``remat`` is True when
    ``fn`` runs under ``jax.checkpoint``. ``delayed``: ``fn(*args, history)``, the FP8 products scaled from
    the amax histories (:mod:`shardplan.jax.fp8`, delayed scaling; current scaling otherwise).
    """
    import jax

    stages = list(stages) if stages is not None else [0] * len(info.leaf_names)
    sh = plan_shardings(plan, info, devices)
    produce: dict[int, Callable[[Any], Any]] = {var: constrain_both_ways(s) for var, s in sh.values.items()}
    views = param_views(info)
    eqns = info.program.eqns
    consume = {}
    for (k, slot), s in sh.reads.items():
        a = eqns[k].invars[slot]
        sharded = isinstance(a, int) and a in views and stages[views[a]] >= 2
        if not sharded:
            consume[(k, slot)] = constrain_both_ways(s)
            continue
        leaf = views[a]
        whole = shards is not None and a == info.program.invars[leaf]
        consume[(k, slot)] = constrain_forward(s, shards[leaf] if whole else None)
    mc = plan.memory_choices
    index = plan.graph.index
    # the operators the program recomputes itself (a user's jax.checkpoint) re-run under its own call
    recs = set() if mc is None else {n for n, i in index.items() if mc.recompute(i)} - plan.graph.recomputed
    # the operators whose saved activations live in host memory (never recomputing ones)
    offl = set() if mc is None else {n for n, i in index.items() if "activations" in mc.offload(i)} - recs
    remat = bool(recs) or 3 in stages or bool(offl)
    if remat:
        name, down = _saved_name(SAVED), _saved_name(OFFLOADED)
        views = param_views(info, params_only=False)
        for e, owner in zip(info.program.eqns, equation_owners(info)):
            if e.parent == TOP and owner not in recs:
                for var in e.outvars:
                    if var not in views:  # a view of an argument is redone from the argument, never saved
                        produce[var] = _compose(produce.get(var), down if owner in offl else name)
    ring_consume, ring_replace = ring_hooks(plan, info, devices)  # a ring plan's attentions (shardplan.jax.run)
    consume.update(ring_consume)
    replace = {**fp8_equations(plan, info), **ring_replace}
    names = fp8_operators(plan, info)

    def fn(*args: Any) -> Any:
        args, history = (args[:-1], args[-1]) if delayed else (args, None)
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != info.in_tree:
            raise ShardplanError(f"arguments have structure {tree}, the traced function had {info.in_tree}")
        out = evaluate(info, leaves, produce, consume, with_history(replace, names, history))
        return jax.tree_util.tree_unflatten(info.out_tree, out)

    if not remat:
        return fn, False
    if offl:  # saved values named OFFLOADED go to host memory in the forward pass and back for the backward
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[SAVED], names_which_can_be_offloaded=[OFFLOADED],
            offload_src="device", offload_dst="pinned_host")
    else:
        policy = jax.checkpoint_policies.save_only_these_names(SAVED)
    return jax.checkpoint(fn, policy=policy), True


@dataclass(frozen=True, eq=False)
class FitStep:
    """The training step of a fit plan (see the module).

    Attributes:
        plan: the plan (with ``memory_choices``; a plain plan runs as stage 0, no recomputation, k = 1).
        info: the trace at the full batch; ``micro_info`` the trace at the micro-batch shape (k > 1).
        devices: the mesh's devices.
        leaves: per argument leaf its :class:`LeafState`.
        micro_batches: k.
        remat: the loss runs under ``jax.checkpoint`` (some operator recomputes).
        param_shardings, grad_shardings, state_shardings: pytrees matching the parameters: the
            parameters between steps, the gradients the step returns, the optimizer state per parameter.
        batch_shardings: pytree matching the batch.
        step: jitted ``step(params, batch) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``;
            with k > 1 the aux values are stacked over the micro-batches); FP8 products with current scaling.
        loss_fn: the constrained (and checkpointed) loss of one micro-batch.
        fp8_names: the operators run in FP8, in graph order (empty: none).
        fp8_step: for a plan with FP8 products, jitted ``fp8_step(params, batch, history) -> (loss, grads,
            history)``: delayed scaling (:mod:`shardplan.jax.fp8`), the histories of :meth:`init_history` in, the
            next step's out (None without FP8 products); ``fp8_value_and_grad`` the same, not jitted.
        master_weights: the parameters are held in float32 and cast to the program's dtypes inside the step
            (:func:`fit_step`); :meth:`init` makes the float32 copy.
    """

    plan: Any
    info: TraceInfo
    micro_info: TraceInfo
    devices: tuple[Any, ...]
    leaves: tuple[LeafState, ...]
    micro_batches: int
    remat: bool
    param_shardings: Any
    grad_shardings: Any
    state_shardings: Any
    batch_shardings: Any
    step: Callable[..., Any]
    loss_fn: Callable[..., Any]
    value_and_grad: Callable[..., Any]
    fp8_names: tuple[str, ...] = ()
    fp8_step: Callable[..., Any] | None = None
    fp8_value_and_grad: Callable[..., Any] | None = None
    master_weights: bool = False

    def init_history(self, length: int = AMAX_HISTORY) -> dict[str, Any]:
        """The FP8 amax histories before the first step (:func:`shardplan.jax.fp8.init_history`), replicated over
        the devices."""
        import jax

        return jax.device_put(init_history(self.fp8_names, length), replicated(list(self.devices)))

    def opt_state_shardings(self, optimizer: Any, params: Any) -> Any:
        """Shardings of ``optimizer.init(params)``: per-parameter state as :attr:`state_shardings`, the rest
        (step counts) replicated (``optax.tree_map_params``)."""
        import jax
        import optax

        shapes = jax.eval_shape(optimizer.init, params)
        rep = replicated(list(self.devices))
        return optax.tree_map_params(optimizer, lambda _, s: s, shapes, self.state_shardings,
                                     transform_non_params=lambda _: rep)

    @property
    def offloads(self) -> bool:
        """Some operator of the plan keeps something in host memory (:mod:`shardplan.jax.offload`)."""
        mc = self.plan.memory_choices
        return mc is not None and any(mc.offload(i) for i in range(len(mc.choices)))

    def init(self, optimizer: Any, params: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` placed as the plan holds them between steps (offloaded state and parameters
        in host memory); for a plan with FP8 products the state is an :class:`Fp8TrainState`, the optimizer's
        and the empty amax histories (delayed scaling). With :attr:`master_weights` the parameters placed are
        their float32 copy (:func:`~shardplan.jax.run.master_copy`), and the optimizer state follows them."""
        import jax

        if self.master_weights:
            params = master_copy(params)
        if self.offloads:
            from shardplan.jax.offload import offload_step

            params, state = offload_step(self, optimizer, params).init(params)
        else:
            params = jax.device_put(params, self.param_shardings)
            sh = self.opt_state_shardings(optimizer, params)
            state = jax.jit(optimizer.init, out_shardings=sh)(params)
        return (params, Fp8TrainState(state, self.init_history())) if self.fp8_names else (params, state)

    def train_step(self, optimizer: Any, params: Any, donate: bool = True) -> Callable[..., Any]:
        """Jitted ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` with an optax optimizer.

        The update runs on the optimizer state's shards (stages >= 1): the
        gradient is cut to them (stage 1: a local slice of the reduced
        gradient), and the new parameters are gathered back to their tile
        (stages 1, 2) by their output sharding. ``params`` gives the shapes.
        A plan that offloads runs as :class:`~shardplan.jax.offload.OffloadStep` (the same signature; the
        state's copies between host and device memory are made between its programs, ``donate`` unused).
        A plan with FP8 products runs them with delayed scaling (Transformer Engine's default recipe, what the
        cost model charges): its ``opt_state`` is an :class:`Fp8TrainState` carrying the amax histories
        (:meth:`init` makes it).
        """
        import jax
        import optax

        if self.offloads:
            from shardplan.jax.offload import offload_step

            return offload_step(self, optimizer, params)

        opt_sh = self.opt_state_shardings(optimizer, params)
        state_sh, param_sh, rep = self.state_shardings, self.param_shardings, replicated(list(self.devices))
        vg, vgd = self.value_and_grad, self.fp8_value_and_grad

        def train(p: Any, opt_state: Any, batch: Any) -> Any:
            if vgd is not None:
                loss, grads, history = vgd(p, batch, opt_state.history)
                opt_state = opt_state.opt_state
            else:
                loss, grads = vg(p, batch)
            grads = jax.lax.with_sharding_constraint(grads, state_sh)
            p_sh = jax.lax.with_sharding_constraint(p, state_sh)
            updates, opt_state = optimizer.update(grads, opt_state, p_sh)
            new = optax.apply_updates(p_sh, updates)
            return new, Fp8TrainState(opt_state, history) if vgd is not None else opt_state, loss

        if vgd is not None:
            opt_sh = Fp8TrainState(opt_sh, rep)
        batch_sh = self.batch_shardings
        return jax.jit(train, in_shardings=(param_sh, opt_sh, batch_sh), out_shardings=(param_sh, opt_sh, rep),
                       donate_argnums=(0, 1) if donate else ())


def _micro_structs(batch: Any, info: TraceInfo, n_params: int, k: int) -> Any:
    """The batch with every batch leaf's axis 0 divided by ``k``, as ShapeDtypeStructs."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(batch)
    out = []
    for j, x in enumerate(leaves):
        shape = tuple(np.shape(x))
        if n_params + j in info.batch_leaves:
            if shape[0] % k:
                raise ShardplanError(f"batch leaf {info.leaf_names[n_params + j]} has {shape[0]} rows, which "
                                     f"{k} micro-batches do not divide")
            shape = (shape[0] // k,) + shape[1:]
        out.append(jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x)))
    return jax.tree_util.tree_unflatten(tree, out)


def _check_same_program(plan: Any, graph: Any, k: int) -> None:
    want = [(op.name, op.kind) for op in plan.graph.operators]
    got = [(op.name, op.kind) for op in graph.operators]
    if want != got:
        diff = next((a, b) for a, b in zip(want + [None] * len(got), got + [None] * len(want)) if a != b)
        raise ShardplanError(f"the loss traced at 1/{k} of the batch lowers to other operators than the planned "
                             f"one (first difference: planned {diff[0]}, micro-batch {diff[1]}); micro-batches "
                             "need a loss whose program does not depend on the batch size")
    for op, mop in zip(plan.graph.operators, graph.operators):
        split = plan.layout(op.name).split
        bad = [d for d, c in zip(op.dim_names, split) if mop.extents[d] % int(c)]
        if bad:
            raise ShardplanError(f"operator {op.name!r}: dimension {bad[0]} of the micro-batch "
                                 f"({mop.extents[bad[0]]}) is not divisible by its split {split}; "
                                 f"use fewer than {k} micro-batches")


def fit_step(plan: Any, loss_fn: Callable[..., Any], params: Any, batch: Any, devices: Sequence[Any] | None = None,
             has_aux: bool = False, reduce: str = "mean", info: TraceInfo | None = None,
             master_weights: bool | None = None) -> FitStep:
    """The :class:`FitStep` of ``plan`` for ``loss_fn(params, batch)`` (see the module).

    ``info``: the trace of ``loss_fn`` at the full batch that ``plan`` was made
    from (traced again when not given). ``master_weights``: hold the parameters in float32 and run the
    program on a copy cast to the dtypes of ``params`` (the traced ones) inside the step; None: the plan's
    precision rule (:func:`~shardplan.jax.run.plan_master_weights`).
    """
    import jax

    if reduce not in ("mean", "sum"):
        raise ShardplanError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    devices = list(devices) if devices is not None else list(jax.devices())[: plan.machine.num_devices]
    if info is None:
        info = trace(loss_fn, params, batch, params_argnums=(0,))[1]
    mc = plan.memory_choices
    k = 1 if mc is None else int(mc.micro_batches)
    sh = plan_shardings(plan, info, devices)
    states = leaf_states(plan, info, sh.leaves)
    n_params = len(jax.tree_util.tree_leaves(params))
    micro_info = info
    if k > 1:
        g, micro_info = trace(loss_fn, params, _micro_structs(batch, info, n_params, k), params_argnums=(0,))
        _check_same_program(plan, g, k)
    fn, remat = checkpointed_fn(plan, micro_info, devices, [s.stage for s in states], [s.sharded for s in states])
    master = plan_master_weights(plan) if master_weights is None else bool(master_weights)
    dtypes = jax.tree_util.tree_map(jax.numpy.result_type, params)
    if master:
        fn = compute_cast(fn, dtypes)
    tree = info.in_tree

    def pick(attr: str) -> Any:
        return jax.tree_util.tree_unflatten(tree, [getattr(s, attr) for s in states])[0]

    param_sh, grad_sh, state_sh = pick("param"), pick("grad"), pick("state")
    batch_sh = jax.tree_util.tree_unflatten(tree, list(sh.leaves))[1]
    micro_leaves = plan_shardings(plan, micro_info, devices).leaves[n_params:]
    vg1 = jax.value_and_grad(fn, has_aux=has_aux)
    rep = replicated(devices)
    batch_flags = [n_params + j in info.batch_leaves for j in range(len(micro_leaves))]

    def value_and_grad(p: Any, b: Any) -> Any:
        if k == 1:
            val, grads = vg1(p, b)
            return val, jax.lax.with_sharding_constraint(grads, grad_sh)
        leaves, btree = jax.tree_util.tree_flatten(b)
        split = [_split(x, k, s) if is_b else x for x, s, is_b in zip(leaves, micro_leaves, batch_flags)]
        stacked = [x for x, is_b in zip(split, batch_flags) if is_b]

        def body(acc: Any, xs: Any) -> Any:
            it = iter(xs)
            mb = jax.tree_util.tree_unflatten(btree, [next(it) if is_b else x for x, is_b in zip(split, batch_flags)])
            val, g = vg1(p, mb)
            g = jax.lax.with_sharding_constraint(g, grad_sh)
            return jax.tree_util.tree_map(jax.numpy.add, acc, g), val

        zeros = jax.tree_util.tree_map(lambda x: jax.numpy.zeros(x.shape, jax.numpy.result_type(x)), p)
        acc, vals = jax.lax.scan(body, jax.lax.with_sharding_constraint(zeros, grad_sh), stacked)
        scale = 1.0 / k if reduce == "mean" else 1.0
        grads = jax.tree_util.tree_map(lambda x: x * scale, acc)
        loss = vals[0] if has_aux else vals
        loss = loss.mean() if reduce == "mean" else loss.sum()
        val = (loss, vals[1]) if has_aux else loss
        return val, jax.lax.with_sharding_constraint(grads, grad_sh)

    def step(p: Any, b: Any) -> Any:
        val, grads = value_and_grad(p, b)
        if has_aux:
            return (jax.lax.with_sharding_constraint(val[0], rep), val[1]), grads
        return jax.lax.with_sharding_constraint(val, rep), grads

    # results placed by out_shardings too: a constraint on a returned value alone may be left replicated.
    # Not with activations offloaded to host memory: their copies make JAX mark every result's memory kind
    # with a placement XLA's CPU backend refuses (shardplan.jax.offload); the constraints inside still apply.
    offloads = mc is not None and any("activations" in mc.offload(i) for i in range(len(mc.choices)))
    jitted = jax.jit(step, in_shardings=(param_sh, batch_sh),
                     out_shardings=None if offloads else ((rep, None) if has_aux else rep, grad_sh))
    names = tuple(fp8_operators(plan, micro_info))
    fp8 = None
    if names:
        fn_d, _ = checkpointed_fn(plan, micro_info, devices, [s.stage for s in states], [s.sharded for s in states],
                                  delayed=True)
        if master:
            fn_d = compute_cast(fn_d, dtypes)
        vgd = jax.value_and_grad(fn_d, argnums=(0, 2), has_aux=has_aux)

        def delayed_step(p: Any, b: Any, h: Any) -> Any:
            """Loss, gradients and the next histories: the amaxes of every micro-batch's casts, their max."""
            if k == 1:
                val, (grads, amax) = vgd(p, b, h)
            else:
                leaves, btree = jax.tree_util.tree_flatten(b)
                split = [_split(x, k, s) if is_b else x for x, s, is_b in zip(leaves, micro_leaves, batch_flags)]

                def body(acc: Any, xs: Any) -> Any:
                    it = iter(xs)
                    mb = jax.tree_util.tree_unflatten(btree, [next(it) if is_b else x
                                                              for x, is_b in zip(split, batch_flags)])
                    val, (g, a) = vgd(p, mb, h)
                    g = jax.lax.with_sharding_constraint(g, grad_sh)
                    return (jax.tree_util.tree_map(jax.numpy.add, acc[0], g),
                            jax.tree_util.tree_map(jax.numpy.maximum, acc[1], a)), val

                zeros = jax.tree_util.tree_map(lambda x: jax.numpy.zeros(x.shape, jax.numpy.result_type(x)), p)
                zh = jax.tree_util.tree_map(jax.numpy.zeros_like, h)
                (acc, amax), vals = jax.lax.scan(body, (jax.lax.with_sharding_constraint(zeros, grad_sh), zh),
                                                 [x for x, is_b in zip(split, batch_flags) if is_b])
                grads = jax.tree_util.tree_map(lambda x: x * (1.0 / k if reduce == "mean" else 1.0), acc)
                loss = vals[0] if has_aux else vals
                loss = loss.mean() if reduce == "mean" else loss.sum()
                val = (loss, vals[1]) if has_aux else loss
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
            head = (jax.lax.with_sharding_constraint(val[0], rep), val[1]) if has_aux else \
                jax.lax.with_sharding_constraint(val, rep)
            return head, grads, roll_history(h, amax)

        fp8 = jax.jit(delayed_step, in_shardings=(param_sh, batch_sh, rep),
                      out_shardings=None if offloads else ((rep, None) if has_aux else rep, grad_sh, rep))
    return FitStep(plan, info, micro_info, tuple(devices), states, k, remat, param_sh, grad_sh, state_sh, batch_sh,
                   jitted, fn, value_and_grad, names, fp8, delayed_step if names else None, master)


def _split(x: Any, k: int, micro: Any) -> Any:
    """(B, ...) -> (k, B/k, ...) by stride: micro-batch i holds rows i, i + k, ... (local to every device)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    y = x.reshape((x.shape[0] // k, k) + x.shape[1:])
    y = jax.numpy.swapaxes(y, 0, 1)
    return jax.lax.with_sharding_constraint(y, NamedSharding(micro.mesh, PartitionSpec(None, *micro.spec)))


def states_summary(states: Sequence[LeafState], info: TraceInfo) -> list[dict[str, Any]]:
    """JSON-ready: per sharded parameter leaf, its stage, pieces and replica group."""
    return [{"leaf": info.leaf_names[i], "stage": s.stage, "pieces": s.factor, "group": s.group}
            for i, s in enumerate(states) if s.stage]
