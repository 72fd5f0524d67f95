"""Running a searched pipeline plan with ``torch.distributed.pipelining``.

:func:`pipeline` traces ``module(*inputs)`` (a module whose forward returns
the loss) with :func:`shardplan.torch.trace` at the micro-batch size, runs
the pipeline search (:func:`shardplan.pipeline.api.pipeline_solve`, on rank
0; the decision is broadcast) and returns a :class:`TorchPipeline` whose
:meth:`~TorchPipeline.step` runs one training step.

**Units.** Operators are grouped by module path: blocks are the paths up to
the first numeric component (``layers.3``, ``model.transformer.h.0``); other
modules are cut at the same depth (``model.transformer.wte``,
``model.lm_head``); operators of the top-level forward (the loss) join their
unscoped neighbours.

**Stages.** The exported FX graph (``torch.export``'s training IR, the graph
the plan was made for) is split into one ``nn.Module`` per stage (per chunk
for interleaved plans, chunk c of device group d being stage ``c S + d``):
its operators' nodes go to their unit's stage, other nodes (views, constants)
next to their first reader (:func:`shardplan.pipeline.execute.assign_nodes`).
Each stage module holds copies of the parameters its nodes read and runs its
nodes in order. ``torch.distributed.pipelining`` passes tensors only between
neighbouring stages, so a value produced in stage i and read in stage k > i + 1
is carried through the stages between (it is an output and an input of each);
the user inputs all enter stage 0 (``schedule.step(*inputs)`` splits them
into micro-batches on dimension 0) and are carried to the stages that read them
(labels travel to the last stage). The stages are built in static mode: the
example inputs and outputs that :class:`~torch.distributed.pipelining.PipelineStage`
needs are the FX graph's own metadata (shapes, dtypes, whether a value
depends on a trainable parameter), so integer tensors travel as well.

**Schedule.** The plan's m and schedule map to ``Schedule1F1B``,
``ScheduleGPipe`` (a 1F1B plan run in GPipe's order on request),
``ScheduleInterleaved1F1B`` (v chunks per rank) and, for ZB-H1,
``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB1P, the
paper's ZB-H1: each backward split into its input-gradient and
weight-gradient passes by autograd, the W passes deferred into the bubble). The last stage returns the
micro-batch's loss; the schedule's ``loss_fn`` is that value. The loss is
the *mean* over the batch (``reduction="mean"``): the step's loss is the
mean of the m micro-batch losses, and ``scale_grads=True`` (torch's
default, which divides the accumulated gradients by m) gives exactly the
gradient of that mean; ``reduction="sum"`` sums the losses and turns the
scaling off.

**Devices.** ``stage_devices=1`` (default): the search is asked for
sub-meshes of one device (``sizes=(1,)``), so S stages (or S device groups
of v interleaved chunks) run on S processes, the world of the process group,
on plain tensors (a one-device stage has no layout to apply).
``stage_devices=2``: the search is asked for uniform sub-meshes of 2
(``sizes=(2,)``), the world is split by a ``(pp, m0)`` DeviceMesh of shape
``(world / 2, 2)``, and each stage runs as a
:class:`~shardplan.torch.run.ParallelModule` on its sub-mesh ``m0`` with the
*searched* intra-stage layouts as DTensor placements: the stage module is
traced again, its operators are the plan's stage operators in the same
order (checked: same iteration dimensions), and each takes its
counterpart's layout. Activations cross stages as full (replicated) plain
tensors: process k of stage i sends to process k of stage i + 1 (the
``pp`` group of the mesh), so both processes of a stage send the same
tensor, as Megatron-LM does without its scatter/gather optimisation; a
stage input that needs a gradient enters the DTensor program through
``DTensor.from_local`` (differentiable). Limits: sub-meshes of one or two
processes, all stages the same size (``torch.distributed.pipelining`` pairs
ranks one to one between neighbouring stages, and a stage of 4 processes
could need a 2 x 2 mesh that only its own ranks would create); a parameter
read by several stages needs one process per stage.

A parameter read by several stages (tied embeddings, known by several names:
the first name ``named_parameters`` gives is used) has a copy in each; the
copies' gradients are summed over the processes after the step, so each holds
the parameter's full gradient.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shardplan.errors import ShardplanError
from shardplan.machine import Machine

__all__ = ["unit_key", "unit_names", "scoped_trace", "StagePartition", "partition", "TorchPipeline", "pipeline",
           "build_pipeline", "plan_layout", "Tracer", "SCHEDULE_CLASSES", "ShardedStateOptimizer"]

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zb-h1": "ScheduleInterleavedZeroBubble"}


def unit_key(path: str, depth: int) -> str | None:
    """The unit of a module path: its first ``depth + 1`` components (None for the top level)."""
    if path in ("", "<top>"):
        return None
    return ".".join(path.split(".")[:depth + 1])


def _block_depth(paths: Sequence[str]) -> int:
    """Position of the first numeric path component (the index of a block list), else 0."""
    depths = [next((i for i, c in enumerate(p.split(".")) if c.isdigit()), None) for p in paths]
    found = [d for d in depths if d is not None]
    return min(found) if found else 0


def unit_names(module_paths: Mapping[str, str]) -> dict[str, str]:
    """Operator name -> name whose scope (before the first ``/``) is its unit (see the module docstring)."""
    paths = [p for p in module_paths.values() if p != "<top>"]
    depth = _block_depth(paths)
    # containers of the block list (e.g. ``model.transformer`` above ``model.transformer.h.3``) run code
    # before and after the blocks: their operators are glue between units, not a unit of their own
    containers = {".".join(c[:k]) for c in (p.split(".") for p in paths)
                  if len(c) > depth and c[depth].isdigit() for k in range(1, depth)}
    out = {}
    for name, path in module_paths.items():
        key = unit_key(path, depth)
        tail = name.split("/")[-1]
        if key is None:
            out[name] = tail
            continue
        if path in containers:
            out[name] = name.replace("/", ".")
            continue
        rest = path[len(key) + 1:] if len(path) > len(key) else ""
        out[name] = f"{key}/{rest}/{tail}" if rest else f"{key}/{tail}"
    if len(set(out.values())) != len(out):
        raise ShardplanError("operator names collide once grouped by unit")
    return out


def scoped_trace(module: Any, inputs: Sequence[Any]) -> tuple[Any, Any, dict[str, str]]:
    """:func:`shardplan.torch.trace` with operators renamed by :func:`unit_names`: (graph, info, new -> old name)."""
    from shardplan.torch.frontend import trace

    graph, info = trace(module, inputs)
    ren = unit_names({op.name: info.module_paths.get(op.name, "<top>") for op in graph.operators})
    return graph.renamed(ren), info, {v: k for k, v in ren.items()}


class Tracer:
    """``build(rows)``: the module traced on the first ``rows`` examples of every input."""

    def __init__(self, module: Any, inputs: Sequence[Any]) -> None:
        import torch

        self.module, self.inputs = module, tuple(inputs)
        rows = {int(x.shape[0]) for x in self.inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
        if len(rows) != 1 or not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in self.inputs):
            raise ShardplanError("every input of a pipelined module must be a tensor with the batch on dimension 0, "
                                 f"all of one size; got {[tuple(getattr(x, 'shape', ())) for x in self.inputs]}")
        self.batch = rows.pop()
        self.cache: dict[int, tuple[Any, Any, dict[str, str]]] = {}

    def traced(self, rows: int) -> tuple[Any, Any, dict[str, str]]:
        if rows not in self.cache:
            self.cache[rows] = scoped_trace(self.module, tuple(x[:rows] for x in self.inputs))
        return self.cache[rows]

    def __call__(self, rows: int) -> Any:
        return self.traced(rows)[0]


@dataclass(frozen=True)
class StagePartition:
    """One stage's part of the FX graph.

    Attributes:
        index: stage (chunk) index in pipeline order.
        nodes: FX node names it runs, in graph order.
        inputs: value names its forward takes (stage 0: the user inputs), in order.
        outputs: value names it returns (the last stage: the loss).
        params: parameter placeholder name -> parameter target (FQN in the module).
        consts: buffer / constant placeholder name -> (kind, target).
    """

    index: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: Mapping[str, str]
    consts: Mapping[str, tuple[str, str]]


def partition(ep: Any, node_op: Mapping[str, str], rename: Mapping[str, str], graph: Any,
              specs: Sequence[Any]) -> list[StagePartition]:
    """Split the exported program ``ep`` into the stages ``specs`` (see the module docstring)."""
    from torch.export.graph_signature import InputKind

    from shardplan.pipeline.execute import assign_nodes, ops_by_stage

    op_stage = ops_by_stage(graph, specs)
    old_to_new = {v: k for k, v in rename.items()}
    nodes = list(ep.graph.nodes)
    kind: dict[str, tuple[Any, str | None]] = {}
    user: list[str] = []
    for s in ep.graph_signature.input_specs:
        name = s.arg.name if hasattr(s.arg, "name") else None
        if name is None:
            continue
        kind[name] = (s.kind, s.target)
        if s.kind == InputKind.USER_INPUT:
            user.append(name)
    compute = [n.name for n in nodes if n.op not in ("placeholder", "output")]
    by_name = {n.name: n for n in nodes}
    inputs = {n: [a.name for a in by_name[n].all_input_nodes] for n in compute}
    out_node = next(n for n in nodes if n.op == "output")
    outs = [a for a in out_node.args[0]] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    if len(outs) != 1 or getattr(outs[0], "op", None) in (None, "placeholder"):
        raise ShardplanError("a pipelined module's forward must return one loss tensor computed from its inputs")
    loss = outs[0].name
    fixed = {n: op_stage[old_to_new[node_op[n]]] for n in compute if n in node_op}
    last = len(specs) - 1
    stage = assign_nodes(compute, inputs, fixed, last, outputs=[loss])
    if stage[loss] != last:
        raise ShardplanError("the loss is computed before the last stage")
    home: dict[str, int] = {u: 0 for u in user}
    home.update(stage)
    reach: dict[str, int] = {}
    for n in compute:
        for a in inputs[n]:
            if a in home:
                reach[a] = max(reach.get(a, -1), stage[n])
    order = user + compute

    def carried_into(j: int) -> tuple[str, ...]:
        return tuple(v for v in order if home[v] < j <= reach.get(v, -1))

    parts = []
    for j in range(len(specs)):
        mine = tuple(n for n in compute if stage[n] == j)
        read = {a for n in mine for a in inputs[n]}
        params = {a: kind[a][1] for a in read if a in kind and kind[a][0] == InputKind.PARAMETER}
        consts = {a: (kind[a][0].name, kind[a][1]) for a in read
                  if a in kind and kind[a][0] not in (InputKind.PARAMETER, InputKind.USER_INPUT)}
        ins = tuple(user) if j == 0 else carried_into(j)
        outs_j = (loss,) if j == last else carried_into(j + 1)
        parts.append(StagePartition(j, mine, ins, outs_j, params, consts))
    return parts


def _stage_module(part: StagePartition, ep: Any, module: Any,
                  node_choices: Mapping[str, tuple[str, tuple, bool]] | None = None,
                  recompute: tuple[Mapping[str, str], frozenset[str]] | None = None,
                  offload_params: frozenset[str] = frozenset()) -> Any:
    """An ``nn.Module`` running ``part``'s nodes on copies of the parameters it reads.

    ``offload_params``: placeholders of parameters that live in host memory between their uses (ZeRO-Infinity's
    ``offload_param`` in a stage of one process, :func:`_offloaded_placeholders`): each has a home (a host copy,
    ``Stage.offloaded_parameters()``) and its device storage is freed; a forward pass brings them all in when it
    starts and frees them when it ends, and what autograd saves of them (the parameter or a view of it) is kept
    as a reference and copied in again from the home when the backward pass reads it (fresh memory, freed with
    the saved tensor), as :class:`~shardplan.torch.run.ParallelModule` regathers its ZeRO-3 shards.

    ``node_choices``: FX node name -> (its operator, its FP8 operands as (argument path, tensor name), whether
    its saved tensors live in host memory), for the nodes of operators with such choices (:func:`node_choices`):
    the operands are cast (:func:`shardplan.torch.precision.fp8_cast`, current scaling, or delayed from
    ``Stage.scaling`` when set) and the output's gradient cast in the backward pass
    (:func:`~shardplan.torch.precision.fp8_grad`); the node runs under the stage's
    :class:`~shardplan.torch.precision.HostOffload` hooks (``Stage.host`` counts what went to the host).
    ``recompute``: (FX node -> operator, the operators that recompute): consecutive nodes of those operators
    (with the views that follow them) run as one ``torch.utils.checkpoint`` segment
    (:func:`shardplan.torch.run.recompute_segments`), their forward run again in the backward pass."""
    import contextlib

    import torch
    from torch import nn

    from torch.utils.checkpoint import checkpoint

    from shardplan.torch.precision import HostOffload, _to, fp8_cast, fp8_grad
    from shardplan.torch.run import Segment, _get, _offloaded, _set, fetch_home, recompute_segments, release_storage

    chosen = dict(node_choices or {})

    named = dict(module.named_parameters(remove_duplicate=False))
    by_name = {n.name: n for n in ep.graph.nodes}
    nodes = [by_name[n] for n in part.nodes]
    items = recompute_segments(nodes, *recompute) if recompute and recompute[1] else nodes

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.ParameterDict()
            self.keys: dict[str, str] = {}  # placeholder -> key in self.weights
            for ph, target in sorted(part.params.items()):
                key = target.replace(".", "__")
                if key not in self.weights:
                    src = named[target]
                    self.weights[key] = nn.Parameter(src.detach().clone(), requires_grad=src.requires_grad)
                self.keys[ph] = key
            self.targets = {self.keys[ph]: t for ph, t in part.params.items()}
            self.consts: dict[str, Any] = {}
            for ph, (k, target) in part.consts.items():
                self.consts[ph] = ep.constants[target] if k == "CONSTANT_TENSOR" else ep.state_dict[target]
            self.host = HostOffload()
            self.segments = [i for i in items if isinstance(i, Segment)]  # the recomputed runs of nodes
            self.scaling: Any = None  # FP8 delayed scaling's state (None: current scaling)
            self.homes: dict[str, Any] = {}  # key -> host tensor of a parameter living in host memory between uses
            for ph in sorted(offload_params):
                key = self.keys[ph]
                if key not in self.homes:
                    self.homes[key] = _to(self.weights[key].detach(), "cpu")
                    release_storage(self.weights[key])
            self._saving: Any = None  # during a forward pass with homes: the hooks that save their references

        def forward(self, *args: Any) -> Any:
            env: dict[str, Any] = dict(zip(part.inputs, args))
            for ph, key in self.keys.items():
                env[ph] = self.weights[key]
            env.update(self.consts)
            for key, home in self.homes.items():  # on the device for the forward pass
                fetch_home(self.weights[key], home)
            self._saving = self._home_hooks() if self.homes else None
            try:
                with torch.autograd.graph.saved_tensors_hooks(*self._saving) if self._saving \
                        else contextlib.nullcontext():
                    for item in items:
                        if isinstance(item, Segment):
                            outs = checkpoint(self._segment(item), *[env[n] for n in item.inputs],
                                              use_reentrant=False)
                            env.update(zip(item.outputs, outs))
                        else:
                            env[item.name] = self._node(item, env)
            finally:
                self._saving = None
                for key in self.homes:  # ... and back in host memory until the backward pass reads them
                    release_storage(self.weights[key])
            outs = tuple(env[o] for o in part.outputs)
            return outs[0] if len(outs) == 1 else outs

        def _home_hooks(self) -> tuple[Any, Any]:
            """Saved-tensor hooks that keep, instead of an offloaded parameter (or a view of it), a reference to
            its home and the view, and copy it in from the home when the backward pass reads it."""
            by_ptr = {self.weights[key].untyped_storage().data_ptr(): key for key in self.homes
                      if self.weights[key].numel()}

            def pack(t: Any) -> Any:
                if not isinstance(t, torch.Tensor) or not t.numel():
                    return t
                key = by_ptr.get(t.untyped_storage().data_ptr())
                if key is None:
                    return t
                return _HomeView(key, tuple(t.shape), tuple(t.stride()), t.storage_offset())

            def unpack(t: Any) -> Any:
                if not isinstance(t, _HomeView):
                    return t
                full = _to(self.homes[t.key], self.weights[t.key].device)
                return full.as_strided(t.size, t.stride, t.offset)
            return pack, unpack

        def offloaded_parameters(self) -> dict[str, Any]:
            """Parameter name (``weights.<key>``) -> the host tensor holding it between uses; the device
            parameter holds no memory then: read its values here (:meth:`TorchPipeline.optimizer` steps it
            here)."""
            return {"weights." + key: home for key, home in self.homes.items()}

        def _segment(self, seg: Any) -> Any:
            """``seg`` as a function of its inputs' values to its outputs' (what ``checkpoint`` runs twice)."""
            def run(*values: Any) -> tuple[Any, ...]:
                env = dict(zip(seg.inputs, values))
                for node in seg.nodes:
                    env[node.name] = self._node(node, env)
                return tuple(env[n] for n in seg.outputs)
            return run

        def _node(self, node: Any, env: dict[str, Any]) -> Any:
            a = torch.fx.node.map_arg(node.args, lambda x: env[x.name])
            kw = torch.fx.node.map_arg(node.kwargs, lambda x: env[x.name])
            if node.op == "get_attr":  # a sub-graph of a higher-order op (e.g. a vmapped mask)
                return operator.attrgetter(node.target)(ep.graph_module)
            if node.name not in chosen:
                return node.target(*a, **kw)
            op, operands, offload = chosen[node.name]
            a, kw = list(a), dict(kw)
            for path, tname in operands:
                x = _get(a, kw, path)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    _set(a, kw, path, fp8_cast(x, self.scaling, f"{op}:{tname}"))
            if offload and self._saving:  # the offloaded parameters' references stay, the rest goes to the host
                hooks: Any = torch.autograd.graph.saved_tensors_hooks(*_offloaded(*self._saving, self.host))
            else:
                hooks = self.host.hooks() if offload else contextlib.nullcontext()
            with hooks:
                out = node.target(*a, **kw)
            fp8 = operands and isinstance(out, torch.Tensor)
            return fp8_grad(out, self.scaling, f"{op}:dY") if fp8 else out

        def named_targets(self) -> dict[str, Any]:
            """Parameter target in the original module -> this stage's copy."""
            return {t: self.weights[k] for k, t in self.targets.items()}

    return Stage()


