"""The model zoo: computation graphs of the paper's benchmarks and a few more.

Each builder is a function of the batch size (and of the model's sizes where
they vary) returning a validated :class:`~shardplan.ir.Graph`. The registry
:data:`MODELS` maps a name to its builder, default batch, the recommended
cutoff (4 for CNNs as in the paper; 1 for the sequence models so that layers
and heads can be split) and the expert strategy it is compared against
(a key of :data:`shardplan.baselines.BASELINES`).

:data:`NAMED` holds the published sizes of the GPT and Llama families by
name: ``llama3-8b``, ``llama3-70b``, ``llama3-405b`` (and ``llama3-tiny``
for tests), ``gpt3-125m`` .. ``gpt3-175b``, ``megatron-1.7b`` ..
``megatron-1t``, and the mixture-of-experts ``mixtral-8x7b`` and
``deepseek-v3`` (``mixtral-tiny``, ``deepseek-tiny``;
:mod:`~shardplan.models.moe`). :func:`get_model` and :func:`model_spec`
find them as they find the zoo's models, and sizes override them the same way
(``get_model("llama3-8b", 8, layers=4, seq=2048)``, on the command line
``--model llama3-8b --set layers=4``). They are kept apart from
:data:`MODELS`, the zoo every model-wide test and table builds at its
default size (a 405B model at its published batch is no such model).

The attention core is a model option, ``attention="flash"`` (one FlashAttention operator,
:func:`shardplan.ops.flash_attention`: the default of the Llama and mixture-of-experts models) or
``"unfused"`` (scores and context products with the (s, t) probabilities in memory: the default of GPT and the
Megatron-LM rows), e.g. ``get_model("llama3-8b", attention="unfused")``, ``--set attention=unfused``
(docs/models.md, "Attention: flash or unfused").
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
from shardplan.models.gpt import GPT3, GPT_SIZES, MEGATRON, gpt
from shardplan.models.inception import inception_v3
from shardplan.models.llama import LLAMA3, llama
from shardplan.models.moe import MOE, moe
from shardplan.models.resnet import resnet50, resnet101
from shardplan.models.rnnlm import rnnlm
from shardplan.models.transformer import transformer, transformer_big

__all__ = ["ModelSpec", "MODELS", "NAMED", "get_model", "model_spec", "models_table", "named_table",
           "alexnet", "resnet101", "resnet50", "inception_v3", "rnnlm", "transformer", "transformer_big",
           "densenet121", "gpt", "GPT_SIZES", "llama", "moe"]


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
    ModelSpec("moe", moe, 8, 1, "megatron", "Mixture-of-experts decoder, tiny: 2 x d 64, 8 experts, top-2"),
)}


# Default batches of the named sizes. GPT-3: Brown et al. 2020, Table 2.1, batch size in tokens / 2048 (0.5M,
# 1M, 2M tokens: 256, 512, 1024 sequences; 175B's 3.2M is 1,536 sequences, 3.1M tokens, the batch Megatron-LM
# trains it with in Narayanan et al., SC'21, Table 2). Megatron: SC'21, Table 1, "Batch size". Llama 3: the paper
# states a batch for 405B only (16M tokens, 2,048 sequences of 8,192, Dubey et al. 2024, §3.4.1); the others
# take the zoo's sequence-model default of 64.
_GPT3_BATCH = {"gpt3-125m": 256, "gpt3-350m": 256, "gpt3-760m": 256, "gpt3-1.3b": 512, "gpt3-2.7b": 512,
               "gpt3-6.7b": 1024, "gpt3-13b": 1024, "gpt3-175b": 1536}
_MEGATRON_BATCH = {"megatron-1.7b": 512, "megatron-3.6b": 512, "megatron-7.5b": 512, "megatron-18.4b": 1024,
                   "megatron-39.1b": 1536, "megatron-76.1b": 1792, "megatron-145.6b": 2304,
                   "megatron-310.1b": 2160, "megatron-529.6b": 2520, "megatron-1t": 3072}
_LLAMA3_BATCH = {"llama3-8b": 64, "llama3-70b": 64, "llama3-405b": 2048, "llama3-tiny": 8}
# Mixtral: no published batch, the sequence models' 64. DeepSeek-V3: 15,360 sequences of 4K, the batch after the
# warm-up (DeepSeek-AI 2024, §4.2).
_MOE_BATCH = {"mixtral-8x7b": 64, "deepseek-v3": 15360, "mixtral-tiny": 8, "deepseek-tiny": 8}
_MOE_WHERE = {"mixtral-8x7b": "Jiang et al. 2024, Table 1", "deepseek-v3": "DeepSeek-AI 2024, §4.2; MLA as MHA"}


def _named() -> dict[str, ModelSpec]:
    """The named sizes as registry entries (the builder's ``name`` is the entry's, so graphs carry it)."""
    out: dict[str, ModelSpec] = {}
    for name, cfg in GPT3.items():
        out[name] = ModelSpec(name, gpt, _GPT3_BATCH[name], 1, "megatron",
                              f"GPT-3 {name[5:].upper()}: {cfg.layers} x d {cfg.d_model}, {cfg.heads} heads "
                              f"(Brown et al. 2020, Table 2.1)", {**cfg.sizes(), "name": name})
    for name, cfg in MEGATRON.items():
        out[name] = ModelSpec(name, gpt, _MEGATRON_BATCH[name], 1, "megatron",
                              f"GPT {name[9:].upper()}: {cfg.layers} x d {cfg.d_model}, {cfg.heads} heads "
                              f"(Narayanan et al. SC'21, Table 1)", {**cfg.sizes(), "name": name})
    for name, cfg in LLAMA3.items():
        where = "test size" if name == "llama3-tiny" else "Dubey et al. 2024, Table 3"
        out[name] = ModelSpec(name, llama, _LLAMA3_BATCH[name], 1, "megatron",
                              f"Llama 3 {name[7:].upper()}: {cfg.layers} x d {cfg.d_model}, {cfg.heads} heads / "
                              f"{cfg.kv_heads} KV, ffn {cfg.d_ff} ({where})", {**cfg.sizes(), "name": name})
    for name, cfg in MOE.items():
        shared = f" + {cfg.shared} shared" if cfg.shared else ""
        out[name] = ModelSpec(name, moe, _MOE_BATCH[name], 1, "megatron",
                              f"MoE {name}: {cfg.layers} x d {cfg.d_model}, {cfg.experts} experts{shared} of "
                              f"{cfg.d_expert}, top-{cfg.top_k} ({_MOE_WHERE.get(name, 'test size')})",
                              {**cfg.sizes(), "name": name})
    return out


NAMED: dict[str, ModelSpec] = _named()


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_")


_NAMED_KEYS: dict[str, str] = {_key(n): n for n in NAMED}


def model_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``: a zoo model (:data:`MODELS`) or a named size (:data:`NAMED`)
    (case-insensitive; '-' and '_' are interchangeable)."""
    key = _key(name)
    spec = MODELS.get(key) or MODELS.get(key.replace("_", ""))
    if spec is None and key in _NAMED_KEYS:
        spec = NAMED[_NAMED_KEYS[key]]
    if spec is None:
        raise ShardplanError(f"unknown model {name!r}; known models: {', '.join(MODELS)}; "
                             f"named sizes: {', '.join(NAMED)}")
    return spec


