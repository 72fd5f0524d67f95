"""Third-party JAX models, as their libraries define them, at tiny sizes: the corpus of the JAX tests.

Each entry builds ``(loss_fn, params, batch)`` for ``loss_fn(params, batch) -> scalar`` with
random weights. The model code is the library's own (flax linen and nnx layers, equinox and
haiku's built-in networks, Hugging Face transformers' Flax models, Google's recurrentgemma Griffin); only the
loss around it is written here (optax's integer-label cross-entropy where the model is a classifier or a
language model). Used by ``tests/jax_engine/test_jax_corpus.py`` and the benchmarks (``CORPUS``).

T5's own code calls ``jnp.clip(a_max=...)``, a keyword JAX removed in 0.10.0: the corpus runs on the
pinned JAX 0.9.2 (README, "The corpus"). The README's corpus table lists every model tried and its result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

BATCH, SEQ, VOCAB = 8, 16, 64


@dataclass(frozen=True)
class Entry:
    """One corpus model: its library, name and builder (``build() -> (loss_fn, params, batch)``)."""

    library: str
    name: str
    build: Callable[[], tuple[Callable[..., Any], Any, Any]]


def _xent(logits: Any, labels: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _tokens(seed: int = 1) -> tuple[Any, Any]:
    import jax

    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB), jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB))


# -- flax linen ------------------------------------------------------------------------------
def linen_cnn() -> tuple[Callable[..., Any], Any, Any]:
    """The MNIST CNN of the flax examples (conv 32, avg pool, conv 64, avg pool, dense 256, dense 10), 16x16 inputs."""
    import flax.linen as nn
    import jax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.avg_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.avg_pool(nn.relu(nn.Conv(64, (3, 3))(x)), (2, 2), (2, 2))
            x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, 16, 16, 1))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH,), 0, 10)
    model = CNN()
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    return (lambda p, b: _xent(model.apply({"params": p}, b[0]), b[1])), params, (x, y)


def linen_lm() -> tuple[Callable[..., Any], Any, Any]:
    """A linen language model: nn.Embed, two remat'd (nn.remat) blocks of nn.SelfAttention + MLP with LayerNorm."""
    import flax.linen as nn
    import jax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + nn.SelfAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x))
            return x + nn.Dense(32)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(VOCAB, 32)
            x = emb(ids)
            for _ in range(2):
                x = nn.remat(Block)()(x)
            return emb.attend(nn.LayerNorm()(x))

    ids, labels = _tokens()
    model = LM()
    params = model.init(jax.random.PRNGKey(0), ids)["params"]
    return (lambda p, b: _xent(model.apply({"params": p}, b[0]), b[1])), params, (ids, labels)


