"""Heuristic and structural solvers and `auto` on the shared graph suite.

Parts (``--parts``, comma-separated; all but ``long`` by default), each printing a table
and writing under benchmarks/results/. Every solve records wall seconds, process CPU
seconds (all threads) and the 1-minute load average: the machine is shared.

* ``heuristics``: every heuristic on every graph at budgets 0.9 / 0.8 / 0.7 -> status, peak,
  TDI, times (``heuristics.csv``).
* ``twremat``: the TWRemat(k) curve (peak and length against noremat) on the Checkmate
  training graphs and the random layered graphs (``heuristics.twremat.csv`` and the plot
  ``heuristics.twremat.png``).
* ``long``: ``--long-solver`` (default `auto`) at 0.8 with ``--long-time-limit`` seconds
  (default 600) on the graphs given (``heuristics.long_<solver><T>s.csv``).
* ``auto``: `auto` at 0.8 within ``--auto-time-limit`` seconds on every graph
  (``heuristics.auto.csv``; with ``--long-time-limit``, also a longer `auto` run).
* ``compare``: `auto` against the best TDI any run reached: the heuristics, the long runs,
  and the MOCCASIN reference runs of shared/design/BENCHMARKS.md (``heuristics.compare.csv``).

Run from the repository root:
  python benchmarks/heuristics.py                       # everything but the long runs
  python benchmarks/heuristics.py --parts long --long-solver moccasin \
    --graphs moccasin_rl250 moccasin_rl500 moccasin_rl1000 checkmate_resnet50_train
  python benchmarks/heuristics.py --parts compare
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import time

import jaxremat
from jaxremat import InfeasibleBudgetError, NoScheduleFoundError, RematGraph, simulate
from jaxremat._src.solvers.twremat import twremat_curve

ROOT = pathlib.Path(__file__).resolve().parents[1]
GRAPHS = ROOT.parent / "shared" / "graphs"
RESULTS = ROOT / "benchmarks" / "results"
HEURISTICS = (
  "reorder",
  "cover",
  "cover-staged",
  "xla-greedy",
  "chen-sqrtn",
  "chen-sqrtn-ap",
  "chen-greedy",
  "chen-greedy-ap",
  "griewank",
  "griewank-ap",
  "twremat",
)
BUDGETS = (0.9, 0.8, 0.7)
# MOCCASIN reference implementation, 2 cores (shared/design/BENCHMARKS.md): TDI % at 0.8.
REFERENCE_TDI_08 = {
  "checkmate_vgg19_train": 4.851,
  "checkmate_fcn_8_vgg_train": 0.136,
  "moccasin_rl100": 2.296,
  "checkmate_segnet_train": 0.207,
  "checkmate_vgg_unet_train": 1.984,
  "checkmate_mobilenet_train": 0.370,
}


def _run(graph, fraction, solver, time_limit, **options):
  """One solve: status, TDI, wall and process CPU seconds, and the 1-minute load average.

  The machine is shared: CPU seconds (every thread of this process) say how much work the
  solve did, wall seconds how long it waited too.
  """
  start, cpu_start = time.perf_counter(), time.process_time()

  def clocks():
    return {
      "time_s": time.perf_counter() - start,
      "cpu_s": time.process_time() - cpu_start,
      "load_1min": os.getloadavg()[0],
    }

  try:
    s = jaxremat.solve(graph, fraction, solver, time_limit=time_limit, workers=2, **options)
  except InfeasibleBudgetError:
    return {"status": "infeasible", "found_by": None, **clocks()}
  except NoScheduleFoundError:
    return {"status": "none", "found_by": None, **clocks()}
  st = s.stats
  return {
    "status": st["status"],
    "found_by": st.get("found_by"),
    "peak_bytes": st["peak_bytes"],
    "peak_fraction": st["peak_bytes"] / st["baseline_peak_bytes"],
    "tdi_percent": st["tdi_percent"],
    "n_recompute": st["n_recompute"],
    **clocks(),
    "best_solver": st.get("best_solver"),
  }


def _write_csv(path, rows):
  keys = sorted({k for row in rows for k in row}, key=lambda k: (k not in ("graph", "solver"), k))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)


def _fmt(row):
  if "tdi_percent" not in row:
    return f"{row['status']:>10}"
  return f"{row['tdi_percent']:8.2f}%{'' if row['status'] == 'optimal' else ' '}"


def part_heuristics(names, time_limit, solvers=HEURISTICS):
  """Every solver of ``solvers`` on every graph; rows of other solvers in the CSV are kept."""
  rows = []
  print(
    f"\n{'graph':28} {'solver':15} " + " ".join(f"{m:>10}" for m in BUDGETS) + "   time s  found by"
  )
  for name in names:
    graph = RematGraph.load(GRAPHS / f"{name}.json")
    for solver in solvers:
      cells, total_s, found_by = [], 0.0, []
      for fraction in BUDGETS:
        row = {"graph": name, "solver": solver, "budget": fraction}
        row.update(_run(graph, fraction, solver, time_limit))
        rows.append(row)
        cells.append(_fmt(row))
        total_s += row["time_s"]
        found_by.append(row["found_by"] or "-")
      found = ", ".join(dict.fromkeys(found_by))
      print(f"{name:28} {solver:15} " + " ".join(cells) + f" {total_s:8.2f}  {found}", flush=True)
  path = RESULTS / "heuristics.csv"
  redone = {(r["graph"], r["solver"]) for r in rows}
  kept = [r for r in _read_csv(path) if (r["graph"], r["solver"]) not in redone]
  order = {solver: k for k, solver in enumerate(HEURISTICS)}
  rows = sorted(kept + rows, key=lambda r: (r["graph"], order.get(r["solver"], len(order))))
  _write_csv(path, rows)
  return rows


def part_twremat(names):
  rows, curves = [], {}
  print(f"\n{'graph':28} width  k: peak/noremat, length/noremat")
  for name in names:
    if not (name.startswith("moccasin_rl") or name.endswith("_train")):
      continue
    graph = RematGraph.load(GRAPHS / f"{name}.json")
    base = simulate(graph, jaxremat.baseline_schedule(graph))
    start = time.perf_counter()
    curve = twremat_curve(graph, time_limit_s=60)
    elapsed = time.perf_counter() - start
    points = []
    for k, schedule, result in curve:
      point = {
        "graph": name,
        "k": k,
        "width": schedule.stats["width"],
        "peak_fraction": result.peak_bytes / base.peak_bytes,
        "length_ratio": result.n_compute / len(graph.order),
        "duration_ratio": result.duration / base.duration,
        "curve_time_s": elapsed,
      }
      rows.append(point)
      points.append(point)
    curves[name] = points
    best = min(points, key=lambda p: p["peak_fraction"])
    print(
      f"{name:28} {points[0]['width']:5}  "
      + "  ".join(f"{p['k']}: {p['peak_fraction']:.3f},{p['length_ratio']:.2f}" for p in points)
      + f"  | least peak {best['peak_fraction']:.3f} at length x{best['length_ratio']:.2f}"
      f" ({elapsed:.1f} s)",
      flush=True,
    )
  _write_csv(RESULTS / "heuristics.twremat.csv", rows)
  _plot(curves)
  return rows


def _plot(curves):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  for name, points in curves.items():
    ax = axes[0] if name.startswith("checkmate") else axes[1]
    ax.plot(
      [p["length_ratio"] for p in points],
      [p["peak_fraction"] for p in points],
      marker="o",
      label=name.replace("checkmate_", "").replace("_train", ""),
    )
    for p in points:
      ax.annotate(str(p["k"]), (p["length_ratio"], p["peak_fraction"]), fontsize=6)
  for ax, title in zip(axes, ("Checkmate training graphs", "random layered graphs"), strict=True):
    ax.set_xlabel("schedule length / noremat length (computes)")
    ax.set_ylabel("peak / noremat peak")
    ax.set_title(f"TWRemat(k), {title} (labels: k)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(RESULTS / "heuristics.twremat.png", dpi=120)


def part_long(names, solver, time_limit):
  """``solver`` at 0.8 with a long limit: the bound `auto` is compared with."""
  rows = []
  for name in names:
    graph = RematGraph.load(GRAPHS / f"{name}.json")
    row = {"graph": name, "solver": solver, "budget": 0.8, "time_limit_s": time_limit}
    row.update(_run(graph, 0.8, solver, time_limit))
    rows.append(row)
    print(
      f"{name:28} {solver} {time_limit:g}s: {_fmt(row)} wall {row['time_s']:.0f} s, "
      f"cpu {row['cpu_s']:.0f} s, load {row['load_1min']:.1f}, found by {row['found_by']}",
      flush=True,
    )
  path = RESULTS / f"heuristics.long_{solver}{time_limit:g}s.csv"
  old = [r for r in _read_csv(path) if r["graph"] not in names] if path.exists() else []
  _write_csv(path, old + rows)
  return rows


def _read_csv(path):
  with open(path) as f:
    return [
      {**r, "tdi_percent": float(r["tdi_percent"])} if r.get("tdi_percent") else r
      for r in csv.DictReader(f)
    ]


def _long_bounds():
  """graph -> {"<solver>-<T>s": TDI} from every ``heuristics.long_*.csv`` (`part_long`)."""
  bounds = {}
  for path in sorted(RESULTS.glob("heuristics.long_*.csv")):
    for r in _read_csv(path):
      if isinstance(r.get("tdi_percent"), float):
        key = f"{r['solver']}-{float(r['time_limit_s']):g}s"
        bounds.setdefault(r["graph"], {})[key] = r["tdi_percent"]
  return bounds


def part_auto(names, auto_time_limit, long_time_limit, heuristic_rows):
  rows = []
  long_bounds = _long_bounds()
  print(
    f"\n{'graph':28} {'auto TDI':>9} {'s':>6} {'best TDI':>9} {'from':>16} {'gap':>6}  found by"
  )
  for name in names:
    graph = RematGraph.load(GRAPHS / f"{name}.json")
    row = {"graph": name, "budget": 0.8}
    auto = _run(graph, 0.8, "auto", auto_time_limit)
    row.update({f"auto_{k}": v for k, v in auto.items()})
    best = {}
    for h in heuristic_rows:
      if (
        h["graph"] == name and float(h["budget"]) == 0.8 and isinstance(h.get("tdi_percent"), float)
      ):
        best[h["solver"]] = h["tdi_percent"]
    if "tdi_percent" in auto:
      best["auto"] = auto["tdi_percent"]
    if name in REFERENCE_TDI_08:
      best["moccasin-reference"] = REFERENCE_TDI_08[name]
    best.update(long_bounds.get(name, {}))
    if long_time_limit and auto.get("status") != "optimal":
      long = _run(graph, 0.8, "auto", long_time_limit)
      row.update({f"long_{k}": v for k, v in long.items()})
      if "tdi_percent" in long:
        best[f"auto-{long_time_limit:g}s"] = long["tdi_percent"]
    if best:
      source = min(best, key=best.get)
      row.update(best_tdi_percent=best[source], best_source=source)
    rows.append(row)
    gap = (
      auto["tdi_percent"] - row["best_tdi_percent"]
      if "tdi_percent" in auto and "best_tdi_percent" in row
      else math.nan
    )
    auto_tdi = f"{auto['tdi_percent']:.3f}" if "tdi_percent" in auto else auto["status"]
    print(
      f"{name:28} {auto_tdi:>9} {auto['time_s']:6.1f} "
      f"{row.get('best_tdi_percent', math.nan):9.3f} {row.get('best_source', '-'):>16} "
      f"{gap:6.3f}  {auto.get('found_by') or '-'}",
      flush=True,
    )
  suffix = f"_long{long_time_limit:g}s" if long_time_limit else ""
  _write_csv(RESULTS / f"heuristics.auto{suffix}.csv", rows)
  return rows


def part_compare(names):
  """`auto` at 0.8 (``heuristics.auto.csv``) against the best TDI any run reached.

  The bounds: every heuristic at 0.8 (``heuristics.csv``), the long runs
  (``heuristics.long_*.csv``), `auto` itself and the MOCCASIN reference runs.
  """
  auto_rows = {r["graph"]: r for r in _read_csv(RESULTS / "heuristics.auto.csv")}
  heuristic_rows = _read_csv(RESULTS / "heuristics.csv")
  long_bounds = _long_bounds()
  rows = []
  print(
    "\n| graph | auto TDI % (60 s) | wall s | CPU s | load | found by | best TDI % | from | gap |"
    "\n|---|---|---|---|---|---|---|---|---|"
  )
  for name in names:
    auto = auto_rows.get(name)
    if auto is None:
      continue
    best = {
      h["solver"]: h["tdi_percent"]
      for h in heuristic_rows
      if h["graph"] == name and float(h["budget"]) == 0.8 and isinstance(h["tdi_percent"], float)
    }
    best.update(long_bounds.get(name, {}))
    if name in REFERENCE_TDI_08:
      best["moccasin-reference"] = REFERENCE_TDI_08[name]
    auto_tdi = float(auto["auto_tdi_percent"]) if auto.get("auto_tdi_percent") else None
    if auto_tdi is not None:
      best["auto-60s"] = auto_tdi
    row = {"graph": name, "auto_status": auto["auto_status"], "auto_tdi_percent": auto_tdi}
    for key in ("time_s", "cpu_s", "load_1min", "best_solver", "found_by"):
      row[f"auto_{key}"] = auto.get(f"auto_{key}")
    if best:
      source = min(best, key=lambda k: (best[k], k == "auto-60s"))  # ties: another run
      row.update(best_tdi_percent=best[source], best_source=source)
      row["gap_points"] = auto_tdi - best[source] if auto_tdi is not None else math.nan
    rows.append(row)
    short = name.replace("checkmate_", "").replace("_train", "").replace("moccasin_", "")
    tdi = f"{auto_tdi:.3f}" if auto_tdi is not None else row["auto_status"]
    # Rows written before `found_by` existed name the winning member only.
    found_by = auto.get("auto_found_by") or auto.get("auto_best_solver") or "-"
    bound = f"{row['best_tdi_percent']:.3f}" if "best_tdi_percent" in row else "-"
    print(
      f"| {short} | {tdi} | {float(auto['auto_time_s']):.1f} | {float(auto['auto_cpu_s']):.1f} "
      f"| {float(auto['auto_load_1min']):.1f} | {found_by} | {bound} "
      f"| {row.get('best_source', '-')} | {row.get('gap_points', math.nan):.3f} |"
    )
  _write_csv(RESULTS / "heuristics.compare.csv", rows)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="heuristics,twremat,auto,compare")
  parser.add_argument("--graphs", nargs="*", default=sorted(p.stem for p in GRAPHS.glob("*.json")))
  parser.add_argument("--time-limit", type=float, default=30.0, help="per heuristic call")
  parser.add_argument("--solvers", nargs="*", default=HEURISTICS, help="for --parts heuristics")
  parser.add_argument("--auto-time-limit", type=float, default=60.0)
  parser.add_argument("--long-time-limit", type=float, default=0.0, help="0: no longer run")
  parser.add_argument("--long-solver", default="auto", help="the solver of --parts long")
  args = parser.parse_args()
  RESULTS.mkdir(parents=True, exist_ok=True)
  parts = args.parts.split(",")
  out = {"graphs": args.graphs, "machine": "2 CPU cores shared with other jobs"}
  heuristic_rows = []
  if "heuristics" in parts:
    heuristic_rows = out["heuristics"] = part_heuristics(args.graphs, args.time_limit, args.solvers)
  elif (RESULTS / "heuristics.csv").exists():
    with open(RESULTS / "heuristics.csv") as f:
      heuristic_rows = [
        {**r, "budget": float(r["budget"]), "tdi_percent": float(r["tdi_percent"])}
        for r in csv.DictReader(f)
        if r.get("tdi_percent")
      ]
  if "twremat" in parts:
    out["twremat"] = part_twremat(args.graphs)
  if "long" in parts:
    out["long"] = part_long(args.graphs, args.long_solver, args.long_time_limit or 600.0)
  if "auto" in parts:
    out["auto"] = part_auto(args.graphs, args.auto_time_limit, args.long_time_limit, heuristic_rows)
  if "compare" in parts:
    out["compare"] = part_compare(args.graphs)
  long = f"_long{args.long_time_limit:g}s" if "auto" in parts and args.long_time_limit else ""
  path = RESULTS / f"heuristics.{'_'.join(parts)}{long}.json"
  path.write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
  main()
