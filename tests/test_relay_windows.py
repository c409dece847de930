"""The relay's flow-control windows (shim.transport.relay.windows.Windows) on their own."""
from __future__ import annotations

from types import SimpleNamespace

from shim.transport.relay.windows import Windows


def stream(sid: int) -> SimpleNamespace:
    """What the windows use of a Stream: its id and the runtime's window for it."""
    return SimpleNamespace(sid=sid, send_window=0)
from shim.transport.wire.h2 import DATA, END_STREAM, frame


def test_a_raised_initial_window_counts_once_acknowledged_a_lowered_one_at_once():
    w = Windows()
    one = stream(1)
    w.own_stream(one)
    w.server_settings(1 << 20)  # raised: not before the client's ACK went upstream
    assert (w.initial, one.send_window) == (65535, 65535)
    w.client_acked()
    assert (w.initial, one.send_window) == (1 << 20, 1 << 20)
    w.server_settings(1000)  # lowered: at once
    assert (w.initial, one.send_window) == (1000, 1000)
    w.server_settings(None)  # a SETTINGS without the setting still takes an ACK
    w.client_acked()  # acknowledges the 1000
    assert w.initial == 1000 and list(w.settings_unacked) == [None]
    w.client_acked()
    assert not w.settings_unacked


def test_the_clients_view_never_exceeds_what_the_server_allows():
    w = Windows()
    w.upstream_window -= 1000  # the relay sent 1000 bytes more than the client did (a rewrite grew)
    assert not w.server_conn_update(500)  # cut: the client may not have any of it
    assert w.grant() == 0 and w.client_window == 65535
    assert not w.server_conn_update(100_000)  # cut to 99500
    assert w.grant() == 99_500 and w.client_window == w.upstream_window
    assert w.server_conn_update(10) and w.client_window == w.upstream_window  # passed on whole


def test_queued_data_goes_when_the_windows_take_it():
    w = Windows()
    three = stream(3)
    w.own_stream(three)
    three.send_window = 10
    a, b = frame(DATA, 0, 3, b"x" * 10), frame(DATA, END_STREAM, 3, b"y" * 10)
    assert not w.take(3, 20)
    w.enqueue(3, a, 10)
    w.enqueue(3, b, 10)
    assert w.drain() == [a] and w.queued == 10
    three.send_window += 10
    assert w.drain() == [b] and w.queued == 0 and 3 not in w.sending and not w.queued_streams
    w.own_stream(stream(5))
    w.enqueue(5, frame(DATA, 0, 5, b"z"), 1)
    w.forget(5)
    assert not w.queue and w.queued == 0 and 5 not in w.sending
