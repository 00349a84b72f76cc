"""`cover`: cover the over-budget stretch of a schedule with the cheapest recomputations.

Eviction heuristics (`xla-greedy`, DTR) decide at the moment memory runs over, one
value at a time; on graphs with many long edges (the random layered graphs) they evict
values that are needed again soon and thrash. `cover` plans on the whole timeline
instead. It starts from an order run once (every value freed at its last read), and
repeatedly splits a live range at a gap between two reads of a value: the value is
freed after the first read and recomputed just before the second, which saves its bytes
over the gap for its cost, and keeps its inputs alive until the recompute where they
would have died earlier. Each round scores every split by the excess memory it removes
(bytes over budget, summed over the events of the gap, net of the inputs kept longer)
per unit of recompute cost (the greedy rule of weighted set multicover) and applies the
best splits whose event ranges do not overlap. A split of an input kept alive for a
recompute recomputes that input too, so chains of recomputation arise round by round.

Once within budget, needless recomputations are deleted (`prune_recomputes`), then a
ruin-and-recreate local search deletes a few recomputations at a time, repairs with the
same greedy and keeps the result when it is shorter. The random choices come from a
fixed seed and the work is fixed per graph, so the answer is deterministic.

First computes stay in the given order, so on the input order the result also fits
MOCCASIN's staged model and serves as its warm start (`auto`).

References:
  Chvatal, "A Greedy Heuristic for the Set-Covering Problem", Math. of OR, 1979
  (the cost-per-covered-unit rule, here with multiplicities as in multicover).
  Schrimpf et al., "Record Breaking Optimization Results Using the Ruin and Recreate
  Principle", J. Comput. Phys., 2000 (the local search).
  Checkmate (Jain et al., MLSys 2020) and MOCCASIN (Bartan et al., ICML 2023) for the
  model: a fixed first-compute order, recomputations placed anywhere.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import numpy as np

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.solvers.reorder import resolve_order
from jaxremat._src.solvers.replay import evaluate, pick_best, prune_recomputes

# A round applies every non-overlapping split scoring at least this share of the best
# score: fewer rounds, and the splits taken together are still the best ones.
_BATCH_SHARE = 0.5
# Give up on an order when the sequence grows past this many computes per node, or
# after this many rounds that removed no excess.
_MAX_COMPUTES_PER_NODE = 6
_MAX_STALLS = 3
# Ruin-and-recreate: recomputations deleted per trial (at most), and trials.
_RUIN_SIZE = 3
_TRIALS = 50
# Recomputations a trial tries to delete after its repair (the costliest first).
_PRUNE_TRIALS = 8
_SEED = 0


class _Arrays:
  """The graph as numpy arrays (predecessors in CSR form, sizes indexed by value)."""

  def __init__(self, graph: RematGraph):
    preds = graph.compute_preds
    self.mem = np.asarray(graph.mem, dtype=np.int64)
    self.cost = np.asarray(graph.cost, dtype=np.float64)
    self.indeg = np.asarray([len(p) for p in preds], dtype=np.int64)
    self.offsets = np.concatenate(([0], np.cumsum(self.indeg)))
    self.preds = np.asarray([u for p in preds for u in p], dtype=np.int64)
    self.sizes, self.size_index = np.unique(self.mem, return_inverse=True)


class _Timeline:
  """Live ranges of every copy in a compute sequence, and memory at every compute event.

  Event ``len(computes)`` is a virtual last event where the outputs are read.
  """

  def __init__(self, graph: RematGraph, computes: Sequence[int], budget_bytes: int):
    preds = graph.compute_preds
    n_events = len(computes)
    self.nodes = np.asarray(computes, dtype=np.int64)
    copy, reader = [], []  # one entry per read: the copy read (its event) and the reader
    current: dict[int, int] = {}
    for q, v in enumerate(computes):
      for u in preds[v]:
        copy.append(current[u])
        reader.append(q)
      current[v] = q
    for v in graph.outputs:
      if v in current:
        copy.append(current[v])
        reader.append(n_events)
    self.copy = np.asarray(copy, dtype=np.int64)
    self.reader = np.asarray(reader, dtype=np.int64)
    self.end = np.arange(n_events, dtype=np.int64)  # a copy nobody reads dies at once
    np.maximum.at(self.end, self.copy, self.reader)
    mem = np.asarray(graph.mem, dtype=np.int64)[self.nodes]
    change = np.zeros(n_events + 2, dtype=np.int64)
    np.add.at(change, np.arange(n_events), mem)
    np.add.at(change, self.end + 1, -mem)
    self.memory = graph.resident_bytes + np.cumsum(change[: n_events + 1])
    # Bytes live just before each event (its inputs included, its own output not).
    self.before = self.memory.copy()
    self.before[:n_events] -= mem
    self.excess = self.memory - budget_bytes
    self.over = np.concatenate(([0], np.cumsum(self.excess > 0)))
    # Copies sorted by (node, event): the copy a compute inserted before q reads.
    self._key_scale = n_events + 2
    self._keys = np.sort(self.nodes * self._key_scale + np.arange(n_events))

  def live_copies(self, nodes: np.ndarray, events: np.ndarray) -> np.ndarray:
    """Events of the copies of ``nodes`` that computes inserted before ``events`` read."""
    keys = nodes * self._key_scale + events
    return self._keys[np.searchsorted(self._keys, keys) - 1] % self._key_scale


def _prefix(excess: np.ndarray, sizes: np.ndarray, added: bool) -> np.ndarray:
  """Per size s, prefix sums over events of the excess that s bytes remove or add."""
  shifted = excess[None, :] + (sizes[:, None] if added else 0)
  clipped = np.clip(shifted, 0, sizes[:, None])
  return np.concatenate((np.zeros((len(sizes), 1), np.int64), np.cumsum(clipped, axis=1)), axis=1)


def _splits(arrays: _Arrays, timeline: _Timeline, budget_bytes: int, staged: bool) -> list[tuple]:
  """Every split that removes excess: (free, score, lo, q, v, p, moved), best first.

  A split recomputes v (the copy at ``p``) before event ``q``, freeing the copy after its
  read at ``a`` instead; with ``moved`` (the stretch before the first read, free order
  only) it moves that compute to ``q`` at no extra cost. ``free`` marks splits that
  cost nothing; ``lo`` is the first event whose memory the split changes.
  """
  t = timeline
  order = np.lexsort((t.reader, t.copy))
  copy, reader = t.copy[order], t.reader[order]
  same = copy[1:] == copy[:-1]
  first_read = np.concatenate(([True], ~same))
  # Gaps: (previous read, next read) of a copy, and (its compute, its first read).
  p = np.concatenate((copy[1:][same], copy[first_read]))
  a = np.concatenate((reader[:-1][same], copy[first_read]))
  q = np.concatenate((reader[1:][same], reader[first_read]))
  moved = np.zeros(len(p), dtype=bool)
  if not staged:
    moved[int(same.sum()) :] = True
  lo = a + (~moved)
  keep = (q - a >= 2) & (t.over[q] > t.over[lo])  # some event of the gap is over budget
  p, a, q, moved, lo = p[keep], a[keep], q[keep], moved[keep], lo[keep]
  if not len(p):
    return []
  v = t.nodes[p]
  # Inputs of v at the recompute: (split, input) pairs; an input that died before q is
  # kept alive from its last read to q.
  count = arrays.indeg[v]
  split = np.repeat(np.arange(len(v)), count)
  within = np.arange(len(split)) - np.repeat(np.cumsum(count) - count, count)
  u = arrays.preds[np.repeat(arrays.offsets[v], count) + within]
  end = t.end[t.live_copies(u, q[split])]
  extended = end < q[split]
  split, u, end = split[extended], u[extended], end[extended]
  needed = np.unique(np.concatenate((arrays.size_index[v], arrays.size_index[u])))
  row = np.zeros(len(arrays.sizes), dtype=np.int64)
  row[needed] = np.arange(len(needed))
  saved = _prefix(t.excess, arrays.sizes[needed], added=False)
  added = _prefix(t.excess, arrays.sizes[needed], added=True)
  rv, ru = row[arrays.size_index[v]], row[arrays.size_index[u]]
  gain = (saved[rv, q] - saved[rv, lo]).astype(np.float64)
  gain -= np.bincount(split, added[ru, q[split]] - added[ru, end + 1], minlength=len(v))
  kept = np.bincount(split, arrays.mem[u], minlength=len(v))
  gain -= np.maximum(0, t.before[q] + kept - budget_bytes)
  np.minimum.at(lo, split, end + 1)
  extra = np.where(moved, 0.0, arrays.cost[v])
  good = np.nonzero(gain > 0)[0]
  out = [
    (
      bool(extra[i] == 0),
      float(gain[i] / extra[i]) if extra[i] else float(gain[i]),
      int(lo[i]),
      int(q[i]),
      int(v[i]),
      int(p[i]),
      bool(moved[i]),
    )
    for i in good
  ]
  out.sort(key=lambda s: (not s[0], -s[1], s[3], s[4]))
  return out


def _apply(computes: list[int], splits: Sequence[tuple]) -> list[int]:
  before = {q: v for _, _, _, q, v, _, _ in splits}
  gone = {p for *_, p, moved in splits if moved}
  out = []
  for q, v in enumerate(computes):
    if q in before:
      out.append(before[q])
    if q not in gone:
      out.append(v)
  if len(computes) in before:
    out.append(before[len(computes)])
  return out


def cover_computes(
  graph: RematGraph,
  computes: Sequence[int],
  budget_bytes: int,
  deadline: float,
  staged: bool = False,
  forbidden: frozenset[int] = frozenset(),
) -> list[int] | None:
  """Adds recomputations to ``computes`` until its peak fits ``budget_bytes``.

  Args:
    graph: the graph.
    computes: a valid compute sequence (an order, or a schedule's computes).
    budget_bytes: the memory budget.
    deadline: a `time.perf_counter()` value; past it the covering gives up.
    staged: keep every compute where it is (only add recomputations), so that first
      computes stay in the order of ``computes``; otherwise a compute may also move
      to just before its first reader.
    forbidden: nodes not to recompute.

  Returns:
    The longer compute sequence, or None when no split removes the remaining excess,
    the sequence grows past `_MAX_COMPUTES_PER_NODE` computes per node, or the
    deadline passes.
  """
  arrays = _Arrays(graph)
  computes = list(computes)
  limit = _MAX_COMPUTES_PER_NODE * max(len(graph.order), 1)
  least_excess, stalls = math.inf, 0
  while True:
    timeline = _Timeline(graph, computes, budget_bytes)
    if timeline.over[-1] == 0:
      return computes
    if len(computes) > limit or time.perf_counter() > deadline:
      return None
    # Scores are estimates: moves can cycle without removing excess (seen on an MLP
    # step). A round that removes none turns moves off; `_MAX_STALLS` such rounds end it.
    excess = int(np.clip(timeline.excess, 0, None).sum())
    if excess >= least_excess:
      stalls += 1
      staged = True
      if stalls > _MAX_STALLS:
        return None
    least_excess = min(least_excess, excess)
    splits = [s for s in _splits(arrays, timeline, budget_bytes, staged) if s[4] not in forbidden]
    if not splits:
      return None
    # Free splits first (all that do not overlap), then the splits within a share of the
    # best score per unit of cost.
    best_score = next((s[1] for s in splits if not s[0]), 0.0)
    taken = np.zeros(len(computes) + 1, dtype=bool)
    chosen = []
    for split in splits:
      free, score, lo, q, *_ = split
      if not free and score < _BATCH_SHARE * best_score:
        break
      if not taken[lo : q + 1].any():
        taken[lo : q + 1] = True
        chosen.append(split)
    computes = _apply(computes, chosen)


def _recompute_positions(computes: Sequence[int]) -> list[int]:
  seen: set[int] = set()
  out = []
  for k, v in enumerate(computes):
    if v in seen:
      out.append(k)
    seen.add(v)
  return out


def _duration(graph: RematGraph, computes: Sequence[int]) -> float:
  return float(sum(graph.cost[v] for v in computes))


def improve_computes(
  graph: RematGraph,
  computes: Sequence[int],
  budget_bytes: int,
  deadline: float,
  trials: int | None = None,
  staged: bool = False,
  tabu: bool = False,
) -> list[int]:
  """Ruin and recreate: a shorter compute sequence within budget, or ``computes``.

  Each trial deletes up to `_RUIN_SIZE` recomputations (chosen by a seeded generator,
  the costlier more often), repairs with `cover_computes`, prunes, and keeps the result
  when it is shorter. Runs ``trials`` trials (default `_TRIALS`) or until ``deadline``.
  With ``tabu``, every other repair may not recompute the ruined nodes again: the greedy
  often puts the same ones back where several cheaper ones elsewhere would do.
  """
  best = list(computes)
  best_duration = _duration(graph, best)
  rng = random.Random(_SEED)
  trials = _TRIALS if trials is None else trials
  for i in range(trials):
    if time.perf_counter() > deadline:
      break
    positions = _recompute_positions(best)
    if not positions:
      break
    weights = [graph.cost[best[k]] + 1e-9 for k in positions]
    ruined = set(rng.choices(positions, weights, k=min(_RUIN_SIZE, len(positions))))
    trial = [v for k, v in enumerate(best) if k not in ruined]
    forbidden = frozenset(best[k] for k in ruined) if tabu and i % 2 else frozenset()
    repaired = cover_computes(graph, trial, budget_bytes, deadline, staged, forbidden)
    if repaired is None:
      continue
    repaired = prune_recomputes(graph, repaired, budget_bytes, deadline, _PRUNE_TRIALS)
    duration = _duration(graph, repaired)
    if duration < best_duration:
      best, best_duration = repaired, duration
  return best


def _solve(
  graph: RematGraph,
  budget_bytes: int,
  time_limit_s: float,
  orders: Sequence[Sequence[int]],
  trials: int | None,
  staged: bool,
  solver: str,
) -> Schedule:
  graph.require_feasible(budget_bytes)
  deadline = time.perf_counter() + time_limit_s
  candidates = []
  for start in orders:
    computes = cover_computes(graph, start, budget_bytes, deadline, staged)
    if computes is not None:
      computes = prune_recomputes(graph, computes, budget_bytes, deadline)
      candidates.append(evaluate(graph, computes, solver=solver))
  fitting = [c for c in candidates if c[1].peak_bytes <= budget_bytes]
  if fitting:
    schedule, _ = min(fitting, key=lambda c: c[1].duration)
    # The local search only refines: it takes at most half of the time left, so that a
    # portfolio (`auto`) keeps time for its other solvers on large graphs.
    now = time.perf_counter()
    search_deadline = now + max(deadline - now, 0.0) / 2
    improved = improve_computes(
      graph, schedule.computes, budget_bytes, search_deadline, trials, staged
    )
    candidates.append(evaluate(graph, improved, solver=solver))
  return pick_best(candidates, budget_bytes, solver, f"greedy covering of {len(orders)} order(s)")


def solve_cover(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  order: str | Sequence[int] | None = None,
  trials: int | None = None,
  staged: bool = False,
  **_,
) -> Schedule:
  """Greedy covering of the over-budget events by recomputations, then local search.

  Args:
    graph: the graph.
    budget_bytes: the memory budget.
    time_limit_s: wall seconds for the whole solve; the covering stops at the deadline,
      the local search at half the time left after the covering (the best schedule
      found by then is returned).
    order: ``None`` tries the input order and `reorder`'s; ``"input"``, ``"reorder"`` or
      a node sequence fixes one.
    trials: ruin-and-recreate trials (default 50; 0 turns the search off).
    staged: only add recomputations, never move a compute (see `cover_computes`).

  Raises:
    NoScheduleFoundError: no order could be covered within the budget.

  Example:
    >>> import jaxremat
    >>> g = jaxremat.RematGraph.build(mem=[4, 4, 4, 1], cost=[1, 1, 1, 1],
    ...                               edges=[(0, 1), (1, 2), (2, 3), (0, 3)])
    >>> s = jaxremat.solve(g, 9, "cover")  # the baseline peaks at 12
    >>> s.stats["peak_bytes"], s.stats["n_recompute"]
    (9, 1)
  """
  if order is None:
    orders = list(dict.fromkeys([tuple(graph.order), resolve_order(graph, "reorder")]))
  else:
    orders = [resolve_order(graph, order)]
  return _solve(graph, budget_bytes, time_limit_s, orders, trials, staged, "cover")


def solve_cover_staged(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  trials: int | None = None,
  **_,
) -> Schedule:
  """`solve_cover` on the input order, staged: every compute stays in place.

  The first computes follow ``graph.order``, so the result fits MOCCASIN's staged model
  and can warm-start it (`auto` does).

  Raises:
    NoScheduleFoundError: the input order could not be covered within the budget.
  """
  orders = [tuple(graph.order)]
  return _solve(graph, budget_bytes, time_limit_s, orders, trials, True, "cover-staged")
