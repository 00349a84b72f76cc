"""The `jaxremat` command.

Exit codes: 0 success (a valid schedule), 1 an invalid schedule or file, an infeasible
budget, a failed solve or a file that cannot be written, 2 a usage error, 3 an internal
error (a jaxremat bug), 130 interrupted. Errors are one line on stderr, never a traceback
(set JAXREMAT_TRACEBACK=1 to see the traceback of an internal error).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Sequence

from jaxremat._src.errors import BudgetError, JaxrematError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solve import solve
from jaxremat._src.solvers.base import available_solvers

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
MSG_NO_MATPLOTLIB = (
  "--plot {path} needs matplotlib, which is not installed: pip install matplotlib (or the "
  "jaxremat[plots] extra), or leave out --plot."
)
# Options whose values may start with '-' (argparse would take '-5%' for an option).
_VALUE_OPTIONS = ("--budget", "--time-limit", "--workers")


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

  run_demo(budget=args.budget, solver=args.solver, time_limit=args.time_limit, target=args.target)
  return EXIT_OK


def _cmd_targets(args) -> int:
  from jaxremat._src.targets import facts_report

  table, all_match = facts_report(args.target or None)
  print(table)
  if not all_match:
    print(
      "jaxremat targets: a measured fact differs from jaxremat._src.backends; correct the "
      "facts there, citing this measurement.",
      file=sys.stderr,
    )
  return EXIT_OK if all_match else EXIT_INVALID


def _cmd_analyze(args) -> int:
  from jaxremat._src import analyze

  if args.plot and importlib.util.find_spec("matplotlib") is None:
    raise ValueError(MSG_NO_MATPLOTLIB.format(path=args.plot))
  graph = analyze.load_graph(args.file, target=args.target)
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


def _positive_seconds(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive, finite number of seconds")
  return value


def _positive_count(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
  return value


def _join_values(argv: Sequence[str]) -> list[str]:
  """``--budget -5%`` -> ``--budget=-5%``, so that the value reaches the budget parser."""
  out: list[str] = []
  it = iter(argv)
  for arg in it:
    if arg in _VALUE_OPTIONS:
      value = next(it, None)
      out.append(arg if value is None else f"{arg}={value}")
    else:
      out.append(arg)
  return out


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
  p.add_argument("--time-limit", type=_positive_seconds, default=60.0, help="seconds (default 60)")
  p.add_argument("--workers", type=_positive_count, default=None, help="CPU threads (default: all)")
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
  p.add_argument(
    "--time-limit", type=_positive_seconds, default=10.0, help="seconds per solve (default 10)"
  )
  p.add_argument("--plot", help="write a PNG: memory timeline and overhead against budget")
  p.add_argument("--json", help="write the table as JSON")
  p.add_argument(
    "--target",
    default=None,
    help="for jaxpr text: group and cost the equations with this device's compiler "
    "(cpu, tpu-v5e, tpu-v4, tpu-v6e, h100, a100; extras tpu-aot / gpu-aot); default: "
    "shape costs",
  )
  p.set_defaults(run=_cmd_analyze)

  p = sub.add_parser("demo", help="optimize a bundled training step and print the report")
  p.add_argument("--budget", type=float, default=0.5, help="fraction of the no-remat peak (0.5)")
  p.add_argument("--solver", default="auto", help="one of: " + ", ".join(available_solvers()))
  p.add_argument(
    "--time-limit",
    type=_positive_seconds,
    default=None,
    help="seconds for planning (15; 60 for a target without devices here)",
  )
  p.add_argument(
    "--target",
    default=None,
    help="compile and plan for this device without it: tpu-v5e, tpu-v4, tpu-v6e, h100, a100 "
    "(extras tpu-aot / gpu-aot); default: this machine's backend",
  )
  p.set_defaults(run=_cmd_demo)

  p = sub.add_parser(
    "targets",
    help="the devices jaxremat compiles for here, with their compiler facts measured",
  )
  p.add_argument("target", nargs="*", help="targets to check (default: all named ones)")
  p.set_defaults(run=_cmd_targets)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = _parser().parse_args(_join_values(argv))
  except _UsageError as e:
    print(e, file=sys.stderr)
    return EXIT_USAGE
  except SystemExit as e:  # --help
    return int(e.code or 0)
  try:
    return args.run(args)
  except BudgetError as e:
    return _fail(args, e, EXIT_USAGE)
  except JaxrematError as e:
    return _fail(args, e, EXIT_INVALID)
  except ValueError as e:  # bad option values, e.g. an unknown solver
    return _fail(args, e, EXIT_USAGE)
  except OSError as e:  # e.g. an output file in a folder that does not exist
    return _fail(args, f"{e.strerror or e}.", EXIT_INVALID)
  except KeyboardInterrupt:
    return _fail(args, "interrupted (files are written whole or not at all).", EXIT_INTERRUPTED)
  except Exception as e:
    if os.environ.get("JAXREMAT_TRACEBACK"):
      raise
    return _fail(
      args,
      f"internal error ({type(e).__name__}: {e}); this is a jaxremat bug: please report it "
      "with the input (JAXREMAT_TRACEBACK=1 shows the traceback).",
      EXIT_INTERNAL,
    )


def _fail(args, message: object, code: int) -> int:
  """Prints ``message`` as one line on stderr and returns ``code``."""
  print(f"jaxremat {args.command}: {' '.join(str(message).split())}", file=sys.stderr)
  return code


if __name__ == "__main__":
  sys.exit(main())
