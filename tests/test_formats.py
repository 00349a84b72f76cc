"""Reading and writing `jaxremat.graph/1` and `jaxremat.schedule/1` (FORMATS.md)."""

from __future__ import annotations

import json

import pytest
from conftest import shared_graph

from jaxremat import FormatError, RematGraph, Schedule, baseline_schedule, simulate


def _graph_dict(**changes):
  data = {
    "format": "jaxremat.graph/1",
    "name": "tiny",
    "nodes": [
      {"id": 0, "name": "x", "mem": 8, "cost": 0.0},
      {"id": 1, "name": "a", "mem": 4, "cost": 1.5, "primitive": "tanh"},
      {"id": 2, "name": "b", "mem": 2, "cost": 2.0},
    ],
    "edges": [[0, 1], [1, 2]],
    "inputs": [0],
    "outputs": [2],
    "order": [1, 2],
    "meta": {"units": "bytes"},
  }
  data.update(changes)
  return data


def _with_node(i, **changes):
  nodes = _graph_dict()["nodes"]
  nodes[i] = {**nodes[i], **changes}
  return _graph_dict(nodes=nodes)


def test_graph_round_trip(tmp_path):
  g = RematGraph.from_dict(_graph_dict())
  path = tmp_path / "g.json"
  g.save(path)
  again = RematGraph.load(path)
  assert again == g
  assert again.to_dict() == _graph_dict()
  assert again.nodes[1].attrs == {"primitive": "tanh"}
  assert (g.resident_bytes, g.preds, g.compute_preds) == (8, ((), (0,), (1,)), ((), (), (1,)))


def test_graph_without_order_gets_a_topological_one():
  data = _graph_dict()
  del data["order"]
  assert RematGraph.from_dict(data).order == (1, 2)


# Each malformed graph, the item the error must name, and words of the problem.
BAD_GRAPHS = [
  ("not an object", [1, 2], "", "expected a JSON object"),
  (
    "wrong format tag",
    _graph_dict(format="jaxremat.graph/2"),
    "format",
    "expected 'jaxremat.graph/1'",
  ),
  ("no nodes", {k: v for k, v in _graph_dict().items() if k != "nodes"}, "nodes", "missing"),
  ("ids out of order", _with_node(1, id=2), "nodes[1].id", "must equal the node's index 1"),
  (
    "missing mem",
    {**_graph_dict(), "nodes": [{"id": 0, "cost": 0}]},
    "nodes[0]",
    "'mem' is missing",
  ),
  ("negative size", _with_node(1, mem=-4), "nodes[1].mem", "non-negative integer"),
  ("fractional size", _with_node(1, mem=4.5), "nodes[1].mem", "non-negative integer"),
  ("huge size", _with_node(1, mem=10**30), "nodes[1].mem", "below 2**62"),
  ("boolean size", _with_node(1, mem=True), "nodes[1].mem", "non-negative integer"),
  ("negative cost", _with_node(2, cost=-1.0), "nodes[2].cost", "finite non-negative"),
  ("string cost", _with_node(2, cost="1"), "nodes[2].cost", "finite non-negative"),
  (
    "edge to a missing node",
    _graph_dict(edges=[[0, 1], [1, 7]]),
    "edges[1]",
    "node id 7 does not exist",
  ),
  ("edge not a pair", _graph_dict(edges=[[0, 1, 2]]), "edges[0]", "expected a pair"),
  ("self-loop", _graph_dict(edges=[[0, 1], [1, 1]], order=[1, 2]), "edges[1]", "self-loop"),
  ("cycle", _graph_dict(edges=[[0, 1], [1, 2], [2, 1]]), "edges", "cycle"),
  ("edge into an input", _graph_dict(edges=[[1, 0], [1, 2]]), "edges[0]", "input node 0"),
  ("order not topological", _graph_dict(order=[2, 1]), "order", "not topological"),
  ("order incomplete", _graph_dict(order=[1]), "order", "every non-input node exactly once"),
  ("output out of range", _graph_dict(outputs=[3]), "outputs[0]", "is not a node id"),
  ("input listed twice", _graph_dict(inputs=[0, 0], order=[1, 2]), "inputs", "more than once"),
  ("meta not an object", _graph_dict(meta=[]), "meta", "expected a JSON object"),
]


