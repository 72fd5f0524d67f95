"""AlexNet (Krizhevsky et al. 2012, the single-tower variant of "one weird trick", 2014).

Five convolutions (ReLU fused), three max pools, a flatten to 256*6*6 =
9216 features, three fully connected layers 4096 / 4096 / 1000 and the
softmax cross-entropy: a path of 13 vertices. Layer names (conv1..conv5,
fc1..fc3, softmax) match the paper's Table II.
"""

from __future__ import annotations

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder

__all__ = ["alexnet"]


def alexnet(batch: int = 128, image: int = 224, classes: int = 1000) -> Graph:
    """AlexNet on ``batch`` images of ``image`` x ``image`` pixels."""
    b = GraphBuilder("alexnet")
    x = b.input("images", (batch, 3, image, image))
    labels = b.input("labels", (batch,))
    h = b.add(ops.conv2d("conv1", x, 64, 11, 4, 2))
    h = b.add(ops.pool2d("pool1", h, 3, 2))
    h = b.add(ops.conv2d("conv2", h, 192, 5, 1, 2))
    h = b.add(ops.pool2d("pool2", h, 3, 2))
    h = b.add(ops.conv2d("conv3", h, 384, 3, 1, 1))
    h = b.add(ops.conv2d("conv4", h, 256, 3, 1, 1))
    h = b.add(ops.conv2d("conv5", h, 256, 3, 1, 1))
    h = b.add(ops.pool2d("pool5", h, 3, 2))
    h = b.add(ops.flatten("flatten", h))
    h = b.add(ops.dense("fc1", h, 4096))
    h = b.add(ops.dense("fc2", h, 4096))
    h = b.add(ops.dense("fc3", h, classes))
    b.add(ops.softmax_cross_entropy("softmax", h, labels))
    return b.build()
