"""Inception-v3 (Szegedy et al. 2016) at layer granularity, 299 x 299 inputs.

Every convolution is a conv vertex plus a batch-norm vertex (ReLU fused);
pools and concatenations are vertices; the final global average pool is
one ``reduce_mean``. Module layout (torchvision / TF-slim naming):

* ``stem``: 5 convolutions, 2 max pools (299 -> 35 x 35 x 192);
* ``A1..A3`` (Mixed_5b-d): 1x1, 5x5, double 3x3 and pool branches;
* ``B`` (Mixed_6a): grid reduction to 17 x 17 x 768;
* ``C1..C4`` (Mixed_6b-e): factorised 1x7 / 7x1 branches;
* ``D`` (Mixed_7a): grid reduction to 8 x 8 x 1280;
* ``E1, E2`` (Mixed_7b-c): 1x3 / 3x1 split branches joined by inner
  concatenations, 8 x 8 x 2048;
* ``avgpool``, ``fc``, ``softmax``.

94 convolutions, 94 batch norms, 13 pools, 15 concatenations and the 3
classifier vertices: 219 vertices, against 218 in the paper (which does not
list its exact layer split). Vertex names are ``module/layer`` so that
reports can group by module.
"""

from __future__ import annotations

from typing import Sequence

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder, TensorRef
from shardplan.models._blocks import conv_bn

__all__ = ["inception_v3"]


def _cbn(b: GraphBuilder, name: str, x: TensorRef, ch: int, k: int | Sequence[int], s: int = 1,
         pad: int | Sequence[int] = 0) -> TensorRef:
    return conv_bn(b, name, x, ch, k, s, pad, bn_name=f"{name}_bn")


def _module_a(b: GraphBuilder, m: str, x: TensorRef, pool_features: int) -> TensorRef:
    b1 = _cbn(b, f"{m}/branch1x1", x, 64, 1)
    b5 = _cbn(b, f"{m}/branch5x5_1", x, 48, 1)
    b5 = _cbn(b, f"{m}/branch5x5_2", b5, 64, 5, pad=2)
    b3 = _cbn(b, f"{m}/branch3x3dbl_1", x, 64, 1)
    b3 = _cbn(b, f"{m}/branch3x3dbl_2", b3, 96, 3, pad=1)
    b3 = _cbn(b, f"{m}/branch3x3dbl_3", b3, 96, 3, pad=1)
    bp = b.add(ops.pool2d(f"{m}/pool", x, 3, 1, 1, mode="avg"))
    bp = _cbn(b, f"{m}/branch_pool", bp, pool_features, 1)
    return b.add(ops.concat(f"{m}/concat", [b1, b5, b3, bp], axis=1))


def _module_b(b: GraphBuilder, m: str, x: TensorRef) -> TensorRef:
    b3 = _cbn(b, f"{m}/branch3x3", x, 384, 3, 2)
    bd = _cbn(b, f"{m}/branch3x3dbl_1", x, 64, 1)
    bd = _cbn(b, f"{m}/branch3x3dbl_2", bd, 96, 3, pad=1)
    bd = _cbn(b, f"{m}/branch3x3dbl_3", bd, 96, 3, 2)
    bp = b.add(ops.pool2d(f"{m}/pool", x, 3, 2, mode="max"))
    return b.add(ops.concat(f"{m}/concat", [b3, bd, bp], axis=1))


def _module_c(b: GraphBuilder, m: str, x: TensorRef, c7: int) -> TensorRef:
    b1 = _cbn(b, f"{m}/branch1x1", x, 192, 1)
    b7 = _cbn(b, f"{m}/branch7x7_1", x, c7, 1)
    b7 = _cbn(b, f"{m}/branch7x7_2", b7, c7, (1, 7), pad=(0, 3))
    b7 = _cbn(b, f"{m}/branch7x7_3", b7, 192, (7, 1), pad=(3, 0))
    bd = _cbn(b, f"{m}/branch7x7dbl_1", x, c7, 1)
    bd = _cbn(b, f"{m}/branch7x7dbl_2", bd, c7, (7, 1), pad=(3, 0))
    bd = _cbn(b, f"{m}/branch7x7dbl_3", bd, c7, (1, 7), pad=(0, 3))
    bd = _cbn(b, f"{m}/branch7x7dbl_4", bd, c7, (7, 1), pad=(3, 0))
    bd = _cbn(b, f"{m}/branch7x7dbl_5", bd, 192, (1, 7), pad=(0, 3))
    bp = b.add(ops.pool2d(f"{m}/pool", x, 3, 1, 1, mode="avg"))
    bp = _cbn(b, f"{m}/branch_pool", bp, 192, 1)
    return b.add(ops.concat(f"{m}/concat", [b1, b7, bd, bp], axis=1))


