"""Models and the distributed worker for tests/test_torch_dist.py (gloo on CPU, one process per device).

Each case builds a tiny model and a batch deterministically (same on every
rank), computes the single-process loss and gradients, then the sharded ones
through :func:`shardplan.torch.parallelize`, and reports the differences.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, BATCH, D = 64, 8, 8, 32


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return F.cross_entropy(self.fc3(h), y)


class Unsupported(nn.Module):
    """An MLP with an operator no handler describes (logcumsumexp) inside a submodule."""

    class Scan(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.logcumsumexp(h, dim=-1)

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.scan, self.fc2 = nn.Linear(32, 64), self.Scan(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(self.scan(torch.relu(self.fc1(x)))), y)


class OpsZoo(nn.Module):
    """bmm, baddbmm, einsum, matmul, chunk, cat, index_select, softmax, layer norm, dropout (p=0), permute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.norm = nn.LayerNorm(32)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)                                         # (B, T, 32)
        a, b = h.chunk(2, dim=-1)                                # (B, T, 16) each
        s = torch.bmm(a, b.transpose(1, 2))                      # (B, T, T)
        s = torch.baddbmm(s, a, b.permute(0, 2, 1), alpha=0.5)
        p = torch.softmax(s, dim=-1)
        c = torch.einsum("bts,bsd->btd", p, a)
        c = torch.matmul(c, self.mix)
        h = torch.cat([c, b], dim=-1)                            # (B, T, 32)
        h = self.drop(self.norm(h)).index_select(1, idx)         # (B, T', 32)
        return F.cross_entropy(self.out(h.mean(1)), y)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm, causal SDPA over heads, RMSNorm, SwiGLU; a vocabulary head for the loss."""

    def __init__(self, d: int = D, heads: int = 4, ffn: int = 64, vocab: int = VOCAB) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.norm1 = RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.norm2 = nn.RMSNorm(d)
        self.gate, self.up = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, d))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, groups=2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        h = F.adaptive_avg_pool2d(F.relu(self.conv2(h)), 4)
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), y)


class HFLoss(nn.Module):
    """A transformers causal LM whose forward returns its loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def make_mlp() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(1)
    return MLP(), (torch.randn(BATCH * 2, 32, generator=g), torch.randint(0, 16, (BATCH * 2,), generator=g))


def make_unsupported() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(6)
    return Unsupported(), (torch.randn(BATCH * 2, 32, generator=g), torch.randint(0, 16, (BATCH * 2,), generator=g))


def make_ops_zoo() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(7)
    return OpsZoo(), (torch.randn(BATCH, SEQ, 16, generator=g), torch.tensor([0, 2, 3, 7]),
                      torch.randint(0, 10, (BATCH,), generator=g))


def make_llama_block() -> tuple[nn.Module, tuple]:
    return LlamaBlock(), _tokens(2)


def make_cnn() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(3)
    return CNN(), (torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g))


def make_hf_gpt2() -> tuple[nn.Module, tuple]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=4, use_cache=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return HFLoss(GPT2LMHeadModel(cfg)), _tokens(4)


def make_hf_llama() -> tuple[nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                      attn_implementation="sdpa")
    return HFLoss(LlamaForCausalLM(cfg)), _tokens(5)


def _hf_causal(config_cls: str, model_cls: str, seed: int, attn: str = "sdpa", **kw: Any) -> tuple[nn.Module, tuple]:
    """A tiny transformers model built from its config class (no weights), called as documented:
    ``model(input_ids=ids, labels=labels).loss`` with the library's defaults (the KV cache included)."""
    enter_torchvision()  # transformers imports torchvision where it is installed
    import transformers

    cfg = getattr(transformers, config_cls)(vocab_size=VOCAB, attn_implementation=attn, **kw)
    torch.manual_seed(seed)
    return HFLoss(getattr(transformers, model_cls)(cfg)), _tokens(seed)


