"""Issue 4, cases 2, 3 and 9: truncated, bit-flipped, hostile and fuzzed checkpoint files.

Every damaged file must be refused with a CheckpointError subclass (a reason), nothing
else may escape (a crash), hostile lengths must be refused before anything large is
allocated, and with a real model no unvalidated byte may reach ``state_set_from``.
"""

from __future__ import annotations

import json
import random
import struct
import uuid

import numpy as np
import pytest
from faultkit import corrupt, synthetic
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.checkpoints import format as fmt
from engine.checkpoints.kvstate import check_state_for
from engine.errors import (
    CheckpointError,
    CorruptHeader,
    CorruptMetadata,
    CorruptState,
    NotACheckpoint,
    TruncatedCheckpoint,
    UnsupportedVersion,
)

BASE = synthetic.file_bytes(n_tokens=8)
BIG = synthetic.file_bytes(n_tokens=300, seq=3)


def fuzz(max_examples: int):
    """Hypothesis settings for the suite: bounded, reproducible, no example database."""
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck))


def test_intact_files_pass(tmp_path):
    """The baseline the damage tests start from is accepted (so a refusal means something)."""
    assert corrupt.verdict(BASE, tmp_path / "a.kvckpt") is None
    assert corrupt.verdict(BIG, tmp_path / "b.kvckpt") is None


@pytest.mark.parametrize("values, refused", [
    ([1.5, -np.inf, 0.0], False),       # a masked-out token (a grammar, a banned id)
    ([-np.inf, -np.inf, -np.inf], False),
    ([1.5, np.nan, 0.0], True), ([np.nan, -np.inf, 0.0], True),
    ([1.5, np.inf, 0.0], True), ([-np.inf, np.inf, np.nan], True)])
def test_stored_logits_with_nan_or_plus_infinity_are_refused(tmp_path, values, refused):
    """Logits a writer's bug or a crafted file made NaN or +inf would sample garbage (a NaN
    wins every comparison): refused with the reason, the CRC being right; -inf is a masked
    token and loads."""
    import io
    logits = np.zeros(synthetic.N_VOCAB, np.float32)
    logits[[3, 40, 77]] = values
    h = synthetic.header(uuid.UUID(int=7), 8, fmt.KIND_PAUSE)
    out = io.BytesIO()
    fmt.write_sections(out, h, fmt.encode_metadata({"title": "t"}), np.arange(8, dtype=np.int32),
                       logits, synthetic.state_blob(8, seed=1))
    path = tmp_path / "logits.kvckpt"
    path.write_bytes(out.getvalue())
    if refused:
        with pytest.raises(CorruptMetadata, match="NaN or infinite"):
            fmt.read_checkpoint(path)
    else:
        assert np.array_equal(fmt.read_checkpoint(path).logits, logits)


# -- case 2: truncation and bit flips ----------------------------------------------------------

def test_truncation_at_every_header_offset(tmp_path):
    for cut in range(fmt.HEADER_LEN + 1):
        err = corrupt.verdict(BASE[:cut], tmp_path / "t.kvckpt")
        assert isinstance(err, TruncatedCheckpoint), (cut, err)


def test_truncation_at_sampled_payload_offsets_and_extension(tmp_path):
    h = fmt.unpack_header(BIG[:fmt.HEADER_LEN])
    boundaries = [fmt.HEADER_LEN + h.meta_len, fmt.HEADER_LEN + h.meta_len + h.tokens_len,
                  h.state_offset, h.file_len - fmt.TRAILER_LEN]
    rng = random.Random(2)
    cuts = set(rng.sample(range(fmt.HEADER_LEN + 1, len(BIG)), 400))
    cuts |= {b + d for b in boundaries for d in (-1, 0, 1)} | set(range(len(BIG) - 16, len(BIG)))
    for cut in sorted(cuts):
        err = corrupt.verdict(BIG[:cut], tmp_path / "t.kvckpt")
        assert isinstance(err, TruncatedCheckpoint), (cut, err)
    for extra in (b"\0", b"garbage", BIG[-100:]):
        assert isinstance(corrupt.verdict(BIG + extra, tmp_path / "t.kvckpt"), TruncatedCheckpoint)