def _module_d(b: GraphBuilder, m: str, x: TensorRef) -> TensorRef:
    b3 = _cbn(b, f"{m}/branch3x3_1", x, 192, 1)
    b3 = _cbn(b, f"{m}/branch3x3_2", b3, 320, 3, 2)
    b7 = _cbn(b, f"{m}/branch7x7x3_1", x, 192, 1)
    b7 = _cbn(b, f"{m}/branch7x7x3_2", b7, 192, (1, 7), pad=(0, 3))
    b7 = _cbn(b, f"{m}/branch7x7x3_3", b7, 192, (7, 1), pad=(3, 0))
    b7 = _cbn(b, f"{m}/branch7x7x3_4", b7, 192, 3, 2)
    bp = b.add(ops.pool2d(f"{m}/pool", x, 3, 2, mode="max"))
    return b.add(ops.concat(f"{m}/concat", [b3, b7, bp], axis=1))


def _module_e(b: GraphBuilder, m: str, x: TensorRef) -> TensorRef:
    b1 = _cbn(b, f"{m}/branch1x1", x, 320, 1)
    b3 = _cbn(b, f"{m}/branch3x3_1", x, 384, 1)
    b3a = _cbn(b, f"{m}/branch3x3_2a", b3, 384, (1, 3), pad=(0, 1))
    b3b = _cbn(b, f"{m}/branch3x3_2b", b3, 384, (3, 1), pad=(1, 0))
    b3 = b.add(ops.concat(f"{m}/branch3x3_concat", [b3a, b3b], axis=1))
    bd = _cbn(b, f"{m}/branch3x3dbl_1", x, 448, 1)
    bd = _cbn(b, f"{m}/branch3x3dbl_2", bd, 384, 3, pad=1)
    bda = _cbn(b, f"{m}/branch3x3dbl_3a", bd, 384, (1, 3), pad=(0, 1))
    bdb = _cbn(b, f"{m}/branch3x3dbl_3b", bd, 384, (3, 1), pad=(1, 0))
    bd = b.add(ops.concat(f"{m}/branch3x3dbl_concat", [bda, bdb], axis=1))
    bp = b.add(ops.pool2d(f"{m}/pool", x, 3, 1, 1, mode="avg"))
    bp = _cbn(b, f"{m}/branch_pool", bp, 192, 1)
    return b.add(ops.concat(f"{m}/concat", [b1, b3, bd, bp], axis=1))


def inception_v3(batch: int = 128, image: int = 299, classes: int = 1000) -> Graph:
    """Inception-v3 on ``batch`` images of ``image`` x ``image`` pixels (219 vertices)."""
    b = GraphBuilder("inception_v3")
    x = b.input("images", (batch, 3, image, image))
    labels = b.input("labels", (batch,))
    h = _cbn(b, "stem/conv1a_3x3", x, 32, 3, 2)
    h = _cbn(b, "stem/conv2a_3x3", h, 32, 3)
    h = _cbn(b, "stem/conv2b_3x3", h, 64, 3, pad=1)
    h = b.add(ops.pool2d("stem/pool1", h, 3, 2))
    h = _cbn(b, "stem/conv3b_1x1", h, 80, 1)
    h = _cbn(b, "stem/conv4a_3x3", h, 192, 3)
    h = b.add(ops.pool2d("stem/pool2", h, 3, 2))
    for i, pf in enumerate((32, 64, 64), 1):
        h = _module_a(b, f"A{i}", h, pf)
    h = _module_b(b, "B", h)
    for i, c7 in enumerate((128, 160, 160, 192), 1):
        h = _module_c(b, f"C{i}", h, c7)
    h = _module_d(b, "D", h)
    for i in (1, 2):
        h = _module_e(b, f"E{i}", h)
    h = b.add(ops.reduce_mean("avgpool", h, (2, 3)))
    h = b.add(ops.dense("fc", h, classes))
    b.add(ops.softmax_cross_entropy("softmax", h, labels))
    return b.build()
