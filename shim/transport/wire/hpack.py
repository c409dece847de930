"""A small, fast HPACK (RFC 7541) decoder for the relay, and the few encodings it writes itself.

The relay decodes every header block of a connection, in order, to learn each stream's
``:path`` (client to server) and ``grpc-status`` / ``grpc-message`` (server to client). Every
block must be decoded, or the dynamic table goes out of sync with the peer's encoder. This
decoder does only that: bytes in, a list of (name, value) byte pairs out, the dynamic table kept
exactly. Huffman strings are decoded by the ``hpack`` package (``hpack.huffman_table``) and
memoized: a kubelet's header values repeat.

What the relay writes itself (error trailers to a client) uses only "literal header field
without indexing" representations with static-table names or literal names, so it never
touches the peer's dynamic table.
"""
from __future__ import annotations

from hpack.exceptions import HPACKDecodingError
from hpack.huffman_table import decode_huffman

STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"), (b":status", b"200"),
    (b":status", b"204"), (b":status", b"206"), (b":status", b"304"), (b":status", b"400"),
    (b":status", b"404"), (b":status", b"500"), (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"), (b"accept-language", b""), (b"accept-ranges", b""),
    (b"accept", b""), (b"access-control-allow-origin", b""), (b"age", b""), (b"allow", b""),
    (b"authorization", b""), (b"cache-control", b""), (b"content-disposition", b""),
    (b"content-encoding", b""), (b"content-language", b""), (b"content-length", b""),
    (b"content-location", b""), (b"content-range", b""), (b"content-type", b""), (b"cookie", b""),
    (b"date", b""), (b"etag", b""), (b"expect", b""), (b"expires", b""), (b"from", b""), (b"host", b""),
    (b"if-match", b""), (b"if-modified-since", b""), (b"if-none-match", b""), (b"if-range", b""),
    (b"if-unmodified-since", b""), (b"last-modified", b""), (b"link", b""), (b"location", b""),
    (b"max-forwards", b""), (b"proxy-authenticate", b""), (b"proxy-authorization", b""),
    (b"range", b""), (b"referer", b""), (b"refresh", b""), (b"retry-after", b""), (b"server", b""),
    (b"set-cookie", b""), (b"strict-transport-security", b""), (b"transfer-encoding", b""),
    (b"user-agent", b""), (b"vary", b""), (b"via", b""), (b"www-authenticate", b""),
)
_STATIC_N = len(STATIC_TABLE)  # 61
_HUFFMAN_CACHE_MAX = 2048


class HpackError(ValueError):
    """The block cannot be decoded: the connection's HPACK state is lost."""


