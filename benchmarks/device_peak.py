"""One method of benchmarks/e2e.py compiled here and run once on this machine's device:
prints the device allocator's peak beside the compiler's figure, as JSON.

The step is compiled here and run by a second process that only loads it
(`jaxremat._src.measure.isolated_device_peak`: compiling for a GPU allocates autotuning
buffers larger than a small step, and a process's peak cannot be reset).

  python -m benchmarks.device_peak gpt "no remat"
  python -m benchmarks.device_peak gpt "jax.checkpoint dots_saveable"
  python -m benchmarks.device_peak gpt "jaxremat auto" --budget 0.5 --cache-dir DIR

A jaxremat plan is read from the plan cache that benchmarks/e2e.py wrote (same example,
budget and time limit); none is solved here.
"""

from __future__ import annotations

import argparse
import json

import jax

from benchmarks import e2e
from jaxremat._src import compat
from jaxremat._src.measure import isolated_device_peak

PLAN = "jaxremat auto"
CHECKPOINT = "jax.checkpoint "


def device_peak(
  name: str,
  method: str,
  budget: float | None = None,
  time_limit_s: float = 30.0,
  cache_dir: str | None = None,
  small: bool = False,
  batch_scale: int = 1,
) -> dict:
  """Compiles and runs ``method`` once on the default device; its memory figures."""
  variant = method.removeprefix(CHECKPOINT) if method.startswith(CHECKPOINT) else None
  if method not in ("no remat", PLAN) and variant is None:
    raise ValueError(f"method={method!r} is not 'no remat', {PLAN!r} or a jax.checkpoint variant.")
  with jax.default_device(jax.devices("cpu")[0]):
    step, host_args = e2e.example_step(name, variant, small, batch_scale)
  device = jax.devices()[0]
  args = jax.device_put(host_args, device)
  jitted, out = jax.jit(step), {"from_cache": None}
  if method == PLAN:
    if budget is None or cache_dir is None:
      raise ValueError(f"method={PLAN!r} needs --budget and the --cache-dir e2e planned into.")
    plan = e2e.optimize_example(step, budget, time_limit_s, None, cache_dir, verify=False)
    plan = plan.plan(*args)
    out["from_cache"] = plan.from_cache
    # The optimized step's own jitted program, on its flat arguments.
    jitted, args = plan.compiled.jitted, plan.compiled.signature.dynamic_leaves(args, {})
  compiled = jitted.lower(*args).compile()
  figures = isolated_device_peak(compiled, *args)
  return out | figures | {"xla_peak_bytes": compat.memory_peak_bytes(compiled)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("example")
  parser.add_argument("method", help=f"'no remat', '{PLAN}' or 'jax.checkpoint VARIANT'")
  parser.add_argument("--budget", type=float)
  parser.add_argument("--time-limit", type=float, default=30.0)
  parser.add_argument("--cache-dir")
  parser.add_argument("--small", action="store_true")
  parser.add_argument("--batch-scale", type=int, default=1)
  a = parser.parse_args(argv)
  figures = device_peak(
    a.example, a.method, a.budget, a.time_limit, a.cache_dir, a.small, a.batch_scale
  )
  print(json.dumps(figures))


if __name__ == "__main__":
  main()
