"""VGG16 (NHWC): 13 3x3 convolutions in five max-pooled stages, then three dense layers.

The layer structure of Simonyan and Zisserman's configuration D, with the widths divided
by 8 and 64x64 images so that a training step runs in seconds on a CPU.
"""

import sys

import jax
import jax.numpy as jnp

from examples import _common

# Convolutions per stage (configuration D); each stage ends with a 2x2 max pool.
STAGES = (2, 2, 3, 3, 3)


def init_params(key, widths=(8, 16, 32, 64, 64), hidden=128, size=64, c_in=3, n_classes=10):
  keys = iter(jax.random.split(key, sum(STAGES) + 3))

  def conv_w(a, b):
    return jax.random.normal(next(keys), (3, 3, a, b)) * (2.0 / (9 * a)) ** 0.5

  def dense(a, b):
    return {"w": jax.random.normal(next(keys), (a, b)) * (2.0 / a) ** 0.5, "b": jnp.zeros((b,))}

  convs, prev = [], c_in
  for n, c in zip(STAGES, widths, strict=True):
    for _ in range(n):
      convs.append({"w": conv_w(prev, c), "b": jnp.zeros((c,))})
      prev = c
  flat = prev * (size // 2 ** len(STAGES)) ** 2
  return {
    "convs": convs,
    "fc": [dense(flat, hidden), dense(hidden, hidden), dense(hidden, n_classes)],
  }


def _conv(p, x):
  return jax.nn.relu(_common.conv2d(p["w"], x) + p["b"])


def _conv_pool(p, x):
  x = _conv(p, x)
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def loss(params, batch, *, checkpoint=None):
  x, labels = batch
  ends = {sum(STAGES[: i + 1]) - 1 for i in range(len(STAGES))}
  blocks = [(_conv_pool if i in ends else _conv, p) for i, p in enumerate(params["convs"])]
  x = _common.run_blocks(blocks, x, checkpoint).reshape(x.shape[0], -1)
  *hidden, head = params["fc"]
  for p in hidden:
    x = jax.nn.relu(x @ p["w"] + p["b"])
  logp = jax.nn.log_softmax(x @ head["w"] + head["b"])
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def example_batch(key, batch=32, size=64, c_in=3, n_classes=10):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (batch, size, size, c_in)), jax.random.randint(
    ky, (batch,), 0, n_classes
  )


# The smallest sizes (tests, quick benchmarks).
SMALL = {"widths": (2, 2, 4, 4, 4), "hidden": 8, "size": 32, "batch": 2}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
