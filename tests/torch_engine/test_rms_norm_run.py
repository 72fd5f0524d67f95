"""``rms_norm`` in the PyTorch run (:func:`shardplan.torch.run._rms_norm`): out of place where a mesh axis splits
a normalised dim, PyTorch's own elsewhere; both equal to ``torch.nn.functional.rms_norm``, values and gradients.
One process, a mesh of one device (the rewrite's path is taken on the placements alone)."""

from __future__ import annotations

import os
import socket

import pytest

import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # no test initialises a process group in the pytest process (the gloo launches run in their own processes)
    assert not dist.is_initialized(), "a process group is already initialised in this process"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 2])  # the batch (PyTorch's own rms_norm) or the normalised features
def test_rms_norm_runs_as_pytorchs_with_its_features_split(mesh, dtype, dim):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from shardplan.torch.run import _rms_norm

    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, dtype=dtype, requires_grad=True)
    w = torch.randn(8, dtype=dtype, requires_grad=True)
    want = F.rms_norm(x, (8,), w)
    want.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    xd = DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
    wd = DTensor.from_local(w, mesh, [Shard(0) if dim == 2 else Replicate()], run_check=False)
    got = _rms_norm(xd, [8], wd)
    got.full_tensor().sum().backward()
    assert got.full_tensor().dtype == dtype
    assert torch.equal(got.full_tensor(), want)  # the composite's arithmetic, in its order and types
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # backward: autograd of the same ops, summed in another order
    assert torch.allclose(x.grad.float(), gx.float(), atol=tol, rtol=tol)
    assert torch.allclose(w.grad.float(), gw.float(), atol=tol, rtol=tol)


def test_a_plain_tensor_takes_pytorchs_rms_norm():
    from shardplan.torch.run import _rms_norm

    x = torch.randn(2, 5, 6)
    assert torch.equal(_rms_norm(x, [6], None, 1e-5), F.rms_norm(x, (6,), None, 1e-5))
