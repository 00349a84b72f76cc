"""The `jaxremat` command.

Exit codes: 0 success (a valid schedule), 1 an invalid schedule or file, an infeasible
budget or a failed solve, 2 a usage error. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from jaxremat._src.errors import BudgetError, JaxrematError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solve import solve
from jaxremat._src.solvers.base import available_solvers

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
  """Wrong command-line arguments (exit code 2)."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise _UsageError(f"{self.prog}: {message}")


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
  from jaxremat._src.demo import run_demo  # JAX loads only for the commands that need it

  run_demo(budget=args.budget, solver=args.solver, time_limit=args.time_limit)
  return EXIT_OK


def _cmd_analyze(args) -> int:
  from jaxremat._src import analyze

  graph = analyze.load_graph(args.file)
  rows, schedules = analyze.tradeoff(
    graph,
    args.budget or analyze.DEFAULT_BUDGETS,
    args.solver or analyze.DEFAULT_SOLVERS,
    args.time_limit,
  )
  print(analyze.format_table(graph, rows))
  if args.json:
    analyze.save_json(args.json, graph, rows)
  if args.plot:
    analyze.plot(args.plot, graph, rows, analyze.chosen_schedule(rows, schedules))
    print(f"\nwrote {args.plot}")
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

  p = sub.add_parser(
    "analyze", help="budget versus overhead across solvers, for a graph or jaxpr text"
  )
  p.add_argument(
    "file", help="a jaxremat.graph/1 file, or a jaxpr as print(jax.make_jaxpr(f)(*args)) shows it"
  )
  p.add_argument("--budget", action="append", help="a budget (repeatable; default 100%%..50%%)")
  p.add_argument(
    "--solver",
    action="append",
    help="a solver (repeatable); one of: " + ", ".join(available_solvers()),
  )
  p.add_argument("--time-limit", type=float, default=10.0, help="seconds per solve (default 10)")
  p.add_argument("--plot", help="write a PNG: memory timeline and overhead against budget")
  p.add_argument("--json", help="write the table as JSON")
  p.set_defaults(run=_cmd_analyze)

  p = sub.add_parser("demo", help="optimize a bundled training step and print the report")
  p.add_argument("--budget", type=float, default=0.5, help="fraction of the no-remat peak (0.5)")
  p.add_argument("--solver", default="auto", help="one of: " + ", ".join(available_solvers()))
  p.add_argument("--time-limit", type=float, default=15.0, help="seconds for the solver (15)")
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
