"""`memqos-shim serve` configuration: flags, each also settable in a YAML file (--config).

Precedence: a flag on the command line > the YAML file > the built-in default.
YAML keys are the setting names, e.g. `node-allocatable: 30Gi` (underscores also accepted);
the settings marked ``where=FILE`` are file keys only, the others flags too. Unknown keys are an
error, so a typo cannot silently leave a node with defaults. An error names the setting as the
user gave it: the flag (``--factor: ...``) or the file, line and key (``config.yaml:3: factor: ...``).

OPTIONS is the one table of the settings: flag name, Python type, default, parser, help.
The resolved settings are a `Config` (shim/app/settings.py): a frozen dataclass with one typed
field per option and the table's default. Its fields are written into that file from OPTIONS
by `scripts/gen-config` (settings_source() below) and committed, rather than built with
dataclasses.make_dataclass at import, so that a reader and a type checker see every field and
its type; tests/test_config.py fails when the committed fields are not what the table makes.

``decides=True``: the setting changes what is decided from the CRI calls; `serve --record` writes it
into the recording's header as JSON, `replay` applies it (shim.app.decides: ``parse`` must take back
the JSON form of its own result); a new marked setting needs no code in either.
"""
from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

from shim.app.config_classes import checked, parse_classes, parse_namespace_classes
from shim.app.config_file import ConfigError, FileValue, read_settings_file
from shim.app.config_parsers import frame_size as _frame_size, nri_index as _nri_index, nri_socket as _nri_socket
from shim.app.config_parsers import octal_mode as _octal_mode
from shim.app.config_parsers import boolean as _bool, factor as _factor, guard_action as _guard_action, \
    headroom_ratio as _headroom_ratio, policy as _policy, quantity as _quantity
from shim.app.settings import FIELDS, Config
from shim.decision import Policy
from shim.decision.quantity import PAGE_SIZE_MAX, PAGE_SIZE_MIN, QuantityError, parse_page_size
from shim.effects.rollout import MODES


def _positive_int(v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not an integer: {v!r}")
    if n <= 0:
        raise ConfigError(f"must be positive: {v!r}")
    return n


def _positive_float(v: Any) -> float:
    try:
        n = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not a number: {v!r}")
    if n <= 0:
        raise ConfigError(f"must be positive: {v!r}")
    return n


def _non_negative_int(v: Any) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not an integer: {v!r}")
    if n < 0:
        raise ConfigError(f"must be 0 or more: {v!r}")
    return n


def _regex(v: Any) -> str | None:
    if v is None or str(v).strip().lower() in ("", "default"):
        return None
    text = str(v)
    if text.strip().lower() == "all":
        return "."
    try:
        re.compile(text)
    except re.error as e:
        raise ConfigError(f"not a regular expression: {v!r} ({e})")
    return text


def _metrics_address(v: Any) -> str | None:
    """'HOST:PORT', '[v6]:PORT' or a bare PORT (127.0.0.1); 'none' or empty: off."""
    if v is None or str(v).strip().lower() in ("", "none", "off"):
        return None
    text = str(v).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT (e.g. 127.0.0.1:9808), a port, or 'none', not {v!r}")
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


def _non_negative_float(v: Any) -> float:
    try:
        n = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"not a number: {v!r}")
    if not n >= 0:
        raise ConfigError(f"must be 0 or more: {v!r}")
    return n


def _percent(v: Any) -> float:
    text = str(v).strip().rstrip("%")
    try:
        n = float(text)
    except ValueError:
        raise ConfigError(f"not a percentage: {v!r}")
    if not 0 < n <= 100:
        raise ConfigError(f"must be in (0, 100]: {v!r}")
    return n


def _mode(v: Any) -> str:
    t = str(v).strip().lower()
    if t not in MODES:
        raise ConfigError(f"mode must be one of {list(MODES)}, not {v!r}")
    return t


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(v: Any) -> str:
    t = str(v).strip().lower()
    if t not in LOG_LEVELS:
        raise ConfigError(f"log level must be one of {list(LOG_LEVELS)}, not {v!r}")
    return t


