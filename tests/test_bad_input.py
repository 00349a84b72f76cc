"""Every bad input tried, with the exact error expected: through the API and the CLI.

Each table row names the input, the exception class the Python API raises and a fragment
of its message. The CLI must answer the same input with one line on stderr naming the
problem and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxremat
from jaxremat import (
  BudgetError,
  FormatError,
  InfeasibleBudgetError,
  RematGraph,
  Schedule,
  UnsupportedError,
)
from jaxremat._src.cli import main

# A chain 0 -> 1 -> 2 with input 0: the smallest graph every solver plans.
GRAPH = {
  "format": "jaxremat.graph/1",
  "name": "chain",
  "nodes": [
    {"id": 0, "name": "x", "mem": 4, "cost": 0.0},
    {"id": 1, "name": "a", "mem": 2, "cost": 1.0},
    {"id": 2, "name": "b", "mem": 3, "cost": 1.0},
  ],
  "edges": [[0, 1], [1, 2]],
  "inputs": [0],
  "outputs": [2],
}
SCHEDULE = {
  "format": "jaxremat.schedule/1",
  "events": [["compute", 1], ["compute", 2], ["free", 1]],
}


def _graph(**changes: Any) -> str:
  return json.dumps({**GRAPH, **changes})


def _node(i: int, **changes: Any) -> str:
  nodes = [dict(n) for n in GRAPH["nodes"]]
  nodes[i].update(changes)
  return json.dumps({**GRAPH, "nodes": nodes})


def _raw_node(i: int, key: str, literal: str) -> str:
  """The graph with ``nodes[i][key]`` written as a raw JSON literal (NaN, 1e999, ...)."""
  marker = "__RAW__"
  return _node(i, **{key: marker}).replace(f'"{marker}"', literal)


def _schedule(**changes: Any) -> str:
  return json.dumps({**SCHEDULE, **changes})


def _without(data: dict, key: str) -> str:
  return json.dumps({k: v for k, v in data.items() if k != key})


def _million_nodes() -> str:
  n = 1_000_000
  nodes = ",".join(f'{{"id":{i},"mem":8,"cost":1}}' for i in range(n))
  return f'{{"format":"jaxremat.graph/1","nodes":[{nodes}],"edges":[],"inputs":[0]}}'


@dataclasses.dataclass(frozen=True)
class FileCase:
  """A graph or schedule file and the error it must raise."""

  id: str
  kind: str  # "graph" or "schedule"
  content: str | bytes | Callable[[], str]
  error: type[Exception]
  fragment: str


FILE_CASES = [
  # -- graph files --------------------------------------------------------------------
  FileCase("truncated JSON", "graph", _graph()[:40], FormatError, "is not valid JSON"),
  FileCase("empty file", "graph", "", FormatError, "is not valid JSON"),
  FileCase("not UTF-8", "graph", b"\xff\xfe\x00\x01garbage", FormatError, "is not UTF-8 text"),
  FileCase("a JSON list", "graph", "[1, 2]", FormatError, "expected a JSON object, got list"),
  FileCase("JSON null", "graph", "null", FormatError, "expected a JSON object, got NoneType"),
  FileCase(
    "integer of 5000 digits",
    "graph",
    _raw_node(1, "mem", "9" * 5000),
    FormatError,
    "holds an integer of more than 4300 digits",
  ),
  FileCase("huge size", "graph", _node(1, mem=10**30), FormatError, "below 2**62"),
  FileCase(
    "sizes adding past 2**62",
    "graph",
    _node(1, mem=2**61 + 1).replace('"mem": 3', f'"mem": {2**61}'),
    FormatError,
    "add up to 2**62 bytes or more",
  ),
  FileCase("NaN cost", "graph", _raw_node(1, "cost", "NaN"), FormatError, "NaN is not a JSON"),
  FileCase(
    "Infinity cost", "graph", _raw_node(1, "cost", "Infinity"), FormatError, "Infinity is not"
  ),
  FileCase(
    "cost overflowing to inf",
    "graph",
    _raw_node(1, "cost", "1e999"),
    FormatError,
    "nodes[1].cost: expected a finite non-negative number, got inf",
  ),
  FileCase(
    "costs adding past a float",
    "graph",
    _node(1, cost=1e308).replace('"cost": 1.0', '"cost": 1e308'),
    FormatError,
    "costs add up to more than a float can hold",
  ),
  FileCase("NaN size", "graph", _raw_node(1, "mem", "NaN"), FormatError, "NaN is not a JSON"),
  FileCase("negative size", "graph", _node(1, mem=-2), FormatError, "nodes[1].mem"),
  FileCase("negative cost", "graph", _node(1, cost=-1.0), FormatError, "nodes[1].cost"),
  FileCase("fractional size", "graph", _node(1, mem=2.5), FormatError, "got 2.5"),
  FileCase("string size", "graph", _node(1, mem="2"), FormatError, "got '2'"),
  FileCase("boolean size", "graph", _node(1, mem=True), FormatError, "got True"),
  FileCase("string cost", "graph", _node(1, cost="1"), FormatError, "nodes[1].cost"),
  FileCase("id not its index", "graph", _node(1, id=5), FormatError, "must equal the node's index"),
  FileCase(
    "node not an object", "graph", _graph(nodes=[1, 2]), FormatError, "nodes[0]: expected a JSON"
  ),
  FileCase(
    "missing mem",
    "graph",
    _graph(nodes=[{"id": 0, "cost": 0.0}], edges=[]),
    FormatError,
    "'mem' is missing",
  ),
  FileCase(
    "cycle", "graph", _graph(edges=[[0, 1], [1, 2], [2, 1]]), FormatError, "cycle through node 1"
  ),
  FileCase(
    "self-loop", "graph", _graph(edges=[[0, 1], [1, 1]], order=[1, 2]), FormatError, "self-loop"
  ),
  FileCase(
    "dangling edge", "graph", _graph(edges=[[0, 1], [1, 7]]), FormatError, "node id 7 does not"
  ),
  FileCase(
    "edge to a huge id",
    "graph",
    _graph(edges=[[0, 1], [1, 10**30]]),
    FormatError,
    f"node id {10**30} does not exist",
  ),
  FileCase("edge not a pair", "graph", _graph(edges=[[0, 1, 2]]), FormatError, "a pair [u, v]"),
  FileCase(
    "edge into an input", "graph", _graph(edges=[[1, 0], [1, 2]]), FormatError, "input node 0"
  ),
  FileCase(
    "unknown format version",
    "graph",
    _graph(format="jaxremat.graph/2"),
    FormatError,
    "expected 'jaxremat.graph/1', got 'jaxremat.graph/2'",
  ),
  FileCase(
    "no format", "graph", _without(GRAPH, "format"), FormatError, "format: expected 'jaxremat"
  ),
  FileCase("missing nodes", "graph", _without(GRAPH, "nodes"), FormatError, "nodes: is missing"),
  FileCase("missing edges", "graph", _without(GRAPH, "edges"), FormatError, "edges: is missing"),
  FileCase("nodes not a list", "graph", _graph(nodes={"a": 1}), FormatError, "got dict"),
  FileCase("outputs a string", "graph", _graph(outputs="2"), FormatError, "outputs: expected a"),
  FileCase("output out of range", "graph", _graph(outputs=[3]), FormatError, "not a node id"),
  FileCase("input twice", "graph", _graph(inputs=[0, 0]), FormatError, "more than once"),
  FileCase("order not topological", "graph", _graph(order=[2, 1]), FormatError, "not topological"),
  FileCase("name a number", "graph", _graph(name=7), FormatError, "name: expected a string"),
  FileCase("meta a list", "graph", _graph(meta=[]), FormatError, "meta: expected a JSON object"),
  FileCase(
    "deeply nested arrays", "graph", "[" * 100_000 + "]" * 100_000, FormatError, "nested too deeply"
  ),
  FileCase(
    "deeply nested meta",
    "graph",
    '{"format": "jaxremat.graph/1", "meta": ' + '{"a":' * 50_000 + "1" + "}" * 50_001,
    FormatError,
    "nested too deeply",
  ),
  FileCase(
    "a million nodes", "graph", _million_nodes, FormatError, "1000000 entries, more than the"
  ),
  # -- schedule files -----------------------------------------------------------------
  FileCase("truncated schedule", "schedule", _schedule()[:30], FormatError, "is not valid JSON"),
  FileCase(
    "unknown schedule version",
    "schedule",
    _schedule(format="jaxremat.schedule/9"),
    FormatError,
    "expected 'jaxremat.schedule/1', got 'jaxremat.schedule/9'",
  ),
  FileCase(
    "missing events", "schedule", _without(SCHEDULE, "events"), FormatError, "events: expected"
  ),
  FileCase(
    "events an object", "schedule", _schedule(events={}), FormatError, "events: expected a list"
  ),
  FileCase(
    "unknown event kind",
    "schedule",
    _schedule(events=[["run", 1]]),
    FormatError,
    "unknown event kind 'run'",
  ),
  FileCase(
    "event of three items",
    "schedule",
    _schedule(events=[["compute", 1, 2]]),
    FormatError,
    "expected [kind, node]",
  ),
  FileCase(
    "negative node id",
    "schedule",
    _schedule(events=[["compute", -1]]),
    FormatError,
    "expected a node id, got -1",
  ),
  FileCase(
    "float node id",
    "schedule",
    _schedule(events=[["compute", 1.0]]),
    FormatError,
    "expected a node id, got 1.0",
  ),
  FileCase(
    "negative budget", "schedule", _schedule(budget=-1), FormatError, "budget: expected a byte"
  ),
  FileCase("fractional budget", "schedule", _schedule(budget=1.5), FormatError, "budget: expected"),
  FileCase("stats a list", "schedule", _schedule(stats=[]), FormatError, "stats: expected a JSON"),
  FileCase("solver a number", "schedule", _schedule(solver=3), FormatError, "solver: expected"),
  FileCase(
    "NaN in stats",
    "schedule",
    _schedule().replace('"events"', '"stats": {"x": NaN}, "events"'),
    FormatError,
    "NaN is not a JSON number",
  ),
  FileCase(
    "deeply nested schedule",
    "schedule",
    '{"format": "jaxremat.schedule/1", "events": ' + "[" * 100_000 + "]" * 100_000 + "}",
    FormatError,
    "nested too deeply",
  ),
]


def _write(tmp_path, case: FileCase):
  path = tmp_path / f"{case.kind}.json"
  content = case.content() if callable(case.content) else case.content
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)
  return path


def _run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
  code = main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def _assert_one_line(err: str, *fragments: str) -> None:
  assert "Traceback" not in err
  assert len(err.strip().splitlines()) == 1, err
  for fragment in fragments:
    assert fragment in err, (fragment, err)


@pytest.mark.parametrize("case", FILE_CASES, ids=[c.id for c in FILE_CASES])
def test_bad_file_through_the_api_and_the_cli(tmp_path, capsys, case):
  path = _write(tmp_path, case)
  good_graph = tmp_path / "good.json"
  good_graph.write_text(_graph())
  load = RematGraph.load if case.kind == "graph" else Schedule.load
  start = time.perf_counter()
  with pytest.raises(case.error) as info:
    load(path)
  load_s = time.perf_counter() - start
  assert case.fragment in str(info.value)
  assert str(path) in str(info.value)  # the error names the file
  # Hostile input must fail fast (a million nodes takes ~2 s to parse when idle).
  assert load_s < 30, f"rejecting {case.id} took {load_s:.1f} s"

  argv = ["baseline", path] if case.kind == "graph" else ["simulate", good_graph, path]
  code, out, err = _run_cli(capsys, argv)
  assert code == 1 and out == ""
  _assert_one_line(err, case.fragment, str(path))


def test_oversized_file_is_refused_before_it_is_read(tmp_path, capsys):
  path = tmp_path / "huge.json"
  with open(path, "wb") as f:
    f.truncate(300 * 2**20)  # sparse: no disk used, nothing worth reading
  start = time.perf_counter()
  with pytest.raises(FormatError, match="more than the 256 MiB jaxremat reads"):
    RematGraph.load(path)
  assert time.perf_counter() - start < 1.0
  code, _, err = _run_cli(capsys, ["baseline", path])
  assert code == 1
  _assert_one_line(err, "more than the 256 MiB")


@pytest.mark.parametrize(
  "make_path,fragment",
  [
    (lambda tmp: tmp / "absent.json", "cannot be read: No such file or directory"),
    (lambda tmp: tmp, "cannot be read: Is a directory"),
  ],
  ids=["missing file", "a directory"],
)
def test_unreadable_graph_path(tmp_path, capsys, make_path, fragment):
  path = make_path(tmp_path)
  with pytest.raises(FormatError, match=fragment):
    RematGraph.load(path)
  code, _, err = _run_cli(capsys, ["baseline", path])
  assert code == 1
  _assert_one_line(err, fragment)


# -- schedules that parse but are not programs of the graph -----------------------------

INVALID_PROGRAMS = [
  ("node out of range", [["compute", 1], ["compute", 99]], "node 99 does not exist"),
  ("node id 10**30", [["compute", 10**30]], f"node {10**30} does not exist"),
  ("computes an input", [["compute", 0]], "computes input node #0"),
  ("predecessor missing", [["compute", 2]], "predecessor"),
  ("double free", [["compute", 1], ["free", 1], ["free", 1]], "it is not live"),
  ("output never computed", [["compute", 1]], "is never computed"),
  ("computed while live", [["compute", 1], ["compute", 1]], "already live"),
]


@pytest.mark.parametrize(
  "events,fragment", [c[1:] for c in INVALID_PROGRAMS], ids=[c[0] for c in INVALID_PROGRAMS]
)
def test_invalid_program_is_reported_not_raised(tmp_path, capsys, events, fragment):
  graph = RematGraph.from_dict(GRAPH)
  result = jaxremat.simulate(graph, Schedule.from_dict({**SCHEDULE, "events": events}))
  assert not result.valid and fragment in result.error
  (tmp_path / "g.json").write_text(_graph())
  (tmp_path / "s.json").write_text(_schedule(events=events))
  code, out, err = _run_cli(capsys, ["simulate", tmp_path / "g.json", tmp_path / "s.json"])
  assert code == 1 and err == ""
  summary = json.loads(out)
  assert not summary["valid"] and fragment in summary["error"]


# -- budgets ------------------------------------------------------------------------------

# (budget, exception, fragment); the chain's baseline peak is 9 bytes.
BUDGET_CASES = [
  (-1, BudgetError, "is not a positive number of bytes"),
  ("-1", BudgetError, "is not a positive number of bytes"),
  (0, BudgetError, "is not a positive number of bytes"),
  ("0", BudgetError, "is not a positive number of bytes"),
  (-0.5, BudgetError, "is not positive"),
  ("-5%", BudgetError, "is not positive"),
  ("0%", BudgetError, "is not positive"),
  ("1e-400", BudgetError, "is not positive"),
  (math.nan, BudgetError, "is not a finite number"),
  ("nan", BudgetError, "is not a budget"),
  ("NaN%", BudgetError, "is not a budget"),
  (math.inf, BudgetError, "is not a finite number"),
  (-math.inf, BudgetError, "is not a finite number"),
  ("inf", BudgetError, "is not a budget"),
  ("-inf", BudgetError, "is not a budget"),
  ("1e999", BudgetError, "is not a finite number"),
  ("12XB", BudgetError, "unknown unit 'XB'"),
  ("12 parsecs", BudgetError, "unknown unit 'parsecs'"),
  ("garbage", BudgetError, "is not a budget"),
  ("", BudgetError, "is not a budget"),
  ("0x10", BudgetError, "is not a budget"),
  ("1" + "0" * 5000, BudgetError, "5001 characters long"),
  (10**30, BudgetError, "2**62 bytes or more"),
  ("99999999999999999999999999", BudgetError, "2**62 bytes or more"),
  ("1e400%", BudgetError, "2**62 bytes or more"),
  (12.5, BudgetError, "is ambiguous"),
  (True, BudgetError, "is a bool"),
  (None, BudgetError, "has type NoneType"),
  ([0.8], BudgetError, "has type list"),
  (5, InfeasibleBudgetError, "below the smallest feasible peak of 9 bytes"),
  (0.5, InfeasibleBudgetError, "below the smallest feasible peak of 9 bytes"),
]


@pytest.mark.parametrize(
  "budget,error,fragment", BUDGET_CASES, ids=[repr(c[0])[:24] for c in BUDGET_CASES]
)
def test_bad_budget_through_the_api_and_the_cli(tmp_path, capsys, budget, error, fragment):
  graph = RematGraph.from_dict(GRAPH)
  with pytest.raises(error) as info:
    jaxremat.solve(graph, budget, solver="noremat")
  assert fragment in str(info.value)
  if isinstance(budget, list) or budget is None or isinstance(budget, bool):
    return  # the command line passes text only
  path = tmp_path / "g.json"
  path.write_text(_graph())
  code, out, err = _run_cli(capsys, ["solve", path, "--budget", str(budget), "--solver", "noremat"])
  assert code == (2 if error is BudgetError else 1) and out == ""
  _assert_one_line(err, "budget=")


SOLVE_OPTION_CASES = [
  (["--time-limit", "0"], "time_limit=0.0", "'0' is not a positive, finite number of seconds"),
  (["--time-limit", "-1"], "time_limit=-1.0", "'-1' is not a positive, finite number of seconds"),
  (["--time-limit", "nan"], "time_limit=nan", "'nan' is not a positive, finite number"),
  (["--time-limit", "inf"], "time_limit=inf", "'inf' is not a positive, finite number"),
  (["--time-limit", "soon"], None, "'soon' is not a positive, finite number of seconds"),
  (["--workers", "0"], "workers=0", "'0' is not a positive whole number"),
  (["--workers", "-3"], "workers=-3", "'-3' is not a positive whole number"),
  (["--solver", "nope"], "solver='nope' is not a known solver", "solver='nope' is not a known"),
]


@pytest.mark.parametrize(
  "argv,api_fragment,cli_fragment",
  SOLVE_OPTION_CASES,
  ids=[" ".join(c[0]) for c in SOLVE_OPTION_CASES],
)
def test_bad_solve_options(tmp_path, capsys, argv, api_fragment, cli_fragment):
  graph = RematGraph.from_dict(GRAPH)
  option, value = argv[0].lstrip("-").replace("-", "_"), argv[1]
  if api_fragment is not None:
    convert = {"time_limit": float, "workers": int, "solver": str}[option]
    options = {"solver": "noremat", option: convert(value)}
    with pytest.raises(ValueError) as info:
      jaxremat.solve(graph, 1.0, **options)
    assert api_fragment in str(info.value)
  path = tmp_path / "g.json"
  path.write_text(_graph())
  code, out, err = _run_cli(capsys, ["solve", path, "--budget", "1.0", *argv])
  assert code == 2 and out == ""
  _assert_one_line(err, cli_fragment)


def test_solve_rejects_a_path_for_a_graph():
  with pytest.raises(TypeError, match="graph must be a jaxremat.RematGraph, got str"):
    jaxremat.solve("g.json", 1.0)


def test_solve_rejects_an_option_its_solver_does_not_take():
  """Solvers take the arguments `solve` passes them all (``**_``); an option none of them
  names would be dropped, and the solve would run as if it were not there."""
  graph = RematGraph.from_dict(GRAPH)
  with pytest.raises(TypeError, match="solver 'moccasin' has no option 'copy'; it takes copies,"):
    jaxremat.solve(graph, 1.0, solver="moccasin", copy=3)
  with pytest.raises(TypeError, match="solver 'auto' has no option 'time_limit_s'"):
    jaxremat.solve(graph, 1.0, time_limit_s=5)  # solve's own is time_limit
  assert jaxremat.solve(graph, 1.0, solver="moccasin", copies=3).stats["status"]


def test_unwritable_output_is_one_line(tmp_path, capsys):
  path = tmp_path / "g.json"
  path.write_text(_graph())
  target = tmp_path / "missing-folder" / "s.json"
  code, out, err = _run_cli(capsys, ["baseline", path, "-o", target])
  assert code == 1
  _assert_one_line(err, f"cannot write {target}: No such file or directory")
  assert not (tmp_path / "missing-folder").exists()


@pytest.mark.slow  # 3 fresh processes importing JAX; in-process runs above cover the same code
def test_the_installed_command_never_prints_a_traceback(tmp_path):
  """The real entry point (a subprocess), for one file, one budget and one output error."""
  bad = tmp_path / "bad.json"
  bad.write_text("[" * 100_000)
  good = tmp_path / "g.json"
  good.write_text(_graph())
  runs = [
    (["baseline", bad], 1, "nested too deeply"),
    (["solve", good, "--budget", "-5%"], 2, "is not positive"),
    (["baseline", good, "-o", tmp_path / "no" / "s.json"], 1, "cannot write"),
  ]
  for argv, code, fragment in runs:
    proc = subprocess.run(
      [sys.executable, "-m", "jaxremat._src.cli", *map(str, argv)],
      capture_output=True,
      text=True,
      timeout=120,
    )
    assert proc.returncode == code, proc.stderr
    _assert_one_line(proc.stderr, fragment)


# -- optimized steps ----------------------------------------------------------------------


def _loss(params, x):
  return jnp.sum(jnp.tanh(x @ params["w"]) ** 2)


PARAMS = {"w": jnp.full((4, 4), 0.1, jnp.float32)}
X = jnp.ones((2, 4), jnp.float32)


@pytest.fixture(scope="module")
def emitted():
  program = jaxremat.trace_program(_loss, PARAMS, X, costs="shape")
  return jaxremat.emit(program, jaxremat.baseline_schedule(program.graph))


# (call arguments, exception, fragment) for a function emitted for (PARAMS, X).
CALL_CASES = [
  ((PARAMS, jnp.ones((3, 4))), ValueError, "args[1] has shape (3, 4) and dtype float32, but"),
  ((PARAMS, jnp.ones((2, 5))), ValueError, "traced with shape (2, 4) and dtype float32"),
  ((PARAMS, jnp.ones((2, 4), jnp.int32)), ValueError, "dtype int32, but the function was"),
  ((PARAMS, jnp.ones((2, 4), jnp.bfloat16)), ValueError, "dtype bfloat16, but the function"),
  (({"w": jnp.ones((4, 4))[None]}, X), ValueError, "args[0]['w'] has shape (1, 4, 4)"),
  (({"v": PARAMS["w"]}, X), ValueError, "but the function was traced with PyTreeDef"),
  ((PARAMS,), ValueError, "call it with arguments of the traced structure"),
  ((PARAMS, X, X), ValueError, "call it with arguments of the traced structure"),
]


@pytest.mark.parametrize(
  "args,error,fragment",
  CALL_CASES,
  ids=["batch", "width", "int32", "bfloat16", "rank", "tree", "too few", "too many"],
)
def test_emitted_step_with_wrong_arguments(emitted, args, error, fragment):
  for fn in (emitted, jax.jit(emitted)):
    with pytest.raises(error) as info:
      fn(*args)
    assert fragment in str(info.value)


def test_optimized_step_with_wrong_arguments(tmp_path):
  step = jaxremat.optimize(_loss, budget=1.0, solver="noremat", cache_dir=tmp_path, progress=False)
  np.testing.assert_allclose(step(PARAMS, X), _loss(PARAMS, X), rtol=1e-6)
  plan = step.plan(PARAMS, X)
  # The compiled plan is bound to the traced shapes: other shapes are refused, not broadcast.
  with pytest.raises(ValueError, match=r"args\[1\] has shape \(3, 4\)"):
    plan.compiled(PARAMS, jnp.ones((3, 4)))
  with pytest.raises(ValueError, match="dtype int32"):
    plan.compiled(PARAMS, jnp.ones((2, 4), jnp.int32))
  # Called with other shapes, the step plans again (as jax.jit compiles again) ...
  x3 = jnp.ones((3, 4))
  np.testing.assert_allclose(step(PARAMS, x3), _loss(PARAMS, x3), rtol=1e-6)
  assert len(step.plans) == 2
  # ... and where the original itself fails, it fails with the original's error.
  for args, error in [((PARAMS, jnp.ones((2, 5))), TypeError), (({"v": X}, X), KeyError)]:
    with pytest.raises(error):
      _loss(*args)
    with pytest.raises(error):
      step(*args)


OPTIMIZE_CASES = [
  (
    lambda: jaxremat.optimize(lambda s: jnp.ones(3).sum() * len(s), budget=1.0),
    ("mode",),
    UnsupportedError,
    "without",
  ),
  (lambda: jaxremat.optimize(lambda: jnp.ones(3).sum(), budget=1.0), (), UnsupportedError, "array"),
  (
    lambda: jaxremat.optimize(lambda n: jnp.ones(n).sum(), budget=1.0, static_argnums=0),
    (3,),
    UnsupportedError,
    "was called without array inputs",
  ),
  (lambda: jaxremat.optimize(_loss, budget="lots"), (PARAMS, X), BudgetError, "is not a budget"),
  (lambda: jaxremat.optimize(_loss, budget=math.nan), (PARAMS, X), BudgetError, "not a finite"),
  (lambda: jaxremat.optimize(_loss, budget=-1), (PARAMS, X), BudgetError, "not a positive"),
  (lambda: jaxremat.optimize(_loss, budget="12XB"), (PARAMS, X), BudgetError, "unknown unit"),
  (lambda: jaxremat.optimize(_loss, budget=10), (PARAMS, X), InfeasibleBudgetError, "budget=10"),
  (
    lambda: jaxremat.optimize(_loss, budget=1.0, fence="wall"),
    (PARAMS, X),
    ValueError,
    "fence='wall' is not one of",
  ),
  (
    lambda: jaxremat.optimize(_loss, budget=1.0, donate_argnums=5),
    (PARAMS, X),
    ValueError,
    "donate_argnums contains 5",
  ),
  (
    lambda: jaxremat.optimize(_loss, budget=1.0, static_argnums=5),
    (PARAMS, X),
    ValueError,
    "static_argnums contains 5",
  ),
]


@pytest.mark.parametrize(
  "make,args,error,fragment", OPTIMIZE_CASES, ids=[c[3] for c in OPTIMIZE_CASES]
)
def test_bad_optimize_call(tmp_path, monkeypatch, make, args, error, fragment):
  monkeypatch.setenv("JAXREMAT_CACHE_DIR", str(tmp_path))
  step = make()
  with pytest.raises(error) as info:
    step(*args)
  assert fragment in str(info.value)
  assert not list(tmp_path.glob("plans/*"))  # nothing cached for a refused step


@pytest.mark.parametrize(
  "call,fragment",
  [
    (lambda: jaxremat.optimize(3, budget=1.0), "fn=3 is not callable"),
    (lambda: jaxremat.optimize(_loss, budget=1.0, max_replans=-1), "max_replans=-1"),
    (lambda: jaxremat.optimize(_loss, budget=1.0, time_limit=0), "time_limit=0 must be a positive"),
    (lambda: jaxremat.optimize(_loss, budget=1.0, verify="maybe"), "verify='maybe' must be"),
    (
      lambda: jaxremat.optimize(_loss, budget=1.0, solver_options={"exact": None}),
      "solver 'auto' has no option 'solver_options'; it takes exact,",
    ),
    (
      lambda: jaxremat.optimize(_loss, budget=1.0, solver="auto", heuristic=("cover",)),
      "has no option 'heuristic'; it takes exact, exact_options, heuristics",
    ),
    (
      lambda: jaxremat.optimize(_loss, budget=1.0, solver="noremat", copies=3),
      "solver 'noremat' takes no options; drop copies",
    ),
    (lambda: jaxremat.optimize(_loss, budget=1.0, solver="nope"), "solver='nope' is not a known"),
  ],
  ids=[
    "not callable",
    "negative max_replans",
    "zero time_limit",
    "unknown verify",
    "nested",
    "misspelled option",
    "option of a solver without options",
    "unknown solver",
  ],
)
def test_bad_optimize_arguments_fail_at_once(call, fragment):
  with pytest.raises((TypeError, ValueError), match=fragment):
    call()
