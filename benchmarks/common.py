"""What every benchmark section shares: models, prompts, timing, tables, memory peaks.

Nothing here asserts a timing.  These machines are small and shared, so every section
measures the things it compares side by side, in one process, interleaved, and reports
ratios; absolute numbers are for orientation only.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ggml_type id -> (bytes, elements) per block, for the theoretical KV size
GGML_BLOCK = {0: (4, 1), 1: (2, 1), 8: (34, 32), 2: (18, 32), 3: (20, 32), 6: (22, 32),
              7: (24, 32), 30: (2, 1)}
TYPE_NAMES = {0: "f32", 1: "f16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 30: "bf16"}

PARAGRAPHS = (
    "The archive of the northern city held maps, letters and ledgers from three centuries "
    "of trade; each shelf was labelled by hand and every visitor signed the register. ",
    "In spring the river rose over the lower quays, and the clerks carried the oldest "
    "boxes upstairs, counting them twice, because a lost box was never found again. ",
    "A merchant named Ilse Marten wrote to her brother about the price of salt, the "
    "weather at sea, and a ship that arrived {n} days late with half its cargo spoiled. ",
    "The guild met on the first Tuesday of each month to settle disputes over weights, "
    "measures and debts; the minutes of meeting {n} fill eleven closely written pages. ",
)


def prompt_text(n_paragraphs: int) -> str:
    return "".join(PARAGRAPHS[i % len(PARAGRAPHS)].format(n=i + 3) for i in range(n_paragraphs))


def prompt_tokens(model, n: int) -> list[int]:
    """Exactly ``n`` tokens of plain prose (BOS first when the model wants one)."""
    paragraphs = max(4, n // 20)
    while True:
        tokens = model.tokenize(prompt_text(paragraphs), add_special=True, parse_special=False)
        if len(tokens) >= n:
            return tokens[:n]
        paragraphs *= 2


# -- models -----------------------------------------------------------------------------
MODEL_KEYS = ("smollm", "gemma")


def model_path(key: str) -> Path:
    from engine.models import default_model_path, gemma_model_path
    if key == "smollm":
        return default_model_path()
    if key == "gemma":
        return gemma_model_path()
    raise SystemExit(f"unknown model {key!r}: choose from {', '.join(MODEL_KEYS)}")


def context_settings(n_ctx: int, threads: int, *, flash_attn: bool = True, kv_type: int = 8):
    from native.context import ContextSettings
    return ContextSettings(n_ctx=n_ctx, n_threads=threads, flash_attn=flash_attn,
                           type_k=kv_type, type_v=kv_type)


def ctx_size_for(n_tokens: int) -> int:
    """A context a little larger than ``n_tokens``, rounded up to 256."""
    return -(-(n_tokens + 64) // 256) * 256


def greedy_conversation(tokens: Sequence[int], *, n_predict: int = -1, ignore_eos: bool = True):
    """A conversation whose prompt is exactly ``tokens`` and whose answer is greedy."""
    from engine.conversation import Answer, Conversation
    from engine.sampling import SamplerSettings
    conv = Conversation(title="benchmark", sampler=SamplerSettings(temperature=0.0, ignore_eos=ignore_eos),
                        tokens=list(tokens))
    conv.answer = Answer(n_prompt_tokens=len(tokens), n_predict=n_predict)
    return conv


def kv_bytes(shape, type_k: int, type_v: int, cells_per_layer: Iterable[int]) -> int:
    """Theoretical K+V bytes: per layer, cells x n_head_kv x head size x bytes per element."""
    bk, ek = GGML_BLOCK[type_k]
    bv, ev = GGML_BLOCK[type_v]
    total = 0.0
    for cells in cells_per_layer:
        total += cells * shape.n_head_kv * (shape.n_embd_head_k * bk / ek + shape.n_embd_head_v * bv / ev)
    return int(round(total))


# -- timing -----------------------------------------------------------------------------
def clock() -> float:
    return time.perf_counter()


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def ratio(a: float, b: float) -> float | None:
    return None if not b or a is None or b is None else a / b


# -- memory -----------------------------------------------------------------------------
def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _malloc_trim() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory above the level at entry, for native allocations too.

    Resets the kernel's high-water mark (``/proc/self/clear_refs``, value 5) when it
    may, and samples VmRSS every millisecond in a thread besides; the larger of the two
    peaks counts.  Linux only; elsewhere the numbers are 0.
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.base = 0
        self.peak_sampled = 0
        self.peak_hwm = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = os.path.exists("/proc/self/status")

    def __enter__(self) -> PeakRSS:
        if not self.available:
            return self
        gc.collect()
        _malloc_trim()   # freed heap pages back to the kernel: reusing them must show up
        self.base = _status_kb("VmRSS") * 1024
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._hwm_reset = True
        except OSError:
            self._hwm_reset = False
        self.peak_sampled = self.base
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_sampled = max(self.peak_sampled, _status_kb("VmRSS") * 1024)
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        if not self.available:
            return
        self._stop.set()
        self._thread.join()
        self.peak_sampled = max(self.peak_sampled, _status_kb("VmRSS") * 1024)
        self.peak_hwm = _status_kb("VmHWM") * 1024 if self._hwm_reset else 0

    @property
    def extra(self) -> int:
        """Bytes above the entry level at the peak."""
        return max(0, max(self.peak_sampled, self.peak_hwm) - self.base)


# -- raw file floors --------------------------------------------------------------------
def raw_write(path: Path, data, *, chunk: int = 8 << 20) -> float:
    """Seconds to write ``data`` to a new file and fsync it (the floor of a save)."""
    view = memoryview(data).cast("B")
    started = clock()
    with open(path, "wb", buffering=0) as f:
        for start in range(0, len(view), chunk):
            f.write(view[start:start + chunk])
        os.fsync(f.fileno())
    return clock() - started


def raw_read(path: Path) -> tuple[float, bytearray]:
    """Seconds to read a whole file into a fresh buffer (the floor of a load)."""
    started = clock()
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        done = 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return clock() - started, buf


# -- tables -----------------------------------------------------------------------------
@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        return row

    def render(self) -> str:
        cells = [[_fmt(row.get(c)) for c in self.columns] for row in self.rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(self.columns)]
        line = "  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True))
        out = [self.title, line, "-" * len(line)]
        out += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "notes": self.notes}


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "n/a"
        a = abs(value)
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.1f}"
        if a >= 1:
            return f"{value:.2f}"
        return f"{value:.4f}" if a >= 0.001 or a == 0 else f"{value:.2e}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = clock()
    value = fn()
    return clock() - started, value


# -- two layouts of the same work, side by side ---------------------------------------------
#: (key, label, flag): one way of writing the same thing, as a benchmark's table names it
Layout = tuple[str, str, Any]   # (key, label, what one_run is given)


def interleaved_layouts(settings, repeats: int, layouts: Sequence[Layout], one_run,
                        prefix: str, model: Path | None = None) -> dict[str, list[dict]]:
    """``one_run(rt, reader, flag, folder)`` for each layout, ``repeats`` times, interleaved
    run by run (the machine's noise falls on all alike), with a writing and a reading
    Runtime of ``model`` (None: SmolLM2) on ``settings`` and a fresh folder each: the runs'
    dicts per key."""
    from engine.runtime import Runtime
    path = model or model_path("smollm")
    rt, reader = Runtime(path, settings), Runtime(path, settings)
    runs: dict[str, list[dict]] = {key: [] for key, _, _ in layouts}
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            for r in range(repeats):
                for key, _, flag in layouts:
                    runs[key].append(one_run(rt, reader, flag, Path(tmp) / f"{key}-{r}"))
    finally:
        rt.close()
        reader.close()
    return runs


def add_layout_rows(table: Table, runs: dict[str, list[dict]], layouts: Sequence[Layout], before: str,
                    medians: dict[str, str], firsts: dict[str, str] | None = None) -> None:
    """One row of ``table`` per layout of :func:`interleaved_layouts`' ``runs``: each column of
    ``medians`` the median of that key over the layout's runs, each of ``firsts`` the first
    run's value (a count, the same in every run), and ``restore_vs_before`` the layout's
    median ``restore_ms`` over that of the layout keyed ``before``."""
    base = median([r["restore_ms"] for r in runs[before]])
    for key, label, _ in layouts:
        rs = runs[key]
        row = {column: median([r[k] for r in rs]) for column, k in medians.items()}
        row.update({column: rs[0][k] for column, k in (firsts or {}).items()})
        table.add(layout=label, **row, restore_vs_before=ratio(median([r["restore_ms"] for r in rs]), base))


def warm_restores(reader, head_path: Path, tokens: Sequence[int], times: int = 5) -> tuple[float, int]:
    """(median seconds, files read): ``times`` restores of ``head_path``'s chain into
    ``reader``, emptied before each, every check included; SystemExit when the restore
    holds other tokens than ``tokens``."""
    from engine.checkpoints.chain import load_chain, release
    took, files = [], 0
    for _ in range(times):
        reader.trim(0)
        reader.ctx.clear()
        started = clock()
        chain = load_chain(head_path, crc_later=True)
        reader.restore_chain(chain)
        release(chain)   # as the app's restores do
        took.append(clock() - started)
        files = len(chain)
    if list(reader.kv_tokens) != list(tokens):
        raise SystemExit("the restore holds other tokens")
    return median(took), files