@dataclass(frozen=True)
class _HomeView:
    """A saved view of a parameter living in host memory, by reference: its key and the view's size, stride and
    storage offset (:func:`_stage_module`)."""

    key: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _first_readers(ops: Sequence[StageChoice], info: Any, rename: Mapping[str, str],
                   params: Mapping[str, str]) -> dict[str, str]:
    """Parameter placeholder of a stage of one process (``params``: placeholder -> target) -> its first reader
    among the stage's operators (``ops``, new names; ``rename``: new -> traced name), by traced name."""
    ours = {rename.get(c[0], c[0]) for c in ops}
    out = {}
    for ph, target in params.items():
        uses = [u for u in info.param_uses.get(target, ()) if u[0] in ours]
        if uses:
            out[ph] = uses[0][0]
    return out


def _owners(ops: Sequence[StageChoice], rename: Mapping[str, str], part: str) -> set[str]:
    """The traced names of the operators of ``ops`` that offload ``part`` ("optimizer", "parameters")."""
    return {rename.get(c[0], c[0]) for c in ops if part in c[2]}


def _offloaded_placeholders(part: StagePartition, ep: Any, ops: Sequence[StageChoice], info: Any,
                            rename: Mapping[str, str]) -> frozenset[str]:
    """The parameter placeholders of a stage of one process (``part``) that live in host memory: those whose first
    reader in the stage (:func:`_first_readers`) offloads its parameters, and whose every reader is an operator's
    node that does not recompute (the rule of :meth:`shardplan.torch.run.ParallelModule` for its ZeRO-3 shards:
    a view node, or a checkpointed segment, would read the parameter itself after the forward pass freed it)."""
    owners = _owners(ops, rename, "parameters")
    recomputed = {rename.get(c[0], c[0]) for c in ops if c[3]}
    by_name = {n.name: n for n in ep.graph.nodes}
    out = set()
    for ph, first in _first_readers(ops, info, rename, part.params).items():
        users = list(by_name[ph].users)
        readers = [info.node_op.get(u.name) for u in users]
        if first in owners and all(r is not None and r not in recomputed for r in readers) and not any(
                u.name in info.const_nodes for u in users):
            out.add(ph)
    return frozenset(out)


