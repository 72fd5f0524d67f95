"""The machine a PyTorch device mesh runs on, detected from its devices.

``mesh_machine(mesh)`` reads the mesh's device type and size and, for CUDA,
the device's name (``torch.cuda.get_device_name()``), and returns
:func:`shardplan.machine.detect_machine`'s machine for them: the CPU profile
for a ``"cpu"`` mesh, the matching GPU profile for a ``"cuda"`` one.

Nodes: torch.distributed runs one process per device, so the processes do
not tell where nodes end; torchrun's ``LOCAL_WORLD_SIZE`` (processes on this
node) does, and is the node size when set. Without it the profile's node
size stands (8 for the A100 and H100 boards). The mesh's shape is reported in
the machine's name, never read as a node boundary: which mesh dimension (if
any) follows the nodes is the user's choice.
"""

from __future__ import annotations

import os
from dataclasses import replace
from collections.abc import Mapping
from typing import Any

from shardplan.checks import integer
from shardplan.errors import ShardplanError
from shardplan.machine import Machine, detect_machine

__all__ = ["mesh_machine", "mesh_device_kind", "local_world_size", "dtensor_machine"]


def dtensor_machine(machine: Machine) -> Machine:
    """``machine`` charging the collectives the DTensor run sends (:mod:`shardplan.torch.run`):

    * ``stepwise_redistribution`` off: DTensor's ``redistribute`` goes its own way, not in the one-collective
      steps XLA's partitioner lowers to, so a change of layout is charged what each device lacks;
    * ``reduce_per_dim`` on: a partial sum over several split dims is one all-reduce per dim among that dim's
      devices, a dim split over several mesh axes one all-reduce among all of them (the run reduces a
      ``Partial`` one dim at a time, over each dim's flattened mesh axes: :func:`shardplan.torch.run.reduce_steps`,
      :func:`shardplan.torch.run.flat_groups`);
    * ``scatter_gathered_grads`` on: the keys' and values' gradients of an all-gathered attention go home by
      DTensor's ``Partial -> Shard`` reduce-scatter where their producer scatters them: causal, dealt or not,
      and not causal (an encoder's); and so does every other activation's gradient summed over split dims
      whose producer scatters the consumer's tile over the summing devices (:mod:`shardplan.cost.grad_home`).

    An activation's gradient summed over several split dims is reduced one dim at a time too (the run's hook
    before DTensor's redistribution: :func:`shardplan.torch.run.summed_dims`).

    Measured on 4 gloo processes (every collective recorded): docs/torch.md, "What DTensor sends for partial
    sums" (``tests/torch_engine/test_dtensor_reductions.py``).
    """
    return replace(machine, stepwise_redistribution=False, reduce_per_dim=True, scatter_gathered_grads=True)


def local_world_size(environ: Mapping[str, str]) -> int | None:
    """Processes on this node as torchrun states it (``LOCAL_WORLD_SIZE``), or None when unset."""
    text = environ.get("LOCAL_WORLD_SIZE")
    if text is None or not text.strip():
        return None
    try:
        n = int(text)
    except ValueError:
        raise ShardplanError(f"LOCAL_WORLD_SIZE must be a whole number, got {text!r}") from None
    return integer("LOCAL_WORLD_SIZE", n, minimum=1)


def mesh_device_kind(device_type: str, device_name: str | None = None) -> str:
    """The device kind to detect: ``device_name`` when given; for ``"cuda"`` the current device's name
    (``torch.cuda.get_device_name()``); ``"cpu"`` for a CPU mesh. Other device types have no profile."""
    if device_name is not None:
        return device_name
    if device_type == "cpu":
        return "cpu"
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ShardplanError("a cuda device mesh, but torch.cuda is not available: pass machine= or device_name=")
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    raise ShardplanError(f"no machine profile for device type {device_type!r}: pass machine=preset(...) or "
                         f"machine=Machine.from_file(...)")


def mesh_machine(mesh: Any, *, device_name: str | None = None, node_size: int | None = None,
                 environ: Mapping[str, str] | None = None) -> Machine:
    """The machine of ``mesh`` (a ``torch.distributed.device_mesh.DeviceMesh``): p = the mesh's size,
    one process per device, nodes of ``node_size`` (default ``LOCAL_WORLD_SIZE`` from ``environ``,
    default ``os.environ``; else the profile's); ``device_name`` replaces the name read from CUDA."""
    device_type = str(getattr(mesh, "device_type", "cpu"))
    shape = tuple(int(n) for n in mesh.mesh.shape)
    p = int(mesh.mesh.numel())
    kind = mesh_device_kind(device_type, device_name)
    if node_size is None:
        local = local_world_size(os.environ if environ is None else environ)
        node_size = local if local is not None and local < p and p % local == 0 else None
    m = detect_machine(kind, p, processes=p, node_size=node_size)
    return replace(m, name=f"{m.name} on mesh {'x'.join(map(str, shape))}")