_DECODER = {"hidden_size": D, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": SEQ}


def make_hf_gpt2_cache() -> tuple[nn.Module, tuple]:
    return _hf_causal("GPT2Config", "GPT2LMHeadModel", 10, n_positions=SEQ, n_embd=D, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def make_hf_llama_cache() -> tuple[nn.Module, tuple]:
    return _hf_causal("LlamaConfig", "LlamaForCausalLM", 11, num_key_value_heads=2, **_DECODER)


def make_hf_mistral() -> tuple[nn.Module, tuple]:
    return _hf_causal("MistralConfig", "MistralForCausalLM", 12, num_key_value_heads=2, **_DECODER)


def make_hf_qwen2() -> tuple[nn.Module, tuple]:
    return _hf_causal("Qwen2Config", "Qwen2ForCausalLM", 13, num_key_value_heads=2, **_DECODER)


def make_hf_gemma2() -> tuple[nn.Module, tuple]:
    return _hf_causal("Gemma2Config", "Gemma2ForCausalLM", 14, "eager", num_key_value_heads=2, head_dim=8,
                      sliding_window=4, **_DECODER)


def make_hf_phi() -> tuple[nn.Module, tuple]:
    return _hf_causal("PhiConfig", "PhiForCausalLM", 15, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                      **_DECODER)


def make_hf_opt() -> tuple[nn.Module, tuple]:
    return _hf_causal("OPTConfig", "OPTForCausalLM", 16, hidden_size=D, ffn_dim=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=D, dropout=0.0,
                      attention_dropout=0.0, pad_token_id=1)


def make_hf_gpt_neox() -> tuple[nn.Module, tuple]:
    return _hf_causal("GPTNeoXConfig", "GPTNeoXForCausalLM", 17, hidden_dropout=0.0, attention_dropout=0.0,
                      **_DECODER)


def make_hf_falcon() -> tuple[nn.Module, tuple]:
    return _hf_causal("FalconConfig", "FalconForCausalLM", 18, hidden_size=D, num_hidden_layers=2,
                      num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)


def make_hf_bloom() -> tuple[nn.Module, tuple]:
    return _hf_causal("BloomConfig", "BloomForCausalLM", 19, "eager", hidden_size=D, n_layer=2, n_head=4,
                      hidden_dropout=0.0, attention_dropout=0.0)


def make_hf_t5() -> tuple[nn.Module, tuple]:
    return _hf_causal("T5Config", "T5ForConditionalGeneration", 20, "eager", d_model=D, d_kv=8, d_ff=64, num_layers=1,
                      num_decoder_layers=1, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


def make_hf_roberta() -> tuple[nn.Module, tuple]:
    model, (ids, labels) = _hf_causal("RobertaConfig", "RobertaForMaskedLM", 21, hidden_size=D,
                                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=SEQ + 2, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, pad_token_id=1)
    return model, (ids.clamp(min=2), labels)


def make_hf_mixtral() -> tuple[nn.Module, tuple]:
    return _hf_causal("MixtralConfig", "MixtralForCausalLM", 22, num_key_value_heads=2, num_local_experts=4,
                      num_experts_per_tok=2, **_DECODER)


def make_hf_qwen2_moe() -> tuple[nn.Module, tuple]:
    return _hf_causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", 23, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      **_DECODER)


class HardswishNet(nn.Module):
    """MobileNetV3's activations (hardswish, hardsigmoid gate) on a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.act, self.gate = nn.Hardswish(), nn.Hardsigmoid()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        h = self.act(self.fc2(h)) * self.gate(h)
        return F.cross_entropy(self.fc3(h), y)


class MobileNetV3Block(nn.Module):
    """torchvision's MobileNetV3 inverted residual, written out: a fast case for the main environment (which has
    no torchvision; torchvision's own ``mobilenet_v3_small`` runs in tests/torch_hf5): a stem convolution with batch norm and hardswish, then the block: 1x1 expansion + BN + hardswish,
    3x3 depthwise convolution + BN + hardswish, squeeze-and-excitation (global average pool, 1x1 reduce,
    ReLU, 1x1 expand, hardsigmoid gate), 1x1 projection + BN, the residual; a pooled classifier with
    hardswish between its two linear layers, as torchvision's head."""

    def __init__(self, c: int = 16, expand: int = 32, squeeze: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.Hardswish())
        self.expand = nn.Sequential(nn.Conv2d(c, expand, 1, bias=False), nn.BatchNorm2d(expand), nn.Hardswish())
        self.depthwise = nn.Sequential(nn.Conv2d(expand, expand, 3, padding=1, groups=expand, bias=False),
                                       nn.BatchNorm2d(expand), nn.Hardswish())
        self.se_reduce, self.se_expand = nn.Conv2d(expand, squeeze, 1), nn.Conv2d(squeeze, expand, 1)
        self.gate = nn.Hardsigmoid()
        self.project = nn.Sequential(nn.Conv2d(expand, c, 1, bias=False), nn.BatchNorm2d(c))
        self.fc1, self.act, self.fc2 = nn.Linear(c, 32), nn.Hardswish(), nn.Linear(32, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        e = self.depthwise(self.expand(h))
        s = self.gate(self.se_expand(F.relu(self.se_reduce(F.adaptive_avg_pool2d(e, 1)))))
        h = h + self.project(e * s)
        return F.cross_entropy(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(h, 1).flatten(1)))), y)


def make_mobilenetv3_block() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(27)
    torch.manual_seed(27)
    return MobileNetV3Block(), (torch.randn(BATCH * 2, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH * 2,), generator=g))