def _examples(ep: Any, module: Any, names: Sequence[str]) -> tuple[Any, ...]:
    """Example tensors of FX values: shape and dtype from the graph's metadata; ``requires_grad`` when the
    value is floating point and depends on a trainable parameter."""
    import torch
    from torch.export.graph_signature import InputKind

    named = dict(module.named_parameters(remove_duplicate=False))
    grad: dict[str, bool] = {}
    for s in ep.graph_signature.input_specs:
        if hasattr(s.arg, "name"):
            grad[s.arg.name] = s.kind == InputKind.PARAMETER and bool(named[s.target].requires_grad)
    for n in ep.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        v = n.meta.get("val")
        flt = isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        grad[n.name] = flt and any(grad.get(a.name, False) for a in n.all_input_nodes) \
            and str(n.target) != "aten.detach.default"
    by_name = {n.name: n for n in ep.graph.nodes}
    out = []
    for name in names:
        v = by_name[name].meta["val"]
        t = torch.zeros(tuple(int(s) for s in v.shape), dtype=v.dtype)
        out.append(t.requires_grad_(grad[name]))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class _Held:
    """A stage's running module and how its parameters map to the original module's names.

    The running module is the stage module or its DTensor :class:`~shardplan.torch.run.ParallelModule`,
    which keeps the stage module's parameter names (``weights.<key>``).
    """

    module: Any
    targets: Mapping[str, str]  # key in the stage module -> parameter target in the original module
    zero1: frozenset[str] = frozenset()  # the running module's parameters with state in shards (ZeRO-1, 2)
    host: frozenset[str] = frozenset()  # the running module's parameters whose optimizer state is in host memory

    def named_targets(self) -> dict[str, Any]:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return {t: params["weights." + k] for k, t in self.targets.items()}

    def delayed_scaling(self, length: int | None) -> None:
        from shardplan.torch.precision import DelayedScaling

        self.module.scaling = None if length is None else DelayedScaling(length)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)


