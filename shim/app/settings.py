"""The resolved settings of memqos-shim: one typed field per option of the table
shim.app.config.OPTIONS, with the table's default. `Config()` is every default;
`dataclasses.replace(cfg, reclaim=True)` makes a variant; shim.app.config.resolve() makes one
from flags and the YAML file.

The fields between the two "generated" lines are written by scripts/gen-config from OPTIONS
in shim/app/config.py: do not edit them; change the table and run scripts/gen-config
(tests/test_config.py fails when they are stale). The rest of this file is written by hand.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

from shim.decision import Policy
from shim.decision.classes import ContainerClass


def _all_default() -> Mapping[str, str]:
    return MappingProxyType(dict.fromkeys(FIELDS, "default"))


@dataclass(frozen=True, slots=True)
class Config:
    """Settings of the shim; attribute names use underscores (cfg.node_allocatable)."""

    # -- fields generated from OPTIONS by scripts/gen-config: begin
    #: --mode: enforce (rewrite calls, write cgroup files) or observe (decide, audit and count
    #: exactly as enforce would, but forward every call unchanged and write no cgroup file); the
    #: config file's mode is applied again on SIGHUP, without a restart
    mode: str = "enforce"
    #: --listen: socket the kubelet connects to (unix:///path or /path)
    listen: str = "unix:///run/memqos-shim/memqos-shim.sock"
    #: --upstream: the runtime's CRI socket (containerd or CRI-O)
    upstream: str = "unix:///run/containerd/containerd.sock"
    #: --kubelet-config: KubeletConfiguration file to read reservations, cgroup driver and factor
    #: from; 'none' to skip
    kubelet_config: str | None = "/var/lib/kubelet/config.yaml"
    #: --kubelet-version: the kubelet's version (e.g. 1.37), for what it writes itself (MemoryQoS
    #: defaults changed in 1.36 and 1.37); 'auto': run `kubelet --version` (the running kubelet's
    #: executable, else the one on PATH) once at start-up; 'unknown': assume the conservative case
    kubelet_version: str = "auto"
    #: --cgroup-root: where the cgroup v2 hierarchy is mounted
    cgroup_root: str = "/sys/fs/cgroup"
    #: --node-allocatable: node allocatable memory (quantity); default: MemTotal - kubeReserved -
    #: systemReserved
    node_allocatable: int | None = None
    #: --factor: memory throttling factor in (0, 1] for memory.high, or 'none'; default: the
    #: kubelet's memoryThrottlingFactor when its config sets one, else 0.9
    factor: float | str | None = "auto"
    #: --policy: protection policy, named like the kubelet's memoryReservationPolicy: Hard
    #: (memory.min = request for every pod and container with one), Soft (memory.low = request for
    #: all), TieredReservation (Guaranteed: memory.min, Burstable: memory.low), None (no
    #: memory.min/memory.low); any case; a container's memory.min stays protection-headroom under
    #: its limit
    policy: Policy = Policy.HARD
    #: protection-headroom-ratio (config file only): a container's memory.min is at most its limit
    #: minus max(limit x this, protection-headroom-min), so a pod at its memory.max can reclaim its
    #: own page cache instead of being OOM-killed (memory.low then carries the request); in [0, 1)
    protection_headroom_ratio: float = 0.1
    #: protection-headroom-min (config file only): the headroom under a container's limit is at
    #: least this (quantity)
    protection_headroom_min: int = 8 * 1024 * 1024
    #: correct-kubelet-min (config file only): where the kubelet owns a container's memory.min
    #: (v1.36+, gate on, a memoryReservationPolicy) and sends one, lower it under the limit by the
    #: protection-headroom rule (never raised; the kubelet's memory.low and memory.high untouched);
    #: false forwards the kubelet's value as sent
    correct_kubelet_min: bool = False
    #: classes (config file only): memory QoS classes a pod may ask for (annotation memqos.io/class,
    #: or memqos.io/class.CONTAINER for one container): a map of class name -> the settings it
    #: changes, named as these keys: policy, factor (or none), protection-headroom-ratio,
    #: protection-headroom-min, guard-action, reclaim, swap; a setting a class leaves out is the
    #: node's (docs/configuration.md, "Classes")
    classes: tuple[ContainerClass, ...] | None = None
    #: namespace-classes (config file only): the classes each namespace's pods may use: a map of
    #: namespace ('*': every namespace) -> list of class names; a namespace not named may use none,
    #: and its annotations get the node's settings
    namespace_classes: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    #: --audit-log: audit log file (JSON lines), '-' for stdout, 'none' to discard; a file is
    #: reopened on SIGHUP (logrotate's create mode)
    audit_log: str | None = "-"
    #: audit-max-bytes (config file only): rotate the audit log file before a record would push it
    #: past this size (quantity; FILE -> FILE.1 -> ..., audit-keep files kept, no record split); 0:
    #: never by size, for logrotate (docs/audit-files.md)
    audit_max_bytes: int = 64 * 1024 * 1024
    #: audit-keep (config file only): rotated audit log files kept: FILE.1 ... FILE.N, the oldest
    #: deleted; 0: the file starts over
    audit_keep: int = 5
    #: finish-max-pending (config file only): finished calls whose work after the answer (audit
    #: record, recording, reconciler event, CRI metrics) may wait at once for the call-finisher
    #: thread, which takes them in batches; beyond it a call's work is dropped and counted
    #: (memqos_finish_calls_dropped_total)
    finish_max_pending: int = 10000
    #: --page-size: page size for rounding memory.high, a power of two from 4096 to 65536; default:
    #: the system's
    page_size: int | None = None
    #: --socket-group: group allowed to use the socket (mode becomes 0660)
    socket_group: str | None = None
    #: max-connections (config file only): connections the relay serves at once (the kubelet keeps
    #: one or two, crictl and doctor add one each while they run); at the limit the idle connection
    #: quiet longest (no open stream; of the process holding the most connections first) is sent
    #: GOAWAY and closed for the new one, which is refused only when every open connection has a
    #: call in flight; counted in memqos_transport_connections_shed_total
    max_connections: int = 128
    #: max-connections-per-peer (config file only): connections the relay serves at once from one
    #: process (its pid, from the socket's peer credentials); beyond it that process's idle
    #: connection quiet longest is sent GOAWAY and closed for its new one, which is refused only
    #: when all of that process's connections have a call in flight
    max_connections_per_peer: int = 64
    #: socket-mode (config file only): socket mode (octal); default 0600, or 0660 with --socket-
    #: group
    socket_mode: int | None = None
    #: h2-max-header-block (config file only): relay: largest header block (HEADERS + CONTINUATION)
    #: a kubelet connection may send, advertised as SETTINGS_MAX_HEADER_LIST_SIZE; beyond it GOAWAY
    #: ENHANCE_YOUR_CALM and the connection is closed
    h2_max_header_block: int = 1 * 1024 * 1024
    #: h2-max-continuations (config file only): relay: most CONTINUATION frames in one header block;
    #: beyond it GOAWAY ENHANCE_YOUR_CALM
    h2_max_continuations: int = 128
    #: h2-max-frame-size (config file only): relay: largest frame a client may send, at most what
    #: the runtime advertises (SETTINGS_MAX_FRAME_SIZE is lowered to it on the way to the client); a
    #: larger one is GOAWAY FRAME_SIZE_ERROR
    h2_max_frame_size: int = 16384
    #: h2-max-concurrent-streams (config file only): relay: open streams per connection (advertised
    #: as SETTINGS_MAX_CONCURRENT_STREAMS); a stream beyond it is refused with RST_STREAM
    #: REFUSED_STREAM
    h2_max_concurrent_streams: int = 1000
    #: h2-reset-rate (config file only): relay: streams a client may reset per second (rapid reset,
    #: CVE-2023-44487), over a burst of h2-reset-burst; beyond it GOAWAY ENHANCE_YOUR_CALM
    h2_reset_rate: float = 200.0
    #: h2-reset-burst (config file only): relay: resets allowed at once before h2-reset-rate counts
    h2_reset_burst: int = 400
    #: h2-preface-timeout (config file only): relay: seconds a new connection has to send the HTTP/2
    #: preface before it is closed
    h2_preface_timeout: float = 10.0
    #: h2-idle-timeout (config file only): relay: close a connection without an open stream or a
    #: byte either way for this many seconds (GOAWAY first); 0: never (the kubelet keeps one long-
    #: lived connection)
    h2_idle_timeout: float = 0.0
    #: --meminfo: where MemTotal is read from
    meminfo: str = "/proc/meminfo"
    #: --log-level: debug, info, warning or error
    log_level: str = "info"
    #: --record: record every finished CRI call to FILE in the cri-trace format (request as the
    #: kubelet sent it, forwarded bytes when rewritten, responses, code, timing), reopened on
    #: SIGHUP; default: off
    record: str | None = None
    #: record-max-bytes (config file only): rotate the record file before it grows past this size
    #: (quantity)
    record_max_bytes: int = 64 * 1024 * 1024
    #: record-keep (config file only): rotated record files kept: FILE.1 ... FILE.N
    record_keep: int = 3
    #: record-methods (config file only): record only methods whose full path matches REGEX
    #: (re.search); default: every method except the high-volume polling calls (ListContainerStats,
    #: ListPodSandboxStats, ContainerStats, PodSandboxStats, ListContainers, ListPodSandbox,
    #: ContainerStatus, PodSandboxStatus, ImageFsInfo, Status, Version, ListImages, ImageStatus);
    #: 'all' or '.' records every call
    record_methods: str | None = None
    #: --reconcile: write pod, QoS-class and node (kubepods, reserved) memory.min/memory.low from a
    #: side thread; false leaves those cgroups alone
    reconcile: bool = True
    #: --resync-interval: seconds between resyncs with the runtime that recompute pod/QoS/node
    #: values and repair drift
    resync_interval: float = 30.0
    #: --systemd-writes: how pod/QoS/node values are written: dbus (systemd's SetUnitProperties
    #: MemoryMin/MemoryLow on the slice units, runtime only, called on the system bus
    #: ($DBUS_SYSTEM_BUS_ADDRESS, else /run/dbus/system_bus_socket), so systemd keeps them across
    #: daemon-reload and its own property changes), cgroupfs (directly to the files), auto (dbus
    #: when the cgroup driver is systemd, systemd is PID 1 and cgroup-root is /sys/fs/cgroup, else
    #: cgroupfs)
    systemd_writes: str = "auto"
    #: --metrics-address: serve Prometheus metrics on HOST:PORT (a bare PORT means 127.0.0.1:PORT);
    #: default: off
    metrics_address: str | None = None
    #: --health-file: heartbeat file for exec probes (`memqos-shim health --file PATH`): the front
    #: end rewrites it every few seconds with its state; default: none
    health_file: str | None = None
    #: --nri-socket: `memqos-shim nri`: the runtime's NRI socket the plugin connects to (ignored
    #: when the runtime starts the plugin itself and passes NRI_PLUGIN_SOCKET)
    nri_socket: str = "/var/run/nri/nri.sock"
    #: --nri-index: `memqos-shim nri`: the plugin's index 0..99 (registered as two digits,
    #: `50-memqos`); the runtime calls plugins in ascending index order. 50 runs after plugins that
    #: pin themselves first (koordlet: 00) and before nri-plugins' default 90; memqos sets only
    #: memory.* unified keys, which no other plugin may set on the same container anyway
    nri_index: int = 50
    #: --nri-confirm: `memqos-shim nri`: after each adjustment and Synchronize, read the container's
    #: memory.min / memory.low / memory.high in its cgroup (a side thread) and, where the value
    #: decided did not land (a runtime that only updates the stored spec of a container not yet
    #: running, an answer the runtime dropped), write it (never lowering memory.min / memory.low),
    #: or report it (audit and count only), or off
    nri_confirm: str = "write"
    #: nri-confirm-window (config file only): `memqos-shim nri`: seconds a container's values are
    #: waited for (its cgroup must appear, i.e. the container be created) before the confirmation
    #: gives up
    nri_confirm_window: float = 60.0
    #: nri-confirm-queue (config file only): `memqos-shim nri`: containers waiting for confirmation
    #: at most; beyond, a confirmation is dropped and counted
    nri_confirm_queue: int = 4096
    #: --monitor-interval: seconds between samples of every managed container's memory.* files
    #: (metrics and the memory.high guard; read in a side thread, never on the CRI path); 0 turns
    #: sampling and the guard off
    monitor_interval: float = 5.0
    #: --guard-action: what the memory.high guard does when a container crawls at memory.high: relax
    #: (write max to its memory.high until it is calm again) or none (audit and count only)
    guard_action: str = "relax"
    #: guard-threshold (config file only): PSI memory.pressure 'full' avg10 (percent) at or above
    #: which a container at memory.high counts as crawling
    guard_threshold: float = 40.0
    #: guard-window (config file only): seconds the crawl must last before the guard acts
    guard_window: float = 30.0
    #: guard-cooldown (config file only): seconds a relaxed container must stay calm before its
    #: computed memory.high is restored
    guard_cooldown: float = 300.0
    #: guard-state (config file only): file that keeps the guard's open episodes (relaxed containers
    #: and the memory.high to restore) so a restarted shim resumes them; 'auto': guard-episodes.json
    #: next to the --listen socket; 'none': in memory only (a restart leaves relaxed containers at
    #: max)
    guard_state: str | None = "auto"
    #: --reclaim: proactive reclaim: write to a Burstable container's memory.reclaim (kernel >=
    #: 5.19) from the monitor when memory.current comes within the headroom of memory.high, so that
    #: its clean page cache is reclaimed before the kernel throttles it at memory.high; needs
    #: --monitor-interval > 0
    reclaim: bool = False
    #: reclaim-headroom (config file only): reclaim once memory.current is within this percentage of
    #: memory.high (down to memory.high minus 1.5 x the headroom)
    reclaim_headroom: float = 10.0
    #: reclaim-headroom-min (config file only): the headroom is at least this (quantity)
    reclaim_headroom_min: int = 8 * 1024 * 1024
    #: reclaim-step (config file only): at most this much per memory.reclaim write (quantity)
    reclaim_step: int = 32 * 1024 * 1024
    #: reclaim-rate (config file only): at most this much reclaim asked per second and container
    #: (quantity; up to 5 s of it saved up)
    reclaim_rate: int = 16 * 1024 * 1024
    #: reclaim-psi-some (config file only): reclaim only while the container's memory.pressure
    #: 'some' avg10 is below this percentage; above it right after a reclaim, back off
    reclaim_psi_some: float = 10.0
    #: reclaim-refault-tolerance (config file only): back off when the container's refaults
    #: (memory.stat workingset_refault_*) grow by more than this between two samples: the cache
    #: being reclaimed is its working set (quantity)
    reclaim_refault_tolerance: int = 1 * 1024 * 1024
    #: reclaim-backoff (config file only): seconds without reclaim for a container after pressure,
    #: refaults or an EAGAIN that freed nothing
    reclaim_backoff: float = 60.0
    #: reclaim-audit-interval (config file only): at most one 'reclaim' audit record per container
    #: per this many seconds (sums of the writes)
    reclaim_audit_interval: float = 60.0
    # -- fields generated from OPTIONS by scripts/gen-config: end

    #: where each value came from: "flag", "file" or "default" (a Config built in code: "default")
    origin: Mapping[str, str] = field(default_factory=_all_default, compare=False, repr=False)
    #: how an error names each setting the operator gave: "--listen" (a flag), or the config
    #: file's path, line and key as written ("c.yaml:3: listen"); absent: not given
    given_as: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    def setting(self, name: str) -> str:
        """The setting ``name`` (listen, socket-mode) as an error names it: the flag, the file's
        path, line and key, else the name."""
        return self.given_as.get(name.replace("-", "_"), name)

    def as_dict(self) -> dict[str, Any]:
        """The values by field name, the policy by its name."""
        values = {name: getattr(self, name) for name in FIELDS}
        return {k: (v.value if isinstance(v, Policy) else v) for k, v in values.items()}


#: the option fields in the table's order (all but origin and given_as)
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Config) if f.name not in ("origin", "given_as"))
