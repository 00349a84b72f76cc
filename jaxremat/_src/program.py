"""The `Program`: a flat jaxpr and the `RematGraph` over it, and how it is built.

`build_program` groups the flat jaxpr's equations into nodes (`fusion`, or the target
compiler's answer, `hlo_model`), sizes each node by the bytes XLA keeps, and costs it
with `jaxremat._src.costs`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import networkx as nx

from jaxremat._src import compat, costs, hlo_model
from jaxremat._src.backends import backend_facts
from jaxremat._src.fusion import (
  FUSIBLE_PRIMITIVES,
  HIGHER_ORDER_PRIMITIVES,
  group_equations,
  internal_bytes,
  pool_gradient_buffers,
  workspace_bytes,
)
from jaxremat._src.graph import Node, RematGraph, topological_order
from jaxremat._src.loops import LoopRewrite
from jaxremat._src.measure import Measurement
from jaxremat._src.order import memory_minimizing_order
from jaxremat._src.signature import CallSignature, OutputSplit, abstract
from jaxremat._src.targets import Target

# -- the Program: a flat jaxpr and the graph over it --------------------------------------


@dataclasses.dataclass(frozen=True)
class Program:
  """A traced function: its flat jaxpr and the graph whose nodes group its equations.

  Attributes:
    jaxpr: the flat ``ClosedJaxpr``: jit/pjit, custom_jvp_call, custom_vjp_call and
      checkpoint are inlined; scan, while and cond stay single equations.
    graph: the `RematGraph`. Nodes ``0 .. len(jaxpr.invars) - 1`` are the invars,
      then one node per constvar, then the equation nodes in jaxpr order; its ``order``
      is the order the model takes XLA to run them in (the compiler's schedule, or the
      one that holds least).
    node_eqns: per node, the ascending indices into ``jaxpr.jaxpr.eqns`` it stands
      for; ``()`` for input nodes. Every equation is in exactly one node.
    node_outvars: per node, the vars its equations produce that other nodes or the
      function's outputs read (for an input node, its invar or constvar).
    signature: how a call splits into the jaxpr's invars (its traced leaves) and the
      static values baked into the jaxpr (`jaxremat._src.signature`); None for a jaxpr
      read from text.
    outputs: which output leaves are the jaxpr's outvars and which static values are
      returned as they are; None for a jaxpr read from text.
    baseline: the target compiler's figures for the step, with its donation, where
      tracing compiled it (``model="compiler"``); else None.
    loops: the loops that store less for the backward pass than the step as written
      (`loops.shed_residuals`): what each stores and recomputes.
    executable: the compile that gave ``baseline`` (the step, each equation under a
      `jax.named_scope` of its own), which runs as the step does on the flat inputs; else
      None.
  """

  jaxpr: Any
  graph: RematGraph
  node_eqns: tuple[tuple[int, ...], ...]
  node_outvars: tuple[tuple[Any, ...], ...]
  signature: CallSignature | None = None
  outputs: OutputSplit | None = None
  baseline: Measurement | None = None
  loops: tuple[LoopRewrite, ...] = ()
  executable: Any = dataclasses.field(default=None, compare=False, repr=False)

  @property
  def dynamic_mask(self) -> tuple[bool, ...]:
    """Per leaf of the traced ``(args, kwargs)``, whether it is a jaxpr invar."""
    return self.signature.dynamic_mask if self.signature else ()

  @property
  def static_leaves(self) -> tuple[Any, ...]:
    """The static leaves of the traced ``(args, kwargs)``, in order."""
    return self.signature.static_leaves if self.signature else ()

  @property
  def arg_tree(self) -> Any:
    """Treedef of the full ``(args, kwargs)`` the function was traced with."""
    return self.signature.arg_tree if self.signature else None

  def flatten_args(self, *args, **kwargs) -> list[Any]:
    """The jaxpr invar values for a call with the traced argument structure."""
    dynamic = self.signature.dynamic_leaves(args, kwargs)
    for k, (x, var) in enumerate(zip(dynamic, self.jaxpr.jaxpr.invars, strict=True)):
      # A jaxpr evaluated on other shapes or dtypes may broadcast or cast silently.
      spec = abstract(x)
      shape, dtype = spec.shape, spec.dtype
      if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
      if shape != var.aval.shape or dtype != var.aval.dtype:
        raise ValueError(
          f"Argument {self.graph.nodes[k].name} has shape {shape} and dtype {dtype}, but "
          f"the function was traced with shape {var.aval.shape} and dtype {var.aval.dtype}; "
          "trace it again for these arguments (jaxremat.optimize plans per shape and dtype)."
        )
    return dynamic

  def unflatten_outputs(self, flat_outputs: Sequence[Any]) -> Any:
    """The function's output pytree from the values of the jaxpr outvars."""
    return self.outputs.merge(list(flat_outputs))

  def __call__(self, *args, **kwargs) -> Any:
    """Evaluates the flat jaxpr: the traced function's result, for checking."""
    flat = compat.eval_closed_jaxpr(self.jaxpr, *self.flatten_args(*args, **kwargs))
    return self.unflatten_outputs(flat)