def _host_state(ops: Sequence[StageChoice], info: Any, rename: Mapping[str, str], keys: Mapping[str, str],
                params: Mapping[str, str]) -> frozenset[str]:
    """The parameters of a stage of one process (``weights.<key>``; ``keys``: placeholder -> key, ``params``:
    placeholder -> target) whose optimizer state lives in host memory: those whose first reader in the stage
    (:func:`_first_readers`) offloads it."""
    owners = _owners(ops, rename, "optimizer")
    return frozenset("weights." + keys[ph] for ph, first in _first_readers(ops, info, rename, params).items()
                     if first in owners)


def _broadcast_stage_layouts(result: Any, rank: int) -> list[list[tuple[Any, Any]]]:
    """Per stage, its intra-stage plan's ``(operator dims, Layout, dealt)`` in operator order (rank 0 -> all);
    ``dealt``: the causal attention's queries dealt with its keys gathered (:func:`shardplan.cost.ring.deals_gathered`
    on the stage's machine, as its tables charge)."""
    import torch.distributed as dist

    from shardplan.cost.ring import deals_gathered
    from shardplan.pipeline.execute import stage_plan

    box: list[Any] = [None]
    if rank == 0:
        box = [[[(op.dims, pl.layouts[op.name], op.kind == "attn_flash" and deals_gathered(
            op, pl.layouts[op.name], pl.machine)) for op in pl.graph.operators]
                for pl in (stage_plan(result, j) for j in range(result.plan.num_stages))]]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def _dtensor_stage(mod: Any, examples: Sequence[Any], layouts: Sequence[tuple[Any, Any]], mesh: Any,
                   choices: Sequence[StageChoice] = (), ring: bool = False) -> Any:
    """The stage module run on DTensors over ``mesh`` with the searched intra-stage layouts.

    The stage module is traced again (:func:`shardplan.torch.trace`); its operators are the stage's
    operators in the same order (the same FX nodes), each taking the layout the intra-stage plan gave
    its counterpart, and its run choices (``choices``, in the same order: FP8 products, activation offload,
    recomputation; ``ring``: attention whose queries are split runs the ring); a mismatch raises.
    """
    from shardplan.torch.frontend import trace
    from shardplan.torch.layout import plan_mesh_shape
    from shardplan.torch.run import ParallelModule

    graph, info = trace(mod, tuple(x.detach() for x in examples))
    if len(graph.operators) != len(layouts) or any(tuple(d for d, _ in op.dims) != tuple(d if isinstance(d, str) else d[0] for d in entry[0])
                                                   for op, entry in zip(graph.operators, layouts)):
        raise ShardplanError("the stage module's operators differ from the stage the plan was made for")
    lays = {op.name: entry[1] for op, entry in zip(graph.operators, layouts)}
    dealt = frozenset(op.name for op, entry in zip(graph.operators, layouts) if len(entry) > 2 and entry[2])
    shape = plan_mesh_shape(list(lays.values()), int(mesh.mesh.numel()))
    if tuple(shape) != tuple(mesh.mesh.shape):
        raise ShardplanError(f"stage layouts need a mesh of shape {shape}; stages of {mesh.mesh.numel()} processes "
                             "run on a one-axis mesh")
    names = [op.name for op in graph.operators]
    return ParallelModule.create(mod, info, graph, lays, mesh, _run_choices(choices, names, ring, dealt))


