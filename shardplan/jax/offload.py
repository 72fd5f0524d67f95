"""Host offload in the JAX step: optimizer state, parameters and activations in host memory.

A fit plan (:class:`shardplan.fit.MemoryChoices`) says per operator which
parts it keeps in host memory (``MemoryChoices.offload``: ``optimizer``,
``parameters``, ``activations``; their costs in ``docs/memory.md``). JAX
names memories by kind: each device has ``device`` memory and the host's
``pinned_host`` (page-locked, what the devices copy to and from directly);
a sharding with ``with_memory_kind("pinned_host")`` places every shard of an
array in the host memory of its device's host.

* **Activations** (:func:`shardplan.jax.memory.checkpointed_fn`): the values
  an offloading operator's backward keeps are named ``shardplan_offloaded``
  and the loss runs under ``jax.checkpoint`` with
  ``save_and_offload_only_these_names``: each goes to ``pinned_host`` in the
  forward pass and comes back for the backward (a ``device_put`` to
  ``MemorySpace.Host`` and one back to ``MemorySpace.Device`` in the step's
  jaxpr).
* **Optimizer state and parameters** (:class:`OffloadStep`): a parameter
  leaf follows its first reader's choice, as its ZeRO stage does
  (:func:`leaf_offloads`). Between steps its optimizer state (``optimizer``)
  and, with ``parameters``, the parameter shard itself live in
  ``pinned_host`` with their ZeRO shardings. A step fetches the offloaded
  parameter shards to device memory, runs the plan's step, fetches the
  offloaded state, applies the optimizer update on the state's shards, and
  puts the new state (and offloaded parameters) back in host memory.

What XLA's CPU backend does with this (JAX 0.9.2, 8 simulated devices):

* memory kinds exist (``jax.devices()[0].addressable_memories()``: ``device``,
  ``pinned_host``, ``unpinned_host``) and ``jax.device_put`` between them is a
  real copy into another buffer: the placements of :class:`OffloadStep` run;
* a placement *inside* a compiled program is refused: a ``jax.jit`` whose
  ``in_shardings`` / ``out_shardings`` name ``pinned_host``, or a
  ``jax.device_put`` to such a sharding inside the program, lowers to XLA's
  ``annotate_device_placement`` custom call, which the SPMD partitioner
  rejects ("Side-effect ops cannot be replicated", even for a sharding that
  tiles every device) and, on one device, the CPU runtime has no
  implementation of ("No registered implementation for untyped custom call
  to annotate_device_placement for Host"). So the state's copies are made
  between the programs, not inside one, as ZeRO-Offload's runtime does;
* an activation ``device_put`` to ``MemorySpace.Host`` (the checkpoint
  policy's) is lowered as the identity on CPU (JAX registers its memory
  lowering for TPU and GPU only): the jaxpr carries the copies, the
  compiled CPU program does not.

Where the cost model differs: ZeRO-Offload runs the optimizer step on the
CPU, moving the gradient down and the updated parameters up; this step
moves the state up, updates on the device and moves it back (JAX's
optimizer-state offload), so its copies are the state's, not the
gradient's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shardplan.errors import ShardplanError

__all__ = ["HOST", "host_memory_kind", "leaf_offloads", "OffloadStep", "offload_step"]

HOST = "pinned_host"
"""The memory kind offloaded arrays live in."""


def host_memory_kind(devices: Sequence[Any]) -> str:
    """:data:`HOST` when every device has it among its addressable memories; ShardplanError otherwise."""
    for d in devices:
        kinds = [m.kind for m in d.addressable_memories()]
        if HOST not in kinds:
            raise ShardplanError(f"device {d} has no {HOST} memory to offload to (its memories: {', '.join(kinds)})")
    return HOST


def leaf_offloads(plan: Any, info: Any) -> tuple[tuple[str, ...], ...]:
    """Per argument leaf, the parts its first reader offloads (``optimizer``, ``parameters``; data leaves and
    unread leaves: none). A parameter leaf follows the operator whose layout it already has, as its stage."""
    mc = getattr(plan, "memory_choices", None)
    index = plan.graph.index
    out = []
    for i in range(len(info.leaf_names)):
        uses = info.leaf_uses.get(i, ())
        parts: tuple[str, ...] = ()
        if mc is not None and i in info.param_leaves and uses:
            parts = tuple(p for p in mc.offload(index[uses[0][0]]) if p != "activations")
        out.append(parts)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class OffloadStep:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` with offloaded state (see the module).

    Attributes:
        fit: the plan's :class:`~shardplan.jax.memory.FitStep` (its ``step`` computes loss and gradients).
        optimizer: the optax optimizer.
        host_params, host_state: per parameter leaf, whether the parameter / its optimizer state lives in
            host memory between steps.
        param_homes, state_homes: shardings of the parameters and of the optimizer state between steps
            (``pinned_host`` for the offloaded ones).
        update: jitted ``update(params, opt_state, grads) -> (params, opt_state)`` on device memory.
    """

    fit: Any
    optimizer: Any
    host_params: tuple[bool, ...]
    host_state: tuple[bool, ...]
    param_homes: Any
    state_homes: Any
    state_device: Any
    update: Callable[..., Any]

    def init(self, params: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` placed where they live between steps (the optimizer's state alone: a plan with
        FP8 products adds its amax histories, :meth:`shardplan.jax.memory.FitStep.init`)."""
        import jax

        params = jax.device_put(params, self.fit.param_shardings)
        state = jax.jit(self.optimizer.init, out_shardings=self.state_device)(params)
        return jax.device_put(params, self.param_homes), jax.device_put(state, self.state_homes)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        import jax

        p = jax.device_put(params, self.fit.param_shardings)  # offloaded parameter shards fetched
        if self.fit.fp8_names:  # FP8 products: delayed scaling, the amax histories carried beside the state
            from shardplan.jax.fp8 import Fp8TrainState

            loss, grads, history = self.fit.fp8_step(p, batch, opt_state.history)
            opt_state = opt_state.opt_state
        else:
            loss, grads = self.fit.step(p, batch)
        grads = jax.device_put(grads, self.fit.grad_shardings)  # (the step's jit may leave their placement free)
        state = jax.device_put(opt_state, self.state_device)  # offloaded optimizer state fetched
        p, state = self.update(p, state, grads)
        state = jax.device_put(state, self.state_homes)
        if self.fit.fp8_names:
            state = Fp8TrainState(state, history)
        return jax.device_put(p, self.param_homes), state, loss


def offload_step(fit: Any, optimizer: Any, params: Any) -> OffloadStep:
    """The :class:`OffloadStep` of ``fit`` (a :class:`~shardplan.jax.memory.FitStep`) with an optax
    ``optimizer``; ``params`` gives the shapes. The update is that of ``FitStep.train_step``: on the
    optimizer state's shards, the new parameters in their own shardings."""
    import jax
    import optax

    devices = list(fit.devices)
    host_memory_kind(devices)
    parts = leaf_offloads(fit.plan, fit.info)
    leaves, tree = jax.tree_util.tree_flatten(params)
    n = len(leaves)
    host_p = tuple("parameters" in parts[i] for i in range(n))
    host_s = tuple("optimizer" in parts[i] for i in range(n))
    on_host = lambda s, h: s.with_memory_kind(HOST) if h else s  # noqa: E731
    param_homes = jax.tree_util.tree_map(on_host, fit.param_shardings, jax.tree_util.tree_unflatten(tree, host_p))
    state_device = fit.opt_state_shardings(optimizer, params)
    shapes = jax.eval_shape(optimizer.init, params)
    from shardplan.jax.shardings import replicated

    rep = replicated(devices)
    state_homes = optax.tree_map_params(optimizer, lambda _, s, h: on_host(s, h), shapes, fit.state_shardings,
                                        jax.tree_util.tree_unflatten(tree, host_s), transform_non_params=lambda _: rep)
    state_sh, param_sh = fit.state_shardings, fit.param_shardings

    def update(p: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
        grads = jax.lax.with_sharding_constraint(grads, state_sh)
        p_sh = jax.lax.with_sharding_constraint(p, state_sh)
        updates, opt_state = optimizer.update(grads, opt_state, p_sh)
        return optax.apply_updates(p_sh, updates), opt_state

    jitted = jax.jit(update, in_shardings=(param_sh, state_device, fit.grad_shardings),
                     out_shardings=(param_sh, state_device))
    return OffloadStep(fit, optimizer, host_p, host_s, param_homes, state_homes, state_device, jitted)
