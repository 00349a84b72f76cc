"""Program capture: a traced jaxpr with its call-like equations inlined into one flat jaxpr.

The pipeline's first stage (ARCHITECTURE.md): jit/pjit, custom_jvp_call, custom_vjp_call
and checkpoint equations are evaluated in place (`flatten_jaxpr`), and equations read by
nothing dropped (`drop_unread`); for the compiler's model, each split becomes a slice per
output (`split_as_slices`), and equations that repeat an earlier one are merged as XLA's
CSE merges them (`merge_repeats`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxremat._src import compat
from jaxremat._src.signature import abstract, is_array

# -- what a jaxpr computes ----------------------------------------------------------------


def value_dtypes(jaxpr: Any) -> set[Any]:
  """The dtypes of the values an open ``jaxpr`` computes, in its inner jaxprs too."""
  dtypes, bodies = set(), [jaxpr]
  while bodies:
    for eqn in bodies.pop().eqns:
      dtypes.update(v.aval.dtype for v in eqn.outvars if hasattr(v.aval, "dtype"))
      bodies.extend(compat.inner_jaxprs(eqn))
  return dtypes


# -- inlining ----------------------------------------------------------------------------


def flatten_jaxpr(closed: Any) -> Any:
  """Inlines jit/pjit, custom_jvp_call, custom_vjp_call and checkpoint equations.

  Re-traces the jaxpr with the call bodies evaluated in place, keeping each
  equation's traceback and (outer + inner) name stack, and the `optimization_barrier`
  JAX lowers a backward pass's checkpoint behind. scan, while and cond stay.
  """
  jaxpr, _ = compat.open_jaxpr(closed)
  if not any(compat.inline_body(e) is not None for e in jaxpr.eqns):
    return closed
  return retrace(closed, lambda k, eqn, invals: _inlined(eqn, invals))


def drop_unread(closed: Any) -> Any:
  """Flat ``closed`` without the equations that have no effects and whose outputs
  nothing reads, as XLA compiles none of them.

  JAX leaves some in a gradient (a reduction and a division of each `jax.nn.softmax`): as
  nodes read by nothing, a plan that freed the values they read made them again for those
  nodes alone. On a 6-block ViT, segment plans recomputed every block's attention at the
  end of the forward pass for them.
  """
  jaxpr, _ = compat.open_jaxpr(closed)
  read = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in read for v in eqn.outvars):
      kept.append(eqn)
      read.update(v for v in eqn.invars if not isinstance(v, compat.Literal))
  if len(kept) == len(jaxpr.eqns):
    return closed
  return compat.replace_body(closed, kept[::-1], jaxpr.outvars)


def split_as_slices(closed: Any) -> Any:
  """Flat ``closed`` with each `split` equation bound as one `slice` per output that is
  read, so that each output is an equation of its own.

  XLA lowers a split to a slice per output and fuses or keeps each one apart; the
  compiler's model (`hlo_model`) knows which only per equation. On a ViT's step for
  TPU v5e, XLA kept the value slice of the attention's ``q, k, v = split(qkv)`` and read q
  and k from the buffer of the reshape before it. As one equation, the split stood for
  all three at the bytes of one: a plan that kept it and freed the reshape measured
  24 MiB a block over the model, where XLA held q and k apart.
  """
  jaxpr, _ = compat.open_jaxpr(closed)
  if not any(e.primitive is jax.lax.split_p for e in jaxpr.eqns):
    return closed
  # The slices of outputs nothing reads are read by nothing either.
  return drop_unread(retrace(closed, lambda k, eqn, invals: _as_slices(eqn, invals)))


def _as_slices(eqn: Any, invals: list[Any]) -> list[Any] | None:
  """A split equation's outputs as slices of its operand; None for any other equation."""
  if eqn.primitive is not jax.lax.split_p:
    return None
  (operand,) = invals
  axis, sizes = eqn.params["axis"], eqn.params["sizes"]
  ends = np.cumsum(sizes).tolist()
  return [
    jax.lax.slice_in_dim(operand, end - n, end, axis=axis)
    for n, end in zip(sizes, ends, strict=True)
  ]