@fuzz(2000)
@given(flips=st.lists(st.integers(0, 8 * len(BASE) - 1), min_size=1, max_size=3, unique=True))
def test_any_one_to_three_bit_flips_are_refused(tmp_path_factory, flips):
    # CRC-32 detects every error of up to 3 bits in blocks this size, in the header and
    # in the payload alike, so no flip pattern here may slip through
    path = tmp_path_factory.getbasetemp() / "flip.kvckpt"
    err = corrupt.verdict(corrupt.flip(BASE, flips), path)
    assert isinstance(err, CheckpointError), flips


@fuzz(600)
@given(flips=st.lists(st.integers(0, 8 * len(BIG) - 1), min_size=1, max_size=64))
def test_bursts_of_flips_in_a_larger_file_are_refused(tmp_path_factory, flips):
    path = tmp_path_factory.getbasetemp() / "burst.kvckpt"
    damaged = corrupt.flip(BIG, flips)
    if damaged != BIG:   # pairs of flips on one bit cancel out
        assert isinstance(corrupt.verdict(damaged, path), CheckpointError), flips


def test_resealed_flips_in_the_state_structure_are_refused(tmp_path):
    """A file re-sealed after damage passes both CRCs; the state walk must still refuse
    any change to the state's structure."""
    h = fmt.unpack_header(BASE[:fmt.HEADER_LEN])
    offsets = corrupt.state_structure_offsets(h)
    assert len(offsets) > 100
    for off in offsets:
        for bit in (0, 3, 7):
            damaged = corrupt.with_payload_crc(corrupt.flip(BASE, [off * 8 + bit]))
            err = corrupt.verdict(damaged, tmp_path / "s.kvckpt")
            assert isinstance(err, CorruptState), (off - h.state_offset, bit, err)


# -- case 3: hostile headers -------------------------------------------------------------------

U32, U64 = 2**32 - 1, 2**64 - 1
HOSTILE = {
    "n_tokens 2^32-1": (dict(n_tokens=U32), CorruptHeader),
    "n_tokens_total 2^32-1 with its token length": (
        dict(n_tokens_total=U32, tokens_len=4 * U32), CorruptHeader),
    "n_ctx 2^32-1": (dict(n_ctx=U32, n_tokens=U32, n_tokens_total=U32), CorruptHeader),
    "meta_len 2^64-1": (dict(meta_len=U64), CorruptHeader),
    "state_len 2^63": (dict(state_len=2**63), CorruptHeader),
    "lengths that overflow 64 bits together": (
        dict(meta_len=2**24, state_len=U64 - 2**24 + 1000), CorruptHeader),
    "state length past the end": (dict(state_len=3 << 20), TruncatedCheckpoint),
    "metadata length past the end": (dict(meta_len=(16 << 20) - 1), TruncatedCheckpoint),
    "2 GB header length": (dict(header_len=2**31), CorruptHeader),
    "header length 0": (dict(header_len=0), CorruptHeader),
    "wrong magic": (dict(magic=b"\x89PNG\r\n\x1a\n"), NotACheckpoint),
    "future version": (dict(version=fmt.FORMAT_VERSION + 1), UnsupportedVersion),
    "version 0xffff": (dict(version=0xFFFF), UnsupportedVersion),
    "unknown flag": (dict(flags=0x80), CorruptHeader),
    "n_vocab 0": (dict(n_vocab=0), CorruptHeader),
    "n_layer 2^32-1": (dict(n_layer=U32), CorruptHeader),
    "n_head_kv 2^32-1": (dict(n_head_kv=U32), CorruptHeader),
    "kind 200": (dict(kind=200), CorruptHeader),
    "boolean 2": (dict(flash_attn=2), CorruptHeader),
    "title not UTF-8": (dict(title=b"\xff\xfe" + b"\0" * 62), CorruptHeader),
}


