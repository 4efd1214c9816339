"""The block codec: exact round trip, and every kind of damage is a `CodecError` (a miss)."""

import struct

import pytest

from deepinfer.kvstore.codec import MAGIC, VERSION, BlockHeader, CodecError, decode_block, encode_block

HEADER = BlockHeader(layout="paged_kv:block_dim=1", dtype="float32", shape=(2, 2, 4, 2, 6))
PAYLOAD = bytes(range(256)) * 3  # 768 bytes = 2*2*4*2*6 float32 values
KEY = "f00d:00000000000000aa"   # fingerprint:block hash, as engine/kv_transfer.py keys


def test_round_trip_is_exact():
    value = encode_block(HEADER, PAYLOAD, key=KEY)
    header, payload = decode_block(value, key=KEY)
    assert header == HEADER
    assert bytes(payload) == PAYLOAD
    assert value[:4] == MAGIC and struct.unpack_from("<H", value, 4)[0] == VERSION


def test_round_trip_bfloat16_and_memoryview_input():
    header = BlockHeader("mla:block_dim=0", "bfloat16", (3, 8, 4))
    payload = memoryview(bytes(range(192)))
    value = encode_block(header, payload, key=KEY)
    assert decode_block(value, key=KEY)[1].tobytes() == bytes(range(192))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_meta", "truncate", "extend",
                                    "magic", "version", "empty", "short_header"])
def test_damage_is_a_codec_error(damage):
    value = bytearray(encode_block(HEADER, PAYLOAD, key=KEY))
    if damage == "flip_payload":
        value[-5] ^= 0x01
    elif damage == "flip_meta":
        value[25] ^= 0x20
    elif damage == "truncate":
        value = value[:-1]
    elif damage == "extend":
        value += b"\0"
    elif damage == "magic":
        value[0:4] = b"XXXX"
    elif damage == "version":
        struct.pack_into("<H", value, 4, VERSION + 1)
    elif damage == "empty":
        value = b""
    elif damage == "short_header":
        value = value[:10]
    with pytest.raises(CodecError):
        decode_block(bytes(value), key=KEY)


def test_version_mismatch_message_names_both_versions():
    value = bytearray(encode_block(HEADER, PAYLOAD, key=KEY))
    struct.pack_into("<H", value, 4, 7)
    with pytest.raises(CodecError, match=f"version 7; this reader knows {VERSION}"):
        decode_block(bytes(value), key=KEY)


def test_encode_refuses_a_payload_of_the_wrong_size():
    with pytest.raises(ValueError, match="needs 768"):
        encode_block(HEADER, PAYLOAD[:-4], key=KEY)
    with pytest.raises(ValueError, match="dtype"):
        encode_block(BlockHeader("x", "complex64", (1,)), b"12345678", key=KEY)


def test_header_whose_shape_disagrees_with_payload_is_refused():
    # a well-formed value whose meta claims a shape the payload does not fill
    good = encode_block(HEADER, PAYLOAD, key=KEY)
    meta_len = struct.unpack_from("<H", good, 6)[0]
    import json
    import zlib

    meta = json.dumps({"layout": "x", "dtype": "float32", "shape": [5], "key": KEY}).encode()
    fixed = struct.pack("<4sHHQI", MAGIC, VERSION, len(meta), len(PAYLOAD),
                        zlib.crc32(PAYLOAD, zlib.crc32(meta)))
    assert meta_len > 0
    with pytest.raises(CodecError, match="needs 20"):
        decode_block(fixed + meta + PAYLOAD, key=KEY)


def test_a_value_read_under_another_key_is_refused():
    """A block copied or swapped to another prompt's key keeps a correct CRC for its bytes;
    the key it was written under is checked, so it is a miss (recomputed), not a wrong answer
    (issue 26.6)."""
    value = encode_block(HEADER, PAYLOAD, key=KEY)
    with pytest.raises(CodecError, match="written under key 'f00d:00000000000000aa' and read "
                                         "under 'f00d:00000000000000bb'"):
        decode_block(value, key="f00d:00000000000000bb")
    with pytest.raises(CodecError, match="written under key"):   # another model's fingerprint
        decode_block(value, key="beef:00000000000000aa")


def test_the_key_is_covered_by_the_checksum():
    """Editing the key inside the meta (same length, CRC left as is) is a checksum error."""
    value = bytearray(encode_block(HEADER, PAYLOAD, key=KEY))
    at = bytes(value).index(b"00aa")
    value[at:at + 4] = b"00bb"
    with pytest.raises(CodecError, match="checksum"):
        decode_block(bytes(value), key="f00d:00000000000000bb")


def test_a_version_1_value_without_a_key_is_refused():
    import json
    import zlib

    meta = json.dumps({"layout": HEADER.layout, "dtype": "float32",
                       "shape": list(HEADER.shape)}).encode()
    fixed = struct.pack("<4sHHQI", MAGIC, 1, len(meta), len(PAYLOAD),
                        zlib.crc32(PAYLOAD, zlib.crc32(meta)))
    with pytest.raises(CodecError, match="version 1"):
        decode_block(fixed + meta + PAYLOAD, key=KEY)
