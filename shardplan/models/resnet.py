"""ResNet-101 (He et al. 2016): bottleneck blocks [3, 4, 23, 3] with projection shortcuts.

Every convolution is followed by a batch norm vertex (ReLU fused into it);
each block ends with the residual add (ReLU fused). The stride of a
down-sampling block sits on its 3x3 convolution (the common "v1.5"
placement). Global average pooling is one ``reduce_mean`` over the
spatial axes, giving (batch, 2048) directly to the classifier.

Names: ``stem/conv``, ``stem/bn``, ``stem/pool``; block j of stage s is
module ``res{s}.{j}`` (s = 2..5 as in the paper's conv2_x..conv5_x) with
vertices ``conv1, bn1, conv2, bn2, conv3, bn3, proj, proj_bn, add``;
then ``avgpool``, ``fc``, ``softmax``.
"""

from __future__ import annotations

from typing import Sequence

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder, TensorRef
from shardplan.models._blocks import conv_bn

__all__ = ["resnet", "resnet101", "resnet50"]


def _bottleneck(b: GraphBuilder, mod: str, x: TensorRef, width: int, stride: int) -> TensorRef:
    out_ch = 4 * width
    h = conv_bn(b, f"{mod}/conv1", x, width, 1, bn_name=f"{mod}/bn1")
    h = conv_bn(b, f"{mod}/conv2", h, width, 3, stride, 1, bn_name=f"{mod}/bn2")
    h = conv_bn(b, f"{mod}/conv3", h, out_ch, 1, bn_name=f"{mod}/bn3")
    short = x
    if stride != 1 or x.shape[1] != out_ch:
        short = conv_bn(b, f"{mod}/proj", x, out_ch, 1, stride, bn_name=f"{mod}/proj_bn")
    return b.add(ops.elementwise(f"{mod}/add", short, h, kind="add", letters="bchw"))


def resnet(blocks: Sequence[int], batch: int = 128, image: int = 224, classes: int = 1000,
           name: str = "resnet") -> Graph:
    """A bottleneck ResNet with ``blocks[i]`` blocks in stage i+2."""
    b = GraphBuilder(name)
    x = b.input("images", (batch, 3, image, image))
    labels = b.input("labels", (batch,))
    h = conv_bn(b, "stem/conv", x, 64, 7, 2, 3, bn_name="stem/bn")
    h = b.add(ops.pool2d("stem/pool", h, 3, 2, 1))
    for s, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
        for j in range(n):
            stride = 2 if (j == 0 and s > 0) else 1
            h = _bottleneck(b, f"res{s + 2}.{j}", h, width, stride)
    h = b.add(ops.reduce_mean("avgpool", h, (2, 3)))
    h = b.add(ops.dense("fc", h, classes))
    b.add(ops.softmax_cross_entropy("softmax", h, labels))
    return b.build()


def resnet101(batch: int = 128, image: int = 224, classes: int = 1000) -> Graph:
    """ResNet-101: blocks [3, 4, 23, 3]."""
    return resnet((3, 4, 23, 3), batch, image, classes, name="resnet101")


def resnet50(batch: int = 128, image: int = 224, classes: int = 1000) -> Graph:
    """ResNet-50: blocks [3, 4, 6, 3]."""
    return resnet((3, 4, 6, 3), batch, image, classes, name="resnet50")
