"""NRI's multiplexer and ttrpc framing on bytes (shim/transport/wire/mux.py, ttrpc.py): the
worked vectors of the design sheet, hand-derived ones, splitting toward Go runtimes, reassembly
from any cut of the stream, the bounds, and the hand-written envelope against the generated one."""
from __future__ import annotations

import pytest

from shim.nri import ttrpc_pb2
from shim.transport.wire import mux, ttrpc

# RegisterPlugin{plugin_name="memqos", plugin_idx="50"} as the first request on mux connection 2
# (the design sheet's worked bytes, nri.md §1.5):
#   00000002 00000046          mux: conn 2, payload 70 bytes
#   0000003c 00000001 01 00    ttrpc: data 60 bytes, stream 1, type Request, flags 0
#   0a 1c "nri.pkg.api.v1alpha1.Runtime"   Request.service (field 1, 28 bytes)
#   12 0e "RegisterPlugin"                 Request.method (field 2, 14 bytes)
#   1a 0c 0a 06 "memqos" 12 02 "50"        Request.payload (field 3, 12 bytes) = RegisterPluginRequest
REGISTER = bytes.fromhex(
    "00000002 00000046"
    "0000003c 00000001 0100"
    "0a1c") + b"nri.pkg.api.v1alpha1.Runtime" + bytes.fromhex("120e") + b"RegisterPlugin" + \
    bytes.fromhex("1a0c 0a06") + b"memqos" + bytes.fromhex("1202") + b"50"
REGISTER_PAYLOAD = bytes.fromhex("0a06") + b"memqos" + bytes.fromhex("1202") + b"50"


def test_register_plugin_worked_bytes():
    conn = ttrpc.Connection(client=True)
    sid = conn.send_request(ttrpc.Request("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin", REGISTER_PAYLOAD))
    assert sid == 1
    assert mux.encode(2, conn.data_to_send()) == REGISTER
    assert conn.data_to_send() == b""


def test_client_stream_ids_are_odd_and_increase():
    conn = ttrpc.Connection(client=True)
    assert [conn.send_request(ttrpc.Request("s", "m")) for _ in range(3)] == [1, 3, 5]


def test_response_framing():
    # ConfigureResponse{events=0x48d} is 10 8d 09 (field 2 varint; 0x48d = 0b1001_0001101 -> 8d 09);
    # in ttrpc.Response as payload (field 2): 12 03 10 8d 09, no status (OK); header: length 5,
    # stream 1, type Response (2), flags 0.
    conn = ttrpc.Connection(client=False)
    conn.send_response(1, ttrpc.Response(payload=bytes.fromhex("108d09")))
    assert conn.data_to_send() == bytes.fromhex("00000005 00000001 0200 1203108d09")
    # Unimplemented: Response.status (field 1) = Status{code (field 1) = 12, message (field 2) = "x"}
    conn.send_response(3, ttrpc.Response(code=ttrpc.UNIMPLEMENTED, message="x"))
    assert conn.data_to_send() == bytes.fromhex("00000007 00000003 0200 0a05080c120178")


def test_mux_splits_outgoing_payloads_at_4096_bytes():
    payload = bytes(range(256)) * 39 + b"0123456789abcdef"  # 10000 bytes
    out = mux.encode(1, payload)
    # 4096 = 0x1000, 4096, then 10000 - 8192 = 1808 = 0x710
    assert out[:8] == bytes.fromhex("00000001 00001000")
    assert out[8 + 4096:16 + 4096] == bytes.fromhex("00000001 00001000")
    assert out[16 + 8192:24 + 8192] == bytes.fromhex("00000001 00000710")
    assert len(out) == 10000 + 3 * 8
    dec = mux.MuxDecoder({1})
    assert b"".join(p for _, p in dec.receive_data(out)) == payload


