"""rlengine.seeding: every derived seed from one splitmix64.

References: splitmix64's published output for seed 0 (the reference
implementation's first values), the vectorized twin against the scalar, and
the RL loop's seed folding as it was written before it moved here.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from rlengine.seeding import derive_seed, mix, mix_array, mix_seed

_M64 = 0xFFFFFFFFFFFFFFFF


def test_mix_is_splitmix64():
    # splitmix64 seeded with 0: its first three outputs (Vigna's reference code).
    assert [mix(0, i) for i in range(3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@given(st.lists(st.tuples(st.integers(-2**70, 2**70), st.integers(0, 10_000)), min_size=1, max_size=50))
def test_the_vectorized_twin_equals_the_scalar(pairs):
    seeds = np.array([s & _M64 for s, _ in pairs], dtype=np.uint64)
    positions = np.array([p for _, p in pairs], dtype=np.int64)
    assert mix_array(seeds, positions).tolist() == [mix(s, p) for s, p in pairs]


@given(st.integers(-2**64, 2**64), st.integers(0, 1 << 20))
def test_derived_seeds_are_63_bit_and_differ_per_index(seed, index):
    a, b = derive_seed(seed, index), derive_seed(seed, index + 1)
    assert 0 <= a < 2**63 and 0 <= b < 2**63 and a != b
    assert a == mix(seed, index) & (2**63 - 1)


def _old_mix_seed(*parts: int) -> int:
    """``rlengine.rl.rollouts.mix_seed`` as it was: the RL loop's seeds must not change."""
    z = 0x243F6A8885A308D3
    for part in parts:
        z = (z ^ (part & _M64)) * 0x9E3779B97F4A7C15 & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        z ^= z >> 31
    return z & ((1 << 63) - 1)


@given(st.lists(st.integers(-2**65, 2**65), max_size=5))
def test_mix_seed_folds_parts_as_the_rl_loop_always_has(parts):
    assert mix_seed(*parts) == _old_mix_seed(*parts)
    assert 0 <= mix_seed(*parts) < 2**63
