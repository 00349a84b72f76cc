"""The one memory and duration model (FORMATS.md, "Semantics").

Every solver's result, every test and the CLI go through `simulate`; nothing else
computes a peak.
"""

from __future__ import annotations

import dataclasses

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes


@dataclasses.dataclass(frozen=True)
class SimulationResult:
  """What `simulate` found.

  Attributes:
    valid: whether the schedule is a valid program for the graph.
    error: the first violated rule, in a sentence; ``None`` when valid.
    error_event: index into ``schedule.events`` of the first bad event (``len(events)``
      for an end-of-schedule rule); ``None`` when valid.
    error_node: the node of that rule, if any.
    peak_bytes: peak memory over the events simulated (up to the error, if any).
    duration: sum of the cost of every compute event simulated.
    n_compute: number of compute events simulated.
    n_recompute: compute events of nodes that had been computed before.
    timeline_bytes: memory in use after each event simulated (during a compute the
      figure is the same: the new value and everything live).
  """

  valid: bool
  error: str | None
  error_event: int | None
  error_node: int | None
  peak_bytes: int
  duration: float
  n_compute: int
  n_recompute: int
  timeline_bytes: tuple[int, ...]

  def summary(self) -> dict:
    """The JSON object the CLI prints."""
    return {
      "valid": self.valid,
      "peak_bytes": self.peak_bytes,
      "duration": self.duration,
      "n_compute": self.n_compute,
      "n_recompute": self.n_recompute,
      "error": self.error,
      "error_event": self.error_event,
      "error_node": self.error_node,
    }


def simulate(graph: RematGraph, schedule: Schedule) -> SimulationResult:
  """Runs ``schedule`` on ``graph`` under the FORMATS.md semantics.

  Args:
    graph: the graph.
    schedule: the events to check.

  Returns:
    A `SimulationResult`; invalid schedules are reported, never raised.

  Example:
    >>> import jaxremat
    >>> g = jaxremat.RematGraph.build(mem=[4, 2, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
    >>> r = jaxremat.simulate(g, jaxremat.baseline_schedule(g))
    >>> r.valid, r.peak_bytes, r.duration
    (True, 6, 3.0)
  """
  mem, cost = graph.mem, graph.cost
  is_input, preds = graph.is_input, graph.compute_preds
  n = graph.n
  resident = graph.resident_bytes
  live = [False] * n
  computed = [False] * n
  live_bytes = 0
  peak = resident
  duration = 0.0
  n_compute = n_recompute = 0
  timeline: list[int] = []

  def result(error=None, event=None, node=None):
    return SimulationResult(
      error is None, error, event, node, peak, duration, n_compute, n_recompute, tuple(timeline)
    )

  for k, (kind, v) in enumerate(schedule.events):
    if not 0 <= v < n:
      return result(f"event {k} ({kind} {v}): node {v} does not exist ({n} nodes).", k, v)
    label = graph.node_label(v)
    if kind == "compute":
      if is_input[v]:
        return result(f"event {k} computes input node {label}; inputs are resident.", k, v)
      if live[v]:
        return result(f"event {k} computes node {label}, which is already live.", k, v)
      for u in preds[v]:
        if not live[u]:
          return result(
            f"event {k} computes node {label} but its predecessor {graph.node_label(u)} "
            "is not live.",
            k,
            v,
          )
      live[v] = True
      live_bytes += mem[v]
      peak = max(peak, resident + live_bytes)
      duration += cost[v]
      n_compute += 1
      n_recompute += computed[v]
      computed[v] = True
    elif kind == "free":
      if not live[v]:
        why = "inputs are never freed" if is_input[v] else "it is not live"
        return result(f"event {k} frees node {label}, but {why}.", k, v)
      live[v] = False
      live_bytes -= mem[v]
    else:
      return result(f"event {k} has unknown kind {kind!r}.", k, v)
    timeline.append(resident + live_bytes)

  end = len(schedule.events)
  for v in graph.order:
    if not computed[v]:
      return result(f"node {graph.node_label(v)} is never computed.", end, v)
  for v in graph.outputs:
    if not (live[v] or is_input[v]):
      return result(f"output node {graph.node_label(v)} is not live at the end.", end, v)
  return result()


def baseline_schedule(graph: RematGraph) -> Schedule:
  """The reference "no remat" schedule: ``order`` once, each value freed after its last reader.

  A value no node reads (and that is no output) is freed right after it is computed.
  Its peak and duration define budgets given as fractions and the TDI.
  """
  return schedule_from_computes(graph, graph.order, solver="noremat")