# -- building the graph --------------------------------------------------------------------


def build_program(
  closed: Any,
  *,
  fold: bool = True,
  costs_mode: str = "xla",
  name: str = "program",
  arg_names: Sequence[str] | None = None,
  signature: CallSignature | None = None,
  output_split: OutputSplit | None = None,
  cache_dir: str | os.PathLike | None = None,
  cost_time_limit: float | None = None,
  workspace: bool = False,
  printed_jaxpr: str | None = None,
  target: Target | None = None,
  compiled: hlo_model.CompiledValues | None = None,
) -> Program:
  """Builds the `Program` of an already flat ``ClosedJaxpr`` (see `trace.trace_program`).

  ``printed_jaxpr`` is kept in the graph's meta for people (default: ``str(closed)``);
  ``target`` is the device planned for (None: this machine's); ``compiled``, where
  given, is what the target compiler keeps of ``closed``'s equations (`hlo_model`),
  which then decides the grouping, sizes and order in place of `fusion`'s rules.
  """
  platform = None if target is None else target.platform
  jaxpr = closed.jaxpr
  n_in = len(jaxpr.invars) + len(jaxpr.constvars)
  facts = backend_facts(platform)
  groups, duplicated, materialized = group_equations(
    jaxpr, fold, facts.reductions_duplicate_producers, compiled
  )
  producer: dict[Any, int] = {}
  for i, v in enumerate([*jaxpr.invars, *jaxpr.constvars]):
    producer[v] = i
  for g, eqn_ids in enumerate(groups):
    for k in eqn_ids:
      for v in jaxpr.eqns[k].outvars:
        if not isinstance(v, compat.DropVar):
          producer[v] = n_in + g
  n = n_in + len(groups)
  edges: set[tuple[int, int]] = set()
  exported: list[set[Any]] = [set() for _ in range(n)]
  for g, eqn_ids in enumerate(groups):
    v_node = n_in + g
    for k in eqn_ids:
      for v in jaxpr.eqns[k].invars:
        if isinstance(v, compat.Literal):
          continue
        u = producer[v]
        if u != v_node:
          edges.add((u, v_node))
          exported[u].add(v)
  node_of = {k: n_in + g for g, eqn_ids in enumerate(groups) for k in eqn_ids}
  if compiled is not None:
    _add_compiled_reads(edges, node_of, compiled.read_for)
  # XLA recomputes a duplicated value inside each reader's fusion: its operands, not
  # the value, stay live until the last reader. In root order, so that the sources of a
  # chain of duplicated values reach the readers at its end.
  for d in sorted(duplicated):
    d_node = n_in + d
    sources = [u for u, w in edges if w == d_node]
    sinks = [w for u, w in edges if u == d_node]
    edges.update((u, w) for u in sources for w in sinks)
  remakes = {} if compiled is None else _remade_reads(edges, node_of, compiled)
  outputs, aliased = [], set()
  for i, v in enumerate(jaxpr.outvars):
    if isinstance(v, compat.Literal):
      continue
    u = producer[v]
    exported[u].add(v)
    if u not in outputs:
      outputs.append(u)
    if compiled is not None and i in compiled.aliased_outputs:
      aliased.add(u)
  node_outvars: list[tuple[Any, ...]] = [(v,) for v in [*jaxpr.invars, *jaxpr.constvars]]
  for g, eqn_ids in enumerate(groups):
    outs = [
      v
      for k in eqn_ids
      for v in jaxpr.eqns[k].outvars
      if not isinstance(v, compat.DropVar) and v in exported[n_in + g]
    ]
    node_outvars.append(tuple(outs))
  eqn_costs = costs.equation_costs(
    jaxpr.eqns, mode=costs_mode, cache_dir=cache_dir, time_limit_s=cost_time_limit, target=target
  )
  roof = None if costs_mode == "shape" else costs.roofline(cache_dir, target)
  # A value XLA computes inside its readers' fusions is not read from memory: its readers
  # read what it reads, the values XLA keeps. In root order, for chains of such values.
  kept_reads: dict[Any, frozenset[Any]] = {}
  for g in sorted(duplicated):
    made = {v for k in groups[g] for v in jaxpr.eqns[k].outvars}
    reads = frozenset().union(
      *(
        kept_reads.get(v, {v})
        for k in groups[g]
        for v in jaxpr.eqns[k].invars
        if not isinstance(v, compat.Literal) and v not in made
      )
    )
    kept_reads.update(dict.fromkeys(made, reads))
  # XLA computes a duplicated elementwise value inside each reader's fusion, so each
  # reader pays for it (XLA's cost analysis counts it once per reader) and the value costs
  # nothing itself. Duplicated work that is not all elementwise is paid once, by its own
  # node (no product is duplicated: `fusion.group_equations`).
  per_reader = {
    d
    for d in duplicated
    if all(jaxpr.eqns[k].primitive.name in FUSIBLE_PRIMITIVES for k in groups[d])
  }
  inlined: list[set[int]] = [set() for _ in groups]
  for g, eqn_ids in enumerate(groups):  # root order, for chains of duplicated values
    for v in (v for k in eqn_ids for v in jaxpr.eqns[k].invars):
      d = -1 if isinstance(v, compat.Literal) else producer[v] - n_in
      if d != g and d in per_reader:
        inlined[g] |= set(groups[d]) | inlined[d]
  arg_names = list(arg_names or [f"arg{i}" for i in range(len(jaxpr.invars))])
  # A partitioned step's compiled program is one device's part: each equation does the
  # share of its work that the least of its values it holds or reads is of the whole.
  fractions = (
    {}
    if compiled is None or compiled.partitions == 1
    else _device_fractions(jaxpr, materialized, compiled.argument_bytes)
  )
  nodes = []
  for i, v in enumerate(jaxpr.invars):
    held = None if compiled is None else compiled.argument_bytes[i]
    nodes.append(_input_node(i, arg_names[i], v, "argument", held))
  for j, v in enumerate(jaxpr.constvars):
    nodes.append(_input_node(len(jaxpr.invars) + j, f"const[{j}]", v, "constant"))
  for g, eqn_ids in enumerate(groups):
    nodes.append(
      _eqn_node(
        n_in + g,
        [jaxpr.eqns[k] for k in eqn_ids],
        eqn_ids,
        node_outvars[n_in + g],
        [eqn_costs[k] for k in eqn_ids],
        None if g in per_reader else [eqn_costs[k] for k in sorted(inlined[g])],
        g in duplicated,
        materialized,
        kept_reads,
        None if compiled is None else compiled.scratch,
        roof,
        fractions,
      )
    )
  for w, remade in remakes.items():
    nodes[w] = dataclasses.replace(nodes[w], attrs={**nodes[w].attrs, "remakes": remade})
  if compiled is not None and compiled.collective_bytes:
    link = costs.link_bytes_per_s(target, roof.bytes_per_s if roof else None)
    for g, eqn_ids in enumerate(groups):
      sent = sum(compiled.collective_bytes.get(k, 0) for k in eqn_ids)
      if sent:
        node = nodes[n_in + g]
        attrs = {**node.attrs, "collective_bytes": sent}
        nodes[n_in + g] = dataclasses.replace(node, cost=node.cost + sent / link, attrs=attrs)
  # Buffers XLA makes before the program runs: read from the compiler's program where it
  # is at hand, else XLA:CPU's rule for max pool gradients.
  iotas, indices, hoisted = (
    pool_gradient_buffers(jaxpr, groups)
    if facts.pool_gradient_buffers_at_start and compiled is None
    else ({}, {}, set())
  )
  if compiled is not None:
    for k, size in compiled.constants.items():
      g = node_of[k] - n_in
      iotas[g] = iotas.get(g, 0) + size
      indices.setdefault(g, 0)
    hoisted = {node_of[k] - n_in for k in compiled.hoisted}
  for g, extra in iotas.items():
    node = nodes[n_in + g]
    scratch = node.attrs.get("workspace_bytes", 0) + indices[g]
    attrs = {**node.attrs, "constant_bytes": extra, "workspace_bytes": scratch}
    nodes[n_in + g] = dataclasses.replace(node, attrs=attrs)
  for k, (u, readers) in ({} if compiled is None else compiled.constants_for).items():
    node = nodes[node_of[k]]
    attrs = {"constants_with": [node_of[u]], "constants_for": sorted({node_of[w] for w in readers})}
    nodes[node_of[k]] = dataclasses.replace(node, attrs={**node.attrs, **attrs})
  for g in hoisted:
    node = nodes[n_in + g]
    nodes[n_in + g] = dataclasses.replace(node, attrs={**node.attrs, "allocated_at_start": True})
  for v in aliased:  # written into a donated argument's buffer (`xla_memory.held_apart`)
    nodes[v] = dataclasses.replace(nodes[v], attrs={**nodes[v].attrs, "aliased_output": True})
  for k, (size, dying) in ({} if compiled is None else compiled.writes_into).items():
    # where the node's compute frees one of these, XLA writes it there (`xla_memory`)
    into = sorted({node_of[u] for u in dying} - {node_of[k]})
    if into:
      node = nodes[node_of[k]]
      written = [*node.attrs.get("writes_into", []), [size, into]]
      nodes[node_of[k]] = dataclasses.replace(node, attrs={**node.attrs, "writes_into": written})
  for k in () if compiled is None else compiled.off_chip & node_of.keys():
    node = nodes[node_of[k]]
    nodes[node_of[k]] = dataclasses.replace(node, attrs={**node.attrs, "off_chip": True})
  for v in _constants(n_in, len(nodes), edges):
    nodes[v] = dataclasses.replace(nodes[v], attrs={**nodes[v].attrs, "constant": True})
  node_eqns = [() for _ in range(n_in)] + [tuple(g) for g in groups]
  if workspace:
    nodes, edges, outputs, node_eqns, node_outvars = _add_workspace_nodes(
      n_in, nodes, edges, outputs, node_eqns, node_outvars
    )
  graph = RematGraph(
    name=name,
    nodes=tuple(nodes),
    edges=tuple(sorted(edges)),
    inputs=tuple(range(n_in)),
    outputs=tuple(outputs),
    order=tuple(range(n_in, len(nodes)))
    if compiled is None
    else _compiled_order(n_in, len(nodes), edges, node_eqns, compiled.position),
    meta={
      "source": "jaxremat.trace",
      "jaxpr": str(closed) if printed_jaxpr is None else printed_jaxpr,
      "fold": fold,
      "model": "unfolded" if not fold else "rules" if compiled is None else "compiler",
      "workspace": workspace,
      "costs": costs_mode,
      "backend": platform or compat.backend_name(),
      "target": None if target is None else target.name,
      "jax_version": jax.__version__,
      "n_eqns": len(jaxpr.eqns),
      "roofline": costs.roofline_meta(costs_mode, cache_dir, target),
      "on_chip_bytes": _on_chip_bytes(target, compiled),
      # read from the compiler's program: where XLA holds values in outputs' buffers
      "outputs_hold_temporaries": compiled is not None and facts.outputs_hold_temporaries,
    },
  )
  if fold and compiled is None and not workspace:
    # XLA's scheduler runs a step in an order that holds little, not in the jaxpr's: on
    # the demo's tanh MLP step with SGD, the jaxpr's order holds every layer's gradient
    # until the updates at its end, x1.71 of XLA:CPU's peak in the model; this order
    # x1.05 (the examples' own orders are already their lowest). Scratch nodes stay
    # right before their readers in the jaxpr's order.
    graph = dataclasses.replace(graph, order=_order_holding_least(graph))
  return Program(
    jaxpr=closed,
    graph=graph,
    node_eqns=tuple(node_eqns),
    node_outvars=tuple(node_outvars),
    signature=signature,
    outputs=output_split,
    baseline=None if compiled is None else compiled.measurement,
    executable=None if compiled is None else compiled.executable,
  )


