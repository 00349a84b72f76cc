"""A step whose layers run under `lax.scan` (examples/scanned_gpt.py: 8 layers, stacked
weights, Adam): `jax.checkpoint` on the scan body with each built-in policy, nested
sqrt(L) checkpointing, and `jaxremat.optimize` at each budget, as the target compiler
measures them (peak, FLOPs, compile time). Results in ``benchmarks/results/scan_<target>.{csv,json}``.

  python -m benchmarks.scan --target cpu --budgets 0.7,0.5,0.3

XLA's cost analysis counts a loop body once, whatever its trip count: the FLOPs here
are of the program as compiled, so a recomputation inside the backward loop counts once
per layer's body, not once per layer.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import time

import jaxremat
from examples import _common, scanned_gpt

POLICIES = (
  "nothing_saveable",
  "dots_saveable",
  "dots_with_no_batch_dims_saveable",
  "everything_saveable",
  "nested",
)
RESULTS = pathlib.Path(__file__).parent / "results"


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default=None, help="cpu, tpu-v5e, h100, ... (default: here)")
  parser.add_argument("--budgets", default="0.7,0.5,0.3")
  parser.add_argument("--time-limit", type=float, default=60.0)
  parser.add_argument(
    "--at-policies",
    action="store_true",
    help="also plan at each policy's measured peak (bytes) that is below no remat's",
  )
  args = parser.parse_args(argv)
  target = jaxremat.get_target(args.target)
  step, step_args = scanned_gpt.make_train_step()
  params, _, batch = step_args
  rows = []

  def measured(method, fn, extra=None):
    m = jaxremat.measure(fn, *step_args, target=target, runs=0)
    rows.append(
      {
        "method": method,
        "peak_bytes": m.peak_bytes,
        "flops": m.flops,
        "compile_s": m.compile_time_s,
        **(extra or {}),
      }
    )
    return m

  base = measured("no remat", step)
  for policy in POLICIES:
    loss = lambda p, b, policy=policy: scanned_gpt.loss(p, b, checkpoint=policy)  # noqa: E731
    measured(f"ckpt {policy}", _common.make_train_step(loss, params, batch)[0])
  budgets: list[float | int] = [float(b) for b in args.budgets.split(",")]
  if args.at_policies:
    budgets += sorted({r["peak_bytes"] for r in rows[1:] if r["peak_bytes"] < base.peak_bytes})
  for budget in budgets:
    fast = jaxremat.optimize(
      step,
      budget=budget,
      time_limit=args.time_limit,
      use_cache=False,
      progress=False,
      target=target,
    )
    start = time.perf_counter()
    try:
      plan = fast.plan(*step_args)
      met = True
    except jaxremat.BudgetNotMetError as e:
      plan, met = e.plan, False
    stats = plan.schedule.stats["optimize"]
    rows.append(
      {
        "method": f"jaxremat @{budget if isinstance(budget, float) else f'{budget / base.peak_bytes:.3f} (a policy)'}",
        "peak_bytes": plan.measured_peak_bytes,
        "flops": plan.measurement.flops,
        "compile_s": plan.measurement.compile_time_s,
        "met": met,
        "predicted_bytes": stats["predicted_peak_bytes"],
        "plans": len(plan.attempts),
        "plan_s": round(time.perf_counter() - start, 1),
        "solver": plan.schedule.solver,
        "loops": "; ".join(loop.line for loop in plan.program.loops),
      }
    )
  for row in rows:
    row["x_peak"] = row["peak_bytes"] / base.peak_bytes
    row["x_flops"] = row["flops"] / base.flops if row["flops"] else None
    row["x_compile"] = row["compile_s"] / base.compile_time_s
  ours = [r for r in rows if r["method"].startswith("jaxremat") and r.get("met")]
  for r in rows:
    if r["method"].startswith("ckpt"):
      # A policy point that no met plan matches with at most its peak and its FLOPs.
      r["dominated_by_jaxremat"] = any(
        o["peak_bytes"] <= r["peak_bytes"] and o["flops"] <= r["flops"] for o in ours
      )
  print(
    f"{'method':<42}{'peak MiB':>10}{'x peak':>8}{'x FLOPs':>9}{'x compile':>10}"
    f"{'predicted':>11}{'plans':>6}"
  )
  for r in rows:
    pred = r.get("predicted_bytes")
    print(
      f"{r['method']:<42}{r['peak_bytes'] / 2**20:>10.2f}{r['x_peak']:>8.3f}"
      f"{r['x_flops']:>9.3f}{r['x_compile']:>10.2f}"
      f"{'' if pred is None else f'{pred / 2**20:.2f}':>11}{r.get('plans', ''):>6}"
      + ("" if r.get("met", True) else "  NOT MET")
    )
  for r in rows:
    if r.get("loops"):
      print(f"{r['method']}: {r['loops']}")
  RESULTS.mkdir(exist_ok=True)
  stem = RESULTS / f"scan_{target.name}"
  stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
  with open(stem.with_suffix(".csv"), "w", newline="") as f:
    fields = sorted({k for r in rows for k in r})
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
  return rows


if __name__ == "__main__":
  main()
