"""A small convolutional U-Net (NHWC) for per-pixel regression."""

import sys

import jax
import jax.numpy as jnp

from examples import _common

_DN = ("NHWC", "HWIO", "NHWC")


def _conv(w, x, stride=1):
  return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=_DN)


def init_params(key, channels=(16, 32, 64), c_in=3):
  keys = iter(jax.random.split(key, 4 * len(channels) + 2))

  def conv_w(k, a, b, size=3):
    return jax.random.normal(k, (size, size, a, b)) * (2.0 / (size * size * a)) ** 0.5

  down, up = [], []
  prev = c_in
  for c in channels:
    down.append({"w1": conv_w(next(keys), prev, c), "w2": conv_w(next(keys), c, c)})
    prev = c
  for c_skip in reversed(channels[:-1]):
    up.append(
      {"w1": conv_w(next(keys), prev + c_skip, c_skip), "w2": conv_w(next(keys), c_skip, c_skip)}
    )
    prev = c_skip
  return {"down": down, "up": up, "head": conv_w(next(keys), prev, c_in, size=1)}


def _block(p, x):
  x = jax.nn.relu(_conv(p["w1"], x))
  return jax.nn.relu(_conv(p["w2"], x))


def _downsample(x):
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _upsample(x):
  return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


# Blocks carry ``(x, skips)``: the way down pushes skips, the way up pops them.
def _down(p, state):
  x, skips = state
  x = _block(p, x)
  return _downsample(x), (*skips, x)


def _bottom(p, state):
  x, skips = state
  return _block(p, x), skips


def _up(p, state):
  x, skips = state
  return _block(p, jnp.concatenate([_upsample(x), skips[-1]], axis=-1)), skips[:-1]


def loss(params, batch, *, checkpoint=None):
  x, y = batch
  *down, bottom = params["down"]
  blocks = [(_down, p) for p in down] + [(_bottom, bottom)] + [(_up, p) for p in params["up"]]
  x, _ = _common.run_blocks(blocks, (x, ()), checkpoint)
  pred = _conv(params["head"], x)
  return jnp.mean((pred - y) ** 2)


def example_batch(key, batch=8, size=32, c_in=3):
  kx, ky = jax.random.split(key)
  shape = (batch, size, size, c_in)
  return jax.random.normal(kx, shape), jax.random.normal(ky, shape)


# The smallest sizes (tests, quick benchmarks).
SMALL = {"channels": (4, 8), "size": 8, "batch": 2}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