def linen_scan() -> tuple[Callable[..., Any], Any, Any]:
    """nn.scan over four identical Dense+tanh layers (parameters stacked on a layer axis)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return jnp.tanh(nn.Dense(64)(x)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)
            return nn.Dense(10)(x)

    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH * 4, 64))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH * 4,), 0, 10)
    model = Net()
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    return (lambda p, b: _xent(model.apply({"params": p}, b[0]), b[1])), params, (x, y)


# -- flax nnx --------------------------------------------------------------------------------
def nnx_mlp() -> tuple[Callable[..., Any], Any, Any]:
    """An nnx model (nnx.Linear, nnx.BatchNorm in inference mode, nnx.Dropout off), split into its parameters
    (differentiated) and the rest of its state (batch statistics, RNG counts; closed over)."""
    import jax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(32, 128, rngs=rngs)
            self.bn = nnx.BatchNorm(128, use_running_average=True, rngs=rngs)
            self.drop = nnx.Dropout(0.1, deterministic=True, rngs=rngs)
            self.l2 = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))

    graphdef, state, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH * 4, 32))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH * 4,), 0, 10)

    def loss(p, b):
        return _xent(nnx.merge(graphdef, p, rest)(b[0]), b[1])

    return loss, nnx.to_pure_dict(state), (x, y)


# -- equinox ---------------------------------------------------------------------------------
def equinox_mlp() -> tuple[Callable[..., Any], Any, Any]:
    """eqx.nn.MLP, vmapped over the batch, parameters from eqx.partition."""
    import equinox as eqx
    import jax

    model = eqx.nn.MLP(32, 10, 128, 2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH * 4, 32))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH * 4,), 0, 10)

    def loss(p, b):
        return _xent(jax.vmap(eqx.combine(p, static))(b[0]), b[1])

    return loss, params, (x, y)


def equinox_attention() -> tuple[Callable[..., Any], Any, Any]:
    """eqx.nn.Embedding + eqx.nn.MultiheadAttention + eqx.nn.LayerNorm + eqx.nn.Linear, vmapped."""
    import equinox as eqx
    import jax

    k = jax.random.split(jax.random.PRNGKey(0), 3)
    model = (eqx.nn.Embedding(VOCAB, 32, key=k[0]), eqx.nn.MultiheadAttention(4, 32, key=k[1]),
             eqx.nn.LayerNorm(32), eqx.nn.Linear(32, VOCAB, key=k[2]))
    params, static = eqx.partition(model, eqx.is_array)

    def one(m, ids):
        emb, att, ln, out = m
        x = jax.vmap(emb)(ids)
        x = x + att(x, x, x)
        return jax.vmap(lambda t: out(ln(t)))(x)

    def loss(p, b):
        m = eqx.combine(p, static)
        return _xent(jax.vmap(lambda ids: one(m, ids))(b[0]), b[1])

    return loss, params, _tokens()


# -- haiku -----------------------------------------------------------------------------------
def haiku_mlp() -> tuple[Callable[..., Any], Any, Any]:
    """hk.nets.MLP under hk.transform."""
    import haiku as hk
    import jax

    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([128, 128, 10])(x)))
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH * 4, 32))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH * 4,), 0, 10)
    params = net.init(jax.random.PRNGKey(0), x)
    return (lambda p, b: _xent(net.apply(p, b[0]), b[1])), params, (x, y)


# -- Hugging Face transformers (Flax) --------------------------------------------------------
def _hf_lm(model_cls: str, config_cls: str, **cfg: Any) -> tuple[Callable[..., Any], Any, Any]:
    import transformers

    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg), seed=0)
    ids, labels = _tokens()
    return (lambda p, b: _xent(model(b[0], params=p, train=False).logits, b[1])), model.params, (ids, labels)


def hf_gpt2() -> tuple[Callable[..., Any], Any, Any]:
    return _hf_lm("FlaxGPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                  n_positions=SEQ)


def hf_bert() -> tuple[Callable[..., Any], Any, Any]:
    return _hf_lm("FlaxBertForMaskedLM", "BertConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)


def hf_llama() -> tuple[Callable[..., Any], Any, Any]:
    return _hf_lm("FlaxLlamaForCausalLM", "LlamaConfig", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ)


def hf_bart() -> tuple[Callable[..., Any], Any, Any]:
    """BART (encoder-decoder, embeddings shared by encoder, decoder and LM head), one layer each side."""
    import transformers

    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=SEQ)
    return _seq2seq(transformers.FlaxBartForConditionalGeneration(cfg, seed=0))


def hf_t5() -> tuple[Callable[..., Any], Any, Any]:
    """T5 (encoder-decoder, relative-position buckets, embedding tied to the LM head), one layer each side."""
    import transformers

    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=SEQ,
                                decoder_start_token_id=0)
    return _seq2seq(transformers.FlaxT5ForConditionalGeneration(cfg, seed=0))


def _seq2seq(model: Any) -> tuple[Callable[..., Any], Any, Any]:
    """An encoder-decoder's loss on random token ids, random decoder ids and labels."""
    import jax

    ids, labels = _tokens()
    dec = jax.random.randint(jax.random.PRNGKey(5), ids.shape, 0, VOCAB)

    def loss(p, b):
        return _xent(model(b[0], decoder_input_ids=b[1], params=p, train=False).logits, b[2])

    return loss, model.params, (ids, dec, labels)


