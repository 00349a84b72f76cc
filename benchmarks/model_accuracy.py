"""How well each memory model predicts a training step's peak on a target's compiler.

Usage: python -m benchmarks.model_accuracy [--target tpu-v5e] [--models rules,compiler]
                                           [--steps mlp,gpt,...,flax_cnn,equinox,gpt_bf16]
                                           [--batch-scale 8]

For each step: the target compiler's peak of the step as written (with its donation,
`jaxremat.measure`, nothing runs) against the baseline schedule of the graph that each
model builds, counted as XLA counts it (`xla_accounted_peak_bytes`). ``rules`` are the
hand-written XLA:CPU fusion rules; ``compiler`` reads which values the target compiler
keeps, and their sizes with its layout, from its optimized HLO (`hlo_model`). Besides the
six examples' train steps: the Flax CNN and Equinox transformer (steps as those libraries'
users write them) and the GPT train step in bfloat16 (every float argument cast). Prints a
table; writes benchmarks/results/model_accuracy_<target>[_batchx<N>].{csv,json}. "all live"
is the same graph with every live byte charged (as if nothing stayed in TPU VMEM).
"""

import argparse
import csv
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

import examples
import jaxremat
from examples import _common
from jaxremat._src.signature import FlatStep
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

RESULTS = os.path.join(os.path.dirname(__file__), "results")
STEPS = (*examples.EXAMPLES, "flax_cnn", "equinox", "gpt_bf16")


def make_step(name: str, batch_scale: int = 1):
  """``(fn, args, kwargs, options)`` of the named training step at its default size (one
  of the six examples: with its batch times ``batch_scale``)."""
  if batch_scale != 1:
    if name not in examples.EXAMPLES:
      raise ValueError(f"--batch-scale applies to the examples {examples.EXAMPLES}, not {name!r}.")
    module = examples.load(name)
    fn, args = module.make_train_step(batch=_common.default_batch(module) * batch_scale)
    return fn, args, {}, {}
  if name == "flax_cnn":
    from examples import flax_cnn

    fn, args, kwargs = flax_cnn.make_train_step()
    options = {
      "static_argnames": flax_cnn.STATIC_ARGNAMES,
      "donate_argnums": flax_cnn.DONATE_ARGNUMS,
    }
    return fn, args, kwargs, options
  if name == "equinox":
    from examples import equinox_transformer

    fn, args, kwargs = equinox_transformer.make_train_step()
    return fn, args, kwargs, {"donate_argnums": equinox_transformer.DONATE_ARGNUMS}
  if name == "gpt_bf16":
    fn, args = examples.load("gpt").make_train_step()

    def cast(a):
      return a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return fn, jax.tree.map(cast, args), {}, {}
  fn, args = examples.load(name).make_train_step()
  return fn, args, {}, {}


def measure_step(name: str, target: str, models: list[str], batch_scale: int = 1) -> list[dict]:
  fn, args, kwargs, options = make_step(name, batch_scale)
  rows = []
  measured = None
  for model in models:
    start = time.perf_counter()
    program = jaxremat.trace_program(
      fn, *args, costs="shape", target=target, model=model, **options, **kwargs
    )
    trace_s = time.perf_counter() - start
    signature = program.signature
    if measured is None:  # the step as written, not the compile the model read
      measured = jaxremat.measure(
        FlatStep(fn, signature),
        *signature.specs,
        runs=0,
        donate_argnums=signature.donated_leaves,
        target=target,
      )
    predicted = xla_accounted_peak_bytes(program.graph, None, measured.alias_bytes)
    # Every live byte charged, as if nothing stayed in on-chip memory (TPU VMEM).
    all_live = dataclasses.replace(program.graph, meta={**program.graph.meta, "on_chip_bytes": 0})
    all_live_bytes = xla_accounted_peak_bytes(all_live, None, measured.alias_bytes)
    rows.append(
      {
        "step": name,
        "target": target,
        "model": model,
        "nodes": program.graph.n,
        "eqns": program.graph.meta["n_eqns"],
        "predicted_bytes": predicted,
        "xla_bytes": measured.peak_bytes,
        "ratio": round(predicted / measured.peak_bytes, 3),
        "all_live_ratio": round(all_live_bytes / measured.peak_bytes, 3),
        "trace_s": round(trace_s, 1),
      }
    )
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default="cpu")
  parser.add_argument("--models", default="rules,compiler")
  parser.add_argument(
    "--steps", help="comma-separated (default: all; the six examples with --batch-scale)"
  )
  parser.add_argument("--batch-scale", type=int, default=1, help="the examples' batch times this")
  parser.add_argument("--out", default=None)
  ns = parser.parse_args()
  jaxremat.get_target(ns.target)  # before any array exists (a deviceless GPU needs it)
  scaled = f"_batchx{ns.batch_scale}" if ns.batch_scale != 1 else ""
  out = ns.out or os.path.join(RESULTS, f"model_accuracy_{ns.target}{scaled}")
  rows = []
  print(
    f"{'step':10} {'model':9} {'nodes':>6} {'predicted MiB':>14} {'XLA MiB':>9} {'ratio':>6} "
    f"{'all live':>8}"
  )
  steps = ns.steps or ",".join(STEPS if ns.batch_scale == 1 else examples.EXAMPLES)
  for name in steps.split(","):
    for r in measure_step(name, ns.target, ns.models.split(","), ns.batch_scale):
      rows.append(r)
      print(
        f"{r['step']:10} {r['model']:9} {r['nodes']:>6} {r['predicted_bytes'] / 2**20:>14.2f} "
        f"{r['xla_bytes'] / 2**20:>9.2f} {r['ratio']:>6.3f} {r['all_live_ratio']:>8.3f}",
        flush=True,
      )
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  with open(out + ".json", "w") as f:
    json.dump({"jax_version": jax.__version__, "target": ns.target, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