@dataclass(eq=False)
class TorchPipeline:
    """This process's part of a pipelined module: its stage module(s) and the schedule.

    Attributes:
        result: the search's answer (on rank 0; None elsewhere).
        layout: what every rank knows of the plan: ``{"stages": [(first, end, offset, devices), ...],
            "micro_batches": m, "schedule": ..., "chunks": v, "units": [...]}``.
        parts: every stage's :class:`StagePartition`.
        modules: this rank's stage modules (one, or v for interleaved), in chunk order.
        stages: their ``PipelineStage`` objects.
        schedule: the ``torch.distributed.pipelining`` schedule.
        reduction: "mean" or "sum".
        rank, last_rank: this process's rank; the rank of the last stage.
        shared: parameters read by several stages (target -> shape): their copies' gradients are summed.
    """

    result: Any
    layout: dict
    parts: list
    modules: list
    stages: list
    schedule: Any
    reduction: str
    rank: int
    last_rank: int
    shared: Mapping[str, tuple[int, ...]]

    @property
    def micro_batches(self) -> int:
        return int(self.layout["micro_batches"])

    def step(self, *inputs: Any) -> Any:
        """One forward and backward pass over the batch: the loss on every rank; gradients in the stage
        modules' parameters (:meth:`named_grads`). Rank 0 passes the inputs, the others may pass them too.

        In a stage of several processes a ZeRO-0 or ZeRO-1 parameter's gradient stays partial over the tile's
        replicas through the m micro-batches (summed locally) and is reduced once after them
        (:meth:`~shardplan.torch.run.ParallelModule.reduce_grads`): at ZeRO-0 all-reduced into the tile, at ZeRO-1
        reduce-scattered into its master shard's placements (which :meth:`optimizer`'s step then finds in place);
        ZeRO-2 and 3 gradients are reduce-scattered per micro-batch. What the cost tables charge
        (``cost.memory.choice_table``)."""
        import torch
        import torch.distributed as dist

        for mod in self.modules:
            mod.zero_grad(set_to_none=True)
            if getattr(mod.module, "scaling", None) is not None:  # a step starts: the last one's amaxes go in
                mod.module.scaling.commit()
            if hasattr(mod.module, "_stepping"):  # a ParallelModule: its forwards are this step's micro-batches
                mod.module._stepping = True
                mod.module._accumulating = True  # ZeRO-0 and 1 gradients summed locally until reduce_grads
        m = self.micro_batches
        first = any(p.index == 0 for p in self._mine())
        last = any(p.index == len(self.parts) - 1 for p in self._mine())
        losses: list[Any] = []
        kw: dict[str, Any] = {"return_outputs": False}
        if last:
            kw.update(target=torch.zeros(m), losses=losses)
        try:
            self.schedule.step(*(inputs if first else ()), **kw)
        finally:
            for mod in self.modules:
                if hasattr(mod.module, "_stepping"):
                    mod.module._stepping = mod.module._accumulating = False
        for mod in self.modules:  # once a step: ZeRO-0 all-reduced into the tile, ZeRO-1 reduce-scattered
            if hasattr(mod.module, "reduce_grads"):
                mod.module.reduce_grads(mod.zero1)
        if last:
            total = torch.stack([x.detach().reshape(()) for x in losses]).sum()
            loss = total / m if self.reduction == "mean" else total
        else:
            loss = torch.zeros(())
        dist.broadcast(loss, src=self.last_rank)
        self._sum_shared()
        return loss

    def delayed_scaling(self, length: int | None = None) -> "TorchPipeline":
        """Run this rank's FP8 products with delayed scaling (the default) from now on, with fresh amax histories
        of ``length`` steps (:data:`~shardplan.torch.precision.AMAX_HISTORY` by default; each :meth:`step` is a
        step); returns the pipeline."""
        from shardplan.torch.precision import AMAX_HISTORY

        for mod in self.modules:
            mod.delayed_scaling(length or AMAX_HISTORY)
        return self

    def current_scaling(self) -> "TorchPipeline":
        """Run this rank's FP8 products with current scaling from now on (no state); returns the pipeline."""
        for mod in self.modules:
            mod.delayed_scaling(None)
        return self

    def _mine(self) -> list[StagePartition]:
        return [self.parts[j] for j in self._indices()]

    def _indices(self) -> list[int]:
        return [j for j, (_, _, o, d) in enumerate(self.layout["stages"]) if o <= self.rank < o + d]

    def _sum_shared(self) -> None:
        """Sum the gradients of a parameter's copies in several stages (every rank takes part)."""
        import torch
        import torch.distributed as dist

        held = self.named_parameters()
        for target in self.shared:
            p = held.get(target)
            g = p.grad.detach().clone() if p is not None and p.grad is not None else None
            buf = g if g is not None else torch.zeros(self.shared[target])
            dist.all_reduce(buf)
            for mod in self.modules:
                q = mod.named_targets().get(target)
                if q is not None:
                    q.grad = buf.clone()

    def optimizer(self, cls: Any, **options: Any) -> Any:
        """``cls`` (a ``torch.optim`` class) over this rank's stage parameters, holding the state as the plan's ZeRO
        stages say: a parameter whose first reader in its stage has ZeRO-1 or ZeRO-2, in a stage of several
        processes whose tile of it has replicas, gets its state in shards (:class:`ShardedStateOptimizer`; at ZeRO-2
        its gradient already arrives there, reduce-scattered by the stage's ParallelModule); the others (a ZeRO-3
        parameter, already held in shards by its stage's ParallelModule, and every parameter of a stage of one
        process, where the tile is whole on its one process) are stepped as they are. The state of a parameter
        whose first reader offloads it, and of an offloaded ZeRO-3 shard, lives in host memory: those (or their
        master shards) are stepped by a :class:`~shardplan.torch.precision.HostOptimizer`, an offloaded shard in
        its home, as :meth:`shardplan.torch.run.ParallelModule.optimizer` does for one program. Returns a
        :class:`ShardedStateOptimizer` where any state is sharded, else a ``HostOptimizer`` where any lives in host
        memory, else ``cls`` itself. Step it after :meth:`step`: ``loss = pipe.step(*batch); opt.step();
        opt.zero_grad()``."""
        from torch.distributed.tensor import DTensor

        from shardplan.torch.run import zero3_placements

        pairs, others, host, homes = [], [], [], {}
        for held in self.modules:
            params = dict(held.module.named_parameters())
            if hasattr(held.module, "offloaded_parameters"):  # parameters (ZeRO-3 shards) living in host memory
                homes.update({id(params[n]): h for n, h in held.module.offloaded_parameters().items()})
            for name, p in params.items():
                if name in held.host or id(p) in homes:  # a parameter living in host memory is stepped there
                    host.append(p)
                if name in held.zero1 and isinstance(p, DTensor):
                    shard = zero3_placements(p.placements, p.shape, p.device_mesh.mesh.shape)
                    if tuple(shard) != tuple(p.placements):
                        pairs.append((p, shard))
                        continue
                others.append(p)
        if pairs:
            return ShardedStateOptimizer(pairs, others, cls, host=host, homes=homes, **options)
        return _inner_optimizer(others, host, homes, cls, options)

    def named_parameters(self) -> dict[str, Any]:
        """Parameter target (name in the original module) -> this rank's copy."""
        out: dict[str, Any] = {}
        for mod in self.modules:
            out.update(mod.named_targets())
        return out

    def named_grads(self) -> dict[str, Any]:
        return {t: p.grad for t, p in self.named_parameters().items() if p.grad is not None}


