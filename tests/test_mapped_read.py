"""The mapped state reader (engine.checkpoints.mapped): every check of the copying reader
holds for it too, and it fails as a read would, never with SIGBUS."""

from __future__ import annotations

import sys

import pytest
from faultkit import synthetic

from engine.checkpoints import format as fmt
from engine.checkpoints import mapped
from engine.errors import CheckpointError, ChecksumMismatch, TruncatedCheckpoint

pytestmark = pytest.mark.skipif(not mapped.supported() or sys.platform == "win32",
                                reason="no MADV_POPULATE_READ here")


@pytest.fixture
def always_mapped(monkeypatch):
    """Every state is mapped; returns the mappings made (empty: the mapped path was not taken)."""
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    made = []
    real = mapped.map_file
    monkeypatch.setattr(mapped, "map_file", lambda *a, **kw: _kept(made, real(*a, **kw)))
    return made


def _kept(made: list, mapping):
    if mapping is not None:
        made.append(mapping)
    return mapping


@pytest.fixture
def populated(monkeypatch) -> list:
    """The ranges mapped.populate is asked to map in."""
    calls = []
    real = mapped.populate
    monkeypatch.setattr(mapped, "populate", lambda *a: (calls.append(a[1:]), real(*a))[1])
    return calls


def _file(tmp_path, n_tokens: int = 300) -> tuple:
    data = synthetic.file_bytes(n_tokens)
    path = tmp_path / "m.kvckpt"
    path.write_bytes(data)
    return path, data, fmt.unpack_header(data[:fmt.HEADER_LEN])


def test_mapped_state_is_the_files_bytes_and_read_only(tmp_path, always_mapped):
    path, data, h = _file(tmp_path)
    got = fmt.read_checkpoint(path, progress=lambda done, total: None)
    assert always_mapped, "the mapped path was not taken"
    assert got.state.tobytes() == data[h.state_offset:h.state_offset + h.state_len]
    assert not got.state.flags.writeable
    synthetic.load_fully(path)   # the walk over the mapping


def _huge_page_flag_of(path) -> bool | None:
    """Whether this process maps ``path`` with MADV_HUGEPAGE ("hg" in /proc's VmFlags)."""
    from pathlib import Path
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            mapping = line.endswith(str(path))
        elif mapping and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return None


def test_the_mapping_asks_for_huge_pages(tmp_path, always_mapped):
    """A restore's mapping lets the kernel use 2 MiB pages for the file (mapped._ask_for_huge_pages)."""
    import mmap as mmap_module
    with mmap_module.mmap(-1, 1 << 21) as probe:   # can this kernel say so at all?
        try:
            probe.madvise(getattr(mmap_module, "MADV_HUGEPAGE", 14))
        except OSError:
            pytest.skip("no transparent huge pages here")
    path, _, _ = _file(tmp_path)
    got = fmt.read_checkpoint(path)
    assert always_mapped, "the mapped path was not taken"
    assert _huge_page_flag_of(path) is True
    del got


def test_copying_reader_gives_the_same_and_read_only(tmp_path, monkeypatch):
    path, data, h = _file(tmp_path)
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 1 << 62)
    got = fmt.read_checkpoint(path)
    assert got.state.tobytes() == data[h.state_offset:h.state_offset + h.state_len]
    assert not got.state.flags.writeable
    assert got.payload_crc == int.from_bytes(data[-fmt.TRAILER_LEN:-4], "little")
    first = fmt.HEADER_LEN + h.meta_len
    assert got.tokens.tobytes() == data[first:first + h.tokens_len]


@pytest.mark.parametrize("reader", ["mapped", "copied"])
@pytest.mark.parametrize("section", ["metadata", "tokens", "logits", "state", "trailer"])
@pytest.mark.parametrize("later", [False, True], ids=["now", "later"])
def test_every_reader_refuses_a_flip_in_every_section(tmp_path, monkeypatch, reader, section, later):
    """Either reader, its checksum computed at once or on a chain's helper thread
    (crc_later: engine.checkpoints.crc_helper)."""
    if reader == "mapped" and not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here")
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0 if reader == "mapped" else 1 << 62)
    path, data, h = _file(tmp_path)
    start = {"metadata": fmt.HEADER_LEN, "tokens": fmt.HEADER_LEN + h.meta_len,
             "logits": fmt.HEADER_LEN + h.meta_len + h.tokens_len, "state": h.state_offset,
             "trailer": h.file_len - fmt.TRAILER_LEN}[section]
    damaged = bytearray(data)
    damaged[start + 1] ^= 0x08
    path.write_bytes(bytes(damaged))
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)
    with pytest.raises(CheckpointError):
        fmt.read_checkpoint(path, crc_later=later).settle()
    path.write_bytes(data)
    intact = fmt.read_checkpoint(path, crc_later=later)
    intact.settle()
    assert intact.state.tobytes() == data[h.state_offset:h.state_offset + h.state_len]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_state_byte_is_refused_by_the_mapped_path(tmp_path, always_mapped, where):
    path, data, h = _file(tmp_path)
    at = {"first": h.state_offset, "middle": h.state_offset + h.state_len // 2,
          "last": h.state_offset + h.state_len - 1}[where]
    damaged = bytearray(data)
    damaged[at] ^= 0x10
    path.write_bytes(bytes(damaged))
    with pytest.raises(ChecksumMismatch):
        fmt.read_checkpoint(path)
    assert always_mapped


