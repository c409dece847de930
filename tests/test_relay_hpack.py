"""The relay's HPACK decoder against the hpack package (encoder and reference decoder): the same
headers out, the same dynamic table kept, over long sequences of blocks."""
from __future__ import annotations

import random

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.transport.wire.hpack import (
    CONTENT_TYPE_GRPC,
    STATIC_TABLE,
    STATUS_200,
    Decoder,
    HpackError,
    literal,
    literal_static_name,
)


def test_static_table_is_rfc7541():
    assert STATIC_TABLE == tuple(hpack.table.HeaderTable.STATIC_TABLE)


GRPC_REQUEST = [
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/runtime.v1.RuntimeService/ListContainers"),
    (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
    (b"grpc-accept-encoding", b"identity, deflate, gzip"), (b"user-agent", b"grpc-go/1.58.3"),
]


def test_kubelet_like_sequence_with_changing_timeouts_and_table_churn():
    enc = hpack.Encoder()
    ref = hpack.Decoder()
    ours = Decoder()
    rnd = random.Random(7)
    for i in range(3000):
        headers = list(GRPC_REQUEST)
        headers[2] = (b":path", rnd.choice([b"/runtime.v1.RuntimeService/ListContainers",
                                            b"/runtime.v1.RuntimeService/CreateContainer",
                                            b"/runtime.v1.ImageService/ImageFsInfo"]))
        headers.append((b"grpc-timeout", b"%du" % rnd.randrange(1, 10**8)))
        if i % 7 == 0:
            headers.append((b"x-blob-bin", bytes(rnd.randrange(256) for _ in range(rnd.randrange(300)))))
        block = enc.encode(headers, huffman=bool(i % 2))
        assert ours.decode(block) == [tuple(h) for h in ref.decode(block, raw=True)]
        assert ours.dynamic == list(ref.header_table.dynamic_entries)
        assert ours.size == ref.header_table._current_size


def test_table_size_updates_and_eviction():
    enc = hpack.Encoder()
    ref = hpack.Decoder()
    ours = Decoder(max_allowed=65536)
    ref.max_allowed_table_size = 65536
    for size in (65536, 100, 0, 4096, 300, 4096):
        enc.header_table_size = size
        for k in range(20):
            block = enc.encode([(b"k%d" % k, b"v" * (k * 13)), (b":path", b"/x/%d" % k)])
            assert ours.decode(block) == [tuple(h) for h in ref.decode(block, raw=True)]
            assert ours.dynamic == list(ref.header_table.dynamic_entries)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.binary(min_size=1, max_size=40), st.binary(max_size=200)),
                         min_size=1, max_size=8), min_size=1, max_size=30),
       st.booleans())
def test_any_header_sets_decode_like_hpack(blocks, huffman):
    enc = hpack.Encoder()
    ref = hpack.Decoder(max_header_list_size=1 << 30)
    ours = Decoder()
    for headers in blocks:
        block = enc.encode([(n.lower(), v) for n, v in headers], huffman=huffman)
        assert ours.decode(block) == [tuple(h) for h in ref.decode(block, raw=True)]
        assert ours.dynamic == list(ref.header_table.dynamic_entries)


@pytest.mark.parametrize("bad", [b"\x80", b"\xff\xff\xff\xff\xff\xff\x7f", b"\x40\x05ab", b"\x00\x01a\x85abc",
                                 b"\x3f\xff\xff\xff\xff\x7f", b"\xbf"])
def test_bad_blocks_raise(bad):
    with pytest.raises(HpackError):
        Decoder().decode(bad)


def test_size_update_above_the_advertised_size_is_refused():
    with pytest.raises(HpackError):
        Decoder(max_allowed=4096).decode(b"\x3f\xe1\x3f")  # size update to 8192


def test_what_the_relay_writes_leaves_the_table_alone():
    block = STATUS_200 + CONTENT_TYPE_GRPC + literal(b"grpc-status", b"14") + literal(b"grpc-message", b"x" * 300)
    ref = hpack.Decoder()
    assert ref.decode(block, raw=True) == [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                           (b"grpc-status", b"14"), (b"grpc-message", b"x" * 300)]
    assert list(ref.header_table.dynamic_entries) == []
    assert hpack.Decoder().decode(literal_static_name(4, b"/a"), raw=True) == [(b":path", b"/a")]
