"""Trace a JAX function into a `RematGraph` whose baseline peak matches XLA's.

The pipeline's first stage (ARCHITECTURE.md): make a jaxpr, inline the call-like
equations (jit, custom_jvp/custom_vjp, checkpoint) into one flat jaxpr, group the
equations into nodes (folding values XLA fuses and never materializes, fact 2), size
each node by the bytes XLA keeps, and cost it with `jaxremat._src.costs`.

This module composes the stages, each a module of its own, in pipeline order:
`capture` makes the flat jaxpr (`capture.flatten_jaxpr`, `capture.drop_unread`; for the
compiler's model `capture.split_as_slices`, `capture.merge_repeats`);
`fusion` models what XLA fuses and the memory it allocates that the jaxpr does not show;
`program` groups the equations into the nodes of a `RematGraph`, sizes and costs them
(`program.build_program`, the `Program`); `xla_memory` counts the peak as XLA does
(`xla_memory.xla_accounted_peak_bytes`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import jax

from jaxremat._src import compat, hlo_model, jaxpr_text
from jaxremat._src.capture import (
  drop_unread,
  flatten_jaxpr,
  merge_repeats,
  split_as_slices,
)
from jaxremat._src.costs import equation_costs
from jaxremat._src.errors import UnsupportedError
from jaxremat._src.graph import RematGraph
from jaxremat._src.loops import shed_residuals
from jaxremat._src.program import Program, build_program
from jaxremat._src.signature import CallSignature, FlatStep, step_signature
from jaxremat._src.targets import Target, get_target


def trace_program(
  fn: Callable,
  *args,
  fold: bool = True,
  costs: str = "xla",
  workspace: bool = False,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_argnums: int | Sequence[int] = (),
  signature: CallSignature | None = None,
  name: str | None = None,
  cache_dir: str | os.PathLike | None = None,
  cost_time_limit: float | None = None,
  target: str | Target | None = None,
  model: str = "auto",
  shed_loop_bytes: int = 0,
  loop_policy: str | None = None,
  **kwargs,
) -> Program:
  """Traces ``fn(*args, **kwargs)`` into a `Program` (flat jaxpr + `RematGraph`).

  Leaves are traced as `jax.jit` traces them: arrays (``jax.Array``, numpy arrays and
  scalars, ``jax.ShapeDtypeStruct``) and Python scalars (as weakly typed arrays) are
  the jaxpr's inputs; the arguments named by ``static_argnums``/``static_argnames``
  (also those of a ``jax.jit``-wrapped ``fn``) and leaves that are not arrays (strings,
  None, functions, as ``eqx.filter_jit`` keeps them) are static: baked into the jaxpr.
  Output leaves that are not arrays are returned as they are.

  Args:
    fn: the function to trace (e.g. a training step), plain or ``jax.jit``-wrapped.
    *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
    fold: fold values that XLA fuses into their consumers (ARCHITECTURE.md fact 2)
      so that memory is charged only for what XLA keeps; False: one node per equation.
    costs: ``"xla"`` (each distinct equation compiled alone, cost analysis and a
      measured roofline), ``"measured"`` (each distinct equation timed) or ``"shape"``
      (estimates from shapes only, nothing compiled).
    workspace: give each equation that XLA runs with scratch buffers (transposed
      operand copies of dots and convolutions, `fusion.workspace_bytes`) a scratch node
      read only by it: no equations, no values, live only while that node computes.
      Off by default: the graph then has no equation-less non-input nodes, and
      `xla_memory.xla_accounted_peak_bytes` counts the scratch at each node's compute event.
    static_argnums: positions of arguments to treat as static (negative ones count
      from the end).
    static_argnames: names of keyword arguments to treat as static.
    donate_argnums: positions of donated arguments (recorded in the signature).
    signature: the call's split into traced and static leaves, made by the caller
      (`jaxremat._src.signature.call_signature`); the three arguments above are then
      ignored.
    name: the graph's name (default: the function's name).
    cache_dir: the cost cache directory (default ``$JAXREMAT_CACHE_DIR`` or
      ``~/.cache/jaxremat``).
    cost_time_limit: seconds for costing equations with XLA; equations left when they
      are spent get shape estimates (None: no limit).
    target: the device planned for (`jaxremat.get_target`; None: this machine's): its
      compiler's fusion facts group the equations and its cost analysis costs them
      (compiled deviceless, with its published peak rates, where it has no devices here).
    model: which equations keep a buffer, by ``"rules"`` (fusion rules measured on
      XLA:CPU, in the order that holds least, `order.memory_minimizing_order`, as XLA's
      scheduler orders a step to hold little) or ``"compiler"`` (the target compiler's
      optimized HLO of the step, a
      compile that also gives `Program.baseline`, `hlo_model`: which values it keeps,
      their bytes as the target lays them out, its scratch copies, and its schedule's
      order as the graph's); ``"auto"``: the compiler's, on every target, with or
      without its devices here (the rules are for a printed jaxpr without its program,
      `jaxremat.analyze`).
    shed_loop_bytes: bytes the step's differentiated `scan` loops store for the backward
      pass that the program stores less (`loops.shed_residuals`: each iteration stores
      other values of its body and the backward pass recomputes the rest from them, at
      the fewest FLOPs by the target compiler's count of each body equation);
      the program's ``loops`` says what each loop stores. 0: the loops as written.
    loop_policy: the name of a `jax.checkpoint_policies` policy (e.g. ``"dots_saveable"``):
      each such loop stores what `jax.checkpoint` with it on the loop's body would,
      whatever ``shed_loop_bytes``; None: the fewest FLOPs for ``shed_loop_bytes``.
    **kwargs: keyword arguments of ``fn``.

  Returns:
    The `Program`.

  Raises:
    ValueError: for an unknown ``costs`` mode, an argument position out of range or
      an unhashable static value.
    UnsupportedError: ``fn`` uses a traced value in Python control flow.

  Example:
    >>> import jax, jax.numpy as jnp, jaxremat
    >>> f = lambda x: (jnp.sin(x) * 2.0) @ x  # sin is fused into the mul: one node
    >>> p = jaxremat.trace_program(f, jnp.ones((4, 4)), costs="shape")
    >>> [p.graph.nodes[v].attrs["primitive"] for v in p.graph.order], p.node_eqns
    (['mul', 'dot_general'], ((), (0, 1), (2,)))
  """
  if costs not in _COST_MODES:
    raise ValueError(f"costs={costs!r} is not a cost mode; use one of {sorted(_COST_MODES)}.")
  check_model(model)
  target = get_target(target)
  if signature is None:
    signature = step_signature(
      fn,
      args,
      kwargs,
      static_argnums=static_argnums,
      static_argnames=static_argnames,
      donate_argnums=donate_argnums,
    )
  flat_fn = FlatStep(fn, signature)
  fn_name = name or getattr(fn, "__name__", None) or type(fn).__name__
  try:
    traced = jax.make_jaxpr(flat_fn)(*signature.specs)
  except jax.errors.ConcretizationTypeError as e:
    raise UnsupportedError(MSG_CONCRETE.format(name=fn_name, error=str(e).splitlines()[0])) from e
  if model == "auto":
    # The step is at hand, so its compiler says what it keeps. The rules were fitted to
    # six float32 steps on XLA:CPU: on six steps outside them they count XLA:CPU's peak
    # 12-24% under on four, the compiler's model within 10% on four (benchmarks/zoo.py).
    model = "compiler"
  flat, rewrites = shed_residuals(
    drop_unread(flatten_jaxpr(traced)),
    shed_loop_bytes,
    # The target compiler's FLOPs, as the planner compares plans by.
    lambda eqns: [
      c.flops
      for c in equation_costs(
        eqns,
        mode="shape" if costs == "shape" else "xla",
        cache_dir=cache_dir,
        time_limit_s=cost_time_limit,
        target=target,
      )
    ],
    loop_policy,
  )
  closed, compiled = flat, None
  if model == "compiler":
    flat = split_as_slices(flat)
    closed, merged_index = merge_repeats(flat)
    if fold:
      # The step as written is what XLA compiles (its figures are the step's baseline),
      # each equation named after the merged equation that stands for it in the graph.
      compiled = hlo_model.compiled_values(
        flat, target, signature.donated_leaves, scopes=merged_index, specs=signature.specs
      )
  program = build_program(
    closed,
    fold=fold,
    costs_mode=costs,
    name=fn_name,
    arg_names=signature.arg_names,
    signature=signature,
    output_split=flat_fn.outputs,
    cache_dir=cache_dir,
    cost_time_limit=cost_time_limit,
    workspace=workspace,
    target=target,
    compiled=compiled,
  )
  return dataclasses.replace(program, loops=rewrites) if rewrites else program


_MODELS = ("auto", "rules", "compiler")


def check_model(model: str) -> None:
  """Raises ValueError naming ``model`` unless it is one of `_MODELS`."""
  if model not in _MODELS:
    raise ValueError(f"model={model!r} is not a memory model; use one of {_MODELS}.")


MSG_CONCRETE = (
  "{name} uses a traced argument in Python control flow ({error}); jaxremat traces arrays "
  "and Python scalars as jax.jit does: name the argument in static_argnums or "
  "static_argnames (as for jax.jit), or use lax.cond / jnp.where."
)


def trace(fn: Callable, *args, **kwargs) -> RematGraph:
  """`trace_program(fn, *args, **kwargs).graph`: the `RematGraph` of ``fn``.

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> g = jaxremat.trace(lambda x: jnp.tanh(x @ x) @ x, jnp.ones((8, 8)), costs="shape")
    >>> g.n, len(g.inputs), g.mem[g.order[0]]  # x; x @ x, its tanh and the product kept
    (4, 1, 256)
  """
  return trace_program(fn, *args, **kwargs).graph


def save_graph(fn: Callable, *args, path: str | os.PathLike, **kwargs) -> RematGraph:
  """Traces ``fn`` and writes its graph as `jaxremat.graph/1` JSON to ``path``.

  The jaxpr text is kept in ``meta["jaxpr"]`` for people to read (jaxprs cannot be
  pickled, ARCHITECTURE.md fact 6). Returns the graph.
  """
  graph = trace(fn, *args, **kwargs)
  graph.save(path)
  return graph


def graph_from_jaxpr_text(
  text: str,
  *,
  source: str = "<jaxpr text>",
  name: str = "jaxpr",
  fold: bool = True,
  target: str | Target | None = None,
) -> RematGraph:
  """The graph of a jaxpr printed by ``print(jax.make_jaxpr(f)(*args))``.

  The text keeps shapes, dtypes and most parameters but no source locations and no
  constants; nodes, edges and sizes are those `trace` gives for the live jaxpr. Without
  a ``target`` costs are shape-based (``costs="shape"``, nothing compiled) and the
  equations are grouped by this machine's fusion facts; with one, by that target's, and
  each equation is costed by its compiler (``costs="xla"``, deviceless where needed;
  equations it cannot compile alone keep shape estimates).

  Raises:
    FormatError: naming the line and column of what the parser cannot read.
    TargetUnavailableError: the target's compiler is not installed.
  """
  parsed = jaxpr_text.parse_jaxpr_text(text, source)
  flat = jaxpr_text.inline_calls(parsed, compat.INLINE_PRIMITIVES, compat.BODY_PARAMS, source)
  closed = drop_unread(jaxpr_text.to_closed_jaxpr(flat))
  return build_program(
    closed,
    fold=fold,
    costs_mode="shape" if target is None else "xla",
    name=name,
    printed_jaxpr=text,
    target=None if target is None else get_target(target),
  ).graph


_COST_MODES = frozenset({"xla", "measured", "shape"})
