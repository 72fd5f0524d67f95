"""A training configuration as practitioners write it (:class:`Recipe`), costed exactly (:func:`cost_recipe`).

A recipe names the degrees of parallelism and the memory choices of a
Megatron-LM / DeepSpeed run: ``tp=8,pp=4,vp=5,mbs=2,recompute=full``.
:func:`cost_recipe` maps it to one plan of shardplan's own space and costs it
with the model the search uses, so a recipe's prediction and the search's
optimum are comparable (and a recipe with published measurements checks the
model). The map, on ``p`` devices with ``dp = p / (tp · cp · pp)``:

* **layouts** (:func:`megatron_layouts`): Megatron-LM's tensor parallelism
  (Shoeybi et al. 2019): every operator splits its batch dimension ``dp``
  ways and, when it has one, its model dimension ``tp`` ways (attention
  heads ``h``, the feed-forward hidden ``e``, the vocabulary ``v`` of the
  embedding, the head and the loss); the other operators (norms, additions)
  are replicated over the tensor group. Devices are numbered as Megatron-LM
  numbers ranks (tensor rank fastest, then data, then pipeline): on each
  machine level, innermost first, the tensor group takes its part first
  and the data-parallel group what is left. The tables are built with
  ``node_replicas=True`` so that the norms' layouts are candidates;
* **sequence parallelism** ``sp=true`` (Korthikanti et al. 2022, §4.2.2): the
  operators without a model dimension (norms, additions) split their sequence
  dimension ``s`` where the tensor group is, instead of being replicated over
  it, and every tensor-parallel operator that splits a reduction takes the
  partial layout (:attr:`shardplan.layout.Layout.partial`): the row-parallel
  products (attention output, second feed-forward product, the embedding)
  leave their outputs as partial sums, reduce-scattered into the
  sequence-split norms; the column-parallel ones leave their inputs'
  gradients as partial sums, reduce-scattered backward; the all-gathers are
  the redistributions from the sequence-split layouts into the
  column-parallel ones (:mod:`shardplan.cost.edge`); with context parallelism the norms' ``s`` is split over
  the tensor group inside the context group (:func:`_nesting`), so these collectives stay in the tensor group;
* **experts** (``ep``, Megatron-LM's expert parallelism; Lepikhin et al. 2021, GShard): the
  experts' batched products (:data:`~shardplan.models.moe.EXPERT_KINDS`) split their expert
  dimension ``e`` ``ep`` ways inside the data-parallel group (the ``ep`` consecutive data ranks,
  filled from the inside of each level's data share, as Megatron-LM's rank order tp-ep-dp places
  them), their batch the remaining ``dp / ep`` ways and their hidden ``f`` ``tp`` ways (expert
  tensor parallelism = tp, Megatron-LM's default); every other operator, router, gate, dispatch and
  combine included, keeps the layout above, so the tokens reach the experts and come back by
  all-to-alls in groups of ``ep`` (:func:`megatron_layout`). A model without experts refuses ``ep``;
* **ZeRO** stage ``zero`` for every operator with trainable weights, and
  **recomputation** (``full``: every operator of the repeated blocks;
  ``selective``: the attention core, ``attn_scores`` and ``attn_context`` (FlashAttention's ``attn_flash``),
  Korthikanti et al. 2022; an integer ``N``: every operator of the first N
  blocks of each pipeline stage or chunk, Megatron-LM's ``block`` method),
  both by :func:`shardplan.fit.plan_with_choices`;
* **precision** ``precision=mixed`` (fp32 master weights and optimizer state beside the machine's
  element size: :class:`~shardplan.cost.memory.ChoiceRules`) or ``precision=fp8`` (``fp8=true``: that,
  and every matrix product in FP8 with Transformer Engine's delayed scaling, or its per-tensor current
  scaling with ``fp8_scaling=current``; ``fp8_params=true``: the FP8 products' weights stored in FP8 only,
  gathered in FP8), and **host offload**
  ``offload=optimizer+parameters+activations`` (any of them: ZeRO-Offload's optimizer step on the CPU,
  ZeRO-Infinity's parameters at ``zero=3``, activations saved to host), both by
  :func:`shardplan.fit.plan_with_choices`;
* **a ZeRO-3 runtime's collectives** (``zero_regather``, ``zero_grad_reduce``): whether the recomputed
  forward gathers the weights again, and whether each micro-batch's gradient is reduce-scattered or
  all-reduced (DeepSpeed v0.3's ZeRO-3 with its default configuration: both; docs/recipes.md);
* **micro-batches** ``m = gbs / (dp · mbs)``: one program accumulates
  gradients over m (``plan_with_choices(micro_batches=m)``; ``grad_accum=autograd`` charges the
  accumulation's own pass, :data:`GRAD_ACCUMS`); a pipeline
  costs each stage per micro-batch of ``dp · mbs`` sequences with the
  once-per-step collectives charged 1/m (:class:`~shardplan.pipeline.stages.ModelStages`
  with ``strategy`` and ``choices``);
* **pipeline** ``pp`` stages of ``tp · dp`` consecutive devices, the blocks
  split as Megatron-Core splits them (:func:`chunk_sizes`: ``first_stage_layers`` /
  ``last_stage_layers`` on the end ranks, spread over their ``vp`` chunks;
  ``embedding_as_layer`` / ``loss_as_layer`` count the embedding / the head
  with the loss as a layer, else they ride with the first / last chunk),
  under 1F1B, or interleaved 1F1B with ``vp`` chunks per device group
  (chunk j on group j mod pp), costed by
  :func:`shardplan.pipeline.search.evaluate_pipeline` with exact
  stage-to-stage transfers, as the search costs its candidates; an
  interleaved pipeline whose chunks are unequal takes the event simulation
  over each chunk's seconds as its step (:func:`unequal_chunks_simulated`).

What has no exact counterpart in the space is refused with a one-line
:class:`~shardplan.errors.ShardplanError` naming the part, never
approximated: context together with expert parallelism (``cp`` with ``ep``),
hybrid sharding groups (``hsdp``), ``ep`` on a model without experts, a dtype
other than the machine's (``dtype=fp8``: FP8 products are ``precision=fp8``),
FP8 on a machine without an FP8 peak, offload without a host link, and overlap
flags the cost model does not
distinguish (``param_gather`` except with FSDP, whose gathers the
model overlaps exactly when it overlaps the gradient reduction).

``overlap=tp_comm`` (Megatron-LM's ``--tp-comm-overlap``, torchtitan's asynchronous tensor parallelism) needs
``sp=true``, as both runtimes do: the sequence-parallel all-gather in front of each column-parallel product
and the reduce-scatter behind each row-parallel one are cut into chunks that run beside the product
(``build_tables(..., overlap_tp=True)``, docs/cost-model.md). Together with overlapped FSDP (``zero=3`` with
``grad_reduce`` / ``param_gather``) or ``offload``, whose gathers and transfers the model also hides behind the
products' own compute, it is refused unless the tensor group is exactly one node: then the tensor-parallel
collectives use only the node's links and the others the network or the host link, and a product's seconds
hide at most one collective per link.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from shardplan.configs import level_products
from shardplan.errors import ShardplanError
from shardplan.ir import Graph, Operator
from shardplan.layout import Layout
from shardplan.machine import Machine
from shardplan.models.moe import EXPERT_KINDS

__all__ = ["Recipe", "cost_recipe", "causal_attention", "runtime_graph", "fp8_names", "RUNTIMES", "megatron_layouts",
           "expert_dim", "has_experts", "chunk_sizes", "recompute_names", "RECOMPUTE", "OVERLAPS", "ATTENTION_CORE",
           "CP_ALGORITHMS", "ZERO_GRAD_REDUCES", "GRAD_ACCUMS", "recipe_machine"]

RECOMPUTE = ("none", "selective", "full")
"""The named recomputation policies (an integer N: the first N blocks of each stage)."""

OVERLAPS = ("grad_reduce", "param_gather", "tp_comm", "dgrad")
"""Communications a run may overlap with compute (Megatron-LM's ``--overlap-grad-reduce``,
``--overlap-param-gather``, ``--tp-comm-overlap``; ``dgrad``: the reduction of a column-parallel linear's
input gradient beside its weight-gradient product, Megatron-LM's asynchronous tensor-parallel all-reduce,
on by default from 2022, and Transformer Engine's linear layers: :attr:`~shardplan.machine.Machine.overlap_dgrad`)."""

ATTENTION_CORE = ("attn_scores", "attn_context", "attn_flash")
"""Operator kinds of the attention core: QK^T with its softmax, and the product with V (selective
recomputation, Korthikanti et al. 2022, §4), or both as one FlashAttention operator
(:func:`shardplan.ops.flash_attention`)."""

DTYPES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1}

