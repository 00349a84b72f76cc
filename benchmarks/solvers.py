"""Exact solvers (moccasin, checkmate, checkmate-lp) against the reference table of BENCHMARKS.md.

Each reference row runs with a time limit of one fifth of the reference time (the
acceptance target), unless a row says otherwise; the table gives the TDI, the time to the
best schedule and the total time beside the reference's. Every schedule is checked by
`jaxremat.simulate` (inside `jaxremat.solve`).

  python benchmarks/solvers.py                 # every row (about 55 minutes)
  python benchmarks/solvers.py --quick         # the small rows only (about 2 minutes)
  python benchmarks/solvers.py --only rl100 --workers 2
  python benchmarks/solvers.py --parts large,free --tag solvers_large   # the 300 s rows
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import sys
import time

import jaxremat
from jaxremat import InfeasibleBudgetError, NoScheduleFoundError, RematGraph

ROOT = pathlib.Path(__file__).resolve().parent
GRAPHS = ROOT.parents[1] / "shared" / "graphs"
RESULTS = ROOT / "results"

# graph, m, reference TDI % (None: no schedule found), reference time s, time limit s.
# The limit is reference / 5 (the target) except where the acceptance names its own.
REFERENCE = [
  ("checkmate_vgg16_train", 0.9, 1.968, 2.2, None),
  ("checkmate_vgg19_train", 0.8, 4.851, 6.0, None),
  ("checkmate_fcn_8_vgg_train", 0.8, 0.136, 23.2, None),
  ("moccasin_rl100", 0.9, 0.789, 73.1, None),
  ("moccasin_rl100", 0.8, 2.296, 78.0, None),
  ("checkmate_resnet50_train", 0.8, None, 180.0, 120.0),
  ("moccasin_rl250", 0.9, 22.612, 970.0, None),
  ("checkmate_resnet50_train", 0.9, 0.108, 1143.0, None),
  ("moccasin_rl250", 0.8, None, 1202.0, 300.0),
  ("checkmate_segnet_train", 0.8, 0.207, 31.0, None),
  ("checkmate_vgg_unet_train", 0.8, 1.984, 20.4, None),
  ("checkmate_mobilenet_train", 0.8, 0.370, 323.8, None),
]
LARGE = [
  ("moccasin_rl500", 0.9, None, None, 300.0),
  ("moccasin_rl500", 0.8, None, None, 300.0),
  ("moccasin_rl1000", 0.9, None, None, 300.0),
  ("moccasin_rl1000", 0.8, None, None, 300.0),
]
# The free order on the rows where the staged input order is hardest: the heuristics'
# warm start on `reorder`'s order fits there when the input order's does not.
FREE = [
  ("moccasin_rl250", 0.8, None, None, 300.0),
  ("moccasin_rl1000", 0.8, None, None, 300.0),
]
PARTS = ("reference", "large", "free", "compare")
# checkmate (MILP) and checkmate-lp against staged moccasin on the same rows.
COMPARE = [
  ("checkmate_vgg16_train", 0.9),
  ("checkmate_vgg19_train", 0.8),
  ("checkmate_fcn_8_vgg_train", 0.8),
]
# Acceptance targets for rows where the reference found nothing.
TARGET_TDI = {("checkmate_resnet50_train", 0.8): 1.0}
QUICK = {
  "checkmate_vgg16_train",
  "checkmate_vgg19_train",
  "checkmate_fcn_8_vgg_train",
  "checkmate_segnet_train",
  "checkmate_vgg_unet_train",
}


def run_one(
  graph: RematGraph, m: float, solver: str, time_limit_s: float, workers: int, **options
) -> dict:
  """Solves one row; failures are rows too (status none / infeasible).

  ``found_by`` says which part of the solver found the schedule (warm start, CP-SAT or
  MILP search, LP rounding); a `NoScheduleFoundError` from a solver that proved its own
  model infeasible leaves that model's bound in ``restricted_bound_bytes``.

  ``cpu_history`` pairs each better schedule's duration with this process's CPU seconds
  (`time.process_time`) at that moment: on a shared machine, CPU seconds / workers
  approximates the wall time of an idle one.
  """
  load_before = os.getloadavg()[0]
  start = time.perf_counter()
  cpu_start = time.process_time()
  cpu_history = []

  def on_progress(p: jaxremat.Progress) -> None:
    if p.best_duration is not None:
      cpu_history.append([time.process_time() - cpu_start, p.best_duration])

  row = {
    "graph": graph.name,
    "m": m,
    "solver": solver,
    "time_limit_s": time_limit_s,
    "workers": workers,
    "order": options.get("order", "staged" if solver == "moccasin" else ""),
  }
  try:
    schedule = jaxremat.solve(
      graph,
      m,
      solver,
      time_limit=time_limit_s,
      workers=workers,
      progress=on_progress,
      **options,
    )
    stats = schedule.stats
    row.update(
      status=stats["status"],
      budget_bytes=schedule.budget,
      peak_bytes=stats["peak_bytes"],
      tdi_percent=stats["tdi_percent"],
      time_to_best_s=stats.get("time_to_best_s"),
      lower_bound=stats.get("lower_bound"),
      n_recompute=stats["n_recompute"],
      found_by=stats.get("found_by"),
    )
    row["history"] = stats.get("history", [])
    row["baseline_duration"] = stats["baseline_duration"]
    if "rounding" in stats:
      row["rounding"] = stats["rounding"]
  except InfeasibleBudgetError as e:
    row.update(status="infeasible", error=str(e))
  except NoScheduleFoundError as e:
    row.update(status="none", error=str(e))
    row["restricted_bound_bytes"] = getattr(e, "restricted_bound_bytes", None)
  row["total_s"] = time.perf_counter() - start
  row["cpu_s"] = time.process_time() - cpu_start
  row["cpu_history"] = cpu_history
  row["load_1min"] = round((load_before + os.getloadavg()[0]) / 2, 2)
  return row


def time_to_target(row: dict, history: str = "history") -> float | None:
  """Seconds until the first schedule at least as good as the target TDI (see TARGET):
  wall seconds from ``history``, process CPU seconds from ``cpu_history``."""
  target = TARGET_TDI.get((row["graph"], row["m"]), row.get("ref_tdi_percent"))
  if not row.get(history) or "baseline_duration" not in row:
    return None
  for elapsed_s, duration in row[history]:
    if target is None or 100 * (duration / row["baseline_duration"] - 1) <= target + 5e-4:
      return elapsed_s
  return None


def verdict(row: dict) -> str:
  """ "meets" (wall time), "meets in CPU time" (CPU seconds / workers within the target,
  wall time not: the machine was shared), "TDI worse", "slower" or "no schedule"."""
  ref_tdi, ref_time = row.get("ref_tdi_percent"), row.get("ref_time_s")
  if row["status"] not in ("optimal", "feasible"):
    return "no schedule"
  ok_tdi = ref_tdi is None or row["tdi_percent"] <= ref_tdi + 5e-4
  target_tdi = TARGET_TDI.get((row["graph"], row["m"]))
  if target_tdi is not None:
    ok_tdi = ok_tdi and row["tdi_percent"] <= target_tdi + 5e-4
  if not ok_tdi:
    return "TDI worse"
  target_s = row["time_limit_s"] if ref_time is None else min(row["time_limit_s"], ref_time / 5)
  wall_s, cpu_s = row.get("time_to_target_s"), row.get("cpu_to_target_s")
  if wall_s is not None and wall_s <= target_s:
    return "meets"
  if cpu_s is not None and cpu_s / row["workers"] <= target_s:
    return "meets in CPU time"
  return "slower"


def fmt(x, spec=".3f") -> str:
  return "-" if x is None else format(x, spec)


HEAD = (
  "graph",
  "m",
  "solver",
  "order",
  "status",
  "found by",
  "TDI %",
  "target s",
  "target CPU s",
  "best s",
  "total s (limit)",
  "CPU s",
  "ref TDI %",
  "ref s",
  "verdict",
  "load",
)


def print_table(rows: list[dict], header: bool = True) -> None:
  """Markdown rows; ``target s`` / ``target CPU s``: wall / process CPU seconds to the first
  schedule with the target TDI (the first schedule where there is no reference)."""
  if header:
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
  for r in rows:
    cells = [
      r["graph"].removeprefix("checkmate_").removeprefix("moccasin_"),
      str(r["m"]),
      r["solver"],
      r.get("order", ""),
      r["status"],
      r.get("found_by") or "-",
      fmt(r.get("tdi_percent")),
      fmt(r.get("time_to_target_s"), ".2f"),
      fmt(r.get("cpu_to_target_s"), ".2f"),
      fmt(r.get("time_to_best_s"), ".2f"),
      f"{r['total_s']:.1f} ({r['time_limit_s']:g})",
      fmt(r.get("cpu_s"), ".1f"),
      fmt(r.get("ref_tdi_percent")),
      fmt(r.get("ref_time_s"), ".1f"),
      r.get("verdict", ""),
      str(r["load_1min"]),
    ]
    print("| " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small checkmate graphs only")
  parser.add_argument("--only", default="", help="run rows whose graph name contains this")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--max-time", type=float, default=300.0, help="cap on any row's limit")
  parser.add_argument(
    "--time-fraction",
    type=float,
    default=0.2,
    help="limit of a reference row as a fraction of the reference time (0.2: the target)",
  )
  parser.add_argument(
    "--compare-time",
    type=float,
    default=120.0,
    help="time limit of the checkmate / moccasin comparison rows",
  )
  parser.add_argument(
    "--parts",
    default=",".join(PARTS),
    help="comma-separated parts to run: reference (the BENCHMARKS.md rows), large (rl500 "
    "and rl1000), free (free-order rows), compare (checkmate against moccasin)",
  )
  parser.add_argument("--tag", default="solvers", help="results/TAG.csv and TAG.json")
  args = parser.parse_args(argv)

  def wanted(name: str) -> bool:
    return (not args.quick or name in QUICK) and args.only in name

  rows = []

  def record(row: dict) -> None:
    row["time_to_target_s"] = time_to_target(row)
    row["cpu_to_target_s"] = time_to_target(row, "cpu_history")
    row["verdict"] = verdict(row)
    print_table([row], header=not rows)
    rows.append(row)

  parts = args.parts.split(",")
  unknown = set(parts) - set(PARTS)
  if unknown:
    parser.error(f"--parts={args.parts!r} names {sorted(unknown)}; use some of {PARTS}.")
  moccasin_rows = [
    (row, order)
    for part, rows_of_part, order in (
      ("reference", REFERENCE, "staged"),
      ("large", LARGE, "staged"),
      ("free", FREE, "free"),
    )
    if part in parts
    for row in rows_of_part
  ]
  for (name, m, ref_tdi, ref_time, limit), order in moccasin_rows:
    if not wanted(name):
      continue
    graph = RematGraph.load(GRAPHS / f"{name}.json")
    limit = min(limit or ref_time * args.time_fraction, args.max_time)
    row = run_one(graph, m, "moccasin", limit, args.workers, order=order)
    row.update(ref_tdi_percent=ref_tdi, ref_time_s=ref_time)
    record(row)
  if "compare" in parts:
    for name, m in COMPARE:
      if not wanted(name):
        continue
      graph = RematGraph.load(GRAPHS / f"{name}.json")
      for solver in ("moccasin", "checkmate", "checkmate-lp"):
        record(run_one(graph, m, solver, args.compare_time, args.workers))

  RESULTS.mkdir(exist_ok=True)
  fields = [
    "graph",
    "m",
    "solver",
    "order",
    "status",
    "found_by",
    "tdi_percent",
    "time_to_best_s",
    "time_to_target_s",
    "cpu_to_target_s",
    "total_s",
    "cpu_s",
    "time_limit_s",
    "ref_tdi_percent",
    "ref_time_s",
    "verdict",
    "budget_bytes",
    "peak_bytes",
    "n_recompute",
    "lower_bound",
    "workers",
    "load_1min",
    "restricted_bound_bytes",
    "error",
  ]
  with open(RESULTS / f"{args.tag}.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
  meta = {
    "workers": args.workers,
    "cpu_count": os.cpu_count(),
    "argv": argv,
    "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
  }
  (RESULTS / f"{args.tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
  print("\nAll rows:\n")
  print_table(rows)


if __name__ == "__main__":
  main(sys.argv[1:])
