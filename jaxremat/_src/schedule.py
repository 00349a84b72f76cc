"""`Schedule`: a whole program of compute and free events (`jaxremat.schedule/1`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxremat._src.errors import FormatError
from jaxremat._src.graph import RematGraph, read_json, write_json_atomic

SCHEDULE_FORMAT = "jaxremat.schedule/1"
EVENT_KINDS = ("compute", "free")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A sequence of ``("compute", v)`` and ``("free", v)`` events for one graph.

  Attributes:
    events: the program; a second compute of a node is a recomputation.
    graph: name of the graph the schedule was made for.
    budget: the budget in bytes it was planned under, if any.
    solver: which solver made it.
    stats: solver statistics (status, duration, peak_bytes, tdi_percent, solve_time_s, ...).
  """

  events: tuple[tuple[str, int], ...]
  graph: str = ""
  budget: int | None = None
  solver: str = ""
  stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __repr__(self) -> str:
    n_compute = sum(1 for kind, _ in self.events if kind == "compute")
    return (
      f"Schedule(graph={self.graph!r}, solver={self.solver!r}, budget={self.budget}, "
      f"events={len(self.events)}, computes={n_compute})"
    )

  @property
  def computes(self) -> list[int]:
    """The nodes computed, in event order (recomputations included)."""
    return [v for kind, v in self.events if kind == "compute"]

  def replace(self, **changes) -> Schedule:
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return {
      "format": SCHEDULE_FORMAT,
      "graph": self.graph,
      "budget": self.budget,
      "solver": self.solver,
      "events": [[kind, v] for kind, v in self.events],
      "stats": dict(self.stats),
    }

  def save(self, path: str | os.PathLike) -> None:
    """Writes the schedule as `jaxremat.schedule/1` JSON (atomically)."""
    write_json_atomic(path, self.to_dict())

  @classmethod
  def from_dict(cls, data: Any, source: str = "<schedule>") -> Schedule:
    """Parses the JSON object of FORMATS.md; the events are checked for form only.

    Whether the events are a valid program for a graph is `jaxremat.simulate`'s job.

    Raises:
      FormatError: naming ``source``, the item and the problem.
    """
    if not isinstance(data, Mapping):
      raise FormatError(source, "", f"expected a JSON object, got {type(data).__name__}.")
    if data.get("format") != SCHEDULE_FORMAT:
      raise FormatError(
        source, "format", f"expected {SCHEDULE_FORMAT!r}, got {data.get('format')!r}."
      )
    raw = data.get("events")
    if not isinstance(raw, list):
      raise FormatError(source, "events", f"expected a list, got {type(raw).__name__}.")
    events = []
    for k, e in enumerate(raw):
      if not (isinstance(e, list) and len(e) == 2):
        raise FormatError(source, f"events[{k}]", f"expected [kind, node], got {e!r}.")
      kind, v = e
      if kind not in EVENT_KINDS:
        raise FormatError(
          source, f"events[{k}]", f"unknown event kind {kind!r}; expected 'compute' or 'free'."
        )
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(source, f"events[{k}]", f"expected a node id, got {v!r}.")
      events.append((kind, v))
    budget = data.get("budget")
    if budget is not None and (
      not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
    ):
      raise FormatError(source, "budget", f"expected a byte count or null, got {budget!r}.")
    graph, solver = data.get("graph", ""), data.get("solver", "")
    for key, value in (("graph", graph), ("solver", solver)):
      if not isinstance(value, str):
        raise FormatError(source, key, f"expected a string, got {value!r}.")
    stats = data.get("stats", {})
    if not isinstance(stats, Mapping):
      raise FormatError(source, "stats", f"expected a JSON object, got {type(stats).__name__}.")
    return cls(tuple(events), graph, budget, solver, dict(stats))

  @classmethod
  def load(cls, path: str | os.PathLike) -> Schedule:
    """Reads a `jaxremat.schedule/1` file; errors name the file."""
    return cls.from_dict(read_json(path), source=os.fspath(path))


def schedule_from_computes(
  graph: RematGraph,
  computes: Sequence[int],
  *,
  solver: str = "",
  budget: int | None = None,
  stats: Mapping[str, Any] | None = None,
) -> Schedule:
  """Turns a compute sequence into a schedule that frees every value at its last use.

  Each computed copy lives until the last compute that reads it before the node is
  computed again; the last copy of an output lives to the end; a copy nobody reads is
  freed right after it is computed. This is the least memory any schedule with this
  compute sequence can use, so solvers that decide only *what* to compute use it.
  """
  last_use: dict[int, int] = {}  # position of a copy's compute -> position of its last read
  current: dict[int, int] = {}  # node -> position of its live copy
  for pos, v in enumerate(computes):
    for u in graph.compute_preds[v]:
      if u in current:
        last_use[current[u]] = pos
    current[v] = pos
    last_use.setdefault(pos, pos)
  final = {current[v] for v in graph.outputs if v in current}
  frees_after: dict[int, list[int]] = {}
  for pos, end in last_use.items():
    if pos not in final:
      frees_after.setdefault(end, []).append(computes[pos])
  events: list[tuple[str, int]] = []
  for pos, v in enumerate(computes):
    events.append(("compute", v))
    events.extend(("free", u) for u in sorted(frees_after.get(pos, ())))
  return Schedule(tuple(events), graph.name, budget, solver, dict(stats or {}))


def keep_first_copies(graph: RematGraph, schedule: Schedule, nodes: Sequence[int]) -> Schedule:
  """``schedule`` without recomputations of ``nodes``: their first copy lives to its last use.

  Used for nodes with side effects, which must run exactly as often as in the program.
  Returns ``schedule`` itself when it recomputes none of them.
  """
  once = set(nodes)
  computes = schedule.computes
  if all(computes.count(v) <= 1 for v in once):
    return schedule
  seen: set[int] = set()
  kept = []
  for v in computes:
    if v not in once or v not in seen:
      kept.append(v)
    seen.add(v)
  return schedule_from_computes(
    graph, kept, solver=schedule.solver, budget=schedule.budget, stats=schedule.stats
  )
