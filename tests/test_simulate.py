"""The simulator against an independent reading of FORMATS.md, on random DAGs and events."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from jaxremat import RematGraph, Schedule, baseline_schedule, schedule_from_computes, simulate


@st.composite
def dags(draw, max_nodes=9):
  n = draw(st.integers(1, max_nodes))
  n_inputs = draw(st.integers(0, min(2, n - 1)))
  edges = []
  for v in range(n_inputs, n):
    for u in range(v):
      if draw(st.booleans()):
        edges.append((u, v))
  mem = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
  cost = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
  outputs = draw(st.sets(st.integers(n_inputs, n - 1), min_size=1)) if n > n_inputs else set()
  return RematGraph.build(mem, cost, edges, inputs=range(n_inputs), outputs=sorted(outputs))


@st.composite
def graphs_and_events(draw):
  g = draw(dags())
  # Mostly plausible events, so that long valid prefixes are common.
  n_events = draw(st.integers(0, 3 * g.n))
  events = [
    (draw(st.sampled_from(["compute", "compute", "free"])), draw(st.integers(0, g.n)))
    for _ in range(n_events)
  ]
  return g, events


def reference_simulate(g: RematGraph, events):
  """FORMATS.md read literally: returns (first bad event index or None, peak, duration)."""
  inputs = set(g.inputs)
  resident = sum(g.nodes[i].mem for i in inputs)
  live, computed = set(), set()
  peak, duration = resident, 0.0
  for k, (kind, v) in enumerate(events):
    if v >= g.n:
      return k, peak, duration
    if kind == "compute":
      preds = {u for u, w in g.edges if w == v} - inputs
      if v in inputs or v in live or not preds <= live:
        return k, peak, duration
      peak = max(peak, resident + sum(g.nodes[u].mem for u in live) + g.nodes[v].mem)
      duration += g.nodes[v].cost
      live.add(v)
      computed.add(v)
    else:
      if v not in live:
        return k, peak, duration
      live.remove(v)
  if set(range(g.n)) - inputs - computed or set(g.outputs) - inputs - live:
    return len(events), peak, duration
  return None, peak, duration


@settings(max_examples=300, deadline=None)
@given(graphs_and_events())
def test_simulate_agrees_with_the_reference(case):
  g, events = case
  got = simulate(g, Schedule(tuple(events)))
  bad, peak, duration = reference_simulate(g, events)
  assert got.error_event == bad
  assert got.valid == (bad is None)
  assert (got.peak_bytes, got.duration) == (peak, duration)
  if not got.valid:
    assert got.error and f"{bad}" in got.error or bad == len(events)


@settings(max_examples=200, deadline=None)
@given(dags())
def test_baseline_is_valid_and_agrees_with_the_reference(g):
  s = baseline_schedule(g)
  got = simulate(g, s)
  bad, peak, duration = reference_simulate(g, s.events)
  assert got.valid and bad is None
  assert got.peak_bytes == peak and got.duration == duration == sum(g.cost[v] for v in g.order)
  assert got.n_recompute == 0


@settings(max_examples=200, deadline=None)
@given(dags(), st.data())
def test_recomputing_a_whole_prefix_stays_valid(g, data):
  # Computing the order, then the order again, is a valid program with n recomputations.
  k = data.draw(st.integers(0, len(g.order)))
  computes = list(g.order) + list(g.order[:k])
  got = simulate(g, schedule_from_computes(g, computes))
  assert got.valid, got.error
  assert got.n_recompute == k


def test_errors_name_event_node_and_reason():
  g = RematGraph.build(mem=[4, 2, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)], inputs=[0])
  cases = [
    ([("compute", 2)], 0, "predecessor #1 '1' is not live"),
    ([("compute", 0)], 0, "inputs are resident"),
    ([("compute", 1), ("compute", 1)], 1, "already live"),
    ([("compute", 1), ("free", 2)], 1, "it is not live"),
    ([("free", 0)], 0, "inputs are never freed"),
    ([("compute", 9)], 0, "does not exist"),
    ([("compute", 1), ("compute", 2), ("free", 2)], 3, "output node #2 '2' is not live"),
    ([("compute", 1)], 1, "never computed"),
  ]
  for events, index, words in cases:
    r = simulate(g, Schedule(tuple(events)))
    assert not r.valid and r.error_event == index and words in r.error, (events, r)


def test_timeline_and_peak_count_resident_inputs():
  g = RematGraph.build(mem=[4, 2, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)], inputs=[0])
  r = simulate(g, baseline_schedule(g))
  assert r.timeline_bytes == (6, 7, 5)
  assert r.peak_bytes == 7