NRI_CONFIRM = ("write", "report", "off")


def _nri_confirm(v: Any) -> str:
    t = str(v).strip().lower()
    if t not in NRI_CONFIRM:
        raise ConfigError(f"nri-confirm must be one of {list(NRI_CONFIRM)}, not {v!r}")
    return t


SYSTEMD_WRITES = ("auto", "dbus", "cgroupfs")


def _systemd_writes(v: Any) -> str:
    t = str(v).strip().lower()
    if t not in SYSTEMD_WRITES:
        raise ConfigError(f"systemd-writes must be one of {list(SYSTEMD_WRITES)}, not {v!r}")
    return t


def _kubelet_version(v: Any) -> str:
    if isinstance(v, float):  # YAML reads 1.30 as the number 1.3
        raise ConfigError(f"write the kubelet version as a string (e.g. '1.30'), not the number {v!r}")
    text = str(v).strip()
    if text.lower() in ("auto", "unknown"):
        return text.lower()
    if not re.fullmatch(r"v?\d+\.\d+(\.\d+)?([-+].*)?", text):
        raise ConfigError(f"kubelet version must be like 1.37 or v1.37.2, 'auto' or 'unknown', not {v!r}")
    return text


def _optional_path(v: Any) -> str | None:
    if v is None or str(v).strip().lower() in ("", "none"):
        return None
    return str(v)


def _record_path(v: Any) -> str | None:
    path = _optional_path(v)
    if path is not None and path.endswith((".gz", ".xz")):
        raise ConfigError(f"the recorder writes plain JSON lines; {path!r} would be read back as compressed. "
                          "Record to a .jsonl file and compress it when it is finished (xz -k FILE)")
    return path


FLAG, FILE = "flag", "file"  # Option.where: a flag of serve and nri as well as a config key, or a config key only


@dataclass(frozen=True)
class Option:
    """One setting: the YAML key NAME, the Config field NAME_WITH_UNDERSCORES and, unless it is
    a tuning knob kept in the config file only (``where=FILE``), the flag --NAME."""

    name: str  # flag name without --
    type: str  # the Config field's type annotation, e.g. "float | None"
    default: Any
    parse: Callable[[Any], Any]
    help: str
    metavar: str | None = None
    where: str = FLAG
    file_text: bool = False  # from the config file, parse gets the scalar's text as written, not YAML's reading
    decides: bool = False  # recorded in a recording's header and applied by replay (module docstring)


