"""Predicted (traced graph, simulated baseline) versus XLA's measured peak, per example.

Usage: python -m benchmarks.trace_accuracy [--examples mlp,gpt] [--steps grad,train]

Prints a table and writes benchmarks/results/trace_accuracy.{csv,json}. XLA's peak is
argument + output + temp - alias of ``jax.jit(f).lower(*args).compile().memory_analysis()``
(ARCHITECTURE.md fact 3); the prediction is ``xla_memory.xla_accounted_peak_bytes(graph)``: the
baseline run ``simulate(graph, baseline_schedule(graph))`` counted as XLA counts it (outputs
from the start, per-node scratch, buffers XLA makes at the program start).
"""

import argparse
import csv
import json
import os
import time

import jax

import examples
import jaxremat
from jaxremat._src import compat
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def xla_peak_bytes(fn, args) -> int:
  return compat.memory_peak_bytes(jax.jit(fn).lower(*args).compile())


def measure(name: str, step: str) -> list[dict]:
  module = examples.load(name)
  fn, args = module.make_grad_fn() if step == "grad" else module.make_train_step()
  measured = xla_peak_bytes(fn, args)
  rows = []
  for fold, workspace in ((True, True), (True, False), (False, False)):
    t0 = time.perf_counter()
    graph = jaxremat.trace(fn, *args, fold=fold, workspace=workspace, costs="shape")
    trace_s = time.perf_counter() - t0
    simulated = jaxremat.simulate(graph, jaxremat.baseline_schedule(graph)).peak_bytes
    predicted = xla_accounted_peak_bytes(graph)
    rows.append(
      {
        "example": name,
        "step": step,
        "fold": fold,
        "workspace": workspace,
        "nodes": graph.n,
        "eqns": graph.meta["n_eqns"],
        "simulated_bytes": simulated,
        "predicted_bytes": predicted,
        "xla_bytes": measured,
        "error_percent": round(100.0 * (predicted - measured) / measured, 2),
        "trace_s": round(trace_s, 3),
      }
    )
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", default=",".join(examples.EXAMPLES))
  parser.add_argument("--steps", default="grad,train")
  parser.add_argument("--out", default=os.path.join(RESULTS, "trace_accuracy"))
  ns = parser.parse_args()
  rows = []
  header = f"{'example':8} {'step':5} {'fold':5} {'scratch':7} {'nodes':>6} {'predicted MiB':>14} {'XLA MiB':>9} {'error %':>8}"
  print(header)
  for name in ns.examples.split(","):
    for step in ns.steps.split(","):
      for r in measure(name, step):
        rows.append(r)
        print(
          f"{r['example']:8} {r['step']:5} {str(r['fold']):5} {str(r['workspace']):7} {r['nodes']:>6} "
          f"{r['predicted_bytes'] / 2**20:>14.2f} {r['xla_bytes'] / 2**20:>9.2f} {r['error_percent']:>8.1f}"
        )
  os.makedirs(os.path.dirname(ns.out), exist_ok=True)
  with open(ns.out + ".csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  with open(ns.out + ".json", "w") as f:
    json.dump(
      {"jax_version": jax.__version__, "backend": jax.default_backend(), "rows": rows}, f, indent=1
    )


if __name__ == "__main__":
  main()
