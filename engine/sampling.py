"""Sampler settings and the per-position seed that makes sampling resumable.

The determinism contract: with the same model, settings and seed, generating N tokens
in one go and generating k, checkpointing, exiting, and generating N-k in a new process
give the same tokens.  Sampling is therefore a pure function of

    (logits at position p, the last ``repeat_last_n`` tokens, settings, seed_for(seed, p))

where p is the absolute position in the sequence of the token being chosen.  No random
generator state is carried from one token to the next, so there is nothing to save:
the stored logits of the last position (see engine.checkpoints.format) and the token
list are enough.  ``seed_for`` mixes (seed, p) with SplitMix64, whose output is well
distributed even for consecutive inputs, and keeps 32 bits for llama.cpp's ``dist``
sampler.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, fields
from typing import Any

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_for(seed: int, position: int) -> int:
    """The 32-bit seed of the random draw for the token at ``position``."""
    return splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64)) & 0xFFFFFFFF


def random_seed() -> int:
    return secrets.randbits(32)


@dataclass(frozen=True)
class SamplerSettings:
    """How the next token is chosen; temperature <= 0 means greedy."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0
    ignore_eos: bool = False     # keep going past end-of-generation tokens (benchmarks, tests)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SamplerSettings":
        known = {f.name: f.type for f in fields(cls)}
        clean = {}
        for name, value in data.items():
            if name not in known:
                continue
            if known[name] == "bool":
                if isinstance(value, bool):
                    clean[name] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                clean[name] = int(value) if known[name] == "int" else float(value)
        return cls(**clean)
