"""The pipelined toy of the JAX stage-runner tests: four scoped tanh layers, the pipeline search's plan on sub-meshes
of 4 of the 8 simulated devices (two stages of two layers, m = 2), and plans edited with per-operator choices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from shardplan.machine import Machine

MACHINE = Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy-fp8-host", fp8_flops=64e9, hbm_bandwidth=1e11,
                  host_bandwidth=4e9, host_memory_bytes=1e10, cpu_adam_rate=1e9)
B, D = 32, 16


def scoped(p, batch):
    x, y = batch
    for i, w in enumerate(p["w"]):
        with jax.named_scope(f"L{i}"):
            x = jnp.tanh(x @ w)
    return jnp.mean((x - y) ** 2)


def model():
    ks = jax.random.split(jax.random.PRNGKey(2), 6)
    params = {"w": [jax.random.normal(k, (D, D)) / D**0.5 for k in ks[:4]]}
    batch = (jax.random.normal(ks[4], (B, D)), jax.random.normal(ks[5], (B, D)))
    return params, batch


def searched_plan(params, batch):
    """The pipeline search's plan of :func:`scoped`: two stages of two layers on 4 devices each, m = 2."""
    from shardplan.jax.staged import Tracer, batch_size
    from shardplan.pipeline.api import pipeline_solve
    from shardplan.planner import from_pipeline

    tracer = Tracer(scoped, params, batch)
    plan = from_pipeline(pipeline_solve(tracer, batch_size(tracer.full_info), MACHINE, micro_batches=(2,),
                                        sizes=(4,), cutoff=1))
    assert plan.num_stages == 2 and plan.micro_batches == 2
    assert [sorted(s.operators)[:2] for s in plan.stages] == [["L0/dot_general", "L1/dot_general"],
                                                              ["L2/dot_general", "L3/dot_general"]]
    return plan


def with_choices(plan, edits, listed=True, offload=("activations",)):
    """``plan`` with the per-operator choices ``edits`` (operator -> fields of its OperatorChoice), as a plan
    loaded from JSON: no search answer attached, every stage rebuilt with its memory choices (``listed``), host
    offload of the parts ``offload`` offered."""
    stages = tuple(dataclasses.replace(s, operators={n: dataclasses.replace(c, **edits.get(n, {}))
                                                     for n, c in s.operators.items()}) for s in plan.stages)
    stats = {**plan.stats, "memory_choice_stages": list(range(len(stages))) if listed else [],
             "memory_rules": {"fp8_offered": True, "offload_offered": list(offload)}}
    return dataclasses.replace(plan, stages=stages, stats=stats, detail=None)
