"""RNNLM: a word-level language model with a stacked LSTM (the paper's benchmark).

Four vertices: ``embedding`` (dims ``bsdv``, the vocabulary a reduction
dimension), ``lstm`` (the whole 2-layer recurrent operator as one vertex,
dims ``lbsde``), ``fc`` (projection to the vocabulary, dims ``bsvd``) and
``softmax`` (cross-entropy over the vocabulary, dims ``bsv``). Meant to be
solved with cutoff 1 so that the layer dimension can be split.
"""

from __future__ import annotations

from shardplan import ops
from shardplan.ir import Graph, GraphBuilder

__all__ = ["rnnlm"]


def rnnlm(batch: int = 64, seq: int = 256, vocab: int = 100_000, hidden: int = 2048, layers: int = 2) -> Graph:
    """RNNLM on ``batch`` sequences of ``seq`` tokens."""
    b = GraphBuilder("rnnlm")
    ids = b.input("tokens", (batch, seq))
    labels = b.input("labels", (batch, seq))
    h = b.add(ops.embedding("embedding", ids, vocab, hidden))
    h = b.add(ops.lstm("lstm", h, hidden, layers))
    h = b.add(ops.dense("fc", h, vocab, letters="bsvd"))
    b.add(ops.softmax_cross_entropy("softmax", h, labels, letters="bsv"))
    return b.build()
