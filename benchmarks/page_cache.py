"""How the page cache holds a checkpoint, and what that costs a restore's mapping (Linux).

    python -m benchmarks.page_cache [--sizes-mb 24,92] [--repeats 5] [--folder DIR]

A restore maps a checkpoint's state and populates the mapping before anything reads it
(engine.checkpoints.mapped), then llama.cpp copies it into the cache.  With 4 KiB pages
that costs a page-table entry per 4 KiB; a file system with large folios (ext4 from
Linux 6.16, xfs) can hold the file in 2 MiB pages instead, mapped with one entry each.
Two things decide which it gets, and this measures both, side by side, interleaved:

* **how the file was written** (hot: just written, still in the page cache): the writer's
  writes aligned to 2 MiB in the file (format._write_parts) against the same bytes written
  as the writer did before, in 2 MiB chunks from the state's own start;
* **how a cold file is read back** (evicted with ``posix_fadvise(DONTNEED)`` first): the
  mapping with ``MADV_HUGEPAGE`` (mapped._ask_for_huge_pages) or without it; then the same
  file mapped again, now cached as that read left it.

For each: ``populate_ms`` (map the whole file, populate the state's pages) and
``copy_ms`` (populate, then copy the state out into memory already faulted in, as
``llama_state_seq_set_data`` does), and how much of the file was mapped with 2 MiB pages
(``huge_MB``, from /proc/self/smaps).  The files hold random bytes in the checkpoint
format's layout, written by the real writer.  Medians; exits 0 whatever the numbers, and
says so when the platform cannot map this way.
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import sys
import tempfile
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.common import Table, clock, median, ratio  # noqa: E402
from engine.checkpoints import format as fmt  # noqa: E402
from engine.checkpoints import mapped  # noqa: E402


def table() -> Table:
    return Table("A checkpoint's state mapped from the page cache (ms, medians)",
                 ["state_MB", "case", "populate_ms", "copy_ms", "huge_MB", "vs_first"])


def _header(state_len: int) -> fmt.Header:
    return fmt.Header(
        model_fingerprint=b"\x07" * 16, model_size=1, n_vocab=49152, n_layer=30, n_head_kv=3,
        n_embd_head_k=64, n_embd_head_v=64, n_swa=0, n_ctx=8192, type_k=8, type_v=8,
        flash_attn=True, kv_unified=True, n_seq_max=2, n_tokens=2, n_tokens_total=2,
        n_generated=0, created_unix_ns=1_700_000_000_000_000_000, conversation_id=uuid.uuid4(),
        library="benchmark", title="page cache")


def write_aligned(path: Path, state: np.ndarray) -> None:
    """As the app's writer writes: format.write_sections, then fsync."""
    meta = fmt.encode_metadata({"title": "page cache", "transcript": "words " * 2000})
    with open(path, "wb") as f:
        fmt.write_sections(f, _header(len(state)), meta, np.array([1, 2], dtype=np.int32), None, state)
        f.flush()
        os.fsync(f.fileno())


def write_unaligned(src: Path, path: Path, chunk: int = 2 << 20) -> None:
    """The same bytes as ``src``, written as the writer wrote them before its writes were
    aligned: the sections before the state, then the state in chunks from its own start."""
    h = fmt.read_header(src)
    data = memoryview(src.read_bytes())
    end = h.state_offset + h.state_len
    with open(path, "wb") as f:
        f.write(data[:h.state_offset])
        for start in range(h.state_offset, end, chunk):
            f.write(data[start:min(start + chunk, end)])
        f.write(data[end:])
        f.flush()
        os.fsync(f.fileno())


def evict(path: Path) -> bool:
    """Drop ``path`` from the page cache; False where it stayed (tmpfs keeps its files):
    the "cold" rows are then not cold, and the table says so."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return _cached_pages(path) == 0


def _cached_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache now (mincore over a mapping that touches none)."""
    import ctypes
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    with open(path, "rb") as f:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1
        try:
            if libc.mincore(addr, size, vec) != 0:
                return -1
        finally:
            libc.munmap(addr, size)
    return sum(b & 1 for b in vec.raw)


def huge_mb(path: Path) -> float:
    """MB of ``path`` this process maps with 2 MiB pages now (FilePmdMapped)."""
    name = str(path.resolve())   # as /proc names it
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(name)
        elif inside and line.startswith("FilePmdMapped:"):
            return int(line.split()[1]) / 1024
    return 0.0


