"""`jaxremat.optimize`: make a (training) step fit a memory budget, checked by XLA.

The decorator and the function it returns; the planning is `jaxremat._src.planner`'s,
the side-by-side report `jaxremat._src.report`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxremat._src.budget import BudgetLike
from jaxremat._src.errors import UnsupportedError
from jaxremat._src.planner import Plan, PlanOptions, make_plan
from jaxremat._src.report import Report, make_report
from jaxremat._src.signature import call_signature, jit_options
from jaxremat._src.solvers.base import Progress, check_options
from jaxremat._src.targets import Target
from jaxremat._src.trace import check_model

MSG_TRACED = (
  "{name} is being traced (by jax.jit, eqx.filter_jit, jax.grad or jax.vmap) before it has "
  "a plan for these argument shapes, and jaxremat plans and verifies with real arrays: call "
  "it once with arrays of these shapes (or call its .plan(*args)) before transforming it, "
  "or write optimize(jax.jit(step)) instead of jax.jit(optimize(step))."
)


class OptimizedFunction:
  """What `optimize` returns: call it like the original step.

  Attributes:
    fn: the original step.
    plans: one `Plan` per call signature seen so far (shapes, dtypes, static values).
  """

  def __init__(self, fn: Callable, options: PlanOptions, arguments: dict[str, tuple]):
    self.fn = fn
    self.options = options
    self.plans: dict[Any, Plan] = {}
    # Static and donated arguments: optimize's own and those of a jax.jit-wrapped step.
    jitted = jit_options(fn)
    self._arguments = {k: (*v, *jitted.get(k, ())) for k, v in arguments.items()}
    self._arguments["trace_scalars"] = jitted.get("trace_scalars", True)
    # Not __dict__: a wrapper's fields (Equinox's `fn`) would overwrite this object's.
    functools.update_wrapper(self, fn, updated=())

  def __call__(self, *args, **kwargs):
    return self.plan(*args, **kwargs).compiled(*args, **kwargs)

  def plan(self, *args, **kwargs) -> Plan:
    """The `Plan` for these arguments' signature, making it on first use."""
    signature = call_signature(args, kwargs, **self._arguments)
    key = signature.key
    if key not in self.plans:
      if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
        raise UnsupportedError(MSG_TRACED.format(name=getattr(self.fn, "__name__", "the step")))
      self.plans[key] = make_plan(self.fn, args, kwargs, signature, self.options)
    return self.plans[key]

  def report(self, *args, runs: int = 5, **kwargs) -> Report:
    """Plans if needed, then measures the original and optimized steps side by side."""
    return make_report(self.plan(*args, **kwargs), self.fn, args, kwargs, runs=runs)


