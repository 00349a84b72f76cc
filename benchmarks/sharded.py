"""Sharded training steps: jaxremat against jax.checkpoint, per device, on a device mesh.

For each example step under each sharding (`examples.sharded`: data parallel, FSDP,
tensor parallel) over a mesh of host CPU devices it measures, with the compiler's figures
for one device's part of the partitioned step (`jaxremat.measure`: memory_analysis peak,
cost_analysis FLOPs):

* no remat (budgets are fractions of its per-device peak), and the peak jaxremat's model
  predicts for it;
* the jax.checkpoint variants (`examples._common.CHECKPOINT_VARIANTS`) on the same sharded
  step;
* `jaxremat.optimize` at each budget: the measured and predicted per-device peak, FLOPs,
  whether the outputs match the unoptimized sharded step, and whether a variant has a lower
  peak at no more FLOPs (``dominated_by``).

``--target tpu-v5e`` compiles the same steps for a 2x2 TPU v5e slice (4 chips, deviceless:
the host mesh laid over them); outputs are checked on the host mesh.

Writes benchmarks/results/sharded[_TARGET].{csv,json}. Run from the repository root:
  python -m benchmarks.sharded                         # GPT and ResNet, dp/fsdp/tp, 4 devices
  python -m benchmarks.sharded --devices 8 --steps gpt:fsdp
  python -m benchmarks.sharded --target tpu-v5e
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import tempfile
import time

import jax

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STEPS = ("gpt:dp", "gpt:fsdp", "gpt:tp", "resnet:dp", "resnet:fsdp")
BUDGETS = (0.7, 0.5)


def _close(got, want) -> bool:
  import numpy as np

  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.linalg.norm(a - b) > 1e-4 * max(np.linalg.norm(b), 1e-30):
      return False
  return True


def run_step(name: str, mode: str, time_limit_s: float, target: str | None, **sizes) -> list[dict]:
  import jaxremat
  from examples import _common, sharded
  from jaxremat._src.verify import collectives_as_planned, planned_sent_bytes, unplanned_sent_bytes
  from jaxremat._src.xla_memory import xla_accounted_peak_bytes

  def measured(variant=None):
    step, args, _ = sharded.sharded_train_step(name, mode, checkpoint=variant, **sizes)
    return jaxremat.measure(step, *args, runs=0, donate_argnums=(0, 1), target=target)

  step, args, place = sharded.sharded_train_step(name, mode, **sizes)
  base = measured()
  program = jaxremat.trace_program(step, *args, target=target)
  predicted = xla_accounted_peak_bytes(program.graph, None, base.alias_bytes)
  expected = step(*place())
  rows = [_row(name, mode, "no remat", None, base, base, predicted)]
  rows[0]["sent_mib"] = round(base.sent_bytes / 2**20, 2)
  for variant in _common.CHECKPOINT_VARIANTS:
    rows.append(_row(name, mode, variant, None, measured(variant), base))
  for budget in BUDGETS:
    fast = jaxremat.optimize(
      step, budget=budget, time_limit=time_limit_s, target=target, cache_dir=tempfile.mkdtemp()
    )
    start = time.perf_counter()
    try:
      plan = fast.plan(*place())
    except jaxremat.BudgetNotMetError as e:
      plan = e.plan
    chosen = next(a for a in plan.attempts if a.measured_peak_bytes == plan.measured_peak_bytes)
    row = _row(name, mode, "jaxremat", budget, plan.measurement, base, chosen.predicted_peak_bytes)
    row["plan_s"] = round(time.perf_counter() - start, 1)
    row["plans"] = len(plan.attempts)
    row["chosen_by"] = f"{chosen.solver} ({chosen.origin})"  # which part of jaxremat
    row["outputs_match"] = _close(plan.compiled(*place()), expected)
    row["sent_mib"] = round(plan.measurement.sent_bytes / 2**20, 2)
    # What the recomputations' collectives send (the model's), and beyond the step's and
    # theirs, what XLA sends (`verify.collectives_as_planned`).
    planned = planned_sent_bytes(plan.program, plan.schedule)
    unplanned = unplanned_sent_bytes(base.sent_bytes, plan.measurement.sent_bytes, planned)
    row["planned_sent_mib"] = round(planned / 2**20, 2)
    row["unplanned_sent_mib"] = round(unplanned / 2**20, 2)
    row["collectives_as_planned"] = collectives_as_planned(unplanned, base.sent_bytes)
    rows.append(row)
  for row in rows:
    if row["method"] == "jaxremat":
      row["dominated_by"] = " ".join(
        r["method"]
        for r in rows
        if r["method"] in _common.CHECKPOINT_VARIANTS
        and r["peak_ratio"] < row["peak_ratio"]
        and r["flops_ratio"] <= row["flops_ratio"]
      )
  return rows


def _row(name, mode, method, budget, m, base, predicted=None) -> dict:
  return {
    "target": m.target,
    "step": name,
    "mode": mode,
    "devices": len(jax.devices()),
    "method": method,
    "budget": budget,
    "peak_mib": round(m.peak_bytes / 2**20, 2),
    "peak_ratio": round(m.peak_bytes / base.peak_bytes, 3),
    "met": None if budget is None else m.peak_bytes <= budget * base.peak_bytes,
    "predicted_mib": None if predicted is None else round(predicted / 2**20, 2),
    "model_error": None if predicted is None else round(predicted / m.peak_bytes - 1, 3),
    "flops_ratio": round((m.flops or 0) / (base.flops or 1), 3),
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4, help="host CPU devices in the mesh")
  parser.add_argument("--steps", nargs="*", default=list(STEPS), help="model:mode pairs")
  parser.add_argument("--time-limit", type=float, default=120.0)
  parser.add_argument("--tag", default=None, help="results file name (default: sharded[_TARGET])")
  parser.add_argument("--target", default=None, help="e.g. tpu-v5e: a 2x2 slice, as many chips")
  parser.add_argument("--batch", type=int, default=None, help="the examples' batch size")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", args.devices)
  tag = args.tag or "sharded" + (f"_{args.target}" if args.target else "")
  sizes = {} if args.batch is None else {"batch": args.batch}
  rows = []
  for pair in args.steps:
    name, mode = pair.split(":")
    for row in run_step(name, mode, args.time_limit, args.target, **sizes):
      rows.append(row)
      print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / f"{tag}.json").write_text(json.dumps(rows, indent=1))
  with open(RESULTS / f"{tag}.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
    writer.writeheader()
    writer.writerows(rows)
  print(f"wrote {RESULTS / tag}.csv", file=sys.stderr)


if __name__ == "__main__":
  main()