def _shifted(data: bytes, move: int) -> bytes:
    """Sections overlapping their neighbours: ``move`` bytes counted twice, sum unchanged."""
    f = corrupt.header_fields(data)
    return corrupt.with_header(data, meta_len=f["meta_len"] + move, state_len=f["state_len"] - move)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_header_refused_before_any_large_allocation(tmp_path, name):
    changes, expected = HOSTILE[name]
    path = tmp_path / "hostile.kvckpt"
    data = corrupt.with_header(BASE, **changes)
    path.write_bytes(data)
    with corrupt.peak_memory() as peak:
        with pytest.raises(expected) as info:
            synthetic.load_fully(path)
    assert str(info.value)
    assert peak[0] < 256 << 10, f"{peak[0]} bytes allocated to refuse {name}"


@pytest.mark.parametrize("move", [4, 12, -4, -40])
def test_overlapping_sections_refused(tmp_path, move):
    # the payload CRC still matches (same bytes, other boundaries): the structure checks
    # (JSON, then the state walk) are what refuse it
    err = corrupt.verdict(_shifted(BASE, move), tmp_path / "o.kvckpt")
    assert isinstance(err, (CorruptMetadata, CorruptState)), err


def _with_metadata(data: bytes, meta: bytes) -> bytes:
    f = corrupt.header_fields(data)
    rest = data[fmt.HEADER_LEN + f["meta_len"]:]
    resealed = corrupt.with_header(data[:fmt.HEADER_LEN], meta_len=len(meta)) + meta + rest
    return corrupt.with_payload_crc(resealed)


@pytest.mark.parametrize("name,meta,limit", [
    ("a million empty lists", b'{"a":[' + b"[]," * 1_000_000 + b"[]]}", 12 << 20),
    ("a million numbers", b'{"a":[' + b"1.5," * 1_000_000 + b"1]}", 12 << 20),
    ("nested 50,000 deep", b"[" * 50_000 + b"]" * 50_000, 1 << 20),
    ("nested 900 deep", b'{"a":' + b"[" * 900 + b"]" * 900 + b"}", 1 << 20),
    ("nested 40 deep", b'{"a":' + b"[" * 40 + b"]" * 40 + b"}", 1 << 20),
    ("an integer of 10,000 digits", b'{"a":' + b"7" * 10_000 + b"}", 1 << 20),
    ("not an object", b"[1,2,3]", 1 << 20),
    ("not UTF-8", b'{"a":"\xff"}', 1 << 20),
])
def test_hostile_metadata_refused_with_flat_memory(tmp_path, name, meta, limit):
    path = tmp_path / "m.kvckpt"
    path.write_bytes(_with_metadata(BASE, meta))
    with corrupt.peak_memory() as peak:
        with pytest.raises(CorruptMetadata):
            synthetic.load_fully(path)
    # a few copies of the metadata text at most; parsing a million lists would take ~60 MB
    assert peak[0] < limit, f"{peak[0]} bytes to refuse {name}"


def test_metadata_over_the_cap_refused_from_the_header_alone(tmp_path):
    path = tmp_path / "big.kvckpt"
    path.write_bytes(corrupt.with_header(BASE, meta_len=fmt.LIMITS.max_meta + 1))
    with corrupt.peak_memory() as peak:
        with pytest.raises(CorruptHeader, match="cap"):
            synthetic.load_fully(path)
    assert peak[0] < 64 << 10


def test_writer_refuses_metadata_a_reader_would_refuse():
    with pytest.raises(CorruptMetadata):
        fmt.encode_metadata({"many": [[] for _ in range(fmt.LIMITS.max_json_containers + 1)]})
    assert fmt.decode_metadata(fmt.encode_metadata({"text": "{[" * 100_000})) == {"text": "{[" * 100_000}


