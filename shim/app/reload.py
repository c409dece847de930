"""The configuration file read again while the shim runs (SIGHUP): only ``mode`` is applied.

Every other setting is built into the running parts at start (sockets, threads, limits), so a
change to one is logged as needing a restart and otherwise left alone. A file that does not
read, or holds an unknown key or a bad value, changes nothing: the running mode is kept, and
the error is logged and audited. A mode given as the ``--mode`` flag stays (flag > file, as at
start).
"""
from __future__ import annotations

import dataclasses
import logging
from types import MappingProxyType

from shim.app.config import ConfigError, reread
from shim.app.settings import FIELDS

log = logging.getLogger(__name__)


def reload_mode(service, config_path: str | None) -> str:
    """Read ``config_path`` again and apply its ``mode`` to ``service`` (a ``Service`` or an
    ``NriService``); returns the mode in force afterwards. Safe from any thread."""
    running = service.rollout.mode
    if not config_path:
        log.warning("SIGHUP: the shim was started without --config: no file to read, mode stays %s", running)
        return running
    cfg = service.cfg
    try:
        new = reread(cfg, config_path)
    except ConfigError as e:
        log.error("SIGHUP: cannot reload the configuration, mode stays %s: %s", running, e)
        service.audit.emit({"event": "config-reload-error", "config": config_path, "error": str(e)[:500],
                            "mode_kept": running})
        return running
    needs_restart = [name.replace("_", "-") for name in FIELDS
                     if name != "mode" and getattr(new, name) != getattr(cfg, name)]
    if needs_restart:
        log.warning("SIGHUP: %s changed in %s: needs a restart (only mode is applied without one)",
                    ", ".join(needs_restart), config_path)
    if cfg.origin.get("mode") == "flag":
        log.warning("SIGHUP: mode is given by the --mode flag (%s), which the file does not override", cfg.mode)
    service.set_mode(new.mode, f"SIGHUP: {config_path}")
    given_as = {k: v for k, v in cfg.given_as.items() if k != "mode"} | \
        ({"mode": new.given_as["mode"]} if "mode" in new.given_as else {})
    service.cfg = dataclasses.replace(cfg, mode=new.mode,
                                      origin=MappingProxyType({**cfg.origin, "mode": new.origin["mode"]}),
                                      given_as=MappingProxyType(given_as))
    service.audit.emit({"event": "config-reload", "config": config_path, "rollout": new.mode,
                        **({"needs_restart": needs_restart} if needs_restart else {})})
    if not needs_restart and new.mode == running:
        log.info("SIGHUP: %s read again: mode %s, nothing else changed", config_path, new.mode)
    return new.mode
