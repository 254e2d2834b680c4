"""Section c: generation speed with autosave every N tokens (full, delta) vs none.

Every run starts from the same prefilled prompt and generates the same greedy tokens.
Full and delta autosave use ``engine.autosave.Autosaver`` (``mode="full"`` /
``"delta"``); without it, full autosave is ``Runtime.save`` to one file and delta is n/a.
Runs without autosave are interleaved between the others and the best of them is the
baseline (the noise of a shared machine only ever slows a run down).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.common import Table, clock, greedy_conversation, median, prompt_tokens

MB = 1e6


def table() -> Table:
    return Table("c. Generation speed with autosave (tokens/s; cost vs no autosave; direct = time in "
                 "autosave calls / generation time)",
                 ["model", "context", "tokens", "every", "none_tok_s", "full_tok_s", "full_cost_pct",
                  "full_direct_pct", "full_save_ms", "full_MB", "delta_tok_s", "delta_cost_pct",
                  "delta_direct_pct", "delta_save_ms", "delta_MB"])


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

    @property
    def written(self) -> int:
        return getattr(self.fn, "bytes_written", self.bytes)


def _run(rt, prompt: list[int], n_gen: int, every: int, saver) -> float:
    from engine.generation import generate
    rt.trim(len(prompt))
    conv = greedy_conversation(prompt)
    result = generate(rt, conv, stop_after=n_gen, autosave=saver, autosave_every=every if saver else 0)
    if result.n_generated != n_gen:
        raise RuntimeError(f"generated {result.n_generated} tokens, wanted {n_gen}")
    return result.tokens_per_s


def measure(rt, key: str, context: int, n_gen: int, everies: list[int], folder: Path, out: Table) -> None:
    from engine.checkpoints.format import KIND_AUTOSAVE
    prompt = prompt_tokens(rt.model, context)
    Autosaver, why = _delta_factory()
    if why and why not in out.notes:
        out.notes.append(why + ": delta columns are n/a, full autosave is Runtime.save to one file")
    rt.trim(0)
    _run(rt, prompt, 8, 0, None)   # prefill once, warm everything up
    baseline = [_run(rt, prompt, n_gen, 0, None)]
    results = []
    for every in everies:
        got = {}
        for mode in ("full", "delta"):
            store = folder / f"{key}-{mode}-{every}"
            store.mkdir(parents=True, exist_ok=True)
            if Autosaver is not None:
                saver = _Counting(Autosaver(rt, store, mode=mode))
            elif mode == "full":
                path = store / "autosave.kvckpt"
                saver = _Counting(lambda c, p=path: rt.save(p, c, KIND_AUTOSAVE), path)
            else:
                continue
            try:
                got[mode] = (_run(rt, prompt, n_gen, every, saver), saver)
            except Exception as exc:  # noqa: BLE001 - the delta feature is young: report, go on
                note = f"{mode} autosave failed: {type(exc).__name__}: {exc}"
                if note not in out.notes:
                    out.notes.append(note)
            shutil.rmtree(store, ignore_errors=True)
        baseline.append(_run(rt, prompt, n_gen, 0, None))
        results.append((every, got))
    base = max(baseline)
    for every, got in results:
        row = dict(model=key, context=context, tokens=n_gen, every=every, none_tok_s=base)
        for mode in ("full", "delta"):
            tps, saver = got.get(mode, (None, None))
            row[f"{mode}_tok_s"] = tps
            row[f"{mode}_cost_pct"] = None if tps is None else 100.0 * (1 - tps / base)
            row[f"{mode}_save_ms"] = 1000 * median(saver.seconds) if saver and saver.seconds else None
            row[f"{mode}_MB"] = saver.written / MB if saver else None
            # noise-free view of the same cost: time spent inside the autosave calls
            row[f"{mode}_direct_pct"] = (100.0 * sum(saver.seconds) / (n_gen / tps)
                                         if saver and tps else None)
        out.add(**row)
    spread = (max(baseline) - min(baseline)) / base * 100
    out.notes.append(f"{key}: best of {len(baseline)} runs without autosave is the baseline; "
                     f"they spread over {spread:.1f}% of it")
