"""Two small causal language models whose attention is flax's own, written as flax's users write them:
a linen one (``nn.Embed``, two ``nn.remat`` blocks of ``nn.SelfAttention`` + MLP, the mask of
``nn.make_causal_mask``, tied head) and an nnx one (``nnx.MultiHeadAttention`` with ``nnx.make_causal_mask``,
split into its parameters with ``nnx.split``). Shared by test_flax_attention.py (their description) and
test_flax_attention_run.py (their planned ring run). ``mask`` swaps the causal mask for another
(``mask(ids) -> mask``) to show what is not recognised."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

V, S, D, NH = 64, 32, 32, 4  # vocabulary, sequence, width, heads


def _xent(logits: Any, labels: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def tokens(batch: int = 2, seq: int = S) -> tuple[Any, Any]:
    ids = jax.random.randint(jax.random.PRNGKey(1), (batch, seq), 0, V)
    return ids, jnp.roll(ids, -1, axis=1)


def linen_lm(mask: Callable[[Any], Any] | None = None, batch: tuple[int, int] = (2, S),
             **attention: Any) -> tuple[Callable[..., Any], Any, Any]:
    """The linen LM: ``(loss_fn, params, batch)`` on ``batch`` (sequences, length) of tokens; ``attention``:
    more arguments of ``nn.SelfAttention`` (``mask=None``: ``nn.make_causal_mask``)."""
    import flax.linen as nn

    make = mask or nn.make_causal_mask
    kw = {"deterministic": True, **attention}

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, m):
            x = x + nn.SelfAttention(num_heads=NH, **kw)(nn.LayerNorm()(x), mask=m)
            return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(V, D)
            x, m = emb(ids), make(ids)
            for _ in range(2):
                x = nn.remat(Block)()(x, m)
            return emb.attend(nn.LayerNorm()(x))

    ids = tokens(*batch)
    model = LM()
    params = model.init(jax.random.PRNGKey(0), ids[0])["params"]
    rngs = {"dropout": jax.random.PRNGKey(2)} if not kw["deterministic"] else None
    return (lambda p, b: _xent(model.apply({"params": p}, b[0], rngs=rngs), b[1])), params, ids


def nnx_lm(mask: Callable[[Any], Any] | None = None, batch: tuple[int, int] = (2, S)
           ) -> tuple[Callable[..., Any], Any, Any]:
    """The nnx LM: ``(loss_fn, params, batch)`` on ``batch`` (sequences, length) of tokens (``mask=None``:
    ``nnx.make_causal_mask``)."""
    from flax import nnx

    make = mask or nnx.make_causal_mask

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=NH, in_features=D, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

        def __call__(self, x, m):
            x = x + self.attn(self.norm(x), mask=m)
            return x + self.down(nnx.gelu(self.up(x)))

    class LM(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.emb = nnx.Embed(V, D, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

        def __call__(self, ids):
            x, m = self.emb(ids), make(ids)
            for block in self.blocks:
                x = block(x, m)
            return self.emb.attend(x)

    graphdef, state, rest = nnx.split(LM(nnx.Rngs(0)), nnx.Param, ...)
    return (lambda p, b: _xent(nnx.merge(graphdef, p, rest)(b[0]), b[1])), nnx.to_pure_dict(state), tokens(*batch)
