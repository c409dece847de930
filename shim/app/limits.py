"""Process limits `serve` sets for itself at start.

Each kubelet connection through the relay costs two file descriptors (the kubelet's side and
the runtime's). systemd starts services with a soft RLIMIT_NOFILE of 1024 unless the unit says
otherwise, which would cap the shim at about 500 connections by accident; the soft limit is
raised to the hard one (the unit's ``LimitNOFILE=``), so that the limits that apply are the
chosen ones: ``max-connections`` and the unit's value.
"""
from __future__ import annotations

import logging
import resource

log = logging.getLogger("memqos-shim")

DESCRIPTORS_PER_CONNECTION = 2
DESCRIPTORS_BESIDE_CONNECTIONS = 64  # the listening socket, logs, audit, metrics, runtime client, ...


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_nofile_limit(max_connections: int | None = None) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (to fs.nr_open when the hard one is
    unlimited); log the values; warn when the result cannot hold ``max_connections``. Returns
    (soft, hard) as they are afterwards. Never raises: a limit it cannot change is logged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("file descriptors: cannot raise the soft RLIMIT_NOFILE from %d to %d: %s", soft, target, e)
        else:
            log.info("file descriptors: soft RLIMIT_NOFILE raised from %d to %d (the hard limit %s)", soft, target,
                     "unlimited, so fs.nr_open" if hard == resource.RLIM_INFINITY else hard)
            soft = target
    else:
        log.info("file descriptors: soft RLIMIT_NOFILE %s, hard %s", _shown(soft), _shown(hard))
    if max_connections is not None and soft != resource.RLIM_INFINITY:
        needed = max_connections * DESCRIPTORS_PER_CONNECTION + DESCRIPTORS_BESIDE_CONNECTIONS
        if soft < needed:
            log.warning("file descriptors: the limit %d holds about %d connections, fewer than max-connections "
                        "%d; beyond it new connections are sent GOAWAY and closed (LimitNOFILE= in the unit "
                        "raises it)", soft, (soft - DESCRIPTORS_BESIDE_CONNECTIONS) // DESCRIPTORS_PER_CONNECTION,
                        max_connections)
    return soft, hard


def _shown(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)
