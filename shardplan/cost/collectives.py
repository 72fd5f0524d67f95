"""Collectives in the alpha-beta model, vectorised over configurations.

For n bytes among g devices over links of bandwidth B and latency alpha:

* all-reduce (ring):           2 (g-1)/g * n / B + 2 (g-1) alpha
* all-gather / reduce-scatter: (g-1)/g * n / B + (g-1) alpha
* point-to-point of n bytes:   n / B + alpha    (alpha only when n > 0)

With alpha = 0 this is the reference model, which counts bandwidth only.
Every function takes arrays (one entry per configuration) and a boolean
``inter`` array saying whether the group crosses a node boundary (then
the inter-node link is the ring's bottleneck).
"""

from __future__ import annotations

import numpy as np

from shardplan.machine import Machine

__all__ = ["link_arrays", "allreduce_time", "allgather_time", "p2p_time", "group_crosses_nodes"]


def link_arrays(machine: Machine, inter: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth and latency arrays matching ``inter``."""
    b_in, a_in = machine.link(False)
    b_out, a_out = machine.link(True)
    inter = np.asarray(inter, dtype=bool)
    return np.where(inter, b_out, b_in), np.where(inter, a_out, a_in)


def allreduce_time(nbytes: np.ndarray, g: np.ndarray, machine: Machine, inter: np.ndarray) -> np.ndarray:
    """Ring all-reduce of ``nbytes`` among ``g`` devices (0 when g == 1)."""
    g = np.asarray(g, dtype=np.float64)
    bw, lat = link_arrays(machine, inter)
    t = 2.0 * (g - 1.0) / g * np.asarray(nbytes, dtype=np.float64) / bw + 2.0 * (g - 1.0) * lat
    return np.where(g > 1, t, 0.0)


def allgather_time(nbytes: np.ndarray, g: np.ndarray, machine: Machine, inter: np.ndarray) -> np.ndarray:
    """Ring all-gather (or reduce-scatter) whose full result is ``nbytes``, among ``g`` devices."""
    g = np.asarray(g, dtype=np.float64)
    bw, lat = link_arrays(machine, inter)
    t = (g - 1.0) / g * np.asarray(nbytes, dtype=np.float64) / bw + (g - 1.0) * lat
    return np.where(g > 1, t, 0.0)


def p2p_time(nbytes: np.ndarray, machine: Machine, inter: np.ndarray) -> np.ndarray:
    """Point-to-point (or all-to-all) of ``nbytes`` per device."""
    nbytes = np.asarray(nbytes, dtype=np.float64)
    bw, lat = link_arrays(machine, inter)
    return np.where(nbytes > 0, nbytes / bw + lat, 0.0)


def group_crosses_nodes(configs: np.ndarray, coords: np.ndarray, active: np.ndarray, group_axes: list[int],
                        machine: Machine) -> np.ndarray:
    """Whether, under each configuration, some group spans more than one node.

    A group is the set of devices of one replica whose grid coordinates
    agree on every axis outside ``group_axes``. Returns a bool array (K,). On a one-level
    machine, always False.
    """
    k, p, n = coords.shape
    if not machine.hierarchical or not group_axes:
        return np.zeros(k, dtype=bool)
    node = np.arange(p, dtype=np.int64) // int(machine.node_size)  # type: ignore[arg-type]
    n_nodes = int(node[-1]) + 1
    other = [j for j in range(n) if j not in group_axes]
    q = np.arange(p, dtype=np.int64)
    key = q[None, :] // configs.prod(axis=1)[:, None]  # replica index: each replica has its own groups
    for j in other:
        key = key * (int(configs[:, j].max()) + 1) + coords[:, :, j]
    big = int(key.max(initial=0)) + 1
    key = np.where(active, key, big + q)
    pair = key * n_nodes + np.where(active, node[None, :], 0)

    def distinct(a: np.ndarray) -> np.ndarray:
        s = np.sort(a, axis=1)
        return 1 + (np.diff(s, axis=1) != 0).sum(axis=1)

    return distinct(pair) != distinct(key)
