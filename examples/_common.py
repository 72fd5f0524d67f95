"""What the JAX examples share: the toy machine and one ``main``.

The examples' sizes make communication dominate on the reference machine
(10 TFLOP/s, 16 GB/s); a machine with a lower FLOP-to-byte balance
(2 FLOP per byte) makes splitting them pay.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from typing import Any, Callable  # noqa: E402


def toy_machine() -> Any:
    """8 devices at 32 GFLOP/s and 16 GB/s."""
    from shardplan.machine import Machine

    return Machine(8, peak_flops=32e9, bandwidth=16e9, name="toy")


def run_example(loss_fn: Callable[..., Any], init_params: Callable[[Any], Any], make_batch: Callable[[Any], Any],
                ) -> None:
    """Plan ``loss_fn`` on 8 devices, run one step, print the plan and the loss against the unsharded one."""
    import jax

    import shardplan.jax as sj

    params, batch = init_params(jax.random.PRNGKey(0)), make_batch(jax.random.PRNGKey(1))
    plan, step = sj.parallelize(loss_fn, params, batch, machine=toy_machine())
    loss, _ = step(params, batch)
    print(sj.report(plan))
    print(f"loss {float(loss):.6f} (unsharded {float(loss_fn(params, batch)):.6f})")
