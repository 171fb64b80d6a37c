"""Seeds, all from one mixer: splitmix64 (Steele, Lea and Flood, 2014).

Every seed rlengine derives comes from here, so that a seed means the same
thing everywhere and across processes and runs:

* ``mix(seed, index)``: the splitmix64 output for state ``seed + (index + 1) *
  GOLDEN`` (64 bits): the sim backend's token draws;
* ``mix_array(seeds, positions)``: its vectorized twin over numpy arrays;
* ``derive_seed(seed, index)``: ``mix`` cut to 63 bits, the seed of sample
  ``index`` of a request seeded with ``seed`` (and of a paused sequence
  resumed after ``index`` tokens);
* ``mix_seed(*parts)``: a 63-bit seed folded from several integers (the RL
  loop's per-group, per-attempt and per-turn seeds).

Pure functions; no state, no randomness of their own.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "derive_seed", "mix", "mix_array", "mix_seed"]

_M64 = 0xFFFFFFFFFFFFFFFF
_M63 = (1 << 63) - 1
GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""splitmix64's increment (the golden ratio) and its two finalizer multipliers."""
_NP = (np.uint64(GOLDEN), np.uint64(_MUL1), np.uint64(_MUL2))


def _finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MUL1) & _M64
    z = ((z ^ (z >> 27)) * _MUL2) & _M64
    return z ^ (z >> 31)


def mix(seed: int, index: int) -> int:
    """splitmix64 of ``seed`` at step ``index`` (64 bits; any int seed, taken mod 2**64)."""
    return _finalize((seed + (index + 1) * GOLDEN) & _M64)


def mix_array(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``mix(seeds[i], positions[i])`` for whole arrays (uint64 seeds, integer positions)."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64, copy=False) + (positions.astype(np.uint64) + np.uint64(1)) * _NP[0]
        z = (z ^ (z >> np.uint64(30))) * _NP[1]
        z = (z ^ (z >> np.uint64(27))) * _NP[2]
        return z ^ (z >> np.uint64(31))


def derive_seed(seed: int, index: int) -> int:
    """The 63-bit seed of sample ``index`` of a request seeded with ``seed``."""
    return mix(seed, index) & _M63


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, each folded in with splitmix64's finalizer."""
    z = 0x243F6A8885A308D3
    for part in parts:
        z = _finalize(((z ^ (part & _M64)) * GOLDEN) & _M64)
    return z & _M63
