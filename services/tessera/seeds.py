"""Seeded sampling as a pure function of (seed, choice index, output position): the random
draw for output token p of choice j depends on nothing else, so any replica, a resumed
stream, or a speculative verifier reproduces it exactly (plain Python, no torch)."""
from __future__ import annotations

_MASK = (1 << 64) - 1


def mix(a: int, b: int) -> int:
    """A 63-bit hash of two integers (splitmix64 finalizer over a ^ golden-ratio * b)."""
    z = (a + 0x9E3779B97F4A7C15 * (b + 1)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def choice_seed(seed: int, choice: int) -> int:
    """Choice 0 keeps the user's seed (n = 1 behaves as the seed says); choice j > 0 gets its
    own stream, never another choice's or another seed's."""
    return seed if choice == 0 else mix(seed, -choice)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for output position `position` of a request seeded with `seed`."""
    return mix(seed, position)
