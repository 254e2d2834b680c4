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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
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
    def from_json(cls, data: dict[str, Any]) -> SamplerSettings:
        known = {f.name: f.type for f in fields(cls)}
        clean: dict[str, Any] = {}
        for name, value in data.items():
            if name not in known:
                continue
            if known[name] == "bool":
                if isinstance(value, bool):
                    clean[name] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                clean[name] = int(value) if known[name] == "int" else float(value)
        return cls(**clean)


# -- what a model starts with ---------------------------------------------------------------------

#: The bundled SmolLM2-135M-Instruct.  Its model card's example (temperature 0.2, top-p
#: 0.9) loops within a few hundred tokens of a story, and so does 0.8 without a penalty:
#: repeated word 6-grams over 900 tokens ("Write a long story about a lighthouse keeper.",
#: seeds 1 and 2) were 0.51/0.54 and 0.32/0.54; 0.7, top-p 0.9 and a repeat penalty of
#: 1.1 over the last 64 tokens gave 0.00/0.06 (benchmarks/sampling_defaults.py).
BUNDLED_MODEL_DEFAULTS = SamplerSettings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                         repeat_penalty=1.1, repeat_last_n=64)
#: Any other model without recommendations in its file: llama.cpp's usual sampling, and
#: a mild repetition penalty (small models loop without one).
GENERIC_DEFAULTS = SamplerSettings(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                   repeat_penalty=1.1, repeat_last_n=64)

#: GGUF keys in which a model's authors record the sampling they recommend (llama.cpp's
#: ``general.sampling.*``), and the setting each one sets.
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repeat_penalty",
                      "general.sampling.penalty_last_n": "repeat_last_n"}
#: Where defaults came from, for Settings.
FROM_MODEL_FILE, FROM_MEASUREMENT, FROM_GENERIC = (
    "recommended in the model file", "measured for the bundled model", "general defaults")


def model_defaults(gguf_meta: Mapping[str, Any], *, bundled: bool = False) -> tuple[SamplerSettings, str]:
    """The sampler a model starts with, and where that came from.

    Recommendations in the GGUF file win (over the generic defaults, key by key); the
    bundled model uses what was measured for it.  Values out of range are ignored.
    """
    base = BUNDLED_MODEL_DEFAULTS if bundled else GENERIC_DEFAULTS
    found: dict[str, Any] = {}          # an int or a float, as each setting's field wants
    for key, name in GGUF_SAMPLING_KEYS.items():
        value = gguf_meta.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name in ("top_k", "repeat_last_n"):
            if -1 <= value <= 1 << 20:
                found[name] = int(value)
        elif 0.0 <= value <= 100.0:
            found[name] = float(value)
    if found:
        return replace(base, **found), FROM_MODEL_FILE
    return base, FROM_MEASUREMENT if bundled else FROM_GENERIC


def defaults_for_model(model) -> tuple[SamplerSettings, str]:
    """:func:`model_defaults` for a loaded model (native.model.Model): llama.cpp already
    holds its metadata, so nothing is read from disk again (reading the GGUF header in
    Python walks the tokenizer's ~100k strings: tens of milliseconds with the GIL held,
    which the window's UI thread would feel)."""
    from engine.models import is_default_model
    meta: dict[str, Any] = {}
    for key in GGUF_SAMPLING_KEYS:
        raw = model.meta(key)
        if raw is None:
            continue
        try:
            meta[key] = int(raw) if raw.lstrip("-").isdigit() else float(raw)
        except ValueError:
            continue
    return model_defaults(meta, bundled=is_default_model(model.path))


def defaults_for_model_file(path) -> tuple[SamplerSettings, str]:
    """:func:`model_defaults` for a GGUF file on disk (read without llama.cpp)."""
    from engine.gguf import GGUFError, read_metadata
    from engine.models import is_default_model
    try:
        meta = read_metadata(path)
    except (GGUFError, OSError):
        meta = {}
    return model_defaults(meta, bundled=is_default_model(path))
