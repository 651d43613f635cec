import struct

import numpy as np
import pytest

from services.common.profile import MAGIC, Profile, ProfileError, fingerprint_key

FP = "0123456789abcdef0123"  # longer than 16 chars: the profile keeps the first 16


def sample_counts():
    counts = np.zeros((3, 4), dtype=np.int64)  # [L, E]
    counts[2, 1] = 50
    counts[0, 3] = 20
    counts[1, 0] = 20  # ties with (0, 3): layer order puts (0, 3) first
    counts[1, 2] = 5
    return counts


def test_from_counts_ranks_by_count_then_layer_order():
    profile = Profile.from_counts(sample_counts(), FP, built_for_slots=3)
    assert profile.ranked[:4] == ((2, 1, 50), (0, 3, 20), (1, 0, 20), (1, 2, 5))
    # Zero counts follow in layer order, so every pair is ranked.
    assert [p[:2] for p in profile.ranked[4:]] == [
        (0, 0), (0, 1), (0, 2), (1, 1), (1, 3), (2, 0), (2, 2), (2, 3)]
    assert profile.top_pairs(2) == [(2, 1), (0, 3)]
    assert profile.fingerprint == fingerprint_key(FP) == FP[:16]
    np.testing.assert_array_equal(profile.counts(), sample_counts())


def test_round_trip(tmp_path):
    path = tmp_path / "expert-profile.bin"
    profile = Profile.from_counts(sample_counts(), FP, built_for_slots=7)
    profile.write(path)
    assert path.stat().st_size == 48 + 12 * 12
    assert Profile.read(path) == profile
    assert list(tmp_path.iterdir()) == [path]  # the temporary file was renamed away


def test_layout_is_little_endian_and_documented(tmp_path):
    path = tmp_path / "p.bin"
    Profile.from_counts(sample_counts(), "abc", built_for_slots=9).write(path)
    data = path.read_bytes()
    assert data[:8] == MAGIC
    assert struct.unpack_from("<I", data, 8) == (1,)
    assert data[12:28] == b"abc" + b"\0" * 13
    assert struct.unpack_from("<IIIQ", data, 28) == (3, 4, 12, 9)
    assert struct.unpack_from("<HHQ", data, 48) == (2, 1, 50)


@pytest.mark.parametrize("mangle, message", [
    (lambda d: b"NOTAPROF" + d[8:], "not an expert profile"),
    (lambda d: d[:8] + struct.pack("<I", 3) + d[12:], "version 3"),
    (lambda d: d[:8] + struct.pack("<I", 2) + d[12:], "truncated or corrupt"),  # v1 records
    (lambda d: d[:30], "truncated header"),
    (lambda d: d[:-5], "truncated or corrupt"),
    (lambda d: d[:48] + struct.pack("<HHQ", 9, 0, 99) + d[60:], "outside"),
    (lambda d: d[:48] + d[60:72] + d[60:], "listed twice"),
    (lambda d: d[:48] + d[60:72] + d[48:60] + d[72:], "not ranked"),
])
def test_corrupt_files_raise_profile_error(tmp_path, mangle, message):
    path = tmp_path / "p.bin"
    Profile.from_counts(sample_counts(), FP).write(path)
    path.write_bytes(mangle(path.read_bytes()))
    with pytest.raises(ProfileError, match=message):
        Profile.read(path)


def test_decode_counts_round_trip_as_version_2(tmp_path):
    decode = sample_counts() // 2  # [L, E] the decode share of every pair's routed tokens
    profile = Profile.from_counts(sample_counts(), FP, built_for_slots=3, decode_counts=decode)
    assert profile.ranked[:2] == ((2, 1, 50), (0, 3, 20))  # ranked by all routed tokens
    assert profile.decode_counts[:2] == (25, 10)
    np.testing.assert_array_equal(profile.decode_table(), decode)
    path = tmp_path / "p.bin"
    profile.write(path)
    data = path.read_bytes()
    assert struct.unpack_from("<I", data, 8) == (2,)
    assert len(data) == 48 + 20 * 12
    assert struct.unpack_from("<HHQQ", data, 48) == (2, 1, 50, 25)
    assert Profile.read(path) == profile


def test_profile_without_decode_counts_stays_version_1(tmp_path):
    profile = Profile.from_counts(sample_counts(), FP)
    assert profile.decode_counts is None and profile.decode_table() is None
    profile.write(tmp_path / "p.bin")
    assert struct.unpack_from("<I", (tmp_path / "p.bin").read_bytes(), 8) == (1,)


def test_missing_file_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.read(tmp_path / "absent.bin")


def test_validate_rejects_another_model():
    profile = Profile.from_counts(sample_counts(), FP)
    profile.validate(FP, 3, 4)
    profile.validate(FP[:16] + "ignored-tail", 3, 4)
    with pytest.raises(ProfileError, match="another model.*fingerprint"):
        profile.validate("ffffffffffffffff", 3, 4)
    with pytest.raises(ProfileError, match="shape 3x4 != 3x8"):
        profile.validate(FP, 3, 8)


def test_order_appends_unlisted_pairs_in_layer_order():
    profile = Profile("fp", 2, 2, ((1, 1, 9), (0, 1, 3)))
    assert profile.order().tolist() == [3, 1, 0, 2]
