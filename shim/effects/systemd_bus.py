"""systemd's D-Bus API, as the shim uses it: ``SetUnitProperties`` on a unit, nothing else.

One connection to the system bus (``DBUS_SYSTEM_BUS_ADDRESS``, else
/run/dbus/system_bus_socket), made on first use and kept. Only the reconciler's thread and
``memqos-shim reset`` call it, never the CRI path; the I/O is blocking (jeepney's
``jeepney.io.blocking``) and every step has a deadline: connecting and authenticating, the
bus's Hello, each call (``timeout``).

A call that fails for want of a bus (no socket, the daemon restarting, no answer in time) is
made again on a new connection, ``attempts`` times in all with a pause between them
(``backoff``, doubling). When every attempt failed, systemd is not asked again for ``hold``
seconds (1 s, doubling while it keeps failing, at most ``max_hold``): calls in that time fail
at once, so a pass over many cgroups without a bus costs one failed call, not one per cgroup.
An error answer from systemd (no such unit, a property it refuses, access denied) is not
retried: the bus works, the call does not.

Every failure is a ``SystemdError`` (an OSError): the reconciler logs and audits it and tries
again at its next pass; ``reset`` reports it.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

from jeepney import DBusAddress, MessageType, new_method_call
from jeepney.bus import get_bus
from jeepney.bus_messages import message_bus
from jeepney.io import blocking
from jeepney.io.common import MessageFilters
from jeepney.wrappers import DBusErrorResponse

SYSTEMD = DBusAddress("/org/freedesktop/systemd1", bus_name="org.freedesktop.systemd1",
                      interface="org.freedesktop.systemd1.Manager")
# SetUnitProperties(in s name, in b runtime, in a(sv) properties)
SET_UNIT_PROPERTIES_SIGNATURE = "sba(sv)"
# the properties the shim sets, with their D-Bus type (systemd's dbus-cgroup.c: uint64 bytes)
PROPERTY_TYPES = {"MemoryMin": "t", "MemoryLow": "t"}
UINT64_MAX = 2**64 - 1
DEFAULT_SYSTEM_BUS = "unix:path=/var/run/dbus/system_bus_socket"  # jeepney's and libdbus's default


class SystemdError(OSError):
    """systemd refused or could not be asked (the reconciler logs it and retries at the next resync)."""


class _Connection(blocking.DBusConnection):
    """jeepney's blocking connection, whose Hello (the first call on a bus) has a deadline too:
    ``blocking.DBusConnection`` says Hello without one."""

    def __init__(self, sock, timeout: float):
        blocking.DBusConnectionBase.__init__(self, sock, enable_fds=False)
        self._filters = MessageFilters()
        self.bus_proxy = blocking.Proxy(message_bus, self, timeout=timeout)
        self.unique_name = self.bus_proxy.Hello()[0]


def open_connection(address: str, timeout: float) -> blocking.DBusConnection:
    """A connection to the bus at ``address`` ('SYSTEM' or a D-Bus address such as
    'unix:path=/run/dbus/system_bus_socket'), authenticated and named within ``timeout``."""
    sock = blocking.prep_socket(get_bus(address), enable_fds=False, timeout=timeout)
    try:
        return _Connection(sock, timeout)
    except BaseException:
        sock.close()
        raise


class SystemdBus:
    """``SetUnitProperties`` over one kept connection to the system bus (see the module doc)."""

    def __init__(self, address: str = "SYSTEM", *, timeout: float = 10.0, attempts: int = 3,
                 backoff: float = 0.2, hold: float = 1.0, max_hold: float = 30.0,
                 connect: Callable[[str, float], blocking.DBusConnection] = open_connection,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if attempts < 1 or timeout <= 0:
            raise ValueError("attempts must be >= 1 and timeout > 0")
        self.address = address
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff
        self.first_hold = hold
        self.max_hold = max_hold
        self._connect = connect
        self._clock = clock
        self._sleep = sleep
        self._conn: blocking.DBusConnection | None = None
        self._hold = 0.0  # the last hold-off (0: the bus answered last time)
        self._held_until = 0.0
        self.last_error: str | None = None  # why the last call found no bus (None: it did)
        self.connects = 0  # connections made (tests, the audit)
        self.failures = 0  # calls that found no bus after every attempt, or during a hold-off

    @property
    def where(self) -> str:
        """The bus's address as it is used ('SYSTEM': $DBUS_SYSTEM_BUS_ADDRESS or the default socket)."""
        if self.address == "SYSTEM":
            return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or DEFAULT_SYSTEM_BUS
        return self.address

    @property
    def down(self) -> bool:
        """The last call found no bus."""
        return self.last_error is not None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def set_unit_properties(self, unit: str, props: Sequence[tuple[str, int]], runtime: bool = True) -> None:
        """``SetUnitProperties(unit, runtime, [(name, <t value>), ...])``; SystemdError if systemd
        refused or could not be reached."""
        body = []
        for name, value in props:
            if name not in PROPERTY_TYPES:
                raise ValueError(f"{name!r} is not a property the shim sets")
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
                raise ValueError(f"bad value {value!r} for {name}")
            body.append((name, (PROPERTY_TYPES[name], value)))
        what = f"SetUnitProperties({unit}, {', '.join(f'{n}={v}' for n, v in props)})"
        now = self._clock()
        if now < self._held_until:
            self.failures += 1
            raise SystemdError(f"{what}: the system bus is not used for {self._held_until - now:.1f} s more "
                               f"after it failed: {self.last_error}")
        msg = new_method_call(SYSTEMD, "SetUnitProperties", SET_UNIT_PROPERTIES_SIGNATURE, (unit, bool(runtime), body))
        pause = self.backoff
        error = ""
        for attempt in range(self.attempts):
            if attempt:
                self._sleep(pause)
                pause *= 2
            try:
                if self._conn is None:
                    self._conn = self._connect(self.address, self.timeout)
                    self.connects += 1
                reply = self._conn.send_and_get_reply(msg, timeout=self.timeout)
            except TimeoutError:
                error = f"no answer in {self.timeout:g} s"
            except DBusErrorResponse as e:  # the bus refused the connection's Hello
                error = f"the bus refused the connection: {e}"
            except (OSError, EOFError, ValueError, RuntimeError, KeyError) as e:
                # OSError: no socket, refused, reset; RuntimeError/KeyError: jeepney on an address
                # it cannot use or an unset variable; ValueError: a malformed message from the peer
                error = f"{type(e).__name__}: {e}"
            else:
                self._hold, self._held_until, self.last_error = 0.0, 0.0, None
                if reply.header.message_type == MessageType.error:
                    raise SystemdError(f"{what} refused by systemd: {_error_text(reply)}")
                return
            self.close()
        self._hold = min(self.max_hold, self._hold * 2 if self._hold else self.first_hold)
        self._held_until = self._clock() + self._hold
        self.last_error = f"{error} ({self.attempts} attempt(s), bus {self.where})"
        self.failures += 1
        raise SystemdError(f"{what}: cannot reach systemd: {self.last_error}")


def _error_text(reply) -> str:
    from jeepney import HeaderFields

    name = reply.header.fields.get(HeaderFields.error_name, "?")
    text = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
    return f"{name}: {text}"[:300] if text else str(name)
