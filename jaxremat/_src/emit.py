"""`emit`: run a schedule as a JAX function whose recomputations XLA really performs.

The emitted function evaluates the traced jaxpr node by node in schedule order; a node
computed twice has its equations traced twice, and a node XLA keeps no buffer of is
evaluated inside each of its readers (`inlined_reads`). Duplicated equations alone are merged
back by XLA's common-subexpression elimination, and on XLA:CPU `optimization_barrier`
is expanded before CSE, so `jax.checkpoint` recomputation disappears there
(ARCHITECTURE.md fact 1, https://github.com/jax-ml/jax/issues/19822). Each run of
consecutive recomputations is therefore put behind one *fence* that waits for the value
the schedule computed just before the run (the *trigger*). A predicate read from the
trigger that is always true, though XLA cannot prove it (`always_true`), makes:

- ``"select"`` (the XLA:CPU default): each operand passes through
  ``where(predicate, x, 0)``, one elementwise pass; the recomputation reads the result,
  so it can neither start before the trigger nor be merged with the first computation.
  In a run of recomputations each operand is selected right before its first reader,
  on a predicate read from the value the run made before it: a select before a product
  is a copy, and selected all at the run's start, the 19 copies for an unrolled GRU's
  backward products were held at once (7 MiB; XLA measured the plan 18.7% over the model).
- ``"cond"``: the operands pass through a `lax.cond` on that predicate (the other
  branch returns zeros); XLA:CPU copies all of them at once.
- ``"cond-branch"``: the run itself is the cond's taken branch; nothing is copied.
- ``"barrier"``: `lax.optimization_barrier` over the trigger and the operands; kept by
  XLA:GPU and TPU (their barrier expander runs after scheduling), merged on XLA:CPU.
- ``"none"``: no fence (XLA merges or hoists the recomputation; a control).

Each equation of a run that reads nothing behind the fence yet gets its smallest operand
routed (a dot's weights, not its activations), so a select that XLA cannot fuse into its
reader copies little. The trigger must depend on a function input: XLA folds a predicate
read from a constant, and then CSE merges the recomputation away. A node recomputed
twice in one run starts a new run, and recomputations nobody reads are dropped (XLA
would delete them).

Fences on recomputations alone bound them from below; XLA's memory scheduler still
orders the first computations and frees as it likes, and on convolutional and
transformer steps it held 20-80% more than the plan. ``pin="all"`` (the default) also
fences each first computation on the value computed just before it, which chains the
whole program in the schedule's order (benchmarks/emit.py measures both).
``pin="checkpoint"`` fences the recomputations alone, and every later reader of a value
that went through a fence (a parameter too) reads the fence's copy, as the backward pass
reads what `jax.checkpoint`'s barrier passes. Elementwise work that a recomputation and
a later reader both do on the same values (a GELU's tanh, for its value and its
gradient; a batch norm's scaling) is then one expression that CSE merges. The plan of
``jax.checkpoint``'s ``dots_saveable`` policy on a ConvMixer step for H100 measures as the
policy does so (x0.641 of the peak at x1.018 FLOPs); with ``"recomputations"``, at the
original's peak and x1.029 (38 tanh where the policy has 32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat._src import compat
from jaxremat._src.backends import backend_facts
from jaxremat._src.errors import UnsupportedError
from jaxremat._src.hlo_model import EQUATION_SCOPE
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import simulate

FENCES = ("auto", "select", "cond", "cond-branch", "barrier", "none")
# What is fenced: every compute event (the schedule's whole order), only recomputations,
# or only recomputations with later readers reading the fenced copies.
PINS = ("all", "recomputations", "checkpoint")
# Fences that route the run's operands and leave the run itself in the main computation.
_ROUTING_FENCES = ("cond", "select", "barrier")


def default_fence(backend: str | None = None) -> str:
  """The fence that holds on ``backend`` (default: JAX's default backend).

  ``"select"`` on CPU, where XLA expands `optimization_barrier` before CSE; ``"barrier"``
  on GPU and TPU. The reasons and measurements are in `jaxremat._src.backends`.
  """
  return backend_facts(backend).fence


@dataclasses.dataclass(frozen=True)
class _Run:
  """Consecutive compute events: one first computation, or a run of recomputations."""

  nodes: tuple[int, ...]
  recompute: bool
  trigger: Any = None  # a Var the schedule computed just before a recomputation run
  reads: tuple[Any, ...] = ()  # Vars the run reads from outside itself
  routed: tuple[Any, ...] = ()  # of those, the ones a routing fence passes through
  resident: frozenset[Any] = frozenset()  # of those, function inputs (routed for the run only)
  results: tuple[Any, ...] = ()  # Vars the run makes that later runs or the outputs read


def emit(
  program_or_fn: Any,
  schedule: Schedule,
  *example_args: Any,
  fence: str = "auto",
  pin: str = "all",
  backend: str | None = None,
  fold: bool = True,
  scoped: bool = False,
  **example_kwargs: Any,
) -> Callable[..., Any]:
  """A function that runs ``schedule``: same signature and pytrees as the original.

  Args:
    program_or_fn: a `Program` from `trace_program`, or the function itself (traced
      here on the example arguments).
    schedule: a schedule valid for the program's graph (e.g. from `jaxremat.solve`).
    *example_args: example positional arguments (only used to trace a function).
    fence: ``"auto"`` (per backend, see `default_fence`) or one of ``"cond"``,
      ``"cond-branch"``, ``"select"``, ``"barrier"``, ``"none"`` (module docstring).
    pin: ``"all"`` fences every compute event on the one before it, so XLA runs the
      schedule's order (with the routing fences ``"select"``, ``"cond"``, ``"barrier"``);
      ``"recomputations"`` fences only recomputations and leaves the order of first
      computations and frees to XLA; ``"checkpoint"`` too, and later readers of a fenced
      value read the fence's copy, as after `jax.checkpoint`'s barrier.
    backend: the backend ``"auto"`` chooses for (default: JAX's default backend).
    fold: passed to `trace_program` when tracing a function; it must match the graph
      the schedule was planned on.
    scoped: each equation under the `jax.named_scope` that names it in the compiler's
      model (`hlo_model`), so that the compiled program's instructions map back to the
      program's equations (`pinned.pinned_original`).
    **example_kwargs: example keyword arguments (only used to trace a function).

  Returns:
    A function of the original's arguments, usable under `jax.jit` (also with
    ``donate_argnums``) and `jax.grad` wherever the original is. Its attributes
    ``program``, ``schedule``, ``fence`` (the one chosen), ``pin`` and ``n_fences`` say
    what it runs.

  Raises:
    ValueError: ``fence`` or ``pin`` is unknown, or ``schedule`` is not a valid program
      for the traced graph (the message carries the simulator's reason).
    UnsupportedError: the schedule recomputes a node with side effects.

  Example:
    >>> import jax, jax.numpy as jnp, jaxremat
    >>> f = lambda x: jnp.sum(jnp.sin(x) * 2.0)
    >>> program = jaxremat.trace_program(f, jnp.ones(3), costs="shape")
    >>> g = jaxremat.emit(program, jaxremat.baseline_schedule(program.graph))
    >>> bool(jnp.allclose(jax.jit(g)(jnp.ones(3)), f(jnp.ones(3))))
    True
  """
  if fence not in FENCES:
    raise ValueError(f"fence={fence!r} is not one of {FENCES}; pass 'auto' to choose per backend.")
  if pin not in PINS:
    raise ValueError(f"pin={pin!r} is not one of {PINS}; pass 'all' to run the schedule's order.")
  fence = default_fence(backend) if fence == "auto" else fence
  if _is_program(program_or_fn):
    program, fn = program_or_fn, None
  else:
    from jaxremat._src.trace import trace_program  # a later stage may import an earlier one

    fn = program_or_fn
    # Emitting needs the graph's structure and sizes only, not measured costs.
    program = trace_program(fn, *example_args, fold=fold, costs="shape", **example_kwargs)
  inlined = inlined_reads(program)
  runs = plan_runs(program, schedule, fence=fence, pin=pin, inlined=inlined)

  def emitted(*args: Any, **kwargs: Any) -> Any:
    return _Evaluator(program, inlined, scoped).execute(runs, fence, pin, *args, **kwargs)

  if fn is not None:
    functools.update_wrapper(emitted, fn)
  # `verify` reads these to count the planned recomputations.
  emitted.program, emitted.schedule, emitted.fence, emitted.pin = program, schedule, fence, pin
  emitted.n_fences = sum(r.trigger is not None for r in runs)
  return emitted


def _is_program(x: Any) -> bool:
  return all(hasattr(x, a) for a in ("jaxpr", "graph", "node_eqns", "node_outvars", "flatten_args"))


# -- planning: which equations run where, and which values go through a fence ---------


def check_schedule(program: Any, schedule: Schedule) -> None:
  """Raises a clear error unless ``schedule`` can be emitted for ``program``.

  Raises:
    ValueError: the schedule is invalid for the program's graph.
    UnsupportedError: the schedule recomputes an effectful node.
  """
  graph = program.graph
  if not isinstance(schedule, Schedule):
    raise TypeError(f"schedule must be a jaxremat.Schedule, got {type(schedule).__name__}.")
  result = simulate(graph, schedule)
  if not result.valid:
    names = (
      f" (the schedule was made for graph {schedule.graph!r}, the program's graph is "
      f"{graph.name!r})"
      if schedule.graph and schedule.graph != graph.name
      else ""
    )
    raise ValueError(
      f"schedule is not a valid program for the traced graph{names}: {result.error} "
      "Solve or build the schedule on this program's graph (program.graph)."
    )
  seen: set[int] = set()
  for kind, v in schedule.events:
    if kind != "compute":
      continue
    if v in seen and graph.nodes[v].attrs.get("effectful"):
      raise UnsupportedError(
        f"schedule recomputes node {graph.node_label(v)}, which has side effects; a "
        "schedule may compute an effectful node only once. Keep it live instead (e.g. "
        "pass it in `keep=` when building segment schedules)."
      )
    seen.add(v)


def live_computes(
  program: Any, schedule: Schedule, inlined: Sequence[tuple[int, ...] | None] | None = None
) -> list[tuple[int, bool]]:
  """``(node, is_recompute)`` for each compute event whose result is used.

  A compute none of whose values is read before the node is computed again (and that is
  no output, and has no effect) does nothing; XLA would delete it, so it is not emitted
  and not counted as a planned recomputation. Nodes that XLA keeps no buffer of are
  evaluated inside their readers (``inlined``, default `inlined_reads`), not on their own.
  """
  eqns = program.jaxpr.jaxpr.eqns
  graph = program.graph
  inlined = inlined_reads(program) if inlined is None else inlined
  computes = [v for v in schedule.computes if inlined[v] is not None]
  live = set(_vars(program.jaxpr.jaxpr.outvars))
  used = [False] * len(computes)
  for k in range(len(computes) - 1, -1, -1):
    v = computes[k]
    made = {x for i in program.node_eqns[v] for x in eqns[i].outvars}
    if graph.nodes[v].attrs.get("effectful") or made & live:
      used[k] = True
      live = (live - made) | set(_external_reads(program, _emitted_eqns(program, [v], inlined)))
  seen: set[int] = set()
  out = []
  for v, keep in zip(computes, used):
    if keep:
      out.append((v, v in seen))
      seen.add(v)
  return out


def plan_runs(
  program: Any,
  schedule: Schedule,
  *,
  fence: str = "select",
  pin: str = "all",
  inlined: Sequence[tuple[int, ...] | None] | None = None,
) -> tuple[_Run, ...]:
  """The compute events of ``schedule`` grouped into runs, with what each run's fence needs.

  A run is one first computation, or consecutive recomputations. A node recomputed twice
  within a run starts a new run: both copies would read the same fenced values, and
  XLA would merge them. Recomputation runs are fenced; with ``pin="all"`` first
  computations too (all but those before any value a fence can wait for).

  Raises:
    ValueError: as `check_schedule`.
    UnsupportedError: as `check_schedule`, or a cond-fenced run makes a value the
      untaken branch cannot stand in for (PRNG keys, tokens).
  """
  check_schedule(program, schedule)
  inlined = inlined_reads(program) if inlined is None else inlined
  producer: dict[Any, int] = {}
  for v, outvars in enumerate(program.node_outvars):
    for var in outvars:
      producer[var] = v
  groups: list[tuple[list[int], bool]] = []
  for v, recompute in live_computes(program, schedule, inlined):
    if recompute and groups and groups[-1][1] and v not in groups[-1][0]:
      groups[-1][0].append(v)
    else:
      groups.append(([v], recompute))
  eqns = program.jaxpr.jaxpr.eqns
  varying = _input_dependent(program)
  emitted = [_emitted_eqns(program, nodes, inlined) for nodes, _ in groups]
  reads = [_external_reads(program, eqn_ids) for eqn_ids in emitted]
  makes = [{x for i in eqn_ids for x in eqns[i].outvars} for eqn_ids in emitted]
  # Liveness, backwards: what each run must hand on to later runs and the outputs.
  live = set(_vars(program.jaxpr.jaxpr.outvars))
  results: list[tuple[Any, ...]] = [()] * len(groups)
  for k in range(len(groups) - 1, -1, -1):
    results[k] = tuple(x for x in _ordered_outvars(program, groups[k][0]) if x in live)
    live = (live - makes[k]) | set(reads[k])
  runs = []
  for k, (nodes, recompute) in enumerate(groups):
    run = _Run(tuple(nodes), recompute, reads=tuple(reads[k]), results=results[k])
    trigger = None
    # A cond per first computation would split the program into branches; cond-branch
    # fences recomputations only.
    pinned = pin == "all" and fence in _ROUTING_FENCES
    if fence != "none" and (recompute or pinned):
      trigger = _trigger(program, groups[:k], results[:k], varying)
      if trigger is None and recompute:
        raise UnsupportedError(
          f"nothing computed before the recomputation of nodes {nodes} is an array a fence "
          "can wait for; emit with fence='none' or move the recomputation later."
        )
    if trigger is not None:
      routed = _routed_vars(program, emitted[k])
      run = dataclasses.replace(
        run,
        trigger=trigger,
        routed=routed if fence in _ROUTING_FENCES else (),
        resident=frozenset()
        if pin == "checkpoint"
        else frozenset(x for x in routed if not _made_by_node(x, producer, program)),
      )
      if fence == "cond-branch":
        _check_cond_results(program, run)
    runs.append(run)
  return tuple(runs)


def inlined_reads(program: Any) -> tuple[tuple[int, ...] | None, ...]:
  """Per node, the nodes without a buffer that it reads, directly or through each other,
  in graph order; None for those nodes themselves.

  A value XLA duplicates into each reader's fusion (node attribute ``duplicated``) has no
  bytes in the graph: its readers hold its operands instead (`program.build_program`
  gives them its operands' edges). So the emitted program evaluates it inside each
  reader, from the copies of its operands live there, as XLA does. Read from its own
  first computation, it kept that first copy of a recomputed operand live as well: on the
  ResNet step for TPU v5e, three 8 MiB convolution outputs that a plan recomputed stayed
  live through the backward pass. A kept value that XLA computes again inside a reader
  (node attribute ``remakes`` of the reader) is evaluated inside it too, from the
  buffers of its own operands (one it remakes in turn is read, not made again: XLA:TPU
  computes each of a Mixer's layer norm gradients again inside the next one's fusion,
  reading the one before from its buffer). No product is
  duplicated in the graph (`fusion.group_equations`): evaluated in each reader's fenced
  run, it would be computed once per reader. (On TPU v5e, the GPT step's plan at 0.7
  pinned in its order ran 16 products more than planned: x1.44 of the step's FLOPs where
  the model counted x1.18.)
  """
  graph, eqns = program.graph, program.jaxpr.jaxpr.eqns
  outputs = set(_vars(program.jaxpr.jaxpr.outvars))
  inline = {
    v
    for v, node in enumerate(graph.nodes)
    if node.attrs.get("duplicated") and not outputs & set(program.node_outvars[v])
  }
  made_by = {x: v for v in inline for x in program.node_outvars[v]}
  out: list[tuple[int, ...] | None] = []
  for v in range(len(graph.nodes)):
    if v in inline:
      out.append(None)
      continue
    found: set[int] = set()
    todo = [v]
    while todo:
      u = todo.pop()
      reads = _vars(x for i in program.node_eqns[u] for x in eqns[i].invars)
      # A kept value computed again here reads its own operands' buffers, as XLA does.
      remade = graph.nodes[u].attrs.get("remakes", ()) if u == v or u in inline else ()
      for d in [*remade, *map(made_by.get, reads)]:
        if d is not None and d not in found:
          found.add(d)
          todo.append(d)
    out.append(tuple(sorted(found)))
  return tuple(out)


def _emitted_eqns(
  program: Any, nodes: Sequence[int], inlined: Sequence[tuple[int, ...] | None]
) -> list[int]:
  """The equations a run of ``nodes`` evaluates: each node's inlined reads, then its own."""
  return [i for v in nodes for u in (*inlined[v], v) for i in program.node_eqns[u]]


def _vars(xs: Any) -> list[Any]:
  """The Vars among ``xs`` (no Literals)."""
  return [x for x in xs if not isinstance(x, compat.Literal)]


def _external_reads(program: Any, eqn_ids: Sequence[int]) -> list[Any]:
  """Vars equations ``eqn_ids`` read that they do not make, in first-read order."""
  eqns = program.jaxpr.jaxpr.eqns
  made: set[Any] = set()
  out: dict[Any, None] = {}
  for i in eqn_ids:
    for x in _vars(eqns[i].invars):
      if x not in made:
        out[x] = None
    made.update(eqns[i].outvars)
  return list(out)


def _ordered_outvars(program: Any, nodes: Sequence[int]) -> list[Any]:
  eqns = program.jaxpr.jaxpr.eqns
  return [
    x
    for v in nodes
    for i in program.node_eqns[v]
    for x in eqns[i].outvars
    if not isinstance(x, compat.DropVar)
  ]


def _check_cond_results(program: Any, run: _Run) -> None:
  for x in run.results:
    if not _fenceable(x):
      raise UnsupportedError(
        f"the recomputation of nodes {list(run.nodes)} makes a value of type {x.aval} that a "
        "cond fence cannot stand in for in its untaken branch; emit with fence='barrier' "
        "or keep that node live instead of recomputing it."
      )


def _trigger(
  program: Any,
  groups: Sequence[tuple[Sequence[int], bool]],
  results: Sequence[Sequence[Any]],
  varying: set[Any],
) -> Any:
  """The value computed last before ``run`` that a fence can read an exact predicate from.

  A first computation leaves all its values in the environment; a recomputation run
  only its ``results``. The value must depend on a function input: XLA folds a
  predicate read from a constant (e.g. the ``N - ddof > 0`` of ``jnp.var``) to true, and
  then CSE merges the recomputation with the first computation.
  """
  eqns = program.jaxpr.jaxpr.eqns
  for (nodes, recompute), made in zip(reversed(groups), reversed(results)):
    if recompute:
      candidates = list(reversed(made))
    else:
      candidates = [
        x
        for v in reversed(nodes)
        for i in reversed(program.node_eqns[v])
        for x in eqns[i].outvars
        if not isinstance(x, compat.DropVar)  # never in the environment
      ]
    for var in candidates:
      if var in varying and _fenceable(var) and np.prod(var.aval.shape, dtype=int) > 0:
        return var
  return None


def _input_dependent(program: Any) -> set[Any]:
  """Vars whose value depends on a function input (XLA cannot constant-fold them)."""
  varying = set(program.jaxpr.jaxpr.invars)
  for eqn in program.jaxpr.jaxpr.eqns:
    if any(not isinstance(x, compat.Literal) and x in varying for x in eqn.invars):
      varying.update(eqn.outvars)
  return varying


def _fenceable(var: Any) -> bool:
  if isinstance(var, (compat.Literal, compat.DropVar)):
    return False
  aval = var.aval
  dtype = getattr(aval, "dtype", None)
  return (
    dtype is not None
    and hasattr(aval, "shape")
    and not compat.is_extended_dtype(dtype)
    and (jnp.issubdtype(dtype, np.number) or dtype == np.bool_)
  )


def _made_by_node(x: Any, producer: dict, program: Any) -> bool:
  return x in producer and not program.graph.is_input[producer[x]]


def _routed_vars(program: Any, eqn_ids: Sequence[int]) -> tuple[Any, ...]:
  """The values a routing fence must pass so that each of a run's equations (``eqn_ids``)
  waits for it.

  An equation that reads nothing behind the fence gets its smallest fenceable operand
  routed (a dot's or convolution's weights rather than its activations): the equation
  then waits for the trigger and differs from the first computation, so XLA can neither
  hoist nor merge it, and a fence that XLA cannot fuse into the reader (a `select` before
  a dot) copies the small value, not the large one.
  """
  eqns = program.jaxpr.jaxpr.eqns
  made: set[Any] = set()  # vars produced inside the run so far
  behind: set[Any] = set()  # vars that depend on the fence
  fenced: dict[Any, None] = {}
  for i in eqn_ids:
    eqn = eqns[i]
    reads = _vars(eqn.invars)
    if not any(x in fenced or x in behind for x in reads):
      outside = [
        x
        for x in reads
        if x not in made and (_fenceable(x) or _is_key(getattr(x.aval, "dtype", None)))
      ]
      if outside:
        fenced[min(outside, key=lambda x: compat.aval_bytes(x.aval))] = None
    if any(x in fenced or x in behind for x in reads):
      behind.update(eqn.outvars)
    made.update(eqn.outvars)
  return tuple(fenced)


def _is_key(dtype: Any) -> bool:
  """Whether ``dtype`` is that of PRNG keys: a recomputation reading them gets them routed
  as their key data (`apply_fence`), so that a recomputed `random_bits` waits for the
  fence. Not routed, XLA merged it with the first draw and held the random bits from the
  forward pass to the backward one (a dropout autoencoder on XLA:CPU, 4.3 MiB over the
  plan)."""
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# -- running ---------------------------------------------------------------------------


class _Evaluator:
  """Evaluates runs of nodes on an environment of values, one call of the function.

  A node without a buffer is evaluated again inside each reader (`inlined_reads`) unless
  its operands are the very values it was last evaluated on: equal equations on equal
  operands would be merged by XLA anyway, and the traced program stays as small.
  """

  def __init__(self, program: Any, inlined: Sequence[tuple[int, ...] | None], scoped: bool):
    self.program, self.inlined, self.scoped = program, inlined, scoped
    self.outer_stack = compat.current_name_stack()
    self.reads: dict[int, list[Any]] = {}  # inlined node -> the vars it reads
    self.last: dict[int, tuple[list[Any], list[Any]]] = {}  # inlined node -> operands, outputs

  def execute(self, runs: Sequence[_Run], fence: str, pin: str, *args: Any, **kwargs: Any) -> Any:
    program = self.program
    leaves = program.flatten_args(*args, **kwargs)
    closed = program.jaxpr
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.invars, leaves))
    env.update(zip(jaxpr.constvars, closed.consts))
    for run in runs:
      if run.trigger is None:
        self.eval_nodes(run.nodes, env)
      elif fence in _ROUTING_FENCES:
        # After a cond, later readers read the routed copy, so the original can die at the
        # fence; so they do after any fence with ``pin="checkpoint"``. Otherwise a select
        # is only read by the run: XLA fuses it into later readers, which would then keep
        # the original and the trigger alive as well as the copy.
        hand_on = fence == "cond" or pin == "checkpoint"
        local = dict(env)
        for nodes, due, trigger in self.routing(run, fence):
          with self.scope(program.node_eqns[nodes[0]][-1]):
            local[trigger], routed = apply_fence(fence, local[trigger], [env[x] for x in due])
          if trigger is run.trigger:
            env[run.trigger] = local[trigger]
          for x, value in zip(due, routed):
            local[x] = value
            if hand_on and x not in run.resident:
              env[x] = value
          self.eval_nodes(nodes, local)
        # A first computation leaves all its values behind: a later fence may read one.
        made = run.results if run.recompute else _ordered_outvars(program, run.nodes)
        env.update((x, local[x]) for x in made)
      else:
        env.update(zip(run.results, self.cond_run(run, env)))
    return program.unflatten_outputs([_read(env, x) for x in jaxpr.outvars])

  def routing(self, run: _Run, fence: str) -> list[tuple[tuple[int, ...], list[Any], Any]]:
    """``run``'s nodes in groups, each with the routed values a fence passes right before
    it and the value the fence waits for: one group, all at the run's start, or, for
    ``"select"`` in a run of recomputations, each value before its first reader, waiting
    for the last value the node before it made from what is behind the fence (a select's
    copy then lives for its reader, not the whole run)."""
    if fence != "select" or not run.recompute:
      return [(run.nodes, list(run.routed), run.trigger)]
    eqns = self.program.jaxpr.jaxpr.eqns
    groups = []
    left, behind, trigger = list(run.routed), set(run.routed), run.trigger
    for v in run.nodes:
      evaluated = self.evaluated(v)
      reads = {x for i in evaluated for x in _vars(eqns[i].invars)}
      due = [x for x in left if x in reads]
      left = [x for x in left if x not in reads]
      groups.append(((v,), due, trigger))
      own = set(self.program.node_eqns[v])  # an inlined node's values may come from a cache
      for i in evaluated:
        if any(x in behind for x in _vars(eqns[i].invars)):
          behind.update(eqns[i].outvars)
          if i in own:
            trigger = next((x for x in reversed(eqns[i].outvars) if _waitable(x)), trigger)
    groups[0][1].extend(left)
    return groups

  def evaluated(self, v: int) -> list[int]:
    """The equations `eval_nodes` evaluates for node ``v``, in order."""
    return [i for u in (*(self.inlined[v] or ()), v) for i in self.program.node_eqns[u]]

  def cond_run(self, run: _Run, env: dict) -> list[Any]:
    """Evaluates ``run`` as the always-taken branch of a cond on its trigger."""

    def taken(operands: list[Any]) -> list[Any]:
      local = dict(zip(run.reads, operands))
      self.eval_nodes(run.nodes, local)
      return [local[x] for x in run.results]

    def untaken(operands: list[Any]) -> list[Any]:
      del operands
      return [jnp.zeros(x.aval.shape, x.aval.dtype) for x in run.results]

    operands = [env[x] for x in run.reads]
    return list(lax.cond(always_true(env[run.trigger]), taken, untaken, operands))

  def eval_nodes(self, nodes: Sequence[int], env: dict) -> None:
    for v in nodes:
      for u in self.inlined[v]:
        self.eval_inlined(u, env)
      self.eval_eqns(self.program.node_eqns[v], env)

  def eval_inlined(self, u: int, env: dict) -> None:
    eqn_ids = self.program.node_eqns[u]
    if u not in self.reads:
      self.reads[u] = _external_reads(self.program, eqn_ids)
    operands = [env[x] for x in self.reads[u]]
    outvars = self.program.node_outvars[u]
    last = self.last.get(u)
    if last is not None and all(a is b for a, b in zip(last[0], operands, strict=True)):
      env.update(zip(outvars, last[1]))
      return
    self.eval_eqns(eqn_ids, env)
    self.last[u] = (operands, [env[x] for x in outvars])

  def scope(self, i: int) -> Any:
    """Where ``scoped``, the scope that names equation ``i``; a fence is named after the
    first node it fences for, which reads what it passes."""
    return jax.named_scope(f"{EQUATION_SCOPE}{i}") if self.scoped else contextlib.nullcontext()

  def eval_eqns(self, eqn_ids: Sequence[int], env: dict) -> None:
    eqns = self.program.jaxpr.jaxpr.eqns
    for i in eqn_ids:
      eqn = eqns[i]
      with compat.user_context(eqn, self.outer_stack), compat.eqn_ctx_manager(eqn), self.scope(i):
        outs = eqn.primitive.bind(*[_read(env, x) for x in eqn.invars], **compat.bind_params(eqn))
      if not eqn.primitive.multiple_results:
        outs = [outs]
      for var, value in zip(eqn.outvars, outs):
        if not isinstance(var, compat.DropVar):
          env[var] = value


def _read(env: dict, x: Any) -> Any:
  return x.val if isinstance(x, compat.Literal) else env[x]


def _waitable(x: Any) -> bool:
  """Whether a fence's predicate can be read from var ``x`` (`always_true`)."""
  return (
    not isinstance(x, compat.DropVar) and math.prod(x.aval.shape) > 0 and not _is_key(x.aval.dtype)
  )


def apply_fence(fence: str, trigger: Any, values: Sequence[Any]) -> tuple[Any, list[Any]]:
  """``trigger`` and ``values``, unchanged, but the values only available after it.

  ``"cond"`` passes the values through a cond on an always-true predicate read from
  ``trigger`` (copying them on XLA:CPU); ``"select"`` is ``where(predicate, x, 0)``;
  ``"barrier"`` is `optimization_barrier` over the trigger and the values, and returns
  the barrier's copy of the trigger for its later readers: XLA's algebraic simplifier
  drops a barrier operand whose copy nobody reads, and without its trigger the barrier
  no longer orders anything (on the GPT example for H100 a recomputation moved into the
  forward pass, 3 MiB over the plan).
  """
  values = list(values)
  if fence == "none" or not values:
    return trigger, values
  if any(_is_key(v.dtype) for v in values):  # fences take the keys' data
    data = [jax.random.key_data(v) if _is_key(v.dtype) else v for v in values]
    trigger, out = apply_fence(fence, trigger, data)
    return trigger, [
      jax.random.wrap_key_data(x, impl=jax.random.key_impl(v)) if _is_key(v.dtype) else x
      for x, v in zip(out, values, strict=True)
    ]
  if fence == "barrier":
    trigger, out = lax.optimization_barrier((trigger, values))
    return trigger, list(out)
  if fence == "select":
    pred = always_true(trigger)
    selected = [lax.select(compat.broadcast_as(pred, v), v, jnp.zeros_like(v)) for v in values]
    return trigger, selected
  if fence == "cond":
    return trigger, list(lax.cond(always_true(trigger), _identity, _zeros_like, values))
  raise ValueError(f"fence={fence!r} is not one of {_ROUTING_FENCES + ('none',)}.")


def always_true(x: Any) -> Any:
  """A scalar predicate read from ``x`` that is true for every value, NaN included.

  The first element's bits OR 1 are never zero; XLA does no bit-level range analysis,
  so it cannot fold the comparison, and the predicate waits for ``x``. The element is read
  in place, not from ``x`` flattened: flattening a value sharded along a minor dimension
  gathers it whole on every device. A value sharded in its type (a mesh with explicit
  axes) cannot give one element; its largest one does.
  """
  x = lax.stop_gradient(jnp.real(x) if jnp.iscomplexobj(x) else x)
  try:
    first = x[(0,) * jnp.ndim(x)]
  except compat.ShardingTypeError:
    first = jnp.max(x)
  if first.dtype == np.bool_:
    bits = first.astype(np.uint8)
  else:
    bits = lax.bitcast_convert_type(first, np.dtype(f"uint{8 * first.dtype.itemsize}"))
  return (bits | 1) != 0


def _identity(values: list[Any]) -> list[Any]:
  return values


def _zeros_like(values: list[Any]) -> list[Any]:
  return [jnp.zeros_like(v) for v in values]