def optimize(
  fn: Callable | None = None,
  *,
  budget: BudgetLike,
  solver: str = "auto",
  time_limit: float = 60.0,
  verify: bool | str = True,
  cache_dir: str | None = None,
  use_cache: bool = True,
  fence: str = "auto",
  max_replans: int = 7,
  donate_argnums: int | Sequence[int] = (),
  donate_argnames: str | Sequence[str] = (),
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  progress: bool | Callable[[Progress], None] = True,
  target: str | Target | None = None,
  model: str = "auto",
  **solver_options: Any,
) -> Any:
  """Makes ``fn`` run within ``budget`` bytes of device memory, recomputing the least.

  Usable as ``@jaxremat.optimize(budget=0.5)`` on a plain, `jax.jit`- or
  ``eqx.filter_jit``-wrapped step, or as ``jaxremat.optimize(step, budget="12GiB")``.
  Arguments are traced as `jax.jit` traces them (arrays and Python scalars); static
  arguments and leaves that are not arrays (as ``eqx.filter_jit`` keeps them) are baked
  in: one plan per shape, dtype and static value. The static and donated arguments of a
  `jax.jit`-wrapped step count as if given here.

  Args:
    fn: the step; omit it to get a decorator.
    budget: bytes, "12GiB", or a fraction / percentage of XLA's measured peak of ``fn``
      (with its donation).
    solver: a name from `jaxremat.available_solvers()`.
    time_limit: seconds for the whole first call per signature: costing, solves,
      compiles and verification (a compile in flight is not cut short).
    verify: check the plan before it runs (`jaxremat.verify`): outputs against the
      original within the step's own float noise, and the planned recomputations in the
      compiled HLO; also for a plan read from the cache. True or ``"auto"``: on the
      device, or on the host CPU where the original step would not fit the device;
      ``"device"`` or ``"host"`` to choose; False skips it.
    cache_dir: the plan cache (default ``$JAXREMAT_CACHE_DIR`` or ``~/.cache/jaxremat``).
    use_cache: read and write the plan cache.
    fence: how recomputations are kept from being merged away (see `jaxremat.emit`).
    max_replans: how many more plans may be compiled when XLA measures one over budget
      (at most ``1 + max_replans`` solved plans per signature; ``auto`` then tries the
      segment planners with what is left).
    donate_argnums, donate_argnames: as for `jax.jit`; the budget's fraction is taken
      of the donated original's peak.
    static_argnums, static_argnames: as for `jax.jit` (any hashable value, or an array
      by content).
    progress: print the solver's progress to stderr on solves longer than 2 s; or a
      callable that receives each `Progress` report instead.
    target: the device whose compiler measures the budget (`jaxremat.get_target`: None
      for this machine's backend, ``"tpu-v5e"``, ``"h100"``, ...). A target without
      devices here is compiled for deviceless: the budget, the baseline and the plans are
      its compiler's figures, the fence is its own, and the outputs are checked on the
      host. The step that is returned runs on this machine.
    model: the memory model plans are made in (`jaxremat.trace_program`): ``"rules"``
      (XLA:CPU's fusion rules), ``"compiler"`` (what the target compiler keeps of the
      step, read from its optimized program), or ``"auto"``: the compiler's. The rules
      were written for six float32 steps; the compiler's is closer on steps they were
      not written for (benchmarks/README.md, "The compiler's model").
    **solver_options: passed to the solver.

  Returns:
    An `OptimizedFunction` (or a decorator making one).

  Raises:
    InfeasibleBudgetError: on the first call, if the budget is below what the step's
      arguments and outputs alone take (a proof; ``min_feasible_bytes``).
    BudgetNotMetError: on the first call, if no plan found meets the budget; it carries
      the best plan found and its measured peak.

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> step = jaxremat.optimize(lambda x: jnp.tanh(x @ x).sum(), budget=1.0, solver="noremat")
    >>> float(step(jnp.eye(4)))
    3.046...
  """
  if max_replans < 0:
    raise ValueError(f"max_replans={max_replans!r} must be a non-negative count.")
  if not time_limit > 0:
    raise ValueError(f"time_limit={time_limit!r} must be a positive number of seconds.")
  if verify not in (True, False, "auto", "device", "host"):
    raise ValueError(f"verify={verify!r} must be True, False, 'auto', 'device' or 'host'.")
  check_model(model)
  if fn is not None and not callable(fn):
    raise TypeError(f"fn={fn!r} is not callable; pass the step function to optimize.")
  check_options(solver, solver_options)
  options = PlanOptions(
    budget=budget,
    solver=solver,
    time_limit=time_limit,
    verify=verify,
    cache_dir=cache_dir,
    use_cache=use_cache,
    fence=fence,
    max_replans=max_replans,
    progress=progress,
    solver_options=solver_options,
    target=target,
    model=model,
  )
  arguments = {
    "static_argnums": _as_tuple(static_argnums),
    "static_argnames": _as_tuple(static_argnames),
    "donate_argnums": _as_tuple(donate_argnums),
    "donate_argnames": _as_tuple(donate_argnames),
  }
  if fn is None:
    return lambda f: OptimizedFunction(f, options, arguments)
  return OptimizedFunction(fn, options, arguments)


def _as_tuple(x: int | str | Sequence) -> tuple:
  return (x,) if isinstance(x, (int, str)) else tuple(x)