def _integer(data: bytes, i: int, value: int) -> tuple[int, int]:
    """Continue an HPACK integer whose prefix was all ones (``value``) at data[i]."""
    shift = 0
    while True:
        b = data[i]
        i += 1
        value += (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 28:
            raise HpackError("HPACK integer too large")


class HeaderListTooLarge(HpackError):
    """A block that decodes to more than the decoder's ``max_list`` (SETTINGS_MAX_HEADER_LIST_SIZE:
    names and values plus 32 bytes per field), e.g. a few bytes referencing a large table entry
    many times."""


class Decoder:
    """One direction of one connection. ``max_allowed`` is the largest SETTINGS_HEADER_TABLE_SIZE
    the decoding peer advertised: a size update above it is an error (the relay follows the
    encoder; the peers check the rest)."""

    __slots__ = ("dynamic", "size", "max_size", "max_allowed", "max_list", "_huffman", "_generation", "_blocks")

    def __init__(self, max_allowed: int = 4096, max_list: int = 0) -> None:
        self.dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self.size = 0
        self.max_size = 4096
        self.max_allowed = max_allowed
        self.max_list = max_list  # the decoded header list's size at most (0: no limit)
        self._huffman: dict[bytes, bytes] = {}
        # Blocks that did not change the table, by their bytes, with the table generation they
        # were decoded at: a steady-state gRPC peer sends the same few fully indexed blocks.
        self._generation = 0
        self._blocks: dict[bytes, list] = {}  # block -> [generation, headers, derived info or None]

    def _string(self, data: bytes, i: int) -> tuple[bytes, int]:
        b = data[i]
        length = b & 0x7F
        i += 1
        if length == 0x7F:
            length, i = _integer(data, i, 0x7F)
        end = i + length
        if end > len(data):
            raise HpackError("truncated HPACK string")
        s = data[i:end]
        if b & 0x80:
            h = self._huffman.get(s)
            if h is None:
                try:
                    h = decode_huffman(s)
                except HPACKDecodingError as e:
                    raise HpackError(str(e)) from None
                if len(self._huffman) >= _HUFFMAN_CACHE_MAX:
                    self._huffman.clear()
                self._huffman[s] = h
            s = h
        return s, end

    def _get(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= _STATIC_N:
            return STATIC_TABLE[index - 1]
        try:
            if index > 0:
                return self.dynamic[index - _STATIC_N - 1]
        except IndexError:
            pass
        raise HpackError(f"HPACK index {index} out of range")

    def _add(self, name: bytes, value: bytes) -> None:
        need = 32 + len(name) + len(value)
        dynamic = self.dynamic
        if need > self.max_size:
            dynamic.clear()
            self.size = 0
            self._generation += 1
            return
        size = self.size + need
        while size > self.max_size:
            old = dynamic.pop()
            size -= 32 + len(old[0]) + len(old[1])
        dynamic.insert(0, (name, value))
        self.size = size
        self._generation += 1

    def _resize(self, max_size: int) -> None:
        if max_size > self.max_allowed:
            raise HpackError(f"HPACK table size update {max_size} above the allowed {self.max_allowed}")
        self.max_size = max_size
        self._generation += 1
        dynamic = self.dynamic
        while self.size > max_size:
            old = dynamic.pop()
            self.size -= 32 + len(old[0]) + len(old[1])

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The block's (name, value) pairs, in order. The list may be shared: do not change it."""
        generation = self._generation
        hit = self._blocks.get(data)
        if hit is not None and hit[0] == generation:
            return hit[1]
        out: list[tuple[bytes, bytes]] = []
        self._decode(data, out)
        if self._generation == generation and len(data) <= 512:
            if len(self._blocks) >= 256:
                self._blocks.clear()
            self._blocks[data] = [generation, out, None]
        return out

    def info(self, data: bytes, derive):
        """``derive(headers)`` for the block, computed once per cached block."""
        hit = self._blocks.get(data)
        if hit is not None and hit[0] == self._generation:
            info = hit[2]
            if info is None:
                info = hit[2] = derive(hit[1])
            return info
        return derive(self.decode(data))

    def _decode(self, data: bytes, out: list) -> None:
        i = 0
        n = len(data)
        limit = self.max_list
        counted = total = 0
        try:
            while i < n:
                if limit and len(out) > counted:
                    total = self._list_size(out, counted, total)
                    counted = len(out)
                b = data[i]
                if b & 0x80:  # indexed field
                    index = b & 0x7F
                    i += 1
                    if index == 0x7F:
                        index, i = _integer(data, i, 0x7F)
                    out.append(self._get(index))
                elif b & 0x40:  # literal with incremental indexing
                    index = b & 0x3F
                    i += 1
                    if index == 0x3F:
                        index, i = _integer(data, i, 0x3F)
                    if index:
                        name = self._get(index)[0]
                    else:
                        name, i = self._string(data, i)
                    value, i = self._string(data, i)
                    out.append((name, value))
                    self._add(name, value)
                elif b & 0x20:  # dynamic table size update
                    if out:
                        raise HpackError("HPACK table size update after a header field")
                    size = b & 0x1F
                    i += 1
                    if size == 0x1F:
                        size, i = _integer(data, i, 0x1F)
                    self._resize(size)
                else:  # literal without indexing (0000) / never indexed (0001)
                    index = b & 0x0F
                    i += 1
                    if index == 0x0F:
                        index, i = _integer(data, i, 0x0F)
                    if index:
                        name = self._get(index)[0]
                    else:
                        name, i = self._string(data, i)
                    value, i = self._string(data, i)
                    out.append((name, value))
        except IndexError:
            raise HpackError("truncated HPACK block") from None
        if limit and len(out) > counted:
            self._list_size(out, counted, total)

    def _list_size(self, out: list, counted: int, total: int) -> int:
        """``total`` plus the size of the fields from ``counted`` on; HeaderListTooLarge past
        ``max_list``."""
        for name, value in out[counted:]:
            total += len(name) + len(value) + 32
        if total > self.max_list:
            raise HeaderListTooLarge(f"a header list above {self.max_list} bytes")
        return total


# ------------------------------------------------------------------------------------- encoding


def _encode_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman: leaves every table alone."""
    return b"\x00" + _encode_int(len(name), 7, 0) + name + _encode_int(len(value), 7, 0) + value


def literal_static_name(index: int, value: bytes) -> bytes:
    """A literal without indexing whose name is static-table entry ``index``."""
    return _encode_int(index, 4, 0) + _encode_int(len(value), 7, 0) + value


STATUS_200 = b"\x88"  # indexed: static entry 8, ":status: 200"
CONTENT_TYPE_GRPC = literal_static_name(31, b"application/grpc")
