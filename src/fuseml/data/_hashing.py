"""Counter-based pseudo-random numbers (SplitMix64) shared by the data modules.

Every value is a pure function of ``(key, counter)``. The row split of ``prepare`` and
every random draw of the synthetic generator are keyed by a row's position, so results
do not depend on how the rows were chunked and no generator state is carried between
chunks.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64 increment (odd, golden ratio)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_TWO_POW_M53 = 2.0**-53


def _mix_int(x: int) -> int:
    """SplitMix64 finaliser on a Python int (used for scalar keys)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """Combine integers (seed, stream id, table index, ...) into one 64-bit key."""
    key = 0
    for part in parts:
        key = _mix_int((key ^ (part & _MASK64)) + _GAMMA)
    return key


def hash_u64(key: int, counters: np.ndarray) -> np.ndarray:
    """SplitMix64 output number ``counters`` of the stream seeded with ``key``, as uint64."""
    # Unsigned numpy arrays wrap around on overflow, which is the arithmetic wanted here.
    x = counters.astype(np.uint64) * np.uint64(_GAMMA) + np.uint64(key & _MASK64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_MUL1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_MUL2)
    x ^= x >> np.uint64(31)
    return x


def uniform(key: int, counters: np.ndarray) -> np.ndarray:
    """Uniform floats in the open interval (0, 1), one per counter."""
    # 53 high bits, shifted by half a step so that neither 0 nor 1 occurs (log-safe).
    return ((hash_u64(key, counters) >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_M53


def normal(key: int, counters: np.ndarray) -> np.ndarray:
    """Standard normal floats, one per counter (Box-Muller on the two halves of one hash)."""
    h = hash_u64(key, counters)
    # 32 bits per uniform; u1 is shifted into (0, 1) so that log(u1) is finite.
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