def merge_repeats(closed: Any) -> tuple[Any, tuple[int, ...]]:
  """Drops each equation of flat ``closed`` that repeats an earlier one (the same
  primitive, parameters and operands, no effects); its readers read the earlier one's
  outputs. Returns the merged jaxpr and, per equation of ``closed``, the index of the
  merged equation that computes its outputs.

  XLA's CSE merges such repeats into one instruction, named after one of them, on every
  backend. The compiler's model (`hlo_model`) needs it: a normalization's ``x - mean``,
  computed again inside ``jnp.var``, is one buffer in XLA, and the unnamed copy, folded
  into its backward readers, kept the convolution output it reads alive until the
  backward pass. On H100 that put the ResNet example at x1.28 of XLA's peak and the
  MobileNet at x1.20; merged, x1.02 and x0.96. XLA:CPU's fusion rules were measured on
  the jaxpr as traced and stay with it (merged, they put a BatchNorm-ReLU6 stack 27%
  under XLA:CPU's peak).
  """
  jaxpr, _ = compat.open_jaxpr(closed)
  renamed: dict[Any, Any] = {}  # an output of a dropped repeat -> the kept output

  def read(v: Any) -> Any:
    return v if isinstance(v, compat.Literal) else renamed.get(v, v)

  first: dict[tuple, int] = {}  # an equation's key -> the merged equation computing it
  eqns: list[Any] = []
  index: list[int] = []
  for eqn in jaxpr.eqns:
    eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
    key = _cse_key(eqn)
    k = first.get(key) if key is not None else None
    kept = None if k is None else eqns[k].outvars
    if kept is not None and not any(
      isinstance(a, compat.DropVar) and not isinstance(b, compat.DropVar)
      for a, b in zip(kept, eqn.outvars, strict=True)
    ):
      renamed.update(zip(eqn.outvars, kept, strict=True))
      index.append(k)
      continue
    if key is not None:
      first.setdefault(key, len(eqns))
    index.append(len(eqns))
    eqns.append(eqn)
  if len(eqns) == len(jaxpr.eqns):
    return closed, tuple(index)
  return compat.replace_body(closed, eqns, [read(v) for v in jaxpr.outvars]), tuple(index)


# -- re-tracing ---------------------------------------------------------------------------


def retrace(closed: Any, run_eqn: Callable[[int, Any, list[Any]], list[Any] | None]) -> Any:
  """``closed`` traced again, equation by equation: ``run_eqn(index, eqn, operands)``
  gives an equation's outputs, or None to bind it as it is."""
  jaxpr, consts = compat.open_jaxpr(closed)
  n_consts = len(consts)

  def run(*args):
    return _run_eqns(jaxpr, args[:n_consts], args[n_consts:], run_eqn)

  specs = [
    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
    for v in jaxpr.invars
  ]
  const_specs = [abstract(c) if is_array(c) else c for c in consts]
  inner, inner_consts = compat.open_jaxpr(jax.make_jaxpr(run)(*const_specs, *specs))
  return _close_over(inner, inner_consts, n_consts, consts)


def _run_eqns(
  jaxpr: Any,
  consts: Sequence[Any],
  args: Sequence[Any],
  run_eqn: Callable[[int, Any, list[Any]], list[Any] | None],
) -> list[Any]:
  """Evaluates ``jaxpr``, each equation by ``run_eqn`` (as in `retrace`) or bound."""
  env = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  outer = compat.current_name_stack()
  for k, eqn in enumerate(jaxpr.eqns):
    invals = [read(env, v) for v in eqn.invars]
    with compat.user_context(eqn, outer):
      outs = run_eqn(k, eqn, invals)
    if outs is None:
      _bind(eqn, invals, env, outer)
    else:
      _write(env, eqn.outvars, outs)
  return [read(env, v) for v in jaxpr.outvars]


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> dict[Any, Any]:
  """Every value of open ``jaxpr`` on ``consts`` and ``args``, by variable."""
  env = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  evaluate_eqns(jaxpr.eqns, env)
  return env


