"""DenseNet-121 (Huang et al. 2017): dense blocks [6, 12, 24, 16], growth 32, compression 0.5.

Each dense layer is BN (+ReLU) -> 1x1 conv (4 x growth) -> BN (+ReLU) -> 3x3
conv (growth), and its output is concatenated to the block's features.
Two equivalent graph forms:

* ``connectivity="running"`` (default): each layer ends with
  ``concat(previous features, new features)``; the next layer reads that
  running concatenation. The tensors are exactly the framework's, and the
  graph stays sparse (5 vertices per layer, bounded degree).
* ``connectivity="dense"``: each layer's concatenation reads the block input
  and every earlier layer's new features directly, the textbook picture
  and the paper's "uniformly dense" limit case, where every elimination
  order keeps large dependent sets.

Transitions: BN -> 1x1 conv (halve channels) -> 2 x 2 average pool. Stem:
7x7/2 conv, BN, 3x3/2 max pool. Head: final BN, global average pool,
``fc``, ``softmax``. Names: ``stem/...``, ``D{block}.{layer}/...``,
``T{block}/...``.
"""

from __future__ import annotations

from typing import Sequence

from shardplan import ops
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, GraphBuilder, TensorRef

__all__ = ["densenet", "densenet121"]


def _dense_block(b: GraphBuilder, blk: int, x: TensorRef, n: int, growth: int, dense: bool) -> TensorRef:
    feats = x
    new: list[TensorRef] = []
    for j in range(1, n + 1):
        m = f"D{blk}.{j}"
        h = b.add(ops.batch_norm(f"{m}/bn1", feats))
        h = b.add(ops.conv2d(f"{m}/conv1", h, 4 * growth, 1))
        h = b.add(ops.batch_norm(f"{m}/bn2", h))
        h = b.add(ops.conv2d(f"{m}/conv2", h, growth, 3, 1, 1))
        new.append(h)
        parts = [x, *new] if dense else [feats, h]
        feats = b.add(ops.concat(f"{m}/concat", parts, axis=1))
    return feats


def densenet(blocks: Sequence[int], batch: int = 128, image: int = 224, classes: int = 1000, growth: int = 32,
             connectivity: str = "running", name: str = "densenet") -> Graph:
    """A DenseNet-BC with ``blocks[i]`` layers in dense block i+1."""
    if connectivity not in ("running", "dense"):
        raise ShardplanError(f"densenet: connectivity must be 'running' or 'dense', got {connectivity!r}")
    b = GraphBuilder(name)
    x = b.input("images", (batch, 3, image, image))
    labels = b.input("labels", (batch,))
    h = b.add(ops.conv2d("stem/conv", x, 2 * growth, 7, 2, 3))
    h = b.add(ops.batch_norm("stem/bn", h))
    h = b.add(ops.pool2d("stem/pool", h, 3, 2, 1))
    for i, n in enumerate(blocks, 1):
        h = _dense_block(b, i, h, n, growth, connectivity == "dense")
        if i < len(blocks):
            t = f"T{i}"
            h = b.add(ops.batch_norm(f"{t}/bn", h))
            h = b.add(ops.conv2d(f"{t}/conv", h, h.shape[1] // 2, 1))
            h = b.add(ops.pool2d(f"{t}/pool", h, 2, 2, mode="avg"))
    h = b.add(ops.batch_norm("final_bn", h))
    h = b.add(ops.reduce_mean("avgpool", h, (2, 3)))
    h = b.add(ops.dense("fc", h, classes))
    b.add(ops.softmax_cross_entropy("softmax", h, labels))
    return b.build()


def densenet121(batch: int = 128, image: int = 224, classes: int = 1000, connectivity: str = "running") -> Graph:
    """DenseNet-121: blocks [6, 12, 24, 16], growth 32."""
    return densenet((6, 12, 24, 16), batch, image, classes, 32, connectivity, name="densenet121")