def _device_fractions(
  jaxpr: Any, materialized: dict[Any, int], argument_bytes: Sequence[int]
) -> dict[Any, float]:
  """Of a partitioned step, the share of each input and kept value that one device holds
  (its compiled bytes over its whole bytes)."""
  held = {**dict(zip(jaxpr.invars, argument_bytes, strict=True)), **materialized}
  return {v: b / compat.aval_bytes(v.aval) for v, b in held.items() if compat.aval_bytes(v.aval)}


def _order_holding_least(graph: RematGraph) -> tuple[int, ...]:
  """`order.memory_minimizing_order` of ``graph``, with its effects in program order."""
  once = graph.compute_once_nodes
  edges = tuple(sorted({*graph.edges, *zip(once, once[1:])}))
  return memory_minimizing_order(dataclasses.replace(graph, edges=edges))


def _on_chip_bytes(target: Target | None, compiled: hlo_model.CompiledValues | None) -> int:
  """The bytes of temporaries the compiler keeps on chip for this program: what the
  compiled step held there where it evicted some (XLA:TPU gives some programs less than
  others: a graph network's step on TPU v5e 57 MiB, where the target's probe keeps 108),
  else what the target keeps (`Target.on_chip_bytes`) or more, as the step held (112 MiB
  with other temporaries in HBM: the MLP and VGG16 examples at 8x their batch)."""
  kept = 0 if target is None else target.on_chip_bytes()
  if compiled is None:
    return kept
  if compiled.evicts_from_chip:
    return compiled.on_chip_peak_bytes
  return max(kept, compiled.on_chip_peak_bytes)


