"""`griewank`: binomial checkpointing (revolve), applied to DAGs through a linearized order.

The forward nodes, in order, are the steps of a chain (``griewank``: one node per step;
``griewank-ap``: steps end at articulation points). Each backward node is attached to
the earliest step whose values it reads. Reversal with c snapshots: advance to a split
point, keep a snapshot there, reverse the tail with c - 1 snapshots, drop it, reverse
the head with c. The split minimizes the number of forward steps (the optimum of
Griewank's binomial schedule for chains); missing DAG values are recomputed from
whatever is live. The number of snapshots is searched to meet the budget.

References:
  Griewank, Walther, "Algorithm 799: Revolve: An Implementation of Checkpointing for the
  Reverse or Adjoint Mode of Computational Differentiation", ACM TOMS 26(1), 2000.
  Jain et al., "Checkmate", MLSys 2020, appendix B (Griewank's log n on linearized DAGs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.segments import forward_nodes
from jaxremat._src.solvers.chen import checkpoint_candidates
from jaxremat._src.solvers.reorder import resolve_order
from jaxremat._src.solvers.replay import Replay, SequenceTooLongError, evaluate, pick_best


@functools.cache
def _reversal(steps: int, snapshots: int) -> tuple[int, int]:
  """(forward steps to reverse a chain of ``steps`` with ``snapshots``, best first split)."""
  if steps <= 1:
    return steps, 0
  if snapshots == 0:
    return steps * (steps + 1) // 2, 0
  best = None
  for split in range(1, steps):
    total = split + _reversal(steps - split, snapshots - 1)[0] + _reversal(split, snapshots)[0]
    if best is None or total < best[0]:
      best = (total, split)
  return best


class _Revolve:
  def __init__(
    self,
    graph: RematGraph,
    order: Sequence[int],
    groups: list[list[int]],
    stage_targets: list[list[int]],
  ):
    self.graph, self.groups, self.stage_targets = graph, groups, stage_targets
    self.replay = Replay(graph, order)

  def advance(self, lo: int, hi: int) -> list[int]:
    computed = []
    for step in range(lo, hi):
      for v in self.groups[step]:
        start = len(self.replay.computes)
        self.replay.ensure(v)
        computed += self.replay.computes[start:]
    return computed

  def reverse(self, lo: int, hi: int, snapshots: int) -> None:
    """Runs the backward nodes of steps hi-1 down to lo; the state before lo is live."""
    if hi - lo <= 0:
      return
    if hi - lo == 1 or snapshots == 0:
      for step in range(hi - 1, lo - 1, -1):
        computed = self.advance(lo, step + 1)
        for v in self.stage_targets[step]:
          self.replay.ensure(v)
        for v in computed:
          self.replay.drop(v)
      return
    split = lo + _reversal(hi - lo, snapshots)[1]
    computed = self.advance(lo, split)
    snapshot = self.groups[split - 1][-1]
    for v in computed:
      if v != snapshot:
        self.replay.drop(v)
    self.reverse(split, hi, snapshots - 1)
    self.replay.drop(snapshot)
    self.reverse(lo, split, snapshots)


def revolve_computes(
  graph: RematGraph,
  snapshots: int,
  *,
  order: Sequence[int] | None = None,
  variant: str = "linearized",
) -> list[int]:
  """The compute sequence of binomial checkpointing with ``snapshots`` snapshots.

  Without backward nodes there is nothing to reverse: the sequence is the forward sweep.

  Raises:
    SequenceTooLongError: the schedule passed 50 computes per node.
  """
  order = tuple(graph.order) if order is None else tuple(order)
  forward = forward_nodes(graph)
  backward = [v for v in order if v not in forward]
  if not backward:
    return list(order)
  ends = checkpoint_candidates(graph, order, variant)
  # Steps: forward nodes up to and including each candidate; the rest joins the last step.
  step_of, groups, current = {}, [], []
  is_end = set(ends)
  for v in order:
    if v in forward:
      current.append(v)
      if v in is_end:
        groups.append(current)
        current = []
  if current:
    groups.append(current)
  for s, group in enumerate(groups):
    for v in group:
      step_of[v] = s
  last = len(groups) - 1
  stage: dict[int, int] = {}
  for v in backward:
    reads = [step_of[p] for p in graph.compute_preds[v] if p in step_of]
    reads += [stage[p] for p in graph.compute_preds[v] if p in stage]
    stage[v] = min(reads, default=last)
  stage_targets: list[list[int]] = [[] for _ in groups]
  for v in backward:
    stage_targets[stage[v]].append(v)
  revolve = _Revolve(graph, order, groups, stage_targets)
  revolve.reverse(0, len(groups), snapshots)
  return revolve.replay.finish()


def _solve(graph: RematGraph, budget_bytes: int, solver: str, variant: str, order) -> Schedule:
  graph.require_feasible(budget_bytes)
  order = resolve_order(graph, order)
  steps = len(checkpoint_candidates(graph, order, variant))
  most = max(1, math.ceil(math.log2(max(steps, 2))) * 2)
  candidates = []
  for snapshots in range(0, most + 1):
    try:
      computes = revolve_computes(graph, snapshots, order=order, variant=variant)
    except SequenceTooLongError:
      continue
    candidates.append(evaluate(graph, computes, solver=solver))
  return pick_best(candidates, budget_bytes, solver, f"0..{most} snapshots over {steps} steps")


def solve_griewank(graph: RematGraph, budget_bytes: int, *, order=None, **_) -> Schedule:
  """Binomial checkpointing over the linearized forward order (snapshots searched).

  Raises:
    NoScheduleFoundError: no snapshot count meets the budget.
  """
  return _solve(graph, budget_bytes, "griewank", "linearized", order)


def solve_griewank_ap(graph: RematGraph, budget_bytes: int, *, order=None, **_) -> Schedule:
  """Binomial checkpointing over steps that end at articulation points."""
  return _solve(graph, budget_bytes, "griewank-ap", "ap", order)