def test_mux_reassembles_from_any_cut_and_drops_unknown_connections():
    stream = mux.encode(1, b"hello") + mux.encode(7, b"nobody") + mux.encode(2, b"world" * 1000)
    dec = mux.MuxDecoder({1, 2})
    got = []
    for i in range(len(stream)):
        got += dec.receive_data(stream[i:i + 1])
    assert [(c, len(p)) for c, p in got] == [(1, 5), (2, 4096), (2, 904)]
    assert dec.dropped_frames == 1 and dec.buffered == 0


def test_mux_accepts_the_largest_legal_frame_and_refuses_above_the_bound():
    dec = mux.MuxDecoder({1})
    big = b"\xab" * mux.MAX_FRAME  # 1 << 24: what NRI <= 0.6 runtimes may send in one frame
    frames = dec.receive_data(mux.HEADER.pack(1, len(big)) + big)
    assert frames == [(1, big)]
    small = mux.MuxDecoder({1}, max_frame=4096)
    with pytest.raises(mux.MuxError, match="4097 bytes .* above the limit of 4096"):
        small.receive_data(mux.HEADER.pack(1, 4097))
    assert small.buffered == 0


def go_style_cuts(ttrpc_bytes: bytes) -> list[bytes]:
    """How a Go ttrpc writer's bytes reach the mux: a 4096-byte bufio chunk, then the rest of a
    large message in one write."""
    return [ttrpc_bytes[:4096], ttrpc_bytes[4096:]] if len(ttrpc_bytes) > 4096 else [ttrpc_bytes]


def test_ttrpc_messages_reassemble_across_mux_frames():
    client = ttrpc.Connection(client=True)
    payload = b"p" * 9000
    client.send_request(ttrpc.Request("svc", "Big", payload, timeout_nano=2_000_000_000,
                                      metadata=(("traceparent", "00-ab"),)))
    client.send_request(ttrpc.Request("svc", "Small"))
    data = client.data_to_send()
    wire = b"".join(mux.encode(1, cut, max_frame=mux.MAX_FRAME) for cut in go_style_cuts(data))
    server, dec = ttrpc.Connection(client=False), mux.MuxDecoder({1})
    events = []
    for i in range(0, len(wire), 1000):
        for _, p in dec.receive_data(wire[i:i + 1000]):
            events += server.receive_data(p)
    assert [type(e).__name__ for e in events] == ["RequestReceived", "RequestReceived"]
    big, small = events
    assert (big.stream_id, big.request.method, big.request.payload, big.request.timeout_nano) == (1, "Big", payload,
                                                                                                  2_000_000_000)
    assert big.request.metadata == (("traceparent", "00-ab"),)
    assert (small.stream_id, small.request.method, small.request.payload) == (3, "Small", b"")


def test_oversized_message_is_discarded_and_the_connection_survives():
    server = ttrpc.Connection(client=False)
    huge = ttrpc.frame(1, ttrpc.REQUEST, b"\0" * (ttrpc.MAX_DATA + 1))
    after = ttrpc.frame(3, ttrpc.REQUEST, ttrpc.encode_request(ttrpc.Request("svc", "After")))
    events = []
    stream = huge + after
    for i in range(0, len(stream), 65536):
        events += server.receive_data(stream[i:i + 65536])
        assert len(server._buf) <= 65536 + ttrpc.HEADER_SIZE  # never buffered whole
    assert isinstance(events[0], ttrpc.MessageDiscarded) and events[0].code == ttrpc.RESOURCE_EXHAUSTED
    assert isinstance(events[1], ttrpc.RequestReceived) and events[1].request.method == "After"
    reply = server.data_to_send()
    length, sid, mtype, _ = ttrpc.HEADER.unpack_from(reply)
    resp = ttrpc.decode_response(reply[10:10 + length])
    assert (sid, mtype, resp.code) == (1, ttrpc.RESPONSE, ttrpc.RESOURCE_EXHAUSTED)
    assert "4194305 bytes" in resp.message