def _add_compiled_reads(
  edges: set[tuple[int, int]], node_of: dict[int, int], read_for: dict[int, set[int]]
) -> None:
  """Edges from each kept equation's node to the nodes of the equations whose compiled
  instructions read its buffers, so that the node stays live until they run. XLA fuses
  cheap producers into their readers: XLA:CPU and XLA:TPU recompute a batch norm's
  ``x - mean`` (and its ReLU) from the convolution's output inside later fusions, those
  of the backward pass too, and so hold that output until then (the ResNet step on
  XLA:CPU, and the Flax CNN's on TPU v5e: 7 and 16 MiB that the jaxpr's reads do not
  show). XLA:GPU computes the zeros that a max pool's gradient scatters into beside the
  forward pass's ReLU and holds them to the backward pass (4 of the VGG16 step's 45 MiB
  on H100). Only readers after the equation in the program's order: an edge must not
  reorder the graph or close a cycle."""
  reach = nx.DiGraph(edges)
  for k, later in sorted(read_for.items()):
    u = node_of[k]
    for w in sorted({node_of[r] for r in later if r > k} - {u}):
      if (u, w) not in edges and not (w in reach and u in reach and nx.has_path(reach, w, u)):
        edges.add((u, w))
        reach.add_edge(u, w)


def _remade_reads(
  edges: set[tuple[int, int]], node_of: dict[int, int], compiled: hlo_model.CompiledValues
) -> dict[int, list[int]]:
  """A node whose compiled instructions compute a kept value again from its operands,
  reading none of its buffers (`CompiledValues.remade_for`), reads those operands instead
  of the value, which need not live until that node runs. Returns, per such node, the
  nodes it computes again (the emitted program evaluates them inside it, as XLA does).

  The value is read where the edges say, those through values XLA duplicates into their
  readers too (GroupNorm's reshape of a biased convolution output: the Flax and Equinox
  GroupNorm CNNs read x1.39 and x1.24 of XLA:CPU's peak with the bias add held to the
  backward pass). The operands are the value's own, as the edges read before any of
  this rewiring, and those of the values it reads that the node computes again as well:
  read after it, a chain of remakes handed each node the operands of every node before
  it (a bfloat16 MLP-Mixer's layer norm gradients on TPU v5e: the last one read 131
  nodes, and no schedule of the model went below 69.76 MiB, where per-block
  `jax.checkpoint` measured 61.01)."""
  sources_of: dict[int, list[int]] = {}
  for p, w in sorted(edges):
    sources_of.setdefault(w, []).append(p)
  made_by: dict[int, set[int]] = {}
  for k, remakers in sorted(compiled.remade_for.items()):
    u = node_of[k]
    reading = {node_of[r] for r in compiled.read_for.get(k, ()) if r in node_of}
    for w in {node_of[r] for r in remakers if r in node_of} - reading - {u}:
      made_by.setdefault(w, set()).add(u)
  remakes: dict[int, list[int]] = {}
  for w, made in sorted(made_by.items()):
    # What ``w`` computes again may read another value it computes again (GroupNorm's
    # ``x - mean`` of a bias add): it reads the operands of both.
    stack, seen = sorted(u for u in made if (u, w) in edges), set()
    while stack:
      u = stack.pop()
      if u in seen:
        continue
      seen.add(u)
      edges.discard((u, w))
      remakes.setdefault(w, []).append(u)
      for p in sources_of.get(u, []):
        if p in made:
          stack.append(p)
        elif p != w:
          edges.add((p, w))
  return {w: sorted(us) for w, us in remakes.items()}


