"""The front ends' commands, ``serve`` and ``nri``: their flags from ``OPTIONS``, each front end's
start and stop, SIGHUP and systemd's notifications. The command line itself (``memqos-shim``,
the operator's commands beside these) is ``shim.cli``, above this room and the tools."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Callable

from shim.app.config import OPTIONS, ConfigError, add_arguments, file_only_note, resolve

log = logging.getLogger("memqos-shim")


# -- serve ---------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from shim.app.endpoint_check import check_endpoints

    try:
        cfg = resolve(args)
        check_endpoints(cfg)
    except ConfigError as e:
        print(f"memqos-shim: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    say_unused("serve", args.config)
    from shim.app.limits import raise_nofile_limit
    from shim.app.service import Service
    from shim.effects.files import UnsafeFile

    raise_nofile_limit(cfg.max_connections)
    hold_sighup()
    try:
        service = Service.from_config(cfg)
    except UnsafeFile as e:  # a symlink where the shim writes: a configuration problem
        print(f"memqos-shim: {e.strerror}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    return asyncio.run(_serve(service, config_path=args.config))


# -- nri -----------------------------------------------------------------------
def cmd_nri(args: argparse.Namespace) -> int:
    """The shim as an NRI plugin (shim.app.nri_front), from the same settings as serve."""
    try:
        cfg = resolve(args)
    except ConfigError as e:
        print(f"memqos-shim: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, str(cfg.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    say_unused("nri", args.config)
    from shim.app.nri_front import NriService
    from shim.effects.files import UnsafeFile

    hold_sighup()
    try:
        service = NriService.from_config(cfg)
    except UnsafeFile as e:
        print(f"memqos-shim: {e.strerror}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        log.error("cannot start: %s", e)
        return 1
    return asyncio.run(_serve(service, f"NRI plugin on {cfg.nri_socket}", config_path=args.config))


def say_unused(front: str, config_path: str | None) -> None:
    """Log the config file's settings the other front end only uses (shim.app.config_unused)."""
    from shim.app.config_unused import unused_note

    if (note := unused_note(front, config_path, front_end_options(front))) is not None:
        log.info("%s", note)


# -- SIGHUP --------------------------------------------------------------------
def sighup_actions(service) -> list[Callable[[], None]]:
    """What SIGHUP does, in this order. An action runs on the event loop (the signal's
    callback, not the handler itself) and only sets a flag or puts a mark on a queue: the
    work happens on the thread that owns it."""
    return [
        service.reopen_files,  # the audit log and the recorder, before their next record
    ]


def on_sighup(actions: list[Callable[[], None]]) -> None:
    """Run SIGHUP's actions; one that raises is logged and the others still run."""
    log.info("SIGHUP: %s", ", ".join(getattr(a, "__name__", repr(a)) for a in actions))
    for action in actions:
        try:
            action()
        except Exception:
            log.exception("SIGHUP: %r failed", action)


_early_sighup = False


def _remember_sighup(signum, frame) -> None:
    global _early_sighup
    _early_sighup = True


def hold_sighup() -> None:
    """From here until the event loop takes SIGHUP over, a SIGHUP (logrotate's, while the shim
    starts) is remembered and acted on then, instead of ending the process."""
    global _early_sighup
    _early_sighup = False
    signal.signal(signal.SIGHUP, _remember_sighup)


async def _serve(service, status: str = "", config_path: str | None = None) -> int:
    global _early_sighup
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hup = asyncio.Event()  # set by SIGHUP; the config file is read again by _on_sighup

    def reload_config() -> None:
        hup.set()

    actions = sighup_actions(service) + [reload_config]
    loop.add_signal_handler(signal.SIGHUP, on_sighup, actions)
    reloads = asyncio.ensure_future(_on_sighup(hup, service, config_path))
    if _early_sighup:
        _early_sighup = False
        on_sighup(actions)
    try:
        await service.start()
    except (OSError, ValueError) as e:  # what the settings' checks could not foresee (a live socket there)
        print(f"memqos-shim: cannot start: {e}", file=sys.stderr)
        reloads.cancel()
        try:
            await service.stop()
        except Exception:  # noqa: BLE001 - stopping what did start, best effort
            log.debug("stopping after a failed start", exc_info=True)
        return 1
    sd_notify(f"READY=1\nSTATUS={status or f'serving on {service.cfg.listen}'}")
    await stop.wait()
    log.info("stopping")
    sd_notify("STOPPING=1")
    reloads.cancel()
    await service.stop()
    return 0


async def _on_sighup(hup: asyncio.Event, service, config_path: str | None) -> None:
    """Each SIGHUP: the config file's mode applied (shim.app.reload), in a worker thread so
    that the event loop never waits for the file."""
    from shim.app.reload import reload_mode

    while True:
        await hup.wait()
        hup.clear()
        try:
            await asyncio.to_thread(reload_mode, service, config_path)
        except Exception:  # noqa: BLE001 - a reload never stops the shim
            log.exception("SIGHUP: reload failed; the running settings are kept")


def sd_notify(state: str) -> bool:
    """Tell systemd (``Type=notify``: $NOTIFY_SOCKET) the service's state: READY=1 once the
    socket serves, so that a kubelet ordered after the shim starts only then. Without
    $NOTIFY_SOCKET nothing is sent; a failure is logged, never fatal."""
    import socket

    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr[0] == "@":  # an abstract socket
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd (%s): %s", addr.replace("\0", "@"), e)
        return False


# -- wiring --------------------------------------------------------------------
#: the settings only one front end uses: the other has no flag for them (and leaves them out of
#: its --help and its list of tuning keys); a config file may still carry them for both
ONLY = {
    "serve": frozenset({"listen", "upstream", "socket-group", "socket-mode", "record", "record-max-bytes",
                        "record-keep", "record-methods", "max-connections", "max-connections-per-peer",
                        "finish-max-pending",
                        "h2-max-header-block", "h2-max-continuations", "h2-max-frame-size",
                        "h2-max-concurrent-streams", "h2-reset-rate", "h2-reset-burst", "h2-preface-timeout",
                        "h2-idle-timeout"}),
    "nri": frozenset({"nri-socket", "nri-index", "health-file", "nri-confirm", "nri-confirm-window",
                      "nri-confirm-queue"}),
}


def front_end_options(front: str):
    """The options of OPTIONS that the front end ``front`` ("serve" or "nri") uses."""
    other = ONLY["nri" if front == "serve" else "serve"]
    return tuple(o for o in OPTIONS if o.name not in other)


def register(sub) -> None:
    """``serve`` and ``nri`` on the command line's subcommands (``shim.cli.main``)."""
    serve_options, nri_options = front_end_options("serve"), front_end_options("nri")
    serve = sub.add_parser("serve", help="run the CRI proxy", epilog=file_only_note(serve_options))
    add_arguments(serve, serve_options)
    serve.set_defaults(func=cmd_serve)

    nri = sub.add_parser("nri", help="run as an NRI plugin of containerd / CRI-O (no kubelet change)",
                         epilog=file_only_note(nri_options))
    add_arguments(nri, nri_options)
    nri.set_defaults(func=cmd_nri)