def get_model(name: str, batch: int | None = None, **sizes: Any) -> Graph:
    """Build the registered model ``name`` at ``batch`` (default: the model's) with optional sizes."""
    return model_spec(name).build(batch, **sizes)


def models_table() -> str:
    """A text table of the zoo: name, vertices, edges, default batch, cutoff, expert baseline; then the named
    sizes (:func:`named_table`)."""
    from shardplan.table import format_table

    rows = []
    for spec in MODELS.values():
        g = spec.build()
        rows.append((spec.name, len(g), len(g.edges), spec.batch, spec.cutoff, spec.expert, spec.description))
    zoo = format_table(rows, ("model", "vertices", "edges", "batch", "cutoff", "expert", "description"))
    return f"{zoo}\n\nnamed sizes (same use: --model NAME --set KEY=VALUE):\n{named_table()}"


def named_table() -> str:
    """A text table of the named sizes (no graph is built): name, layers, width, heads, key/value heads,
    feed-forward width, vocabulary, sequence, default batch and the weights of the graph (for GPT: no biases, no
    position table, embedding and output untied, padded vocabulary; :func:`~shardplan.models.gpt.gpt_published_params`
    counts them as the papers do)."""
    from shardplan.models.flops import config_of
    from shardplan.table import format_table

    rows = []
    for spec in NAMED.values():
        cfg = config_of(spec.name)
        kv = getattr(cfg, "kv_heads", cfg.heads)
        ffn = getattr(cfg, "ffn", None) or cfg.d_ff
        rows.append((spec.name, cfg.layers, cfg.d_model, cfg.heads, kv, ffn, cfg.vocab, cfg.seq, spec.batch,
                     f"{cfg.params() / 1e9:.2f}B"))
    return format_table(rows, ("name", "layers", "d_model", "heads", "kv_heads", "d_ff", "vocab", "seq", "batch",
                               "graph params"))
