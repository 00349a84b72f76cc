"""Runs one training step in a fresh process and prints the device's memory figures as JSON.

``device.memory_stats()["peak_bytes_in_use"]`` is the process's high-water mark and
cannot be reset, so every measurement runs alone in its own process:

  python tests/device_peak.py original   # the step as JAX compiles it
  python tests/device_peak.py emitted    # the step emitted from a 4-segment schedule

The step is the 16-layer tanh MLP of ARCHITECTURE.md (batch 4096, width 256).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxremat
from jaxremat._src import compat
from jaxremat._src.segments import segment_schedule
from jaxremat._src.trace import trace_program

LAYERS, BATCH, WIDTH, SEGMENTS = 16, 4096, 256, 4


def loss(params, x):
  h = x
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.mean(h * h)


def main(which: str) -> dict:
  # Host-made inputs, so that nothing but the step itself ever allocates on the device.
  rng = np.random.default_rng(0)
  params = [
    jax.device_put(rng.standard_normal((WIDTH, WIDTH), np.float32) / np.sqrt(WIDTH))
    for _ in range(LAYERS)
  ]
  x = jax.device_put(rng.standard_normal((BATCH, WIDTH), np.float32))
  step = jax.value_and_grad(loss)
  program = trace_program(step, params, x, costs="shape")
  if which == "original":
    fn, schedule = step, jaxremat.baseline_schedule(program.graph)
  else:
    schedule = segment_schedule(program.graph, SEGMENTS)
    fn = jaxremat.emit(program, schedule)
  compiled = jax.jit(fn).lower(params, x).compile()
  device = jax.devices()[0]
  before = device.memory_stats() or {}
  jax.block_until_ready(compiled(params, x))
  after = device.memory_stats() or {}
  return {
    "platform": jax.default_backend(),
    "device_kind": device.device_kind,
    "jax_version": jax.__version__,
    "which": which,
    "predicted_peak_bytes": jaxremat.simulate(program.graph, schedule).peak_bytes,
    "xla_peak_bytes": compat.memory_peak_bytes(compiled),
    "bytes_in_use_before_run": before.get("bytes_in_use"),
    "device_peak_bytes": after.get("peak_bytes_in_use"),
  }


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
