"""Which values a loop body stores per iteration for the backward pass: a knapsack.

A forward `scan` stores, stacked over its iterations, the residuals its backward scan
reads. Each iteration may instead store other values of its body and the backward body
recompute the residuals from them (and from what every iteration has anyway: the loop's
constants and its stacked inputs). Which to store is a choice of bytes per iteration
times the trip count against recomputed FLOPs times the trip count, over all the step's
loops at once (`choose_stored`); or what a `jax.checkpoint` policy would store
(`policy_choice`), the target compiler measuring both. Below the least any iteration can
store, iterations go in groups whose carry alone is stacked (`grouped`). Kept apart from JAX: `jaxremat._src.loops` builds the
problem from the jaxpr and rewrites the loops with the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from ortools.sat.python import cp_model


@dataclasses.dataclass(frozen=True)
class BodyProblem:
  """One loop body's values and equations, by index.

  Attributes:
    trips: iterations of the loop.
    value_bytes: bytes of each value of the body (one iteration's).
    free: values every iteration has without storing them (constants, stacked inputs).
    producer: per value, the equation that computes it, or -1 (a body input).
    eqn_operands: per equation, the values it reads.
    eqn_flops: per equation, its FLOPs for one iteration.
    recomputable: per equation, whether it may run again (no effects).
    residuals: the values the backward body reads.
  """

  trips: int
  value_bytes: tuple[int, ...]
  free: frozenset[int]
  producer: tuple[int, ...]
  eqn_operands: tuple[tuple[int, ...], ...]
  eqn_flops: tuple[float, ...]
  recomputable: tuple[bool, ...]
  residuals: tuple[int, ...]

  def stored_bytes(self, stored: Sequence[int]) -> int:
    """Bytes stacked over the iterations for ``stored``."""
    return self.trips * sum(self.value_bytes[v] for v in set(stored) if v not in self.free)

  def choice(self, stored: Collection[int], recomputed: Collection[int]) -> BodyChoice:
    """Storing the values ``stored`` and recomputing the equations ``recomputed``."""
    return BodyChoice(
      stored=frozenset(stored),
      recomputed=frozenset(recomputed),
      stored_bytes=self.stored_bytes(stored),
      recomputed_flops=self.trips * sum(self.eqn_flops[e] for e in recomputed),
    )


@dataclasses.dataclass(frozen=True)
class BodyChoice:
  """What one body stores and what the backward body recomputes from it.

  Attributes:
    stored: values, by index, each iteration stores.
    recomputed: equations, by index, the backward body recomputes.
    stored_bytes: bytes held for the backward pass at once, over the iterations.
    recomputed_flops: FLOPs recomputed over the iterations.
    group: iterations per group (`grouped`); 1: every iteration's ``stored`` is stacked
      by the forward loop.
  """

  stored: frozenset[int]
  recomputed: frozenset[int]
  stored_bytes: int
  recomputed_flops: float
  group: int = 1


def choose_stored(
  bodies: Sequence[BodyProblem], max_stored_bytes: int | None, time_limit_s: float = 10.0
) -> list[BodyChoice] | None:
  """The values each body stores, at most ``max_stored_bytes`` over all bodies and
  iterations, with the fewest recomputed FLOPs, then the fewest bytes; None if no choice
  stores that little. ``max_stored_bytes=None``: the fewest bytes any choice stores, then
  the fewest FLOPs.

  Every residual is stored or recomputed; a recomputed equation's operands are stored,
  recomputed or free. Exact (CP-SAT) where it proves optimality within the time limit
  (each of the two objectives gets it), else the best choice found.
  """
  model = cp_model.CpModel()
  keep: list[list[cp_model.IntVar]] = []
  comp: list[list[cp_model.IntVar]] = []
  stored_terms, flop_terms = [], []
  scale = _flop_scale(bodies)
  for b, body in enumerate(bodies):
    keep.append([model.new_bool_var(f"keep{b}_{v}") for v in range(len(body.value_bytes))])
    comp.append([model.new_bool_var(f"comp{b}_{e}") for e in range(len(body.eqn_flops))])

    def available(v: int, body=body, b=b) -> list[cp_model.IntVar] | None:
      """Literals one of which must hold for ``v`` to be at hand; None if it always is."""
      if v in body.free:
        return None
      e = body.producer[v]
      return [keep[b][v]] + ([comp[b][e]] if e >= 0 else [])

    for v in body.residuals:
      lits = available(v)
      if lits is not None:
        model.add_bool_or(lits)
    for e, operands in enumerate(body.eqn_operands):
      if not body.recomputable[e]:
        model.add(comp[b][e] == 0)
        continue
      for u in operands:
        lits = available(u)
        if lits is not None:
          model.add_bool_or(lits).only_enforce_if(comp[b][e])
    for v, size in enumerate(body.value_bytes):
      if v in body.free:
        model.add(keep[b][v] == 0)
      else:
        stored_terms.append(body.trips * size * keep[b][v])
    flop_terms += [round(body.trips * f * scale) * comp[b][e] for e, f in enumerate(body.eqn_flops)]
  stored, flops = sum(stored_terms), sum(flop_terms)
  first, second = (flops, stored) if max_stored_bytes is not None else (stored, flops)
  if max_stored_bytes is not None:
    model.add(stored <= max_stored_bytes)
  solver = cp_model.CpSolver()
  solver.parameters.max_time_in_seconds = time_limit_s
  solver.parameters.num_workers = 1
  model.minimize(first)
  if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    return None
  # Then the other objective at that value (a value stored needlessly is not free).
  model.add(first <= round(solver.objective_value))
  for row in (*keep, *comp):
    for x in row:
      model.add_hint(x, solver.value(x))
  model.minimize(second)
  if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
    return None
  return [
    body.choice(
      [v for v, x in enumerate(keep[b]) if solver.value(x)],
      [e for e, x in enumerate(comp[b]) if solver.value(x)],
    )
    for b, body in enumerate(bodies)
  ]


def policy_choice(body: BodyProblem, saved_eqns: Collection[int]) -> BodyChoice:
  """What `jax.checkpoint` on the body stores with a policy that saves the outputs of
  ``saved_eqns``: those outputs and the carried values that the residuals need, the
  backward body recomputing every other equation they need (an equation with effects is
  never recomputed: its outputs are stored)."""
  stored, recomputed = set(), set()
  needed, seen = list(body.residuals), set()
  while needed:
    v = needed.pop()
    if v in seen or v in body.free:
      continue
    seen.add(v)
    e = body.producer[v]
    if e < 0 or e in saved_eqns or not body.recomputable[e]:
      stored.add(v)
    else:
      recomputed.add(e)
      needed += body.eqn_operands[e]
  return body.choice(stored, recomputed)


def grouped(body: BodyProblem, choice: BodyChoice) -> BodyChoice | None:
  """``choice`` in groups of iterations (two-level checkpointing): the forward loop
  stacks only the carry each group starts from, and the backward pass runs each group's
  iterations forward again from it, stacking ``choice.stored`` for that group alone,
  before running them backward. It holds trips / k carries and k iterations' stored
  values at once and recomputes the body's forward once more per iteration; k divides
  the trip count and holds least. None where no k holds less than ``choice``."""
  carry_bytes = sum(
    size for v, size in enumerate(body.value_bytes) if body.producer[v] < 0 and v not in body.free
  )
  per_iteration = choice.stored_bytes // body.trips
  held, k = min(
    (
      (body.trips // k * carry_bytes + k * per_iteration, k)
      for k in range(2, body.trips)
      if body.trips % k == 0
    ),
    default=(choice.stored_bytes, 1),
  )
  if held >= choice.stored_bytes:
    return None
  return dataclasses.replace(
    choice,
    stored_bytes=held,
    recomputed_flops=choice.recomputed_flops + body.trips * sum(body.eqn_flops),
    group=k,
  )


def _flop_scale(bodies: Sequence[BodyProblem]) -> float:
  """Scales FLOPs to integers CP-SAT can sum without overflow."""
  total = sum(b.trips * sum(b.eqn_flops) for b in bodies)
  return min(1.0, 1e12 / total) if total > 0 else 1.0
