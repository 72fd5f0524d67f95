"""The activation memory of today's Hugging Face models (transformers 5) against what autograd keeps.

As ``tests/torch_engine/test_saved_bytes.py`` for transformers 4: each model's step (tiny, float32) run node by
node under saved-tensor hooks (:func:`shardplan.torch.saved.measure`); every operator but the attention is
charged exactly the bytes autograd kept. (The exported program, which is what a plan runs, keeps more than the
model run eagerly on transformers 5: under ``torch.export`` the causal mask is built where the eager call
passes ``is_causal``, and a custom ``autograd.Function`` such as BLOOM's GeLU is traced through, its
elementwise steps keeping what their own formulas keep.) The attention
is left out: its own part is what its handler states of the fused kernels, and the CPU's kernel keeps the mask
it was given besides. Falcon is left out too: its multi-query call (one K/V head, no ``enable_gqa``) runs
PyTorch's math kernel on CPU, which keeps the probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch_cases  # tests/ is on sys.path, see conftest.py

from shardplan.torch import saved as sv
from shardplan.torch import trace

MODELS = ["hf_gpt2_cache", "hf_llama_cache", "hf_gemma2", "hf_bloom", "hf_t5", "hf_mixtral"]


@pytest.fixture(scope="module", params=MODELS)
def step(request):
    module, batch = torch_cases.CASES[request.param]()
    graph, info = trace(module, batch)
    ref = sv.reference_bytes(module)
    m = sv.measure(info.program, module, batch, None, info.value_ops.get,
                   {op.name: math.prod(op.output.shape) for op in graph}, ref)
    return module, batch, graph, info, ref, m


def test_every_operator_but_attention_is_charged_what_autograd_keeps(step):
    _, _, graph, info, ref, m = step
    attention = {info.node_op[n.name] for n in info.program.graph.nodes
                 if str(n.target) == "aten.scaled_dot_product_attention.default"}
    wrong = {op.name: (op.saved * math.prod(op.output.shape) * ref, m.by_operator.get(op.name, 0.0))
             for op in graph if op.name not in attention
             and op.saved * math.prod(op.output.shape) * ref != m.by_operator.get(op.name, 0.0)}
    assert m.uncharged_bytes == 0 and wrong == {}