def _constants(n_in: int, n_nodes: int, edges: set[tuple[int, int]]) -> set[int]:
  """Equation nodes that read no input, even indirectly (a causal mask, a broadcast
  scalar): constants of the program, which solvers may hold or remake at any time."""
  succs: dict[int, list[int]] = {}
  for u, w in edges:
    succs.setdefault(u, []).append(w)
  reached, stack = set(range(n_in)), list(range(n_in))
  while stack:
    for w in succs.get(stack.pop(), ()):
      if w not in reached:
        reached.add(w)
        stack.append(w)
  return set(range(n_in, n_nodes)) - reached


def _compiled_order(
  n_in: int,
  n: int,
  edges: set[tuple[int, int]],
  node_eqns: Sequence[Sequence[int]],
  position: dict[int, int],
) -> tuple[int, ...]:
  """The nodes in the order the compiler's schedule computes them (`hlo_model`).

  XLA's scheduler orders a step for memory, and the jaxpr's order can hold far more (the
  MobileNet example on TPU v5e: 1.61x the compiler's peak in jaxpr order, 0.89x in the
  compiler's). A node the compiler keeps no buffer for goes right before its first reader;
  one that nothing kept reads (an output the compiler computes inside another
  instruction) right after its operands, not at the end, holding them all along.
  Where the compiler makes a value after one of its readers, `_give_way` mends the keys.
  """
  readers: list[list[int]] = [[] for _ in range(n)]
  producers: list[list[int]] = [[] for _ in range(n)]
  for u, w in edges:
    readers[u].append(w)
    producers[w].append(u)
  key = [-math.inf] * n_in + [math.inf] * (n - n_in)
  for v in range(n - 1, n_in - 1, -1):  # readers have larger ids
    made = [position[k] for k in node_eqns[v] if k in position]
    key[v] = min(made) if made else min((key[w] - 0.5 for w in readers[v]), default=math.inf)
  for v in range(n_in, n):
    if key[v] == math.inf:
      key[v] = max((key[u] + 0.5 for u in producers[v] if u >= n_in), default=-0.5)
  _give_way(key, readers, producers)
  return tuple(topological_order(n, sorted(edges), set(range(n_in)), priority=key))


