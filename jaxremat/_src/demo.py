"""`jaxremat demo`: optimize a bundled training step and show what XLA measured.

The step is the deep tanh MLP of ARCHITECTURE.md (fact 1): on XLA:CPU every
`jax.checkpoint` variant of it keeps the same peak, because XLA merges the
recomputation back into the forward pass. The demo shows that, then jaxremat's plan.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxremat._src.api import optimize
from jaxremat._src.measure import measure
from jaxremat._src.targets import get_target


def make_mlp_step(depth: int = 16, width: int = 256, batch: int = 4096, checkpoint: bool = False):
  """A training step (loss, gradient, SGD update) of a ``depth``-layer tanh MLP.

  Plain SGD, written out, so that the demo needs nothing beyond jaxremat's dependencies
  (optax's ``sgd`` without momentum computes the same update and keeps no state either).

  Returns:
    ``(step, (params, opt_state, x, y))``: ``step`` returns the new params, opt state (an
    empty tuple), loss.
  """
  learning_rate = 1e-3
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
    params = jax.tree.map(lambda w, g: w - learning_rate * g, params, grads)
    return params, opt_state, value

  return step, (params, (), x, y)


def run_demo(
  budget: float = 0.5,
  solver: str = "auto",
  time_limit: float | None = None,
  target: str | None = None,
) -> None:
  """Prints the jax.checkpoint comparison and jaxremat's `Report` for the MLP step, as the
  compiler of ``target`` measures them (`jaxremat.get_target`; None: this machine's).

  ``time_limit`` defaults to 15 s here and 60 s for a target without devices, whose
  compiles take seconds each.
  """
  mib = 2.0**20
  target = get_target(target)
  if time_limit is None:
    time_limit = 15.0 if target.local else 60.0
  step, args = make_mlp_step()
  print(
    f"Training step: 16-layer tanh MLP, batch 4096, width 256, float32, SGD "
    f"(XLA for {target.name}: {target.device_kind}"
    + ("" if target.local else ", compiled without the device")
    + ")."
  )
  plain = measure(step, *args, runs=0, target=target)
  ckpt_step, _ = make_mlp_step(checkpoint=True)
  ckpt = measure(ckpt_step, *args, runs=0, target=target)
  print(f"  no remat:               XLA peak {plain.peak_bytes / mib:7.1f} MiB")
  print(
    f"  per-layer checkpoint:   XLA peak {ckpt.peak_bytes / mib:7.1f} MiB, "
    f"FLOPs x{(ckpt.flops or 0) / plain.flops:.3f}"
  )
  print(f"\nOptimizing with jaxremat at {budget:.0%} of the no-remat peak (solver {solver!r})...")
  start = time.perf_counter()
  fast = optimize(
    step, budget=budget, solver=solver, time_limit=time_limit, use_cache=False, target=target
  )
  report = fast.report(*args, runs=3)
  print(f"planned, emitted and verified in {time.perf_counter() - start:.1f} s\n")
  print(report)
