"""llama.cpp's sampler chain, driven over a candidate array we own.

The engine needs sampling to be a pure function of (logits, recent tokens, settings,
per-position seed) so that a resumed generation samples exactly what an uninterrupted
one would.  llama.cpp's stateless filters (top-k, top-p, min-p, temperature) and its
repeat-penalty sampler (whose only state is the last N tokens, which the engine
replays) satisfy that; the random draw comes from a fresh ``dist`` sampler seeded for
each position.

The candidate array is a numpy structured array laid out as ``llama_token_data``
(id, logit, p), so refilling it from the logits is one vectorised copy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import numpy as np

from native.library import bindings

TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class Candidates:
    """A reusable ``llama_token_data_array`` over the whole vocabulary."""

    def __init__(self, n_vocab: int) -> None:
        ll = self._ll = bindings()
        assert TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)
        self.n_vocab = n_vocab
        self.data = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = ll.llama_token_data_array(
            data=self.data.ctypes.data_as(ll.llama_token_data_p),
            size=n_vocab, selected=-1, sorted=False)
        self.pointer = ctypes.pointer(self.array)

    def fill(self, logits: np.ndarray) -> None:
        self.data["id"] = self._ids
        self.data["logit"] = logits
        self.data["p"] = 0.0
        self.array.size = self.n_vocab
        self.array.selected = -1
        self.array.sorted = False

    @property
    def selected_token(self) -> int:
        index = self.array.selected
        if index < 0 or index >= self.array.size:
            raise RuntimeError("the sampler selected no token")
        return int(self.data["id"][index])


class SamplerChain:
    """An owned ``llama_sampler`` chain of filters (no random draw inside)."""

    def __init__(self, *, n_vocab: int, top_k: int, top_p: float, min_p: float,
                 temperature: float, repeat_penalty: float, repeat_last_n: int) -> None:
        ll = self._ll = bindings()
        params = ll.llama_sampler_chain_default_params()
        params.no_perf = True
        self._ptr = ll.llama_sampler_chain_init(params)
        self.has_penalty = repeat_penalty != 1.0 and repeat_last_n != 0
        if self.has_penalty:
            # llama_sampler_init_penalties(int32 n_vocab, int32 penalty_last_n, float penalty_repeat,
            #                              float penalty_freq, float penalty_present)
            ll.llama_sampler_chain_add(self._ptr, ll.llama_sampler_init_penalties(
                n_vocab, repeat_last_n, repeat_penalty, 0.0, 0.0))
        self.greedy = temperature <= 0.0
        if not self.greedy:
            if top_k > 0:
                ll.llama_sampler_chain_add(self._ptr, ll.llama_sampler_init_top_k(top_k))
            if top_p < 1.0:
                ll.llama_sampler_chain_add(self._ptr, ll.llama_sampler_init_top_p(top_p, 1))
            if min_p > 0.0:
                ll.llama_sampler_chain_add(self._ptr, ll.llama_sampler_init_min_p(min_p, 1))
            ll.llama_sampler_chain_add(self._ptr, ll.llama_sampler_init_temp(temperature))

    def accept(self, tokens: Iterable[int]) -> None:
        """Feed tokens to the stateful filters (the repeat penalty's history)."""
        if not self.has_penalty:
            return
        for token in tokens:
            self._ll.llama_sampler_accept(self._ptr, token)

    def sample(self, candidates: Candidates, logits: np.ndarray, seed: int) -> int:
        """Filter ``logits`` and draw one token with a ``dist`` sampler seeded by ``seed``."""
        ll = self._ll
        if self.greedy and not self.has_penalty:
            return int(np.argmax(logits))
        candidates.fill(logits)
        ll.llama_sampler_apply(self._ptr, candidates.pointer)
        if self.greedy:
            final = ll.llama_sampler_init_greedy()
        else:
            final = ll.llama_sampler_init_dist(seed & 0xFFFFFFFF)
        try:
            ll.llama_sampler_apply(final, candidates.pointer)
        finally:
            ll.llama_sampler_free(final)
        return candidates.selected_token

    def close(self) -> None:
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._ll.llama_sampler_free(ptr)

    def __del__(self) -> None:
        self.close()