def _give_way(key: list[float], readers: list[list[int]], producers: list[list[int]]) -> None:
  """Makes ``key`` ordered along every edge, in place. For each value keyed after one of
  its readers, either the value, with those of its producers keyed after the reader, takes
  the reader's key, or the reader, with those of its readers keyed before the value, takes
  the value's: whichever changes fewer keys. Neither puts another edge out of order.

  Left out of order, the later key held back the earlier node and all nodes after it,
  and the nodes keyed in between ran first: XLA:GPU computes each step's backward sum of
  an unrolled LSTM again inside an early fusion and keeps a buffer of it only for the late
  weight gradients, and each step's 1.25 MiB gradient product ran in the forward pass
  (x1.32 of the compiler's peak, x1.03 so). Moving the value always would take the VGG16
  example's forward pass to its loss's gather, which XLA:TPU starts before the logits
  it reads (x1.03 on TPU v5e, x0.99 so)."""
  for u in range(len(key)):
    for w in readers[u]:
      if key[u] <= key[w]:
        continue
      early = _reached(u, producers, lambda x, bound=key[w]: key[x] > bound)
      late = _reached(w, readers, lambda x, bound=key[u]: key[x] < bound)
      moved, to = (early, key[w]) if len(early) <= len(late) else (late, key[u])
      for x in moved:
        key[x] = to


