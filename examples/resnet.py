"""A small ResNet (NHWC): a stem, residual stages with strided downsampling, a linear head."""

import functools
import sys

import jax
import jax.numpy as jnp

from examples import _common

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(w, x, stride=1):
  return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=_DN)


def _norm(p, x):
  # Per-example channel normalization (no running statistics to carry).
  mean = x.mean((1, 2), keepdims=True)
  var = x.var((1, 2), keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def init_params(key, widths=(16, 32, 64), blocks_per_stage=2, c_in=3, n_classes=10):
  keys = iter(jax.random.split(key, 2 + 3 * len(widths) * blocks_per_stage))

  def conv_w(a, b, size=3):
    return jax.random.normal(next(keys), (size, size, a, b)) * (2.0 / (size * size * a)) ** 0.5

  def norm(c):
    return {"g": jnp.ones((c,)), "b": jnp.zeros((c,))}

  stages = []
  prev = widths[0]
  for s, c in enumerate(widths):
    blocks = []
    for b in range(blocks_per_stage):
      stride = 2 if (s > 0 and b == 0) else 1
      blk = {
        "w1": conv_w(prev, c),
        "n1": norm(c),
        "w2": conv_w(c, c),
        "n2": norm(c),
      }
      if stride != 1 or prev != c:
        blk["proj"] = conv_w(prev, c, size=1)
      blocks.append(blk)
      prev = c
    stages.append(blocks)
  return {
    "stem": conv_w(c_in, widths[0]),
    "stages": stages,
    "head": jax.random.normal(next(keys), (prev, n_classes)) / prev**0.5,
  }


def _block(stride, blk, x):
  h = jax.nn.relu(_norm(blk["n1"], _conv(blk["w1"], x, stride)))
  h = _norm(blk["n2"], _conv(blk["w2"], h))
  shortcut = _conv(blk["proj"], x, stride) if "proj" in blk else x
  return jax.nn.relu(h + shortcut)


def loss(params, batch, *, checkpoint=None):
  x, labels = batch
  x = jax.nn.relu(_conv(params["stem"], x))
  # The first block of every later stage halves the resolution (and projects).
  blocks = [
    (functools.partial(_block, 2 if (s > 0 and b == 0) else 1), blk)
    for s, stage in enumerate(params["stages"])
    for b, blk in enumerate(stage)
  ]
  x = _common.run_blocks(blocks, x, checkpoint)
  logits = x.mean((1, 2)) @ params["head"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def example_batch(key, batch=16, size=32, c_in=3, n_classes=10):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (batch, size, size, c_in)), jax.random.randint(
    ky, (batch,), 0, n_classes
  )


# The smallest sizes (tests, quick benchmarks).
SMALL = {"widths": (4, 8), "blocks_per_stage": 1, "size": 8, "batch": 2}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
