"""`jaxremat analyze`: what recomputation buys on a saved graph or a printed jaxpr.

It solves one graph at several budgets with several solvers and shows the trade-off:
the extra compute (TDI) each solver pays for each budget, the memory timeline of a
chosen schedule, and the curve of overhead against budget.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

from jaxremat._src.budget import BudgetLike, parse_budget
from jaxremat._src.errors import InfeasibleBudgetError, JaxrematError
from jaxremat._src.graph import RematGraph, parse_json, read_text
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solve import solve

DEFAULT_BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
DEFAULT_SOLVERS = ("xla-greedy", "chen-sqrtn", "twremat", "auto")


@dataclasses.dataclass(frozen=True)
class Row:
  """One (budget, solver) cell of the trade-off table."""

  fraction: float
  budget_bytes: int
  solver: str
  status: str  # optimal, feasible, infeasible, none (nothing found), error
  peak_bytes: int | None
  tdi_percent: float | None
  solve_time_s: float | None
  note: str = ""


def load_graph(path: str | os.PathLike, target: str | None = None) -> RematGraph:
  """Reads a `jaxremat.graph/1` file or a jaxpr printed by ``print(jax.make_jaxpr(f)(*a))``.

  Args:
    path: the file.
    target: for jaxpr text, the device whose compiler groups and costs the equations
      (`jaxremat.get_target`; None: shape costs, this machine's fusion facts). A graph
      file already has its sizes and costs, so it takes no target.

  Raises:
    FormatError: naming the file and what is wrong with it.
    ValueError: a target given with a graph file.
  """
  source = os.fspath(path)
  text = read_text(path, expected="a graph JSON or jaxpr text")
  head = text.lstrip()
  if head.startswith("let ") or head.replace(" ", "").startswith("{lambda"):
    from jaxremat._src.trace import graph_from_jaxpr_text  # JAX loads only for jaxpr text

    name = os.path.splitext(os.path.basename(source))[0]
    return graph_from_jaxpr_text(text, source=source, name=name, target=target)
  graph = RematGraph.from_dict(parse_json(text, source), source=source)
  if target is not None:
    traced_for = graph.meta.get("target") or graph.meta.get("backend") or "an unrecorded device"
    raise ValueError(
      f"--target {target} applies to jaxpr text; {source} is a graph file whose sizes and "
      f"costs are already fixed (for {traced_for}). Save the graph again with "
      f"jaxremat.save_graph(fn, *args, path=..., target={target!r}), or pass the jaxpr text."
    )
  return graph


def model_description(graph: RematGraph) -> str:
  """Which memory and cost model made ``graph``, in one line for people."""
  meta = graph.meta
  if meta.get("source") != "jaxremat.trace":
    return f"model: as given in the graph file (source {meta.get('source', 'unrecorded')!r})"
  device = meta.get("target") or meta.get("backend", "?")
  roofline = meta.get("roofline") or {}
  costs = {
    "shape": "shape estimates",
    "xla": f"{device}'s compiler cost analysis, seconds from "
    f"{roofline.get('source', 'measured')} peak rates",
    "measured": "equations timed on the device",
  }.get(meta.get("costs"), str(meta.get("costs")))
  on_chip = meta.get("on_chip_bytes", 0)
  kept = f"; up to {on_chip / 2**20:.0f} MiB of temporaries on chip" if on_chip else ""
  return f"model: sizes from the jaxpr grouped by {device}'s fusion facts{kept}; costs: {costs}"


def tradeoff(
  graph: RematGraph,
  budgets: Sequence[BudgetLike] = DEFAULT_BUDGETS,
  solvers: Sequence[str] = DEFAULT_SOLVERS,
  time_limit_s: float = 10.0,
) -> tuple[list[Row], dict[tuple[float, str], Schedule]]:
  """Solves ``graph`` at each budget (any form `parse_budget` reads) with each solver.

  Returns:
    The rows of the table, and the schedules found, keyed by (fraction, solver).
  """
  base = simulate(graph, baseline_schedule(graph))
  rows, schedules = [], {}
  for budget in budgets:
    budget_bytes = parse_budget(budget, base.peak_bytes)
    fraction = budget_bytes / base.peak_bytes
    for solver in solvers:
      try:
        s = solve(graph, budget_bytes, solver=solver, time_limit=time_limit_s, workers=None)
      except JaxrematError as e:
        status = "infeasible" if isinstance(e, InfeasibleBudgetError) else "none"
        rows.append(Row(fraction, budget_bytes, solver, status, None, None, None, str(e)))
        continue
      schedules[(fraction, solver)] = s
      st = s.stats
      rows.append(
        Row(
          fraction,
          budget_bytes,
          solver,
          st["status"],
          st["peak_bytes"],
          st["tdi_percent"],
          st["solve_time_s"],
        )
      )
  return rows, schedules


def format_table(graph: RematGraph, rows: Sequence[Row]) -> str:
  """The table `jaxremat analyze` prints."""
  base = simulate(graph, baseline_schedule(graph))
  lines = [
    f"graph {graph.name}: {graph.n} nodes, {len(graph.edges)} edges, "
    f"baseline peak {base.peak_bytes} bytes, duration {base.duration:.6g}; "
    f"no schedule peaks below {graph.min_feasible_bytes} bytes",
    model_description(graph),
    "",
    f"{'budget':>7} {'bytes':>14} {'solver':>12} {'status':>10} {'peak':>14} {'TDI %':>8} {'time s':>7}",
  ]
  for r in rows:
    peak = "" if r.peak_bytes is None else str(r.peak_bytes)
    tdi = "" if r.tdi_percent is None else f"{r.tdi_percent:.2f}"
    t = "" if r.solve_time_s is None else f"{r.solve_time_s:.2f}"
    lines.append(
      f"{r.fraction:>7.0%} {r.budget_bytes:>14} {r.solver:>12} {r.status:>10} "
      f"{peak:>14} {tdi:>8} {t:>7}"
    )
  return "\n".join(lines)


def save_json(path: str | os.PathLike, graph: RematGraph, rows: Sequence[Row]) -> None:
  data = {"graph": graph.name, "n_nodes": graph.n, "rows": [dataclasses.asdict(r) for r in rows]}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)


def plot(
  path: str | os.PathLike, graph: RematGraph, rows: Sequence[Row], schedule: Schedule | None
) -> None:
  """A PNG: the memory timeline of ``schedule`` beside the baseline's, and TDI vs budget."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  base = simulate(graph, baseline_schedule(graph))
  left.plot(base.timeline_bytes, label="no remat", lw=1)
  if schedule is not None:
    chosen = simulate(graph, schedule)
    left.plot(chosen.timeline_bytes, label=f"{schedule.solver} at {schedule.budget} B", lw=1)
    left.axhline(schedule.budget, color="red", ls="--", lw=0.8, label="budget")
  left.set(xlabel="event", ylabel="bytes in use", title=f"memory timeline: {graph.name}")
  left.legend()
  for solver in dict.fromkeys(r.solver for r in rows):
    pts = [
      (r.fraction, r.tdi_percent) for r in rows if r.solver == solver and r.tdi_percent is not None
    ]
    if pts:
      xs, ys = zip(*pts)
      right.plot(xs, ys, marker="o", label=solver)
  right.set(
    xlabel="budget (fraction of the no-remat peak)",
    ylabel="TDI %",
    title="extra compute against budget",
  )
  right.invert_xaxis()
  right.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def chosen_schedule(rows: Sequence[Row], schedules: dict) -> Schedule | None:
  """The lowest-TDI schedule at the smallest budget any solver met (None if none did)."""
  feasible = [r for r in rows if (r.fraction, r.solver) in schedules]
  if not feasible:
    return None
  best = min(feasible, key=lambda r: (r.fraction, r.tdi_percent))
  return schedules[(best.fraction, best.solver)]