def hf_vit() -> tuple[Callable[..., Any], Any, Any]:
    import jax
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10)
    model = transformers.FlaxViTForImageClassification(cfg, seed=0)
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, 3, 16, 16))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH,), 0, 10)
    return (lambda p, b: _xent(model(b[0], params=p, train=False).logits, b[1])), model.params, (x, y)


def hf_gpt_neo() -> tuple[Callable[..., Any], Any, Any]:
    """GPT-Neo: one global and one local attention layer (window 8 of the 16 tokens), GPT-2 style, LM head tied to the embedding."""
    return _hf_lm("FlaxGPTNeoForCausalLM", "GPTNeoConfig", num_layers=2, attention_types=[[["global", "local"], 1]],
                  window_size=8, hidden_size=32, num_heads=4, intermediate_size=64, vocab_size=VOCAB,
                  max_position_embeddings=SEQ)


def hf_xglm() -> tuple[Callable[..., Any], Any, Any]:
    """XGLM: sinusoidal positions, pre-LayerNorm blocks, embedding scaled by sqrt(d) and tied to the LM head."""
    return _hf_lm("FlaxXGLMForCausalLM", "XGLMConfig", num_layers=2, d_model=32, attention_heads=4, ffn_dim=64,
                  vocab_size=VOCAB, max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0)


def hf_bloom() -> tuple[Callable[..., Any], Any, Any]:
    """BLOOM: ALiBi position bias, fused query-key-value, LayerNorm on the embedding, tied LM head."""
    return _hf_lm("FlaxBloomForCausalLM", "BloomConfig", n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB)


def hf_gptj() -> tuple[Callable[..., Any], Any, Any]:
    """GPT-J: rotary embeddings on the first 4 of each head's 8 dimensions, attention and MLP in parallel, untied
    head with a bias."""
    return _hf_lm("FlaxGPTJForCausalLM", "GPTJConfig", n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_inner=64,
                  vocab_size=VOCAB, n_positions=SEQ)


def hf_regnet() -> tuple[Callable[..., Any], Any, Any]:
    """RegNet-Y: a stride-2 stem, two stages of grouped-convolution bottlenecks with squeeze-and-excitation,
    BatchNorm in inference mode (its statistics closed over, the parameters differentiated), 16x16 images."""
    import jax
    import transformers

    cfg = transformers.RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1],
                                    groups_width=8, layer_type="y", num_labels=10)
    model = transformers.FlaxRegNetForImageClassification(cfg, seed=0)
    stats = model.params["batch_stats"]
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, 3, 16, 16))
    y = jax.random.randint(jax.random.PRNGKey(2), (BATCH,), 0, 10)

    def loss(p, b):
        return _xent(model(b[0], params={"params": p, "batch_stats": stats}, train=False).logits, b[1])

    return loss, model.params["params"], (x, y)


# -- Google's recurrentgemma --------------------------------------------------------------------
def griffin() -> tuple[Callable[..., Any], Any, Any]:
    """Griffin (recurrentgemma 1.0.1, its own ``GriffinConfig``): one recurrent block (RG-LRU, its temporal
    Conv1D and linear scan) and one local-attention block (window 8 of the 16 tokens), each under the library's
    default ``nn.remat``, the embedding tied to the logits, logits soft-capped; called as its users call it,
    ``model.apply(variables, tokens, segment_pos)`` (the cache it also returns is left unused)."""
    import jax
    import jax.numpy as jnp
    import recurrentgemma.jax as rg

    cfg = rg.GriffinConfig(vocab_size=VOCAB, width=32, mlp_expanded_width=64, num_heads=4, lru_width=32,
                           block_types=(rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION),
                           embeddings_scale_by_sqrt_dim=True, attention_window_size=8, logits_soft_cap=30.0)
    model = rg.Griffin(cfg)
    ids, labels = _tokens()
    pos = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ids, pos)["params"]  # eager init is twice as slow

    def loss(p, b):
        logits, _ = model.apply({"params": p}, b[0], b[1])
        return _xent(logits, b[2])

    return loss, params, (ids, pos, labels)


