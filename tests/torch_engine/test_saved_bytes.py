"""The activation memory of traced PyTorch programs (``Operator.saved``) against what autograd keeps.

Measured: the program run on real tensors under ``torch.autograd.graph.saved_tensors_hooks``, each saved storage
counted once, parameters left out (:func:`shardplan.torch.saved.measure`, which charges each storage to an
operator as the description does). The tiny Hugging Face models of ``tests/torch_cases.py`` (GPT-2 in float32,
Llama in bfloat16: its RMSNorm and its loss compute in float32) and hand-written modules whose saved tensors
are known from PyTorch's derivative formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch_cases  # tests/ is on sys.path, see conftest.py
from torch import nn

from shardplan.machine import Machine
from shardplan.torch import saved as sv
from shardplan.torch import trace


def _bytes(graph, ref: int) -> dict[str, float]:
    return {op.name: op.saved * math.prod(op.output.shape) * ref for op in graph}


def _measured(module: nn.Module, args: tuple, graph, info) -> sv.Measured:
    ref = sv.reference_bytes(module)
    return sv.measure(info.program, module, args, None, info.value_ops.get,
                      {op.name: math.prod(op.output.shape) for op in graph}, ref)


def _eager(module: nn.Module, args: tuple) -> float:
    return sv.eager_saved_bytes(module, args)


@pytest.fixture(scope="module", params=["gpt2_fp32", "llama_bf16"])
def hf(request):
    torch.manual_seed(0)
    if request.param == "gpt2_fp32":
        module, batch = torch_cases.make_hf_gpt2()
    else:
        module, batch = torch_cases.make_hf_llama()
        module = module.to(torch.bfloat16)
    graph, info = trace(module, batch)
    return request.param, module, batch, graph, info, _measured(module, batch, graph, info)


def _attention(graph, info) -> list:
    """The operators of the program's ``scaled_dot_product_attention`` nodes."""
    nodes = [n.name for n in info.program.graph.nodes if str(n.target) == "aten.scaled_dot_product_attention.default"]
    return [graph[info.node_op[n]] for n in nodes]


def test_every_operator_but_attention_is_charged_exactly_what_autograd_keeps(hf):
    _, module, _, graph, info, m = hf
    pred = _bytes(graph, sv.reference_bytes(module))
    assert m.uncharged_bytes == 0
    att = {op.name for op in _attention(graph, info)}
    assert len(att) == 2
    wrong = {n: (p, m.by_operator.get(n, 0.0)) for n, p in pred.items() if n not in att and p != m.by_operator.get(n, 0.0)}
    assert wrong == {}
    assert set(m.by_operator) <= set(pred)


def test_attention_keeps_output_mask_and_log_sum_exp_and_is_charged_within_them(hf):
    """The CPU kernel keeps its output, the boolean mask made additive in q's dtype and one float32 log-sum-exp per
    query row; the description charges the output and what the attention's handler states of its own (at most
    output and log-sum-exp), and the mask unless the handler runs it as causal: the difference is within the mask
    and the log-sum-exp."""
    _, module, _, graph, info, m = hf
    ref = sv.reference_bytes(module)
    for op in _attention(graph, info):
        out = math.prod(op.output.shape) * ref
        lse = 4.0 * math.prod(op.output.shape[:-1])  # one float32 per query row (of every head)
        (mask,) = [t for t in m.tensors if t[0] == op.name.split("/")[-1] and len(t[1]) == 4 and t[1][1] == 1]
        assert m.by_operator[op.name] == out + mask[3] + lse
        gap = m.by_operator[op.name] - op.saved * out
        assert 0 <= gap <= mask[3] + lse


def test_repeated_layers_are_charged_alike(hf):
    """The constants every layer keeps (a causal mask, the rotary tables) are shared equally by their keepers."""
    name, _, _, graph, info, _ = hf
    block = "model.transformer.h" if name.startswith("gpt2") else "model.model.layers"
    layers = [[op.saved for op in graph if info.module_paths[op.name].startswith(f"{block}.{i}")] for i in (0, 1)]
    assert len(layers[0]) > 10 and layers[0] == layers[1]


def test_the_exported_program_keeps_what_the_model_run_eagerly_keeps(hf):
    _, module, batch, _, _, m = hf
    assert m.total_bytes == _eager(module, batch)


