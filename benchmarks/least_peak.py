"""How low recomputation takes each example's step in jaxremat's model, beside what the
end-to-end benchmark's best plans measured.

Usage: python -m benchmarks.least_peak [--target tpu-v5e] [--examples mlp,unet,...]
                                       [--time-limit 40]

For each example's training step as benchmarks/e2e.py compiles it (default size, Adam, no
donation): the target compiler's peak, the model's count of the original, the bound no
plan goes below in the model (`xla_memory.peak_bound`, a proof in the model), and the
least peak of a plan in the model (`planner._Loop.least_peak_plan`: `minimize_peak` with
``auto`` on the planner's graph, as `optimize` searches it before it reports a missed
budget; a search), each counted as the compiler counts a peak. Where
benchmarks/results/e2e_<target>.json exists, the budgets it missed and its best plan's
peak beside them. Prints a table; writes benchmarks/results/least_peak_<target>.{csv,json}.
"""

from __future__ import annotations

import argparse
import json
import time

import examples
import jaxremat
from benchmarks.e2e import RESULTS, _write_csv, example_step
from jaxremat._src.planner import PlanOptions, _Deadline, _Loop
from jaxremat._src.signature import call_signature


def e2e_misses(target: jaxremat.Target) -> dict[str, dict]:
  """Per example, the budgets benchmarks/e2e.py missed on ``target`` and the least peak
  its plans measured (fractions of the original's), from its results file."""
  path = RESULTS / f"e2e_{target.name}.json"
  if not path.exists():
    return {}
  misses: dict[str, dict] = {}
  for row in json.loads(path.read_text())["rows"]:
    best = row.get("best_plan")
    if best:
      miss = misses.setdefault(row["example"], {"budgets": [], "best_ratio": best["peak_ratio"]})
      miss["budgets"].append(row["budget"])
      miss["best_ratio"] = min(miss["best_ratio"], best["peak_ratio"])
  return misses


def least_peak(name: str, target: jaxremat.Target, time_limit_s: float) -> dict:
  """The model's original and least-peak plan for one example's step, in bytes as the
  compiler counts a peak."""
  step, args = example_step(name, None)
  program = jaxremat.trace_program(step, *args, target=target)
  baseline = program.baseline or jaxremat.measure(step, *args, runs=0, target=target)
  opts = PlanOptions(budget=1.0, target=target, progress=False)
  # The planner's own loop: the same graph and count of a peak as `least_peak_hint`.
  loop = _Loop(
    program,
    call_signature(args, {}),
    baseline.peak_bytes,
    opts,
    _Deadline(time_limit_s),
    baseline,
  )
  start = time.perf_counter()
  loop.least_peak_plan(time_limit_s)
  return {
    "example": name,
    "xla_peak_bytes": baseline.peak_bytes,
    "model_peak_bytes": loop.baseline_peak_bytes - loop.baseline_gap_bytes,
    "model_bound_bytes": loop.model_bound_bytes,
    "least_peak_bytes": loop.least_peak_bytes,
    "search_s": time.perf_counter() - start,
  }


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", default=None, help="cpu, tpu-v5e, h100, ... (default: here)")
  parser.add_argument(
    "--examples", default=None, help="comma-separated (default: those e2e missed a budget on)"
  )
  parser.add_argument("--time-limit", type=float, default=40.0, help="seconds per search")
  args = parser.parse_args(argv)
  target = jaxremat.get_target(args.target)
  misses = e2e_misses(target)
  names = (
    args.examples.split(",") if args.examples else [n for n in examples.EXAMPLES if n in misses]
  )
  rows = []
  print("| example | budgets e2e missed | best plan | model's original | bound | least peak |")
  print("|---|---|---|---|---|---|")
  for name in names:
    row = least_peak(name, target, args.time_limit)
    miss = misses.get(name, {})
    row.update(
      target=target.name, e2e_missed=miss.get("budgets", []), e2e_best_ratio=miss.get("best_ratio")
    )
    rows.append(row)
    xla = row["xla_peak_bytes"]
    best = f"x{row['e2e_best_ratio']:.3f}" if row["e2e_best_ratio"] else ""
    print(
      f"| {name} | {', '.join(map(str, row['e2e_missed']))} | {best} "
      f"| x{row['model_peak_bytes'] / xla:.3f} | x{row['model_bound_bytes'] / xla:.3f} "
      f"| x{row['least_peak_bytes'] / xla:.3f} |",
      flush=True,
    )
  out = RESULTS / f"least_peak_{target.name}"
  out.with_suffix(".json").write_text(
    json.dumps({"time_limit_s": args.time_limit, "rows": rows}, indent=1)
  )
  _write_csv(out.with_suffix(".csv"), rows)
  return rows


if __name__ == "__main__":
  main()
