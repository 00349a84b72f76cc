"""Time to trace and cost a training step of about 1000 equations, cold and from cache.

Usage: python -m benchmarks.trace_speed [--example gpt]

Targets (issue 3): under 30 s the first time (empty cost cache; the roofline
micro-benchmark included) and under 2 s from the cache (memory cache cleared, so
the disk cache is read). Writes benchmarks/results/trace_speed.json.
"""

import argparse
import json
import os
import tempfile
import time

import jax

import examples
import jaxremat
from jaxremat._src import costs

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--example", default="gpt")
  parser.add_argument("--out", default=os.path.join(RESULTS, "trace_speed.json"))
  ns = parser.parse_args()
  fn, args = examples.load(ns.example).make_train_step()
  rows = []
  with tempfile.TemporaryDirectory() as cache_dir:
    for run in ("first", "cached", "cached"):
      costs.clear_memory_cache()
      t0 = time.perf_counter()
      p = jaxremat.trace_program(fn, *args, cache_dir=cache_dir)
      seconds = time.perf_counter() - t0
      sources = [n.attrs.get("cost_source") for n in p.graph.nodes if not p.graph.is_input[n.id]]
      rows.append(
        {
          "example": ns.example,
          "run": run,
          "seconds": round(seconds, 3),
          "eqns": p.graph.meta["n_eqns"],
          "nodes": p.graph.n,
          "distinct_signatures": len(costs.CostCache(cache_dir).entries),
          "nodes_costed_by_xla": sources.count("xla"),
          "nodes_shape_fallback": sources.count("shape"),
        }
      )
      print(rows[-1])
  os.makedirs(os.path.dirname(ns.out), exist_ok=True)
  with open(ns.out, "w") as f:
    json.dump(
      {"jax_version": jax.__version__, "load_avg": os.getloadavg(), "rows": rows}, f, indent=1
    )


if __name__ == "__main__":
  main()