def make_hardswish() -> tuple[nn.Module, tuple]:
    g = torch.Generator().manual_seed(24)
    return HardswishNet(), (torch.randn(BATCH * 2, 32, generator=g), torch.randint(0, 16, (BATCH * 2,), generator=g))


def enter_torchvision() -> bool:
    """Make ``import torchvision`` give the installed package without running its ``__init__.py``; False when
    torchvision is not installed (the main environment).

    PyPI's torchvision 0.28.0 wheel (the one pip installs beside the CPU
    build of torch 2.13.0 pinned here; the ``+cpu`` build lives on PyTorch's
    own index only) is built against CUDA torch: its C++ extension links
    ``libtorch_cuda.so`` and does not load, and ``torchvision/__init__.py``
    then raises registering fake kernels for the missing ``torchvision::nms``
    and the other detection operators. That breaks every transformers 5 model
    too, since transformers imports torchvision when it is installed. The
    models, the ``torchvision.ops`` building blocks and ``torchvision.transforms``
    are Python modules of the package that do not call those operators, so
    the package is entered with its search path only (as a namespace package
    is) and they load from the installed files unchanged.
    """
    import importlib.util
    import sys
    import types

    if "torchvision" in sys.modules:
        return True
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.submodule_search_locations is None:
        return False
    pkg = types.ModuleType("torchvision")
    pkg.__path__, pkg.__spec__, pkg.__file__ = list(spec.submodule_search_locations), spec, spec.origin
    sys.modules["torchvision"] = pkg
    return True


def torchvision_models() -> Any:
    """``torchvision.models`` (:func:`enter_torchvision`)."""
    import importlib

    if not enter_torchvision():
        raise ImportError("torchvision is not installed (pip install -e '.[hf5]')")
    return importlib.import_module("torchvision.models")


def timm_module() -> Any:
    """``timm``, after :func:`torchvision_models` (timm imports torchvision)."""
    torchvision_models()
    import timm

    return timm


class ImageLoss(nn.Module):
    """An image classifier's cross-entropy loss, as its training loop computes it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


IMAGE, CLASSES = 32, 10


def _images(seed: int, n: int = BATCH * 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def make_tv_mobilenet_v3() -> tuple[nn.Module, tuple]:
    """torchvision's ``mobilenet_v3_small`` at a quarter of its width (8 to 144 channels), no dropout."""
    torch.manual_seed(40)
    model = torchvision_models().mobilenet_v3_small(num_classes=CLASSES, width_mult=0.25, dropout=0.0)
    return ImageLoss(model), _images(40)


