"""Segment checkpointing schedules on any graph (Chen et al. style, for emit and verify).

The graph's nodes are split into its forward part (`forward_nodes`, with the values they
read, where a tracer marked the ``backward`` nodes) and the rest; a graph without marks,
where its input order holds the most memory in the baseline. The forward part is cut into
segments of equal cost; only the values crossing a segment boundary (the checkpoints) and
the last segment are kept, every other forward value is freed after its last forward
reader and recomputed, from the nearest kept values, right before the first backward node
that needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import baseline_schedule, simulate

# The primitives whose outputs `jax.checkpoint_policies.dots_saveable` saves.
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def segment_schedule(
  graph: RematGraph, n_segments: int, *, keep: Iterable[int] = (), keep_last: bool = True
) -> Schedule:
  """A checkpoint-every-segment schedule of ``graph``.

  Args:
    graph: the graph, typically a traced training step (forward, then backward).
    n_segments: how many segments the forward part is cut into (1 keeps everything).
    keep: nodes that must never be recomputed, besides those whose ``attrs`` say
      ``effectful``.
    keep_last: keep the last segment's values (its backward runs first) instead of
      recomputing them.

  Returns:
    A valid schedule whose values are freed at their last use; ``solver`` is
    ``"segments-K"`` and ``stats["checkpoints"]`` lists the kept boundary nodes.

  Raises:
    ValueError: ``n_segments`` is below 1.

  References:
    Chen, Xu, Zhang, Guestrin. Training deep nets with sublinear memory cost. 2016.

  Example:
    >>> import jaxremat
    >>> from jaxremat._src.segments import segment_schedule
    >>> # x -> f1 -> f2 -> f3 -> f4 -> b4 -> b3 -> b2 -> b1; b_i also reads f_i's input.
    >>> g = jaxremat.RematGraph.build(
    ...     mem=[1] * 9, cost=[1] * 9, inputs=[0],
    ...     edges=[(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (3, 5), (5, 6), (2, 6), (6, 7),
    ...            (1, 7), (7, 8), (0, 8)])
    >>> s = segment_schedule(g, 2)
    >>> s.stats["checkpoints"], s.computes
    ([2], [1, 2, 3, 4, 5, 6, 1, 7, 8])
  """
  if n_segments < 1:
    raise ValueError(f"n_segments={n_segments!r} must be at least 1; pass 1 to keep every value.")
  forward, backward, held = _split(graph)
  bounds = _segment_bounds(graph, forward, n_segments)
  kept = set(keep) | held | {v for v in graph.order if graph.nodes[v].attrs.get("effectful")}
  checkpoints: set[int] = set()
  for b in bounds[1:-1]:
    checkpoints |= _cut(graph, forward, b)
  kept |= checkpoints
  if keep_last:
    kept |= set(forward[bounds[-2] :])
  available = set(kept) | set(graph.inputs)
  computes = list(forward)
  for b in backward:
    for u in graph.compute_preds[b]:
      _recompute_into(graph, u, available, computes)
    computes.append(b)
    available.add(b)
  return schedule_from_computes(
    graph,
    computes,
    solver=f"segments-{n_segments}",
    stats={"checkpoints": sorted(checkpoints)},
  )


def forward_nodes(graph: RematGraph) -> set[int]:
  """Nodes of the forward pass: where nodes are marked ``backward``, the unmarked ones
  that the backward pass reads (directly or through other forward nodes) and that read
  nothing of it; every node if none is marked.

  A training step also holds nodes that are neither: the optimizer's update reads the
  gradients, and its step count reads only an input. XLA schedules them where it likes
  (the count first, on the H100 GPT step), and counted as forward they reach over every
  segment boundary, leaving no checkpoint to place. So do the program's constants (a
  causal mask, a broadcast scalar: nodes `trace` marks ``constant``): merged into one
  node per value (`capture.flatten_jaxpr`), each is read by every block.
  """
  backward = [node.id for node in graph.nodes if node.attrs.get("backward")]
  if not any("backward" in node.attrs for node in graph.nodes):
    return set(graph.order)
  read_by_backward = _reach(backward, graph.compute_preds)
  reads_backward = _reach(backward, graph.succs)
  constant = {v for v in graph.order if graph.nodes[v].attrs.get("constant")}
  forward = read_by_backward - reads_backward - set(backward) - set(graph.inputs) - constant
  # A graph whose marked backward nodes read no forward value: its unmarked nodes.
  return forward or {n.id for n in graph.nodes if not n.attrs.get("backward")} - set(graph.inputs)


def forward_products(graph: RematGraph) -> set[int]:
  """The forward nodes that compute a product or a convolution: the values
  ``jax.checkpoint_policies.dots_saveable`` saves."""
  return {
    v
    for v in forward_nodes(graph)
    if {graph.nodes[v].attrs.get("primitive"), *graph.nodes[v].attrs.get("fused", ())} & _PRODUCTS
  }


def _reach(start: Iterable[int], step: Sequence[Sequence[int]]) -> set[int]:
  """The nodes reached from ``start`` by one or more ``step``s (not ``start`` itself)."""
  seen: set[int] = set()
  stack = [u for v in start for u in step[v]]
  while stack:
    v = stack.pop()
    if v not in seen:
      seen.add(v)
      stack.extend(step[v])
  return seen


def _split(graph: RematGraph) -> tuple[list[int], list[int], set[int]]:
  """The forward part in the input order, the rest in that order, and the values the
  forward part reads that are not its own (constants): those are kept.

  Taken by position, the forward part would end at the first marked node, which XLA's
  order may put first: the kernel reversals of a convolution's gradient read only the
  parameters (the ConvMixer step on H100 had 4 forward nodes so).
  """
  order = graph.order
  if any("backward" in graph.nodes[v].attrs for v in order):
    forward = forward_nodes(graph)
    held = _reach(forward, graph.compute_preds) - forward - set(graph.inputs)
    first = forward | held
    return [v for v in order if v in first], [v for v in order if v not in first], held
  length = _forward_length(graph)
  return list(order[:length]), list(order[length:]), set()


def _forward_length(graph: RematGraph) -> int:
  """Without marks, the forward part ends before the compute where the baseline holds
  the most memory (all residuals live)."""
  base = baseline_schedule(graph)
  held_bytes, best_bytes, best_pos, pos = graph.resident_bytes, -1, 0, 0
  for (kind, _), after_bytes in zip(base.events, simulate(graph, base).timeline_bytes):
    if kind == "compute":
      if held_bytes > best_bytes:
        best_pos, best_bytes = pos, held_bytes
      pos += 1
    held_bytes = after_bytes
  return best_pos


def _cut(graph: RematGraph, forward: list[int], b: int) -> set[int]:
  """Forward values made before position ``b`` and read by forward nodes at or after it."""
  before = set(forward[:b])
  return {u for v in forward[b:] for u in graph.compute_preds[v] if u in before}


def _segment_bounds(graph: RematGraph, forward: list[int], n_segments: int) -> list[int]:
  """Cut positions 0 = b_0 < ... < b_k = len(forward): equal cost, nudged to small cuts."""
  n = len(forward)
  k = max(1, min(n_segments, n))
  prefix = [0.0]
  for v in forward:
    prefix.append(prefix[-1] + max(graph.cost[v], 1e-30))
  total = prefix[-1]
  bounds = [0]
  window = max(1, n // (4 * k))
  for s in range(1, k):
    ideal = next(p for p in range(n + 1) if prefix[p] >= total * s / k)
    lo, hi = max(bounds[-1] + 1, ideal - window), min(n - 1, ideal + window)
    if lo > hi:
      continue
    # The smallest checkpoint near the ideal split; ties go to the closest position.
    best = min(
      range(lo, hi + 1),
      key=lambda p: (sum(graph.mem[u] for u in _cut(graph, forward, p)), abs(p - ideal)),
    )
    bounds.append(best)
  bounds.append(n)
  return bounds


def _recompute_into(graph: RematGraph, target: int, available: set[int], computes: list[int]):
  """Appends to ``computes`` what it takes to make ``target`` available (post-order DFS)."""
  stack = [(target, False)]
  while stack:
    v, expanded = stack.pop()
    if v in available:
      continue
    if expanded:
      computes.append(v)
      available.add(v)
      continue
    stack.append((v, True))
    stack.extend((u, False) for u in reversed(graph.compute_preds[v]) if u not in available)
