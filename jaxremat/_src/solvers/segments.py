"""`segments`: the forward pass cut into k segments of equal cost, k searched; and
`dots-saveable`, the plan of ``jax.checkpoint``'s ``dots_saveable`` policy.

`segment_schedule` keeps what crosses each cut and recomputes each segment's other values
right before the backward pass needs them. Unlike Chen's checkpoints over articulation
points, a cut may be crossed by several values, so a graph with skip connections (a U-Net)
still has cuts: the skips are kept, as per-block `jax.checkpoint` keeps a block's outputs.
On the U-Net example for H100, 4 segments measured x0.615 of the peak at x1.04 FLOPs, where
the articulation points left no plan within 0.7.

References:
  Chen, Xu, Zhang, Guestrin, "Training Deep Nets with Sublinear Memory Cost", 2016.
"""

from __future__ import annotations

import time

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.segments import forward_products, segment_schedule
from jaxremat._src.simulate import simulate
from jaxremat._src.solvers.replay import pick_best

# Segment counts tried: 1, 2, 3, 4, 6, 8, ... 64 (about sqrt(2) apart).
_SEGMENT_COUNTS = sorted({round(2 ** (k / 2)) for k in range(13)})


def solve_segments(
  graph: RematGraph, budget_bytes: int, *, time_limit_s: float = 60.0, **_
) -> Schedule:
  """The shortest `segment_schedule` within budget over `_SEGMENT_COUNTS` segments.

  Raises:
    NoScheduleFoundError: no segment count meets the budget.
  """
  graph.require_feasible(budget_bytes)
  deadline = time.perf_counter() + time_limit_s
  tried = []
  for count in _SEGMENT_COUNTS:
    if tried and time.perf_counter() > deadline:
      break
    schedule = segment_schedule(graph, count)
    tried.append((schedule, simulate(graph, schedule)))
  return pick_best(tried, budget_bytes, "segments", f"{len(tried)} segment counts")


def solve_dots_saveable(graph: RematGraph, budget_bytes: int, **_) -> Schedule:
  """The plan of ``jax.checkpoint_policies.dots_saveable`` over the whole forward pass:
  every forward product and convolution kept, every other forward value recomputed from
  them where the backward pass reads it. In `auto`'s portfolio so that the policy users
  try first is a plan the planner weighs: on the ConvMixer step for H100 at 0.7 the policy
  measured x0.641 of the peak at x1.018 FLOPs, and the plan `auto` made without it x0.677
  at x1.041.

  Raises:
    NoScheduleFoundError: the plan does not meet the budget (a graph whose nodes do not
      say what they compute has no products: everything is recomputed from its inputs).
  """
  graph.require_feasible(budget_bytes)
  schedule = segment_schedule(graph, 1, keep=forward_products(graph), keep_last=False)
  candidate = [(schedule, simulate(graph, schedule))]
  return pick_best(candidate, budget_bytes, "dots-saveable", "the forward products kept")
