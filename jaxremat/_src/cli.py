"""The `jaxremat` command.

Exit codes: 0 success (a valid schedule), 1 an invalid schedule or file, an infeasible
budget or a failed solve, 2 a usage error. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources

from jaxremat._src.budget import parse_budget
from jaxremat._src.errors import BudgetError, JaxrematError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solve import solve
from jaxremat._src.solvers.base import available_solvers

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
DEMO_GRAPH = "checkmate_vgg16_train.json"


class _UsageError(Exception):
  """Wrong command-line arguments (exit code 2)."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise _UsageError(f"{self.prog}: {message}")


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  raise AssertionError("unreachable")


def _cmd_baseline(args) -> int:
  graph = RematGraph.load(args.graph)
  schedule = baseline_schedule(graph)
  result = simulate(graph, schedule)
  schedule = schedule.replace(stats={"peak_bytes": result.peak_bytes, "duration": result.duration})
  if args.output:
    schedule.save(args.output)
  print(json.dumps(result.summary()))
  return EXIT_OK


def _cmd_simulate(args) -> int:
  graph = RematGraph.load(args.graph)
  schedule = Schedule.load(args.schedule)
  result = simulate(graph, schedule)
  print(json.dumps(result.summary()))
  return EXIT_OK if result.valid else EXIT_INVALID


def _cmd_solve(args) -> int:
  graph = RematGraph.load(args.graph)
  schedule = solve(
    graph, args.budget, solver=args.solver, time_limit=args.time_limit, workers=args.workers
  )
  if args.output:
    schedule.save(args.output)
  keys = ("status", "peak_bytes", "duration", "tdi_percent", "n_recompute", "solve_time_s")
  print(
    json.dumps(
      {
        "solver": schedule.solver,
        "budget": schedule.budget,
        **{k: schedule.stats.get(k) for k in keys},
      }
    )
  )
  return EXIT_OK


def _cmd_demo(args) -> int:
  with resources.as_file(resources.files("jaxremat") / "data" / DEMO_GRAPH) as path:
    graph = RematGraph.load(path)
  base = simulate(graph, baseline_schedule(graph))
  print(f"Graph {graph.name}: {graph.n} nodes, {len(graph.edges)} edges (bundled example).")
  print(f"No-remat baseline: peak {_bytes(base.peak_bytes)}, duration {base.duration:g}.")
  print(
    f"No schedule can peak below {_bytes(graph.min_feasible_bytes)} "
    f"({graph.node_label(graph.bottleneck_node)} with its inputs)."
  )
  print(
    f"\n{'budget':>8} {'bytes':>12} {'solver':>12} {'status':>10} {'peak':>12} {'TDI %':>7} {'time s':>7}"
  )
  for fraction in args.budgets:
    budget_bytes = parse_budget(fraction, base.peak_bytes)
    row = f"{fraction:>8.0%} {_bytes(budget_bytes):>12} {args.solver:>12}"
    try:
      s = solve(graph, budget_bytes, solver=args.solver, time_limit=args.time_limit)
      print(
        f"{row} {s.stats['status']:>10} {_bytes(s.stats['peak_bytes']):>12} "
        f"{s.stats['tdi_percent']:>7.2f} {s.stats['solve_time_s']:>7.2f}"
      )
    except JaxrematError as e:
      print(f"{row} {'none':>10}  {e}")
  return EXIT_OK


def _parser() -> _Parser:
  parser = _Parser(prog="jaxremat", description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

  p = sub.add_parser(
    "baseline", help="write the no-remat schedule of a graph and print its figures"
  )
  p.add_argument("graph", help="a jaxremat.graph/1 file")
  p.add_argument("-o", "--output", help="where to write the jaxremat.schedule/1 file")
  p.set_defaults(run=_cmd_baseline)

  p = sub.add_parser(
    "simulate", help="check a schedule against a graph and print peak and duration"
  )
  p.add_argument("graph", help="a jaxremat.graph/1 file")
  p.add_argument("schedule", help="a jaxremat.schedule/1 file")
  p.set_defaults(run=_cmd_simulate)

  p = sub.add_parser("solve", help="plan a schedule of a graph within a memory budget")
  p.add_argument("graph", help="a jaxremat.graph/1 file")
  p.add_argument("--budget", required=True, help="bytes, a fraction (0.8), '80%%' or '12GiB'")
  p.add_argument("--solver", default="auto", help="one of: " + ", ".join(available_solvers()))
  p.add_argument("--time-limit", type=float, default=60.0, help="seconds (default 60)")
  p.add_argument("--workers", type=int, default=None, help="CPU threads (default: all)")
  p.add_argument("-o", "--output", help="where to write the jaxremat.schedule/1 file")
  p.set_defaults(run=_cmd_solve)

  p = sub.add_parser("demo", help="plan the bundled example graph at several budgets")
  p.add_argument("--solver", default="auto", help="one of: " + ", ".join(available_solvers()))
  p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.9, 0.8, 0.7])
  p.add_argument("--time-limit", type=float, default=20.0, help="seconds per budget")
  p.set_defaults(run=_cmd_demo)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  try:
    args = _parser().parse_args(argv)
  except _UsageError as e:
    print(e, file=sys.stderr)
    return EXIT_USAGE
  except SystemExit as e:  # --help
    return int(e.code or 0)
  try:
    return args.run(args)
  except BudgetError as e:
    print(f"jaxremat {args.command}: {e}", file=sys.stderr)
    return EXIT_USAGE
  except JaxrematError as e:
    print(f"jaxremat {args.command}: {e}", file=sys.stderr)
    return EXIT_INVALID
  except ValueError as e:  # bad option values, e.g. an unknown solver
    print(f"jaxremat {args.command}: {e}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