@pytest.mark.parametrize("cut", [1, fmt.TRAILER_LEN, 4096 + 3])
def test_a_truncated_file_is_refused_by_the_mapped_path(tmp_path, always_mapped, cut):
    path, data, _ = _file(tmp_path)
    path.write_bytes(data[:-cut])
    with pytest.raises(TruncatedCheckpoint):
        fmt.read_checkpoint(path)


def test_a_file_that_shrinks_under_the_mapping_is_a_refusal_not_sigbus(tmp_path):
    path, data, h = _file(tmp_path)
    import mmap
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), len(data), access=mmap.ACCESS_READ)
        with open(path, "r+b") as w:   # another program truncating the file in place
            w.truncate(mmap.PAGESIZE)
        with pytest.raises(TruncatedCheckpoint):
            mapped.populate(m, h.state_offset, h.state_len)
        m.close()


def _cached_now(path) -> bool:
    import os
    fd = os.open(path, os.O_RDONLY)
    try:
        return mapped.in_page_cache(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def test_a_cached_state_the_helper_checksums_is_not_populated(tmp_path, monkeypatch, always_mapped, populated):
    """No page of a cached state needs the disk, so none can fail to read: a state whose
    checksum the chain's helper thread computes is not populated first (its reading maps
    the pages, on the other core: mapped.in_page_cache).  One checksummed on the reading
    thread still is."""
    path, data, h = _file(tmp_path)
    if not _cached_now(path):
        pytest.skip("this kernel cannot say what the page cache holds (cachestat, Linux 6.5)")
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)
    got = fmt.read_checkpoint(path, crc_later=True)
    got.settle()
    assert always_mapped and not populated
    assert got.state.tobytes() == data[h.state_offset:h.state_offset + h.state_len]
    fmt.read_checkpoint(path)
    assert sum(n for _, n in populated) == h.state_len


def test_a_state_not_wholly_cached_is_populated_before_it_is_read(tmp_path, monkeypatch, always_mapped,
                                                                 populated):
    """A state the disk must be read for (a cold file) is populated first, as before, its
    checksum left to the helper or not: a read error is then an error of that call, never
    SIGBUS."""
    from benchmarks.page_cache import evict
    path, data, h = _file(tmp_path)
    if not evict(path):
        pytest.skip("the file system keeps its files in memory (tmpfs)")
    assert not _cached_now(path)
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)
    got = fmt.read_checkpoint(path, crc_later=True)
    got.settle()
    assert always_mapped
    assert sum(n for _, n in populated) == h.state_len, "not every page of the state was populated"
    assert got.state.tobytes() == data[h.state_offset:h.state_offset + h.state_len]


def test_the_part_of_a_file_that_shrank_is_not_in_the_page_cache(tmp_path):
    """A file truncated under the reader (after its size was read) is never taken as
    cached, so its state is populated, and refused (TruncatedCheckpoint) as before."""
    import os
    path, data, h = _file(tmp_path)
    fd = os.open(path, os.O_RDWR)
    try:
        if not mapped.in_page_cache(fd, h.state_offset, h.state_len):
            pytest.skip("this kernel cannot say what the page cache holds (cachestat, Linux 6.5)")
        os.truncate(fd, h.state_offset + h.state_len // 2)
        assert not mapped.in_page_cache(fd, h.state_offset, h.state_len)
        assert mapped.in_page_cache(fd, h.state_offset, h.state_len // 4)
    finally:
        os.close(fd)


def test_small_states_are_read_not_mapped(tmp_path, monkeypatch):
    path, _, _ = _file(tmp_path, 8)
    made: list = []
    real = mapped.map_file
    monkeypatch.setattr(mapped, "map_file", lambda *a, **kw: _kept(made, real(*a, **kw)))
    fmt.read_checkpoint(path)
    assert not made
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)   # the same file is mapped when allowed
    fmt.read_checkpoint(path)
    assert made
