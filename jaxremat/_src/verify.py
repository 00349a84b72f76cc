"""`verify`: proof that an emitted function computes the same values and keeps its plan.

Three checks, each against XLA rather than the model: the outputs equal the original's;
the recomputed expensive equations of the plan are still in the optimized HLO (XLA did
not merge them away, ARCHITECTURE.md fact 1); XLA's peak is the simulator's prediction.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxremat._src import compat
from jaxremat._src.backends import backend_facts
from jaxremat._src.emit import live_computes
from jaxremat._src.measure import Measurement, measure
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.trace import xla_accounted_peak_bytes

# Equations whose recomputation costs real time, and the HLO instruction each becomes.
# Elementwise work is left out: XLA fuses and duplicates it on its own (fact 2).
EXPENSIVE_PRIMITIVES: Mapping[str, str] = {
  "dot_general": "dot",
  "conv_general_dilated": "convolution",
  "fft": "fft",
  "sort": "sort",
}
# XLA rewrites some convolutions as dots (1x1 kernels on XLA:CPU), so a planned
# convolution may survive as a dot: opcodes in one group are counted together.
_OPCODE_GROUPS = (("dot", "convolution"), ("fft",), ("sort",))
_HLO_OPCODE = re.compile(r"=\s.*?\s([a-z][a-z0-9-]*)\(")


@dataclasses.dataclass(frozen=True)
class Verification:
  """What `verify` found.

  Attributes:
    outputs_match: every output leaf is allclose to the original's.
    max_abs_error: the largest absolute difference over all output leaves.
    max_rel_norm_error: the largest ``||got - expected|| / ||expected||`` over the leaves.
      Recomputation may fuse reductions differently; an optimizer such as Adam divides
      a near-zero gradient by its own magnitude and can blow that last-bit noise up to a
      whole step in a few elements, which elementwise comparison flags but this does not.
    planned_recomputes: recomputed expensive equations in the plan, by HLO opcode.
    surviving_recomputes: extra instructions of those opcodes in the emitted function's
      optimized HLO over the original's (fusions and control-flow branches included).
    predicted_peak_bytes: the simulator's peak for the schedule.
    measured_peak_bytes: XLA's peak (argument + output + temp - alias) of the emitted one.
    predicted_xla_peak_bytes: the simulator's peak as XLA counts it (output buffers
      held from the start, `trace.xla_accounted_peak_bytes`).
    predicted_baseline_peak_bytes: the simulator's peak for the no-remat baseline.
    planned_flops_increase: extra flops of the recomputations over the graph's total
      (a fraction; None when the graph's nodes carry no ``flops``).
    measured_flops_increase: emitted over original flops from XLA's cost analysis, less 1.
    original: `measure` of the original function.
    emitted: `measure` of the emitted function.
  """

  outputs_match: bool
  max_abs_error: float
  max_rel_norm_error: float
  planned_recomputes: Mapping[str, int]
  surviving_recomputes: Mapping[str, int]
  predicted_peak_bytes: int
  measured_peak_bytes: int
  predicted_xla_peak_bytes: int
  predicted_baseline_peak_bytes: int
  planned_flops_increase: float | None
  measured_flops_increase: float | None
  original: Measurement = dataclasses.field(repr=False)
  emitted: Measurement = dataclasses.field(repr=False)

  @property
  def recomputes_survive(self) -> bool:
    """Every planned expensive recomputation is in the optimized HLO.

    Dots and convolutions count together: XLA lowers some convolutions to dots.
    """
    return all(
      sum(self.surviving_recomputes.get(op, 0) for op in group)
      >= sum(self.planned_recomputes.get(op, 0) for op in group)
      for group in _OPCODE_GROUPS
    )

  @property
  def n_planned_recomputes(self) -> int:
    """Planned expensive recomputations, all opcodes together."""
    return sum(self.planned_recomputes.values())

  @property
  def n_surviving_recomputes(self) -> int:
    """Of those, how many XLA kept (at most the planned number per opcode group)."""
    return sum(
      min(
        sum(self.surviving_recomputes.get(op, 0) for op in group),
        sum(self.planned_recomputes.get(op, 0) for op in group),
      )
      for group in _OPCODE_GROUPS
    )

  @property
  def peak_error(self) -> float:
    """XLA's peak over the simulator's, less 1 (0.05: XLA needs 5% more)."""
    return self.measured_peak_bytes / max(self.predicted_peak_bytes, 1) - 1.0

  @property
  def xla_peak_error(self) -> float:
    """XLA's peak over the simulator's peak as XLA counts it, less 1."""
    return self.measured_peak_bytes / max(self.predicted_xla_peak_bytes, 1) - 1.0

  def summary(self) -> dict[str, Any]:
    """Every check and figure (not the two `Measurement` objects), as a JSON-ready dict."""
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("original", "emitted")
    }
    out.update(
      planned_recomputes=dict(self.planned_recomputes),
      surviving_recomputes=dict(self.surviving_recomputes),
      recomputes_survive=self.recomputes_survive,
      n_planned_recomputes=self.n_planned_recomputes,
      n_surviving_recomputes=self.n_surviving_recomputes,
      peak_error=self.peak_error,
      xla_peak_error=self.xla_peak_error,
      original_peak_bytes=self.original.peak_bytes,
      original_temp_bytes=self.original.temp_bytes,
      emitted_temp_bytes=self.emitted.temp_bytes,
      emitted_output_bytes=self.emitted.output_bytes,
      emitted_flops=self.emitted.flops,
      original_wall_time_s=self.original.wall_time_s,
      emitted_wall_time_s=self.emitted.wall_time_s,
      emitted_device_peak_bytes=self.emitted.device_peak_bytes,
      ok=self.ok(),
    )
    return out

  def ok(self, peak_rtol: float = 0.10) -> bool:
    """Outputs match, recomputations survive, and XLA's peak is within ``peak_rtol``."""
    return self.outputs_match and self.recomputes_survive and abs(self.peak_error) <= peak_rtol


def verify(
  fn: Callable[..., Any],
  emitted: Callable[..., Any],
  schedule_or_program: Any = None,
  *args: Any,
  rtol: float | None = None,
  atol: float | None = None,
  runs: int = 0,
  original: Measurement | None = None,
  **kwargs: Any,
) -> Verification:
  """Checks ``emitted`` (from `jaxremat.emit`) against the original ``fn``.

  Args:
    fn: the original function.
    emitted: the function `emit` returned for it.
    schedule_or_program: the plan to compare with: a `Schedule`, a `Program`, or None;
      whatever is not given is read from ``emitted.schedule`` / ``emitted.program``.
    *args: arguments to run both functions on.
    rtol, atol: tolerances of the output comparison (`numpy.allclose`); None takes each
      output's from the backend's facts by dtype (float32 on CPU: 1e-5 and 1e-6; integers
      and booleans exactly).
    runs: timed calls per function for `measure` (0: compile and analyse only).
    original: a `measure` of ``fn`` on these arguments to reuse (when verifying many
      schedules of one function); measured here when None.
    **kwargs: keyword arguments to run both functions on.

  Returns:
    A `Verification`; ``ok()`` says whether every check passed.

  Raises:
    ValueError: the plan cannot be found (pass the schedule and the program's function
      through `emit`).

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> f = lambda x: jnp.sum(jnp.tanh(x @ x))
    >>> p = jaxremat.trace_program(f, jnp.ones((8, 8)), costs="shape")
    >>> s = jaxremat.baseline_schedule(p.graph)
    >>> v = jaxremat.verify(f, jaxremat.emit(p, s), s, jnp.ones((8, 8)))
    >>> v.outputs_match, v.recomputes_survive, v.planned_recomputes
    (True, True, {})
  """
  schedule = getattr(emitted, "schedule", None)
  program = getattr(emitted, "program", None)
  if isinstance(schedule_or_program, Schedule):
    schedule = schedule_or_program
  elif schedule_or_program is not None:
    program = schedule_or_program
  if schedule is None or program is None:
    raise ValueError(
      f"verify needs the schedule and the traced program behind emitted={emitted!r}; pass "
      "a function returned by jaxremat.emit, or the missing one as schedule_or_program."
    )
  expected = jax.jit(fn)(*args, **kwargs)
  got = jax.jit(emitted)(*args, **kwargs)
  outputs_match, max_abs_error, max_rel_norm_error = _compare(expected, got, rtol=rtol, atol=atol)
  if original is None:
    original = measure(fn, *args, runs=runs, **kwargs)
  emitted_m = measure(emitted, *args, runs=runs, **kwargs)
  before, after = count_hlo_ops(original.hlo_text), count_hlo_ops(emitted_m.hlo_text)
  planned = planned_recomputes(program, schedule)
  surviving = {op: after.get(op, 0) - before.get(op, 0) for op in EXPENSIVE_PRIMITIVES.values()}
  graph = program.graph
  return Verification(
    outputs_match=outputs_match,
    max_abs_error=max_abs_error,
    max_rel_norm_error=max_rel_norm_error,
    planned_recomputes=planned,
    surviving_recomputes={op: n for op, n in surviving.items() if n or op in planned},
    predicted_peak_bytes=simulate(graph, schedule).peak_bytes,
    measured_peak_bytes=emitted_m.peak_bytes,
    predicted_xla_peak_bytes=xla_accounted_peak_bytes(graph, schedule),
    predicted_baseline_peak_bytes=simulate(graph, baseline_schedule(graph)).peak_bytes,
    planned_flops_increase=planned_flops_increase(program, schedule),
    measured_flops_increase=(
      emitted_m.flops / original.flops - 1.0 if original.flops and emitted_m.flops else None
    ),
    original=original,
    emitted=emitted_m,
  )


def _compare(
  expected: Any, got: Any, *, rtol: float | None, atol: float | None
) -> tuple[bool, float, float]:
  """(all leaves allclose, max absolute error, max norm-wise relative error)."""
  if jax.tree.structure(expected) != jax.tree.structure(got):
    return False, float("inf"), float("inf")
  match, worst, worst_rel = True, 0.0, 0.0
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
      return False, float("inf"), float("inf")
    rtol_a, atol_a = backend_facts().tolerance(a.dtype)
    rtol_a, atol_a = rtol_a if rtol is None else rtol, atol_a if atol is None else atol
    match &= bool(np.allclose(b, a, rtol=rtol_a, atol=atol_a, equal_nan=True))
    if a.size and np.issubdtype(a.dtype, np.number):
      a64, b64 = a.astype(np.float64), b.astype(np.float64)
      diff = np.abs(b64 - a64)
      if not np.all(np.isnan(diff)):
        worst = max(worst, float(np.nanmax(diff)))
        norm = float(np.linalg.norm(np.nan_to_num(a64)))
        err = float(np.linalg.norm(np.nan_to_num(diff)))
        worst_rel = max(worst_rel, err / norm if norm else (0.0 if err == 0 else float("inf")))
    elif a.size:
      match &= bool(np.array_equal(a, b))
  return match, worst, worst_rel


def count_hlo_ops(hlo_text: str) -> dict[str, int]:
  """Instructions per opcode in HLO text, fused computations and branches included."""
  counts: collections.Counter[str] = collections.Counter()
  for line in hlo_text.splitlines():
    match = _HLO_OPCODE.search(line)
    if match:
      counts[match.group(1)] += 1
  return dict(counts)


def planned_recomputes(program: Any, schedule: Schedule) -> dict[str, int]:
  """Expensive equations the schedule runs again, by the HLO opcode they lower to.

  Recomputations whose values nobody reads are left out: `emit` drops them (as XLA would).
  """
  counts: collections.Counter[str] = collections.Counter()
  for v, recompute in live_computes(program, schedule):
    if recompute:
      for i in program.node_eqns[v]:
        _count_expensive(program.jaxpr.jaxpr.eqns[i], counts)
  return dict(counts)


def _count_expensive(eqn: Any, counts: collections.Counter) -> None:
  op = EXPENSIVE_PRIMITIVES.get(eqn.primitive.name)
  if op:
    counts[op] += 1
  for inner in compat.inner_jaxprs(eqn):
    for sub in inner.eqns:
      _count_expensive(sub, counts)


def planned_flops_increase(program: Any, schedule: Schedule) -> float | None:
  """Flops of the (used) recomputations over the flops of one run of every node.

  None unless every node carries a ``flops`` attribute.
  """
  graph = program.graph
  flops = [graph.nodes[v].attrs.get("flops") for v in graph.order]
  if any(f is None for f in flops):
    return None
  total = float(sum(flops))
  extra = sum(
    graph.nodes[v].attrs["flops"] for v, again in live_computes(program, schedule) if again
  )
  return extra / total if total else None
