"""The value format of one KV block: a small versioned header, then the raw tensor bytes.

    offset  size  field
    0       4     magic b"DIKV"
    4       2     format version (little-endian u16), `VERSION`
    6       2     meta length M (u16)
    8       8     payload length P in bytes (u64)
    16      4     CRC-32 of meta + payload (u32, zlib.crc32)
    20      M     meta: UTF-8 JSON {"layout": str, "dtype": str, "shape": [int, ...],
                  "key": str}
    20+M    P     payload: the tensor's bytes, C order

Never pickle: decoding reads numbers and JSON only, so a hostile or corrupted value cannot run
code. Anything off — magic, version, a short or long buffer, the checksum, meta that does not
parse, a payload size that disagrees with dtype x shape — raises `CodecError`, which readers
count as a miss. CRC-32 (not a cryptographic hash) guards against torn writes and bit rot.

The value binds the key it was written under (block hash + model fingerprint, the caller's
store key): the key is in the checksummed meta and `decode_block` refuses a value read under
another key, so a block copied or swapped to another prompt's key (with a correct CRC for its
bytes) is a miss, recomputed, never a silently wrong answer. Version 1 values (no key) are
refused. The store is still trusted not to forge values: whoever can write to it can also write
a correct key and CRC (protect it with Redis ACLs / TLS, see README).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"DIKV"
VERSION = 2   # 2: the meta binds the store key
_FIXED = struct.Struct("<4sHHQI")  # magic, version, meta length, payload length, crc32

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
               "float8_e5m2": 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


class CodecError(ValueError):
    """The bytes are not a valid block of this format version."""


@dataclass(frozen=True)
class BlockHeader:
    """layout: the writer's KV layout name (e.g. "paged_kv:block_dim=1"); dtype: a torch dtype
    name without "torch." (see `DTYPE_BYTES`); shape: the payload tensor's shape."""

    layout: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def encode_block(header: BlockHeader, payload: bytes | memoryview, *, key: str) -> bytes:
    """Header + payload as one bytes value bound to `key`, the store key it is written under.

    Raises:
        ValueError: unknown dtype, or the payload size is not dtype size x prod(shape).
    """
    if header.dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {header.dtype!r} is not one of {sorted(DTYPE_BYTES)}.")
    payload = memoryview(payload).cast("B")
    if payload.nbytes != header.num_bytes:
        raise ValueError(f"payload has {payload.nbytes} bytes; {header.dtype} x "
                         f"{list(header.shape)} needs {header.num_bytes}.")
    meta = json.dumps({"layout": header.layout, "dtype": header.dtype,
                       "shape": list(header.shape), "key": key},
                      separators=(",", ":")).encode()
    checksum = zlib.crc32(payload, zlib.crc32(meta))
    return b"".join((_FIXED.pack(MAGIC, VERSION, len(meta), payload.nbytes, checksum), meta,
                     payload))


def decode_block(data: bytes | memoryview, *, key: str) -> tuple[BlockHeader, memoryview]:
    """Parse and verify a value read under `key`; returns its header and a zero-copy view of
    the payload.

    Raises:
        CodecError: bad magic, other version, wrong length, bad checksum, bad meta, or a value
            written under another key than `key`.
    """
    data = memoryview(data).cast("B")
    if data.nbytes < _FIXED.size:
        raise CodecError(f"value has {data.nbytes} bytes, shorter than the "
                         f"{_FIXED.size}-byte header.")
    magic, version, meta_len, payload_len, checksum = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}.")
    if version != VERSION:
        raise CodecError(f"format version {version}; this reader knows {VERSION}.")
    if data.nbytes != _FIXED.size + meta_len + payload_len:
        raise CodecError(f"value has {data.nbytes} bytes; its header says "
                         f"{_FIXED.size + meta_len + payload_len}.")
    meta = data[_FIXED.size:_FIXED.size + meta_len]
    payload = data[_FIXED.size + meta_len:]
    if zlib.crc32(payload, zlib.crc32(meta)) != checksum:
        raise CodecError("checksum mismatch: the value is corrupted.")
    try:
        fields = json.loads(bytes(meta))
        header = BlockHeader(str(fields["layout"]), str(fields["dtype"]),
                             tuple(int(d) for d in fields["shape"]))
        expected = header.num_bytes
        written_under = fields["key"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CodecError(f"bad header meta: {exc}") from None
    if written_under != key:
        raise CodecError(f"value was written under key {written_under!r} and read under "
                         f"{key!r}: a copied or swapped block, not this prompt's.")
    if expected != payload_len:
        raise CodecError(f"payload has {payload_len} bytes; {header.dtype} x "
                         f"{list(header.shape)} needs {expected}.")
    return header, payload
