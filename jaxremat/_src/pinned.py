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

The compiler says how: `pinned_original` emits the step's order fenced so, each equation
(and each fence, after the node it fences for) under the scope that names it, and
compiles it for the target; `pinned_program` reads the graph from that program as
`trace` reads the step's from the step's: what it keeps, at what size, with what scratch,
in what order. On XLA:CPU its graph counts the pinned step of the six examples and nine
steps outside them within 10.3% (14 of 15 within 5%), where the step's graph with only
the pinned step's kept values was 18-28% off on four of them. The planner plans and
predicts on it where the pinned original meets the budget, and the pinned original is
then the first plan itself (`planner._Loop.try_pinned_order`); the graph does not see
the copies a recomputation's fences make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxremat._src import hlo_model
from jaxremat._src.emit import emit
from jaxremat._src.measure import Measurement, compile_and_measure
from jaxremat._src.program import Program, build_program
from jaxremat._src.signature import CallSignature, FlatStep
from jaxremat._src.simulate import baseline_schedule
from jaxremat._src.targets import Target


@dataclasses.dataclass(frozen=True)
class PinnedOriginal:
  """The step emitted in its own order with every equation fenced, compiled for a target.

  Attributes:
    emitted: the step so emitted (`emit`'s ``pin="all"``), each equation under its scope.
    executable: its compile, with the step's donation.
    measured: the compiler's figures for it.
    values: what the compiler keeps of the step's equations there (`hlo_model`).
  """

  emitted: Callable[..., Any] = dataclasses.field(repr=False)
  executable: Any = dataclasses.field(repr=False)
  measured: Measurement
  values: hlo_model.CompiledValues = dataclasses.field(repr=False)


def pinned_original(
  program: Program, signature: CallSignature, target: Target, fence: str = "auto"
) -> PinnedOriginal:
  """``program``'s own order emitted with every equation fenced (by ``fence``, `emit`'s),
  compiled for ``target``: what the compiler keeps of its equations there, and its
  figures. It is also the plan of that order (`planner._Loop.try_pinned_order`)."""
  emitted = emit(
    program,
    baseline_schedule(program.graph),
    fence=fence,
    pin="all",
    scoped=True,
    backend=target.platform,
  )
  emitted.__name__ = "pinned_original"  # as JAX names its compile
  executable, measured = compile_and_measure(
    FlatStep(emitted, signature),
    *signature.specs,
    donate_argnums=signature.donated_leaves,
    target=target,
  )
  values = hlo_model.scoped_values(measured.hlo_text, program.jaxpr.jaxpr)
  return PinnedOriginal(emitted, executable, measured, values)


def pinned_program(program: Program, pinned: PinnedOriginal, target: Target) -> Program:
  """``program``'s equations grouped, sized and ordered as the compiler holds them pinned
  (`pinned_original`): plans made on its graph are emitted from it. Equation costs are
  the step's (`costs`' cache), none compiled again."""
  graph = program.graph
  built = build_program(
    program.jaxpr,
    fold=graph.meta.get("fold", True),
    costs_mode=graph.meta.get("costs", "xla"),
    name=graph.name,
    arg_names=[graph.nodes[v].name for v in range(len(program.jaxpr.jaxpr.invars))],
    signature=program.signature,
    output_split=program.outputs,
    cost_time_limit=0.0,
    workspace=graph.meta.get("workspace", False),
    target=target,
    compiled=pinned.values,
  )
  # The pinned original ran the step's nodes each on its own, and XLA computed some inside
  # their readers: those are emitted so again, not inside each reader (`emit.inlined_reads`),
  # which XLA merges and holds (the ResNet step of tests/test_pinned.py: 3.21 MB, not 2.42).
  inlined = {
    k for v in graph.order if graph.nodes[v].attrs.get("duplicated") for k in program.node_eqns[v]
  }
  nodes = list(built.graph.nodes)
  for v in built.graph.order:
    if nodes[v].attrs.get("duplicated") and not inlined.issuperset(built.node_eqns[v]):
      attrs = {a: x for a, x in nodes[v].attrs.items() if a != "duplicated"}
      nodes[v] = dataclasses.replace(nodes[v], attrs=attrs)
  return dataclasses.replace(
    built,
    graph=dataclasses.replace(built.graph, nodes=tuple(nodes)),
    baseline=pinned.measured,
    loops=program.loops,
  )
