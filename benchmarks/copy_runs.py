"""How fast this machine's ``memmove`` copies a restore's runs, by their length.

llama.cpp sets a sequence's state (``llama_state_seq_set_data``) by copying each layer's
K and V rows of a file as one run of cells x row bytes.  A conversation restored from
several files copies the same bytes in shorter runs, and glibc picks its copy method by
length (``rep movsb`` below a threshold, the L2 size on some AMD CPUs, a vector loop above):
this measures what that costs here, with ``memmove`` itself, into 4 KiB pages as llama.cpp's
CPU buffer is.

    python -m benchmarks.copy_runs [--mb 92] [--row 204] [--layers 60] [--repeats 25]

Defaults: SmolLM2-135M at 7,500 tokens (30 layers x K and V = 60 runs per file, 204-byte
q8_0 rows of 3 KV heads x 64).  Table 1: the same bytes as one file, as the shared layout's
three (1,500 + 3,000 + 3,000 tokens) and as twelve; table 2: 92 MB in pieces of each size.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time

import numpy as np

from benchmarks.common import Table


def _memmove():
    libc = ctypes.CDLL(None)
    move = libc.memmove
    move.restype = ctypes.c_void_p
    move.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return move


def _buffers(size: int):
    """A source in ordinary memory and a destination of 4 KiB pages, both written once."""
    mapping = mmap.mmap(-1, size)
    dst = np.frombuffer(mapping, dtype=np.uint8)
    dst[:] = 1
    src = np.ones(size, dtype=np.uint8)
    return mapping, src, dst


def _files_pass(move, src: int, dst: int, files: list[tuple[int, int]], layers: int, row: int, cells: int) -> float:
    """Copy as llama.cpp sets each file: per layer, the file's cells as one run."""
    started = time.perf_counter()
    offset = 0
    for first, n in files:
        for layer in range(layers):
            move(dst + layer * cells * row + first * row, src + offset, n * row)
            offset += n * row
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=92.0)
    parser.add_argument("--row", type=int, default=204, help="bytes per cell and layer run")
    parser.add_argument("--layers", type=int, default=60, help="runs per file (layers x K and V)")
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args(argv)
    cells = int(args.mb * 1e6) // (args.row * args.layers)
    size = cells * args.row * args.layers
    mapping, src_array, dst_array = _buffers(size + (4 << 20))
    move, src, dst = _memmove(), src_array.ctypes.data, dst_array.ctypes.data
    fifth, twelfth = cells // 5, cells // 12
    layouts = {"one file": [(0, cells)],
               "three files (1/5, 2/5, 2/5)": [(0, fifth), (fifth, 2 * fifth), (3 * fifth, cells - 3 * fifth)],
               "twelve files": [(i * twelfth, twelfth if i < 11 else cells - 11 * twelfth) for i in range(12)]}
    spent: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(args.repeats):   # interleaved: the machine's drift hits every layout alike
        for name, files in layouts.items():
            spent[name].append(_files_pass(move, src, dst, files, args.layers, args.row, cells))
    first = Table(f"{size / 1e6:.1f} MB as a restore copies it ({args.layers} runs per file, {args.row}-byte rows), "
                  f"medians of {args.repeats}", ["layout", "shortest_run_KB", "ms", "GB_s", "vs_one_file"])
    one = statistics.median(spent["one file"])
    for name, files in layouts.items():
        took = statistics.median(spent[name])
        first.add(layout=name, shortest_run_KB=round(min(n for _, n in files) * args.row / 1024),
                  ms=took * 1e3, GB_s=size / took / 1e9, vs_one_file=took / one)
    print(first.render())
    second = Table("the same bytes copied in pieces of one size", ["piece_KiB", "GB_s"])
    for piece_kib in (64, 256, 512, 768, 1000, 1024, 1536, 4096):
        piece = piece_kib << 10
        if piece > size:
            break
        times = []
        for _ in range(max(5, args.repeats // 3)):
            started = time.perf_counter()
            for at in range(0, size - piece + 1, piece):
                move(dst + at, src + at, piece)
            times.append(time.perf_counter() - started)
        second.add(piece_KiB=piece_kib, GB_s=(size // piece) * piece / statistics.median(times) / 1e9)
    print()
    print(second.render())
    del src_array, dst_array
    mapping.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