@pytest.mark.parametrize(
  "data,item,problem", [b[1:] for b in BAD_GRAPHS], ids=[b[0] for b in BAD_GRAPHS]
)
def test_malformed_graph_is_rejected_naming_the_item(tmp_path, data, item, problem):
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(data))
  with pytest.raises(FormatError) as info:
    RematGraph.load(path)
  assert info.value.source == str(path)
  assert info.value.item == item
  assert problem in str(info.value)


@pytest.mark.parametrize(
  "text,problem",
  [
    ('{"format": "jaxremat.graph/1", "nodes": [', "is not valid JSON"),
    ('{"format": NaN}', "NaN is not a JSON number"),
    ("", "is not valid JSON"),
  ],
  ids=["truncated", "nan", "empty"],
)
def test_not_json_is_rejected_naming_the_file(tmp_path, text, problem):
  path = tmp_path / "broken.json"
  path.write_text(text)
  with pytest.raises(FormatError, match=problem) as info:
    RematGraph.load(path)
  assert str(path) in str(info.value)


def test_missing_file_is_a_format_error(tmp_path):
  with pytest.raises(FormatError, match="cannot be read"):
    RematGraph.load(tmp_path / "absent.json")


def test_schedule_round_trip(tmp_path):
  g = RematGraph.from_dict(_graph_dict())
  s = baseline_schedule(g).replace(budget=20, stats={"status": "optimal"})
  path = tmp_path / "s.json"
  s.save(path)
  assert Schedule.load(path) == s
  assert json.loads(path.read_text())["format"] == "jaxremat.schedule/1"


BAD_SCHEDULES = [
  ("wrong tag", {"format": "x", "events": []}, "format", "expected 'jaxremat.schedule/1'"),
  ("no events", {"format": "jaxremat.schedule/1"}, "events", "expected a list"),
  (
    "unknown kind",
    {"format": "jaxremat.schedule/1", "events": [["keep", 1]]},
    "events[0]",
    "unknown event kind 'keep'",
  ),
  (
    "bad node",
    {"format": "jaxremat.schedule/1", "events": [["compute", "a"]]},
    "events[0]",
    "expected a node id",
  ),
  (
    "not a pair",
    {"format": "jaxremat.schedule/1", "events": [["compute"]]},
    "events[0]",
    "expected [kind, node]",
  ),
  (
    "negative budget",
    {"format": "jaxremat.schedule/1", "events": [], "budget": -1},
    "budget",
    "byte count",
  ),
]


@pytest.mark.parametrize(
  "data,item,problem", [b[1:] for b in BAD_SCHEDULES], ids=[b[0] for b in BAD_SCHEDULES]
)
def test_malformed_schedule_is_rejected_naming_the_item(tmp_path, data, item, problem):
  path = tmp_path / "bad_schedule.json"
  path.write_text(json.dumps(data))
  with pytest.raises(FormatError) as info:
    Schedule.load(path)
  assert (info.value.source, info.value.item) == (str(path), item)
  assert problem in str(info.value)


# FORMATS.md and BENCHMARKS.md list these baseline peaks of the MOCCASIN reference.
REFERENCE_BASELINE_PEAKS = {
  "moccasin_rl100": 46319,
  "moccasin_rl1000": 608619,
  "checkmate_vgg16_train": 15825108992,
  "checkmate_vgg19_train": 17058234368,
  "checkmate_resnet50_train": 38059356160,
  "checkmate_fcn_8_vgg_train": 13484795520,
}


@pytest.mark.parametrize("name,peak", sorted(REFERENCE_BASELINE_PEAKS.items()))
def test_baseline_peak_matches_the_reference(name, peak):
  g = shared_graph(name)
  result = simulate(g, baseline_schedule(g))
  assert result.valid and result.n_recompute == 0
  assert result.peak_bytes == peak


def test_every_shared_graph_loads_and_its_baseline_is_valid(any_shared_graph, tmp_path):
  g = any_shared_graph
  result = simulate(g, baseline_schedule(g))
  assert result.valid, result.error
  assert g.min_feasible_bytes <= result.peak_bytes
  g.save(tmp_path / "copy.json")
  assert RematGraph.load(tmp_path / "copy.json") == g
