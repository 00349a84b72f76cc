"""How closely each solver honors a tiny time limit on a large shared graph.

Every registered solver solves ``--graph`` at budget 0.8 with each ``--time-limit``; the
table shows the wall seconds of `jaxremat.solve` (imports excluded: each solver is
imported once before timing), the overrun beyond the limit, the outcome and the
1-minute load average. Writes benchmarks/results/time_limits.csv.

Run from the repository root:
  python benchmarks/time_limits.py --graph moccasin_rl1000 --time-limit 0.5 1 2
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import time

import jaxremat
from jaxremat import InfeasibleBudgetError, NoScheduleFoundError, RematGraph
from jaxremat._src.solvers.base import get_solver

ROOT = pathlib.Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "graphs"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--graph", default="moccasin_rl1000")
  parser.add_argument("--time-limit", type=float, nargs="+", default=[0.5, 1.0, 2.0])
  parser.add_argument("--workers", type=int, default=2)
  args = parser.parse_args()
  graph = RematGraph.load(GRAPHS / f"{args.graph}.json")
  rows = []
  print(
    f"{'solver':<16}{'limit s':>8}{'wall s':>8}{'over s':>8}  {'outcome':<22}{'load':>6}  found by"
  )
  for solver in jaxremat.available_solvers():
    get_solver(solver)
    for limit in args.time_limit:
      start = time.perf_counter()
      try:
        stats = jaxremat.solve(
          graph, 0.8, solver=solver, time_limit=limit, workers=args.workers
        ).stats
        outcome, found_by = stats["status"], stats.get("found_by")
      except (InfeasibleBudgetError, NoScheduleFoundError) as e:
        outcome, found_by = type(e).__name__, None
      wall_s = time.perf_counter() - start
      load = os.getloadavg()[0]
      row = dict(
        graph=args.graph,
        solver=solver,
        time_limit_s=limit,
        wall_s=round(wall_s, 3),
        overrun_s=round(max(0.0, wall_s - limit), 3),
        outcome=outcome,
        found_by=found_by,
        load_1min=round(load, 2),
      )
      rows.append(row)
      print(
        f"{solver:<16}{limit:>8g}{wall_s:>8.2f}{row['overrun_s']:>8.2f}  {outcome:<22}{load:>6.1f}"
        f"  {found_by or '-'}",
        flush=True,
      )
  out = ROOT / "benchmarks" / "results" / "time_limits.csv"
  out.parent.mkdir(parents=True, exist_ok=True)
  with open(out, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  print(f"\nwrote {out}")


if __name__ == "__main__":
  main()
