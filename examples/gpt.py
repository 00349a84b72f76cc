"""A small GPT-style decoder: token embedding, causal self-attention, GELU MLP, layer norm."""

import sys

import jax
import jax.numpy as jnp

from examples import _common


def init_params(key, vocab=512, d_model=128, n_layers=4, seq_len=128):
  keys = iter(jax.random.split(key, 4 + 4 * n_layers))

  def dense(k, a, b):
    return jax.random.normal(k, (a, b)) * 0.02

  blocks = []
  for _ in range(n_layers):
    blocks.append(
      {
        "ln1": {"g": jnp.ones((d_model,)), "b": jnp.zeros((d_model,))},
        "qkv": dense(next(keys), d_model, 3 * d_model),
        "proj": dense(next(keys), d_model, d_model),
        "ln2": {"g": jnp.ones((d_model,)), "b": jnp.zeros((d_model,))},
        "fc": dense(next(keys), d_model, 4 * d_model),
        "out": dense(next(keys), 4 * d_model, d_model),
      }
    )
  return {
    "embed": dense(next(keys), vocab, d_model),
    "pos": dense(next(keys), seq_len, d_model),
    "blocks": blocks,
    "ln_f": {"g": jnp.ones((d_model,)), "b": jnp.zeros((d_model,))},
  }


def _layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def _attention(qkv, n_heads):
  b, t, three_d = qkv.shape
  d = three_d // 3
  q, k, v = jnp.split(qkv.reshape(b, t, 3, n_heads, d // n_heads), 3, axis=2)
  q, k, v = (a[:, :, 0] for a in (q, k, v))  # (b, t, heads, head_dim)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // n_heads).astype(q.dtype)
  mask = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(mask, scores, -1e9)
  weights = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)


N_HEADS = 4


def _block(blk, x):
  x = x + _attention(_layer_norm(blk["ln1"], x) @ blk["qkv"], N_HEADS) @ blk["proj"]
  return x + jax.nn.gelu(_layer_norm(blk["ln2"], x) @ blk["fc"]) @ blk["out"]


def loss(params, tokens, *, checkpoint=None):
  x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]
  x = _common.run_blocks([(_block, blk) for blk in params["blocks"]], x, checkpoint)
  logits = _layer_norm(params["ln_f"], x) @ params["embed"].T
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def example_batch(key, batch=8, seq_len=128, vocab=512):
  return jax.random.randint(key, (batch, seq_len + 1), 0, vocab)


# The smallest sizes (tests, quick benchmarks).
SMALL = {"vocab": 64, "d_model": 32, "n_layers": 2, "seq_len": 16, "batch": 2}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
