"""The checkpoint format's CRC32 (zlib's polynomial and values), as fast as it can be had.

python-isal computes exactly zlib's CRC32 with ISA-L's carry-less-multiply folding:
measured here 36.7 GB/s against zlib's 4.3 GB/s (a 25 MB state: 0.68 ms instead of
5.84 ms), which is most of what a save adds to writing its bytes, and of what a restore
adds to reading them.  Where no isal wheel exists for a platform, zlib's is used; files
are the same either way.
"""

from __future__ import annotations

from collections.abc import Callable

#: crc32(data, value=0) -> int, zlib-compatible (chain it over consecutive buffers).
#: FAST: True when the fast implementation is in use (a save then checksums inline: a
#: helper thread costs more than the checksum itself)
try:
    from isal.isal_zlib import crc32
    FAST = True
except ImportError:   # pragma: no cover - every platform we ship has a wheel
    from zlib import crc32
    FAST = False

#: combine(crc_a, crc_b, len_b) -> the CRC32 of a's bytes followed by b's, from their CRCs
#: alone (zlib's crc32_combine: python-isal has it, the standard zlib module does
#: not): a reader checks a file's payload CRC without reading a part whose own CRC it holds
#: (engine.checkpoints.format: a point's recurrent state).  None where it is missing: every
#: byte is read then.
combine: Callable[[int, int, int], int] | None
try:
    from isal.isal_zlib import crc32_combine as combine
except ImportError:   # pragma: no cover
    combine = None

__all__ = ["FAST", "combine", "crc32"]
