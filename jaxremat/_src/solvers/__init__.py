"""Solvers: each turns (graph, budget) into a `Schedule`. None of them imports JAX."""
