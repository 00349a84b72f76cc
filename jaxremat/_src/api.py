"""`jaxremat.optimize`: make a (training) step fit a memory budget, checked by XLA.

For each input signature the first call traces, costs, solves, emits and compiles the
step, then measures the compiled step with XLA. If XLA's peak is over the budget, the
planning budget is lowered by the excess and the plan solved again (a bounded closed
loop): the graph's memory model is close to XLA's, not equal to it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.metadata
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxremat._src import compat
from jaxremat._src.budget import BudgetLike, parse_budget
from jaxremat._src.emit import emit
from jaxremat._src.errors import (
  InfeasibleBudgetError,
  NoScheduleFoundError,
  UnsupportedError,
  VerificationError,
)
from jaxremat._src.measure import Measurement, measure
from jaxremat._src.plan_cache import PlanCache, fingerprint
from jaxremat._src.schedule import Schedule
from jaxremat._src.solve import solve
from jaxremat._src.solvers.base import Progress
from jaxremat._src.trace import Program, trace_program
from jaxremat._src.verify import verify as verify_plan

logger = logging.getLogger("jaxremat")
# How much tighter (a fraction of the budget) each replan aims beyond XLA's measured excess.
_REPLAN_MARGIN = 0.02
# Outputs pass verification when allclose elementwise (rtol 1e-5) or, per leaf, within this
# norm-wise relative error: float32 reassociation amplified by the optimizer (Verification).
_NORM_RTOL = 1e-4
# Planners whose plans recompute whole segments, which XLA's scheduler keeps as planned.
_SEGMENT_SOLVERS = ("chen-sqrtn-ap", "chen-greedy-ap", "griewank-ap", "twremat")


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One round of the closed loop: what was planned and what XLA measured."""

  solver: str
  planning_budget_bytes: int
  predicted_peak_bytes: int
  measured_peak_bytes: int


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything `optimize` decided for one input signature.

  Attributes:
    program: the traced step (flat jaxpr and graph).
    schedule: the schedule that runs, with the solver's stats.
    budget_bytes: the user's budget, in XLA bytes.
    baseline_peak_bytes: XLA's peak of the original step.
    measured_peak_bytes: XLA's peak of the optimized step.
    attempts: each round of the closed loop.
    from_cache: whether the schedule came from the plan cache.
    plan_time_s: seconds from the first call to a compiled step.
    compile_time_s: of those, the seconds XLA spent compiling the optimized step(s).
  """

  program: Program
  schedule: Schedule
  budget_bytes: int
  baseline_peak_bytes: int
  measured_peak_bytes: int
  attempts: tuple[Attempt, ...]
  from_cache: bool
  plan_time_s: float
  compile_time_s: float
  compiled: Callable[..., Any] = dataclasses.field(repr=False, compare=False)


class OptimizedFunction:
  """What `optimize` returns: call it like the original step.

  Attributes:
    plans: one `Plan` per input signature seen so far.
  """

  def __init__(self, fn: Callable, options: dict[str, Any]):
    self.fn = fn
    self.options = options
    self.plans: dict[Any, Plan] = {}
    functools.update_wrapper(self, fn)

  def __call__(self, *args, **kwargs):
    return self.plan(*args, **kwargs).compiled(*args, **kwargs)

  def plan(self, *args, **kwargs) -> Plan:
    """The `Plan` for these arguments' signature, making it on first use."""
    key = _signature(args, kwargs, self.options["static_argnums"])
    if key not in self.plans:
      if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
        raise UnsupportedError(
          f"{getattr(self.fn, '__name__', 'the step')} is being traced (by jax.jit, jax.grad "
          "or jax.vmap) before it has a plan for these argument shapes, and jaxremat plans "
          "and verifies with real arrays: call it once with arrays of these shapes (or "
          "call its .plan(*args)) before transforming it."
        )
      self.plans[key] = _make_plan(self.fn, args, kwargs, **self.options)
    return self.plans[key]

  def report(self, *args, runs: int = 5, **kwargs) -> Report:
    """Plans if needed, then measures the original and optimized steps side by side."""
    return make_report(self, *args, runs=runs, **kwargs)


