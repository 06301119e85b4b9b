"""A small, safe binary encoding for cached samples, checked by a keyed digest.

Bagua's cached dataset pickles its values; unpickling runs code named by the bytes, so a
shared cache that anyone on the network can write to (a Redis server) would be a way to run
code in every training process. This encoding only builds numpy arrays, dicts, lists,
tuples and scalars. Every value is stored as ``MAGIC | digest | payload``, where the digest
is a BLAKE2b over the key and the payload: a truncated, flipped or misplaced entry (a value
written under another key) fails the check and is read as a miss.
"""

import hashlib
import struct

import numpy as np

MAGIC = b"JBC1"
_DIGEST = 16
_HEADER = len(MAGIC) + _DIGEST
_MAX_DEPTH = 64


class DecodeError(ValueError):
    """An entry that is not a value written by ``encode`` under this key."""


def _digest(key: bytes, payload: bytes) -> bytes:
    # Length-prefixed key, so no (key, payload) pair hashes like another split of the bytes.
    h = hashlib.blake2b(struct.pack("<Q", len(key)) + key, digest_size=_DIGEST)
    h.update(payload)
    return h.digest()


def _pack_bytes(out: list, tag: bytes, data: bytes) -> None:
    out.append(tag + struct.pack("<Q", len(data)))
    out.append(data)


def _encode(value, out: list, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise ValueError(f"cache: value nested deeper than {_MAX_DEPTH} levels")
    if value is None:
        out.append(b"N")
    elif isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise ValueError(
                f"cache: cannot encode an array of dtype {array.dtype}; use plain numeric, "
                "bool, string or bytes dtypes"
            )
        tag = b"a" if isinstance(value, np.ndarray) else b"g"
        dtype = array.dtype.str.encode()
        out.append(tag + struct.pack("<BB", len(dtype), array.ndim) + dtype)
        out.append(struct.pack(f"<{array.ndim}Q", *array.shape))
        _pack_bytes(out, b"", np.ascontiguousarray(array).tobytes())
    elif isinstance(value, bool):
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        _pack_bytes(out, b"i", str(value).encode())
    elif isinstance(value, float):
        out.append(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        _pack_bytes(out, b"s", value.encode("utf-8"))
    elif isinstance(value, bytes):
        _pack_bytes(out, b"b", value)
    elif isinstance(value, dict):
        out.append(b"d" + struct.pack("<Q", len(value)))
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"cache: dict keys must be str, got {type(k).__name__} {k!r}")
            _pack_bytes(out, b"", k.encode("utf-8"))
            _encode(v, out, depth + 1)
    elif isinstance(value, list | tuple):
        out.append((b"l" if isinstance(value, list) else b"t") + struct.pack("<Q", len(value)))
        for v in value:
            _encode(v, out, depth + 1)
    else:
        raise ValueError(
            f"cache: cannot encode a {type(value).__name__}; samples must be numpy arrays, "
            "numbers, str, bytes, None, or dicts/lists/tuples of them"
        )


class _Reader:
    def __init__(self, data: bytes):
        self.view = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise DecodeError("cache: entry ends early")
        chunk = self.view[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def sized(self) -> bytes:
        (n,) = self.unpack("<Q")
        return bytes(self.take(n))


def _decode(r: _Reader, depth: int):
    if depth > _MAX_DEPTH:
        raise DecodeError("cache: entry nested too deep")
    tag = bytes(r.take(1))
    if tag == b"N":
        return None
    if tag in (b"T", b"F"):
        return tag == b"T"
    if tag == b"i":
        return int(r.sized().decode())
    if tag == b"f":
        return r.unpack("<d")[0]
    if tag == b"s":
        return r.sized().decode("utf-8")
    if tag == b"b":
        return r.sized()
    if tag in (b"a", b"g"):
        dtype_len, ndim = r.unpack("<BB")
        dtype = np.dtype(bytes(r.take(dtype_len)).decode())
        if dtype.hasobject or dtype.fields is not None:
            raise DecodeError(f"cache: entry holds a forbidden dtype {dtype}")
        shape = r.unpack(f"<{ndim}Q")
        data = r.sized()
        if len(data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise DecodeError("cache: array size does not match its shape")
        array = np.frombuffer(data, dtype=dtype).reshape(shape).copy()
        return array if tag == b"a" else array[()]
    if tag == b"d":
        (n,) = r.unpack("<Q")
        return {r.sized().decode("utf-8"): _decode(r, depth + 1) for _ in range(n)}
    if tag in (b"l", b"t"):
        (n,) = r.unpack("<Q")
        items = [_decode(r, depth + 1) for _ in range(n)]
        return items if tag == b"l" else tuple(items)
    raise DecodeError(f"cache: unknown tag {tag!r}")


def encode(key: bytes, value) -> bytes:
    """Encodes ``value`` for storage under ``key``; raises ValueError for unsupported types."""
    out: list[bytes] = []
    _encode(value, out, 0)
    payload = b"".join(out)
    return MAGIC + _digest(key, payload) + payload


def decode(key: bytes, data: bytes):
    """Decodes what ``encode(key, value)`` wrote; raises DecodeError for anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"cache: entry is a {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) < _HEADER or data[: len(MAGIC)] != MAGIC:
        raise DecodeError("cache: entry has no valid header")
    payload = data[_HEADER:]
    if data[len(MAGIC) : _HEADER] != _digest(key, payload):
        raise DecodeError(
            "cache: entry digest does not match (corrupt or written under another key)"
        )
    reader = _Reader(payload)
    try:
        value = _decode(reader, 0)
    except (struct.error, UnicodeDecodeError, TypeError, ValueError) as e:
        raise DecodeError(f"cache: malformed entry: {e}") from e
    if reader.pos != len(payload):
        raise DecodeError("cache: trailing bytes after the value")
    return value
