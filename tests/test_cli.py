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


def _two_node_graph(tmp_path):
  """A graph file of one input and one node that reads it."""
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
  return graph


def test_analyze_takes_a_target_only_for_jaxpr_text(tmp_path):
  graph = _two_node_graph(tmp_path)
  code, out, err = run("analyze", graph, "--target", "tpu-v5e")
  assert code == 2 and out == ""
  assert "--target tpu-v5e applies to jaxpr text" in err and "save_graph" in err
  code, out, _ = run("analyze", graph, "--budget", "100%")
  assert code == 0 and "model: as given in the graph file" in out


def test_analyze_plot_without_matplotlib_says_what_to_install(tmp_path):
  """matplotlib is an extra (``jaxremat[plots]``): without it ``--plot`` is a usage error
  named before any work, not an internal error after the table."""
  graph = _two_node_graph(tmp_path)
  hide = "import sys; sys.modules['matplotlib'] = None"  # as where it is not installed
  run_cli = "from jaxremat._src.cli import main; sys.exit(main(sys.argv[1:]))"
  proc = subprocess.run(
    [sys.executable, "-c", f"{hide}; {run_cli}", "analyze", graph, "--plot", tmp_path / "t.png"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2 and proc.stdout == ""
  assert "--plot" in proc.stderr and "pip install matplotlib" in proc.stderr
  assert not (tmp_path / "t.png").exists()


def test_the_library_and_the_demos_step_need_no_extra():
  """``pip install -e ".[tpu-aot]"`` brings no optax, flax, equinox or matplotlib: every
  module of jaxremat imports without them, and `jaxremat demo`'s step trains."""
  code = """
import sys
for extra in ("optax", "flax", "equinox", "matplotlib"):
  sys.modules[extra] = None  # as where it is not installed
import importlib, pkgutil
import jaxremat
for m in pkgutil.walk_packages(jaxremat.__path__, "jaxremat."):
  importlib.import_module(m.name)
from jaxremat._src.demo import make_mlp_step
step, args = make_mlp_step(depth=2, width=8, batch=8)
params, opt_state, loss = step(*args)
print(float(loss) > 0, len(params), opt_state)
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["True", "2", "()"]


def test_targets_lists_each_target_with_its_facts_measured():
  code, out, err = run("targets", "cpu", "tpu-v5e")
  assert code == 0, err
  cpu = next(line for line in out.splitlines() if line.startswith("cpu "))
  # The barrier holds on XLA:CPU from jaxlib 0.11 on; reductions never take shared values.
  assert "select" in cpu and cpu.count("no (measured no)") == 1 + (not CPU_BARRIER_HOLDS)
  tpu = next(line for line in out.splitlines() if line.startswith("tpu-v5e "))
  assert "yes (measured yes)" in tpu or 'pip install -e ".[tpu-aot]"' in tpu
