"""Replaying a target order with recomputation on demand: the engine of the heuristic solvers.

A heuristic decides *which* values to keep; `Replay` turns those decisions into a valid
compute sequence. Asking for a node whose predecessors were dropped recomputes them
(recursively, from whatever is still live), so every sequence it emits is a valid
program; `schedule_from_computes` then frees each copy at its last read.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

from jaxremat._src.errors import NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import SimulationResult, simulate

# Trials times sequence length that `prune_recomputes` may simulate (about 10 s).
_PRUNE_WORK = 2_000_000
# Ancestors a recompute-cost estimate visits before it stops (keeps eviction O(live)).
_CLOSURE_LIMIT = 64


class SequenceTooLongError(Exception):
  """A replay passed its ``max_computes``: the heuristic is thrashing; give up on it."""


class Replay:
  """Builds a compute sequence for ``graph`` while tracking which values are live.

  Args:
    graph: the graph.
    order: the target order (a topological order of the non-input nodes); positions in it
      define "next use" for eviction and "dead" values.
    budget_bytes: if given, `ensure` evicts live values (lowest recompute cost per byte
      and per step until the next use first) before a compute would exceed it.
    max_computes: raise `SequenceTooLongError` past this many computes (default 50 x
      the number of nodes).
    deadline: raise `SequenceTooLongError` when eviction runs past this
      `time.perf_counter()` value.

  Attributes:
    computes: the compute sequence so far (recomputations included).
    computed: per node, whether it has been computed at least once.
    live: per node, whether a copy is live (available without recomputation).
    now: position in ``order`` of the target being computed; set by the caller.
  """

  def __init__(
    self,
    graph: RematGraph,
    order: Sequence[int],
    budget_bytes: int | None = None,
    max_computes: int | None = None,
    deadline: float | None = None,
  ):
    self.graph = graph
    self.deadline = deadline
    self.max_computes = 50 * max(graph.n, 1) if max_computes is None else max_computes
    self.budget_bytes = budget_bytes
    self.position = [-1] * graph.n
    for k, v in enumerate(order):
      self.position[v] = k
    preds = graph.compute_preds
    self._uses: list[list[int]] = [[] for _ in range(graph.n)]
    for v in order:
      for u in preds[v]:
        self._uses[u].append(self.position[v])
    for uses in self._uses:
      uses.sort()
    self._is_output = [False] * graph.n
    for v in graph.outputs:
      self._is_output[v] = True
    self.live = [False] * graph.n
    self.live_set: set[int] = set()
    self.live_bytes = 0
    self.computes: list[int] = []
    self.computed = [False] * graph.n
    self.now = 0
    self._pinned = [0] * graph.n

  # -- primitives --------------------------------------------------------------------

  def ensure(self, v: int) -> None:
    """Makes ``v`` live, recomputing every dropped ancestor it needs (iteratively)."""
    if self.live[v]:
      return
    preds = self.graph.compute_preds
    stack = [v]
    self._pin(v)
    while stack:
      u = stack[-1]
      if self.live[u]:
        stack.pop()
        self._unpin(u)
        continue
      missing = [p for p in preds[u] if not self.live[p]]
      if missing:
        for p in missing:
          stack.append(p)
          self._pin(p)
        continue
      stack.pop()
      self._make_room(u)
      self.live[u] = True
      self.live_set.add(u)
      self.live_bytes += self.graph.mem[u]
      self.computes.append(u)
      self.computed[u] = True
      self._unpin(u)
      if len(self.computes) > self.max_computes:
        raise SequenceTooLongError(f"more than {self.max_computes} computes")

  def drop(self, v: int) -> None:
    """Forgets the live copy of ``v``; a later reader recomputes it."""
    if self.live[v]:
      self.live[v] = False
      self.live_set.discard(v)
      self.live_bytes -= self.graph.mem[v]

  def drop_dead(self, nodes: Sequence[int]) -> None:
    """Drops those of ``nodes`` that no target after ``now`` reads (outputs stay)."""
    for v in nodes:
      if self.live[v] and not self._is_output[v] and self._next_use(v) is None:
        self.drop(v)

  def finish(self) -> list[int]:
    """Makes every output live and returns the compute sequence."""
    self.now = len(self.position)
    for v in self.graph.outputs:
      if not self.graph.is_input[v]:
        self.ensure(v)
    return self.computes

  # -- eviction ----------------------------------------------------------------------

  def _pin(self, v: int) -> None:
    # The predecessors of a node waiting on the stack must survive eviction.
    for p in self.graph.compute_preds[v]:
      self._pinned[p] += 1

  def _unpin(self, v: int) -> None:
    for p in self.graph.compute_preds[v]:
      self._pinned[p] -= 1

  def _next_use(self, v: int) -> int | None:
    uses = self._uses[v]
    k = bisect.bisect_right(uses, self.now)
    return uses[k] if k < len(uses) else None

  def _make_room(self, v: int) -> None:
    if self.budget_bytes is None:
      return
    mem, cost = self.graph.mem, self.graph.cost
    limit = self.budget_bytes - self.graph.resident_bytes - mem[v]
    while self.live_bytes > limit:
      if self.deadline is not None and time.perf_counter() > self.deadline:
        raise SequenceTooLongError("the time limit passed")
      # Branch and bound: cost[w] / (mem[w] x steps) bounds w's rank from below, so
      # candidates are refined in that order until no bound can beat the best rank.
      bounds = []
      for w in self.live_set:
        if self._pinned[w] or w == v:
          continue
        nxt = self._next_use(w)
        steps = max((len(self.position) if nxt is None else nxt) - self.now, 1)
        dead = nxt is None and not self._is_output[w]
        bounds.append((-1.0 if dead else cost[w] / (max(mem[w], 1) * steps), w))
      bounds.sort()
      best, best_key, best_next = None, None, None
      for bound, w in bounds:
        if best_key is not None and bound >= best_key[0]:
          break
        key, nxt = self._eviction_key(w)
        if best_key is None or key < best_key:
          best, best_key, best_next = w, key, nxt
      if best is None:
        return  # nothing evictable: the caller sees the overshoot in `simulate`
      if best_next is not None:
        # Recomputing `best` before its next reader needs its inputs then: they live
        # until that point.
        for p in self.graph.compute_preds[best]:
          if self.live[p]:
            bisect.insort(self._uses[p], best_next)
      self.drop(best)

  def _last_use(self, v: int) -> int:
    return self._uses[v][-1] if self._uses[v] else -1

  def _closure_cost(self, v: int, end: int, root: bool = False) -> float:
    """Cost of recomputing ``v`` at ``end`` with every missing ancestor (capped search).

    Values live now and read at or after ``end`` are assumed still live; past
    `_CLOSURE_LIMIT` nodes the estimate stops growing (the cascade is already costly).
    """
    preds, cost = self.graph.compute_preds, self.graph.cost
    seen, stack, total = {v}, [v], 0.0
    while stack and len(seen) <= _CLOSURE_LIMIT:
      u = stack.pop()
      if u != v or not root:
        if self.live[u] and (self._last_use(u) >= end or self._is_output[u]):
          continue
      total += cost[u]
      for p in preds[u]:
        if p not in seen:
          seen.add(p)
          stack.append(p)
    return total

  def _eviction_key(self, w: int) -> tuple[tuple[float, int], int | None]:
    """(rank, next use whose recompute keeps the inputs) of evicting ``w``; lower is better.

    Two ways to recompute ``w`` later: keep its inputs alive until then (as XLA extends
    operand live ranges; saves ``mem[w]`` minus what they hold longer) or let them die
    and recompute them too (saves ``mem[w]``, costs theirs).
    """
    nxt = self._next_use(w)
    if nxt is None and not self._is_output[w]:
      return (-1.0, w), None  # dead: free at no cost
    end = len(self.position) if nxt is None else nxt
    mem, cost = self.graph.mem, self.graph.cost
    keep_cost, extended, dying = cost[w], 0, []
    for p in self.graph.compute_preds[w]:
      if not self.live[p]:
        keep_cost += self._closure_cost(p, end)
      elif self._last_use(p) < end and not self._is_output[p]:
        extended += mem[p]
        dying.append(p)
    cascade_cost = keep_cost + sum(self._closure_cost(p, end, root=True) for p in dying)
    # XLA ranks remat candidates by memory saved per recompute cost; dividing by the
    # steps until the next reader (as DTR does) keeps values that are about to be read.
    steps = max(end - self.now, 1)
    cascade = cascade_cost / (max(mem[w], 1) * steps)
    saved = mem[w] - extended
    if saved > 0 and keep_cost / (saved * steps) <= cascade:
      return (keep_cost / (saved * steps), w), end
    return (cascade, w), None


def evaluate(
  graph: RematGraph,
  computes: Sequence[int],
  *,
  solver: str,
  budget_bytes: int | None = None,
) -> tuple[Schedule, SimulationResult]:
  """The schedule of a compute sequence (frees at last use) and its simulation."""
  schedule = schedule_from_computes(graph, computes, solver=solver, budget=budget_bytes)
  return schedule, simulate(graph, schedule)


def pick_best(
  candidates: Sequence[tuple[Schedule, SimulationResult]],
  budget_bytes: int,
  solver: str,
  what: str,
  graph: RematGraph | None = None,
  deadline: float | None = None,
) -> Schedule:
  """The shortest valid candidate within budget; its stats: ``status="feasible"`` and
  ``found_by=solver``.

  With ``graph`` and ``deadline``, the winner's recomputations are then pruned
  (`prune_recomputes`) until the deadline.

  Raises:
    NoScheduleFoundError: no candidate fits; the message names the least peak reached.
  """
  fitting = [
    (r.duration, r.peak_bytes, k)
    for k, (_, r) in enumerate(candidates)
    if r.valid and r.peak_bytes <= budget_bytes
  ]
  if not fitting:
    least_bytes = min((r.peak_bytes for _, r in candidates if r.valid), default=None)
    least = "" if least_bytes is None else f"; the least peak it reached was {least_bytes} bytes"
    raise NoScheduleFoundError(
      f"solver {solver!r} found no schedule within budget={budget_bytes} bytes after "
      f"trying {what}{least}; raise the budget or use solver='auto'.",
      least_peak_bytes=least_bytes,
    )
  _, _, k = min(fitting)
  schedule, _ = candidates[k]
  if deadline is not None and graph is not None:
    computes = prune_recomputes(graph, schedule.computes, budget_bytes, deadline)
    schedule = schedule_from_computes(graph, computes)
  stats = {"status": "feasible", "found_by": solver}
  return schedule.replace(budget=budget_bytes, solver=solver, stats=stats)


def prune_recomputes(
  graph: RematGraph,
  computes: Sequence[int],
  budget_bytes: int,
  deadline: float,
  max_trials: int | None = None,
) -> list[int]:
  """Deletes recomputations, most expensive first, while the peak stays within budget.

  Deleting a recompute of v keeps v's previous copy alive until the readers of the
  deleted one (`schedule_from_computes` frees at last use), so every result is valid;
  only its peak can grow. Tries the most expensive recomputations first, as many as
  a fixed amount of work allows (at most ``max_trials`` where given), and stops early at
  ``deadline`` (a `time.perf_counter()` value).
  """
  computes = list(computes)
  seen: set[int] = set()
  recomputes = []
  for k, v in enumerate(computes):
    if v in seen:
      recomputes.append(k)
    seen.add(v)
  removed: set[int] = set()
  # A fixed amount of work (trials x sequence length) keeps the result deterministic;
  # the deadline only guards the caller's time limit.
  trials = max(200, _PRUNE_WORK // max(len(computes), 1))
  if max_trials is not None:
    trials = min(trials, max_trials)
  for k in sorted(recomputes, key=lambda k: (-graph.cost[computes[k]], k))[:trials]:
    if time.perf_counter() > deadline:
      break
    trial = [v for j, v in enumerate(computes) if j != k and j not in removed]
    if simulate(graph, schedule_from_computes(graph, trial)).peak_bytes <= budget_bytes:
      removed.add(k)
  return [v for j, v in enumerate(computes) if j not in removed]


def resequence(graph: RematGraph, computes: Sequence[int], max_pull: int = 8) -> list[int]:
  """``computes`` with the same computations in an order of lower peak, if one is found.

  A replay recomputes a segment at once, in the target order, so a value that one more
  computation would free can stay live across the whole replay: on the GPT example the
  logits' gradient waited through the last block's replay for the embedding's gradient,
  which reads a value of that replay (2.5 MiB of H100's 36.4). Before each run of
  recomputations, this pulls forward the computations that finish a live copy (its
  remaining readers and what they wait for, at most ``max_pull``) while that frees more
  than it allocates. Each computation still reads the copy it read (a copy's readers
  stay before its node's next computation), so the result is valid at the same cost;
  it is returned where its peak is lower, or the same with fewer bytes held over time.
  """
  mem, preds = graph.mem, graph.compute_preds
  deps: list[list[int]] = []  # per computation: the copies it reads
  readers: list[list[int]] = [[] for _ in computes]
  before: list[set[int]] = []  # per computation: what must run first
  recompute: list[bool] = []
  current: dict[int, int] = {}
  effects = set(graph.compute_once_nodes)
  last_effect: set[int] = set()  # effects keep their order
  for i, v in enumerate(computes):
    recompute.append(v in current)
    deps.append(sorted({current[u] for u in preds[v] if u in current}))
    for j in deps[i]:
      readers[j].append(i)
    first = set(deps[i])
    if v in current:
      first.add(current[v])
      first.update(readers[current[v]])
    if v in effects:
      first |= last_effect
      last_effect = {i}
    before.append(first)
    current[v] = i
  final = {current[v] for v in graph.outputs if v in current}
  done = [False] * len(computes)
  live: set[int] = set()  # copies that a computation not yet run reads
  order: list[int] = []

  def run(i: int) -> None:
    done[i] = True
    order.append(i)
    if not all(done[r] for r in readers[i]):
      live.add(i)
    live.difference_update(j for j in deps[i] if all(done[r] for r in readers[j]))

  def finishing(j: int) -> list[int] | None:
    """What must run, in sequence order, before copy ``j`` is read for the last time."""
    need: set[int] = set()
    stack = [r for r in readers[j] if not done[r]]
    while stack:
      i = stack.pop()
      if i not in need:
        need.add(i)
        if len(need) > max_pull:
          return None
        stack.extend(k for k in before[i] if not done[k])
    return sorted(need)

  def freed_bytes(group: list[int]) -> int:
    """Live bytes released minus bytes left allocated by running ``group`` now."""
    inside = set(group)

    def dead(j: int) -> bool:
      return j not in final and all(done[r] or r in inside for r in readers[j])

    touched = {j for i in group for j in deps[i]} & live
    released = sum(mem[computes[j]] for j in touched if dead(j))
    return released - sum(mem[computes[i]] for i in group if not dead(i))

  for i in range(len(computes)):
    while recompute[i] and not recompute[i - 1] and not done[i]:
      groups = [g for g in map(finishing, sorted(live)) if g and i not in g]
      freed, best = max(((freed_bytes(g), g) for g in groups), default=(0, []))
      if freed <= 0:
        break
      for k in best:
        run(k)
    if not done[i]:
      run(i)
  resequenced = [computes[i] for i in order]
  old, new = (simulate(graph, schedule_from_computes(graph, c)) for c in (computes, resequenced))
  # XLA's peak may fall where the model's does not: less memory held over time counts.
  lower = (new.peak_bytes, sum(new.timeline_bytes)) < (old.peak_bytes, sum(old.timeline_bytes))
  return resequenced if lower else list(computes)
