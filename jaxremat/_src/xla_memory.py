"""XLA's accounting of the peak: what its ``memory_analysis`` counts for a graph's schedule.

XLA allocates the step's outputs (and some buffers, `fusion.pool_gradient_buffers`)
before the program runs, adds the scratch of the running instruction, and on a target
that keeps temporaries on chip leaves some of them out (`device_peak_bytes`).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import networkx as nx

from jaxremat._src.graph import RematGraph
from jaxremat._src.simulate import baseline_schedule, simulate


def allocated_at_start(graph: RematGraph) -> set[int]:
  """The nodes other than the step's outputs whose buffers XLA allocates before the
  program runs (`trace` marks them ``allocated_at_start``): held from the start until
  their node computes them."""
  outputs = _outputs(graph)
  return {v for v in graph.order if graph.nodes[v].attrs.get("allocated_at_start")} - outputs


def constant_bytes(graph: RematGraph) -> int:
  """The bytes XLA makes from constants before the program runs (nodes'
  ``constant_bytes``, `_constants_released` says until when)."""
  return sum(node.attrs.get("constant_bytes", 0) for node in graph.nodes)


def _outputs(graph: RematGraph) -> set[int]:
  return {v for v in graph.outputs if not graph.is_input[v]}


def xla_accounted_peak_bytes(
  graph: RematGraph, schedule: Any = None, alias_bytes: int = 0, reuse_outputs: bool = True
) -> int:
  """The peak as XLA's ``memory_analysis`` counts it, for ``schedule`` (default: baseline).

  XLA allocates the output buffers before the program runs and keeps them to the end,
  so its figure (argument + output + temp - alias) charges every output throughout, but
  for the ``alias_bytes`` it writes into donated arguments (`held_apart`); where its
  buffer assignment places values in the buffer of an output not written yet (the
  graph's ``meta["outputs_hold_temporaries"]``, `_in_output_buffers`), those count
  nothing, unless ``reuse_outputs`` is False (the solvers' view). This is the
  simulated memory of the other values at each compute event plus those, plus the
  buffers XLA allocates at the start (``allocated_at_start``) until their node computes
  them, plus the scratch XLA allocates while that node runs (its ``workspace_bytes``,
  unless the graph already has scratch nodes for them), plus the bytes XLA makes from
  constants at the start until their reader runs (``constant_bytes``,
  `_constants_released`), less what a node writes into the buffers of values it frees
  (`_written_bytes`). On a target that keeps temporaries on chip
  (``meta["on_chip_bytes"]``), the figure its compiler makes of that (`device_peak_bytes`),
  where at each event past on-chip memory device memory holds at least the values the
  compiled step held there (nodes marked ``off_chip``) and what the rest leaves over.
  """
  schedule = schedule or baseline_schedule(graph)
  apart, held_bytes = held_apart(graph, alias_bytes)
  result = simulate(apart, schedule)
  if not result.valid:
    raise ValueError(f"The schedule is invalid for graph {graph.name!r}: {result.error}")
  pending = allocated_at_start(graph)
  pending_bytes = sum(graph.mem[v] for v in pending)
  early_bytes = constant_bytes(graph)
  released = _constants_released(graph, schedule)
  resident_bytes = graph.resident_bytes + held_bytes
  on_chip_bytes = graph.meta.get("on_chip_bytes", 0)
  off_chip = _off_chip_timeline(apart, schedule) if on_chip_bytes else None
  reuse = reuse_outputs and graph.meta.get("outputs_hold_temporaries", False)
  packed = _in_output_buffers(graph, schedule, pending) if reuse else None
  written = _written_into(apart, schedule)
  peak, spilled = resident_bytes + pending_bytes + early_bytes, 0
  for t, ((kind, v), after) in enumerate(zip(schedule.events, result.timeline_bytes, strict=True)):
    if kind != "compute":
      continue
    if v in pending:
      pending.discard(v)
      pending_bytes -= graph.mem[v]
    live = after + held_bytes + pending_bytes + early_bytes + scratch_bytes(graph, v)
    live -= written.get(t, 0)  # what the node writes into an operand it frees
    if packed:
      live -= packed[t]
    peak = max(peak, live)
    if off_chip and live - resident_bytes > on_chip_bytes:
      # past VMEM, what the compiled step held in HBM stays there, and the rest fills VMEM
      rest = live - resident_bytes - off_chip[t]
      spilled = max(spilled, off_chip[t] + max(0, rest - on_chip_bytes))
    early_bytes -= released.get(t, 0)
  return max(device_peak_bytes(peak, resident_bytes, on_chip_bytes), resident_bytes + spilled)


def _written_into(graph: RematGraph, schedule: Any) -> dict[int, int]:
  """Compute event of ``schedule`` -> `_written_bytes` of its node into the values freed
  right after it."""
  written: dict[int, int] = {}
  for t, (kind, v) in enumerate(schedule.events):
    if kind != "compute" or not graph.nodes[v].attrs.get("writes_into"):
      continue
    freed = set()
    for after_kind, u in schedule.events[t + 1 :]:
      if after_kind == "compute":
        break
      freed.add(u)
    written[t] = _written_bytes(graph, v, freed)
  return written


def _written_bytes(graph: RematGraph, v: int, freed: set[int]) -> int:
  """The bytes of ``v``'s output that XLA writes into the buffers of values in ``freed``,
  which ``v`` reads last and elementwise (nodes' ``writes_into``, read from the compiled
  step: `hlo_model.CompiledValues`): those and the output are not held at once."""
  return sum(
    max((min(size, graph.mem[u]) for u in dying if u in freed), default=0)
    for size, dying in graph.nodes[v].attrs.get("writes_into", ())
  )


def _in_output_buffers(graph: RematGraph, schedule: Any, pending: set[int]) -> list[int]:
  """Per event of ``schedule``, the bytes of values live then that XLA places in the
  buffer of an output not yet written. XLA's buffer assignment visits values from the
  largest down; each output gets a buffer of its own, and each other value the smallest
  such buffer at least its size that holds nothing live at the same time (BufferAssigner's
  reuse of an allocation); the values left over are the temporaries it counts."""
  outputs, end = _outputs(graph), len(schedule.events)
  made: dict[int, int] = {}
  values = []  # (bytes, whether an output's final value, first event, event freed, node)
  for t, (kind, v) in enumerate(schedule.events):
    if kind == "compute":
      made[v] = t
    else:
      values.append((graph.mem[v], False, made.pop(v), t, v))
  values += [(graph.mem[v], v in outputs, t, end, v) for v, t in made.items()]
  buffers: list[list[tuple[int, int]]] = []  # per output, largest first: what it holds when
  sizes: list[int] = []
  at = [0] * (end + 1)
  for size, is_output, first, freed, v in sorted(values, key=lambda x: (-x[0], not x[1], x[2])):
    if is_output:
      if not _aliased(graph, v):
        buffers.append([(first, end)])
        sizes.append(size)
      continue
    if size == 0 or v in outputs or v in pending:
      continue  # counted apart (`held_apart`, `allocated_at_start`)
    for held, room in zip(reversed(buffers), reversed(sizes)):
      if room >= size and all(freed <= a or b <= first for a, b in held):
        held.append((first, freed))
        at[first] += size
        at[freed] -= size
        break
  for t in range(end):
    at[t + 1] += at[t]
  return at


def peak_bound(graph: RematGraph, alias_bytes: int = 0) -> tuple[int, int | None]:
  """A lower bound on `xla_accounted_peak_bytes` of every valid schedule of ``graph``, and
  the node that sets it (None where the bytes held before the first equation do).

  Whatever the order and the recomputations, a node's first computation holds its
  operands and its result (FORMATS.md), beside the arguments, the outputs XLA holds
  throughout (`held_apart`), the node's scratch, and what XLA made before the program
  for the node and for the equations that depend on it, none of which has run yet:
  their constants and the buffers it allocates at the start (`waiting_bytes`), less what
  it may write into its operands' buffers (`_written_bytes`). Where XLA
  holds values in outputs' buffers (`_in_output_buffers`), the node's operands, result
  and scratch may each sit in a buffer of its own of any output but the node. The figure
  grows with the live bytes (`device_peak_bytes`). It bounds plans in the model: a
  compiler that fuses a plan otherwise than the step may hold less.
  """
  apart, held_bytes = held_apart(graph, alias_bytes)
  waiting = waiting_bytes(graph)
  reuse = graph.meta.get("outputs_hold_temporaries", False)
  rooms = {v: graph.mem[v] for v in _outputs(graph) if reuse and not _aliased(graph, v)}
  sizes = sorted(rooms.values())

  def live_bytes(v: int) -> int:
    values = [apart.mem[u] for u in (*apart.compute_preds[v], v)] + [scratch_bytes(graph, v)]
    others = sizes
    if v in rooms:  # its own buffer is being written
      others = list(sizes)
      others.remove(rooms[v])
    held = _most_held_in(values, others)
    written = _written_bytes(apart, v, set(apart.compute_preds[v]))
    return apart.compute_bytes(v) + scratch_bytes(graph, v) + waiting[v] - held - written

  node = max((v for v in graph.order if not graph.is_input[v]), key=live_bytes, default=None)
  early = sum(graph.mem[v] for v in allocated_at_start(graph)) + constant_bytes(graph)
  live = apart.resident_bytes + early
  if node is not None and live_bytes(node) > live:
    live = live_bytes(node)
  else:
    node = None
  resident_bytes = graph.resident_bytes + held_bytes
  bound = device_peak_bytes(live + held_bytes, resident_bytes, graph.meta.get("on_chip_bytes", 0))
  return bound, node


def _most_held_in(values: list[int], rooms: list[int]) -> int:
  """The most bytes of ``values`` that ``rooms`` (ascending) hold, one value in each: the
  largest value first, into the smallest room it fits."""
  free, held = list(rooms), 0
  for size in sorted((v for v in values if v), reverse=True):
    at = bisect.bisect_left(free, size)
    if at < len(free):
      free.pop(at)
      held += size
  return held


def _aliased(graph: RematGraph, v: int) -> bool:
  """Whether output ``v`` is written into a donated argument's buffer (`trace` marks it)."""
  return graph.nodes[v].attrs.get("aliased_output", False)


def waiting_bytes(graph: RematGraph) -> list[int]:
  """Per node, the bytes XLA made before the program that are still held when the node is
  first computed, whatever the schedule: the constants of the node and of the equations
  that depend on it, and the buffers allocated at the start for those equations; none of
  them has run before the node first does (`_constants_released`, `allocated_at_start`).
  On the VGG16 example for TPU v5e, 4.25 MB of them wait at the node that sets the bound."""
  early = [graph.nodes[v].attrs.get("constant_bytes", 0) for v in range(graph.n)]
  waiting = list(early)
  for v in allocated_at_start(graph):
    early[v] += graph.mem[v]
  dag = nx.DiGraph(graph.edges)
  for d, size in enumerate(early):
    if size and d in dag:
      for u in nx.ancestors(dag, d):
        waiting[u] += size
  return waiting


def scratch_bytes(graph: RematGraph, v: int) -> int:
  """The scratch XLA allocates while ``v`` runs, where the graph has no scratch nodes."""
  if graph.meta.get("workspace", False):
    return 0
  return int(graph.nodes[v].attrs.get("workspace_bytes", 0))


def _off_chip_timeline(graph: RematGraph, schedule: Any) -> tuple[int, ...] | None:
  """After each event of ``schedule``, the bytes of the values that the compiled step held
  in device memory beside on-chip memory (nodes marked ``off_chip``); None where none is."""
  off = {n.id for n in graph.nodes if n.attrs.get("off_chip")}
  if not off:
    return None
  nodes = tuple(n if n.id in off else dataclasses.replace(n, mem=0) for n in graph.nodes)
  return simulate(dataclasses.replace(graph, nodes=nodes), schedule).timeline_bytes


def held_apart(graph: RematGraph, alias_bytes: int) -> tuple[RematGraph, int]:
  """``graph`` with the step's outputs at no bytes, and the bytes XLA holds for them
  throughout: theirs, less what it writes into donated arguments (``alias_bytes``). An
  output made before the end adds nothing: the MLP example's plan at 0.7 on XLA:CPU,
  which updates each layer's weights once its gradient is made, read 27.99 MiB where XLA
  measured 21.16 while outputs were taken to be aliased only once the last was made."""
  outputs = _outputs(graph)
  nodes = tuple(dataclasses.replace(n, mem=0) if n.id in outputs else n for n in graph.nodes)
  held_bytes = max(0, sum(graph.mem[v] for v in outputs) - alias_bytes)
  return dataclasses.replace(graph, nodes=nodes), held_bytes


def _constants_released(graph: RematGraph, schedule: Any) -> dict[int, int]:
  """Event index -> the bytes made from constants freed after it: a node's
  ``constant_bytes`` once it is first computed, or later, where its reader reads a node
  (``constants_with``) for others (``constants_for``), once the copy of that node they
  read first is computed (a plan that makes a max pool's input again in the backward pass
  moves the argmax, and XLA holds the iotas it reads until then)."""
  computes: dict[int, list[int]] = {}
  for t, (kind, v) in enumerate(schedule.events):
    if kind == "compute":
      computes.setdefault(v, []).append(t)
  released: dict[int, int] = {}
  for v, node in enumerate(graph.nodes):
    size = node.attrs.get("constant_bytes", 0)
    if not size or v not in computes:
      continue
    at = computes[v][0]
    readers = [computes[w][0] for w in node.attrs.get("constants_for", ()) if w in computes]
    until = min(readers, default=len(schedule.events))
    for u in node.attrs.get("constants_with", ()):
      at = max(at, max((t for t in computes.get(u, ()) if t < until), default=at))
    released[at] = released.get(at, 0) + size
  return released


def device_peak_bytes(live_bytes: int, resident_bytes: int, on_chip_bytes: int) -> int:
  """The compiler's peak figure for a program whose live bytes peak at ``live_bytes``, of
  them ``resident_bytes`` its arguments and outputs in device memory, on a target that
  keeps up to ``on_chip_bytes`` of temporaries on chip (what the compiled step held there,
  or `Target.on_chip_bytes`: `program._on_chip_bytes`; 0: the figure is the live bytes).

  On TPU the figure is the larger of the arguments plus what VMEM held at most and device
  memory's own peak, the bytes live beyond VMEM: it follows the live bytes until the
  temporaries fill VMEM, stays at the arguments plus VMEM until they fill it twice over,
  then follows the live bytes less VMEM. Measured on the GPT example's step for TPU v5e
  at batch 8, 16, 32, 48 and 64 from XLA's buffer assignment (live bytes 39.6, 68.9,
  127.5, 186.2, 244.8 MiB; peak 42.9, 72.2, 122.0, 121.8, 134.0 MiB).
  """
  temp_bytes = live_bytes - resident_bytes
  if on_chip_bytes <= 0 or temp_bytes <= 0:
    return live_bytes
  return resident_bytes + max(min(temp_bytes, on_chip_bytes), temp_bytes - on_chip_bytes)


def live_bytes_within(device_bytes: int, resident_bytes: int, on_chip_bytes: int) -> int:
  """The most live bytes whose `device_peak_bytes` is within ``device_bytes``."""
  if on_chip_bytes <= 0 or device_bytes - resident_bytes < on_chip_bytes:
    return device_bytes
  return device_bytes + on_chip_bytes
