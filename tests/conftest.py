"""Shared fixtures: the benchmark graph suite in ../shared/graphs."""

from __future__ import annotations

import pathlib

import pytest

from jaxremat import RematGraph

SHARED_GRAPHS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "graphs"
GRAPH_NAMES = sorted(p.stem for p in SHARED_GRAPHS.glob("*.json"))


def shared_graph(name: str) -> RematGraph:
  """Loads ``../shared/graphs/NAME.json`` or skips the test with the reason."""
  path = SHARED_GRAPHS / f"{name}.json"
  if not path.exists():
    pytest.skip(
      f"{path} does not exist: the benchmark graphs live in ../shared/graphs beside the checkout."
    )
  return RematGraph.load(path)


@pytest.fixture(params=GRAPH_NAMES or ["<no shared graphs>"])
def any_shared_graph(request) -> RematGraph:
  """Every graph in ../shared/graphs, one test each (skipped when the folder is absent)."""
  return shared_graph(request.param)