def optimize(
  fn: Callable | None = None,
  *,
  budget: BudgetLike,
  solver: str = "auto",
  time_limit: float = 60.0,
  verify: bool = True,
  cache_dir: str | None = None,
  use_cache: bool = True,
  fence: str = "auto",
  max_replans: int = 3,
  donate_argnums: int | Sequence[int] = (),
  static_argnums: int | Sequence[int] = (),
  progress: bool | Callable[[Progress], None] = True,
  **solver_options: Any,
) -> Any:
  """Makes ``fn`` run within ``budget`` bytes of device memory, recomputing the least.

  Usable as ``@jaxremat.optimize(budget=0.5)`` on a plain or `jax.jit`-wrapped step, or
  as ``jaxremat.optimize(step, budget="12GiB")``.

  Args:
    fn: the step; omit it to get a decorator.
    budget: bytes, "12GiB", or a fraction / percentage of XLA's measured peak of ``fn``.
    solver: a name from `jaxremat.available_solvers()`.
    time_limit: seconds the solver may use per solve.
    verify: compare the optimized step's outputs with the original's on the first
      call (`jaxremat.verify`); a mismatch raises.
    cache_dir: the plan cache (default ``$JAXREMAT_CACHE_DIR`` or ``~/.cache/jaxremat``).
    use_cache: read and write the plan cache.
    fence: how recomputations are kept from being merged away (see `jaxremat.emit`).
    max_replans: how many times to tighten the plan when XLA measures it over budget.
    donate_argnums: as for `jax.jit`, for the optimized step.
    static_argnums: arguments that are static (as for `jax.jit`).
    progress: print the solver's progress to stderr on solves longer than 2 s; or a
      callable that receives each `Progress` report instead.
    **solver_options: passed to the solver.

  Returns:
    An `OptimizedFunction` (or a decorator making one).

  Raises:
    InfeasibleBudgetError: on the first call, if the budget cannot be met; it names the
      smallest budget jaxremat can meet.

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> step = jaxremat.optimize(lambda x: jnp.tanh(x @ x).sum(), budget=1.0, solver="noremat")
    >>> float(step(jnp.eye(4)))
    3.046...
  """
  options = dict(
    budget=budget,
    solver=solver,
    time_limit=time_limit,
    verify=verify,
    cache_dir=cache_dir,
    use_cache=use_cache,
    fence=fence,
    max_replans=max_replans,
    donate_argnums=_as_tuple(donate_argnums),
    static_argnums=_as_tuple(static_argnums),
    progress=progress,
    solver_options=solver_options,
  )
  if max_replans < 0:
    raise ValueError(f"max_replans={max_replans!r} must be a non-negative count.")
  if fn is not None and not callable(fn):
    raise TypeError(f"fn={fn!r} is not callable; pass the step function to optimize.")
  if fn is None:
    return lambda f: OptimizedFunction(f, options)
  return OptimizedFunction(fn, options)


# -- planning -------------------------------------------------------------------------


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
  return (x,) if isinstance(x, int) else tuple(x)


