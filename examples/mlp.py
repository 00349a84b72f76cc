"""A deep tanh MLP regression model (ARCHITECTURE.md fact 1's 16-layer MLP, smaller)."""

import sys

import jax
import jax.numpy as jnp

from examples import _common


def init_params(key, depth=16, width=256, d_in=256, d_out=16):
  keys = jax.random.split(key, depth + 1)
  dims = [d_in] + [width] * depth
  layers = [
    {"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": jnp.zeros((b,))}
    for k, a, b in zip(keys[:-1], dims[:-1], dims[1:], strict=True)
  ]
  head = {
    "w": jax.random.normal(keys[-1], (width, d_out)) / jnp.sqrt(width),
    "b": jnp.zeros((d_out,)),
  }
  return {"layers": layers, "head": head}


def _layer(p, x):
  return jnp.tanh(x @ p["w"] + p["b"])


def loss(params, batch, *, checkpoint=None):
  x, y = batch
  x = _common.run_blocks([(_layer, p) for p in params["layers"]], x, checkpoint)
  pred = x @ params["head"]["w"] + params["head"]["b"]
  return jnp.mean((pred - y) ** 2)


def example_batch(key, batch=1024, d_in=256, d_out=16):
  kx, ky = jax.random.split(key)
  return jax.random.normal(kx, (batch, d_in)), jax.random.normal(ky, (batch, d_out))


# The smallest sizes (tests, quick benchmarks).
SMALL = {"depth": 4, "width": 32, "d_in": 32, "batch": 1024}


make_grad_fn, make_train_step = _common.step_makers(__name__)


if __name__ == "__main__":
  sys.exit(0 if _common.main(sys.modules[__name__]) else 1)
