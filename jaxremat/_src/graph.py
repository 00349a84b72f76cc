"""`RematGraph`: the computation graph every solver plans on (`jaxremat.graph/1`).

See shared/design/FORMATS.md. A node is one value-producing operation with the bytes
of its output (`mem`) and the time to compute it (`cost`). Inputs are resident: never
computed, never freed.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from jaxremat._src.errors import FormatError, InfeasibleBudgetError

GRAPH_FORMAT = "jaxremat.graph/1"
# Sizes are bytes in a signed 64-bit counter everywhere downstream (CP-SAT, numpy).
MAX_BYTES = 2**62
# Files and graphs above these limits are refused before any work that grows with them:
# no solver plans graphs this large, and reading them would take minutes.
MAX_NODES = 100_000
MAX_EDGES = 2_000_000
MAX_FILE_BYTES = 256 * 2**20

_NODE_KEYS = ("id", "name", "mem", "cost")


@dataclasses.dataclass(frozen=True)
class Node:
  """One graph node.

  Attributes:
    id: index of the node in ``RematGraph.nodes``.
    name: a human-readable label (source location, primitive, ...).
    mem: bytes of the node's output (sum over outputs for multi-output equations).
    cost: time to compute the node, in seconds or abstract units.
    attrs: every other key of the node's JSON object (primitive, shape, flops, ...).
  """

  id: int
  name: str
  mem: int
  cost: float
  attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    return {"id": self.id, "name": self.name, "mem": self.mem, "cost": self.cost, **self.attrs}


@dataclasses.dataclass(frozen=True)
class RematGraph:
  """A DAG of nodes with sizes and costs, as defined in FORMATS.md.

  Build one with :meth:`from_dict`, :meth:`load` or :func:`jaxremat.trace`; every
  constructor path validates. Derived views (``preds``, ``succs``, ...) are cached.
  """

  name: str
  nodes: tuple[Node, ...]
  edges: tuple[tuple[int, int], ...]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  order: tuple[int, ...]
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    _validate(self, source=f"graph {self.name!r}")

  def __repr__(self) -> str:
    return (
      f"RematGraph(name={self.name!r}, nodes={len(self.nodes)}, edges={len(self.edges)}, "
      f"inputs={len(self.inputs)}, outputs={len(self.outputs)}, "
      f"resident_bytes={self.resident_bytes})"
    )

  # -- derived views -------------------------------------------------------------------

  @property
  def n(self) -> int:
    return len(self.nodes)

  @functools.cached_property
  def mem(self) -> tuple[int, ...]:
    return tuple(node.mem for node in self.nodes)

  @functools.cached_property
  def cost(self) -> tuple[float, ...]:
    return tuple(node.cost for node in self.nodes)

  @functools.cached_property
  def preds(self) -> tuple[tuple[int, ...], ...]:
    """Sorted, de-duplicated predecessors of each node."""
    out: list[set[int]] = [set() for _ in self.nodes]
    for u, v in self.edges:
      out[v].add(u)
    return tuple(tuple(sorted(p)) for p in out)

  @functools.cached_property
  def succs(self) -> tuple[tuple[int, ...], ...]:
    """Sorted, de-duplicated successors of each node."""
    out: list[set[int]] = [set() for _ in self.nodes]
    for u, v in self.edges:
      out[u].add(v)
    return tuple(tuple(sorted(s)) for s in out)

  @functools.cached_property
  def is_input(self) -> tuple[bool, ...]:
    flags = [False] * self.n
    for i in self.inputs:
      flags[i] = True
    return tuple(flags)

  @functools.cached_property
  def compute_preds(self) -> tuple[tuple[int, ...], ...]:
    """Predecessors that are not inputs: the values a compute needs live."""
    inp = self.is_input
    return tuple(tuple(u for u in p if not inp[u]) for p in self.preds)

  @functools.cached_property
  def resident_bytes(self) -> int:
    """Bytes of the inputs, in memory from start to end."""
    return sum(self.nodes[i].mem for i in self.inputs)

  def compute_bytes(self, v: int) -> int:
    """Memory while v is computed with nothing else live: inputs, non-input preds, v."""
    return self.resident_bytes + self.mem[v] + sum(self.mem[u] for u in self.compute_preds[v])

  @functools.cached_property
  def bottleneck_node(self) -> int | None:
    """The node whose `compute_bytes` is largest (None for a graph of inputs only)."""
    return max(self.order, key=self.compute_bytes, default=None)

  @functools.cached_property
  def min_feasible_bytes(self) -> int:
    """A lower bound on the peak of every valid schedule: max of `compute_bytes`.

    Computing v needs its non-input predecessors and its own output in memory at once,
    on top of the resident inputs (FORMATS.md semantics).
    """
    v = self.bottleneck_node
    return self.resident_bytes if v is None else self.compute_bytes(v)

  def require_feasible(self, budget_bytes: int) -> None:
    """Raises `InfeasibleBudgetError` if ``budget_bytes`` is below `min_feasible_bytes`."""
    if budget_bytes < self.min_feasible_bytes:
      raise InfeasibleBudgetError(
        budget_bytes,
        self.min_feasible_bytes,
        f"the resident inputs plus the inputs and output of "
        f"{self.node_label(self.bottleneck_node)} alone",
      )

  @functools.cached_property
  def compute_once_nodes(self) -> tuple[int, ...]:
    """Nodes with side effects (attribute ``effectful``), in ``order``: never recomputed."""
    return tuple(v for v in self.order if self.nodes[v].attrs.get("effectful"))

  def with_pinned_effects(self) -> RematGraph:
    """The graph solvers plan on when some nodes must run exactly once, in order.

    Each effectful node's output moves into a new resident input of the same size (its
    own ``mem`` becomes 0), so that no plan gains memory by recomputing it, and edges
    chain the effectful nodes in ``order`` so that no plan reorders their effects. A
    schedule of this graph, with its recomputations of effectful nodes dropped
    (`jaxremat.schedule.keep_first_copies`), is a schedule of ``self`` whose peak is at
    most the planned one: the dropped copies' values live within the resident bytes.
    """
    once = self.compute_once_nodes
    nodes = list(self.nodes)
    inputs = list(self.inputs)
    for v in once:
      if self.mem[v]:
        pin = len(nodes)
        nodes.append(Node(pin, f"pinned output of {self.nodes[v].name}", self.mem[v], 0.0))
        inputs.append(pin)
        nodes[v] = dataclasses.replace(self.nodes[v], mem=0)
    chain = tuple(zip(once, once[1:]))
    return dataclasses.replace(
      self, nodes=tuple(nodes), edges=self.edges + chain, inputs=tuple(inputs)
    )

  def node_label(self, v: int) -> str:
    """``"#12 'dot_general @ model.py:41'"``: how errors and reports name a node."""
    return f"#{v} {self.nodes[v].name!r}"

  # -- serialization -------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return {
      "format": GRAPH_FORMAT,
      "name": self.name,
      "nodes": [node.to_dict() for node in self.nodes],
      "edges": [list(e) for e in self.edges],
      "inputs": list(self.inputs),
      "outputs": list(self.outputs),
      "order": list(self.order),
      "meta": dict(self.meta),
    }

  def save(self, path: str | os.PathLike) -> None:
    """Writes the graph as `jaxremat.graph/1` JSON (atomically)."""
    write_json_atomic(path, self.to_dict())

  @classmethod
  def from_dict(cls, data: Any, source: str = "<graph>") -> RematGraph:
    """Builds and validates a graph from the JSON object of FORMATS.md.

    Raises:
      FormatError: naming ``source``, the item and the problem.
    """
    if not isinstance(data, Mapping):
      raise FormatError(source, "", f"expected a JSON object, got {type(data).__name__}.")
    if data.get("format") != GRAPH_FORMAT:
      raise FormatError(source, "format", f"expected {GRAPH_FORMAT!r}, got {data.get('format')!r}.")
    raw_nodes = _get_list(data, "nodes", source)
    raw_edges = _get_list(data, "edges", source)
    for key, items, limit in (("nodes", raw_nodes, MAX_NODES), ("edges", raw_edges, MAX_EDGES)):
      if len(items) > limit:
        raise FormatError(
          source,
          key,
          f"has {len(items)} entries, more than the {limit} jaxremat plans; split the "
          "program (e.g. plan one layer or one scan body) or coarsen the graph.",
        )
    nodes = tuple(_parse_node(i, raw, source) for i, raw in enumerate(raw_nodes))
    n = len(nodes)
    edges = []
    for k, e in enumerate(raw_edges):
      if not (isinstance(e, list) and len(e) == 2 and all(_is_int(x) for x in e)):
        raise FormatError(source, f"edges[{k}]", f"expected a pair [u, v] of node ids, got {e!r}.")
      for x in e:
        if not 0 <= x < n:
          raise FormatError(source, f"edges[{k}]", f"node id {x} does not exist ({n} nodes).")
      edges.append((e[0], e[1]))
    inputs = _parse_ids(data, "inputs", n, source, required=False)
    outputs = _parse_ids(data, "outputs", n, source, required=False)
    name = data.get("name", os.path.splitext(os.path.basename(source))[0])
    if not isinstance(name, str):
      raise FormatError(source, "name", f"expected a string, got {name!r}.")
    meta = data.get("meta", {})
    if not isinstance(meta, Mapping):
      raise FormatError(source, "meta", f"expected a JSON object, got {type(meta).__name__}.")
    order = data.get("order")
    if order is None:
      order = topological_order(n, edges, set(inputs), source=source)
    else:
      order = _parse_ids(data, "order", n, source, required=True)
    try:
      return cls(name, nodes, tuple(edges), tuple(inputs), tuple(outputs), tuple(order), dict(meta))
    except FormatError as e:
      raise FormatError(source, e.item, e.problem) from None

  @classmethod
  def load(cls, path: str | os.PathLike) -> RematGraph:
    """Reads a `jaxremat.graph/1` file; errors name the file."""
    return cls.from_dict(read_json(path), source=os.fspath(path))

  @classmethod
  def build(
    cls,
    mem: Sequence[int],
    cost: Sequence[float],
    edges: Sequence[tuple[int, int]],
    *,
    inputs: Sequence[int] = (),
    outputs: Sequence[int] | None = None,
    order: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    name: str = "graph",
  ) -> RematGraph:
    """Convenience constructor for tests and synthetic graphs.

    ``outputs`` defaults to the sinks; ``order`` to the smallest-id topological order.
    """
    n = len(mem)
    nodes = tuple(
      Node(i, names[i] if names else str(i), int(mem[i]), float(cost[i])) for i in range(n)
    )
    edges = tuple((int(u), int(v)) for u, v in edges)
    if outputs is None:
      has_succ = {u for u, _ in edges}
      outputs = [v for v in range(n) if v not in has_succ and v not in set(inputs)]
    if order is None:
      order = topological_order(n, edges, set(inputs))
    return cls(name, nodes, edges, tuple(inputs), tuple(outputs), tuple(order))


# -- validation ------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _get_list(data: Mapping, key: str, source: str) -> list:
  if key not in data:
    raise FormatError(source, key, "is missing.")
  value = data[key]
  if not isinstance(value, list):
    raise FormatError(source, key, f"expected a list, got {type(value).__name__}.")
  return value


def _parse_ids(data: Mapping, key: str, n: int, source: str, required: bool) -> list[int]:
  if key not in data and not required:
    return []
  ids = _get_list(data, key, source)
  for k, x in enumerate(ids):
    if not _is_int(x) or not 0 <= x < n:
      raise FormatError(source, f"{key}[{k}]", f"{x!r} is not a node id (0..{n - 1}).")
  return list(ids)


def _parse_node(i: int, raw: Any, source: str) -> Node:
  item = f"nodes[{i}]"
  if not isinstance(raw, Mapping):
    raise FormatError(source, item, f"expected a JSON object, got {type(raw).__name__}.")
  for key in ("id", "mem", "cost"):
    if key not in raw:
      raise FormatError(source, item, f"the required key {key!r} is missing.")
  if raw["id"] != i or not _is_int(raw["id"]):
    raise FormatError(
      source, f"{item}.id", f"ids must equal the node's index {i}, got {raw['id']!r}."
    )
  name = raw.get("name", str(i))
  if not isinstance(name, str):
    raise FormatError(source, f"{item}.name", f"expected a string, got {name!r}.")
  attrs = {k: v for k, v in raw.items() if k not in _NODE_KEYS}
  return Node(i, name, raw["mem"], raw["cost"], attrs)


def _check_node_values(node: Node, source: str) -> None:
  item = f"nodes[{node.id}]"
  mem, cost = node.mem, node.cost
  if not _is_int(mem) or not 0 <= mem < MAX_BYTES:
    raise FormatError(
      source, f"{item}.mem", f"expected a non-negative integer byte count below 2**62, got {mem!r}."
    )
  if (
    isinstance(cost, bool)
    or not isinstance(cost, (int, float))
    or not math.isfinite(cost)
    or cost < 0
  ):
    raise FormatError(
      source, f"{item}.cost", f"expected a finite non-negative number, got {cost!r}."
    )


def _validate(g: RematGraph, source: str) -> None:
  n = len(g.nodes)
  for i, node in enumerate(g.nodes):
    if node.id != i:
      raise FormatError(
        source, f"nodes[{i}].id", f"ids must equal the node's index {i}, got {node.id!r}."
      )
    _check_node_values(node, source)
  # Per-node bounds do not bound the sums that peaks and durations are made of.
  if sum(node.mem for node in g.nodes) >= MAX_BYTES:
    raise FormatError(
      source, "nodes", "the sizes (mem) add up to 2**62 bytes or more; sizes are bytes of one step."
    )
  if not math.isfinite(sum(node.cost for node in g.nodes)):
    raise FormatError(
      source, "nodes", "the costs add up to more than a float can hold; rescale them."
    )
  inputs = set(g.inputs)
  if len(inputs) != len(g.inputs):
    raise FormatError(source, "inputs", "lists a node more than once.")
  if len(set(g.outputs)) != len(g.outputs):
    raise FormatError(source, "outputs", "lists a node more than once.")
  for k, (u, v) in enumerate(g.edges):
    if not (0 <= u < n and 0 <= v < n):
      raise FormatError(
        source, f"edges[{k}]", f"edge {[u, v]} names a node that does not exist ({n} nodes)."
      )
    if u == v:
      raise FormatError(
        source, f"edges[{k}]", f"edge {[u, v]} is a self-loop; the graph must be a DAG."
      )
    if v in inputs:
      raise FormatError(
        source,
        f"edges[{k}]",
        f"edge {[u, v]} reads into input node {v}; inputs are never computed.",
      )
  topological_order(n, g.edges, inputs, source=source)  # raises on a cycle
  expected = [v for v in range(n) if v not in inputs]
  if sorted(g.order) != expected:
    raise FormatError(
      source,
      "order",
      "must list every non-input node exactly once "
      f"({len(expected)} non-input nodes, got {len(g.order)} entries).",
    )
  position = {v: k for k, v in enumerate(g.order)}
  for k, (u, v) in enumerate(g.edges):
    if u not in inputs and position[u] > position[v]:
      raise FormatError(
        source,
        "order",
        f"is not topological: node {v} comes before its predecessor {u} (edges[{k}]).",
      )


def topological_order(
  n: int,
  edges: Sequence[tuple[int, int]],
  inputs: set[int] | frozenset = frozenset(),
  source: str = "<graph>",
  priority: Sequence[float] | None = None,
) -> list[int]:
  """The topological order of the non-input nodes (Kahn) that takes, of the nodes ready,
  the one of least ``priority`` (default: its id), ties by id.

  Raises:
    FormatError: if the edges contain a cycle (naming one node on it).
  """
  succs: list[list[int]] = [[] for _ in range(n)]
  indeg = [0] * n
  for u, v in edges:
    succs[u].append(v)
    indeg[v] += 1
  rank = priority if priority is not None else range(n)
  heap = [(rank[v], v) for v in range(n) if indeg[v] == 0]
  heapq.heapify(heap)
  out = []
  while heap:
    _, u = heapq.heappop(heap)
    out.append(u)
    for v in succs[u]:
      indeg[v] -= 1
      if indeg[v] == 0:
        heapq.heappush(heap, (rank[v], v))
  if len(out) != n:
    stuck = min(v for v in range(n) if indeg[v] > 0)
    raise FormatError(
      source, "edges", f"contain a cycle through node {stuck}; the graph must be a DAG."
    )
  return [v for v in out if v not in inputs]


# -- JSON files ------------------------------------------------------------------------


def read_text(path: str | os.PathLike, expected: str = "a JSON file") -> str:
  """Reads a UTF-8 text file, turning every failure into a `FormatError` naming the file."""
  source = os.fspath(path)
  try:
    if os.path.getsize(path) > MAX_FILE_BYTES:
      raise FormatError(
        source,
        "",
        f"is {os.path.getsize(path)} bytes, more than the {MAX_FILE_BYTES // 2**20} MiB "
        f"jaxremat reads; expected {expected}.",
      )
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError as e:
    raise FormatError(source, "", f"cannot be read: {e.strerror or e}.") from None
  except UnicodeDecodeError:
    raise FormatError(source, "", f"is not UTF-8 text; expected {expected}.") from None


def parse_json(text: str, source: str) -> Any:
  """Parses JSON text (no NaN or Infinity), errors naming ``source`` and the position."""
  try:
    return json.loads(text, parse_constant=_reject_constant)
  except json.JSONDecodeError as e:
    raise FormatError(
      source, f"line {e.lineno} column {e.colno}", f"is not valid JSON: {e.msg}."
    ) from None
  except RecursionError:
    raise FormatError(source, "", "is nested too deeply to be a graph, schedule or plan.") from None
  except ValueError as e:
    if "integer string conversion" in str(e):
      raise FormatError(
        source, "", f"holds an integer of more than {sys.get_int_max_str_digits()} digits."
      ) from None
    raise FormatError(source, "", f"is not valid JSON: {e}.") from None


def read_json(path: str | os.PathLike) -> Any:
  """Reads a JSON file, turning every failure into a `FormatError` naming the file."""
  return parse_json(read_text(path), os.fspath(path))


def _reject_constant(name: str):
  # JSON has no NaN or Infinity; Python's json accepts them unless told not to.
  raise ValueError(f"{name} is not a JSON number")


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
  """Writes JSON to ``path`` through a temporary file and a rename (never half-written)."""
  path = os.fspath(path)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(data, f, separators=(",", ":"), allow_nan=False)
      f.write("\n")
    os.replace(tmp, path)
  except OSError as e:  # name the file the caller asked for, not the temporary one
    raise OSError(e.errno, f"cannot write {path}: {e.strerror}", path) from None
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
