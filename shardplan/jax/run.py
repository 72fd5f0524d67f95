"""Execution: the traced program re-run with the plan's sharding constraints, and the training step.

:func:`evaluate` runs the flat program equation by equation, binding each
primitive as ``jax.core.eval_jaxpr`` does; kept ``remat`` calls re-run their
body under ``jax.checkpoint`` with the traced policy, custom_jvp/vjp calls
are bound whole. Two kinds of hooks apply the plan:

* ``produce[var]``: applied to a variable when it is produced (an operator's
  output, in the layout of the producer's configuration);
* ``consume[(eqn, slot)]``: applied to operand ``slot`` of equation ``eqn``
  just before the equation reads it (the layout the consumer's configuration
  reads it in).

A third, ``replace[eqn]``: ``args -> outputs`` bound instead of equation
``eqn``'s primitive (an FP8 product: :mod:`shardplan.jax.fp8`; a plan's ring attention: :func:`ring_hooks`).

Constraining both sides of every edge makes XLA execute the planned
algorithm: the redistribution between the two layouts is the edge's, and
each operator computes in the tiling the cost model charged (without the
read-side constraint XLA's propagation may pick its own algorithm for the
consumer, e.g. all-gather a weight instead of all-reducing partial sums).
Each constraint also pins the cotangent in the backward pass
(:func:`constrain_both_ways`), as the cost model lays out the backward pass
like the forward one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.jax.flatten import TOP, Atom, Const
from shardplan.jax.lower import TraceInfo
from shardplan.jax.shardings import PlanShardings, plan_shardings, replicated

__all__ = ["evaluate", "evaluate_eqns", "constrain_forward", "constrain_both_ways", "constrain_read", "constrained_fn",
           "gather_scatters", "make_step", "ring_charged", "ring_hooks", "master_copy", "compute_cast",
           "plan_master_weights"]

Hook = Callable[[Any], Any]


def evaluate(info: TraceInfo, leaves: Sequence[Any], produce: Mapping[int, Hook] | None = None,
             consume: Mapping[tuple[int, int], Hook] | None = None,
             replace: Mapping[int, Callable[[list[Any]], list[Any]]] | None = None) -> list[Any]:
    """Run the flat program on argument leaves with the ``produce`` / ``consume`` / ``replace`` hooks
    (see the module)."""
    prog = info.program
    env: dict[int, Any] = dict(zip(prog.invars, leaves))
    top = [k for k, e in enumerate(prog.eqns) if e.parent == TOP]
    evaluate_eqns(info, top, env, produce, consume, hook_inputs=True, replace=replace)
    return [a.value if isinstance(a, Const) else env[a] for a in prog.outvars]


def evaluate_eqns(info: TraceInfo, eqns: Sequence[int], env: dict[int, Any],
                  produce: Mapping[int, Hook] | None = None, consume: Mapping[tuple[int, int], Hook] | None = None,
                  hook_inputs: bool = False,
                  replace: Mapping[int, Callable[[list[Any]], list[Any]]] | None = None) -> dict[int, Any]:
    """Run the top-level equations ``eqns`` (indices, in order) on ``env`` (variable id -> value), which
    must hold every variable they read; adds what they produce and returns ``env``. ``hook_inputs``:
    apply the ``produce`` hooks to the values already in ``env`` first (the program's arguments).
    ``replace``: equation index -> what runs instead of its primitive (see the module)."""
    prog = info.program
    produce = produce or {}
    consume = consume or {}
    replace = replace or {}
    by_parent: dict[int, list[int]] = defaultdict(list)
    for k, e in enumerate(prog.eqns):
        if e.parent is not None and e.parent != TOP:
            by_parent[e.parent].append(k)
    if hook_inputs:
        for var in list(env):
            if var in produce:
                env[var] = produce[var](env[var])

    def read(a: Atom) -> Any:
        return a.value if isinstance(a, Const) else env[a]

    def put(var: int, x: Any) -> None:
        env[var] = produce[var](x) if var in produce else x

    def run(ks: Sequence[int]) -> None:
        for k in ks:
            e = prog.eqns[k]
            args = [read(a) for a in e.invars]
            args = [consume[(k, s)](x) if (k, s) in consume else x for s, x in enumerate(args)]
            if k in replace:
                outs = replace[k](args)
            elif e.call_id is not None:
                outs = _remat(e, args, env, put, lambda cid: run(by_parent.get(cid, ())), read)
            else:
                params = e.primitive.get_bind_params(e.params)
                if isinstance(params, tuple):  # (subfuns, params)
                    subfuns, params = params
                    ans = e.primitive.bind(*subfuns, *args, **params)
                else:
                    ans = e.primitive.bind(*args, **params)
                outs = ans if e.primitive.multiple_results else [ans]
            for var, x in zip(e.outvars, outs):
                put(var, x)

    for k in eqns:
        if prog.eqns[k].parent != TOP:
            raise ShardplanError(f"equation {k} is not a top-level equation of the program")
    run(list(eqns))
    return env


def _remat(e: Any, args: list[Any], env: dict[int, Any], put: Callable[[int, Any], None],
           run_block: Callable[[int], None], read: Callable[[Atom], Any]) -> list[Any]:
    """A kept remat call: its body (the equations whose parent is the call) under ``jax.checkpoint``."""
    import jax

    def body(*xs: Any) -> list[Any]:
        for var, x in zip(e.body_in, xs):
            put(var, x)
        run_block(e.call_id)
        return [read(a) for a in e.passthrough]

    kw = {k: e.params[k] for k in ("prevent_cse", "policy") if k in e.params}
    return list(jax.checkpoint(body, **kw)(*args))


def master_copy(params: Any) -> Any:
    """The fp32 master copy of ``params``: every floating leaf narrower than 4 bytes (bfloat16, float16, the
    float8 formats) widened to float32, the others as they are. Exact: every such value is a float32 value."""
    import jax
    import jax.numpy as jnp

    def widen(x: Any) -> Any:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return jnp.asarray(x, jnp.float32)
        return x

    return jax.tree_util.tree_map(widen, params)


def compute_cast(fn: Callable[..., Any], dtypes: Any, argnum: int = 0) -> Callable[..., Any]:
    """``fn`` with argument ``argnum`` (a pytree of master weights) cast leaf by leaf to ``dtypes`` (the same
    pytree of the dtypes the program was traced in) before it runs: mixed precision with master weights.

    With ``c`` the rounding of a float32 weight ``w`` to its compute dtype,
    the step differentiates ``L(c(w))``; ``convert_element_type``'s transpose
    is a cast back, so ``dL/dw`` is the program's gradient at ``c(w)``, in
    the compute dtype, widened exactly to float32. The cast is elementwise:
    the copy keeps the master's sharding, and whatever the program then does
    with the weight (a ZeRO-3 gather, a product's reduce-scatter of the
    gradient) moves the compute dtype's bytes, as the cost model charges."""
    import jax
    import jax.numpy as jnp

    def cast(x: Any, dtype: Any) -> Any:
        return x if jnp.result_type(x) == dtype else jax.lax.convert_element_type(x, dtype)

    def run(*args: Any) -> Any:
        args = list(args)
        args[argnum] = jax.tree_util.tree_map(cast, args[argnum], dtypes)
        return fn(*args)

    return run


def plan_master_weights(plan: Any) -> bool:
    """The plan's precision rule: True where its memory choices were costed with fp32 master weights
    (:class:`shardplan.cost.memory.ChoiceRules` ``master_weights``; a loaded plan's ``stats["memory_rules"]``,
    which :func:`shardplan.planner.spmd_of` turns back into the rule)."""
    mc = getattr(plan, "memory_choices", None)
    return bool(mc is not None and mc.rules.master_weights)


def constrain_forward(sharding: Any, cotangent: Any = None) -> Callable[[Any], Any]:
    """Identity that constrains a value to ``sharding`` and its cotangent to ``cotangent`` (None: left free).

    With ``cotangent=sharding`` the backward pass follows the same layout (what
    the cost model assumes for every planned value); a sharded parameter's read
    passes its shards' sharding instead, so the gradient goes straight into the
    shards (a reduce-scatter of the partial sums) rather than being all-reduced
    to the reader's layout first.
    """
    import jax

    @jax.custom_vjp
    def ident(x: Any) -> Any:
        return jax.lax.with_sharding_constraint(x, sharding)

    def fwd(x: Any) -> tuple[Any, None]:
        return ident(x), None

    def bwd(_: None, g: Any) -> tuple[Any]:
        return (g if cotangent is None else jax.lax.with_sharding_constraint(g, cotangent),)

    ident.defvjp(fwd, bwd)
    return ident


def constrain_both_ways(sharding: Any, cotangent: bool = True) -> Hook:
    """Identity that constrains a value to ``sharding`` and its cotangent in the backward pass too
    (``cotangent=False``: the cotangent is left free, for the reads of a partial layout)."""
    import jax
    import jax.numpy as jnp

    ident = constrain_forward(sharding, sharding if cotangent else None)

    def apply(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return ident(x)
        if jnp.issubdtype(jnp.result_type(x), jnp.integer) or jnp.result_type(x) == jnp.bool_:
            return jax.lax.with_sharding_constraint(x, sharding)
        return x  # PRNG keys and other extended dtypes are left alone

    return apply


def constrain_read(source: Any, target: Any, devices: Sequence[Any], cotangent: bool = True,
                   memo: dict | None = None) -> Hook:
    """:func:`constrain_both_ways` to ``target`` for a value that arrives in ``source``, redistributed in the
    steps the cost model charges (:func:`shardplan.jax.shardings.reshard_chain`: one sharding constraint per
    step, each one collective); the cotangent goes back from ``target`` to ``source`` in the steps of the
    reverse redistribution (``cotangent=False``: left free after the target, as :func:`constrain_both_ways`).
    Where no chain applies, :func:`constrain_both_ways` itself."""
    import jax
    import jax.numpy as jnp

    from shardplan.jax.shardings import reshard_chain

    plain = constrain_both_ways(target, cotangent)

    def apply(x: Any) -> Any:
        dtype = jnp.result_type(x)
        fwd_chain = reshard_chain(source, target, x.shape, devices, memo)
        if fwd_chain is None:
            return plain(x)
        if not jnp.issubdtype(dtype, jnp.inexact):
            if not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
                return x  # PRNG keys and other extended dtypes are left alone
            for s in fwd_chain:
                x = jax.lax.with_sharding_constraint(x, s)
            return jax.lax.with_sharding_constraint(x, target)
        bwd_chain = (reshard_chain(target, source, x.shape, devices, memo) or []) if cotangent else None

        @jax.custom_vjp
        def ident(y: Any) -> Any:
            for s in fwd_chain:
                y = jax.lax.with_sharding_constraint(y, s)
            return jax.lax.with_sharding_constraint(y, target)

        def fwd(y: Any) -> tuple[Any, None]:
            return ident(y), None

        def bwd(_: None, g: Any) -> tuple[Any]:
            if bwd_chain is None:
                return (g,)
            g = jax.lax.with_sharding_constraint(g, target)
            for s in bwd_chain:
                g = jax.lax.with_sharding_constraint(g, s)
            return (jax.lax.with_sharding_constraint(g, source),)

        ident.defvjp(fwd, bwd)
        return ident(x)

    return apply


def ring_hooks(plan: Any, info: TraceInfo, devices: Sequence[Any], recast: Callable[[Any], Any] | None = None,
               ) -> tuple[dict[tuple[int, int], Hook], dict[int, Callable[[list[Any]], list[Any]]]]:
    """The ``consume`` and ``replace`` hooks that run a plan's ring: every ``jax.nn.dot_product_attention``
    (:mod:`shardplan.jax.attention`) whose keys and values the plan's cost tables pass around the ring
    (:func:`ring_charged`) and whose layout splits the query sequence reads its keys and values split along
    the sequence on the same mesh axes, as the queries (over several levels, e.g. nodes and the devices of a
    node, the ring runs over all of them in row-major order, outer level major) (the all-gather of the planned read is
    what the ring replaces), and runs :func:`shardplan.jax.ring.ring_apply` over it; any other attention runs
    as planned (keys and values gathered, ``jax.nn.dot_product_attention`` on each device's tile), except a causal
    one whose queries the tables charge dealt with the keys gathered (:func:`shardplan.cost.ring.deals_gathered`:
    the deal cheaper than the contiguous blocks' extra work), which runs :func:`shardplan.jax.ring.gather_apply`
    on the planned layouts (the queries dealt into the balanced order and the output back). ``recast``:
    applied to the queries' and the keys' NamedShardings before use (the stage runner's prime-factor meshes;
    the ring then runs over the factors of the sequence's mesh axis, a tuple of axis names)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from shardplan.jax.attention import ATTENTION
    from shardplan.cost.ring import deals_gathered
    from shardplan.jax.ring import gather_apply, ring_apply
    from shardplan.jax.shardings import layout_mesh

    consume: dict[tuple[int, int], Hook] = {}
    replace: dict[int, Callable[[list[Any]], list[Any]]] = {}
    tables = getattr(plan, "tables", None)
    if tables is None:
        return consume, replace
    lays = plan.layouts
    for op in plan.graph.operators:
        reads = info.reads.get(op.name, ())
        if op.kind != "attn_flash" or not reads or info.program.eqns[reads[0][0]].name != ATTENTION.name:
            continue
        k = reads[0][0]
        dims = {slot: d for _, slot, d in reads}
        if sorted(dims) != [0, 1, 2]:
            continue
        lay = lays[op.name]
        q_spec = lay.partition_spec(dims[0])
        axis = q_spec[1]  # one mesh axis, or several (the levels that split the sequence, outer first)
        if axis is None:  # the queries' sequence not split: nothing to pass around
            continue
        if not ring_charged(plan, op.name):
            if info.program.eqns[k].params["is_causal"] and deals_gathered(op, lay, plan.machine):
                kv_spec = lay.partition_spec(dims[1])
                mesh = layout_mesh(lay, devices)
                qsh, ksh = NamedSharding(mesh, PartitionSpec(*q_spec)), NamedSharding(mesh, PartitionSpec(*kv_spec))
                if recast is not None:
                    qsh, ksh = recast(qsh), recast(ksh)
                scatter = gather_scatters(plan, op.name)
                if any(scatter):  # those inputs arrive split like the queries (their producers'), gathered inside
                    split = list(kv_spec)
                    split[1] = axis
                    ssh = NamedSharding(mesh, PartitionSpec(*split))
                    ssh = recast(ssh) if recast is not None else ssh
                    for slot, s in zip((1, 2), scatter):
                        if s:
                            consume[(k, slot)] = constrain_both_ways(ssh)
                replace[k] = lambda a, m=qsh.mesh, qs=qsh.spec, ks=ksh.spec, sc=scatter: [
                    gather_apply(a[0], a[1], a[2], m, qs, ks, qs[1], sc)]
            continue
        kv = list(lay.partition_spec(dims[1]))
        kv[1] = axis
        mesh = layout_mesh(lay, devices)
        qsh, ksh = NamedSharding(mesh, PartitionSpec(*q_spec)), NamedSharding(mesh, PartitionSpec(*kv))
        if recast is not None:
            qsh, ksh = recast(qsh), recast(ksh)
        consume[(k, 1)] = consume[(k, 2)] = constrain_both_ways(ksh)
        causal = bool(info.program.eqns[k].params["is_causal"])
        replace[k] = lambda a, m=qsh.mesh, qs=qsh.spec, ks=ksh.spec, c=causal: [
            ring_apply(a[0], a[1], a[2], m, qs, ks, qs[1], c)]
    return consume, replace


def gather_scatters(plan: Any, name: str) -> tuple[bool, bool]:
    """Per key and value of the dealt attention ``name`` (run by :func:`shardplan.jax.ring.gather_apply`),
    whether its gradient goes home by a reduce-scatter: its producer's chosen layout scatters it over the query
    sequence's group (:func:`shardplan.cost.ring.gathered_scatters` at the two chosen layouts, where the cost
    tables charge :func:`shardplan.cost.ring.gathered_reduction` the reduce-scatter). An input read straight
    from the program's arguments has no edge: all-reduced."""
    from shardplan.cost.ring import gathered_scatters
    from shardplan.layout import LayoutArrays

    tables, g = plan.tables, plan.graph
    i = g.index[name]
    op, kv = g.operators[i], plan.assignment[i]
    lv = LayoutArrays.stack([tables.layouts[i][kv]])
    out = {1: False, 2: False}
    for e in g.edges:
        if e.dst == i and e.slot in out:
            lu = LayoutArrays.stack([tables.layouts[e.src][plan.assignment[e.src]]])
            out[e.slot] = bool(gathered_scatters(g.operators[e.src], lu, op, e.slot, lv, plan.machine)[0, 0])
    return out[1], out[2]


def ring_charged(plan: Any, name: str) -> bool:
    """Whether the cost tables of ``plan`` charge operator ``name``'s keys and values the ring, not the all-gather:
    each of its ring inputs is produced by an operator whose chosen layout scatters it over the ring group
    (:func:`shardplan.cost.ring.ring_choices` finite at the two chosen layouts), and, for tables built with
    ``context="auto"``, the ring is what the edge's matrix holds there (the cheaper of the two); never for
    tables built with the all-gather alone. An input read straight from the program's arguments has no edge:
    gathered."""
    import numpy as np

    from shardplan.cost.ring import ring_choices, ring_mask
    from shardplan.layout import LayoutArrays

    tables, g = plan.tables, plan.graph
    if tables.options.get("context", "allgather") == "allgather":
        return False
    i = g.index[name]
    op, kv = g.operators[i], plan.assignment[i]
    lv = LayoutArrays.stack([tables.layouts[i][kv]])
    slots = set(np.nonzero(ring_mask(op, lv)[0][0])[0].tolist())
    edges = {e.slot: (j, e) for j, e in enumerate(g.edges) if e.dst == i and e.slot in slots}
    if not slots or set(edges) != slots:
        return False
    compute = np.asarray(tables.op_costs[i].compute, dtype=np.float64)[[kv]]
    for j, e in edges.values():
        ku = plan.assignment[e.src]
        lu = LayoutArrays.stack([tables.layouts[e.src][ku]])
        ring = float(ring_choices(g.operators[e.src], lu, op, e.slot, lv, plan.machine, compute)[0, 0])
        held = float(tables.edge_costs[j][ku, kv])
        if not np.isfinite(ring) or (tables.options.get("context") == "auto" and ring > held * (1 + 1e-9) + 1e-15):
            return False
    return True


def constrained_fn(info: TraceInfo, shardings: PlanShardings,
                   ring: tuple[Mapping[tuple[int, int], Hook], Mapping[int, Callable[[list[Any]], list[Any]]]]
                   | None = None) -> Callable[..., Any]:
    """The traced function re-run with the planned layout on both sides of every edge; ``ring``: the hooks of
    :func:`ring_hooks` (the plan's ring attentions)."""
    import jax

    produce = {var: constrain_both_ways(s) for var, s in shardings.values.items()}
    sources = shardings.sources or {}
    memo: dict = {}
    consume = {key: (constrain_read(sources[key], s, list(s.mesh.devices.flat), key not in shardings.free_cotangents, memo)
                     if shardings.steps and key in sources else constrain_both_ways(s, key not in shardings.free_cotangents))
               for key, s in shardings.reads.items()}
    consume.update(ring[0] if ring else {})
    replace = dict(ring[1]) if ring else {}

    def fn(*args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != info.in_tree:
            raise ShardplanError(f"arguments have structure {tree}, the traced function had {info.in_tree}")
        return jax.tree_util.tree_unflatten(info.out_tree, evaluate(info, leaves, produce, consume, replace))

    return fn


def make_step(plan: Any, info: TraceInfo, devices: Sequence[Any] | None = None, argnums: int = 0,
              has_aux: bool = False) -> Callable[..., Any]:
    """``step(*args) -> (loss, grads)`` (``((loss, aux), grads)`` with ``has_aux``), as ``jax.value_and_grad``.

    Jitted; arguments enter with their leaves' planned shardings, the loss
    leaves replicated and the gradients with the shardings of the arguments
    they differentiate.
    """
    import jax

    devices = list(devices) if devices is not None else list(jax.devices())[: plan.machine.num_devices]
    sh = plan_shardings(plan, info, devices)
    in_sh = jax.tree_util.tree_unflatten(info.in_tree, list(sh.leaves))
    vg = jax.value_and_grad(constrained_fn(info, sh, ring_hooks(plan, info, devices)), argnums=argnums,
                            has_aux=has_aux)
    rep = replicated(devices)

    def step(*args: Any) -> Any:
        return vg(*args)

    # The result shardings are the jit's out_shardings, not a with_sharding_constraint on the returned values:
    # XLA's propagation (Shardy, JAX 0.10) may leave a constrained result replicated (observed on the flax
    # MNIST CNN, where the first Dense kernel's gradient was all-gathered whole before being returned).
    out_sh = ((rep, None) if has_aux else rep, in_sh[argnums])  # None: the aux output is XLA's choice
    return jax.jit(step, in_shardings=tuple(in_sh), out_shardings=out_sh)