def make_timm_vit() -> tuple[nn.Module, tuple]:
    """timm's ``vit_tiny_patch16_224`` on 32 x 32 images in 8 x 8 patches, 2 blocks of width 48."""
    torch.manual_seed(41)
    model = timm_module().create_model("vit_tiny_patch16_224", num_classes=CLASSES, img_size=IMAGE, patch_size=8,
                                       embed_dim=48, depth=2)
    return ImageLoss(model), _images(41)


def make_timm_convnext() -> tuple[nn.Module, tuple]:
    """timm's ``convnext_atto`` with one block per stage of widths 16, 32, 64, 128."""
    torch.manual_seed(42)
    model = timm_module().create_model("convnext_atto", num_classes=CLASSES, depths=(1, 1, 1, 1),
                                       dims=(16, 32, 64, 128))
    return ImageLoss(model), _images(42)


class TinyMoE(nn.Module):
    """A top-2 mixture of experts dispatched as transformers 5 does (tokens sorted by expert, experts'
    weights indexed per token, a batched product, the inverse permutation by ``index_put_``), with a
    running mean over the sequence (``cumsum``) and a load-balancing term from expert counts (``histc``)."""

    def __init__(self, d: int = D, experts: int = 4, top_k: int = 2, ffn: int = 32, vocab: int = VOCAB) -> None:
        super().__init__()
        self.top_k, self.experts = top_k, experts
        self.embed = nn.Embedding(vocab, d)
        self.router = nn.Linear(d, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, d, ffn) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, ffn, d) / ffn ** 0.5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        x = x + torch.cumsum(x, dim=1) / steps
        h = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(h), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order_ids, perm = torch.sort(flat)
        token = torch.floor_divide(perm, self.top_k)
        hs = h[token]
        y = torch.bmm(F.silu(torch.bmm(hs.unsqueeze(1), self.up[order_ids])), self.down[order_ids]).squeeze(1)
        y = y * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse.index_put_((perm,), torch.arange(perm.shape[0]))
        out = y[inverse].view(h.shape[0], self.top_k, -1).sum(1).view_as(x)
        counts = torch.histc(flat.float(), bins=self.experts, min=0, max=self.experts - 1)
        balance = self.experts * (counts / flat.shape[0] * probs.mean(0)).sum()
        logits = self.head(x + out)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)) + 0.01 * balance


