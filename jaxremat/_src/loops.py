"""Loops that store less for the backward pass: a forward `scan` and the scan that reads
its residuals, rewritten so that each iteration stores what the plan chose.

JAX differentiates a `lax.scan` into a forward scan that stacks, over its iterations,
every residual its backward scan reads (for a scan over layers, usually the step's
peak), and that backward scan. `residual_loops` finds such pairs in a flat jaxpr and
states each body's choice as a `solvers.residuals.BodyProblem`; `store_less` rewrites
the pairs so that the forward scan stacks only the values chosen and the backward body
recomputes the rest from them, per iteration. Both stay loops: the compiled program
stays O(1) in the trip count, and XLA cannot merge the backward body's recomputation
with the forward body's (they are different loops), so no fence is needed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxremat._src import capture, compat, costs
from jaxremat._src.solvers.residuals import (
  BodyChoice,
  BodyProblem,
  choose_stored,
  grouped,
  policy_choice,
)

# Counts the FLOPs of each of a sequence of equations.
FlopsOf = Callable[[Sequence[Any]], list[float]]


@dataclasses.dataclass(frozen=True)
class LoopRewrite:
  """One loop that stores less for the backward pass than the step as written.

  Attributes:
    line: the loop, what each iteration stores and what the backward pass recomputes,
      with source lines, and who chose it.
    stored_bytes: bytes stacked over the iterations.
    recomputed_flops: FLOPs the backward pass recomputes over the iterations (the
      target compiler's count of each body equation).
    policy_flops: per policy of `POLICIES`, the FLOPs its choice for the loop would
      recompute (`ResidualLoop.policy_choice`), known before any is rewritten so.
  """

  line: str
  stored_bytes: int
  recomputed_flops: float
  policy_flops: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)


# The `jax.checkpoint_policies` whose choices a loop may store instead of the knapsack's
# (`shed_residuals`), each recomputing more than the one before.
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable")


@dataclasses.dataclass(frozen=True)
class ResidualLoop:
  """A forward scan whose stacked outputs ``residuals`` only one backward scan reads.

  Attributes:
    forward: index of the forward scan in the flat jaxpr's equations.
    backward: index of the backward scan.
    residuals: positions among the forward body's outputs of the residuals (each read
      by the backward scan alone, as stacked inputs).
    problem: the body's choice (`BodyProblem`), values numbered as in ``body_vars``.
    body_vars: the forward body's variables, in the problem's order.
    body_eqns: the forward body's equations, in the problem's order.
    source: where the loop is in the user's code.
  """

  forward: int
  backward: int
  residuals: tuple[int, ...]
  problem: BodyProblem
  body_vars: tuple[Any, ...]
  body_eqns: tuple[Any, ...]
  source: str

  def policy_choice(self, policy: Callable[..., Any]) -> BodyChoice:
    """What `jax.checkpoint` with ``policy`` on the body would store."""
    saved = {e for e, eqn in enumerate(self.body_eqns) if compat.policy_saves(policy, eqn)}
    return policy_choice(self.problem, saved)

  def rewrite(self, choice: BodyChoice, chosen_by: str) -> LoopRewrite:
    """The loop storing ``choice``, described in one line."""
    trips = self.problem.trips
    was = self.problem.stored_bytes(self.problem.residuals) // trips
    counts = collections.Counter(
      f"{self.body_eqns[e].primitive.name} at {compat.eqn_source(self.body_eqns[e])}"
      for e in choice.recomputed
    )
    recomputed = "; ".join(f"{n} x {name}" for name, n in counts.most_common())
    held = f"stores {len(choice.stored)} value(s), "
    if choice.group > 1:
      held = (
        f"in groups of {choice.group}: stacks the carry each group starts from, and the "
        f"backward pass runs each group forward again, stacking {len(choice.stored)} "
        f"value(s) per iteration for it; on average "
      )
    line = (
      f"scan at {self.source} ({trips} iterations) {held}{choice.stored_bytes // trips} "
      f"bytes per iteration (was {was}), as {chosen_by} chose; the backward pass "
      f"recomputes {len(choice.recomputed)} equation(s)" + (f": {recomputed}" if recomputed else "")
    )
    policy_flops = {
      name: self.policy_choice(getattr(jax.checkpoint_policies, name)).recomputed_flops
      for name in POLICIES
    }
    return LoopRewrite(line, choice.stored_bytes, choice.recomputed_flops, policy_flops)


def residual_loops(closed: Any, flops_of: FlopsOf | None = None) -> list[ResidualLoop]:
  """The forward/backward scan pairs of flat ``closed`` whose residuals a plan may store
  differently. ``flops_of(eqns)`` counts each body equation's FLOPs (default: from
  shapes, `costs.shape_flops`)."""
  jaxpr, _ = compat.open_jaxpr(closed)
  readers: dict[Any, list[tuple[int, int]]] = {}  # var -> [(equation, operand position)]
  for k, eqn in enumerate(jaxpr.eqns):
    for pos, v in enumerate(eqn.invars):
      if not isinstance(v, compat.Literal):
        readers.setdefault(v, []).append((k, pos))
  outputs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}
  loops = []
  for k, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "scan" or eqn.effects:
      continue
    _, n_carry = compat.scan_counts(eqn)
    residuals, backward = [], None
    for pos, v in enumerate(eqn.outvars[n_carry:], start=n_carry):
      if isinstance(v, compat.DropVar) or v in outputs or v not in readers:
        continue
      scans = {r for r, p in readers[v] if _reads_as_stacked_input(jaxpr.eqns[r], p)}
      if len(scans) == 1 and len(readers[v]) == len([1 for r, p in readers[v] if r in scans]):
        (r,) = scans
        if backward in (None, r):
          backward = r
          residuals.append(pos)
    if backward is None:
      continue
    problem, body_vars = _body_problem(eqn, residuals, flops_of)
    body_eqns = tuple(compat.open_jaxpr(eqn.params["jaxpr"])[0].eqns)
    loops.append(
      ResidualLoop(
        k, backward, tuple(residuals), problem, body_vars, body_eqns, compat.eqn_source(eqn)
      )
    )
  return loops


def shed_residuals(
  closed: Any, shed_bytes: int, flops_of: FlopsOf | None = None, policy: str | None = None
) -> tuple[Any, tuple[LoopRewrite, ...]]:
  """``closed`` with its loops storing at least ``shed_bytes`` less for the backward pass
  at the fewest recomputed FLOPs (``flops_of``, as in `residual_loops`; the least any
  choice stores, where none sheds that much), and the loops rewritten. ``policy``: the
  name of a `jax.checkpoint_policies` policy; each loop stores what `jax.checkpoint`
  with it on the body would store, whatever ``shed_bytes``."""
  if shed_bytes <= 0 and policy is None:
    return closed, ()
  found = residual_loops(closed, flops_of)
  if not found:
    return closed, ()
  problems = [loop.problem for loop in found]
  if policy is not None:
    chosen_by = f"jax.checkpoint_policies.{policy}"
    choices = [loop.policy_choice(getattr(jax.checkpoint_policies, policy)) for loop in found]
  else:
    chosen_by = "the knapsack"
    stacked = sum(p.stored_bytes(p.residuals) for p in problems)
    choices = choose_stored(problems, stacked - shed_bytes)
    if choices is None:  # below the least any iteration stores: iterations in groups
      least = choose_stored(problems, None)
      if least is None:
        return closed, ()
      choices = [grouped(p, c) or c for p, c in zip(problems, least, strict=True)]
  return store_less(closed, found, choices), tuple(
    loop.rewrite(c, chosen_by) for loop, c in zip(found, choices, strict=True)
  )


def store_less(closed: Any, loops: Sequence[ResidualLoop], choices: Sequence[BodyChoice]) -> Any:
  """``closed`` with each loop's forward scan stacking ``choice.stored`` in place of its
  residuals and its backward scan recomputing the others per iteration
  (``choice.recomputed``)."""
  jaxpr, _ = compat.open_jaxpr(closed)
  plans = {}  # forward equation -> (loop, choice, {backward xs position: body var})
  for loop, choice in zip(loops, choices, strict=True):
    forward, backward = jaxpr.eqns[loop.forward], jaxpr.eqns[loop.backward]
    fbody, _ = compat.open_jaxpr(forward.params["jaxpr"])
    stands_for = {forward.outvars[p]: fbody.outvars[p] for p in loop.residuals}
    _, _, xs = _split(backward, backward.invars)
    dropped = {i: stands_for[v] for i, v in enumerate(xs) if v in stands_for}
    plans[loop.forward] = (loop, choice, dropped)
  backward_of = {loop.backward: loop.forward for loop in loops}
  stacked: dict[int, tuple[list[Any], list[Any]]] = {}  # forward -> (stored, its invals)
  # Loop constants that are cheap to make are made again in each backward iteration, as
  # JAX's own rematerialized bodies do: passed whole, XLA holds them through both loops
  # (the scanned GPT example's attention mask: 0.5 MiB; 8 MiB at batch 32 and 256
  # tokens), and even a small one takes a slot of the loop's state. Those made from
  # literals alone (an iota mask) are made whole; those broadcast from a much smaller
  # value, from that value.
  producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
  remade: dict[int, dict[int, tuple[tuple[int, ...], int | None, Any]]] = {}
  for k in (k for loop in loops for k in (loop.forward, loop.backward)):
    consts, _, _ = _split(jaxpr.eqns[k], jaxpr.eqns[k].invars)
    remade[k] = {}  # constant position -> (equations, the broadcast whose operand is read, var)
    for i, v in enumerate(consts):
      made = _made_of_literals(v, producer, jaxpr.eqns)
      if made is not None:
        remade[k][i] = (made, None, v)
      elif v in producer and _broadcast_of_small(jaxpr.eqns[producer[v]]):
        remade[k][i] = ((producer[v],), producer[v], v)
  read_operand = {b for of_scan in remade.values() for _, b, _ in of_scan.values() if b is not None}
  operands: dict[int, Any] = {}  # broadcast -> the value it broadcasts

  def in_each_iteration(scan: int) -> dict[int, _Remade]:
    return {
      i: _Remade(
        tuple(jaxpr.eqns[e] for e in made),
        {} if b is None else {jaxpr.eqns[b].invars[0]: operands[b]},
        v,
      )
      for i, (made, b, v) in remade[scan].items()
    }

  def run_eqn(k: int, eqn: Any, invals: list[Any]) -> list[Any] | None:
    if k in read_operand:
      operands[k] = invals[0]
      return None
    if k in plans:
      loop, choice, _ = plans[k]
      outs, stored = _forward(eqn, invals, loop, choice)
      stacked[k] = (stored, invals)
      return outs
    if k in backward_of:
      f = backward_of[k]
      loop, choice, dropped = plans[f]
      stored, forward_invals = stacked[f]
      sunk = in_each_iteration(k), in_each_iteration(f)
      return _backward(
        eqn, invals, jaxpr.eqns[f], forward_invals, loop, choice, stored, dropped, *sunk
      )
    return None

  return capture.retrace(closed, run_eqn)


# -- the body as a knapsack -------------------------------------------------------------


def _reads_as_stacked_input(eqn: Any, pos: int) -> bool:
  return eqn.primitive.name == "scan" and not eqn.effects and pos >= sum(compat.scan_counts(eqn))


def _body_problem(
  eqn: Any, residuals: Sequence[int], flops_of: FlopsOf | None
) -> tuple[BodyProblem, tuple[Any, ...]]:
  body, _ = compat.open_jaxpr(eqn.params["jaxpr"])
  n_consts, n_carry = compat.scan_counts(eqn)
  index: dict[Any, int] = {}
  values: list[Any] = []

  def number(v: Any) -> int:
    if v not in index:
      index[v] = len(values)
      values.append(v)
    return index[v]

  free = set()
  for pos, v in enumerate([*body.constvars, *body.invars]):
    k = number(v)
    carry = len(body.constvars) + n_consts <= pos < len(body.constvars) + n_consts + n_carry
    if not carry:
      free.add(k)
  producer: dict[int, int] = {}  # value -> the equation computing it
  eqn_operands = []
  for e, inner in enumerate(body.eqns):
    eqn_operands.append(tuple(number(v) for v in inner.invars if not isinstance(v, compat.Literal)))
    producer.update((number(v), e) for v in inner.outvars if not isinstance(v, compat.DropVar))
  eqn_flops = flops_of(body.eqns) if flops_of else [costs.shape_flops(e) for e in body.eqns]
  residual_vars = [body.outvars[p] for p in residuals]
  problem = BodyProblem(
    trips=eqn.params["length"],
    value_bytes=tuple(compat.aval_bytes(v.aval) for v in values),
    free=frozenset(free),
    producer=tuple(producer.get(v, -1) for v in range(len(values))),
    eqn_operands=tuple(eqn_operands),
    eqn_flops=tuple(eqn_flops),
    recomputable=tuple(not e.effects for e in body.eqns),
    residuals=tuple(number(v) for v in residual_vars if not isinstance(v, compat.Literal)),
  )
  return problem, tuple(values)


# -- the rewrite --------------------------------------------------------------------------


def _made_of_literals(
  v: Any, producer: dict[Any, int], eqns: Sequence[Any], most: int = 16
) -> tuple[int, ...] | None:
  """The equations (at most ``most``, in order, without effects) that make ``v`` from
  literals alone, or None."""
  made: list[int] = []

  def visit(u: Any) -> bool:
    if isinstance(u, compat.Literal):
      return True
    k = producer.get(u)
    if k is None or eqns[k].effects:
      return False
    if k not in made:
      if not all(visit(w) for w in eqns[k].invars):
        return False
      made.append(k)
    return len(made) <= most

  return tuple(made) if visit(v) else None


def _broadcast_of_small(eqn: Any) -> bool:
  """Whether ``eqn`` broadcasts a value at least 4 times smaller than its output."""
  return (
    eqn.primitive.name == "broadcast_in_dim"
    and not isinstance(eqn.invars[0], compat.Literal)
    and 4 * compat.aval_bytes(eqn.invars[0].aval) <= compat.aval_bytes(eqn.outvars[0].aval)
  )


def _split(eqn: Any, values: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
  n_consts, n_carry = compat.scan_counts(eqn)
  return (
    list(values[:n_consts]),
    list(values[n_consts : n_consts + n_carry]),
    list(values[n_consts + n_carry :]),
  )


def _scan(
  eqn: Any, body_fn, init: list[Any], xs: list[Any], length: int | None = None
) -> tuple[list[Any], list[Any]]:
  """``eqn``'s loop with ``body_fn``, over ``length`` iterations (default: ``eqn``'s)."""
  carry, ys = jax.lax.scan(
    body_fn,
    init,
    xs,
    length=length or eqn.params["length"],
    reverse=eqn.params["reverse"],
    unroll=eqn.params["unroll"],
  )
  return list(carry), list(ys)


def _forward(
  eqn: Any, invals: list[Any], loop: ResidualLoop, choice: BodyChoice
) -> tuple[list[Any], list[Any]]:
  """Runs the forward scan stacking its outputs other than the residuals and the values
  ``choice`` stores. Returns its outputs (None for the residuals) and the stacked stored
  values, in ``sorted(choice.stored)`` order (in groups: the carries the groups start
  from)."""
  body, body_consts = compat.open_jaxpr(eqn.params["jaxpr"])
  consts, init, xs = _split(eqn, invals)
  _, n_carry = compat.scan_counts(eqn)
  residuals = set(loop.residuals)
  kept_ys = [p for p in range(n_carry, len(body.outvars)) if p not in residuals]
  stored = [loop.body_vars[v] for v in sorted(choice.stored)]

  def step(carry, x, stash=stored):
    env = capture.evaluate(body, body_consts, [*consts, *carry, *x])
    outs = [capture.read(env, v) for v in body.outvars]
    return outs[:n_carry], ([outs[p] for p in kept_ys], [capture.read(env, v) for v in stash])

  k = choice.group
  if k == 1:
    carry, (ys, stacked) = _scan(eqn, step, init, xs)
  else:  # each group stacks only the carry it starts from

    def group(carry, x):
      out, (ys, _) = _scan(eqn, functools.partial(step, stash=()), carry, x, length=k)
      return out, (ys, carry)

    carry, (ys, stacked) = _scan(
      eqn, group, init, _in_groups(xs, k), length=eqn.params["length"] // k
    )
    ys = _of_groups(ys)
  outs: list[Any] = [*carry] + [None] * (len(body.outvars) - n_carry)
  for p, y in zip(kept_ys, ys, strict=True):
    outs[p] = y
  return outs, list(stacked)


def _backward(
  eqn: Any,
  invals: list[Any],
  forward: Any,
  forward_invals: list[Any],
  loop: ResidualLoop,
  choice: BodyChoice,
  stored: list[Any],
  dropped: dict[int, Any],
  remade: dict[int, _Remade],
  f_remade: dict[int, _Remade],
) -> list[Any]:
  """Runs the backward scan with the residuals at its stacked inputs ``dropped`` read,
  per iteration, from the stored values or recomputed from them, the forward loop's
  constants and its stacked inputs. Its constants at ``remade``'s positions, and the
  forward loop's at ``f_remade``'s, are made in each iteration."""
  fbody, fbody_consts = compat.open_jaxpr(forward.params["jaxpr"])
  f_consts, _, f_xs = _split(forward, forward_invals)
  f_consts = [f_remade.get(i, c) for i, c in enumerate(f_consts)]
  f_const_vars, _, f_xs_vars = _split(forward, fbody.invars)
  body, body_consts = compat.open_jaxpr(eqn.params["jaxpr"])
  consts, init, xs = _split(eqn, invals)
  _, n_carry = compat.scan_counts(eqn)
  stored_vars = [loop.body_vars[v] for v in sorted(choice.stored)]
  recompute = [fbody.eqns[e] for e in sorted(choice.recomputed)]
  live_xs = [x for i, x in enumerate(xs) if i not in dropped]
  # Only the forward loop's inputs that the recomputation reads: a while loop's operands
  # are its buffers.
  needed = {v for e in recompute for v in e.invars if not isinstance(v, compat.Literal)} | set(
    dropped.values()
  )
  k = choice.group
  if k > 1:  # running a group forward again reads all of them
    needed |= {*f_const_vars, *f_xs_vars}
  f_consts = [c for v, c in zip(f_const_vars, f_consts, strict=True) if v in needed]
  f_const_vars = [v for v in f_const_vars if v in needed]
  # A stacked input the backward scan reads already is read from its own slice: passed
  # twice, XLA would copy it to give the loop two buffers.
  already = {}  # forward body var -> position among live_xs
  extra_vars, extra = [], []
  for v, x in zip(f_xs_vars, f_xs, strict=True):
    if v in needed:
      j = next((j for j, y in enumerate(live_xs) if y is x), None)
      if j is None:
        extra_vars.append(v)
        extra.append(x)
      else:
        already[v] = j

  def step(carry, x):
    x_live, x_stored, x_extra = x
    env = dict(zip(fbody.constvars, fbody_consts, strict=True))
    made: dict[Any, Any] = {}
    env.update(zip(f_const_vars, (_unpack(c, made) for c in f_consts), strict=True))
    env.update(zip(extra_vars, x_extra, strict=True))
    env.update((v, x_live[j]) for v, j in already.items())
    env.update(zip(stored_vars, x_stored, strict=True))
    capture.evaluate_eqns(recompute, env)
    live = iter(x_live)
    x_full = [capture.read(env, dropped[i]) if i in dropped else next(live) for i in range(len(xs))]
    own = [_unpack(remade.get(i, c), made) for i, c in enumerate(consts)]
    out_env = capture.evaluate(body, body_consts, [*own, *carry, *x_full])
    result = [capture.read(out_env, v) for v in body.outvars]
    return result[:n_carry], result[n_carry:]

  if k == 1:
    carry, ys = _scan(eqn, step, init, [live_xs, stored, extra])
    return [*carry, *ys]
  _, n_forward_carry = compat.scan_counts(forward)

  def forward_step(carry, x):
    made: dict[Any, Any] = {}
    f_made = [_unpack(c, made) for c in f_consts]
    env = capture.evaluate(fbody, fbody_consts, [*f_made, *carry, *x])
    outs = [capture.read(env, v) for v in fbody.outvars[:n_forward_carry]]
    return outs, [capture.read(env, v) for v in stored_vars]

  def group(carry, x):
    g_live, g_start, g_extra = x
    own = dict(zip(extra_vars, g_extra, strict=True))
    g_xs = [g_live[already[v]] if v in already else own[v] for v in f_xs_vars]
    _, g_stored = _scan(forward, forward_step, g_start, g_xs, length=k)
    return _scan(eqn, step, carry, [g_live, g_stored, g_extra], length=k)

  groups = [_in_groups(live_xs, k), stored, _in_groups(extra, k)]
  carry, ys = _scan(eqn, group, init, groups, length=eqn.params["length"] // k)
  return [*carry, *_of_groups(ys)]


@dataclasses.dataclass(frozen=True)
class _Remade:
  """A loop constant ``var`` that ``eqns`` make from ``env``, made where it is read
  (`_unpack`): in a loop body, in each iteration."""

  eqns: tuple[Any, ...]
  env: dict[Any, Any]
  var: Any


def _unpack(value: Any, made: dict[Any, Any]) -> Any:
  """``value``, or the constant it makes (once per ``made``: each loop body makes each
  constant once, the forward one's and the backward one's alike)."""
  if not isinstance(value, _Remade):
    return value
  if value.var not in made:
    env = dict(value.env)
    capture.evaluate_eqns(value.eqns, env)
    made[value.var] = env[value.var]
  return made[value.var]


def _in_groups(xs: list[Any], k: int) -> list[Any]:
  """Stacked values split into groups of ``k`` iterations."""
  return [x.reshape((x.shape[0] // k, k, *x.shape[1:])) for x in xs]


def _of_groups(xs: list[Any]) -> list[Any]:
  return [x.reshape((-1, *x.shape[2:])) for x in xs]