def test_metadata_depth_is_counted_on_the_bytes_alike_for_reader_and_writer():
    ok = {"a": [[[{"b": "]]]}}"}]]]}   # brackets inside strings do not count
    assert fmt.decode_metadata(fmt.encode_metadata(ok)) == ok
    deepest = fmt.LIMITS.max_json_depth
    for depth in (deepest - 1, deepest):   # the object itself is one level
        text = b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
        assert fmt.decode_metadata(text) == json.loads(text)
    too_deep = b'{"a":' + b"[" * deepest + b"]" * deepest + b"}"
    with pytest.raises(CorruptMetadata, match="nested too deeply"):
        fmt.decode_metadata(too_deep)
    with pytest.raises(CorruptMetadata, match="nested too deeply"):   # never written either
        fmt.encode_metadata(json.loads(too_deep))
    with pytest.raises(CorruptMetadata, match="pair up"):
        fmt.decode_metadata(b'{"a":[1]]]]]}')
    # the same beside a few shallow lists (too many brackets to skip the count) and among
    # thousands (counted another way); at the limit and one past it
    for depth, fits in ((deepest, True), (deepest + 1, False)):
        text = b'{"a":[' + b"[]," * 10 + b"[" * (depth - 2) + b"]" * (depth - 2) + b"]}"
        if fits:
            assert fmt.decode_metadata(text) == json.loads(text)
        else:
            with pytest.raises(CorruptMetadata, match="nested too deeply"):
                fmt.decode_metadata(text)
    many = b"[]," * 3000
    for depth, fits in ((deepest, True), (deepest + 1, False)):
        text = b'{"a":[' + many + b"[" * (depth - 2) + b"]" * (depth - 2) + b"]}"
        if fits:
            assert fmt.decode_metadata(text) == json.loads(text)
        else:
            with pytest.raises(CorruptMetadata, match="nested too deeply"):
                fmt.decode_metadata(text)


def test_truncated_magic_and_foreign_files(tmp_path):
    assert isinstance(corrupt.verdict(fmt.MAGIC[:5], tmp_path / "a"), TruncatedCheckpoint)
    assert isinstance(corrupt.verdict(b"GGUF" + bytes(300), tmp_path / "a"), NotACheckpoint)
    assert isinstance(corrupt.verdict(b"", tmp_path / "a"), TruncatedCheckpoint)


# -- case 9: property-based fuzzing of the parser -----------------------------------------------

def _field_value(name: str):
    code = corrupt.FIELD_CODES[name]
    if code == "s":
        size = len(corrupt.header_fields(BASE)[name])
        return st.binary(min_size=size, max_size=size)
    bits = {"B": 8, "H": 16, "I": 32, "i": 32, "Q": 64, "q": 64}[code]
    if code in "iq":
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    edges = [0, 1, 2**bits - 1, 2 ** (bits - 1)]
    return st.one_of(st.sampled_from(edges), st.integers(0, 2**bits - 1))


FUZZABLE = [n for n in corrupt.FIELDS if n != "crc"]


@fuzz(1000)
@given(data=st.data())
def test_fuzzed_resealed_headers_never_crash(tmp_path_factory, data):
    names = data.draw(st.lists(st.sampled_from(FUZZABLE), min_size=1, max_size=4, unique=True))
    changes = {n: data.draw(_field_value(n), label=n) for n in names}
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(BASE))))
    damaged = corrupt.with_header(BASE, **changes)[:cut]
    corrupt.verdict(damaged, tmp_path_factory.getbasetemp() / "fuzz.kvckpt")   # must not raise


@fuzz(800)
@given(blob=st.binary(max_size=600), prefix=st.booleans())
def test_fuzzed_random_bytes_never_crash(tmp_path_factory, blob, prefix):
    data = (fmt.MAGIC + struct.pack("<HH", 1, 0) + blob) if prefix else blob
    err = corrupt.verdict(data, tmp_path_factory.getbasetemp() / "rand.kvckpt")
    assert isinstance(err, CheckpointError)


@fuzz(1500)
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 10_000)))
def test_fuzzed_state_blobs_never_crash_the_walker(edits, cut):
    h = fmt.unpack_header(BASE[:fmt.HEADER_LEN])
    blob = bytearray(BASE[h.state_offset:h.state_offset + h.state_len])
    for pos, value in edits:
        blob[pos % len(blob)] = value
    try:
        layout = check_state_for(h, bytes(blob[:cut]))
    except CorruptState:
        return
    assert layout.blocks[0][0] == h.n_tokens


