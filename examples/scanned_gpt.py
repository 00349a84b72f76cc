"""The GPT example with its layers under `lax.scan`: stacked weights, one traced block.

As large models are written (Flax `nn.scan`, MaxText): the backward pass reads what every
iteration of the forward scan stored, stacked over the layers.
"""

import math
import sys

import jax
import jax.numpy as jnp

from examples import _common, gpt


def init_params(key, vocab=512, d_model=128, n_layers=8, seq_len=128):
  params = gpt.init_params(key, vocab=vocab, d_model=d_model, n_layers=n_layers, seq_len=seq_len)
  params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *params["blocks"])
  return params


def loss(params, tokens, *, checkpoint=None):
  """``checkpoint``: None, a `jax.checkpoint_policies` name for the scan body, or
  ``"nested"``: a scan over groups of about sqrt(L) layers, each group's scan under
  `jax.checkpoint` (two-level checkpointing: the backward pass stores one carry per group
  and each group's residuals while it runs)."""
  x = params["embed"][tokens[:, :-1]] + params["pos"][: tokens.shape[1] - 1]

  def body(x, blk):
    return gpt._block(blk, x), None

  if checkpoint == "nested":
    x = _nested_scan(body, x, params["blocks"])
  else:
    if checkpoint is not None:
      body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, checkpoint))
    x, _ = jax.lax.scan(body, x, params["blocks"])
  logits = gpt._layer_norm(params["ln_f"], x) @ params["embed"].T
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def _nested_scan(body, x, blocks):
  n = jax.tree.leaves(blocks)[0].shape[0]
  group = min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - math.sqrt(n)))
  grouped = jax.tree.map(lambda w: w.reshape(n // group, group, *w.shape[1:]), blocks)

  @jax.checkpoint
  def run_group(x, group_blocks):
    return jax.lax.scan(body, x, group_blocks)[0], None

  return jax.lax.scan(run_group, x, grouped)[0]


example_batch = gpt.example_batch

SMALL = {"vocab": 64, "d_model": 32, "n_layers": 3, "seq_len": 16, "batch": 2}

make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
