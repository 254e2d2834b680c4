"""Crafted Windows PE files for tests that run the Windows paths on Linux.

:func:`pe_image` writes a minimal but well-formed PE32+ file: DOS header, PE
signature, COFF header, optional header with 16 data directories, one section that
holds the import descriptors, the delay-import descriptors and the DLL names.  That is
everything :func:`native.libfile.pe_imports` reads, laid out as a linker would.
"""

from __future__ import annotations

import struct

SECTION_RVA = 0x1000
SECTION_FILE_OFFSET = 0x200
_OPT_SIZE = 112 + 16 * 8          # PE32+ optional header with 16 data directories


def pe_header(machine: int = 0x8664) -> bytes:
    """Just enough of a PE file for the bitness check (no import table)."""
    dos = bytearray(0x40)
    dos[:2] = b"MZ"
    struct.pack_into("<I", dos, 0x3C, 0x40)
    return bytes(dos) + b"PE\0\0" + struct.pack("<H", machine) + bytes(64)


def pe_image(imports: list[str] = (), delay_imports: list[str] = (), *,
             machine: int = 0x8664, tail: bytes = b"") -> bytes:
    """A PE32+ DLL importing ``imports`` (and delay-loading ``delay_imports``)."""
    n, m = len(imports), len(delay_imports)
    import_at = 0
    delay_at = import_at + 20 * (n + 1)
    names_at = delay_at + 32 * (m + 1)
    body = bytearray(names_at)
    name_rvas = []
    for name in list(imports) + list(delay_imports):
        name_rvas.append(SECTION_RVA + len(body))
        body += name.encode("ascii") + b"\0"
    for i in range(n):    # OriginalFirstThunk, TimeDateStamp, ForwarderChain, Name, FirstThunk
        struct.pack_into("<IIIII", body, import_at + 20 * i, 0, 0, 0, name_rvas[i], 0)
    for j in range(m):    # Attributes (1: RVA-based), DllNameRVA, then six RVAs we leave at 0
        struct.pack_into("<II", body, delay_at + 32 * j, 1, name_rvas[n + j])
    body += bytes(-len(body) % 0x200)

    dos = bytearray(0x40)
    dos[:2] = b"MZ"
    struct.pack_into("<I", dos, 0x3C, 0x40)
    coff = struct.pack("<HHIIIHH", machine, 1, 0, 0, 0, _OPT_SIZE, 0x2022)
    opt = bytearray(_OPT_SIZE)
    struct.pack_into("<H", opt, 0, 0x20B)
    struct.pack_into("<I", opt, 108, 16)
    if n:
        struct.pack_into("<II", opt, 112 + 8 * 1, SECTION_RVA + import_at, 20 * (n + 1))
    if m:
        struct.pack_into("<II", opt, 112 + 8 * 13, SECTION_RVA + delay_at, 32 * (m + 1))
    section = bytearray(40)
    section[:8] = b".idata\0\0"
    struct.pack_into("<IIII", section, 8, len(body), SECTION_RVA, len(body), SECTION_FILE_OFFSET)
    head = bytes(dos) + b"PE\0\0" + coff + bytes(opt) + bytes(section)
    assert len(head) <= SECTION_FILE_OFFSET
    return head + bytes(SECTION_FILE_OFFSET - len(head)) + bytes(body) + tail
