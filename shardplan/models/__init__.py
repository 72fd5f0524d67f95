"""The model zoo: computation graphs of the paper's benchmarks and a few more.

Each builder is a function of the batch size (and of the model's sizes where
they vary) returning a validated :class:`~shardplan.ir.Graph`. The registry
:data:`MODELS` maps a name to its builder, default batch, the recommended
cutoff (4 for CNNs as in the paper; 1 for the sequence models so that layers
and heads can be split) and the expert strategy it is compared against
(a key of :data:`shardplan.baselines.BASELINES`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from shardplan.checks import MAX_EXTENT, integer
from shardplan.errors import ShardplanError
from shardplan.ir import Graph
from shardplan.models.alexnet import alexnet
from shardplan.models.densenet import densenet121
from shardplan.models.gpt import GPT_SIZES, gpt
from shardplan.models.inception import inception_v3
from shardplan.models.resnet import resnet50, resnet101
from shardplan.models.rnnlm import rnnlm
from shardplan.models.transformer import transformer, transformer_big

__all__ = ["ModelSpec", "MODELS", "get_model", "model_spec", "models_table",
           "alexnet", "resnet101", "resnet50", "inception_v3", "rnnlm", "transformer", "transformer_big",
           "densenet121", "gpt", "GPT_SIZES"]


@dataclass(frozen=True)
class ModelSpec:
    """A registered model.

    Attributes:
        name: registry key.
        builder: ``builder(batch=..., **sizes) -> Graph``.
        batch: default batch size (the paper's where it has one).
        cutoff: recommended minimum points per part (4 for CNNs, 1 for sequence models).
        expert: the expert baseline's name: "one_weird_trick", "gnmt" or "megatron".
        description: one line.
        sizes: default keyword sizes passed to the builder (besides batch).
    """

    name: str
    builder: Callable[..., Graph]
    batch: int
    cutoff: int
    expert: str
    description: str
    sizes: Mapping[str, Any] = field(default_factory=dict)

    def build(self, batch: int | None = None, **sizes: Any) -> Graph:
        """The graph at ``batch`` (default: :attr:`batch`) with ``sizes`` overriding the defaults."""
        allowed = [n for n in inspect.signature(self.builder).parameters if n != "batch"]
        unknown = sorted(set(sizes) - set(allowed))
        if unknown:
            raise ShardplanError(f"model {self.name!r} has no size {unknown[0]!r}; sizes: {', '.join(allowed)}")
        params = inspect.signature(self.builder).parameters
        checked = {k: _check_size(self.name, k, v, params[k]) for k, v in sizes.items()}
        kwargs = {**self.sizes, **checked}
        b = self.batch if batch is None else integer(f"model {self.name!r}: batch", batch, 1, MAX_EXTENT)
        return self.builder(batch=b, **kwargs)


def _check_size(model: str, key: str, value: Any, param: inspect.Parameter) -> Any:
    """A size override checked against the builder's parameter: integer sizes are 1 .. MAX_EXTENT.

    The builders' defaults say the type: an ``int`` default (or ``None`` for an
    optional integer such as ``d_ff``) takes a positive integer, a ``str``
    default a string. A size of 0 or less makes no model (``layers=-1``
    would silently build a model with no layers), so it is refused.
    """
    where = f"model {model!r}: size {key}"
    default = param.default
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ShardplanError(f"{where} must be a string, got {value!r}")
        return value
    if isinstance(default, int) or (default is None and "int" in str(param.annotation)):
        return integer(where, value, 1, MAX_EXTENT)
    return value


MODELS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("alexnet", alexnet, 128, 4, "one_weird_trick", "AlexNet, 5 conv + 3 FC (paper)"),
    ModelSpec("inception_v3", inception_v3, 128, 4, "one_weird_trick", "Inception-v3, 299x299 (paper)"),
    ModelSpec("resnet101", resnet101, 128, 4, "one_weird_trick", "ResNet-101, bottleneck [3,4,23,3]"),
    ModelSpec("resnet50", resnet50, 128, 4, "one_weird_trick", "ResNet-50, bottleneck [3,4,6,3]"),
    ModelSpec("densenet121", densenet121, 128, 4, "one_weird_trick", "DenseNet-121, running concatenations"),
    ModelSpec("rnnlm", rnnlm, 64, 1, "gnmt", "2-layer LSTM LM, vocab 100k, hidden 2048 (paper)"),
    ModelSpec("transformer", transformer, 64, 1, "megatron", "Transformer 6+6, d 512, 8 heads (paper)"),
    ModelSpec("transformer_big", transformer_big, 64, 1, "megatron", "Transformer 6+6, d 1024, 16 heads"),
    ModelSpec("gpt", gpt, 64, 1, "megatron", "GPT decoder-only, 1.3b: 24 x d 2048, 16 heads, seq 2048",
              dict(GPT_SIZES["1.3b"])),
)}


def model_spec(name: str) -> ModelSpec:
    """The registry entry of ``name`` (case-insensitive; '-' and '_' are interchangeable)."""
    key = name.strip().lower().replace("-", "_")
    spec = MODELS.get(key) or MODELS.get(key.replace("_", ""))
    if spec is None:
        raise ShardplanError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return spec


def get_model(name: str, batch: int | None = None, **sizes: Any) -> Graph:
    """Build the registered model ``name`` at ``batch`` (default: the model's) with optional sizes."""
    return model_spec(name).build(batch, **sizes)


def models_table() -> str:
    """A text table of the registry: name, vertices, edges, default batch, cutoff, expert baseline."""
    from shardplan.report.table import format_table

    rows = []
    for spec in MODELS.values():
        g = spec.build()
        rows.append((spec.name, len(g), len(g.edges), spec.batch, spec.cutoff, spec.expert, spec.description))
    return format_table(rows, ("model", "vertices", "edges", "batch", "cutoff", "expert", "description"))