# Griffin is run by the tests (tests/jax_engine/test_jax_corpus.py) but not in CORPUS, which the benchmarks
# (bench_hlo_vs_model.py, bench_memory_vs_xla.py) iterate: their results were measured on the 18 below
# (bench_memory_vs_xla.py's on all but RegNet, on whose FSDP plan XLA's CPU compiler aborts).
GRIFFIN = Entry("recurrentgemma", "Griffin", griffin)

CORPUS: tuple[Entry, ...] = (
    Entry("flax.linen", "mnist_cnn", linen_cnn),
    Entry("flax.linen", "lm_remat", linen_lm),
    Entry("flax.linen", "scan_layers", linen_scan),
    Entry("flax.nnx", "mlp_bn_dropout", nnx_mlp),
    Entry("equinox", "MLP", equinox_mlp),
    Entry("equinox", "attention_lm", equinox_attention),
    Entry("haiku", "nets.MLP", haiku_mlp),
    Entry("transformers", "FlaxGPT2LMHeadModel", hf_gpt2),
    Entry("transformers", "FlaxBertForMaskedLM", hf_bert),
    Entry("transformers", "FlaxLlamaForCausalLM", hf_llama),
    Entry("transformers", "FlaxViTForImageClassification", hf_vit),
    Entry("transformers", "FlaxBartForConditionalGeneration", hf_bart),
    Entry("transformers", "FlaxT5ForConditionalGeneration", hf_t5),
    Entry("transformers", "FlaxGPTNeoForCausalLM", hf_gpt_neo),
    Entry("transformers", "FlaxXGLMForCausalLM", hf_xglm),
    Entry("transformers", "FlaxBloomForCausalLM", hf_bloom),
    Entry("transformers", "FlaxGPTJForCausalLM", hf_gptj),
    Entry("transformers", "FlaxRegNetForImageClassification", hf_regnet),
)


def run_entry(entry: Entry, machine: Any, devices: Any) -> dict[str, Any]:
    """Trace, solve, run one step; the loss and gradient errors against the unsharded step and the HLO bytes.

    Returns ``loss_rel`` (|loss - loss0| / |loss0|), ``grad_rel`` (max |g - g0| over the largest
    |g0| entry, over all leaves), ``grads_as_planned`` (every gradient in its parameter's planned
    sharding), ``hlo_bytes`` / ``model_bytes`` (bytes each device sends per step,
    compiled vs predicted), ``ratio`` and ``conservative`` (the operators the frontend described
    conservatively, :attr:`shardplan.jax.TraceInfo.conservative`).
    """
    import jax

    import shardplan.jax as sj
    from jax_compare import max_abs, max_abs_diff
    from shardplan.jax.hlo import hlo_bytes_per_device, predicted_bytes

    loss_fn, params, batch = entry.build()
    pl = sj.planned(loss_fn, params, batch, devices=devices, machine=machine)
    loss, grads = pl.step(params, batch)
    loss0, grads0 = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    scale = max(max_abs(g) for g in jax.tree.leaves(grads0))
    grad_err = max(max_abs_diff(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)))
    as_planned = all(g.sharding.is_equivalent_to(s, g.ndim)
                     for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(pl.param_shardings)))
    hlo = pl.step.lower(params, batch).compile().as_text()
    got, want = hlo_bytes_per_device(hlo)["total"], predicted_bytes(pl.plan)["total"]
    return {
        "library": entry.library, "model": entry.name, "operators": len(pl.plan.graph),
        "split_operators": sum(1 for c in pl.plan.configs.values() if any(x > 1 for x in c)),
        "loss_rel": abs(float(loss) - float(loss0)) / max(abs(float(loss0)), 1e-30),
        "grad_rel": grad_err / max(scale, 1e-30), "grads_as_planned": as_planned,
        "hlo_bytes": got, "model_bytes": want,
        "ratio": got / want if want else (1.0 if got == 0 else float("inf")),
        "conservative": pl.info.conservative, "plan": pl.plan,
    }
