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
  ``sub``, ``div``: a bias ``h + b``, any elementwise operation is local): the broadcast
  weight's size-1 dimensions are those the gradient sums over, split over exactly R in ``x`` and the output; on the
  other dimensions ``x``, the output and the broadcast weight are split alike. Locally the broadcast to the local
  block and the same multiply; its transpose multiplies and sums the local rows.

Either may read the weight through casts (``convert_element_type``: a weight kept in float32 and read in
bfloat16), applied to the local block first.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

Island = Callable[[list[Any]], list[Any]]  # what runs an equation instead of its primitive: operands -> results
# the elementwise operations a broadcast weight may enter per device (each output element reads one of each operand)
ELEMENTWISE = frozenset({"mul", "add", "sub", "div"})


def apply_views(x: Any, chain: Sequence[Any]) -> Any:
    """``x`` through the view equations ``chain`` (each a one-operand primitive), in order."""
    for c in chain:
        params = c.primitive.get_bind_params(c.params)
        x = c.primitive.bind(x, **(params[1] if isinstance(params, tuple) else params))
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
                  local: Callable[[list[Any]], Any]) -> Island:
    """Run ``local`` (the read on the device's blocks) in a ``shard_map`` over the Explicit mesh of ``sharding``
    (the deferred leaf's type, at argument ``slot``), the other arguments resharded from their Auto read
    layouts into ``specs``, the output in ``out_spec``, handed back on Auto axes."""
    import jax
    from jax.sharding import reshard, use_abstract_mesh

    mesh = sharding.mesh
    in_specs = tuple(sharding.spec if k == slot else s for k, s in enumerate(specs))
    named = {a for s in in_specs for e in s for a in _entry_axes(e)} | set(sharding.spec.reduced)
    axes = tuple(a for a in mesh.axis_names if a in named)

    def body(*xs: Any) -> Any:
        # every block made varying over the axes any of them varies over (a primitive bound directly gets no
        # implicit cast): the leaf's cast over R is the one whose transpose hands back each device's term,
        # unreduced; another cast is an index's (replicated over the table's tile axes), which has no cotangent
        xs = [x if not (more := tuple(a for a in axes if a not in jax.typeof(x).vma)) else
              jax.lax.pcast(x, more, to="varying") for x in xs]
        return local(xs)

    def run(args: list[Any]) -> list[Any]:
        args = list(args)
        with use_abstract_mesh(mesh.abstract_mesh):
            for k, s in enumerate(in_specs):
                if k != slot:
                    args[k] = reshard(args[k], s)
        y = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=True)(*args)
        return [to_auto(y, sharding)]

    return run


def gather_island(e: Any, shape: tuple[int, ...], tile: Any, sharding: Any, read: Any, indices: Any,
                  out: Any, casts: Sequence[Any] = ()) -> Island | None:
    """The ``gather`` equation ``e`` reading a deferred table (shape ``shape``, tile ``tile``, Explicit
    ``sharding`` reduced over R; read in ``read``, through the ``convert_element_type`` equations ``casts``) as
    its operand, run per device (module docstring); None unless the shardings (the plan's, on prime-factor meshes)
    meet the conditions there."""
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
    if any(t[d] for d in dn.start_index_map) or ix[-1]:
        return None
    kept = [d for d in range(rank) if d not in dn.collapsed_slice_dims]
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    if [o[d] for d in dn.offset_dims] != [t[d] for d in kept] or [o[d] for d in batch_out] != ix[:-1]:
        return None
    replicas = sharding.spec.reduced
    if frozenset(a for axes in ix[:-1] for a in axes) != replicas:
        return None
    if any(t[d] and sizes[d] != shape[d] for d in range(rank)):
        return None  # a split dimension must be sliced whole, so the local slice is the local block
    mesh = sharding.mesh
    local_sizes = tuple(s // _ways(mesh, t[d]) for d, s in enumerate(sizes))
    params = dict(e.params, slice_sizes=local_sizes)
    primitive = e.primitive

    def local(xs: list[Any]) -> Any:

        return primitive.bind(apply_views(xs[0], casts), xs[1], **params)

    return _local_island(sharding, 0, (None, _spec(ix)), _spec(o), local)


def scale_island(e: Any, slot: int, view: Any, other_shape: tuple[int, ...], rank: int, tile: Any, sharding: Any,
                 other: Any, out: Any, casts: Sequence[Any] = ()) -> Island | None:
    """The ``mul`` (or other :data:`ELEMENTWISE`) equation ``e`` reading, as operand ``slot``, the
    ``broadcast_in_dim`` equation ``view`` of a deferred leaf (rank ``rank``, tile ``tile``, Explicit ``sharding``
    reduced over R), run per device with the broadcast done on the local block (module docstring); its argument
    ``slot`` is then the leaf itself (the view
    equation passes it through; ``casts``: the ``convert_element_type`` equations between the leaf and the
    broadcast, applied first). ``other_shape``, ``other``, ``out``: the other operand's shape and the plan's
    shardings of it and of the output. None unless they meet the conditions there."""
    if e.name not in ELEMENTWISE or view.name != "broadcast_in_dim" or len(e.invars) != 2 or None in (other, out):
        return None
    if e.invars[0] == e.invars[1] or not (other.mesh == out.mesh == tile.mesh):
        return None
    shape = tuple(e.out_shapes[0])
    vshape = tuple(view.params["shape"])
    dims = tuple(view.params["broadcast_dimensions"])
    if len(vshape) != len(shape) or tuple(other_shape) != shape:
        return None
    t = _entries(tile.spec, rank)
    x = _entries(other.spec, len(shape))
    if _entries(out.spec, len(shape)) != x:
        return None
    v = [()] * len(shape)
    for j, d in enumerate(dims):
        v[d] = t[j]
    summed = [d for d in range(len(shape)) if vshape[d] == 1 and shape[d] > 1]
    if any(x[d] != v[d] for d in range(len(shape)) if d not in summed):
        return None
    if any(v[d] for d in summed) or frozenset(a for d in summed for a in x[d]) != sharding.spec.reduced:
        return None
    mesh = sharding.mesh
    local_shape = tuple(s // _ways(mesh, v[d]) for d, s in enumerate(vshape))
    vparams = dict(view.params, shape=local_shape)
    vprim, prim, params = view.primitive, e.primitive, e.params

    def local(xs: list[Any]) -> Any:

        xs = list(xs)
        xs[slot] = vprim.bind(apply_views(xs[slot], casts), **vparams)
        return prim.bind(*xs, **params)

    return _local_island(sharding, slot, tuple(_spec(x) if k != slot else None for k in range(2)), _spec(x), local)