def test_reseal_fuzzing_also_accepts_harmless_changes(tmp_path):
    """The fuzz property is not vacuous: a resealed change to a free-text field passes."""
    assert corrupt.verdict(corrupt.with_header(BASE, title=b"x" * 64), tmp_path / "x") is None


# -- case 2 with a real model: nothing unvalidated reaches llama.cpp ---------------------------

@pytest.fixture(scope="module")
def smol_bytes(smollm_runtime, tmp_path_factory):
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    conv = Conversation()
    conv.sampler = conv.sampler.__class__(seed=11)
    begin_answer(conv, smollm_runtime, "Count to five.", n_predict=8)
    generate(smollm_runtime, conv, stop_after=2)
    path = tmp_path_factory.mktemp("smol") / "smol.kvckpt"
    smollm_runtime.save(path, conv)
    return path.read_bytes()


@pytest.mark.slow
def test_damaged_real_checkpoints_never_reach_llama(tmp_path, smollm_runtime, smol_bytes, monkeypatch):
    calls = []
    real_set = smollm_runtime.ctx.state_set_from

    def recording_set(buffer, size, seq=0):
        calls.append(size)
        return real_set(buffer, size, seq)

    monkeypatch.setattr(smollm_runtime.ctx, "state_set_from", recording_set)
    h = fmt.unpack_header(smol_bytes[:fmt.HEADER_LEN])
    rng = random.Random(5)
    damaged = [smol_bytes[:cut] for cut in range(fmt.HEADER_LEN + 1)]
    damaged += [smol_bytes[:cut] for cut in rng.sample(range(fmt.HEADER_LEN, len(smol_bytes)), 60)]
    damaged += [corrupt.flip(smol_bytes, rng.sample(range(8 * len(smol_bytes)), rng.randint(1, 3)))
                for _ in range(300)]
    damaged += [corrupt.with_payload_crc(corrupt.flip(smol_bytes, [off * 8 + rng.randrange(8)]))
                for off in rng.sample(corrupt.state_structure_offsets(h), 200)]
    path = tmp_path / "bad.kvckpt"
    for i, data in enumerate(damaged):
        path.write_bytes(data)
        try:
            checked = fmt.read_checkpoint(path)
            smollm_runtime.restore(checked)
        except CheckpointError:
            continue
        pytest.fail(f"damaged file {i} was restored")
    assert calls == [], "an unvalidated state reached llama_state_seq_set_data"
    # the control: the intact file does reach llama.cpp, through the same recorder (from an
    # empty cache: one that holds the file's tokens already restores nothing)
    assert smollm_runtime.trim(0) == 0
    path.write_bytes(smol_bytes)
    conv = smollm_runtime.restore(fmt.read_checkpoint(path))
    assert calls == [h.state_len] and smollm_runtime.kv_tokens == conv.tokens[:h.n_tokens]


@pytest.mark.slow
@pytest.mark.parametrize("conversation", [{"created": "yesterday"}, {"messages": 5},
                                          {"answer": {"n_generated": [1]}}])
def test_resealed_odd_conversation_metadata_is_a_refusal(tmp_path, smollm_runtime, smol_bytes,
                                                         conversation):
    f = corrupt.header_fields(smol_bytes)
    meta = json.loads(smol_bytes[fmt.HEADER_LEN:fmt.HEADER_LEN + f["meta_len"]])
    meta["conversation"].update(conversation)
    new_meta = fmt.encode_metadata(meta)
    rest = smol_bytes[fmt.HEADER_LEN + f["meta_len"]:]
    data = corrupt.with_payload_crc(
        corrupt.with_header(smol_bytes[:fmt.HEADER_LEN], meta_len=len(new_meta)) + new_meta + rest)
    path = tmp_path / "odd.kvckpt"
    path.write_bytes(data)
    checked = fmt.read_checkpoint(path)      # intact as a file
    kv_before = list(smollm_runtime.kv_tokens)
    with pytest.raises(CheckpointError, match="malformed"):
        smollm_runtime.restore(checked)
    assert smollm_runtime.kv_tokens == kv_before