def test_client_fails_the_call_of_an_oversized_response():
    client = ttrpc.Connection(client=True)
    sid = client.send_request(ttrpc.Request("s", "m"))
    events = client.receive_data(ttrpc.HEADER.pack(ttrpc.MAX_DATA + 5, sid, ttrpc.RESPONSE, 0) + b"\0" * 100)
    assert events == [ttrpc.MessageDiscarded(sid, ttrpc.RESPONSE, ttrpc.RESOURCE_EXHAUSTED, events[0].reason)]
    assert client.pending == set()
    assert client.receive_data(b"\0" * (ttrpc.MAX_DATA - 95)) == []
    assert client._discard == 0 and client._buf == bytearray()


def test_outgoing_request_above_the_limit_is_refused():
    with pytest.raises(ttrpc.OversizedMessage):
        ttrpc.Connection(client=True).send_request(ttrpc.Request("s", "m", b"x" * ttrpc.MAX_DATA))


def test_server_refuses_even_and_reused_stream_ids():
    server = ttrpc.Connection(client=False)
    req = ttrpc.encode_request(ttrpc.Request("s", "m"))
    events = server.receive_data(ttrpc.frame(2, ttrpc.REQUEST, req) + ttrpc.frame(5, ttrpc.REQUEST, req)
                                 + ttrpc.frame(3, ttrpc.REQUEST, req))
    assert [(type(e).__name__, e.stream_id) for e in events] == [
        ("MessageDiscarded", 2), ("RequestReceived", 5), ("MessageDiscarded", 3)]
    out = server.data_to_send()
    codes = []
    while out:
        length, sid, _, _ = ttrpc.HEADER.unpack_from(out)
        codes.append((sid, ttrpc.decode_response(out[10:10 + length]).code))
        out = out[10 + length:]
    assert codes == [(2, ttrpc.INVALID_ARGUMENT), (3, ttrpc.INVALID_ARGUMENT)]


def test_client_drops_a_response_for_a_stream_it_did_not_open():
    client = ttrpc.Connection(client=True)
    assert client.receive_data(ttrpc.frame(9, ttrpc.RESPONSE, b"")) == []
    assert client.discarded == 1


def test_hand_envelope_matches_the_generated_messages():
    req = ttrpc.Request("nri.pkg.api.v1alpha1.Plugin", "Configure", b"\x01\x02", timeout_nano=-5,
                        metadata=(("k", "v"), ("", "only-value")))
    parsed = ttrpc_pb2.Request.FromString(ttrpc.encode_request(req))
    assert (parsed.service, parsed.method, parsed.payload, parsed.timeout_nano) == (
        req.service, req.method, req.payload, -5)
    assert [(kv.key, kv.value) for kv in parsed.metadata] == [("k", "v"), ("", "only-value")]
    assert ttrpc.decode_request(parsed.SerializeToString()) == req
    # a Go server always sets Response.status, even for OK (an empty Status message: 0a 00)
    go_ok = ttrpc_pb2.Response(status=ttrpc_pb2.Status(), payload=b"x")
    assert go_ok.SerializeToString() == bytes.fromhex("0a00 120178")
    assert ttrpc.decode_response(go_ok.SerializeToString()) == ttrpc.Response(b"x")
    err = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=-1, message="neg"))
    err.status.details.add(type_url="t", value=b"v")
    assert ttrpc.decode_response(err.SerializeToString()) == ttrpc.Response(b"", -1, "neg")
    ours = ttrpc.encode_response(ttrpc.Response(b"pp", 12, "no such method"))
    assert ttrpc_pb2.Response.FromString(ours) == ttrpc_pb2.Response(
        status=ttrpc_pb2.Status(code=12, message="no such method"), payload=b"pp")


def test_undecodable_request_gets_invalid_argument():
    server = ttrpc.Connection(client=False)
    events = server.receive_data(ttrpc.frame(1, ttrpc.REQUEST, b"\x0a\x05ab"))  # field 1 claims 5 bytes, has 2
    assert events[0].code == ttrpc.INVALID_ARGUMENT
    assert server.data_to_send()[8] == ttrpc.RESPONSE