_INT_FIELDS = ("tp", "cp", "pp", "vp", "first_stage_layers", "last_stage_layers", "dp", "zero", "hsdp", "ep",
               "mbs", "gbs")
_ORDER = ("tp", "sp", "cp", "cp_algo", "pp", "vp", "first_stage_layers", "last_stage_layers", "embedding_as_layer",
          "loss_as_layer", "dp", "zero", "hsdp",
          "ep", "mbs", "gbs", "recompute", "dtype", "precision", "fp8_params", "fp8_scaling", "offload", "overlap",
          "zero_regather",
          "zero_grad_reduce", "grad_accum", "runtime")

CP_ALGORITHMS = ("allgather", "ring")
"""Context parallelism's algorithms (``cp_algo``): ``build_tables(context=...)`` of :mod:`shardplan.cost.ring`."""

ZERO_GRAD_REDUCES = ("reduce_scatter", "allreduce")
"""How a ZeRO-3 runtime synchronises each micro-batch's weight gradients (``zero_grad_reduce``): a
reduce-scatter into the shards (FSDP; DeepSpeed with ``reduce_scatter: true``), or an all-reduce of the whole
gradient of which each device keeps its shard (DeepSpeed v0.3's default, ``reduce_scatter: false``)."""

GRAD_ACCUMS = ("fused", "autograd")
"""How a run adds the micro-batches' weight gradients into the step's (``grad_accum``): inside the
weight-gradient products (``fused``: Megatron-LM's ``--gradient-accumulation-fusion``, its default from 2022 with
fp32 gradient accumulation, and Transformer Engine's linear layers; nothing charged) or by PyTorch autograd's
in-place ``.grad += g`` from the second micro-batch on (``autograd``: 3 × dtype bytes per weight-gradient
element and micro-batch at the HBM bandwidth; Megatron-LM's SC'21 code, 6985e58, which kept no contiguous
gradient buffer; plain PyTorch, DDP under ``no_sync``): :attr:`~shardplan.machine.Machine.grad_accum_bytes`."""

RUNTIMES = ("shardplan", "megatron_te")
"""Whose saved activations and FP8 scope a recipe's memory counts (``runtime``): shardplan's own runtimes (the
graph's ``saved``, every matrix product FP8 under ``precision=fp8``, each FP8 product keeping its own input's
FP8 copy) or Megatron-Core with Transformer Engine layers (:func:`shardplan.cost.memory.te_saved`: what its
autograd functions keep; FP8 only in the transformer blocks' products, the output layer a Megatron-Core
``ColumnParallelLinear`` in the machine's precision). docs/memory.md, "Published H100 recipes' memory"."""