class ZeroExtent(nn.Module):
    """A Griffin-like empty intermediate: a ``(B, 0, D)`` slice of the hidden states (recurrentgemma makes a
    ``(8, 0, 128)`` one), scaled and concatenated back, and reduced (a sum over nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.fc, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.embed(ids)))
        empty = h[:, :0, :]
        h = torch.cat([h, 2.0 * empty], dim=1)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + empty.sum()


def make_zero_extent() -> tuple[nn.Module, tuple]:
    torch.manual_seed(26)
    return ZeroExtent(), _tokens(26)


def make_moe() -> tuple[nn.Module, tuple]:
    torch.manual_seed(25)
    return TinyMoE(), _tokens(25)


HF_CASES: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "hf_gpt2_cache": make_hf_gpt2_cache, "hf_llama_cache": make_hf_llama_cache, "hf_mistral": make_hf_mistral,
    "hf_qwen2": make_hf_qwen2, "hf_gemma2": make_hf_gemma2, "hf_phi": make_hf_phi, "hf_opt": make_hf_opt,
    "hf_gpt_neox": make_hf_gpt_neox, "hf_falcon": make_hf_falcon, "hf_bloom": make_hf_bloom, "hf_t5": make_hf_t5,
    "hf_roberta": make_hf_roberta, "hf_mixtral": make_hf_mixtral, "hf_qwen2_moe": make_hf_qwen2_moe,
    "hardswish": make_hardswish, "moe": make_moe, "zero_extent": make_zero_extent,
    "mobilenetv3_block": make_mobilenetv3_block,
    "tv_mobilenet_v3": make_tv_mobilenet_v3, "timm_vit": make_timm_vit, "timm_convnext": make_timm_convnext,
}


CASES: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "mlp": make_mlp, "llama_block": make_llama_block, "cnn": make_cnn, "hf_gpt2": make_hf_gpt2,
    "hf_llama": make_hf_llama, "unsupported": make_unsupported, "ops_zoo": make_ops_zoo, **HF_CASES,
}


def toy_machine(p: int) -> Any:
    """A machine on which splitting tiny models pays (slow compute, fast links), as in tests/test_jax.py."""
    from shardplan.machine import Machine

    return Machine(p, peak_flops=32e9, bandwidth=16e9, latency=0.0, name="toy")


def run_case(name: str, mesh: Any, p: int) -> dict[str, Any]:
    """Single-process reference and sharded run of one case on this rank; the comparison."""
    import shardplan.torch as st

    torch.manual_seed(0)
    model, batch = CASES[name]()
    model.train()
    ref_model = _clone(model)
    loss0 = ref_model(*batch)
    loss0.backward()
    grads0 = {n: p_.grad.detach() for n, p_ in ref_model.named_parameters() if p_.grad is not None}
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan, pm = st.parallelize(_clone(model), batch, mesh, machine=toy_machine(p))
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss = pm(*batch)
    loss.backward()
    step = time.perf_counter() - t0
    return {**compare_with_unsharded(plan, pm, model, loss, loss0, grads0, caught, p),
            "setup_seconds": setup, "step_seconds": step}


def compare_with_unsharded(plan: Any, pm: Any, model: nn.Module, loss: torch.Tensor, loss0: torch.Tensor,
                           grads0: dict[str, torch.Tensor], caught: list, p: int) -> dict[str, Any]:
    """What :func:`assert_runs_as_unsharded` and :func:`assert_nothing_conservative` read, after one forward
    and backward pass of the sharded module ``pm`` (loss ``loss``) and of the unsharded copy of ``model``
    (loss ``loss0``, gradients ``grads0``); ``caught``: the warnings recorded while planning."""
    import shardplan.torch as st

    named = pm.named_dparameters()
    loss, loss0 = loss.detach(), loss0.detach()
    rel_loss = abs(float(loss) - float(loss0)) / max(abs(float(loss0)), 1e-30)
    worst, scale, missing = 0.0, 0.0, []
    layouts_ok = True
    for n, g0 in grads0.items():
        par = named.get(n)
        if par is None or par.grad is None:
            missing.append(n if par is None else n + " (no gradient)")
            continue
        layouts_ok &= tuple(par.grad.placements) == tuple(par.placements)
        g = par.grad.full_tensor()
        worst = max(worst, float((g - g0).abs().max()))
        scale = max(scale, float(g0.abs().max()))
    split_ops = sum(1 for c in plan.configs.values() if max(c) > 1)
    widest = max(math.prod(c) for c in plan.configs.values())
    tiles_ok = _tiles_match(plan, pm, model)
    return {
        "loss": float(loss), "loss0": float(loss0), "rel_loss": rel_loss, "grad_err": worst, "grad_scale": scale,
        "rel_grad": worst / max(scale, 1e-30), "missing": missing, "grad_layouts_ok": bool(layouts_ok), "tiles_ok": tiles_ok,
        "operators": len(plan.graph), "split_ops": split_ops, "world": p, "widest": widest,
        "solve_seconds": plan.solve_seconds,
        "build_seconds": plan.build_seconds, "cost": plan.cost,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, st.ShardplanWarning)],
        "report": st.report(plan, pm.info),
        "conservative": [c.to_dict() for c in pm.info.conservative_ops()],
        "param_placements": {n: [str(x) for x in pl] for n, pl in pm.param_placements.items()},
    }


def assert_runs_as_unsharded(r: dict[str, Any]) -> None:
    """One case's result (:func:`run_case`): no error, loss and gradients equal to one process's, every
    parameter present, the planned tiles held and the gradients laid out like them, some operator split."""
    assert "error" not in r, r.get("error")
    assert r["rel_loss"] <= 1e-5, (r["loss"], r["loss0"])
    assert r["rel_grad"] <= 1e-4, (r["grad_err"], r["grad_scale"])
    assert r["missing"] == []
    assert r["tiles_ok"] and r["grad_layouts_ok"]
    assert r["split_ops"] > 0, "the toy machine makes splitting pay: some operator must be split"


def assert_nothing_conservative(r: dict[str, Any]) -> None:
    """One case's result (:func:`run_case`): no error, no operator described conservatively (no warning, an
    empty list in the plan and no such section in its report)."""
    assert "error" not in r, r.get("error")
    assert r["warnings"] == [], r["warnings"]
    assert r["conservative"] == [], r["conservative"]
    assert "Described conservatively" not in r["report"]


def _tiles_match(plan: Any, pm: Any, model: nn.Module) -> bool:
    """Every rank's shard of every parameter is the tile the cost model gives that device (all ranks agree).

    Checked for parameters whose first reader indexes them plainly (the layout
    replicates axes read through an offset or a window).
    """
    import numpy as np
    import torch.distributed as dist

    from shardplan.cost.tiles import tensor_boxes

    full = dict(model.named_parameters(remove_duplicate=False))
    rank, p = dist.get_rank(), dist.get_world_size()
    ok = True
    for target, par in pm.named_dparameters().items():
        uses = pm.info.param_uses.get(target)
        if not uses:
            continue
        op = plan.graph[uses[0][0]]
        t = next(x for x in op.tensors if x.name == uses[0][1])
        if not all(a.dim is None or a.is_plain or a.inner for a in t.axes):
            continue
        cfg = np.asarray([plan.configs[op.name]])
        order = np.asarray([plan.orders[op.name]])
        box = tensor_boxes(op, t, cfg, p, orders=order)[0, rank]
        want = full[target].detach()[tuple(slice(int(lo), int(hi)) for lo, hi in box)]
        ok &= tuple(par.to_local().shape) == tuple(want.shape) and bool(torch.equal(par.to_local(), want))
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


# the c10d operators DTensor's redistributions and the runners' own collectives desugar into, by kind
COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "allreduce_": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_to_all_single": "all_to_all"}


def collective_recorder() -> Any:
    """A dispatch mode recording ``(kind, group size, local input shape)`` of every collective of
    :data:`COLLECTIVE_KINDS` issued under it on local tensors (DTensor's redistributions desugar into them: the
    mode lets DTensor run first, as torch's ``CommDebugMode`` does). The group is the operator's last
    process-group (or group-name) argument."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int, tuple[int, ...]]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            schema = getattr(func, "_schema", None)
            ns, _, name = (schema.name if schema is not None else "").partition("::")
            if "c10d" in ns and name in COLLECTIVE_KINDS:
                first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
                group = [a for a in list(args) + list((kwargs or {}).values())
                         if isinstance(a, (str, dist.ProcessGroup))][-1]
                size = (_resolve_process_group(group) if isinstance(group, str) else group).size()
                self.seen.append((COLLECTIVE_KINDS[name], int(size), tuple(first.shape)))
            return func(*args, **(kwargs or {}))

    return Record()


def planned_on_rank_0(make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """A plan made once and shipped: ``make()`` (a :class:`shardplan.Plan` and anything else) runs on rank 0 of
    the default process group, and every rank gets that plan back from its JSON (``Plan.from_json``), as a
    job's processes load a plan made before the job; rank 0's other result, None elsewhere.

    Planning is deterministic: the other ranks would find the same plan at the same cost (on 2 CPU cores, 3 of
    4 processes' planning time saved). Every rank planning for itself is what ``st.parallelize`` does in
    the tests that call it (tests/torch_engine/test_torch_names.py, test_torch_dist.py, test_hf_models.py)."""
    import torch.distributed as dist

    from shardplan import Plan

    box: list[Any] = [None]
    extra = None
    if dist.get_rank() == 0:
        plan, extra = make()
        box[0] = plan.to_json()
    dist.broadcast_object_list(box, src=0)
    return Plan.from_json(box[0]), extra


def _clone(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _run_on_mesh(name: str, world: int) -> dict:
    """One case of this module on a 1-D device mesh of every process."""
    from torch.distributed.device_mesh import init_device_mesh

    return run_case(name, init_device_mesh("cpu", (world,)), world)


def worker(rank: int, world: int, port: int, names: list[str], out_path: str,
           run_one: Callable[[str, int], dict] = _run_on_mesh) -> None:
    """Entry point of one spawned gloo process: ``run_one(name, world)`` for every case (an exception
    becomes that case's ``error``); rank 0 writes the results as JSON, and with ``SHARDPLAN_CASE_CPU_LOG`` set
    appends each case's CPU seconds to that file (docs/testing.md)."""
    import logging
    import sys

    import torch.distributed as dist

    if "torch_preload" not in sys.modules:  # a fork of the fork server (start_fork_server) that preloaded nothing
        raise RuntimeError("the fork server did not import tests/torch_preload.py (an ImportError in it, or tests/ "
                           "not on its path): every gloo process would import torch and transformers again")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name in names:
            cpu = time.process_time()
            try:
                results[name] = run_one(name, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            if rank == 0 and os.environ.get("SHARDPLAN_CASE_CPU_LOG"):  # where a launch's CPU seconds go
                with open(os.environ["SHARDPLAN_CASE_CPU_LOG"], "a") as f:
                    f.write(f"{name}\t{time.process_time() - cpu:.1f}\n")
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_fork_server() -> None:
    """Start this process's multiprocessing fork server (once; later calls find it running) with
    ``tests/torch_preload.py`` imported in it.

    The fork server is a fresh interpreter (``python -c``) that imports the preload modules by name and drops
    those that raise ImportError without a word; Python 3.11 hands it the parent's ``sys.path`` but does not
    apply it, so ``torch_preload`` (in tests/, on pytest's ``sys.path`` only) was not found and every gloo
    process imported torch, shardplan and transformers itself (measured: 27 of rank 0's 45 profiled seconds on
    the GPT-2 case of ``test_torch_names.py``). Its environment is this process's: tests/ is put on its
    ``PYTHONPATH`` while it starts, then this process's variable is restored."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(["torch_preload"])
    before = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here, before] if before else [here])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run_distributed(names: list[str], world: int, out_path: str,
                    run_one: Callable[[str, int], dict] = _run_on_mesh) -> dict[str, Any]:
    """Start ``world`` gloo processes running ``run_one`` on every name (a module-level function, so
    that the processes can import it); returns rank 0's results.

    The processes are forked from a fork server (one per pytest process, kept between launches) that has
    imported torch, shardplan and transformers once (``tests/torch_preload.py``), not started as fresh
    interpreters that each import them again."""
    import torch.multiprocessing as mp

    start_fork_server()
    mp.start_processes(worker, args=(world, free_port(), names, out_path, run_one), nprocs=world, join=True,
                       start_method="forkserver")
    with open(out_path) as f:
        return json.load(f)


if __name__ == "__main__":  # python tests/torch_cases.py 8 llama_block ...
    import sys

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    names = sys.argv[2:] or list(CASES)
    res = run_distributed(names, world, "/tmp/shardplan_torch_cases.json")
    for k, v in res.items():
        if "error" in v:
            print(k, "ERROR\n", v["error"])
        else:
            print(k, {x: v[x] for x in ("rel_loss", "rel_grad", "grad_err", "operators", "split_ops", "solve_seconds",
                                        "build_seconds", "setup_seconds", "step_seconds", "missing", "grad_layouts_ok", "tiles_ok")})
            print(v["report"])
            for w in v["warnings"]:
                print("  W:", w)
