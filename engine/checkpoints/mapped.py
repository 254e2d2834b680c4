"""A checkpoint's state section, mapped from the file instead of copied (Linux, Windows).

A restore checks the state's structure before llama.cpp sees a byte and its CRC32 while
llama.cpp copies it (engine.restore), so the state has to lie in memory whole before
``llama_state_seq_set_data`` copies it into the KV cache.  Read into fresh memory, that
costs a page fault and a copy per 4 KiB: measured here (SmolLM2, 92 MB state, files in
the page cache) about 16 ms, as long as llama-server's whole slot restore of the same
tokens, which streams its file through one small reused buffer and checks nothing.
Mapped, the page cache's own pages are used: about 7 ms to map them, no copy
(benchmarks/restore_profile.py).

Why the mapping is safe to check and to hand to llama.cpp:

* ``MADV_POPULATE_READ`` (Linux 5.14) maps every page of the range before any byte of
  it is read.  A file that shrank meanwhile, or a disk that fails, is an error of that
  call (``EFAULT``, ``EIO``), never the ``SIGBUS`` a plain access to a missing page
  raises: the reader refuses the file as it would refuse a short read.
* The mapping is read-only.  Checkpoint Chat never writes a checkpoint in place (every
  write lands by ``os.replace``, a new inode): the mapped bytes are the bytes the CRC and
  the walk checked, whatever replaces or deletes the file meanwhile.  One read maps
  privately (copy-on-write, ``map_file``'s ``private``), which writes nothing to the file
  either: a restore's of an earlier file of a hybrid's chain, whose recurrent block it
  leaves unread.  It writes a few hundred bytes over that block's start, so that llama.cpp
  sets the attention part straight from the mapping, and puts them back at once
  (engine.checkpoints.format, ``CheckpointData.state_with_tail``); the page or two written
  become the process's own copies, dropped with the mapping (the arrays over it stay
  read-only).  A private mapping is charged against the commit limit for its whole size
  while it lasts (Windows; Linux under strict overcommit): ~50 MB per earlier file at
  Qwen3.5-4B's widths, for the restore's few milliseconds; where the charge cannot be had,
  the mapping fails and the file is read instead.  Only another
  program truncating the file in place during the restore could still raise ``SIGBUS``
  (as it could under llama.cpp's own mapping of the model).
* A state whose checksum a helper thread computes (read_checkpoint's ``crc_later``) is
  not populated where it lies wholly in the page cache (:func:`in_page_cache`, Linux 6.5's
  ``cachestat``): no page of it needs the disk, so no read error can strike while it is
  read, and the helper's reading maps its pages on the other core while the restoring
  thread goes on.  Measured here (SmolLM2, 2,000 tokens, a new process each time, medians
  of 15): a restore from one 24.5 MB file took 4.95 ms populated and 4.62 ms not; from two
  files (18.4 + 6.1 MB) 5.77 and 4.91 ms.  A state checksummed on the restoring thread is
  still populated: faulting its pages in there as the checksum reads them cost more (12
  files of 2 MB: 10.3 ms populated, 11.8 ms not).  A state not wholly cached (a cold file,
  a file that shrank) is populated as before: the disk is read then anyway.
* The bytes a restore leaves unread (engine.checkpoints.format: the points' recurrent
  states, an earlier file's own recurrent block) are read only where they are used (and a
  block's row headers by the walk), as the helper reads a state: not populated where they
  lie wholly in the page cache, populated at the read otherwise
  (:func:`ready_to_read_later`; on Windows never: see below).
* Where any of this is missing (macOS; kernels before 5.14; a file system that cannot
  map), :func:`map_file` returns None and the reader reads the state into memory.

Windows maps too, for a restore's read alone (measured on Linux, the copying read cost a
restore 1.97x llama-server's from one 24.7 MB file: the fresh pages it fills):

* A mapped file can be neither replaced nor deleted there (the store's saves, pruning and
  compaction would fail on it), so a file is mapped only where the reader's caller lets it
  go as soon as the states are used (``releasable``: a restore's read; whoever restores
  calls engine.checkpoints.chain.release).  Every other read copies.
* Only a file on a fixed local disk is mapped (:func:`on_a_fixed_disk`): a network share
  or a removable drive is read.
* Windows has no MADV_POPULATE_READ.  It needs none against a file that shrinks: a file
  with a mapped view cannot be truncated (SetEndOfFile fails with ERROR_USER_MAPPED_FILE),
  and a file shorter than the header says cannot be mapped (the read then copies and
  fails as any short read).  What is left is a local disk failing under a page that is not
  in memory: that faults whoever reads it (the process ends; the copying read reported an
  error), as it does under llama.cpp's own mapping of the model (the app loads every model
  mapped).  ``populate`` asks PrefetchVirtualMemory to read such pages in large reads
  before the checksum and llama.cpp fault them in one by one (a hint: nothing fails if it
  does not).  Bytes a restore leaves unread are not prefetched (but for the page or two it
  writes over, above): Windows cannot say what the cache holds, and a prefetch of a cold
  file would read from the disk what is most likely never used (50 MB of recurrent state
  per earlier file at Qwen3.5-4B's widths).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys

from engine.errors import TruncatedCheckpoint

#: Linux's MADV_POPULATE_READ (Python names it from 3.13 only)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)

#: states smaller than this are read, not mapped: glibc's malloc serves a buffer below its
#: mmap threshold (128 KiB) from memory the process has used before, and then the mapping's
#: system calls cost more than the copy; a larger buffer is fresh pages, each faulted in as
#: the read fills it, and mapping the page cache's own pages costs less.  Measured here
#: (read_checkpoint in new processes, 12 files each, medians of 15): a file whose state is
#: 74 KB 129 us read, 187 us mapped; 147 KB 290 / 196 us; 295 KB 422 / 247 us.  A
#: hybrid's conversation of 12 turn files on a shared prefix (0.6 MB states) restored in
#: 9.8 ms instead of 12.2 with the 1 MiB this was before.
MAP_MIN_BYTES = 128 << 10


#: a mapped file can be neither replaced nor deleted while the mapping lasts (Windows): only a
#: read whose caller releases it maps (see the module docstring).  Tests set it on Linux.
PINS_FILES = sys.platform == "win32"

#: populating a range only prefetches it, and no read of a mapped page can raise SIGBUS
#: for a file that shrank (Windows: see the module docstring).  Tests set it on Linux.
PREFETCH_ONLY = sys.platform == "win32"


@functools.cache
def supported() -> bool:
    """Whether this system maps states: Windows (see the module docstring), Linux with
    MADV_POPULATE_READ (asked once, on one page)."""
    if sys.platform == "win32":
        return True
    if not sys.platform.startswith("linux") or not hasattr(mmap.mmap, "madvise"):
        return False
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as probe:
            probe.madvise(MADV_POPULATE_READ, 0, mmap.PAGESIZE)
    except (OSError, ValueError):
        return False
    return True


def map_file(fileno: int, size: int, state_len: int, releasable: bool, path: str | os.PathLike,
             private: bool = False) -> mmap.mmap | None:
    """A read-only mapping of a whole file of ``size`` bytes at ``path`` (already checked
    against its header), or None where the state is better read: too small, no support, a
    mapping would keep the file from being replaced (:data:`PINS_FILES`) and the caller does
    not release it when done (``releasable``), or the file is not on a fixed local disk
    (Windows: :func:`on_a_fixed_disk`).  ``private``: a copy-on-write mapping instead, for a
    reader that writes into its own copy of a page (see the module docstring)."""
    if state_len < MAP_MIN_BYTES or not supported() or (PINS_FILES and not releasable) \
            or not on_a_fixed_disk(path):
        return None
    try:
        mapping = mmap.mmap(fileno, size, access=mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
    except (OSError, ValueError):   # a file system that cannot map (or no commit left for a private one): read
        return None
    _ask_for_huge_pages(mapping, size)
    return mapping


def on_a_fixed_disk(path: str | os.PathLike) -> bool:
    """Windows: whether ``path`` lies on a fixed local drive (GetDriveTypeW: DRIVE_FIXED).
    A network share or a removable drive can fail under a mapping (unplugged, disconnected),
    and there a page that cannot be read faults whoever reads it, where a copying read
    reports an error: such files are read.  True elsewhere (Linux's populate reports it)."""
    if sys.platform != "win32":
        return True
    drive = os.path.splitdrive(os.path.abspath(path))[0]
    return bool(drive) and _drive_type(drive.rstrip("\\/") + "\\") == DRIVE_FIXED


#: GetDriveTypeW's answer for a hard disk or SSD (not removable, remote, CD-ROM or RAM disk)
DRIVE_FIXED = 3


@functools.lru_cache(maxsize=64)
def _drive_type(root: str) -> int:
    if sys.platform != "win32":
        return 0
    kernel32 = ctypes.WinDLL("kernel32")
    kernel32.GetDriveTypeW.argtypes = [ctypes.c_wchar_p]
    kernel32.GetDriveTypeW.restype = ctypes.c_uint
    return int(kernel32.GetDriveTypeW(root))


#: Linux's MADV_HUGEPAGE (Python names it where the system headers do)
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def _ask_for_huge_pages(mapping: mmap.mmap, size: int) -> None:
    """Let the kernel read the file into 2 MiB pages where it reads it from disk, and map
    cached 2 MiB pages whole (a file system with large folios: ext4 from Linux 6.16, xfs).

    Measured here (benchmarks.page_cache, a 24 MB state, evicted before each try): mapping,
    populating and copying it out 17.1 ms with, 22.0 ms without; mapping and copying it
    again once cached, 2.45 against 3.72 ms.  At 92 MB the cold read gained nothing (61.2
    against 58.6 ms: its readahead made part of it large anyway).  The pages are the page
    cache's either way; a kernel without transparent huge pages refuses the call, and
    nothing changes.
    """
    try:
        mapping.madvise(MADV_HUGEPAGE, 0, size)
    except (OSError, ValueError, AttributeError):   # (AttributeError: Windows has no madvise)
        pass


def prepare() -> None:
    """Ask now what every read would otherwise ask the first time (mapping support, the
    cachestat call): ~0.2 ms of a first restore here, spent while a model loads instead."""
    supported()
    _syscall()
    _prefetch_call()


class _Range(ctypes.Structure):      # struct cachestat_range
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):  # struct cachestat
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