OPTIONS: tuple[Option, ...] = (
    Option("mode", "str", "enforce", _mode,
           "enforce (rewrite calls, write cgroup files) or observe (decide, audit and count exactly as enforce "
           "would, but forward every call unchanged and write no cgroup file); the config file's mode is applied "
           "again on SIGHUP, without a restart", decides=True),
    Option("listen", "str", "unix:///run/memqos-shim/memqos-shim.sock", str,
           "socket the kubelet connects to (unix:///path or /path)"),
    Option("upstream", "str", "unix:///run/containerd/containerd.sock", str,
           "the runtime's CRI socket (containerd or CRI-O)"),
    Option("kubelet-config", "str | None", "/var/lib/kubelet/config.yaml", _optional_path,
           "KubeletConfiguration file to read reservations, cgroup driver and factor from; 'none' to skip"),
    Option("kubelet-version", "str", "auto", _kubelet_version,
           "the kubelet's version (e.g. 1.37), for what it writes itself (MemoryQoS defaults changed in 1.36 "
           "and 1.37); 'auto': run `kubelet --version` (the running kubelet's executable, else the one on PATH) "
           "once at start-up; 'unknown': assume the conservative case", "V", decides=True),
    Option("cgroup-root", "str", "/sys/fs/cgroup", str, "where the cgroup v2 hierarchy is mounted"),
    Option("node-allocatable", "int | None", None, _quantity,
           "node allocatable memory (quantity); default: MemTotal - kubeReserved - systemReserved", "Q", decides=True),
    Option("factor", "float | str | None", "auto", _factor,
           "memory throttling factor in (0, 1] for memory.high, or 'none'; default: the kubelet's "
           "memoryThrottlingFactor when its config sets one, else 0.9", "F", decides=True),
    Option("policy", "Policy", Policy.HARD, _policy,
           "protection policy, named like the kubelet's memoryReservationPolicy: Hard (memory.min = request "
           "for every pod and container with one), Soft (memory.low = request for all), TieredReservation "
           "(Guaranteed: memory.min, Burstable: memory.low), None (no memory.min/memory.low); any case; a "
           "container's memory.min stays protection-headroom under its limit", decides=True),
    Option("protection-headroom-ratio", "float", 0.1, _headroom_ratio,
           "a container's memory.min is at most its limit minus max(limit x this, protection-headroom-min), "
           "so a pod at its memory.max can reclaim its own page cache instead of being OOM-killed (memory.low "
           "then carries the request); in [0, 1)", "R", where=FILE, decides=True),
    Option("protection-headroom-min", "int", 8 * 1024 * 1024, _quantity,
           "the headroom under a container's limit is at least this (quantity)", "Q", where=FILE, decides=True),
    Option("correct-kubelet-min", "bool", False, _bool,
           "where the kubelet owns a container's memory.min (v1.36+, gate on, a memoryReservationPolicy) and "
           "sends one, lower it under the limit by the protection-headroom rule (never raised; the kubelet's "
           "memory.low and memory.high untouched); false forwards the kubelet's value as sent", where=FILE, decides=True),
    Option("classes", "tuple[ContainerClass, ...] | None", None, parse_classes,
           "memory QoS classes a pod may ask for (annotation memqos.io/class, or memqos.io/class.CONTAINER for one "
           "container): a map of class name -> the settings it changes, named as these keys: policy, factor (or "
           "none), protection-headroom-ratio, protection-headroom-min, guard-action, reclaim, swap; a setting a "
           "class leaves out is the node's (docs/configuration.md, \"Classes\")", "MAP", where=FILE),
    Option("namespace-classes", "tuple[tuple[str, tuple[str, ...]], ...] | None", None, parse_namespace_classes,
           "the classes each namespace's pods may use: a map of namespace ('*': every namespace) -> list of "
           "class names; a namespace not named may use none, and its annotations get the node's settings", "MAP",
           where=FILE),
    Option("audit-log", "str | None", "-", _optional_path,
           "audit log file (JSON lines), '-' for stdout, 'none' to discard; a file is reopened on SIGHUP "
           "(logrotate's create mode)"),
    Option("audit-max-bytes", "int", 64 * 1024 * 1024, _quantity,
           "rotate the audit log file before a record would push it past this size (quantity; FILE -> "
           "FILE.1 -> ..., audit-keep files kept, no record split); 0: never by size, for logrotate "
           "(docs/audit-files.md)", "Q", where=FILE),
    Option("audit-keep", "int", 5, _non_negative_int,
           "rotated audit log files kept: FILE.1 ... FILE.N, the oldest deleted; 0: the file starts over", "N", where=FILE),
    Option("finish-max-pending", "int", 10000, _positive_int,
           "finished calls whose work after the answer (audit record, recording, reconciler event, CRI metrics) may "
           "wait at once for the call-finisher thread, which takes them in batches; beyond it a call's work is "
           "dropped and counted (memqos_finish_calls_dropped_total)", "N", where=FILE),
    Option("page-size", "int | None", None, parse_page_size,
           f"page size for rounding memory.high, a power of two from {PAGE_SIZE_MIN} to {PAGE_SIZE_MAX}; "
           "default: the system's", "N", decides=True),
    Option("socket-group", "str | None", None, str, "group allowed to use the socket (mode becomes 0660)", "GROUP"),
    Option("max-connections", "int", 128, _positive_int,
           "connections the relay serves at once (the kubelet keeps one or two, crictl and doctor add one each "
           "while they run); at the limit the idle connection quiet longest (no open stream; of the process "
           "holding the most connections first) is sent GOAWAY and closed for the new one, which is refused only "
           "when every open connection has a call in flight; counted in memqos_transport_connections_shed_total",
           "N", where=FILE),
    Option("max-connections-per-peer", "int", 64, _positive_int,
           "connections the relay serves at once from one process (its pid, from the socket's peer credentials); "
           "beyond it that process's idle connection quiet longest is sent GOAWAY and closed for its new one, "
           "which is refused only when all of that process's connections have a call in flight", "N", where=FILE),
    Option("socket-mode", "int | None", None, _octal_mode,
           "socket mode (octal); default 0600, or 0660 with --socket-group", where=FILE, file_text=True),
    Option("h2-max-header-block", "int", 1024 * 1024, _quantity,
           "relay: largest header block (HEADERS + CONTINUATION) a kubelet connection may send, advertised as "
           "SETTINGS_MAX_HEADER_LIST_SIZE; beyond it GOAWAY ENHANCE_YOUR_CALM and the connection is closed", "Q",
           where=FILE),
    Option("h2-max-continuations", "int", 128, _positive_int,
           "relay: most CONTINUATION frames in one header block; beyond it GOAWAY ENHANCE_YOUR_CALM", "N", where=FILE),
    Option("h2-max-frame-size", "int", 16384, _frame_size,
           "relay: largest frame a client may send, at most what the runtime advertises (SETTINGS_MAX_FRAME_SIZE "
           "is lowered to it on the way to the client); a larger one is GOAWAY FRAME_SIZE_ERROR", "N", where=FILE),
    Option("h2-max-concurrent-streams", "int", 1000, _positive_int,
           "relay: open streams per connection (advertised as SETTINGS_MAX_CONCURRENT_STREAMS); a stream beyond "
           "it is refused with RST_STREAM REFUSED_STREAM", "N", where=FILE),
    Option("h2-reset-rate", "float", 200.0, _positive_float,
           "relay: streams a client may reset per second (rapid reset, CVE-2023-44487), over a burst of "
           "h2-reset-burst; beyond it GOAWAY ENHANCE_YOUR_CALM", "N", where=FILE),
    Option("h2-reset-burst", "int", 400, _positive_int, "relay: resets allowed at once before h2-reset-rate "
           "counts", "N", where=FILE),
    Option("h2-preface-timeout", "float", 10.0, _positive_float,
           "relay: seconds a new connection has to send the HTTP/2 preface before it is closed", "S", where=FILE),
    Option("h2-idle-timeout", "float", 0.0, _non_negative_float,
           "relay: close a connection without an open stream or a byte either way for this many seconds "
           "(GOAWAY first); 0: never (the kubelet keeps one long-lived connection)", "S", where=FILE),
    Option("meminfo", "str", "/proc/meminfo", str, "where MemTotal is read from"),
    Option("log-level", "str", "info", _log_level, "debug, info, warning or error"),
    Option("record", "str | None", None, _record_path,
           "record every finished CRI call to FILE in the cri-trace format (request as the kubelet sent "
           "it, forwarded bytes when rewritten, responses, code, timing), reopened on SIGHUP; default: off", "FILE"),
    Option("record-max-bytes", "int", 64 * 1024 * 1024, _quantity,
           "rotate the record file before it grows past this size (quantity)", "Q", where=FILE),
    Option("record-keep", "int", 3, _non_negative_int, "rotated record files kept: FILE.1 ... FILE.N", "N", where=FILE),
    Option("record-methods", "str | None", None, _regex,
           "record only methods whose full path matches REGEX (re.search); default: every method except "
           "the high-volume polling calls (ListContainerStats, ListPodSandboxStats, ContainerStats, "
           "PodSandboxStats, ListContainers, ListPodSandbox, ContainerStatus, PodSandboxStatus, ImageFsInfo, "
           "Status, Version, ListImages, ImageStatus); 'all' or '.' records every call", "REGEX", where=FILE),
    Option("reconcile", "bool", True, _bool,
           "write pod, QoS-class and node (kubepods, reserved) memory.min/memory.low from a side thread; "
           "false leaves those cgroups alone"),
    Option("resync-interval", "float", 30.0, _positive_float,
           "seconds between resyncs with the runtime that recompute pod/QoS/node values and repair drift", "S"),
    Option("systemd-writes", "str", "auto", _systemd_writes,
           "how pod/QoS/node values are written: dbus (systemd's SetUnitProperties MemoryMin/MemoryLow on the "
           "slice units, runtime only, called on the system bus ($DBUS_SYSTEM_BUS_ADDRESS, else "
           "/run/dbus/system_bus_socket), so systemd keeps them across daemon-reload and its own property "
           "changes), cgroupfs (directly to the files), auto (dbus when the cgroup driver is systemd, systemd is "
           "PID 1 and cgroup-root is /sys/fs/cgroup, else cgroupfs)"),
    Option("metrics-address", "str | None", None, _metrics_address,
           "serve Prometheus metrics on HOST:PORT (a bare PORT means 127.0.0.1:PORT); default: off", "ADDR"),
    Option("health-file", "str | None", None, _optional_path,
           "heartbeat file for exec probes (`memqos-shim health --file PATH`): the front end rewrites it every "
           "few seconds with its state; default: none", "PATH"),
    Option("nri-socket", "str", "/var/run/nri/nri.sock", _nri_socket,
           "`memqos-shim nri`: the runtime's NRI socket the plugin connects to (ignored when the runtime "
           "starts the plugin itself and passes NRI_PLUGIN_SOCKET)", "PATH"),
    Option("nri-index", "int", 50, _nri_index,
           "`memqos-shim nri`: the plugin's index 0..99 (registered as two digits, `50-memqos`); the runtime "
           "calls plugins in ascending index order. 50 runs after plugins that pin themselves first "
           "(koordlet: 00) and before nri-plugins' default 90; memqos sets only memory.* unified keys, "
           "which no other plugin may set on the same container anyway", "N"),
    Option("nri-confirm", "str", "write", _nri_confirm,
           "`memqos-shim nri`: after each adjustment and Synchronize, read the container's memory.min / "
           "memory.low / memory.high in its cgroup (a side thread) and, where the value decided did not land "
           "(a runtime that only updates the stored spec of a container not yet running, an answer the "
           "runtime dropped), write it (never lowering memory.min / memory.low), or report it (audit and "
           "count only), or off"),
    Option("nri-confirm-window", "float", 60.0, _positive_float,
           "`memqos-shim nri`: seconds a container's values are waited for (its cgroup must appear, i.e. "
           "the container be created) before the confirmation gives up", "S", where=FILE),
    Option("nri-confirm-queue", "int", 4096, _positive_int,
           "`memqos-shim nri`: containers waiting for confirmation at most; beyond, a confirmation is dropped "
           "and counted", "N", where=FILE),
    Option("monitor-interval", "float", 5.0, _non_negative_float,
           "seconds between samples of every managed container's memory.* files (metrics and the memory.high "
           "guard; read in a side thread, never on the CRI path); 0 turns sampling and the guard off", "S"),
    Option("guard-action", "str", "relax", _guard_action,
           "what the memory.high guard does when a container crawls at memory.high: relax (write max to its "
           "memory.high until it is calm again) or none (audit and count only)"),
    Option("guard-threshold", "float", 40.0, _percent,
           "PSI memory.pressure 'full' avg10 (percent) at or above which a container at memory.high counts as "
           "crawling", "PCT", where=FILE),
    Option("guard-window", "float", 30.0, _positive_float,
           "seconds the crawl must last before the guard acts", "S", where=FILE),
    Option("guard-cooldown", "float", 300.0, _positive_float,
           "seconds a relaxed container must stay calm before its computed memory.high is restored", "S", where=FILE),
    Option("guard-state", "str | None", "auto", _optional_path,
           "file that keeps the guard's open episodes (relaxed containers and the memory.high to restore) so a "
           "restarted shim resumes them; 'auto': guard-episodes.json next to the --listen socket; 'none': in "
           "memory only (a restart leaves relaxed containers at max)", "FILE", where=FILE),
    Option("reclaim", "bool", False, _bool,
           "proactive reclaim: write to a Burstable container's memory.reclaim (kernel >= 5.19) from the monitor "
           "when memory.current comes within the headroom of memory.high, so that its clean page cache is "
           "reclaimed before the kernel throttles it at memory.high; needs --monitor-interval > 0"),
    Option("reclaim-headroom", "float", 10.0, _percent,
           "reclaim once memory.current is within this percentage of memory.high (down to memory.high minus "
           "1.5 x the headroom)", "PCT", where=FILE),
    Option("reclaim-headroom-min", "int", 8 * 1024 * 1024, _quantity,
           "the headroom is at least this (quantity)", "Q", where=FILE),
    Option("reclaim-step", "int", 32 * 1024 * 1024, _quantity,
           "at most this much per memory.reclaim write (quantity)", "Q", where=FILE),
    Option("reclaim-rate", "int", 16 * 1024 * 1024, _quantity,
           "at most this much reclaim asked per second and container (quantity; up to 5 s of it saved up)", "Q",
           where=FILE),
    Option("reclaim-psi-some", "float", 10.0, _percent,
           "reclaim only while the container's memory.pressure 'some' avg10 is below this percentage; above it "
           "right after a reclaim, back off", "PCT", where=FILE),
    Option("reclaim-refault-tolerance", "int", 1024 * 1024, _quantity,
           "back off when the container's refaults (memory.stat workingset_refault_*) grow by more than this "
           "between two samples: the cache being reclaimed is its working set (quantity)", "Q", where=FILE),
    Option("reclaim-backoff", "float", 60.0, _positive_float,
           "seconds without reclaim for a container after pressure, refaults or an EAGAIN that freed nothing", "S",
           where=FILE),
    Option("reclaim-audit-interval", "float", 60.0, _positive_float,
           "at most one 'reclaim' audit record per container per this many seconds (sums of the writes)", "S",
           where=FILE),
)
_BY_KEY = {o.name: o for o in OPTIONS} | {o.name.replace("-", "_"): o for o in OPTIONS}