PRECISIONS = ("mixed", "fp8")
"""Precision rules of a recipe beyond the machine's element size (module docstring)."""
_ALIASES = {"fsdp": "zero", "micro_batch_size": "mbs", "global_batch_size": "gbs", "tensor_parallel": "tp",
            "pipeline_parallel": "pp", "data_parallel": "dp", "sequence_parallel": "sp", "context_parallel": "cp",
            "expert_parallel": "ep", "virtual_stages": "vp", "context_algorithm": "cp_algo",
            "fp8_param_gather": "fp8_params", "fp8_param": "fp8_params", "fp8_recipe": "fp8_scaling"}
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclass(frozen=True)
class Recipe:
    """A training configuration (module docstring); ``None`` and the defaults mean "not given".

    Attributes:
        tp: tensor-parallel degree. sp: sequence parallelism (Megatron-LM's ``--sequence-parallel``).
        cp: context-parallel degree. cp_algo: how attention receives the keys and values of the context
            group, ``allgather`` (Llama 3's, the default) or ``ring`` (:mod:`shardplan.cost.ring`).
            pp: pipeline stages. vp: model chunks per pipeline stage (interleaved
            1F1B when > 1). first_stage_layers, last_stage_layers: blocks on the first / last stage, with
            ``vp`` > 1 spread evenly over its chunks (Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
            ``--decoder-last-pipeline-num-layers``; default: an even split). embedding_as_layer,
            loss_as_layer: the embedding / the head with the loss counts as one layer in the split
            (Megatron-Core's ``account_for_embedding_in_pipeline_split`` /
            ``account_for_loss_in_pipeline_split``; :func:`chunk_sizes`). dp: data-parallel degree (default:
            devices / (tp · cp · pp)).
        zero: ZeRO stage 0-3 of every weight's state (3: FSDP). hsdp: hybrid-sharding group size.
        ep: expert-parallel degree. mbs: micro-batch size (sequences per data-parallel replica and micro-batch).
        gbs: global batch (default: the model's). recompute: ``none``, ``selective``, ``full`` or N blocks.
        dtype: ``fp16``, ``bf16``, ``fp32`` or ``fp8`` (default: the machine's). precision: None (the
            machine's element size for everything), ``mixed`` (fp32 master weights and optimizer state) or
            ``fp8`` (mixed, with FP8 matrix products). fp8_params: with ``precision=fp8``, the FP8 products'
            weights stored in FP8 only (Megatron-Core's ``--fp8-param-gather``, TE's ``fp8_model_init``:
            :attr:`~shardplan.cost.memory.ChoiceRules.fp8_params`). fp8_scaling: with ``precision=fp8``,
            ``delayed`` (default) or ``current`` (per-tensor current scaling, Megatron-Core's
            ``fp8_recipe=tensorwise``; ``tensorwise`` is read as ``current``). offload: what lives in host memory (a subset of
            ``optimizer``, ``parameters``, ``activations``). overlap: the communications
            overlapped with compute (a subset of :data:`OVERLAPS`; None: the machine's own setting).
        zero_regather: at ``zero=3`` a recomputing operator gathers its weights again for the recomputed
            forward (DeepSpeed's ZeRO-3: its pre-forward hook fetches on every forward call; default False:
            one gather shared by the recomputed forward and the backward, as an FSDP unit around the
            checkpointed block). zero_grad_reduce: at ``zero=3``, :data:`ZERO_GRAD_REDUCES`.
        grad_accum: :data:`GRAD_ACCUMS`, how the micro-batches' weight gradients are added up (None: the
            machine's own setting, :attr:`~shardplan.machine.Machine.grad_accum_bytes`).
        runtime: :data:`RUNTIMES`, whose saved activations and FP8 scope the memory counts (default
            ``shardplan``).
    """

    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_algo: str = "allgather"
    pp: int = 1
    vp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    embedding_as_layer: bool = False
    loss_as_layer: bool = False
    dp: int | None = None
    zero: int = 0
    hsdp: int | None = None
    ep: int = 1
    mbs: int = 1
    gbs: int | None = None
    recompute: str | int = "none"
    dtype: str | None = None
    precision: str | None = None
    fp8_params: bool = False
    fp8_scaling: str = "delayed"
    offload: tuple[str, ...] = ()
    overlap: tuple[str, ...] | None = None
    zero_regather: bool = False
    zero_grad_reduce: str = "reduce_scatter"
    grad_accum: str | None = None
    runtime: str = "shardplan"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in ("first_stage_layers", "last_stage_layers", "dp", "hsdp", "gbs"):
                continue
            low = 0 if name in ("zero", "first_stage_layers", "last_stage_layers") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ShardplanError(f"recipe: {name} must be an integer >= {low}, got {v!r}")
        if self.zero > 3:
            raise ShardplanError(f"recipe: zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero}")
        for name in ("sp", "embedding_as_layer", "loss_as_layer", "fp8_params"):
            if not isinstance(getattr(self, name), bool):
                raise ShardplanError(f"recipe: {name} must be true or false, got {getattr(self, name)!r}")
        if self.cp_algo not in CP_ALGORITHMS:
            raise ShardplanError(f"recipe: cp_algo must be one of {', '.join(CP_ALGORITHMS)}, got {self.cp_algo!r}")
        if not isinstance(self.zero_regather, bool):
            raise ShardplanError(f"recipe: zero_regather must be true or false, got {self.zero_regather!r}")
        if self.zero_grad_reduce not in ZERO_GRAD_REDUCES:
            raise ShardplanError(f"recipe: zero_grad_reduce must be one of {', '.join(ZERO_GRAD_REDUCES)}, "
                                 f"got {self.zero_grad_reduce!r}")
        from shardplan.cost.memory import FP8_SCALINGS

        if self.fp8_scaling not in FP8_SCALINGS:
            raise ShardplanError(f"recipe: fp8_scaling must be one of {', '.join(FP8_SCALINGS)}, "
                                 f"got {self.fp8_scaling!r}")
        if self.grad_accum is not None and self.grad_accum not in GRAD_ACCUMS:
            raise ShardplanError(f"recipe: grad_accum must be one of {', '.join(GRAD_ACCUMS)} (or none), "
                                 f"got {self.grad_accum!r}")
        if self.runtime not in RUNTIMES:
            raise ShardplanError(f"recipe: runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        rec = self.recompute
        if isinstance(rec, bool) or not (rec in RECOMPUTE or (isinstance(rec, int) and rec >= 1)):
            raise ShardplanError(f"recipe: recompute must be none, selective, full or a number of blocks >= 1, "
                                 f"got {rec!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ShardplanError(f"recipe: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ShardplanError(f"recipe: precision must be one of {', '.join(PRECISIONS)} (or none), "
                                 f"got {self.precision!r}")
        from shardplan.cost.memory import OFFLOADS

        off = tuple(self.offload)
        if any(o not in OFFLOADS for o in off):
            bad = next(o for o in off if o not in OFFLOADS)
            raise ShardplanError(f"recipe: offload {bad!r} is not one of {', '.join(OFFLOADS)} (or none)")
        object.__setattr__(self, "offload", tuple(o for o in OFFLOADS if o in off))
        if self.overlap is not None:
            ov = tuple(self.overlap)
            bad = [o for o in ov if o not in OVERLAPS]
            if bad:
                raise ShardplanError(f"recipe: overlap {bad[0]!r} is not one of {', '.join(OVERLAPS)} (or none)")
            object.__setattr__(self, "overlap", tuple(o for o in OVERLAPS if o in ov))

    # -- text -------------------------------------------------------------------------------------------
    @staticmethod
    def parse(text: str) -> "Recipe":
        """``key=value`` pairs separated by commas (``tp=8,pp=4,vp=5,mbs=2,recompute=full``); ``fsdp`` alone
        means ``zero=3``, ``sp`` alone ``sp=true``; overlap lists its parts joined by ``+`` (or ``none``)."""
        if not isinstance(text, str) or not text.strip():
            raise ShardplanError("recipe: empty; write key=value pairs, e.g. tp=8,pp=2,mbs=4,recompute=full")
        pairs: dict[str, str] = {}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip().lower().replace("-", "_")
            if not sep:
                if key in ("fsdp", "sp", "fp8"):
                    value = "true"
                else:
                    raise ShardplanError(f"recipe: {part!r} is not key=value (e.g. tp=8)")
            if key in pairs:
                raise ShardplanError(f"recipe: {key} given twice")
            pairs[key] = value.strip()
        return Recipe.from_mapping(pairs)

    @staticmethod
    def from_mapping(values: Mapping[str, Any]) -> "Recipe":
        """A recipe from a mapping of keys (names of the fields or their aliases) to values (text or JSON); a
        value None means not given (the field's default), so :meth:`to_dict`'s output reads back."""
        known = {f.name for f in fields(Recipe)}
        out: dict[str, Any] = {}
        for raw, value in values.items():
            if value is None:
                continue
            key = _ALIASES.get(str(raw).lower().replace("-", "_"), str(raw).lower().replace("-", "_"))
            if key == "fp8":  # fp8=true is precision=fp8
                key, value = "precision", ("fp8" if _bool("fp8", value) else "none")
            if key not in known:
                raise ShardplanError(f"recipe: unknown key {raw!r}; keys: {', '.join(_ORDER)} (fsdp = zero 3)")
            if key in out:
                raise ShardplanError(f"recipe: {key} given twice")
            out[key] = _value(key, value, str(raw).lower() == "fsdp")
        return Recipe(**out)

    @staticmethod
    def from_file(path: str | Path) -> "Recipe":
        """A recipe from a JSON object, or TOML-like ``key = value`` lines (``#`` comments, an optional
        ``[recipe]`` header, quoted strings, ``overlap = ["grad_reduce"]``)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ShardplanError(f"recipe: cannot read {path}: {e.strerror or e}") from None
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                data = json.loads(stripped)
            except json.JSONDecodeError as e:
                raise ShardplanError(f"recipe: {path} is not valid JSON: {e}") from None
            if not isinstance(data, dict):
                raise ShardplanError(f"recipe: {path} must hold one JSON object")
            return Recipe.from_mapping(data.get("recipe", data) if isinstance(data.get("recipe"), dict) else data)
        pairs: dict[str, Any] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line or line in ("[recipe]",):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise ShardplanError(f"recipe: {path}:{n}: {line!r} is not key = value")
            value = value.strip()
            if value.startswith("["):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise ShardplanError(f"recipe: {path}:{n}: bad list {value!r}") from None
            elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            key = key.strip()
            if key in pairs:
                raise ShardplanError(f"recipe: {path}:{n}: {key} given twice")
            pairs[key] = value
        return Recipe.from_mapping(pairs)

    @staticmethod
    def load(text_or_path: str) -> "Recipe":
        """A file's recipe when ``text_or_path`` names an existing file, else :meth:`parse` of the text."""
        p = Path(text_or_path)
        if "=" not in text_or_path and p.is_file():
            return Recipe.from_file(p)
        return Recipe.parse(text_or_path)

    def __str__(self) -> str:
        """The canonical text :meth:`parse` reads back: the fields that differ from their defaults, in order
        (``tp=1`` when none does)."""
        parts = []
        default = Recipe()
        for name in _ORDER:
            v = getattr(self, name)
            if v == getattr(default, name):
                continue
            if isinstance(v, bool):
                v = "true" if v else "false"
            elif name in ("overlap", "offload"):
                v = "+".join(v) or "none"  # type: ignore[arg-type]
            parts.append(f"{name}={v}")
        return ",".join(parts) or "tp=1"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``overlap`` as a list)."""
        return {f.name: (list(getattr(self, f.name)) if f.name in ("overlap", "offload")
                         and getattr(self, f.name) is not None else getattr(self, f.name)) for f in fields(self)}


def _value(key: str, value: Any, fsdp: bool) -> Any:
    """One field's value from text or JSON."""
    if fsdp:
        flag = _bool(key, value)
        return 3 if flag else 0
    if key in ("sp", "zero_regather", "embedding_as_layer", "loss_as_layer", "fp8_params"):
        return _bool(key, value)
    if key == "fp8_scaling":  # Megatron-Core's fp8_recipe names current scaling "tensorwise"
        text = str(value).strip().lower()
        return "current" if text == "tensorwise" else text
    if key in ("zero_grad_reduce", "runtime"):
        return str(value).strip().lower().replace("-", "_")
    if key in ("overlap", "offload"):
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
        text = str(value).strip().lower()
        return () if text in ("none", "") else tuple(x.strip() for x in text.split("+"))
    if key == "recompute":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text.isdigit():
            return int(text)
        return text
    if key in ("dtype", "cp_algo"):
        return str(value).strip().lower().replace("-", "")
    if key in ("precision", "grad_accum"):
        text = str(value).strip().lower()
        return None if text in ("none", "") else text
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if key in ("first_stage_layers", "last_stage_layers", "dp", "hsdp", "gbs") and text.lower() in ("none", "auto"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ShardplanError(f"recipe: {key} must be an integer, got {value!r}") from None


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ShardplanError(f"recipe: {key} must be true or false, got {value!r}")


# -- what cannot be costed exactly ----------------------------------------------------------------------
def refusal(recipe: Recipe, machine: Machine) -> str | None:
    """Why ``recipe`` has no exact counterpart in shardplan's space on ``machine`` (None: it has one)."""
    if recipe.sp and recipe.tp < 2:
        return "sequence parallelism (sp) splits the sequence over the tensor group: it needs tp >= 2"
    if recipe.cp_algo != "allgather" and recipe.cp < 2:
        return f"cp_algo={recipe.cp_algo}: a context-parallel algorithm needs a context group (cp >= 2)"
    if recipe.cp > 1 and recipe.ep > 1:
        return "context and expert parallelism together (cp with ep): their groups' rank order is not mapped"
    if recipe.hsdp is not None:
        return "hybrid sharding (hsdp): ZeRO state sharded within a group and replicated across groups is not modelled"
    if recipe.dtype == "fp8":
        return ("dtype fp8: every tensor in one byte is not a training recipe; FP8 matrix products with "
                "mixed-precision state are precision=fp8 (fp8=true)")
    if recipe.precision != "fp8" and (recipe.fp8_params or recipe.fp8_scaling != "delayed"):
        return "fp8_params / fp8_scaling describe FP8 products' weights and casts: they need precision=fp8"
    if recipe.fp8_params and recipe.offload:
        return "fp8_params with offload: the FP8 weights' copies to and from the host are not modelled"
    if recipe.precision == "fp8" and machine.fp8_flops is None:
        return f"precision fp8: the machine {machine.name!r} has no FP8 matrix products (no fp8_flops)"
    if recipe.offload and (machine.host_bandwidth is None or machine.host_memory_bytes is None):
        return (f"offload: the machine {machine.name!r} has no host link or host memory (host_bandwidth, "
                f"host_memory_bytes)")
    if "optimizer" in recipe.offload and (recipe.zero < 1 or machine.cpu_adam_rate is None):
        return ("offload optimizer: DeepSpeed offloads a ZeRO partition (give zero >= 1) and the machine needs a "
                "CPU Adam rate (cpu_adam_rate)")
    if "parameters" in recipe.offload and (recipe.zero != 3 or "optimizer" not in recipe.offload):
        return "offload parameters: only at zero=3 together with the optimizer state (ZeRO-Infinity's offload_param)"
    if recipe.dtype is not None and DTYPES[recipe.dtype] != machine.dtype_bytes:
        return (f"dtype {recipe.dtype}: the machine computes in {machine.dtype_bytes}-byte values (give a machine "
                f"with that dtype instead)")
    if recipe.vp > 1 and recipe.pp < 2:
        return "vp > 1 (interleaving) needs pp >= 2"
    uneven = recipe.first_stage_layers is not None or recipe.last_stage_layers is not None
    as_layer = recipe.embedding_as_layer or recipe.loss_as_layer
    if recipe.pp < 2 and (uneven or as_layer):
        return "first_stage_layers / last_stage_layers / embedding_as_layer / loss_as_layer need pp >= 2"
    if uneven and as_layer:
        return ("first_stage_layers / last_stage_layers with embedding_as_layer / loss_as_layer: Megatron-Core "
                "refuses uneven end stages together with the embedding or loss counted as a layer")
    if recipe.zero != 3 and (recipe.zero_regather or recipe.zero_grad_reduce != "reduce_scatter"):
        return ("zero_regather / zero_grad_reduce describe a ZeRO-3 runtime's gathers and gradient reduction; "
                "they need zero=3")
    ov = recipe.overlap
    if ov is not None:
        if "tp_comm" in ov and not recipe.sp:
            return ("overlap tp_comm: Megatron-LM and torchtitan overlap the sequence-parallel gathers and "
                    "reduce-scatters with the products; it needs sp=true")
        others = recipe.offload or (recipe.zero == 3 and ("grad_reduce" in ov or "param_gather" in ov))
        if "tp_comm" in ov and others and not (len(machine.levels) > 1 and recipe.tp == machine.levels[0]):
            return ("overlap tp_comm with overlapped FSDP or offload: both would hide behind the same products on "
                    "the same links; only with the tensor group exactly one node (tp = node size)")
        if "param_gather" in ov and recipe.zero != 3:
            return ("overlap param_gather: below ZeRO-3 the cost model charges the gather of updated weights in "
                    "full (it does not overlap it with the next forward)")
        if recipe.zero == 3 and ("grad_reduce" in ov) != ("param_gather" in ov):
            return ("overlap: with FSDP the cost model overlaps the weight gathers exactly when it overlaps the "
                    "gradient reduction; give both grad_reduce and param_gather, or neither")
    return None


# -- the layouts ------------------------------------------------------------------------------------------
def model_dim(op: Operator) -> str | None:
    """The dimension Megatron-LM's tensor parallelism splits (the rule of :func:`shardplan.baselines.megatron`):
    the heads ``h`` of attention operators, the hidden ``e`` of feed-forward ones, the hidden ``f`` of the
    experts, the vocabulary ``v`` of the embedding, head and loss; None for the rest (norms, additions, the
    router, gate, dispatch and combine of a mixture of experts: replicated over the tensor group)."""
    names = op.dim_names
    if op.kind in EXPERT_KINDS:
        return "f" if "f" in names else None
    if "h" in names:
        return "h"
    if op.kind == "ffn" and "e" in names:
        return "e"
    return "v" if "v" in names else None


def _level_ways(levels: tuple[int, ...], dp: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tp_l, dp_l) per level: the tensor group filled from the inside, the data group in what is left."""
    if dp * tp != math.prod(levels):
        raise ShardplanError(f"recipe: dp {dp} × tp {tp} is not the {math.prod(levels)} devices of the stage")
    tps = level_products(tp, levels)
    if tps is None:
        raise ShardplanError(f"recipe: tp={tp} does not fill the machine levels {levels} from the inside")
    dps = level_products(dp, tuple(s // t for s, t in zip(levels, tps)))
    if dps is None:
        raise ShardplanError(f"recipe: dp={dp} does not fit the levels {levels} beside tp={tp}")
    return tps, dps


def expert_dim(op: Operator) -> str | None:
    """The dimension expert parallelism splits: ``e`` of the experts' operators
    (:data:`~shardplan.models.moe.EXPERT_KINDS`), None for every other operator."""
    return "e" if op.kind in EXPERT_KINDS and "e" in op.dim_names else None


def has_experts(graph: Graph) -> bool:
    """Whether ``graph`` has an operator that expert parallelism splits (:func:`expert_dim`)."""
    return any(expert_dim(op) is not None for op in graph.operators)


def causal_attention(graph: Graph, balanced: bool = True) -> Graph:
    """``graph`` with its attention core (:data:`ATTENTION_CORE` kinds over a query sequence ``s`` and a key
    sequence ``t`` of one extent) under a causal mask (:class:`~shardplan.ir.Causal`): the cost model then
    charges the masked work, the busiest device's share (``balanced``: the sequence dealt out in 2 cp chunks,
    as Megatron-LM and Llama 3 do; False: contiguous blocks). The zoo's builders leave attention unmasked
    (the work of the whole domain)."""
    from shardplan.ir import Causal

    def mark(op: Operator) -> Operator:
        ext = op.extents
        if op.kind in ATTENTION_CORE and "s" in ext and "t" in ext and ext["s"] == ext["t"]:
            return replace(op, causal=Causal("s", "t", balanced))
        return op

    return Graph(graph.name, tuple(mark(op) for op in graph.operators), graph.graph_inputs, graph.ties,
                 graph.recomputed)


def megatron_layout(op: Operator, levels: tuple[int, ...], dp: int, tp: int, sp: bool = False,
                    ep: int = 1, cp: int = 1) -> Layout:
    """Megatron-LM's layout of ``op`` on machine levels ``levels`` with ``dp`` × ``tp`` devices.

    Per machine level l (innermost first) the tensor group takes ``tp_l`` ways (``tp`` filled from the inside)
    and the data-parallel group ``dp_l`` of the rest (``dp`` filled from the inside of what is left); the
    operator splits its model dimension (:func:`model_dim`) ``tp_l`` and its batch dimension ``dp_l`` ways on
    level l. Inside a level the model dimension is the more significant: a level's devices are
    interchangeable in the machine model (one bandwidth per level: a node's NVSwitch), so this numbering is
    Megatron-LM's (rank = data rank · tp + tensor rank) relabelled inside each level, chosen because a level's
    replicas are the most significant part of its position (:mod:`shardplan.layout`): the norms, replicated
    over the tensor group, then hold the same batch rows as the tensor-parallel operators, as in Megatron-LM
    (no redistribution between them; the other nesting would charge one that Megatron-LM does not run).
    With ``sp`` (sequence parallelism) an operator without a model dimension splits its sequence dimension
    ``s`` in the tensor group's place, and a layout that splits a reduction it can defer is partial
    (:func:`shardplan.configs.with_partial`).

    With ``ep`` > 1 an expert operator (:func:`expert_dim`) splits ``e`` ``ep_l`` ways and its batch
    ``dp_l / ep_l`` ways on level l, ``ep`` filled from the inside of the data shares ``dp_l``, ``e`` the least
    significant: data rank = batch rank · ep + expert rank, so each expert group is ``ep`` consecutive data
    ranks, whose tokens it exchanges by all-to-all.

    With ``cp`` > 1 (context parallelism, Megatron-LM's rank order tp-cp-dp) ``cp`` is filled from the inside
    of the non-tensor shares ``dp_l`` (``dp`` is then data × context devices): every operator splits its
    sequence dimension (:func:`sequence_dim`: ``s``, or ``t`` for the key/value projections) ``cp_l`` ways
    and its batch the remaining ``dp_l / cp_l``; attention's scores and context split their query sequence
    ``s`` and keep the key sequence ``t`` whole, so the keys and values reach them by an all-gather over the
    context group (Llama 3's all-gather context parallelism, Dubey et al. 2024 §3.3.2).
    Raises :class:`ShardplanError` when a split does not divide its dimension.
    """
    from shardplan.baselines import batch_dim
    from shardplan.configs import with_partial

    tps, dps = _level_ways(levels, dp, tp)
    names = op.dim_names
    md, bd, ed = model_dim(op), batch_dim(op), expert_dim(op)
    if sp and md is None and "s" in names:
        md = "s"
    cps = _inner_ways(dps, cp, "cp") if cp > 1 else (1,) * len(levels)
    cd = sequence_dim(op) if cp > 1 else None
    eps = (1,) * len(levels)
    if ed is not None and ep > 1:
        eps = _inner_ways(dps, ep, "ep")
    rows = [[1] * len(names) for _ in levels]
    orders = []
    for lvl in range(len(levels)):
        if bd is not None:
            rows[lvl][names.index(bd)] *= dps[lvl] // eps[lvl] // cps[lvl]
        if md is not None:
            rows[lvl][names.index(md)] *= tps[lvl]
        if cd is not None:
            rows[lvl][names.index(cd)] *= cps[lvl]
        if ed is not None:
            rows[lvl][names.index(ed)] *= eps[lvl]
        orders.append(tuple(names.index(d) for d in dict.fromkeys(_nesting(md, bd, cd, ed, tps[lvl], cps[lvl], sp))
                            if d is not None and rows[lvl][names.index(d)] > 1))
    for j, (d, extent) in enumerate(op.dims):
        ways = math.prod(r[j] for r in rows)
        if extent % ways:
            raise ShardplanError(f"recipe: operator {op.name!r} cannot split {d}={extent} {ways} ways "
                                 f"(dp={dp}, tp={tp}, ep={ep}, cp={cp})")
    lay = Layout(names, levels, tuple(tuple(r) for r in rows), tuple(orders))
    return with_partial(op, [lay])[-1] if sp else lay


def _nesting(md: str | None, bd: str | None, cd: str | None, ed: str | None, tp_l: int, cp_l: int,
             sp: bool) -> tuple[str | None, ...]:
    """The dims of :func:`megatron_layout` on one level, most significant first: the model dim (where the tensor
    group splits this level), the batch, the sequence (context), the experts. With ``sp`` a sequence-split norm's
    ``s`` is the model dim and the context dim at once: it sits where the tensor group is on a level the tensor
    group splits, else in the context group's place (after the batch, as every other operator's ``s``), so that
    its tiles are the tensor-parallel operators' tiles cut over the tensor group only. On a level that both the
    tensor and the context group split, the context part of ``s`` nests outside the tensor part (a norm's
    sequence chunk is context rank · tp + tensor rank, Megatron-LM's order), so there every operator puts its
    sequence dim first."""
    if sp and tp_l > 1 and cp_l > 1:
        return (cd, md, bd, ed)
    return (md if tp_l > 1 else None, bd, cd, ed)


def _inner_ways(dps: tuple[int, ...], ways: int, key: str) -> tuple[int, ...]:
    """Per level, ``ways`` (ep or cp) filled from the inside of the non-tensor shares ``dps``."""
    out = level_products(ways, dps)
    if out is None:
        raise ShardplanError(f"recipe: {key}={ways} does not fill the data-parallel group's levels {dps} from the "
                             f"inside (it must divide {math.prod(dps)})")
    return out


def sequence_dim(op: Operator) -> str | None:
    """The dimension context parallelism splits: the sequence ``s``, else ``t`` (the key/value projections'
    sequence); None for an operator without one."""
    names = op.dim_names
    return "s" if "s" in names else "t" if "t" in names else None


def megatron_layouts(tables: Any, dp: int, tp: int, sp: bool = False, ep: int = 1, cp: int = 1) -> dict[str, Layout]:
    """:func:`megatron_layout` of every operator of ``tables``; raises :class:`ShardplanError` when one is not a
    candidate of the tables (then the recipe is not in their space: say so rather than cost another layout)."""
    levels = tuple(tables.machine.levels)
    out: dict[str, Layout] = {}
    for i, op in enumerate(tables.graph.operators):
        lay = megatron_layout(op, levels, dp, tp, sp, ep, cp)
        if lay not in tables.layouts[i]:
            raise ShardplanError(f"recipe: the layout {lay.describe()} of operator {op.name!r} is not in "
                                 f"shardplan's space on {levels} devices")
        out[op.name] = lay
    return out


def megatron_candidates(levels: tuple[int, ...], dp: int, tp: int, orders: str,
                        sp: bool = False, ep: int = 1, cp: int = 1) -> Callable[[Operator], tuple[Layout]]:
    """``candidates(op)`` for :func:`shardplan.cost.build_tables`: the one layout :func:`megatron_layout`, after
    checking that it is among the operator's layouts in shardplan's space (:func:`shardplan.configs.layouts`
    with every split, ``node_replicas`` and ``orders``, and their partial copies with ``sp``), so the recipe's
    tables cost exactly that plan of the space without building the rest of it. Identical operators are
    checked once."""
    from shardplan.configs import layouts, with_partial
    from shardplan.cost import operator_key

    checked: dict[tuple, Layout] = {}

    def candidates(op: Operator) -> tuple[Layout]:
        key = operator_key(op)
        if key not in checked:
            lay = megatron_layout(op, levels, dp, tp, sp, ep, cp)
            space = layouts(op, levels, 1, orders=orders, node_replicas=True)
            if lay not in (with_partial(op, space) if sp else space):
                raise ShardplanError(f"recipe: the layout {lay.describe()} of operator {op.name!r} is not in "
                                     f"shardplan's space on {levels} devices")
            checked[key] = lay
        return (checked[key],)

    return candidates


# -- the memory choices --------------------------------------------------------------------------------
def recompute_names(graph: Graph, recompute: str | int) -> list[str]:
    """The operators that recompute under policy ``recompute`` (module docstring): ``full`` every operator of the
    repeated blocks, ``selective`` their attention core, N the operators of the graph's first N blocks."""
    from shardplan.pipeline.stages import unit_prefix

    if recompute == "none":
        return []
    block = [(op, unit_prefix(op.name)) for op in graph.operators]
    if recompute == "full":
        return [op.name for op, u in block if u is not None]
    if recompute == "selective":
        names = [op.name for op, u in block if u is not None and op.kind in ATTENTION_CORE]
        if not names:
            raise ShardplanError("recipe: recompute=selective, but the model has no attention core "
                                 f"({', '.join(ATTENTION_CORE)}) in its blocks")
        return names
    first: list[str] = []
    for _, u in block:
        if u is not None and u not in first:
            first.append(u)
    keep = set(first[: int(recompute)])
    return [op.name for op, u in block if u in keep]


# -- the model -------------------------------------------------------------------------------------------
def _resolve(model: Any, batch: int | None, sizes: Mapping[str, Any] | None
             ) -> tuple[Callable[[int], Graph] | None, Graph | None, int | None, str]:
    """(builder or None, the one graph given or None, default batch, name)."""
    if isinstance(model, str):
        from shardplan.models import model_spec

        spec = model_spec(model)
        extra = dict(sizes or {})
        return (lambda b: spec.build(b, **extra)), None, spec.batch, spec.name
    if sizes:
        raise ShardplanError("cost_recipe: sizes= applies to a zoo model given by name")
    if isinstance(model, Graph):
        return None, model, None, model.name
    if callable(model):
        return model, None, None, getattr(model, "__name__", "model")
    raise ShardplanError(f"cost_recipe: model must be a zoo name, a shardplan Graph or a builder build(batch) -> "
                         f"Graph, got {type(model).__name__}")


def _batch_of(recipe: Recipe, batch: int | None, default: int | None, graph: Graph | None) -> int:
    """The global batch: the recipe's gbs, ``batch``, the graph's or the model's (they must agree)."""
    from shardplan.baselines import batch_dim

    given = {k: v for k, v in (("gbs", recipe.gbs), ("batch", batch)) if v is not None}
    if graph is not None:
        dims = {d: e for op in graph.operators for d, e in op.dims if d == batch_dim(op)}
        if len(set(dims.values())) == 1:
            given["graph"] = next(iter(dims.values()))
    if len(set(given.values())) > 1:
        raise ShardplanError(f"recipe: the global batch is given differently: "
                             f"{', '.join(f'{k} {v}' for k, v in given.items())}")
    if given:
        return int(next(iter(given.values())))
    if default is None:
        raise ShardplanError("recipe: give the global batch (gbs=, or batch=)")
    return int(default)


def chunk_sizes(blocks: int, pp: int, vp: int = 1, first: int | None = None, last: int | None = None,
                embedding_as_layer: bool = False, loss_as_layer: bool = False) -> tuple[int, ...]:
    """Layers of each of the pp · vp chunks in model order (chunk j on pipeline rank j mod pp), as Megatron-Core
    splits ``blocks`` transformer layers (``get_num_layers_to_build`` and ``get_transformer_layer_offset`` of
    megatron/core/transformer/transformer_block.py and transformer_layer.py).

    The embedding (``embedding_as_layer``) and the head with the loss (``loss_as_layer``) count as one layer
    each: the split is of ``n = blocks + [embedding] + [loss]`` layers, the first chunk's first layer being the
    embedding and the last chunk's last the loss. Without ``first`` / ``last``, each rank takes n / pp and each
    chunk n / (pp vp) (both must divide). With ``first`` (``last``), pipeline rank 0 (pp - 1) takes that many
    blocks, the other ranks the rest evenly, and each rank's count splits evenly over its vp chunks (Megatron-Core
    gives the uneven count to *every* virtual stage of the first / last rank); Megatron-Core refuses them
    together with a layer-counted embedding or loss. Raises :class:`ShardplanError` where Megatron-Core asserts.
    """
    uneven = first is not None or last is not None
    if uneven and (embedding_as_layer or loss_as_layer):
        raise ShardplanError("recipe: first_stage_layers / last_stage_layers cannot be combined with "
                             "embedding_as_layer / loss_as_layer (Megatron-Core refuses both together)")
    if uneven:
        left = pp - (first is not None) - (last is not None)
        rest = blocks - (first or 0) - (last or 0)
        if rest < 0 or (left == 0 and rest) or (left and rest % left):
            raise ShardplanError(f"recipe: {blocks} blocks do not split into first {first}, last {last} and "
                                 f"{left} even stages between")
        per_rank = [rest // left if left else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        n = blocks + embedding_as_layer + loss_as_layer
        if n % pp:
            counted = " (counting " + " and ".join(w for w, f in (("the embedding", embedding_as_layer),
                                                                 ("the loss", loss_as_layer)) if f) + ")"
            raise ShardplanError(f"recipe: {n} layers{counted if n != blocks else ''} do not split evenly into "
                                 f"pp={pp} (give first_stage_layers / last_stage_layers, or embedding_as_layer / "
                                 f"loss_as_layer)")
        per_rank = [n // pp] * pp
    bad = [r for r in per_rank if r % vp]
    if bad:
        raise ShardplanError(f"recipe: a pipeline rank's {bad[0]} layers do not split evenly into vp={vp} chunks "
                             f"(ranks hold {per_rank})")
    return tuple(per_rank[j % pp] // vp for j in range(pp * vp))


def _stage_bounds(recipe: Recipe, units: int) -> list[int]:
    """Unit boundaries of the pp · vp stages or chunks (:func:`chunk_sizes`): units 0 and U - 1 are the embedding
    and the head; a layer-counted one is the first / last layer of the split, otherwise it rides with the first
    / last chunk."""
    emb, loss = recipe.embedding_as_layer, recipe.loss_as_layer
    sizes = chunk_sizes(units - 2, recipe.pp, recipe.vp, recipe.first_stage_layers, recipe.last_stage_layers,
                        emb, loss)
    off = 0 if emb else 1  # unit of split position x: x + off
    cum = [0]
    for sz in sizes:
        cum.append(cum[-1] + sz)
    bounds = [0] + [c + off for c in cum[1:-1]] + [units]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ShardplanError(f"recipe: a pipeline stage or chunk would hold nothing (layers per chunk {sizes})")
    return bounds


# -- costing ---------------------------------------------------------------------------------------------
TABLE_OPTIONS = {"cutoff": 1, "orders": "row-major", "node_replicas": True}
"""The space a recipe's layouts must belong to: every split allowed, Megatron-LM's norms (``node_replicas``);
``orders`` becomes "all" when a level holds both a tensor and a data split (:func:`table_options`)."""


def table_options(machine: Machine, tp: int, dp: int, sp: bool = False, ep: int = 1, cp: int = 1,
                  overlap_tp: bool = False, cp_algo: str = "allgather") -> dict[str, Any]:
    """:func:`shardplan.cost.build_tables` options of a stage of ``tp`` × ``dp`` devices on ``machine``'s levels:
    :data:`TABLE_OPTIONS` with the model dimension nested outside the batch inside a level
    (:func:`megatron_layout`: a candidate only with every order), and the recipe's layouts as the candidates
    (:func:`megatron_candidates`); ``overlap_tp``: the tensor-parallel collectives overlapped with the products
    (``overlap=tp_comm``); ``cp_algo``: the tables' ``context`` (``ring``: the keys and values passed around
    the context group, :mod:`shardplan.cost.ring`)."""
    levels = tuple(replace(machine, num_devices=tp * dp).levels)
    tps, dps = _level_ways(levels, dp, tp)
    orders = "all" if any(t > 1 and d > 1 for t, d in zip(tps, dps)) else "row-major"
    return {**TABLE_OPTIONS, "orders": orders, "candidates": megatron_candidates(levels, dp, tp, orders, sp, ep, cp),
            **({"overlap_tp": True} if overlap_tp else {}), **({"context": cp_algo} if cp_algo != "allgather" else {})}


def overlaps_tp(recipe: "Recipe") -> bool:
    """Whether the recipe overlaps its tensor-parallel collectives with the products (``overlap=tp_comm``)."""
    return recipe.overlap is not None and "tp_comm" in recipe.overlap


def cost_recipe(model: Any, machine: Machine, recipe: Recipe | str, batch: int | None = None,
                sizes: Mapping[str, Any] | None = None) -> Any:
    """The :class:`~shardplan.result.Plan` of ``recipe`` on ``machine``, costed by the search's model (module
    docstring); ``solver="recipe"``, no lower bound, its memory against the machine's (a recipe that does not
    fit is costed and reported, not refused).

    Args:
        model: a zoo name (``sizes`` overriding its defaults), a builder ``build(batch) -> Graph``, or a
            :class:`~shardplan.ir.Graph` (one program only: a pipeline needs the model at its micro-batch size).
        recipe: a :class:`Recipe` or its text.
        batch: the global batch (must agree with the recipe's ``gbs`` when both are given).

    Raises:
        ShardplanError: a part of the recipe with no exact counterpart (named), degrees that do not multiply to
            the devices, a batch that does not split into micro-batches, a layout outside the space.
    """
    if isinstance(recipe, str):
        recipe = Recipe.parse(recipe)
    if not isinstance(recipe, Recipe):
        raise ShardplanError(f"cost_recipe: recipe must be a Recipe or its text, got {type(recipe).__name__}")
    if not isinstance(machine, Machine):
        raise ShardplanError(f"cost_recipe: machine must be a shardplan Machine, got {type(machine).__name__}")
    why = refusal(recipe, machine)
    if why is not None:
        raise ShardplanError(f"recipe {recipe}: not expressible: {why}")
    machine = recipe_machine(recipe, machine)
    t0 = time.perf_counter()
    build, graph, default, name = _resolve(model, batch, sizes)
    if recipe.runtime == "megatron_te":
        graph = None if graph is None else runtime_graph(graph, recipe, machine.dtype_bytes)
        build = None if build is None else _runtime_builder(build, recipe, machine.dtype_bytes)
    gbs = _batch_of(recipe, batch, default, graph)
    p = machine.num_devices
    mp = recipe.tp * recipe.cp * recipe.pp
    if p % mp:
        raise ShardplanError(f"recipe {recipe}: tp × cp × pp = {mp} does not divide the {p} devices")
    dp = p // mp if recipe.dp is None else recipe.dp
    if dp * mp != p:
        raise ShardplanError(f"recipe {recipe}: tp × cp × pp × dp = {mp * dp}, not the {p} devices")
    if gbs % (dp * recipe.mbs):
        raise ShardplanError(f"recipe {recipe}: the global batch {gbs} is not a multiple of dp × mbs = "
                             f"{dp} × {recipe.mbs}")
    m = gbs // (dp * recipe.mbs)
    if recipe.ep > 1:
        if dp % recipe.ep:
            raise ShardplanError(f"recipe {recipe}: ep={recipe.ep} does not divide the data-parallel degree dp={dp} "
                                 "(the expert groups split the data-parallel group)")
        if not has_experts(graph if graph is not None else build(dp * recipe.mbs)):  # type: ignore[misc]
            raise ShardplanError(f"recipe {recipe}: not expressible: expert parallelism (ep={recipe.ep}): model "
                                 f"{name!r} has no experts (no mixture-of-experts layer to split)")
    if recipe.pp == 1:
        if graph is None:
            assert build is not None
            graph = build(gbs)
        out = _cost_one_program(graph, machine, recipe, dp, m, name, gbs)
    else:
        if build is None:
            raise ShardplanError(f"recipe {recipe}: a pipeline needs the model at its micro-batch size: give a zoo "
                                 f"name or a builder build(batch) -> Graph, not one graph")
        out = _cost_pipeline(build, machine, recipe, dp, m, name, gbs)
    stats = {**dict(out.stats), "recipe": str(recipe), "data_parallel": dp, "plan_seconds": time.perf_counter() - t0}
    budget = machine.memory_bytes
    memory = {**dict(out.memory), "budget_bytes": float(budget) if budget else float("inf")}
    return replace(out, solver="recipe", lower_bound=None, stats=stats, memory=memory, batch=gbs)


def recipe_machine(recipe: Recipe, machine: Machine) -> Machine:
    """``machine`` with the runtime behaviour the recipe states: its overlaps
    (:attr:`~shardplan.machine.Machine.overlap_grad`, :attr:`~shardplan.machine.Machine.overlap_dgrad`) and its
    gradient accumulation (:attr:`~shardplan.machine.Machine.grad_accum_bytes`: 0 for ``fused``, two reads and
    one write of an element, ``3 × dtype_bytes``, for ``autograd``); what it leaves unsaid, the machine's."""
    if recipe.overlap is not None:
        machine = replace(machine, overlap_grad="grad_reduce" in recipe.overlap,
                          overlap_dgrad="dgrad" in recipe.overlap)
    if recipe.grad_accum is not None:
        machine = replace(machine, grad_accum_bytes=3.0 * machine.dtype_bytes if recipe.grad_accum == "autograd"
                          else 0.0)
    return machine


def precision_choices(recipe: Recipe, graph: Graph | None = None) -> dict[str, Any]:
    """The keywords of :func:`shardplan.fit.plan_with_choices` for the recipe's precision, offload and ZeRO-3
    runtime (``zero_regather``, ``zero_grad_reduce``); with ``runtime=megatron_te`` the FP8 products of
    ``graph``'s blocks (:func:`fp8_names`) and the producers' FP8 copies (``fp8_saved_inputs=False``); the FP8
    weights' storage and scaling (``fp8_params``, ``fp8_scaling``) as the tables' rules (``offer``)."""
    from shardplan.cost.memory import ChoiceRules

    fp8: bool | list[str] = recipe.precision == "fp8"
    te = recipe.runtime == "megatron_te"
    out: dict[str, Any] = {}
    if te:
        if graph is None:
            raise ShardplanError("precision_choices: runtime=megatron_te needs the graph (its FP8 products)")
        fp8 = sorted(fp8_names(graph)) if fp8 else False
    if te or recipe.fp8_params or recipe.fp8_scaling != "delayed":
        out["offer"] = ChoiceRules(fp8_saved_inputs=not te, fp8_params=recipe.fp8_params,
                                   fp8_scaling=recipe.fp8_scaling)
    return {"fp8": fp8, "offload": recipe.offload,
            "master_weights": recipe.precision is not None, "zero3_regather": recipe.zero_regather,
            "zero3_grad_allreduce": recipe.zero_grad_reduce == "allreduce", **out}


def fp8_names(graph: Graph) -> frozenset[str]:
    """The matrix products Megatron-Core runs in FP8 under Transformer Engine (``runtime=megatron_te``): those of
    the repeated blocks (its ``TransformerLayer``'s TE linear layers). The embedding is a gather and the output
    layer a Megatron-Core ``ColumnParallelLinear`` (not a TE module): both stay in the machine's precision."""
    from shardplan.cost.memory import fp8_product
    from shardplan.pipeline.stages import unit_prefix

    return frozenset(op.name for op in graph.operators if unit_prefix(op.name) is not None and fp8_product(op))


def runtime_graph(graph: Graph, recipe: Recipe, element_bytes: int) -> Graph:
    """``graph`` with the ``saved`` of ``recipe.runtime`` (``megatron_te``: :func:`shardplan.cost.memory.te_saved`
    with the recipe's FP8 products and, unchanged, the operators that recompute: every block operator for
    ``recompute=full``, the attention core for ``selective``, for N the first N blocks of the one program or of
    each pipeline stage or chunk, :func:`recomputed_blocks`), its grouped-query attentions' q, k and v products
    fused into Megatron-Core's one ``linear_qkv`` (:func:`fused_gqa_qkv`) where the recipe has no context group
    (``cp=1``: with one, the values' edge across the context group is a sliced read of the fused output, which
    the edge model charges above the all-gather or ring of the values' own tensor; docs/fidelity.md,
    "Megatron-Core's fused linear_qkv"); ``graph`` itself for ``shardplan``."""
    from shardplan.cost.memory import te_saved
    from shardplan.pipeline.stages import unit_prefix

    if recipe.runtime != "megatron_te":
        return graph
    rec = recipe.recompute
    if rec == "selective":
        keep = frozenset(recompute_names(graph, rec))
    elif rec == "none":
        keep = frozenset()
    elif rec == "full":
        keep = frozenset(op.name for op in graph.operators if unit_prefix(op.name) is not None)
    else:
        chosen = recomputed_blocks(graph, recipe)
        keep = frozenset(op.name for op in graph.operators if unit_prefix(op.name) in chosen)
    fp8 = fp8_names(graph) if recipe.precision == "fp8" else frozenset()
    try:
        saved = te_saved(graph, fp8, keep, element_bytes)
    except ShardplanError as e:
        raise ShardplanError(f"recipe {recipe}: not expressible: {e}") from None
    if recipe.cp > 1:  # the values' edge over the context group would be a sliced read: charged above their own
        return saved
    try:
        return fused_gqa_qkv(saved)
    except ShardplanError as e:
        raise ShardplanError(f"recipe {recipe}: not expressible: {e}") from None


def fused_gqa_qkv(graph: Graph) -> Graph:
    """``graph`` with each grouped-query attention of the zoo's Llama (:func:`shardplan.models.llama.gqa_attention`
    with FlashAttention: ``{p}q``, ``{p}k``, ``{p}v`` reading one input, then ``{p}rope_q``, ``{p}rope_k`` and
    ``{p}attention``) computing its queries, keys and values in one product ``{p}qkv``, as Megatron-Core runs
    them under Transformer Engine (one ``linear_qkv``, a ``LayerNormLinear``); every other operator unchanged.

    The product is ``bsd,dhck->bshck`` with weight (d, g, r + 2, K): per key/value group h its r query heads,
    then its key, then its value along c (Megatron-Core's [ng, (np/ng + 2) hn] output, so tensor parallelism
    splits the groups as it split the three products). ``rope_q`` reads c as its query heads r at offset 0,
    ``rope_k`` and the attention's values read it at offsets r and r + 1 through a dimension ``c`` of extent 1
    (sliced reads, ``AxisMap(partial=True)``, as :func:`shardplan.models._blocks.attention`'s fused Megatron-LM
    product is read); ``rope_k``'s output keeps that (1) axis, so the attention reads its keys and its values
    through the same dimensions (one group of ring inputs under context parallelism, :mod:`shardplan.cost.ring`). FLOPs and parameters are the three products' (2 B s d g (r + 2) K, d g (r + 2) K); the
    input is read, cast to FP8 and its gradient reduced once instead of three times. ``saved`` (in tiles of
    the output) is the three products' kept elements over the fused output's, ``(r s_q + s_k + s_v) / (r + 2)``,
    so what the step keeps is unchanged (all three split as the product is). A graph without this pattern is
    returned as it is.
    """
    from shardplan import ops
    from shardplan.ir import AxisMap, TensorRef

    by_name = {op.name: op for op in graph.operators}
    fused: dict[str, Operator] = {}  # operator name -> its replacement
    drop: set[str] = set()
    for att in graph.operators:
        if att.kind != "attn_flash" or not att.name.endswith("/attention"):
            continue
        p = att.name[: -len("attention")]
        q, k, v = (by_name.get(f"{p}{n}") for n in ("q", "k", "v"))
        rq, rk = by_name.get(f"{p}rope_q"), by_name.get(f"{p}rope_k")
        if None in (q, k, v, rq, rk) or len({t.src for o in (q, k, v) for t in o.inputs}) != 1 \
                or rq.inputs[0].src != q.name or rk.inputs[0].src != k.name or att.inputs[2].src != v.name \
                or len(q.weights[0].shape) != 4:
            continue
        if len({n in graph.recomputed for n in (q.name, k.name, v.name)}) != 1:
            raise ShardplanError(f"operator {q.name!r}: the query, key and value products of {p!r} must all "
                                 "recompute or none (one fused product)")
        d, g, r, kd = q.weights[0].shape
        x = q.inputs[0]
        qkv = ops.einsum(f"{p}qkv", "bsd,dhck->bshck", TensorRef(x.src, x.shape, needs_grad=x.needs_grad),
                         ops.Param((d, g, r + 2, kd)), kind="attn_proj")
        qkv = replace(qkv, saved=(r * float(q.saved) + float(k.saved) + float(v.saved)) / (r + 2))
        out = qkv.output.shape

        def read(op: Operator, slot: int, dim: str, offset: int) -> Operator:
            t = op.inputs[slot]
            axes = t.axes[:3] + (AxisMap(dim, offset=offset, partial=True),) + t.axes[3:]
            ins = list(op.inputs)
            ins[slot] = replace(t, shape=out, axes=axes, src=qkv.name)
            dims = op.dims if dim in op.dim_names else op.dims + ((dim, 1),)
            return replace(op, inputs=tuple(ins), dims=dims)

        rq_axes = rq.inputs[0].axes
        rope_k = read(rk, 0, "c", r)  # its output keeps the (1) axis, so keys and values read the same dims
        ko = rope_k.output
        rope_k = replace(rope_k, output=replace(ko, shape=ko.shape[:3] + (1,) + ko.shape[3:],
                                                axes=ko.axes[:3] + (AxisMap("c"),) + ko.axes[3:]))
        core = read(att, 2, "c", r + 1)
        k_in = core.inputs[1]
        core = replace(core, inputs=(core.inputs[0], replace(k_in, shape=rope_k.output.shape,
                                                             axes=k_in.axes[:3] + (AxisMap("c"),) + k_in.axes[3:]),
                                     core.inputs[2]))
        fused[q.name] = qkv
        fused[rq.name] = replace(rq, inputs=(replace(
            rq.inputs[0], shape=out, src=qkv.name,
            axes=rq_axes[:3] + (replace(rq_axes[3], partial=True),) + rq_axes[4:]),))
        fused[rk.name] = rope_k
        fused[att.name] = core
        drop.update((k.name, v.name))
    if not fused:
        return graph
    recomputed = frozenset(fused[n].name if n in fused else n for n in graph.recomputed if n not in drop)
    return Graph(graph.name, tuple(fused.get(op.name, op) for op in graph.operators if op.name not in drop),
                 graph.graph_inputs, graph.ties, recomputed)


def recomputed_blocks(graph: Graph, recipe: Recipe) -> frozenset[str]:
    """The blocks (name prefixes) that ``recompute=N`` recomputes: the first N of the graph (one program), or
    the first N of each of the pp · vp stages or chunks (:func:`_stage_bounds`: unit 0 the embedding, the last
    the head), as :func:`recompute_names` picks them on each stage's graph."""
    from shardplan.pipeline.stages import unit_prefix

    n = int(recipe.recompute)
    blocks = list(dict.fromkeys(u for u in (unit_prefix(op.name) for op in graph.operators) if u is not None))
    if recipe.pp == 1:
        return frozenset(blocks[:n])
    bounds = _stage_bounds(recipe, len(blocks) + 2)
    out: set[str] = set()
    for a, b in zip(bounds, bounds[1:]):
        inside = [blocks[u - 1] for u in range(max(a, 1), min(b, len(blocks) + 1))]
        out.update(inside[:n])
    return frozenset(out)


def _runtime_builder(build: Callable[[int], Graph], recipe: Recipe, element_bytes: int) -> Callable[[int], Graph]:
    """``build`` whose graphs carry :func:`runtime_graph`'s ``saved``."""

    def built(batch: int) -> Graph:
        return runtime_graph(build(batch), recipe, element_bytes)

    return built


def _cost_one_program(graph: Graph, machine: Machine, recipe: Recipe, dp: int, m: int, name: str, gbs: int) -> Any:
    """One SPMD program: Megatron's layouts, then ZeRO, recomputation and m micro-batches by hand."""
    from shardplan.cost import build_tables
    from shardplan.fit import plan_with_choices
    from shardplan.spmd import plan_from_configs
    from shardplan.planner import from_spmd

    recs = recompute_names(graph, recipe.recompute)
    t0 = time.perf_counter()
    dc = dp * recipe.cp  # the non-tensor devices: data × context
    opts = table_options(machine, recipe.tp, dc, recipe.sp, recipe.ep, recipe.cp, overlaps_tp(recipe), recipe.cp_algo)
    tables = replace(build_tables(graph, replace(machine, memory_bytes=None), **opts), machine=machine)
    base = plan_from_configs(tables, megatron_layouts(tables, dc, recipe.tp, recipe.sp, recipe.ep, recipe.cp),
                             name="megatron")
    sp = plan_with_choices(base, stage=recipe.zero, recompute=recs, micro_batches=m, name="recipe",
                           **precision_choices(recipe, graph))
    return from_spmd(replace(sp, build_seconds=time.perf_counter() - t0), model=name, batch=gbs)


def unequal_chunks_simulated(plan: Any) -> Any:
    """An interleaved :class:`~shardplan.pipeline.search.PipelinePlan` whose device groups' chunks are not all of
    one length (forward or backward seconds), with its step the event simulation's over each chunk's own seconds
    (:func:`shardplan.pipeline.schedule.simulate` with ``chunk_times``) instead of the closed form, which takes
    every chunk as 1/v of its group (exact only for equal chunks: docs/pipeline.md, "Unequal chunks"); the
    closed form is kept in ``stats["closed_form_step"]``. Any other plan is returned as it is."""
    from shardplan.pipeline.schedule import StageTimes, makespan, simulate

    if plan.chunks < 2:
        return plan
    n = plan.num_stages // plan.chunks
    chunks = [StageTimes(s.cost.forward, s.cost.backward) for s in plan.stages]
    if all(chunks[j] == chunks[j % n] for j in range(len(chunks))):
        return plan
    step = makespan(simulate(plan.stage_times(), plan.group_links(), plan.micro_batches, "interleaved", plan.chunks,
                             back=plan.group_links(back=True), chunk_times=chunks))
    return replace(plan, step_time=step, stats={**plan.stats, "closed_form_step": plan.step_time,
                                                "step_from": "event simulation, unequal chunks"})


def _cost_pipeline(build: Callable[[int], Graph], machine: Machine, recipe: Recipe, dp: int, m: int, name: str,
                   gbs: int) -> Any:
    """pp stages (× vp chunks) of Megatron's layouts and the recipe's memory choices, evaluated as the search
    evaluates a candidate pipeline."""
    from shardplan.fit import plan_with_choices
    from shardplan.pipeline.api import PipelineResult
    from shardplan.pipeline.search import PipelineSpace, evaluate_pipeline
    from shardplan.pipeline.stages import ModelStages, unit_prefix
    from shardplan.planner import from_pipeline

    t0 = time.perf_counter()
    tp, ep, zero, rec, sp, cp = recipe.tp, recipe.ep, recipe.zero, recipe.recompute, recipe.sp, recipe.cp
    dc = dp * cp  # a stage's non-tensor devices: data × context

    def choices(plan: Any, mb: int) -> Any:
        return plan_with_choices(plan, stage=zero, recompute=recompute_names(plan.graph, rec), micro_batches=1,
                                 accumulate=mb, name="recipe", **precision_choices(recipe, plan.graph))

    stages = ModelStages(build, gbs, replace(machine, memory_bytes=None),
                         table_options(machine, tp, dc, sp, ep, cp, overlaps_tp(recipe), recipe.cp_algo),
                         periodic=False, strategy=lambda t: megatron_layouts(t, dc, tp, sp, ep, cp), choices=choices)
    g, units, _ = stages.graph(m)
    kinds = [unit_prefix(g.operators[idx[0]].name) is not None for idx in units]
    if len(units) < 3 or kinds[0] or kinds[-1] or not all(kinds[1:-1]):
        raise ShardplanError(f"recipe {recipe}: a pipeline needs the model as an embedding, repeated blocks and a "
                             f"head (the zoo's GPT and Llama); this model's units are not")
    bounds = _stage_bounds(recipe, len(units))
    q = tp * dc
    segs = [(bounds[j], bounds[j + 1], q) for j in range(len(bounds) - 1)]
    space = PipelineSpace(len(units), machine.num_devices, machine.node_size, (m,), None)
    schedule = "interleaved" if recipe.vp > 1 else "1f1b"
    pp = evaluate_pipeline(segs, m, space, stages.stage_cost, stages.link_time, stages.exchange_time,
                           schedule=schedule, chunks=recipe.vp)
    if pp is None:
        raise ShardplanError(f"recipe {recipe}: a stage cannot be costed on {q} devices")
    pp = unequal_chunks_simulated(pp)
    result = PipelineResult(pp, stages, machine, time.perf_counter() - t0)
    return from_pipeline(result, model=name)  # an interleaved plan's memory is its device groups' (group_memory)