def _broadcast_layout(result: Any, rank: int) -> dict:
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        plan = result.plan
        box = [{"stages": [(s.first, s.end, s.offset, s.devices) for s in plan.stages],
                "micro_batches": plan.micro_batches, "schedule": plan.schedule, "chunks": plan.chunks,
                "units": result.unit_names(), "step_time": plan.step_time, "choices": _result_choices(result),
                "ring": result.stages.solve_options.get("context") == "ring"}]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


StageChoice = tuple  # (operator name, fp8, offload parts, recompute, ZeRO stage): one operator's run choices


def _result_choices(result: Any) -> list[list[StageChoice]]:
    """Per stage of a pipeline search's answer, its operators' run choices in order (every operator plain for a
    search without memory choices)."""
    from shardplan.pipeline.execute import stage_plan

    out = []
    for j, st in enumerate(result.plan.stages):
        sp = stage_plan(result, j) if result.stages.memory_choices else None
        mc = getattr(sp, "memory_choices", None)
        out.append([] if mc is None else
                   [(op.name, bool(mc.fp8(i)), tuple(mc.offload(i)), bool(mc.recompute(i)), int(mc.stage(i)))
                    for i, op in enumerate(sp.graph.operators)])
    return out


def check_stage_choices(choices: Sequence[Sequence[StageChoice]], q: int) -> None:
    """Refuse what the stage runner cannot hold (stages of ``q`` processes): parameters in host memory beside a ZeRO
    stage other than 3 (ZeRO-Infinity's ``offload_param`` moves the ZeRO-3 partition; the plan never offers it).

    Held: ZeRO-1 and ZeRO-2 by :meth:`TorchPipeline.optimizer` (the state in master shards over each tile's
    replicas; at ZeRO-2 the stage's :class:`~shardplan.torch.run.ParallelModule` reduce-scatters the gradient
    into the shard), ZeRO-3 by the ParallelModule (parameters in shards, gathered at each use and again for the
    backward); optimizer state in host memory by a :class:`~shardplan.torch.precision.HostOptimizer` inside
    :meth:`TorchPipeline.optimizer`, and offloaded parameters in their homes (the ParallelModule's ZeRO-3 shards,
    :meth:`~shardplan.torch.run.ParallelModule.offloaded_parameters`; a stage of one process's whole parameters,
    :func:`_stage_module`), as in one program. In a stage of one process every ZeRO stage holds what stage 0
    holds (the tile has no replicas to shard over)."""
    for ops in choices:  # stages of any size q hold the same choices
        for name, _fp8, offload, _recompute, stage in ops:
            if "parameters" in offload and stage != 3:
                raise ShardplanError(f"pipeline stage operator {name!r} offloads its parameters at ZeRO stage {stage}: "
                                     "the PyTorch stage runner keeps parameters in host memory at ZeRO stage 3 only")


class ShardedStateOptimizer:
    """A ``torch.optim`` optimizer whose state for some DTensor parameters lives in shards (ZeRO-1 and 2).

    Each such parameter ``p`` (placements ``tile``) has a master shard ``s``: ``p`` redistributed to ``shard``
    (:func:`shardplan.torch.run.zero3_placements`: the tile further split over the mesh axes that replicate it), a
    leaf the inner optimizer steps, so its state (Adam's moments) is allocated on the shard. :meth:`step` hands
    ``p``'s gradient to the shard (already laid out as the shard: ZeRO-1's reduce-scattered once after the step's
    micro-batches by :meth:`TorchPipeline.step`, ZeRO-2's in each backward pass by the stage's
    :class:`~shardplan.torch.run.ParallelModule`; a gradient in other placements is redistributed to the
    shard's), steps the inner optimizer, and gathers the new shard back into
    ``p``'s tile (an all-gather over the replicas). Other parameters are stepped as they are. ``host``: parameters
    (of the pairs or ``others``) whose state lives in host memory: they (a pair's master shard) are stepped by a
    :class:`~shardplan.torch.precision.HostOptimizer` inner optimizer (``homes``: its host-resident parameters).
    The masters are taken from the parameters when this optimizer is made: load new values into the module
    before making it.
    """

    def __init__(self, pairs: Sequence[tuple[Any, Any]], others: Sequence[Any], cls: Any, *, host: Sequence[Any] = (),
                 homes: Mapping[int, Any] | None = None, **options: Any) -> None:
        import torch

        self.pairs = []
        for p, shard in pairs:
            master = torch.nn.Parameter(p.detach().redistribute(p.device_mesh, shard).clone())
            self.pairs.append((p, master))
        hosted = {id(x) for x in host}
        on_host = [m for p, m in self.pairs if id(p) in hosted] + [x for x in others if id(x) in hosted]
        self.inner = _inner_optimizer([m for _, m in self.pairs] + list(others), on_host, homes or {}, cls, options)

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (keyed by master shard or parameter); a
        :class:`~shardplan.torch.precision.HostOptimizer`'s is ``inner.inner.state``, keyed by the host copies."""
        return self.inner.state

    def masters(self) -> list[tuple[Any, Any]]:
        """(parameter, its master shard) for every parameter with sharded state."""
        return list(self.pairs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            p.grad = None if set_to_none or p.grad is None else p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for p, master in self.pairs:
                master.grad = None if p.grad is None else p.grad.redistribute(p.device_mesh, master.placements)
        self.inner.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master.redistribute(p.device_mesh, p.placements))

    def state_dict(self) -> Any:
        return self.inner.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)


