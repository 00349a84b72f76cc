"""MobileNet v1 (NHWC): a strided stem, 13 depthwise-separable blocks, a linear head.

Howard et al.'s layer structure with width multiplier 1/4 and 64x64 images, so that a
training step runs in seconds on a CPU. Each convolution is followed by a training-mode
batch normalization (batch statistics) and ReLU6.
"""

import functools
import sys

import jax
import jax.numpy as jnp

from examples import _common

# (output channels at width 1, stride) of the 13 depthwise-separable blocks.
BLOCKS = (
  (64, 1),
  (128, 2),
  (128, 1),
  (256, 2),
  (256, 1),
  (512, 2),
  (512, 1),
  (512, 1),
  (512, 1),
  (512, 1),
  (512, 1),
  (1024, 2),
  (1024, 1),
)


def init_params(key, width=0.25, c_in=3, n_classes=10):
  keys = iter(jax.random.split(key, 2 * len(BLOCKS) + 2))

  def conv_w(size, a, b):
    return jax.random.normal(next(keys), (size, size, a, b)) * (2.0 / (size * size * a)) ** 0.5

  def norm(c):
    return {"g": jnp.ones((c,)), "b": jnp.zeros((c,))}

  prev = max(1, int(32 * width))
  params = {"stem": {"w": conv_w(3, c_in, prev), "n": norm(prev)}, "blocks": []}
  for c, _ in BLOCKS:
    c = max(1, int(c * width))
    params["blocks"].append(
      {"dw": conv_w(3, 1, prev), "n1": norm(prev), "pw": conv_w(1, prev, c), "n2": norm(c)}
    )
    prev = c
  params["head"] = jax.random.normal(next(keys), (prev, n_classes)) / prev**0.5
  return params


def _relu6_norm(p, x):
  return jnp.clip(_common.channel_norm(p, x), 0.0, 6.0)


def _separable(stride, p, x):
  x = _relu6_norm(p["n1"], _common.conv2d(p["dw"], x, stride, groups=x.shape[-1]))
  return _relu6_norm(p["n2"], _common.conv2d(p["pw"], x))


def loss(params, batch, *, checkpoint=None):
  x, labels = batch
  x = _relu6_norm(params["stem"]["n"], _common.conv2d(params["stem"]["w"], x, 2))
  blocks = [
    (functools.partial(_separable, stride), p)
    for (_, stride), p in zip(BLOCKS, params["blocks"], strict=True)
  ]
  x = _common.run_blocks(blocks, x, checkpoint)
  logp = jax.nn.log_softmax(x.mean((1, 2)) @ params["head"])
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def example_batch(key, batch=32, size=64, c_in=3, n_classes=10):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (batch, size, size, c_in)), jax.random.randint(
    ky, (batch,), 0, n_classes
  )


# The smallest sizes (tests, quick benchmarks).
SMALL = {"width": 1 / 32, "size": 64, "batch": 2}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