def _signature(args, kwargs, static_argnums) -> Any:
  """Tree structure, shapes and dtypes of the arguments, and the static values."""

  def leaf_key(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return (tuple(x.shape), str(x.dtype))
    return ("static", repr(x))

  marked = tuple(("static", repr(a)) if i in static_argnums else a for i, a in enumerate(args))
  leaves, tree = jax.tree_util.tree_flatten((marked, kwargs))
  return tree, tuple(leaf_key(x) for x in leaves)


def _progress_printer(
  enabled: bool | Callable[[Progress], None],
) -> Callable[[Progress], None] | None:
  """Prints a solve's progress to stderr every 2 s once it has run for 2 s."""
  if callable(enabled):
    return enabled
  if not enabled:
    return None
  last = [0.0]

  def report(p: Progress) -> None:
    if p.elapsed_s >= 2.0 and p.elapsed_s - last[0] >= 2.0:
      last[0] = p.elapsed_s
      print(
        f"jaxremat: solving for {p.elapsed_s:.0f} s; best duration {p.best_duration}, "
        f"lower bound {p.lower_bound} {p.message}",
        file=sys.stderr,
      )

  return report


def _make_plan(
  fn,
  args,
  kwargs,
  *,
  budget,
  solver,
  time_limit,
  verify,
  cache_dir,
  use_cache,
  fence,
  max_replans,
  donate_argnums,
  static_argnums,
  progress,
  solver_options,
) -> Plan:
  start = time.perf_counter()
  for i in donate_argnums:
    if not -len(args) <= i < len(args):
      raise ValueError(
        f"donate_argnums contains {i}, but the step was given {len(args)} positional "
        "arguments; name only positions that exist."
      )
  program = trace_program(fn, *args, static_argnums=static_argnums, **kwargs)
  if not any(program.dynamic_mask):
    raise UnsupportedError(
      f"{program.graph.name} was called without array inputs (jax.Array, numpy arrays or "
      "jax.ShapeDtypeStruct), so there is no step memory to plan: pass the parameters and "
      "the batch as arrays, not Python numbers or static arguments."
    )
  graph = program.graph
  versions = {name: importlib.metadata.version(name) for name in ("jax", "jaxlib", "jaxremat")}
  key = fingerprint(
    jaxpr=str(program.jaxpr),
    graph=graph.to_dict()["nodes"],
    budget=repr(budget),
    solver=solver,
    fence=fence,
    options=solver_options,
    backend=jax.default_backend(),
    versions=versions,
  )
  cache = PlanCache(cache_dir) if use_cache else None
  cached = cache.load(key, graph) if cache else None
  if cached is not None and not _plan_info_ok(cached):
    logger.warning("jaxremat: the cached plan lacks its budget figures; planning again.")
    cached = None
  if cached is not None:
    info = cached.stats["optimize"]
    compiled = _compile(program, cached, fence, args, kwargs, donate_argnums)
    measured = compiled.peak_bytes
    if measured <= info.get("budget_bytes", -1):
      return Plan(
        program,
        cached,
        info["budget_bytes"],
        info["baseline_peak_bytes"],
        measured,
        (),
        True,
        time.perf_counter() - start,
        compiled.compile_time_s,
        compiled.run,
      )
    logger.warning(
      "jaxremat: the cached plan measures %d bytes, over budget; planning again.", measured
    )

  baseline = measure(fn, *args, runs=0, **kwargs).peak_bytes
  budget_bytes = parse_budget(budget, baseline)
  graph.require_feasible(budget_bytes)
  loop = functools.partial(
    _closed_loop,
    program,
    args,
    kwargs,
    budget_bytes,
    fence=fence,
    donate_argnums=donate_argnums,
    time_limit=time_limit,
    progress=progress,
    solver_options=solver_options,
  )
  tried = loop(solver, max_replans)
  if solver == "auto" and not any(t.met for t in tried):
    # XLA may reorder what a plan leaves unfenced; plans built from whole segments keep
    # their shape. Try those, and keep the cheapest plan XLA confirms.
    logger.info("jaxremat: no 'auto' plan fits as XLA measures it; trying segment planners.")
    for name in _SEGMENT_SOLVERS:
      tried += loop(name, min(max_replans, 1))
  if not tried:
    raise NoScheduleFoundError(
      f"solver={solver!r} found no schedule within budget={budget_bytes} bytes in "
      f"time_limit={time_limit} s; raise the time limit or the budget."
    )
  met = [t for t in tried if t.met]
  if not met:
    least = min(t.compiled.peak_bytes for t in tried)
    raise InfeasibleBudgetError(
      budget_bytes, least, f"the least XLA measured over {len(tried)} plans"
    )
  chosen = min(met, key=lambda t: t.schedule.stats["duration"])
  schedule, compiled = chosen.schedule, chosen.compiled
  attempts = tuple(t.attempt for t in tried)
  compile_time_s = sum(t.compiled.compile_time_s for t in tried)
  if verify:
    _check(verify_plan(fn, compiled.emitted, schedule, *args, **kwargs))
  schedule = schedule.replace(
    stats={
      **schedule.stats,
      "optimize": {
        "budget_bytes": budget_bytes,
        "baseline_peak_bytes": baseline,
        "attempts": [dataclasses.asdict(a) for a in attempts],
      },
    }
  )
  if cache:
    cache.store(key, schedule, info={"graph": graph.name, "versions": versions})
  return Plan(
    program,
    schedule,
    budget_bytes,
    baseline,
    compiled.peak_bytes,
    attempts,
    False,
    time.perf_counter() - start,
    compile_time_s,
    compiled.run,
  )


def _plan_info_ok(schedule: Schedule) -> bool:
  """Whether a cached plan carries the figures `_make_plan` stored with it."""
  info = schedule.stats.get("optimize")
  return isinstance(info, dict) and all(
    isinstance(info.get(k), int) for k in ("budget_bytes", "baseline_peak_bytes")
  )


@dataclasses.dataclass(frozen=True)
class _Tried:
  attempt: Attempt
  schedule: Schedule
  compiled: _Compiled
  met: bool


def _closed_loop(
  program,
  args,
  kwargs,
  budget_bytes,
  solver,
  max_replans,
  *,
  fence,
  donate_argnums,
  time_limit,
  progress,
  solver_options,
) -> list[_Tried]:
  """Solves with ``solver`` and compiles; while XLA measures over budget, plans tighter.

  The model and XLA count the same bytes but XLA adds some (buffers it holds longer,
  workspace, its own order): each round plans below the last plan's peak by what XLA
  measured beyond the budget (`next_planning_budget`). Stops at the first plan XLA
  confirms.

  Raises:
    InfeasibleBudgetError: the first solve proved the budget infeasible.
  """
  graph = program.graph
  planning = budget_bytes
  tried: list[_Tried] = []
  while len(tried) <= max_replans and planning >= graph.min_feasible_bytes:
    try:
      schedule = solve(
        graph,
        planning,
        solver=solver,
        time_limit=time_limit,
        progress=_progress_printer(progress),
        **solver_options,
      )
    except InfeasibleBudgetError as e:
      if tried:
        break
      raise InfeasibleBudgetError(budget_bytes, e.min_feasible_bytes, e.reason) from None
    except NoScheduleFoundError as e:
      logger.info("jaxremat: %s", e)
      break
    compiled = _compile(program, schedule, fence, args, kwargs, donate_argnums)
    met = compiled.peak_bytes <= budget_bytes
    attempt = Attempt(solver, planning, schedule.stats["peak_bytes"], compiled.peak_bytes)
    tried.append(_Tried(attempt, schedule, compiled, met))
    if met:
      break
    logger.info(
      "jaxremat: %s plan measures %d bytes in XLA, over the budget of %d; planning tighter.",
      solver,
      compiled.peak_bytes,
      budget_bytes,
    )
    planning = next_planning_budget(
      planning, schedule.stats["peak_bytes"], compiled.peak_bytes, budget_bytes
    )
  return tried


def next_planning_budget(
  planning_bytes: int, predicted_bytes: int, measured_bytes: int, budget_bytes: int
) -> int:
  """The planning budget after a plan that XLA measured over the budget.

  XLA is taken to add to the next plan what it added to this one, plus a margin, so the
  next plan must be that far below this plan's own peak. This plan's peak, not the
  planning budget: a segment planner's plan may sit well under the planning budget, and
  a budget cut short of its peak would return the same plan.
  """
  overshoot = measured_bytes - budget_bytes + int(_REPLAN_MARGIN * budget_bytes)
  return min(planning_bytes, predicted_bytes) - overshoot


@dataclasses.dataclass(frozen=True)
class _Compiled:
  emitted: Callable[..., Any]  # the emitted function, not jitted
  run: Callable[..., Any]  # jitted, with the donation asked for
  peak_bytes: int
  compile_time_s: float


def _compile(program, schedule, fence, args, kwargs, donate_argnums) -> _Compiled:
  # Pinning every event to the plan's order raised XLA's peak on small training steps,
  # whose jaxpr order runs the optimizer update worse than XLA's own scheduler
  # (tests/test_optimize.py); the closed loop fences recomputations only.
  emitted = emit(program, schedule, fence=fence, pin="recomputations")
  jitted = jax.jit(emitted, donate_argnums=donate_argnums)
  start = time.perf_counter()
  compiled = jitted.lower(*args, **kwargs).compile()
  return _Compiled(emitted, jitted, compat.memory_peak_bytes(compiled), time.perf_counter() - start)


def _check(v) -> None:
  if not (v.outputs_match or v.max_rel_norm_error <= _NORM_RTOL):
    raise VerificationError(
      f"The optimized step's outputs differ from the original's (max abs error "
      f"{v.max_abs_error:.3g}, norm-wise relative error {v.max_rel_norm_error:.3g}); this "
      "is a jaxremat bug: please report it with the step. Pass verify=False to skip this "
      "check."
    )
  if not v.recomputes_survive:
    raise VerificationError(
      f"XLA merged away planned recomputations (planned {dict(v.planned_recomputes)}, kept "
      f"{dict(v.surviving_recomputes)}); the memory saving is not real. Try fence='cond', "
      "or report it with the step."
    )


# -- reports --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Report:
  """The original and the optimized step side by side, as XLA measures them."""

  plan: Plan
  original: Measurement
  optimized: Measurement

  def recomputed(self) -> list[tuple[str, str, int]]:
    """``(source, primitive, count)`` of recomputed nodes, most recomputations first."""
    graph = self.plan.program.graph
    counts = collections.Counter(self.plan.schedule.computes)
    grouped: collections.Counter = collections.Counter()
    for v, n in counts.items():
      if n > 1:
        attrs = graph.nodes[v].attrs
        grouped[(attrs.get("source", "?"), attrs.get("primitive", graph.nodes[v].name))] += n - 1
    return [(src, prim, n) for (src, prim), n in grouped.most_common()]

  def __str__(self) -> str:
    p, s = self.plan, self.plan.schedule.stats
    mib = 2.0**20
    orig, opt = self.original, self.optimized
    met = "met" if opt.peak_bytes <= p.budget_bytes else "NOT met"

    def ratio(a, b):
      return f"x{a / b:.3f}" if a is not None and b else "n/a"

    rows = [
      ("", "original", "optimized", "ratio"),
      (
        "peak, model",
        f"{s['baseline_peak_bytes'] / mib:.1f} MiB",
        f"{s['peak_bytes'] / mib:.1f} MiB",
        ratio(s["peak_bytes"], s["baseline_peak_bytes"]),
      ),
      (
        "peak, XLA",
        f"{orig.peak_bytes / mib:.1f} MiB",
        f"{opt.peak_bytes / mib:.1f} MiB",
        ratio(opt.peak_bytes, orig.peak_bytes),
      ),
      (
        "duration, model",
        f"{s['baseline_duration']:.3g}",
        f"{s['duration']:.3g}",
        ratio(s["duration"], s["baseline_duration"]),
      ),
      (
        "FLOPs, XLA",
        f"{orig.flops or 0:.3g}",
        f"{opt.flops or 0:.3g}",
        ratio(opt.flops, orig.flops),
      ),
      (
        "wall time",
        f"{(orig.wall_time_s or 0) * 1e3:.2f} ms",
        f"{(opt.wall_time_s or 0) * 1e3:.2f} ms",
        ratio(opt.wall_time_s, orig.wall_time_s),
      ),
    ]
    lines = [
      f"jaxremat: {p.program.graph.name} ({p.program.graph.n} nodes) on {opt.backend}",
      f"budget {p.budget_bytes / mib:.1f} MiB: {met} (XLA measured {opt.peak_bytes / mib:.1f} MiB)",
      f"solver {self.plan.schedule.solver}: {s.get('status')} in {s.get('solve_time_s', 0):.2f} s"
      + (" (plan from cache)" if p.from_cache else f", {len(p.attempts)} plan(s)"),
      "",
    ]
    lines += [f"{a:<16}{b:>14}{c:>14}{d:>9}" for a, b, c, d in rows]
    recomputed = self.recomputed()
    lines += [
      "",
      f"recomputed: {s.get('n_recompute', 0)} node computations"
      + (", by source:" if recomputed else ""),
    ]
    lines += [f"  {n:4d} x {prim:<18} {src}" for src, prim, n in recomputed[:20]]
    return "\n".join(lines)


def make_report(optimized: OptimizedFunction, *args, runs: int = 5, **kwargs) -> Report:
  plan = optimized.plan(*args, **kwargs)
  original = measure(optimized.fn, *args, runs=runs, **kwargs)
  after = measure(plan.compiled, *args, runs=runs, **kwargs)
  return Report(plan, original, after)