def _inner_optimizer(params: Sequence[Any], host: Sequence[Any], homes: Mapping[int, Any], cls: Any,
                     options: Mapping[str, Any]) -> Any:
    """``cls`` over ``params``, those of ``host`` (by identity) stepped in host memory by a
    :class:`~shardplan.torch.precision.HostOptimizer` (``homes``: id -> host tensor of a parameter that lives
    there, stepped in place) beside the others, as :meth:`shardplan.torch.run.ParallelModule.optimizer` does."""
    from shardplan.torch.precision import HostOptimizer

    hosted = {id(x) for x in host}
    if not hosted:
        return cls(list(params), **options)
    return HostOptimizer([x for x in params if id(x) in hosted], cls,
                         device_params=[x for x in params if id(x) not in hosted], homes=dict(homes), **options)


def node_choices(ops: Sequence[StageChoice], info: Any, graph: Any, old: Mapping[str, str]) -> dict[str, tuple]:
    """FX node name -> (operator, its FP8 operands as (argument path, tensor name), activations offloaded) for
    the nodes of the operators of ``ops`` (new names; ``old``: new -> traced name) with FP8 or activation offload
    (:func:`_stage_module`)."""
    from shardplan.torch.precision import fp8_operands

    want = {old.get(name, name): (name, fp8, "activations" in offload and not rec) for name, fp8, offload, rec, _s
            in ops if fp8 or ("activations" in offload and not rec)}
    out = {}
    for node, op in info.node_op.items():
        if op not in want:
            continue
        new, fp8, offload = want[op]
        tensors = fp8_operands(graph[new]) if fp8 else frozenset()
        out[node] = (new, tuple((path, t) for path, t in info.operands.get(op, ()) if t in tensors), offload)
    return out


def _run_choices(ops: Sequence[StageChoice], names: Sequence[str], ring: bool,
                 dealt: frozenset[str] = frozenset()) -> Any:
    """The :class:`~shardplan.torch.run.RunChoices` of a stage's operators ``ops`` (in order; empty: none) for the
    stage module traced again, whose operators are ``names`` in the same order; ``dealt``: its causal
    attentions that deal their queries with the keys gathered."""
    from shardplan.torch.run import RunChoices

    if ops and len(ops) != len(names):
        raise ShardplanError("the stage module's operators differ from the stage the plan was made for")
    pick = lambda k: frozenset(n for n, c in zip(names, ops) if k(c))  # noqa: E731
    return RunChoices(recompute=pick(lambda c: c[3]), fp8=pick(lambda c: c[1]),
                      offload=pick(lambda c: "activations" in c[2] and not c[3]), ring=ring,
                      zero3=pick(lambda c: c[4] == 3), zero2=pick(lambda c: c[4] == 2),
                      offload_optimizer=pick(lambda c: "optimizer" in c[2]),
                      offload_params=pick(lambda c: "parameters" in c[2]), dealt=dealt)


def pipeline(module: Any, example_inputs: Sequence[Any], machine: Machine | None = None, *,
             micro_batches: Sequence[int] = (1, 2, 4, 8), max_stages: int | None = None, uniform: bool = False,
             interleave: Sequence[int] = (), schedules: Sequence[str] = ("1f1b", "interleaved"),
             budget: float | None = None, periodic: bool = True, schedule: str | None = None,
             reduction: str = "mean", cutoff: int = 1, stage_devices: int = 1,
             **solve_options: Any) -> TorchPipeline:
    """Search the pipeline of ``module(*example_inputs)`` (a loss) over the processes of the default group
    and build this rank's stages and schedule (call on every rank, with the same module and inputs).

    ``machine`` defaults to the one detected from the device (one device per process). ``stage_devices``: processes
    per stage; 1 (default) runs each stage on one process with plain tensors; 2 searches uniform sub-meshes of
    2 and runs each stage with its intra-stage layouts as DTensor placements (see the module docstring). ``micro_batches`` .. ``periodic`` go to
    :func:`shardplan.pipeline.api.pipeline_solve`; ``schedule="gpipe"`` runs a 1F1B plan with
    ``ScheduleGPipe``; ``solve_options`` go to each intra-stage solve.
    """
    import torch.distributed as dist

    from shardplan.pipeline.api import pipeline_solve

    if reduction not in ("mean", "sum"):
        raise ShardplanError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not dist.is_initialized():
        raise ShardplanError("torch pipelining needs an initialised process group (one process per stage)")
    world, rank = dist.get_world_size(), dist.get_rank()
    q = int(stage_devices)
    if q < 1 or world % q or world // q < 2:
        raise ShardplanError(f"{world} processes cannot form pipeline stages of {q} processes (at least 2 stages)")
    if machine is None:
        import torch

        from shardplan.machine import detect_machine
        from shardplan.torch.device import mesh_device_kind

        machine = detect_machine(mesh_device_kind("cuda" if torch.cuda.is_available() else "cpu"), world,
                                 processes=world)
    elif machine.num_devices != world:
        raise ShardplanError(f"machine has {machine.num_devices} devices but the process group has {world}")
    from shardplan.torch.device import dtensor_machine

    machine = dtensor_machine(machine)  # the collectives DTensor sends, not XLA's
    tracer = Tracer(module, example_inputs)
    result = None
    error: list[Any] = [None]
    if rank == 0:
        try:
            result = pipeline_solve(tracer, tracer.batch, machine, micro_batches=micro_batches, max_stages=max_stages,
                                    uniform=uniform or q > 1, interleave=interleave, schedules=schedules, budget=budget,
                                    periodic=periodic, sizes=(q,), cutoff=cutoff, **solve_options)
        except ShardplanError as e:
            error = [str(e)]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ShardplanError(error[0])
    layout = _broadcast_layout(result, rank)
    stage_layouts = _broadcast_stage_layouts(result, rank) if q > 1 else None
    return build_pipeline(result, layout, stage_layouts, tracer, module, schedule, reduction)


