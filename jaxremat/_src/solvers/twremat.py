"""`twremat`: Kumar et al.'s divide and conquer over a tree decomposition.

To compute a set of nodes, pick a balanced separator (a bag of a tree decomposition of
the undirected graph), compute the separator's nodes in topological order (each one's
predecessors inside the remaining components by recursion), keep them while recursing
into every component, then forget them. Memory stays near the separators on the
recursion stack, O(treewidth x log n) values, at the price of recomputation.
TWRemat(k) stops the recursion after k levels and runs the leaves in order without
recomputation, trading memory for length: k = 0 is the no-remat schedule.

References:
  Kumar, Purohit, Schwartz, Svitkina, Vee, Wang, "Efficient Rematerialization for Deep
  Networks", NeurIPS 2019, sec. 4 (TWRemat) and sec. 5 (the k-level variant).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import networkx as nx
from networkx.algorithms.approximation import treewidth_min_degree, treewidth_min_fill_in

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import SimulationResult
from jaxremat._src.solvers.reorder import resolve_order
from jaxremat._src.solvers.replay import Replay, SequenceTooLongError, evaluate, pick_best

# Min fill-in takes about 5 s on a 1000-node random layered graph (2 cores); min degree
# is ten times faster and nearly as narrow there.
_MIN_FILL_IN_MAX_NODES = 600
_MAX_LEVELS = 64


@dataclasses.dataclass(frozen=True)
class TreeDecomposition:
  """A rooted tree decomposition of the undirected graph of the non-input nodes.

  Attributes:
    width: the largest bag size minus one.
    bags: the bags, as tuples of node ids.
    parent: parent bag of each bag (-1 for the root).
    postorder: bags, children before parents.
    home: for each node, the bag closest to the root that holds it (-1 for inputs).
  """

  width: int
  bags: tuple[tuple[int, ...], ...]
  parent: tuple[int, ...]
  postorder: tuple[int, ...]
  home: tuple[int, ...]


def tree_decomposition(graph: RematGraph, heuristic: str = "auto") -> TreeDecomposition:
  """networkx's min fill-in (or min degree) tree decomposition, rooted at bag 0.

  Args:
    graph: the graph; inputs are left out (they are always resident).
    heuristic: ``"min_fill_in"``, ``"min_degree"`` or ``"auto"`` (min fill-in up to 600
      nodes).
  """
  undirected = nx.Graph()
  undirected.add_nodes_from(graph.order)
  inputs = set(graph.inputs)
  undirected.add_edges_from((u, v) for u, v in graph.edges if u not in inputs)
  if heuristic == "auto":
    heuristic = "min_fill_in" if graph.n <= _MIN_FILL_IN_MAX_NODES else "min_degree"
  if heuristic not in ("min_fill_in", "min_degree"):
    raise ValueError(f"heuristic={heuristic!r} must be 'min_fill_in', 'min_degree' or 'auto'.")
  fn = treewidth_min_fill_in if heuristic == "min_fill_in" else treewidth_min_degree
  width, tree = fn(undirected)
  bag_sets = sorted(tree.nodes, key=lambda bag: sorted(bag))  # deterministic numbering
  index = {bag: k for k, bag in enumerate(bag_sets)}
  parent = [-1] * len(bag_sets)
  postorder: list[int] = []
  seen = [False] * len(bag_sets)
  # networkx may return a forest for a disconnected graph: root every tree.
  for root in range(len(bag_sets)):
    if seen[root]:
      continue
    seen[root] = True
    stack = [(root, iter(sorted(index[b] for b in tree[bag_sets[root]])))]
    while stack:
      bag, children = stack[-1]
      child = next((c for c in children if not seen[c]), None)
      if child is None:
        stack.pop()
        postorder.append(bag)
        continue
      seen[child] = True
      parent[child] = bag
      stack.append((child, iter(sorted(index[b] for b in tree[bag_sets[child]]))))
  home = [-1] * graph.n
  for bag in reversed(postorder):  # parents first: the first bag seen is the closest to the root
    for v in bag_sets[bag]:
      if home[v] < 0:
        home[v] = bag
  return TreeDecomposition(
    width, tuple(tuple(sorted(b)) for b in bag_sets), tuple(parent), tuple(postorder), tuple(home)
  )


class _TWRemat:
  """One run of TWRemat(k) over a fixed decomposition and order."""

  def __init__(
    self, graph: RematGraph, order: Sequence[int], td: TreeDecomposition, k: int, max_computes: int
  ):
    self.graph, self.td, self.k = graph, td, k
    self.replay = Replay(graph, order, max_computes=max_computes)
    self.position = self.replay.position
    inputs = set(graph.inputs)
    self.neighbors = [set() for _ in range(graph.n)]
    for u, v in graph.edges:
      if u not in inputs:
        self.neighbors[u].add(v)
        self.neighbors[v].add(u)

  def run(self) -> list[int]:
    outputs = {v for v in self.graph.outputs if not self.graph.is_input[v]}
    self._compute(set(self.graph.order), outputs, cover=True, depth=0)
    return self.replay.finish()

  def _ancestors_within(self, nodes: set[int], targets: set[int]) -> set[int]:
    preds = self.graph.compute_preds
    out, stack = set(targets), list(targets)
    while stack:
      for p in preds[stack.pop()]:
        if p in nodes and p not in out:
          out.add(p)
          stack.append(p)
    return out

  def _separator(self, nodes: set[int]) -> set[int]:
    """The bag (restricted to ``nodes``) whose removal leaves components of <= half the nodes."""
    td = self.td
    weight = [0] * len(td.bags)
    for v in nodes:
      weight[td.home[v]] += 1
    subtree = weight[:]
    for bag in td.postorder:
      if td.parent[bag] >= 0:
        subtree[td.parent[bag]] += subtree[bag]
    children: dict[int, list[int]] = {}
    for bag in td.postorder:
      children.setdefault(td.parent[bag], []).append(bag)
    # Walk down from the heaviest root towards the heavy child while it holds over half.
    half = len(nodes) / 2
    bag = max(children[-1], key=lambda b: (subtree[b], -b))
    while True:
      heavy = max(children.get(bag, []), key=lambda b: (subtree[b], -b), default=None)
      if heavy is None or subtree[heavy] <= half:
        break
      bag = heavy
    return set(td.bags[bag]) & nodes

  def _components(self, nodes: set[int]) -> list[set[int]]:
    left, comps = set(nodes), []
    for start in sorted(nodes, key=self.position.__getitem__):
      if start not in left:
        continue
      left.discard(start)
      comp, stack = {start}, [start]
      while stack:
        for w in self.neighbors[stack.pop()]:
          if w in left:
            left.discard(w)
            comp.add(w)
            stack.append(w)
      comps.append(comp)
    return comps

  def _compute(self, nodes: set[int], targets: set[int], cover: bool, depth: int) -> None:
    """Computes every node of ``nodes`` (cover) or just ``targets``; leaves targets live.

    Predecessors outside ``nodes`` are live: the callers hold their separators.
    """
    replay, position = self.replay, self.position
    if cover:
      # Nodes computed earlier (for a separator) need no second visit: cover the rest.
      uncovered = {v for v in nodes if not replay.computed[v]}
      if not uncovered and not targets:
        return
      nodes = self._ancestors_within(nodes, uncovered | targets)
    else:
      nodes = self._ancestors_within(nodes, targets)
    if depth >= self.k or len(nodes) <= 2:
      run = sorted(nodes, key=position.__getitem__)
      for v in run:
        replay.ensure(v)
      for v in run:
        if v not in targets:
          replay.drop(v)
      return
    separator = self._separator(nodes)
    comps = self._components(nodes - separator)
    comp_of = {v: c for c, comp in enumerate(comps) for v in comp}
    held = sorted(separator, key=position.__getitem__)
    for x in held:
      needed: dict[int, set[int]] = {}
      for p in self.graph.compute_preds[x]:
        if p in comp_of and not replay.live[p]:
          needed.setdefault(comp_of[p], set()).add(p)
      for c, preds in sorted(needed.items()):
        self._compute(comps[c], preds, cover=False, depth=depth + 1)
      replay.ensure(x)
      for preds in needed.values():
        for p in preds - targets:
          replay.drop(p)
    for comp in comps:
      inner = targets & comp
      if cover or inner:
        self._compute(comp, inner, cover, depth + 1)
    for x in held:
      if x not in targets:
        replay.drop(x)


def twremat_computes(
  graph: RematGraph,
  k: int,
  *,
  order: Sequence[int] | None = None,
  decomposition: TreeDecomposition | None = None,
  max_computes: int | None = None,
) -> list[int]:
  """The compute sequence of TWRemat(k).

  Args:
    graph: the graph.
    k: recursion levels (0: the order once, no recomputation).
    order: topological order used inside leaves and for ties (default ``graph.order``).
    decomposition: a `tree_decomposition` of ``graph`` (computed if omitted).
    max_computes: give up past this many computes (default 50 x nodes).

  Raises:
    SequenceTooLongError: the schedule passed ``max_computes``.
  """
  order = tuple(graph.order) if order is None else tuple(order)
  td = decomposition or tree_decomposition(graph)
  return _TWRemat(graph, order, td, k, max_computes or 50 * max(graph.n, 1)).run()


def twremat_curve(
  graph: RematGraph,
  *,
  order: Sequence[int] | None = None,
  max_levels: int = _MAX_LEVELS,
  max_computes: int | None = None,
  time_limit_s: float = 60.0,
) -> list[tuple[int, Schedule, SimulationResult]]:
  """(k, schedule, simulation) of TWRemat(k) for k = 0, 1, ... until the recursion bottoms out.

  Stops when k no longer changes the schedule, past ``max_computes`` or ``time_limit_s``.
  """
  start = time.perf_counter()
  td = tree_decomposition(graph)
  out, previous = [], None
  for k in range(max_levels + 1):
    try:
      computes = twremat_computes(
        graph, k, order=order, decomposition=td, max_computes=max_computes
      )
    except SequenceTooLongError:
      break
    if computes == previous:
      break
    previous = computes
    schedule, result = evaluate(graph, computes, solver="twremat")
    out.append((k, schedule.replace(stats={"k": k, "width": td.width}), result))
    if time.perf_counter() - start > time_limit_s:
      break
  return out


def solve_twremat(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  k: int | None = None,
  order: str | Sequence[int] | None = None,
  **_,
) -> Schedule:
  """TWRemat(k) with the least duration within budget, over k (or the given k).

  Args:
    graph: the graph.
    budget_bytes: the memory budget.
    time_limit_s: stop trying deeper k after this long.
    k: a fixed recursion depth instead of the search.
    order: input order for leaves: ``"input"`` (default), ``"reorder"`` or a sequence.

  Raises:
    NoScheduleFoundError: no k meets the budget.
  """
  graph.require_feasible(budget_bytes)
  order = resolve_order(graph, order)
  if k is not None:
    try:
      computes = twremat_computes(graph, k, order=order)
    except SequenceTooLongError:
      computes = None
    candidates = [] if computes is None else [evaluate(graph, computes, solver="twremat")]
    what = f"TWRemat(k={k})"
  else:
    curve = twremat_curve(graph, order=order, time_limit_s=time_limit_s)
    candidates = [(s, r) for _, s, r in curve]
    what = f"TWRemat(k) for k = 0..{len(curve) - 1}"
  schedule = pick_best(candidates, budget_bytes, "twremat", what)
  return schedule
