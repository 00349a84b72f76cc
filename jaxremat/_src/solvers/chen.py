"""Chen et al.'s checkpointing, generalized to DAGs as in Checkmate's appendix B.

The forward nodes of the order form segments separated by checkpoints. During the
forward pass a segment's values are dropped when the next checkpoint is computed; a
later reader (the backward pass) recomputes the missing values from the nearest live
ones and keeps them until their last use, so each segment is replayed about once.

Two choices of candidate checkpoints (Checkmate, appendix B):
  * linearized: every forward node of the topological order (the DAG read as a chain);
  * articulation points (``-ap``): forward nodes whose removal disconnects the
    undirected forward graph and that no forward edge passes over in the order, so
    that a checkpoint alone separates the segments.

Two rules to place them:
  * ``chen-sqrtn``: every s-th candidate, s searched from sqrt(n) to meet the budget;
  * ``chen-greedy``: Chen's greedy rule, a checkpoint whenever the bytes accumulated since
    the last one pass a segment budget; the segment budget is searched.

``chen-search-ap`` starts from the best set of both rules, and of the set that
``jax.checkpoint``'s ``dots_saveable`` policy keeps (every forward product and
convolution), and searches on: it adds or removes one checkpoint at a time while that
shortens the schedule within budget (or brings it closer to the budget). Its plan for the GPT example on H100 at 0.7 measured x0.691 of
the peak at x1.112 FLOPs (benchmarks/README.md, "End to end on TPU v5e and H100").

References:
  Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016,
  sec. 4 (algorithm 2 and the greedy "memory planning with budget").
  Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
  Rematerialization", MLSys 2020, appendix B (generalizations to DAGs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import networkx as nx

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.segments import forward_nodes, forward_products
from jaxremat._src.simulate import SimulationResult
from jaxremat._src.solvers.reorder import resolve_order
from jaxremat._src.solvers.replay import Replay, SequenceTooLongError, evaluate, pick_best

_SEGMENT_BUDGET_STEPS = 40  # geometric grid of Chen's segment budgets tried


def checkpoint_candidates(graph: RematGraph, order: Sequence[int], variant: str) -> list[int]:
  """Forward nodes that may be checkpoints, in ``order``: ``"linearized"`` or ``"ap"``.

  Raises:
    ValueError: ``variant`` is neither.
  """
  forward = forward_nodes(graph)
  if variant == "linearized":
    return [v for v in order if v in forward]
  if variant == "ap":
    undirected = nx.Graph()
    undirected.add_nodes_from(forward)
    undirected.add_edges_from((u, v) for u, v in graph.edges if u in forward and v in forward)
    cut = set(nx.articulation_points(undirected))
    return [v for v in _order_separators(graph, order, forward) if v in cut]
  raise ValueError(f"variant={variant!r} must be 'linearized' or 'ap'.")


def _order_separators(graph: RematGraph, order: Sequence[int], forward: set[int]) -> list[int]:
  """Forward nodes, in ``order``, that no forward edge passes over.

  A checkpoint drops the values of its segment; that is only right when no later forward
  node reads one of them. An articulation point that cuts off a side branch (a variance
  reduction, say) is not such a point: the next node may read the value before it.
  """
  pos = {v: t for t, v in enumerate(order)}
  last_read = {v: pos[v] for v in forward}
  for u, w in graph.edges:
    if u in forward and w in forward:
      last_read[u] = max(last_read[u], pos[w])
  out, reach = [], -1  # reach: the last position read by a node before the current one
  for t, v in enumerate(order):
    if v not in forward:
      continue
    if reach <= t:
      out.append(v)
    reach = max(reach, last_read[v])
  return out


def segment_computes(
  graph: RematGraph,
  order: Sequence[int],
  checkpoints: set[int],
  forward: set[int],
) -> list[int]:
  """The compute sequence of segment checkpointing with the given checkpoints.

  Forward values outside ``checkpoints`` are dropped when the next checkpoint is
  computed; everything recomputed later stays until its last use (freed by
  `schedule_from_computes`), which replays a segment once per backward sweep.
  """
  replay = Replay(graph, order)
  segment: list[int] = []
  for t, v in enumerate(order):
    replay.now = t
    replay.ensure(v)
    if v not in forward:
      continue
    if v in checkpoints:
      for w in segment:
        replay.drop(w)
      segment = []
    else:
      segment.append(v)
  return replay.finish()


def _candidates_run(
  graph: RematGraph,
  order: Sequence[int],
  checkpoint_sets: Sequence[frozenset[int]],
  solver: str,
  forward: set[int],
  deadline: float = math.inf,
) -> list[tuple[Schedule, SimulationResult]]:
  out = []
  for checkpoints in dict.fromkeys(checkpoint_sets):
    if time.perf_counter() > deadline:
      break  # the time limit: the sets tried so far compete
    try:
      computes = segment_computes(graph, order, set(checkpoints), forward)
    except SequenceTooLongError:
      continue
    schedule, result = evaluate(graph, computes, solver=solver)
    out.append((schedule.replace(stats={"checkpoints": sorted(checkpoints)}), result))
  return out


def sqrtn_checkpoints(candidates: Sequence[int], spacing: int) -> frozenset[int]:
  """Every ``spacing``-th candidate (Chen's sqrt(n) rule when spacing = sqrt(n))."""
  return frozenset(candidates[spacing - 1 :: spacing])


def greedy_checkpoints(
  graph: RematGraph,
  candidates: Sequence[int],
  order: Sequence[int],
  segment_bytes: float,
  forward: set[int],
) -> frozenset[int]:
  """Chen's greedy rule: a checkpoint at the first ``forward`` candidate after
  ``segment_bytes`` accrue."""
  is_candidate = set(candidates)
  chosen, accrued = [], 0
  for v in order:
    if v not in forward:
      continue
    accrued += graph.mem[v]
    if accrued > segment_bytes and v in is_candidate:
      chosen.append(v)
      accrued = 0
  return frozenset(chosen)


def _rule_sets(
  graph: RematGraph,
  order: Sequence[int],
  candidates: Sequence[int],
  rule: str,
  forward: set[int],
) -> tuple[list[frozenset[int]], str]:
  """The checkpoint sets a rule tries (``"sqrtn"``, ``"greedy"`` or ``"dots"``), and what
  they are."""
  if rule == "dots":
    dots = frozenset(forward_products(graph))
    return [dots], "the forward products"
  if rule == "sqrtn":
    root = max(1, round(math.sqrt(len(candidates))))
    spacings = sorted(
      {root, *(2**k for k in range(int(math.log2(max(len(candidates), 1))) + 1))},
      key=lambda s: (s != root, s),
    )
    return [sqrtn_checkpoints(candidates, s) for s in spacings], f"checkpoint spacings {spacings}"
  forward_bytes = sum(graph.mem[v] for v in order if v in forward)
  smallest = max(1, min((graph.mem[v] for v in candidates), default=1))
  ratio = (max(forward_bytes, smallest) / smallest) ** (1 / _SEGMENT_BUDGET_STEPS)
  budgets = [smallest * ratio**k for k in range(_SEGMENT_BUDGET_STEPS + 1)]
  sets = [greedy_checkpoints(graph, candidates, order, b, forward) for b in budgets]
  return sets, f"{len(set(sets))} segment budgets"


def _solve(
  graph: RematGraph,
  budget_bytes: int,
  solver: str,
  rules: Sequence[str],
  variant: str,
  order,
  time_limit_s: float,
  search: bool = False,
):
  graph.require_feasible(budget_bytes)
  deadline = time.perf_counter() + time_limit_s
  order = resolve_order(graph, order)
  candidates = checkpoint_candidates(graph, order, variant)
  forward = forward_nodes(graph)
  sets, whats = [], []
  for rule in rules:
    rule_sets, what = _rule_sets(graph, order, candidates, rule, forward)
    sets += rule_sets
    whats.append(what)
  what = f"{' and '.join(whats)} over {len(candidates)} {variant} candidates"
  tried = _candidates_run(graph, order, sets, solver, forward, deadline)
  if not (search and tried):
    return pick_best(tried, budget_bytes, solver, what)
  found = _search(graph, order, candidates, forward, tried, budget_bytes, solver, deadline)
  best = pick_best([*tried, found], budget_bytes, solver, what + ", then a local search")
  by_search = best.computes == found[0].computes and found[0].stats.get("searched")
  found_by = f"{solver} ({'local search' if by_search else 'rules'})"
  return best.replace(stats={**best.stats, "found_by": found_by})


def _search(
  graph: RematGraph,
  order: Sequence[int],
  candidates: Sequence[int],
  forward: set[int],
  tried: Sequence[tuple[Schedule, SimulationResult]],
  budget_bytes: int,
  solver: str,
  deadline: float,
) -> tuple[Schedule, SimulationResult]:
  """Local search over checkpoint sets from the best of ``tried``: one checkpoint added or
  removed at a time, kept while it lowers (bytes over budget, duration)."""

  def key(result: SimulationResult) -> tuple[int, float]:
    return (max(0, result.peak_bytes - budget_bytes), result.duration)

  best = min(((s, r) for s, r in tried if r.valid), key=lambda t: key(t[1]), default=tried[0])
  checkpoints = set(best[0].stats["checkpoints"])
  improved = True
  while improved and time.perf_counter() < deadline:
    improved = False
    for v in candidates:
      if time.perf_counter() > deadline:
        break
      trial = checkpoints ^ {v}
      try:
        computes = segment_computes(graph, order, trial, forward)
      except SequenceTooLongError:
        continue
      schedule, result = evaluate(graph, computes, solver=solver)
      if result.valid and key(result) < key(best[1]):
        best = (schedule.replace(stats={"checkpoints": sorted(trial), "searched": True}), result)
        checkpoints, improved = trial, True
  return best


def solve_chen_sqrtn(
  graph: RematGraph, budget_bytes: int, *, order=None, time_limit_s: float = 60.0, **_
) -> Schedule:
  """Chen's sqrt(n) checkpoints over the linearized forward order (spacing searched).

  Raises:
    NoScheduleFoundError: no spacing meets the budget.
  """
  return _solve(graph, budget_bytes, "chen-sqrtn", ("sqrtn",), "linearized", order, time_limit_s)


def solve_chen_sqrtn_ap(
  graph: RematGraph, budget_bytes: int, *, order=None, time_limit_s: float = 60.0, **_
) -> Schedule:
  """Chen's sqrt(n) checkpoints restricted to articulation points (spacing searched)."""
  return _solve(graph, budget_bytes, "chen-sqrtn-ap", ("sqrtn",), "ap", order, time_limit_s)


def solve_chen_greedy(
  graph: RematGraph, budget_bytes: int, *, order=None, time_limit_s: float = 60.0, **_
) -> Schedule:
  """Chen's greedy segments over the linearized forward order (segment budget searched).

  Raises:
    NoScheduleFoundError: no segment budget meets the memory budget.
  """
  return _solve(graph, budget_bytes, "chen-greedy", ("greedy",), "linearized", order, time_limit_s)


def solve_chen_greedy_ap(
  graph: RematGraph, budget_bytes: int, *, order=None, time_limit_s: float = 60.0, **_
) -> Schedule:
  """Chen's greedy segments over articulation points (segment budget searched)."""
  return _solve(graph, budget_bytes, "chen-greedy-ap", ("greedy",), "ap", order, time_limit_s)


def solve_chen_search_ap(
  graph: RematGraph, budget_bytes: int, *, order=None, time_limit_s: float = 60.0, **_
) -> Schedule:
  """Checkpoints over articulation points: the best set of both of Chen's rules and of the
  forward products (`dots_saveable`'s), then a local search that adds or removes one
  articulation point at a time.

  Raises:
    NoScheduleFoundError: no set found meets the budget.
  """
  rules = ("sqrtn", "greedy", "dots")
  return _solve(graph, budget_bytes, "chen-search-ap", rules, "ap", order, time_limit_s, True)
