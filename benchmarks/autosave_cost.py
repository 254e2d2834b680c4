"""Section c: generation speed with autosave every N tokens (full, delta) vs none.

Every run starts from the same prefilled prompt and generates the same greedy tokens;
runs without autosave are interleaved between the others and their median is the
baseline, so drifting machine load shows up as spread, not as a cost.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.common import Table, clock, greedy_conversation, median, prompt_tokens

MB = 1e6


def table() -> Table:
    return Table("c. Generation speed with autosave (tokens/s; cost vs no autosave)",
                 ["model", "context", "tokens", "every", "none_tok_s", "full_tok_s", "full_cost_pct",
                  "full_save_ms", "full_MB", "delta_tok_s", "delta_cost_pct", "delta_save_ms"])


def _delta_factory():
    """engine.autosave.Autosaver when it exists, else None and the reason."""
    try:
        from engine.autosave import Autosaver
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        return None, f"engine.autosave.Autosaver unavailable ({type(exc).__name__}: {exc})"
    return Autosaver, None


class _Counting:
    """Wraps an autosave callable: counts calls, their time and (full) bytes written."""

    def __init__(self, fn, path: Path | None = None) -> None:
        self.fn = fn
        self.path = path
        self.seconds: list[float] = []
        self.bytes = 0

    def __call__(self, conv) -> None:
        t0 = clock()
        self.fn(conv)
        self.seconds.append(clock() - t0)
        if self.path is not None and self.path.exists():
            self.bytes += self.path.stat().st_size


def _run(rt, prompt: list[int], n_gen: int, every: int, saver) -> float:
    from engine.generation import generate
    rt.trim(len(prompt))
    conv = greedy_conversation(prompt)
    result = generate(rt, conv, stop_after=n_gen, autosave=saver, autosave_every=every if saver else 0)
    if result.n_generated != n_gen:
        raise RuntimeError(f"generated {result.n_generated} tokens, wanted {n_gen}")
    return result.tokens_per_s


def measure(rt, key: str, context: int, n_gen: int, everies: list[int], folder: Path, out: Table) -> None:
    from engine.checkpoint_format import KIND_AUTOSAVE
    prompt = prompt_tokens(rt.model, context)
    Autosaver, why = _delta_factory()
    if why and why not in out.notes:
        out.notes.append(why + ": delta columns are n/a")
    rt.trim(0)
    _run(rt, prompt, 8, 0, None)   # prefill once, warm everything up
    baseline = [_run(rt, prompt, n_gen, 0, None)]
    results = []
    for every in everies:
        path = folder / f"{key}-autosave.kvckpt"
        full = _Counting(lambda c, p=path: rt.save(p, c, KIND_AUTOSAVE), path)
        full_tps = _run(rt, prompt, n_gen, every, full)
        delta_tps, delta = None, None
        if Autosaver is not None:
            store = folder / f"{key}-delta-{every}"
            try:
                delta = _Counting(Autosaver(rt, store, mode="delta"))
                delta_tps = _run(rt, prompt, n_gen, every, delta)
            except Exception as exc:  # noqa: BLE001
                note = f"delta autosave failed: {type(exc).__name__}: {exc}"
                if note not in out.notes:
                    out.notes.append(note)
                delta = None
            shutil.rmtree(store, ignore_errors=True)
        baseline.append(_run(rt, prompt, n_gen, 0, None))
        results.append((every, full_tps, full, delta_tps, delta))
        path.unlink(missing_ok=True)
    base = median(baseline)
    for every, full_tps, full, delta_tps, delta in results:
        out.add(model=key, context=context, tokens=n_gen, every=every, none_tok_s=base,
                full_tok_s=full_tps, full_cost_pct=100.0 * (1 - full_tps / base),
                full_save_ms=1000 * median(full.seconds) if full.seconds else None,
                full_MB=full.bytes / MB,
                delta_tok_s=delta_tps,
                delta_cost_pct=None if delta_tps is None else 100.0 * (1 - delta_tps / base),
                delta_save_ms=1000 * median(delta.seconds) if delta and delta.seconds else None)
    spread = (max(baseline) - min(baseline)) / base * 100
    out.notes.append(f"{key}: {len(baseline)} runs without autosave, spread {spread:.1f}% of the median")