def _reached(start: int, step: list[list[int]], within: Callable[[int], bool]) -> set[int]:
  """``start`` and the nodes reached from it along ``step`` through nodes ``within``."""
  seen, stack = {start}, [start]
  while stack:
    for x in step[stack.pop()]:
      if x not in seen and within(x):
        seen.add(x)
        stack.append(x)
  return seen


# Node attributes that name other nodes.
_NODE_LISTS = ("remakes", "constants_with", "constants_for")


def _add_workspace_nodes(n_in, nodes, edges, outputs, node_eqns, node_outvars):
  """Puts a scratch node right before each node with ``workspace_bytes``.

  The scratch node has no equations and no values; its only reader is the node it
  serves, so under FORMATS.md semantics it is live exactly while that node computes
  (and again whenever a schedule recomputes it), as XLA's scratch buffers are.
  """
  new_id: dict[int, int] = {v: v for v in range(n_in)}
  out_nodes = list(nodes[:n_in])
  out_eqns = list(node_eqns[:n_in])
  out_vars = list(node_outvars[:n_in])
  scratch_edges = []
  for node in nodes[n_in:]:
    scratch = node.attrs.get("workspace_bytes", 0)
    if scratch:
      w = len(out_nodes)
      attrs = {
        "primitive": "workspace",
        "shapes": [],
        "dtypes": [],
        "flops": 0.0,
        "bytes_accessed": 0.0,
        "source": node.attrs["source"],
        "name_stack": node.attrs["name_stack"],
        "backward": node.attrs["backward"],
        "eqns": [],
        "cost_source": "none",
        "workspace_for": w + 1,
      }
      out_nodes.append(Node(w, f"workspace of {node.name}", scratch, 0.0, attrs))
      out_eqns.append(())
      out_vars.append(())
      scratch_edges.append((w, w + 1))
    new_id[node.id] = len(out_nodes)
    out_nodes.append(dataclasses.replace(node, id=len(out_nodes)))
    out_eqns.append(node_eqns[node.id])
    out_vars.append(node_outvars[node.id])
  new_edges = {(new_id[u], new_id[v]) for u, v in edges} | set(scratch_edges)
  for i, node in enumerate(out_nodes):
    named = {a: [new_id[u] for u in node.attrs[a]] for a in _NODE_LISTS if a in node.attrs}
    if named:
      out_nodes[i] = dataclasses.replace(node, attrs={**node.attrs, **named})
  return out_nodes, new_edges, [new_id[v] for v in outputs], out_eqns, out_vars


def _avals_attrs(vs: Sequence[Any]) -> dict[str, Any]:
  shapes = [list(getattr(v.aval, "shape", ())) for v in vs]
  dtypes = [str(getattr(v.aval, "dtype", type(v.aval).__name__)) for v in vs]
  attrs: dict[str, Any] = {"shapes": shapes, "dtypes": dtypes}
  if len(vs) == 1:
    attrs["shape"], attrs["dtype"] = shapes[0], dtypes[0]
  return attrs