#: cachestat's number: system calls added since Linux 5.1 have one number on every
#: architecture but alpha and mips (offset there), so it is asked only on these
SYS_CACHESTAT = 451
CACHESTAT_MACHINES = ("x86_64", "amd64", "aarch64", "arm64", "riscv64", "ppc64le", "s390x")


@functools.cache
def _syscall():
    """libc's ``syscall``, where cachestat can be asked through it (64-bit Linux on one of
    :data:`CACHESTAT_MACHINES`), else None."""
    import platform
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8 \
            or platform.machine().lower() not in CACHESTAT_MACHINES:
        return None
    call = ctypes.CDLL(None, use_errno=True).syscall
    call.restype = ctypes.c_long
    return call


def in_page_cache(fileno: int, start: int, length: int) -> bool:
    """Whether every page of bytes ``[start, start + length)`` of the open file is in the
    page cache now (cachestat, Linux 6.5); False where that cannot be asked.

    Asked in ~10 µs for a file cached in large folios, ~0.3 ms for 92 MB in small ones:
    less than populating them (see the module docstring)."""
    call = _syscall()
    if length <= 0 or call is None:
        return False
    first, last = start // mmap.PAGESIZE, (start + length - 1) // mmap.PAGESIZE
    span, stat = _Range(first * mmap.PAGESIZE, (last - first + 1) * mmap.PAGESIZE), _CacheStat()
    # syscall() reads longs: every argument passed as one, no upper half left undefined;
    # a kernel before 6.5 answers ENOSYS (-1)
    failed = call(ctypes.c_long(SYS_CACHESTAT), ctypes.c_long(fileno), ctypes.byref(span),
                  ctypes.byref(stat), ctypes.c_long(0))
    return failed == 0 and stat.nr_cache >= last - first + 1


