"""Central differences over the sim trainer's one weight vector: the reference the sim
trainer's analytic gradients are checked against (tests/backends/test_sim.py, tests/trainer)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def central_difference(theta: np.ndarray, objective: Callable[[], float], h: float = 1e-6) -> np.ndarray:
    """d objective / d theta[i] for every i, by (f(theta + h e_i) - f(theta - h e_i)) / 2h;
    ``theta`` is moved in place and put back."""
    numeric = np.zeros(theta.shape[0])
    for i in range(theta.shape[0]):
        for sign in (1, -1):
            theta[i] += sign * h
            numeric[i] += sign * objective()
            theta[i] -= sign * h
    return numeric / (2 * h)