def _input_node(i: int, name: str, v: Any, kind: str, held_bytes: int | None = None) -> Node:
  """An input's node; ``held_bytes``, as the compiler holds it, instead of its aval's."""
  attrs = {"primitive": kind, **_avals_attrs([v]), "eqns": []}
  mem = compat.aval_bytes(v.aval) if held_bytes is None else held_bytes
  return Node(i, name, mem, 0.0, attrs)


def _eqn_node(
  i: int,
  eqns: list[Any],
  eqn_ids: list[int],
  outvars: Sequence[Any],
  eqn_costs: list[Any],
  inlined_costs: list[Any] | None,
  duplicated: bool,
  materialized: dict[Any, int],
  kept_reads: dict[Any, frozenset[Any]],
  scratch: dict[int, int] | None = None,
  roof: costs.Roofline | None = None,
  fractions: dict[Any, float] | None = None,
) -> Node:
  """The node of the equations ``eqns``; ``inlined_costs`` are those of the duplicated
  values XLA computes inside its fusion, which it pays for (None: its readers pay for
  this node's own work). ``fractions``: of a partitioned step, the share of each value
  one device holds."""
  root = eqns[-1]
  prim = root.primitive.name
  source = compat.eqn_source(root)
  stack = compat.name_stack_str(root)
  inside = {v for e in eqns for v in e.outvars}
  read = set().union(
    *(
      kept_reads.get(v, {v})
      for e in eqns
      for v in e.invars
      if not isinstance(v, compat.Literal) and v not in inside
    )
  )
  # Of a partitioned step: the share of the node's work one device does, and of a value
  # the compiled program does not show, the share of it one device holds.
  fractions = fractions or {}
  share = min([1.0, *(fractions[v] for v in (*outvars, *read) if v in fractions)])

  def held(v: Any) -> int:
    if v in materialized:
      return materialized[v]
    return round(compat.aval_bytes(v.aval) * fractions.get(v, share))

  kept = sum(held(v) for v in outvars)
  # A duplicated value lives only inside its readers' fusions: XLA keeps nothing.
  out_bytes = 0 if duplicated else kept
  kernel = (
    [] if inlined_costs is None else [costs.scaled(c, share) for c in (*eqn_costs, *inlined_costs)]
  )
  if scratch is None:
    workspace = sum(workspace_bytes(e) for e in eqns)
  else:  # the compiler's own copies (`hlo_model`)
    workspace = sum(scratch.get(k, 0) for k in eqn_ids)
  attrs: dict[str, Any] = {
    "primitive": prim,
    **_avals_attrs(outvars),
    "flops": float(sum(c.flops for c in kernel)),
    "bytes_accessed": float(sum(c.bytes_accessed for c in kernel)),
    "source": source,
    "name_stack": stack,
    "backward": "transpose(" in stack,
    "eqns": list(eqn_ids),
    "cost_source": _merge_sources(c.source for c in eqn_costs),
  }
  if len(eqns) > 1:
    attrs["fused"] = [e.primitive.name for e in eqns]
  if workspace:
    attrs["workspace_bytes"] = workspace
  if duplicated:
    attrs["duplicated"] = True
  if kept != sum(compat.aval_bytes(v.aval) for v in outvars):
    attrs["materialized_bytes"] = kept
  if any(e.effects for e in eqns):
    attrs["effectful"] = True
  if prim in HIGHER_ORDER_PRIMITIVES:
    attrs["internal_bytes"] = internal_bytes(root)
  short = (
    os.path.basename(source.split(":")[0]) + ":" + source.split(":")[1] if ":" in source else source
  )
  # A node's cost prices its recomputation. Recomputed elementwise work runs inside the
  # kernel that reads it, which then reads its operands in place of the value: it adds its
  # arithmetic and the bytes it reads beyond the value. Other work writes its value out.
  read_bytes = sum(held(v) for v in read)
  if all(e.primitive.name in FUSIBLE_PRIMITIVES for e in eqns):
    moved = max(read_bytes - kept, 0)
  else:
    moved = read_bytes + kept
  seconds = costs.kernel_seconds(kernel, moved, roof) if kernel else 0.0
  return Node(i, f"{prim} @ {short}", out_bytes, seconds, attrs)


def _merge_sources(sources) -> str:
  s = set(sources)
  return s.pop() if len(s) == 1 else "mixed"