def test_total_is_the_measurement_less_the_attention_gap(hf):
    _, module, _, graph, info, m = hf
    pred = _bytes(graph, sv.reference_bytes(module))
    gap = sum(m.by_operator[op.name] - pred[op.name] for op in _attention(graph, info))
    assert sum(pred.values()) == pytest.approx(m.total_bytes - gap, rel=1e-12)
    assert sum(pred.values()) < 0.6 * sum(math.prod(op.output.shape) for op in graph) * sv.reference_bytes(module), \
        "one output per operator (the old charge) is about twice what autograd keeps"


def test_the_plan_charges_the_graph_activations_on_one_device():
    import shardplan.torch as st

    torch.manual_seed(0)
    module, batch = torch_cases.make_hf_gpt2()
    graph, _ = trace(module, batch)
    plan = st.plan(module, batch, machine=Machine(1, peak_flops=1e12, bandwidth=1e10), fit=False, stages=False)
    assert plan.memory["activations_bytes"] == pytest.approx(sum(_bytes(graph, 4).values()), rel=1e-12)


# -- hand-written modules: what the derivative formulas keep ---------------------------------------------------

class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).sum()


def test_a_product_keeps_its_input_and_an_activation_its_input():
    """fc1 keeps x (for its weight's gradient: the user input, charged to it, half its output) and gelu keeps
    fc1's output; fc2 keeps gelu's output; the sum keeps nothing."""
    g, _ = trace(_Chain(), (torch.randn(8, 16),))
    assert {op.name: op.saved for op in g} == {"fc1/linear": 1.5, "gelu": 1.0, "fc2/linear_1": 0.0, "sum_1": 0.0}


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.fc(x).split(8, dim=-1)
        return (q * k).sum() + v.sum()


def test_views_of_one_storage_are_kept_once_by_the_operator_that_made_it():
    g, _ = trace(_Split(), (torch.randn(4, 8),))
    kept = {op.name: op.saved for op in g if op.saved}
    assert kept == {"fc/linear": 1.0 + 1.0 / 3.0}  # its output (q and k are views of it) and x (4 x 8 of 4 x 24)


class _Upcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).float().exp().sum()


def test_a_float32_value_in_a_bfloat16_model_counts_two_tiles():
    module = _Upcast().to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    g, info = trace(module, (x,))
    assert {op.name: op.saved for op in g} == {"fc/linear": 1.0, "to": 0.0, "exp": 2.0, "sum_1": 0.0}
    m = _measured(module, (x,), g, info)
    assert m.by_operator == {n: b for n, b in _bytes(g, 2).items() if b}


class _Drop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(self.fc(x), 0.25, True).sum()


def test_dropout_keeps_a_one_byte_mask_as_cuda_runs_it():
    g, _ = trace(_Drop(), (torch.randn(8, 16),))
    assert {op.name: op.saved for op in g} == {"fc/linear": 1.0, "dropout": 0.25, "sum_1": 0.0}


class _Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.fc(x), y)


def test_the_log_softmax_of_a_cross_entropy_is_charged_to_its_logits():
    """The loss keeps the float32 log-softmax of the logits (charged to the logits' operator, split as they are)
    and its scalar weight sum; the labels (int64) are charged to it, their one keeper."""
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    g, info = trace(_Loss(), (x, y))
    logits = 8 * 10 * 4
    assert g["fc/linear"].saved == (8 * 16 * 4 + logits + 4) / logits
    (loss,) = [op for op in g if op.kind == "cross_entropy"]
    assert loss.saved == 8 * 8 / 4
    m = _measured(_Loss(), (x, y), g, info)
    assert m.by_operator == {n: b for n, b in _bytes(g, 4).items() if b}


class _TopK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 12)

    def forward(self, x):
        values, _ = self.fc(x).softmax(-1).topk(3, dim=-1)
        return values.sum()


def test_a_tuple_result_kept_is_charged_to_the_operator_that_takes_it():
    """top-k keeps its int64 indices (to scatter the gradient back): two float32 tiles of the indices' operator;
    softmax keeps its result, the product its input."""
    x = torch.randn(8, 16)
    g, info = trace(_TopK(), (x,))
    kept = {op.kind: op.saved for op in g if op.saved}
    assert kept == {"linear": 16 / 12, "softmax": 1.0, "topk": 2.0}
    m = _measured(_TopK(), (x,), g, info)
    assert m.uncharged_bytes == 0 and m.by_operator == {n: b for n, b in _bytes(g, 4).items() if b}
