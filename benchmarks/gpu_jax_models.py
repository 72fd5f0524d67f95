"""The JAX models timed on a GPU by ``gpu_measure.py`` and predicted by ``bench_gpu_step.py``: language models
written with flax.linen's own layers (nn.Embed, nn.SelfAttention with a causal mask, nn.Dense, nn.LayerNorm,
nn.gelu), bf16 parameters and activations, the loss a mean cross entropy over the tokens.

Both scripts build a model from the same entry of :data:`JAX_MODELS`, so the program timed and the program
planned are the same jaxpr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

JAX_MODELS = {  # name: (vocab, d_model, layers, heads, batch, sequence)
    "flax-gpt-125m": (50304, 768, 12, 12, 16, 1024),
    "flax-gpt-350m": (50304, 1024, 24, 16, 8, 1024),
    "flax-gpt-1.3b": (50304, 2048, 24, 16, 4, 2048),
}
SMOKE_MODELS = {"flax-gpt-toy": (512, 64, 2, 4, 2, 64)}


def flax_gpt(vocab: int, d: int, layers: int, heads: int) -> Any:
    """A GPT-2-shaped causal LM in flax.linen: pre-norm blocks, a learned position embedding, tied head."""
    import flax.linen as nn
    import jax.numpy as jnp

    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: Any, mask: Any) -> Any:
            x = x + nn.SelfAttention(num_heads=heads, deterministic=True, **bf16)(nn.LayerNorm(**bf16)(x), mask=mask)
            return x + nn.Dense(d, **bf16)(nn.gelu(nn.Dense(4 * d, **bf16)(nn.LayerNorm(**bf16)(x))))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, ids: Any) -> Any:
            emb = nn.Embed(vocab, d, **bf16)
            pos = self.param("pos", nn.initializers.normal(0.02), (ids.shape[1], d), jnp.bfloat16)
            x = emb(ids) + pos[None]
            mask = nn.make_causal_mask(ids)
            for _ in range(layers):
                x = Block()(x, mask)
            return emb.attend(nn.LayerNorm(**bf16)(x))

    return GPT()


def build(name: str, smoke: bool = False, abstract: bool = False) -> tuple[Callable[..., Any], Any, Any]:
    """``(loss_fn, params, batch)`` of model ``name``: ``loss_fn(params, (ids, labels))``, the mean token cross
    entropy in fp32 over the bf16 logits; params initialised from PRNG key 0 on the default device, or only their
    shapes and dtypes (``abstract``: ``jax.ShapeDtypeStruct`` leaves, enough to trace and plan)."""
    import jax
    import jax.numpy as jnp

    vocab, d, layers, heads, b, s = (SMOKE_MODELS if smoke else JAX_MODELS)[name]
    model = flax_gpt(vocab, d, layers, heads)
    ids = jax.random.randint(jax.random.PRNGKey(1), (b, s), 0, vocab)
    labels = jnp.roll(ids, -1, axis=1)
    def init(k: Any) -> Any:
        return model.init(k, ids)["params"]
    key = jax.random.PRNGKey(0)
    params = jax.eval_shape(init, key) if abstract else jax.jit(init)(key)

    def loss_fn(p: Any, batch: Any) -> Any:
        x, y = batch
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    return loss_fn, params, (ids, labels)