def plan_layout(plan: Any) -> tuple[dict, list[list[tuple[Any, Any]]]]:
    """What every rank needs of a :class:`shardplan.Plan` of stages: the stage map and, per stage, its
    operators' ``(dimension names, Layout, dealt)`` in order (the form :func:`pipeline` broadcasts; ``dealt``:
    :attr:`shardplan.result.OperatorChoice.dealt`, as the stage's tables charged it)."""
    layout = {"stages": [(s.first, s.end, s.offset, s.devices) for s in plan.stages],
              "micro_batches": plan.micro_batches, "schedule": plan.schedule, "chunks": plan.chunks,
              "units": None, "step_time": plan.step_time,
              "choices": [[(n, c.fp8, tuple(c.offload), c.recompute, c.state_stage) for n, c in s.operators.items()]
                          for s in plan.stages],
              "ring": (plan.stats.get("table_options") or {}).get("context") == "ring"}
    return layout, [[(c.layout.dims, c.layout, c.dealt) for c in s.operators.values()] for s in plan.stages]


def build_pipeline(result: Any, layout: dict, stage_layouts: Sequence[Sequence[tuple[Any, Any]]] | None,
                   tracer: "Tracer", module: Any, schedule: str | None = None,
                   reduction: str = "mean") -> TorchPipeline:
    """This rank's stages and schedule of a pipeline plan (``layout``: its stage map; ``stage_layouts``: per
    stage its operators' layouts, used when stages span several processes)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    from shardplan.pipeline.execute import StageSpec

    if reduction not in ("mean", "sum"):
        raise ShardplanError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    qs = {d for _, _, _, d in layout["stages"]}
    if len(qs) != 1:
        raise ShardplanError(f"stages of different sizes {sorted(qs)} cannot run on torch's pipelining")
    q = qs.pop()
    if sum(d for _, _, _, d in layout["stages"]) // max(1, int(layout["chunks"])) != world:
        raise ShardplanError(f"the plan's stages cover {sum(d for *_, d in layout['stages'])} devices, the "
                             f"process group has {world}")
    run_schedule = schedule or layout["schedule"]
    v = int(layout["chunks"])
    if run_schedule not in SCHEDULE_CLASSES or (v > 1) != (run_schedule == "interleaved"):
        raise ShardplanError(f"a plan with {v} chunk(s) per process cannot run the {run_schedule!r} schedule")
    m = int(layout["micro_batches"])
    if run_schedule == "1f1b" and m < len(layout["stages"]):
        raise ShardplanError(f"torch's Schedule1F1B needs at least as many micro-batches as stages; the plan has "
                             f"m={m} for {len(layout['stages'])} stages: offer larger micro_batches or run "
                             "schedule='gpipe'")
    graph, info, rename = tracer.traced(tracer.batch // m)
    choices = layout.get("choices") or [[] for _ in layout["stages"]]
    check_stage_choices(choices, q)
    n = len(layout["stages"])
    specs = [StageSpec(j, a, b, o, q, j % (n // v), j // (n // v)) for j, (a, b, o, q) in enumerate(layout["stages"])]
    first_name: dict[int, str] = {}
    canon = {t: first_name.setdefault(id(x), t) for t, x in module.named_parameters(remove_duplicate=False)}
    parts = [dataclasses.replace(p, params={ph: canon.get(t, t) for ph, t in p.params.items()})
             for p in partition(info.program, info.node_op, rename, graph, specs)]
    ep = info.program
    mine = [j for j, (_, _, o, d) in enumerate(layout["stages"]) if o <= rank < o + d]
    group, sub = None, None
    if q > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // q, q), mesh_dim_names=("pp", "m0"))
        group, sub = mesh["pp"].get_group(), mesh["m0"]
    modules, stages = [], []
    for j in mine:
        mod = _stage_module(parts[j], ep, module,
                            node_choices(choices[j], info, graph, rename) if q == 1 else None,
                            (info.node_op, frozenset(rename.get(c[0], c[0]) for c in choices[j] if c[3]))
                            if q == 1 else None,
                            _offloaded_placeholders(parts[j], ep, choices[j], info, rename) if q == 1 else frozenset())
        ins = _examples(ep, module, parts[j].inputs)
        outs = _examples(ep, module, parts[j].outputs)
        if sub is not None and stage_layouts is None:
            raise ShardplanError("stages of several processes need their layouts")
        run_mod = mod if sub is None else _dtensor_stage(mod, ins, stage_layouts[j], sub,  # type: ignore[index]
                                                         choices[j], bool(layout.get("ring")))
        if sub is None and any(c[1] for c in choices[j]):  # FP8 products: delayed scaling, as a ParallelModule
            from shardplan.torch.precision import DelayedScaling

            mod.scaling = DelayedScaling()
        stages.append(pp.PipelineStage(run_mod, j, n, torch.device("cpu"), input_args=ins,
                                       output_args=outs[0] if len(outs) == 1 else outs, group=group))
        zero1: frozenset[str] = frozenset()
        if sub is not None:  # the stage traced again: its operators are the plan's, in order
            ones = {op.name for op, c in zip(run_mod.graph.operators, choices[j]) if c[4] in (1, 2)}
            zero1 = frozenset(t for t, uses in run_mod.info.param_uses.items() if uses and uses[0][0] in ones)
            host = run_mod.host_state()
        else:
            host = _host_state(choices[j], info, rename, mod.keys, parts[j].params)
        modules.append(_Held(run_mod, mod.targets, zero1, host))
    cls = getattr(pp, SCHEDULE_CLASSES[run_schedule])
    kw = dict(n_microbatches=m, loss_fn=lambda out, _target: out, scale_grads=reduction == "mean")
    sched = cls(stages, **kw) if run_schedule in ("interleaved", "zb-h1") else cls(stages[0], **kw)
    counts: dict[str, int] = {}
    for p in parts:
        for t in set(p.params.values()):
            counts[t] = counts.get(t, 0) + 1
    named = dict(module.named_parameters(remove_duplicate=False))
    shared = {t: tuple(named[t].shape) for t in sorted(counts) if counts[t] > 1}
    if shared and q > 1:
        raise ShardplanError(f"parameters read by several stages ({', '.join(shared)}) are supported with one "
                             "process per stage only")
    return TorchPipeline(result, layout, parts, modules, stages, sched, reduction, rank,
                         int(layout["stages"][-1][2]), shared)