def map_once(path: Path, dest: np.ndarray | None, hugepage: bool) -> tuple[float, float]:
    """Map ``path``, populate its state (and copy it into ``dest``): seconds, huge-page MB."""
    h = fmt.read_header(path)
    with open(path, "rb") as f:
        started = clock()
        m = mmap.mmap(f.fileno(), h.file_len, access=mmap.ACCESS_READ)
        if hugepage:
            mapped._ask_for_huge_pages(m, h.file_len)
        mapped.populate(m, h.state_offset, h.state_len)
        if dest is not None:
            src = np.frombuffer(m, dtype=np.uint8, count=h.state_len, offset=h.state_offset)
            np.copyto(dest[:h.state_len], src)
            del src
        spent = clock() - started
        huge = huge_mb(path)
        m.close()
    return spent, huge


def run(sizes_mb: list[int], repeats: int, folder: Path | None = None, echo=print) -> dict:
    out = table()
    if not mapped.supported() or not sys.platform.startswith("linux"):   # (/proc/self/smaps, MADV_*)
        out.notes.append("measured on Linux only (its page cache and mapping calls): nothing measured")
        return {"table": out}
    with tempfile.TemporaryDirectory(prefix="page-cache-") as tmp:
        where = folder or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        not_cold: set[int] = set()
        for size_mb in sizes_mb:
            state = rng.integers(0, 256, size_mb << 20, dtype=np.uint8)
            dest = np.empty(len(state), dtype=np.uint8)
            dest[:] = 0   # faulted in once, as llama.cpp's cache is
            aligned, unaligned = where / f"aligned-{size_mb}.kvckpt", where / f"unaligned-{size_mb}.kvckpt"
            rows: dict[str, list[tuple[float, float, float]]] = {}
            echo(f"{size_mb} MB ...", file=sys.stderr)
            for _ in range(repeats):   # interleaved: the machine's noise falls on every case
                for name, path in (("hot, written aligned (now)", aligned),
                                   ("hot, written unaligned (before)", unaligned)):
                    write_aligned(aligned, state)
                    if path is unaligned:
                        write_unaligned(aligned, unaligned)
                    now = path is aligned   # the reader before asked for no huge pages
                    populate_s, huge = map_once(path, None, hugepage=now)
                    copy_s, _ = map_once(path, dest, hugepage=now)
                    rows.setdefault(name, []).append((populate_s, copy_s, huge))
                for hugepage in (True, False):
                    label = "with MADV_HUGEPAGE (now)" if hugepage else "without (before)"
                    if not evict(unaligned):
                        not_cold.add(size_mb)
                    cold_copy_s, huge = map_once(unaligned, dest, hugepage)
                    again_s, again_huge = map_once(unaligned, dest, hugepage)
                    rows.setdefault(f"cold, read {label}", []).append((float("nan"), cold_copy_s, huge))
                    rows.setdefault(f"  then mapped again, {label}", []).append((float("nan"), again_s, again_huge))
            first: dict[str, float] = {}
            for name, values in rows.items():
                pop = median([v[0] for v in values])
                copy = median([v[1] for v in values])
                group = name.split(",")[0].strip()
                first.setdefault(group, copy)
                out.add(state_MB=size_mb, case=name,
                        populate_ms=None if pop != pop else pop * 1e3, copy_ms=copy * 1e3,
                        huge_MB=median([v[2] for v in values]), vs_first=ratio(copy, first[group]))
        if not_cold:
            out.notes.append(f"NOT COLD: {sorted(not_cold)} MB stayed in the page cache after posix_fadvise "
                             "(this file system keeps its files): the cold rows are warm")
    out.notes.append("copy_ms: map, populate and copy the state out; a cold file's includes reading it from disk")
    out.notes.append("vs_first: copy_ms against the first row of the same kind (hot / cold / mapped again)")
    return {"table": out, "sizes_mb": sizes_mb, "repeats": repeats, "load_avg": os.getloadavg()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.page_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", default="24,92", help="state sizes in MiB (default 24,92)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", metavar="DIR", help="write the files here (default: a temporary folder)")
    args = parser.parse_args(argv)
    report = run([int(s) for s in args.sizes_mb.split(",")], args.repeats,
                 Path(args.folder) if args.folder else None)
    print(report["table"].render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