def shown_default(o: Option) -> str:
    """The default as --help says it: none, true/false, the Policy's name, or the value."""
    if o.default is None:
        return "none"
    if isinstance(o.default, bool):
        return str(o.default).lower()
    return o.default.value if isinstance(o.default, Policy) else str(o.default)


def option_help(o: Option) -> str:
    """The option's help with its default said once (a help text that says it already is kept)."""
    return o.help if "default:" in o.help else f"{o.help} (default: {shown_default(o)})"


def file_only_note(options: tuple[Option, ...] = OPTIONS) -> str:
    """The epilog naming the settings that are config-file keys only."""
    names = ", ".join(o.name for o in options if o.where == FILE)
    return (f"Tuning settings, in the config file (--config FILE) only: {names}. "
            "--help-settings describes every setting.")


def settings_help(options: tuple[Option, ...] = OPTIONS) -> str:
    """Every setting as a config-file key: what it does, its default, whether it is also a flag."""
    out = ["Settings (YAML keys of --config FILE; 'flag': also --NAME on the command line):", ""]
    for o in options:
        out.append(f"{o.name}: {shown_default(o)}{'  (flag)' if o.where == FLAG else ''}")
        out += textwrap.wrap(o.help, 96, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out)


class _SettingsHelp(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(settings_help() + "\n")
        parser.exit(0)


def add_arguments(parser: argparse.ArgumentParser, options: tuple[Option, ...] = OPTIONS, *,
                  listed: bool = True) -> None:
    """--config and a flag per option that is one (``where=FLAG``); ``listed=False`` keeps the
    flags out of --help (a command that takes serve's settings without repeating them)."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with any of the settings (flags win over it)")
    parser.add_argument("--help-settings", action=_SettingsHelp,
                        help="describe every setting, the config file's tuning keys too, and exit")
    for o in options:
        if o.where == FILE:
            continue
        parser.add_argument(f"--{o.name}", default=None, metavar=o.metavar,
                            help=option_help(o) if listed else argparse.SUPPRESS)


# names a config file may carry that are not settings, with what to say about them
NOT_SETTINGS = {
    "transport": "the HTTP/2 relay is the only transport (remove the line)",
    "max-concurrent-rpcs": "the relay has no per-call cap; its limits are max-connections and the h2-* settings",
    "max-concurrent-streams": "the relay's is h2-max-concurrent-streams",
}


def load_entries(path: str) -> dict[str, FileValue]:
    """The file's settings by name, each with its key as written and its line."""
    names = {key: o.name for key, o in _BY_KEY.items()}
    return read_settings_file(path, names, NOT_SETTINGS)


def _said(o: Option, raw: Any) -> str:
    """How an error names the setting: the file, line and key as written, or the flag."""
    return raw.where if isinstance(raw, FileValue) else f"--{o.name}"


def _parse(o: Option, raw: Any) -> Any:
    """``raw`` (a flag's text, or a FileValue) parsed; a ConfigError names the flag or the
    file, line and key as written."""
    value = raw.text if isinstance(raw, FileValue) and o.file_text and raw.text is not None else \
        raw.value if isinstance(raw, FileValue) else raw
    said = _said(o, raw)
    try:
        return o.parse(value)
    except (ConfigError, QuantityError) as e:
        raise ConfigError(f"{said}: {e}") from None


def resolve(args: argparse.Namespace, options: tuple[Option, ...] = OPTIONS) -> Config:
    from_file = load_entries(args.config) if getattr(args, "config", None) else {}
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    given_as: dict[str, str] = {}
    for o in options:
        attr = o.name.replace("-", "_")
        raw = getattr(args, attr, None)
        if raw is not None:
            where = "flag"
        elif o.name in from_file:
            raw, where = from_file[o.name], "file"
        else:
            continue
        values[attr] = _parse(o, raw)
        origin[attr], given_as[attr] = where, _said(o, raw)
    return checked(Config(**values, origin=MappingProxyType({f: origin.get(f, "default") for f in FIELDS}),
                          given_as=MappingProxyType(given_as)))


def reread(cfg: Config, path: str, options: tuple[Option, ...] = OPTIONS) -> Config:
    """The settings a start would resolve now: ``cfg``'s values that came from flags (flags are
    not read again), over the file at ``path`` as it is now, over the defaults. ConfigError
    for an unreadable file, an unknown key or a bad value, as at start."""
    from_file = load_entries(path)
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    given_as: dict[str, str] = {}
    for o in options:
        attr = o.name.replace("-", "_")
        if cfg.origin.get(attr) == "flag":
            values[attr], origin[attr], given_as[attr] = getattr(cfg, attr), "flag", f"--{o.name}"
        elif o.name in from_file:
            values[attr] = _parse(o, from_file[o.name])
            origin[attr], given_as[attr] = "file", _said(o, from_file[o.name])
    return checked(Config(**values, origin=MappingProxyType({f: origin.get(f, "default") for f in FIELDS}),
                          given_as=MappingProxyType(given_as)))
