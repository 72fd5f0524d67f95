"""Reads of a deferred pipeline weight run per device: an embedding's gather and a per-feature scale.

A ZeRO 0/1 weight whose tile is replicated over mesh axes R enters a stage program as an Explicit-axes value
``reduced`` over R (:func:`shardplan.jax.staged._deferrable`). A read of it that is *local* -- each device's
block of the read's output is the read applied to the device's blocks of its operands -- runs here inside a
``jax.shard_map`` over the tile's Explicit mesh with ``check_vma=True``, the weight's input spec its tile
``reduced`` over R. JAX's varying-axes typing then makes the weight's cotangent ``unreduced`` over R: the transpose
of the (implicit) ``pvary`` that meets the weight with a value varying over R hands back each device's own term,
with nothing sent (``check_vma=False`` instead all-reduces the terms and still calls the result unreduced: twice
the gradient, ``tests/jax_engine/test_staged_defer_jax.py``). The terms sum to the gradient exactly when the read's
other operand has the dimensions the gradient sums over (an index's rows, a scale's broadcast rows) split over
exactly R, each row on one replica: the conditions below. The products are the unsharded program's own, one per
element (a gather copies, a scale multiplies once); only the sum's association differs.

* :func:`gather_island`: ``gather(table, indices)`` with the table read in its tile, its indexed dimensions
  whole, the other (offset) dimensions sliced whole; the indices' batch dimensions split over exactly R and their
  index vector whole; the output split as the indices on its batch dimensions and as the table on its offset
  dimensions. Locally the same gather with the slice sizes of the local table block; its transpose is a local
  scatter-add into a zero block of the table: the device's partial sum.
* :func:`scale_island`: ``mul(x, broadcast_in_dim(w))`` (an RMS or layer norm's scale ``h * g``; likewise ``add``,
  ``sub``, ``div``: a bias ``h + b``, any elementwise operation is local), or the operation on a view of ``w`` with
  unit axes that it broadcasts itself (flax's ``y + jnp.reshape(b, (1, 1, -1))``): the broadcast weight's size-1
  dimensions are those the gradient sums over, split over exactly R in the output; on the other dimensions the
  output and the broadcast weight are split alike, and ``x`` is split as the output but on its own unit axes (a
  layer norm's ``rsqrt(var) * scale``, ``(b, t, 1)`` by ``(1, 1, d)``). Locally the broadcast to the local block
  and the same multiply; its transpose multiplies and sums the local rows.

* :func:`product_island`: a ``dot_general`` reading the weight through views that move data within the weight
  (``reshape``, ``slice``, a ``split`` or constant-start ``dynamic_slice`` taken as slices, ``squeeze``; a fused
  QKV weight sliced into q, k, v, a weight reshaped to heads; a ``dynamic_slice`` at traced starts, its starts
  carried, :class:`Carried`), which JAX 0.9.2 does not type on a ``reduced``
  value: the views and the product on the device's blocks, ``psum`` over the axes the contraction is split over.
  The other operand's free dimensions (those the weight gradient sums over) split over exactly R, its contracted
  and batch dimensions as the viewed weight's, the output as the product of the blocks.

Each may read the weight through views (:func:`local_views`), applied to the local block first: casts
(``convert_element_type``: a weight kept in float32 and read in bfloat16), transposes, and the views above, each
*local*: the viewed tile is a tiling (each device's block of the view is the view of its block), with the rules of
:func:`local_view` (docs/jax.md, "What the stage programs send for a weight").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

Island = Callable[[list[Any]], list[Any]]  # what runs an equation instead of its primitive: operands -> results
# the elementwise operations a broadcast weight may enter per device (each output element reads one of each operand)
ELEMENTWISE = frozenset({"mul", "add", "sub", "div"})


@dataclass(frozen=True)
class View:
    """One view a deferred weight is read through (a primitive and its parameters), on the program's whole weight
    or on a device's block of it (:func:`local_view`). ``operands``: the run-time operands it takes after the
    weight (a ``dynamic_slice``'s traced starts, :class:`Carried`), 0 for a one-operand view."""

    name: str
    primitive: Any
    params: Mapping[str, Any]
    operands: int = 0


@dataclass(frozen=True)
class Carried:
    """A deferred leaf on its way to its per-device readers through views with run-time operands: the leaf's
    value and those operands' values, in the order of the views (what a traced ``dynamic_slice`` of the leaf
    hands on instead of slicing: its readers slice each device's block, :func:`apply_views`)."""

    value: Any
    operands: tuple[Any, ...] = ()

    def then(self, more: Sequence[Any]) -> "Carried":
        """The same leaf carried through one more view taking the run-time operands ``more``."""
        return Carried(self.value, self.operands + tuple(more))


def view_of(e: Any) -> View:
    """The view equation ``e`` of the program as a :class:`View` (a ``dynamic_slice`` with its starts as run-time
    operands)."""
    return View(e.name, e.primitive, dict(e.params), len(e.invars) - 1)


def slice_view(starts: Sequence[int], limits: Sequence[int]) -> View:
    """The unit-stride ``slice`` ``[starts, limits)`` (what a ``split`` output or a constant ``dynamic_slice`` is)."""
    import jax

    return View("slice", jax.lax.slice_p, {"start_indices": tuple(int(a) for a in starts),
                                            "limit_indices": tuple(int(b) for b in limits), "strides": None})


def local_view(c: View, shape: tuple[int, ...], tile: Sequence[tuple[str, ...]],
               mesh: Any) -> tuple[tuple[int, ...], list[tuple[str, ...]], View] | None:
    """The view ``c`` of a value of shape ``shape`` tiled ``tile`` (per axis, the mesh axes it is split over) as a
    view of each device's block: ``(view's shape, view's tiling, the view of the block)``, or None when the
    view's blocks are not the views of the blocks. A cast moves nothing; a transpose permutes the tiling; a
    ``squeeze`` drops unit (never split) axes; a ``slice`` takes every split axis whole, and so does a
    ``dynamic_slice`` at run-time starts (XLA clamps a start into ``[0, n - size]``, so an axis taken whole starts
    at 0 whatever the start, globally and on each block, and only unsplit axes are cut); a ``reshape`` (no
    ``dimensions``) splits and merges groups of axes with equal products, each group split at most on its
    leading (major) input axis, which then splits the group's leading output axis the same ways (it must divide
    it): contiguous chunks of the group's row-major range, the same on both sides."""
    t = [tuple(x) for x in tile]
    if c.name == "convert_element_type":
        return shape, t, c
    if c.name == "transpose":
        perm = tuple(c.params["permutation"])
        return tuple(shape[d] for d in perm), [t[d] for d in perm], c
    if c.name == "squeeze":
        gone = {d % len(shape) for d in c.params["dimensions"]}
        keep = [d for d in range(len(shape)) if d not in gone]
        return tuple(shape[d] for d in keep), [t[d] for d in keep], c
    if c.name == "slice":
        lo, hi = tuple(c.params["start_indices"]), tuple(c.params["limit_indices"])
        strides = c.params.get("strides") or (1,) * len(shape)
        if any(t[d] and (lo[d], hi[d], strides[d]) != (0, shape[d], 1) for d in range(len(shape))):
            return None
        out = tuple(-(-(hi[d] - lo[d]) // strides[d]) for d in range(len(shape)))
        block = tuple(shape[d] // _ways(mesh, t[d]) if t[d] else hi[d] for d in range(len(shape)))
        return out, t, View("slice", c.primitive, dict(c.params, limit_indices=block))
    if c.name == "dynamic_slice":
        sizes = tuple(int(z) for z in c.params["slice_sizes"])
        if any(t[d] and sizes[d] != shape[d] for d in range(len(shape))):
            return None
        block = tuple(shape[d] // _ways(mesh, t[d]) if t[d] else sizes[d] for d in range(len(shape)))
        return sizes, t, View("dynamic_slice", c.primitive, dict(c.params, slice_sizes=block), c.operands)
    if c.name == "reshape" and c.params.get("dimensions") is None:
        new = tuple(int(n) for n in c.params["new_sizes"])
        out_t = _reshaped_tiling(shape, t, new, mesh)
        if out_t is None:
            return None
        local = tuple(n // _ways(mesh, out_t[d]) for d, n in enumerate(new))
        return new, out_t, View("reshape", c.primitive, dict(c.params, new_sizes=local, sharding=None))
    return None


def _reshaped_tiling(shape: tuple[int, ...], t: Sequence[tuple[str, ...]], new: tuple[int, ...],
                     mesh: Any) -> list[tuple[str, ...]] | None:
    """The tiling of ``reshape(x, new)`` for ``x`` of ``shape`` tiled ``t`` when it is local (:func:`local_view`)."""
    out: list[tuple[str, ...]] = [()] * len(new)
    i = j = 0
    while i < len(shape) or j < len(new):
        if i < len(shape) and shape[i] == 1:
            i += 1
            continue
        if j < len(new) and new[j] == 1:
            j += 1
            continue
        if i == len(shape) or j == len(new):
            return None
        gi, gj, a, b = [i], [j], shape[i], new[j]
        while a != b:
            if a < b:
                i += 1
                gi.append(i)
                a *= shape[i]
            else:
                j += 1
                gj.append(j)
                b *= new[j]
        i, j = i + 1, j + 1
        if any(t[d] for d in gi[1:]) or (t[gi[0]] and new[gj[0]] % _ways(mesh, t[gi[0]])):
            return None
        out[gj[0]] = t[gi[0]]
    return out


def local_views(chain: Sequence[View], shape: tuple[int, ...],
                tile: Any) -> tuple[tuple[int, ...], Any, tuple[View, ...]] | None:
    """:func:`local_view` along ``chain`` from a value of ``shape`` in the ``NamedSharding`` ``tile``: the viewed
    shape, the viewed tile (a ``NamedSharding`` on ``tile``'s mesh) and the views of the blocks; None when a view
    of the chain is not local."""
    from jax.sharding import NamedSharding

    mesh = tile.mesh
    t = _entries(tile.spec, len(shape))
    out: list[View] = []
    for c in chain:
        step = local_view(c, shape, t, mesh)
        if step is None:
            return None
        shape, t, v = step
        out.append(v)
    return shape, NamedSharding(mesh, _spec(t)), tuple(out)


def apply_views(x: Any, chain: Sequence[Any], operands: Sequence[Any] = ()) -> Any:
    """``x`` through the view equations ``chain``, in order; a view taking run-time operands
    (:attr:`View.operands`) takes the next ones of ``operands``."""
    rest = list(operands)
    for c in chain:
        params = c.primitive.get_bind_params(c.params)
        n = getattr(c, "operands", 0)
        more, rest = rest[:n], rest[n:]
        x = c.primitive.bind(x, *more, **(params[1] if isinstance(params, tuple) else params))
    if rest:
        raise AssertionError(f"views {[c.name for c in chain]}: {len(rest)} run-time operands left over")
    return x


def auto_mesh(sharding: Any) -> Any:
    """The abstract mesh of ``sharding``'s devices with every axis Auto."""
    from jax.sharding import AxisType

    mesh = sharding.mesh.abstract_mesh
    return mesh.update_axis_types({a: AxisType.Auto for a in mesh.axis_names})


def to_auto(x: Any, sharding: Any) -> Any:
    """An Explicit-typed ``x`` as a value on the same devices' Auto axes (what the stage's sharding constraints
    use); its transpose hands the cotangent back as ``x``'s cotangent type (unreduced for a reduced ``x``)."""
    from jax.sharding import PartitionSpec, reshard, use_abstract_mesh

    with use_abstract_mesh(auto_mesh(sharding)):
        return reshard(x, PartitionSpec())


def _entry_axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entries(spec: Any, rank: int) -> list[tuple[str, ...]]:
    """Per tensor axis of a rank-``rank`` value, the mesh axes ``spec`` splits it over."""
    entries = list(spec)
    return [_entry_axes(entries[d]) if d < len(entries) else () for d in range(rank)]


def _ways(mesh: Any, axes: Sequence[str]) -> int:
    return math.prod(int(mesh.shape[a]) for a in axes)


def _spec(entries: Sequence[tuple[str, ...]], reduced: frozenset[str] = frozenset()) -> Any:
    from jax.sharding import PartitionSpec

    parts = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
    return PartitionSpec(*parts, reduced=reduced) if reduced else PartitionSpec(*parts)


def _local_island(sharding: Any, slot: int, specs: Sequence[Any], out_spec: Any,
                  local: Callable[[list[Any], list[Any]], Any]) -> Island:
    """Run ``local(blocks, operands)`` (the read on the device's blocks, the run-time operands of the leaf's
    views) in a ``shard_map`` over the Explicit mesh of ``sharding`` (the deferred leaf's type, at argument
    ``slot``, :class:`Carried` there when its views take run-time operands, which enter replicated), the other
    arguments resharded from their Auto read layouts into ``specs``, the output in ``out_spec``, handed back on
    Auto axes."""
    import jax
    from jax.sharding import PartitionSpec, reshard, use_abstract_mesh

    mesh = sharding.mesh
    in_specs = tuple(sharding.spec if k == slot else s for k, s in enumerate(specs))
    named = {a for s in in_specs for e in s for a in _entry_axes(e)} | set(sharding.spec.reduced)
    axes = tuple(a for a in mesh.axis_names if a in named)

    def body(*xs: Any, operands: list[Any]) -> Any:
        # every block made varying over the axes any of them varies over (a primitive bound directly gets no
        # implicit cast): the leaf's cast over R is the one whose transpose hands back each device's term,
        # unreduced; another cast is an index's (replicated over the table's tile axes), which has no cotangent
        xs, operands = ([x if not (more := tuple(a for a in axes if a not in jax.typeof(x).vma)) else
                         jax.lax.pcast(x, more, to="varying") for x in group] for group in (xs, operands))
        return local(xs, operands)

    def run(args: list[Any]) -> list[Any]:
        args = list(args)
        extra: list[Any] = []
        if isinstance(args[slot], Carried):
            args[slot], extra = args[slot].value, list(args[slot].operands)
        n = len(args)
        with use_abstract_mesh(mesh.abstract_mesh):
            for k, s in enumerate(in_specs):
                if k != slot:
                    args[k] = reshard(args[k], s)
            extra = [reshard(x, PartitionSpec()) for x in extra]

        def split(*xs: Any) -> Any:
            return body(*xs[:n], operands=list(xs[n:]))

        specs = in_specs + (PartitionSpec(),) * len(extra)
        y = jax.shard_map(split, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=True)(*args, *extra)
        return [to_auto(y, sharding)]

    return run


def gather_island(e: Any, shape: tuple[int, ...], tile: Any, sharding: Any, read: Any, indices: Any,
                  out: Any, views: Sequence[Any] = ()) -> Island | None:
    """The ``gather`` equation ``e`` reading a deferred table (seen through the local ``views`` of its blocks,
    :func:`local_views`: shape ``shape``, tile ``tile``; the leaf's Explicit ``sharding`` reduced over R; read in
    ``read``) as its operand, run per device (module docstring); None unless the shardings (the plan's, on
    prime-factor meshes) meet the conditions there.

    A table split over mesh axes V on its indexed (vocabulary) axis (Megatron's vocabulary-parallel embedding)
    is read when the gather takes whole rows of that one axis (``x[ids]``, ``jnp.take``: one indexed axis,
    collapsed, slices of 1 along it, ``clip`` or ``promise_in_bounds`` mode, whose index is clamped into the
    table): each device gathers the ids in its range of rows, ``[k n, (k + 1) n)`` for its block k of n rows
    along V, from its block, zeroes the rest, and the outputs are summed over V (``psum``); each output row is
    then one device's copy, exactly the unsharded row. The sum's transpose copies the cotangent to the V
    devices (nothing sent), and each scatters its in-range rows into its block."""
    from jax.lax import GatherScatterMode

    if e.name != "gather" or len(e.invars) != 2 or None in (read, indices, out) or len(e.outvars) != 1:
        return None
    rank = len(shape)
    if not (read.mesh == indices.mesh == out.mesh == tile.mesh) or not read.is_equivalent_to(tile, rank):
        return None
    dn = e.params["dimension_numbers"]
    if dn.operand_batching_dims or dn.start_indices_batching_dims:
        return None
    out_rank = len(e.out_shapes[0])
    idx_rank = out_rank - len(dn.offset_dims) + 1  # the batch dimensions and the index vector (last)
    t = _entries(tile.spec, rank)
    ix = _entries(indices.spec, idx_rank)
    o = _entries(out.spec, out_rank)
    sizes = tuple(e.params["slice_sizes"])
    vocab = tuple(dn.start_index_map)[0] if len(dn.start_index_map) == 1 else None
    split = [d for d in dn.start_index_map if t[d]]
    if ix[-1] or (split and (split != [vocab] or vocab not in dn.collapsed_slice_dims or sizes[vocab] != 1
                             or e.params["mode"] not in (GatherScatterMode.CLIP,
                                                         GatherScatterMode.PROMISE_IN_BOUNDS))):
        return None
    kept = [d for d in range(rank) if d not in dn.collapsed_slice_dims]
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    if [o[d] for d in dn.offset_dims] != [t[d] for d in kept] or [o[d] for d in batch_out] != ix[:-1]:
        return None
    replicas = sharding.spec.reduced
    if frozenset(a for axes in ix[:-1] for a in axes) != replicas:
        return None
    if any(t[d] and d not in split and sizes[d] != shape[d] for d in range(rank)):
        return None  # a split dimension must be sliced whole, so the local slice is the local block
    mesh = sharding.mesh
    local_sizes = tuple(s // _ways(mesh, t[d]) if d not in split else s for d, s in enumerate(sizes))
    params = dict(e.params, slice_sizes=local_sizes)
    primitive = e.primitive
    rows = shape[vocab] // _ways(mesh, t[vocab]) if split else 0
    axes_v = t[vocab] if split else ()

    def local(xs: list[Any], operands: list[Any]) -> Any:
        import jax
        import jax.numpy as jnp

        table = apply_views(xs[0], views, operands)
        if not split:
            return primitive.bind(table, xs[1], **params)
        ids = jnp.clip(xs[1], 0, shape[vocab] - 1) - jax.lax.axis_index(axes_v) * rows
        inside = (ids >= 0) & (ids < rows)
        y = primitive.bind(table, jnp.where(inside, ids, 0), **params)
        mask = jax.lax.broadcast_in_dim(inside[..., 0], y.shape, tuple(batch_out))
        return jax.lax.psum(jnp.where(mask, y, jnp.zeros((), y.dtype)), axes_v)

    return _local_island(sharding, 0, (None, _spec(ix)), _spec(o), local)


def product_island(e: Any, slot: int, shape: tuple[int, ...], tile: Any, sharding: Any, read: Any, other: Any,
                   out: Any, views: Sequence[Any] = ()) -> Island | None:
    """The ``dot_general`` equation ``e`` reading, as operand ``slot``, a deferred leaf seen through the local
    ``views`` of its blocks (:func:`local_views`: shape ``shape``, tile ``tile``; the leaf's Explicit
    ``sharding`` reduced over R; read in ``read``), run per device (module docstring): the views on the leaf's
    block, the product of the blocks, summed over the mesh axes C the contraction is split over. ``other``,
    ``out``: the plan's shardings of the other operand and of the output; None unless the other operand's
    contracted and batch dimensions are split as the viewed leaf's, its free dimensions over exactly R, and the
    output as the blocks' product (batch, then the first operand's free, then the second's)."""
    if e.name != "dot_general" or None in (read, other, out) or len(e.outvars) != 1 or len(e.invars) != 2:
        return None
    rank = len(shape)
    if not (read.mesh == other.mesh == out.mesh == tile.mesh) or not read.is_equivalent_to(tile, rank):
        return None
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    wc, wb, oc, ob = (lc, lb, rc, rb) if slot == 0 else (rc, rb, lc, lb)
    out_rank = len(e.out_shapes[0])
    w_free = [d for d in range(rank) if d not in wc and d not in wb]
    o_rank = out_rank - len(w_free) + len(oc)
    o_free = [d for d in range(o_rank) if d not in oc and d not in ob]
    v = _entries(tile.spec, rank)
    x = _entries(other.spec, o_rank)
    if any(x[a] != v[b] for a, b in zip(oc, wc)) or any(x[a] != v[b] for a, b in zip(ob, wb)):
        return None
    if frozenset(a for d in o_free for a in x[d]) != sharding.spec.reduced:
        return None
    frees = ([v[d] for d in w_free], [x[d] for d in o_free])
    want = [v[d] for d in wb] + frees[slot] + frees[1 - slot]
    if _entries(out.spec, out_rank) != want:
        return None
    mesh = sharding.mesh
    contracted = tuple(a for a in mesh.axis_names if any(a in v[d] for d in wc))
    params = dict(e.params)
    if "out_sharding" in params:
        params["out_sharding"] = None
    primitive = e.primitive

    def local(xs: list[Any], operands: list[Any]) -> Any:
        import jax

        xs = list(xs)
        xs[slot] = apply_views(xs[slot], views, operands)
        y = primitive.bind(xs[0], xs[1], **params)
        return jax.lax.psum(y, contracted) if contracted else y

    return _local_island(sharding, slot, tuple(_spec(x) if k != slot else None for k in range(2)), _spec(want),
                         local)


def scale_island(e: Any, slot: int, view: Any, other_shape: tuple[int, ...], rank: int, tile: Any, sharding: Any,
                 other: Any, out: Any, views: Sequence[Any] = (), viewed: tuple[int, ...] = ()) -> Island | None:
    """The ``mul`` (or other :data:`ELEMENTWISE`) equation ``e`` reading, as operand ``slot``, the
    ``broadcast_in_dim`` equation ``view`` of a deferred leaf (seen through the local ``views`` of its blocks,
    :func:`local_views`: rank ``rank``, tile ``tile``; the leaf's Explicit ``sharding`` reduced over R), run per
    device with the broadcast done on the local block (module docstring); its argument ``slot`` is then the leaf
    itself (the view equations pass it through, ``views`` applied first). ``view`` None: ``e`` reads the viewed
    leaf itself, of shape ``viewed`` and of the output's rank, its unit axes broadcast by the operation (flax's
    ``y + jnp.reshape(bias, (1, 1, -1))``). ``other_shape``, ``other``, ``out``: the other operand's shape and the
    plan's shardings of it and of the output. None unless they meet the conditions there."""
    if e.name not in ELEMENTWISE or len(e.invars) != 2 or None in (other, out):
        return None
    if (view is None) != (len(viewed) > 0) or (view is not None and view.name != "broadcast_in_dim"):
        return None
    if e.invars[0] == e.invars[1] or not (other.mesh == out.mesh == tile.mesh):
        return None
    shape = tuple(e.out_shapes[0])
    vshape = tuple(view.params["shape"]) if view is not None else tuple(viewed)
    dims = tuple(view.params["broadcast_dimensions"]) if view is not None else tuple(range(len(viewed)))
    if len(vshape) != len(shape) or len(other_shape) != len(shape):
        return None
    if any(n not in (1, shape[d]) for d, n in enumerate(other_shape)):
        return None
    t = _entries(tile.spec, rank)
    x = _entries(other.spec, len(shape))
    o = _entries(out.spec, len(shape))
    if any(x[d] != o[d] for d in range(len(shape)) if other_shape[d] == shape[d]):
        return None  # the other operand split as the output, but on its unit axes (an RMS norm's (b, t, 1) factor)
    v = [()] * len(shape)
    for j, d in enumerate(dims):
        v[d] = t[j]
    summed = [d for d in range(len(shape)) if vshape[d] == 1 and shape[d] > 1]
    if any(o[d] != v[d] for d in range(len(shape)) if d not in summed):
        return None
    if any(v[d] for d in summed) or frozenset(a for d in summed for a in o[d]) != sharding.spec.reduced:
        return None
    mesh = sharding.mesh
    local_shape = tuple(s // _ways(mesh, v[d]) for d, s in enumerate(vshape))
    broadcast = None if view is None else (view.primitive, dict(view.params, shape=local_shape))
    prim, params = e.primitive, e.params

    def local(xs: list[Any], operands: list[Any]) -> Any:

        xs = list(xs)
        xs[slot] = apply_views(xs[slot], views, operands)
        if broadcast is not None:
            xs[slot] = broadcast[0].bind(xs[slot], **broadcast[1])
        return prim.bind(*xs, **params)

    return _local_island(sharding, slot, tuple(_spec(x) if k != slot else None for k in range(2)), _spec(o), local)
