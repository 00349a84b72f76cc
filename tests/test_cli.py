"""The `jaxremat` command, run as a user would: a subprocess of the installed script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import SHARED_GRAPHS, shared_graph

from jaxremat._src.compat import CPU_BARRIER_HOLDS


def run(*args):
  proc = subprocess.run(
    [sys.executable, "-m", "jaxremat._src.cli", *map(str, args)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  return proc.returncode, proc.stdout, proc.stderr


def test_baseline_then_simulate(tmp_path):
  shared_graph("moccasin_rl100")
  graph = SHARED_GRAPHS / "moccasin_rl100.json"
  code, out, err = run("baseline", graph, "-o", tmp_path / "s.json")
  assert code == 0, err
  assert json.loads(out)["peak_bytes"] == 46319
  code, out, err = run("simulate", graph, tmp_path / "s.json")
  assert code == 0, err
  result = json.loads(out)
  assert result["valid"] and result["error"] is None
  assert (result["peak_bytes"], result["duration"], result["n_recompute"]) == (46319, 47769.0, 0)


def test_simulate_invalid_schedule_exits_1_with_the_reason(tmp_path):
  shared_graph("moccasin_rl100")
  schedule = tmp_path / "s.json"
  schedule.write_text(json.dumps({"format": "jaxremat.schedule/1", "events": [["compute", 1]]}))
  code, out, _ = run("simulate", SHARED_GRAPHS / "moccasin_rl100.json", schedule)
  result = json.loads(out)
  assert code == 1 and not result["valid"]
  assert "predecessor" in result["error"] and result["error_event"] == 0


@pytest.mark.parametrize(
  "content,words",
  [
    ("{not json", "is not valid JSON"),
    ('{"format": "jaxremat.graph/1", "nodes": 3}', "nodes: expected a list"),
  ],
)
def test_bad_file_exits_1_with_one_line(tmp_path, content, words):
  bad = tmp_path / "bad.json"
  bad.write_text(content)
  code, out, err = run("baseline", bad)
  assert code == 1 and out == ""
  assert words in err and str(bad) in err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_usage_errors_exit_2(tmp_path):
  assert run("frobnicate")[0] == 2
  assert run("simulate")[0] == 2
  shared_graph("moccasin_rl100")
  code, _, err = run("solve", SHARED_GRAPHS / "moccasin_rl100.json", "--budget", "-3")
  assert code == 2 and "budget='-3'" in err
  code, _, err = run(
    "solve", SHARED_GRAPHS / "moccasin_rl100.json", "--budget", "1.0", "--solver", "magic"
  )
  assert code == 2 and "solver='magic' is not a known solver" in err


def test_infeasible_budget_names_the_smallest_feasible_one():
  g = shared_graph("moccasin_rl100")
  code, _, err = run(
    "solve", SHARED_GRAPHS / "moccasin_rl100.json", "--budget", "1000", "--solver", "noremat"
  )
  assert code == 1
  assert f"smallest feasible peak of {g.min_feasible_bytes} bytes" in err


def test_analyze_a_jaxpr_the_user_printed(tmp_path):
  import jax
  import jax.numpy as jnp

  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x)

  ws = [jnp.ones((32, 32))] * 8
  dump = tmp_path / "step.txt"
  dump.write_text(str(jax.make_jaxpr(jax.grad(loss))(ws, jnp.ones((1024, 32)))))
  code, out, err = run(
    "analyze",
    dump,
    "--budget",
    "80%",
    "--budget",
    "60%",
    "--solver",
    "xla-greedy",
    "--solver",
    "chen-sqrtn",
    "--time-limit",
    "5",
    "--json",
    tmp_path / "t.json",
    "--plot",
    tmp_path / "t.png",
  )
  assert code == 0, err
  assert "xla-greedy" in out and "chen-sqrtn" in out
  rows = json.loads((tmp_path / "t.json").read_text())["rows"]
  assert len(rows) == 4 and {r["solver"] for r in rows} == {"xla-greedy", "chen-sqrtn"}
  assert any(r["peak_bytes"] and r["peak_bytes"] <= r["budget_bytes"] for r in rows)
  assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
  "content,words",
  [
    ("{ lambda ; a:f32[3]. let b:f32[3] = sin c in (b,) }", "variable 'c' is used before"),
    ("not a jaxpr at all", "is not valid JSON"),
  ],
)
def test_analyze_bad_input_is_one_clear_line(tmp_path, content, words):
  bad = tmp_path / "dump.txt"
  bad.write_text(content)
  code, out, err = run("analyze", bad)
  assert code == 1 and words in err and str(bad) in err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_analyze_takes_a_target_only_for_jaxpr_text(tmp_path):
  graph = tmp_path / "g.json"
  graph.write_text(
    json.dumps(
      {
        "format": "jaxremat.graph/1",
        "name": "g",
        "nodes": [{"id": 0, "mem": 4, "cost": 0}, {"id": 1, "mem": 4, "cost": 1}],
        "edges": [[0, 1]],
        "inputs": [0],
        "outputs": [1],
      }
    )
  )
  code, out, err = run("analyze", graph, "--target", "tpu-v5e")
  assert code == 2 and out == ""
  assert "--target tpu-v5e applies to jaxpr text" in err and "save_graph" in err
  code, out, _ = run("analyze", graph, "--budget", "100%")
  assert code == 0 and "model: as given in the graph file" in out


def test_targets_lists_each_target_with_its_facts_measured():
  code, out, err = run("targets", "cpu", "tpu-v5e")
  assert code == 0, err
  cpu = next(line for line in out.splitlines() if line.startswith("cpu "))
  # The barrier holds on XLA:CPU from jaxlib 0.11 on; reductions never take shared values.
  assert "select" in cpu and cpu.count("no (measured no)") == 1 + (not CPU_BARRIER_HOLDS)
  tpu = next(line for line in out.splitlines() if line.startswith("tpu-v5e "))
  assert "yes (measured yes)" in tpu or 'pip install -e ".[tpu-aot]"' in tpu
