"""How the target compiler holds a plan emitted in its own order (`emit`'s ``pin="all"``).

The graph is read from the compiler's program of the step as written (`hlo_model`). A plan
emitted with every equation fenced on the one before it is another program, and the
compiler fuses it otherwise: on XLA:CPU each fenced equation reads an operand through a
`select`, which XLA can fuse where it cannot fuse the equation itself (a reduction), so a
cheap elementwise value that the step keeps for such a reader (a batch norm's ``x -
mean``, its normalized ``x``) is computed again inside each of its readers, the backward
pass's too, and kept by none. The six examples' steps emitted in their own order so hold
x0.44 (ResNet) to x1.02 (the MLP) of the step's peak on XLA:CPU, at x1.00 to x1.06 of its
FLOPs, and the model of the step, applied to plans so emitted, counted MobileNet's at
x1.9 of XLA's.

The compiler says which values: `pinned_original` emits the step's order fenced so,
each equation (and each fence, after the node it fences for) under the scope that names
it, and compiles it for the target; the graph's values that no instruction of that
program keeps are computed in their readers, and readers that compute a kept value again
read its operands (`pinned_graph`), as `program.build_program` models what XLA does so in
the step itself. The planner plans and predicts on that graph where the pinned original
meets the budget (`planner._Loop`); the graph does not see the copies a recomputation's
fences make, and on the U-Net example on XLA:CPU at 0.7 its plan measured 16% over it.
"""

from __future__ import annotations

import dataclasses

from jaxremat._src import hlo_model
from jaxremat._src.emit import emit
from jaxremat._src.fusion import FUSIBLE_PRIMITIVES
from jaxremat._src.graph import RematGraph
from jaxremat._src.measure import Measurement, compile_and_measure
from jaxremat._src.program import Program, read_through, remade_reads
from jaxremat._src.signature import CallSignature, FlatStep
from jaxremat._src.simulate import baseline_schedule
from jaxremat._src.targets import Target


def pinned_original(
  program: Program, signature: CallSignature, target: Target
) -> tuple[hlo_model.CompiledValues, Measurement]:
  """What the compiler keeps of ``program``'s equations when the step's own order is
  emitted with every equation fenced, and its figures for that program."""
  emitted = emit(
    program, baseline_schedule(program.graph), pin="all", scoped=True, backend=target.platform
  )
  emitted.__name__ = "pinned_original"  # as JAX names its compile
  _, measured = compile_and_measure(
    FlatStep(emitted, signature),
    *signature.specs,
    donate_argnums=signature.donated_leaves,
    target=target,
  )
  return hlo_model.scoped_values(measured.hlo_text, program.jaxpr.jaxpr), measured


def pinned_program(program: Program, values: hlo_model.CompiledValues) -> Program:
  """``program`` with its graph as the compiler holds it pinned (`pinned_graph`): plans
  made on that graph are emitted from it."""
  return dataclasses.replace(program, graph=pinned_graph(program, values))


def pinned_graph(program: Program, values: hlo_model.CompiledValues) -> RematGraph:
  """``program``'s graph as the compiler holds it pinned (``values``, `pinned_original`).

  A value no instruction keeps is computed inside its readers: no bytes of its own, its
  readers hold its operands instead, and each reader pays for an elementwise one (XLA's
  cost analysis counts it once per reader; other work is paid once, by its own node, as
  in `program.build_program`). In graph order, so that a chain of such values hands its
  sources on to the readers at its end. A reader that computes a kept value again from
  its operands (`CompiledValues.remade_for`: the backward pass's ReLU gradient, from the
  convolution output) reads those operands, and pays for it, instead of the value.
  """
  graph = program.graph
  eqns = program.jaxpr.jaxpr.eqns
  nodes = list(graph.nodes)
  edges = set(graph.edges)

  def elementwise(v: int) -> bool:
    return all(eqns[i].primitive.name in FUSIBLE_PRIMITIVES for i in program.node_eqns[v])

  def pay(w: int, v: int) -> None:
    extra = {"flops": nodes[w].attrs.get("flops", 0.0) + nodes[v].attrs.get("flops", 0.0)}
    nodes[w] = dataclasses.replace(
      nodes[w], cost=nodes[w].cost + nodes[v].cost, attrs={**nodes[w].attrs, **extra}
    )

  node_of = {k: v for v in graph.order for k in program.node_eqns[v]}
  for w, remade in remade_reads(edges, node_of, values).items():
    for u in remade:
      if elementwise(u):
        pay(w, u)
    # The emitted reader computes them again too (`emit.inlined_reads`): a plan may run
    # it before them, or after they were freed.
    remakes = sorted({*nodes[w].attrs.get("remakes", ()), *remade})
    nodes[w] = dataclasses.replace(nodes[w], attrs={**nodes[w].attrs, "remakes": remakes})
  outputs = set(graph.outputs)
  for d in graph.order:
    if (
      not graph.mem[d]
      or d in outputs
      or graph.nodes[d].attrs.get("effectful")
      or values.kept.intersection(program.node_eqns[d])
    ):
      continue
    sinks = read_through(edges, d)
    attrs = {**nodes[d].attrs, "remade_when_pinned": True}
    if elementwise(d):
      for w in sinks:
        pay(w, d)
      attrs["flops"] = 0.0
      nodes[d] = dataclasses.replace(nodes[d], cost=0.0)
    nodes[d] = dataclasses.replace(nodes[d], mem=0, attrs=attrs)
  return dataclasses.replace(graph, nodes=tuple(nodes), edges=tuple(sorted(edges)))
