"""`jaxremat demo`: optimize a bundled training step and show what XLA measured.

The step is the deep tanh MLP of ARCHITECTURE.md (fact 1): on XLA:CPU every
`jax.checkpoint` variant of it keeps the same peak, because XLA merges the
recomputation back into the forward pass. The demo shows that, then jaxremat's plan.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

from jaxremat._src.api import optimize
from jaxremat._src.measure import measure


def make_mlp_step(depth: int = 16, width: int = 256, batch: int = 4096, checkpoint: bool = False):
  """A training step (loss, gradient, SGD update) of a ``depth``-layer tanh MLP.

  Returns:
    ``(step, (params, opt_state, x, y))``: ``step`` returns the new params, opt state, loss.
  """
  optimizer = optax.sgd(1e-3)
  keys = jax.random.split(jax.random.key(0), depth + 2)
  params = [
    jax.random.normal(k, (width, width), jnp.float32) / jnp.sqrt(width) for k in keys[:depth]
  ]
  x = jax.random.normal(keys[-2], (batch, width), jnp.float32)
  y = jax.random.normal(keys[-1], (batch, width), jnp.float32)

  def layer(w, h):
    return jnp.tanh(h @ w)

  if checkpoint:
    layer = jax.checkpoint(layer)

  def loss(params, x, y):
    h = x
    for w in params:
      h = layer(w, h)
    return jnp.mean((h - y) ** 2)

  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, optimizer.init(params), x, y)


def run_demo(budget: float = 0.5, solver: str = "auto", time_limit: float = 15.0) -> None:
  """Prints the jax.checkpoint comparison and jaxremat's `Report` for the MLP step."""
  mib = 2.0**20
  step, args = make_mlp_step()
  print(
    f"Training step: 16-layer tanh MLP, batch 4096, width 256, float32, SGD "
    f"(XLA on {jax.default_backend()})."
  )
  plain = measure(step, *args, runs=0)
  ckpt_step, _ = make_mlp_step(checkpoint=True)
  ckpt = measure(ckpt_step, *args, runs=0)
  print(f"  no remat:               XLA peak {plain.peak_bytes / mib:7.1f} MiB")
  print(
    f"  per-layer checkpoint:   XLA peak {ckpt.peak_bytes / mib:7.1f} MiB, "
    f"FLOPs x{(ckpt.flops or 0) / plain.flops:.3f}"
  )
  print(f"\nOptimizing with jaxremat at {budget:.0%} of the no-remat peak (solver {solver!r})...")
  start = time.perf_counter()
  fast = optimize(step, budget=budget, solver=solver, time_limit=time_limit, use_cache=False)
  report = fast.report(*args, runs=3)
  print(f"planned, emitted and verified in {time.perf_counter() - start:.1f} s\n")
  print(report)