def evaluate_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
  """Binds ``eqns`` in order on the values in ``env``, adding their outputs to it."""
  outer = compat.current_name_stack()
  for eqn in eqns:
    _bind(eqn, [read(env, v) for v in eqn.invars], env, outer)


def read(env: dict[Any, Any], v: Any) -> Any:
  """The value of variable or literal ``v``."""
  return v.val if isinstance(v, compat.Literal) else env[v]


def _bind(eqn: Any, invals: list[Any], env: dict[Any, Any], outer_name_stack: Any) -> None:
  with compat.user_context(eqn, outer_name_stack), compat.eqn_ctx_manager(eqn):
    outs = eqn.primitive.bind(*invals, **compat.bind_params(eqn))
  _write(env, eqn.outvars, outs if eqn.primitive.multiple_results else [outs])


def _write(env: dict[Any, Any], outvars: Sequence[Any], values: Sequence[Any]) -> None:
  for v, x in zip(outvars, values, strict=True):
    if not isinstance(v, compat.DropVar):
      env[v] = x


def _close_over(jaxpr: Any, extra_consts: list[Any], n_consts: int, consts: list[Any]) -> Any:
  """Turns the first ``n_consts`` invars back into constvars holding ``consts``."""
  return compat.close_jaxpr(
    jaxpr,
    [*jaxpr.constvars, *jaxpr.invars[:n_consts]],
    jaxpr.invars[n_consts:],
    [*extra_consts, *consts],
  )


def _inlined(eqn: Any, invals: list[Any]) -> list[Any] | None:
  """The outputs of a call equation with its body evaluated in place, calls inside it
  inlined too; None for any other equation."""
  body = compat.inline_body(eqn)
  if body is None:
    return None
  inner, inner_consts = body
  invals = _behind_barrier(invals, compat.barrier_operands(eqn))
  in_shardings, out_shardings = compat.call_shardings(eqn)
  outs = _run_eqns(
    inner, inner_consts, _constrained(invals, in_shardings), lambda k, e, xs: _inlined(e, xs)
  )
  return _constrained(outs, out_shardings)


def _constrained(values: list[Any], shardings: Sequence[Any]) -> list[Any]:
  """``values``, each under its sharding where one is given: an inlined `jax.jit`'s
  ``in_shardings``/``out_shardings`` kept as sharding constraints."""
  if not any(s is not None for s in shardings):
    return values
  return [
    x if s is None else jax.lax.with_sharding_constraint(x, s)
    for x, s in zip(values, shardings, strict=True)
  ]


def _behind_barrier(values: list[Any], mask: Sequence[bool]) -> list[Any]:
  """``values``, those ``mask`` marks passed through one `optimization_barrier`, as JAX
  lowers a checkpoint's recomputation: on TPU and GPU its compiler keeps the user's
  recomputation only behind it."""
  if not any(mask):
    return values
  fenced = iter(jax.lax.optimization_barrier([x for x, m in zip(values, mask) if m]))
  return [next(fenced) if m else x for x, m in zip(values, mask)]


def _cse_key(eqn: Any) -> tuple | None:
  """What makes an equation's outputs equal to another's: primitive, parameters and the
  operands (variables by identity, literals by value). None for effects and unhashable
  parameters."""
  if eqn.effects:
    return None
  key = (eqn.primitive, tuple(map(_operand_key, eqn.invars)), tuple(sorted(eqn.params.items())))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _operand_key(v: Any) -> Any:
  """A variable by identity; a literal (a scalar) by its value's bytes (0.0 is not -0.0)."""
  if not isinstance(v, compat.Literal):
    return v
  value = np.asarray(v.val)
  return (type(v.val).__name__, value.dtype.str, value.tobytes())