def ready_to_read_later(mapping: mmap.mmap, fileno: int, start: int, length: int) -> None:
    """Make bytes ``[start, start + length)`` of a mapped file, which its reader leaves
    unread for now, safe to read through the mapping later: on Linux, where a page of them
    needs the disk, they are mapped in now (:func:`populate`: a read error is the reader's,
    not a SIGBUS); on Windows nothing (see the module docstring)."""
    if length > 0 and not PREFETCH_ONLY and not in_page_cache(fileno, start, length):
        populate(mapping, start, length)


def populate(mapping: mmap.mmap, start: int, length: int) -> None:
    """Map the pages of ``[start, start + length)`` so that reading them cannot fault.

    A file that no longer reaches that far is a TruncatedCheckpoint; a read error is
    the OSError a read would have raised.
    """
    if length <= 0:
        return
    if sys.platform == "win32":
        _prefetch(mapping, start, length)
        return
    first = start - start % mmap.PAGESIZE
    try:
        mapping.madvise(MADV_POPULATE_READ, first, start + length - first)
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise TruncatedCheckpoint("the file ends inside its KV state (it shrank while it was "
                                      "being read)") from None
        raise



class _MemoryRange(ctypes.Structure):   # WIN32_MEMORY_RANGE_ENTRY
    _fields_ = [("address", ctypes.c_void_p), ("size", ctypes.c_size_t)]


@functools.cache
def _prefetch_call():
    """kernel32's PrefetchVirtualMemory (Windows 8) and GetCurrentProcess, or None."""
    if sys.platform != "win32":
        return None
    from ctypes import wintypes
    kernel32 = ctypes.WinDLL("kernel32")
    call = getattr(kernel32, "PrefetchVirtualMemory", None)
    if call is None:
        return None
    call.argtypes = [wintypes.HANDLE, ctypes.c_size_t, ctypes.POINTER(_MemoryRange), wintypes.ULONG]
    call.restype = wintypes.BOOL
    kernel32.GetCurrentProcess.restype = wintypes.HANDLE
    return call, kernel32.GetCurrentProcess


def _prefetch(mapping: mmap.mmap, start: int, length: int) -> None:
    """Ask Windows to read ``[start, start + length)`` of a mapping into memory in large
    reads (a hint, see the module docstring); nothing where it cannot be asked."""
    found = _prefetch_call()
    if found is None:
        return
    call, current_process = found
    import numpy as np
    at = np.frombuffer(mapping, dtype=np.uint8, count=length, offset=start)
    span = _MemoryRange(at.ctypes.data, length)
    call(current_process(), 1, ctypes.byref(span), 0)
    del at
