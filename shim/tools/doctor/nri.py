"""The NRI check: is NRI on in the runtime and is its socket reachable (for `memqos-shim nri`)?

Reachable means a unix connect() to the socket succeeds; the doctor then closes at once and
sends nothing. It does not register: a registered plugin joins the runtime's event chain (and
its node-wide lock) and would have to answer Configure and Synchronize within the request
timeout. A connection that never registers is dropped by the runtime when it closes (or after
the registration timeout, 5 s by default), with one log line on the runtime's side and no
effect on pods. Proxy mode does not need NRI, so a node without it is a WARN, not a FAIL.
"""
from __future__ import annotations

import errno
import os
import socket
import stat

from shim.tools.doctor.common import FAIL, PASS, WARN, CheckBase, Result

NRI_SOCKET = "/var/run/nri/nri.sock"


class NriChecks(CheckBase):
    """NRI socket and the runtimes' NRI switches."""

    def nri_socket_path(self) -> str:
        return self.env.nri_socket or getattr(self.cfg, "nri_socket", None) or NRI_SOCKET

    def _runtime_config(self) -> tuple[list[str], bool | None]:
        """(one line per runtime configuration found, whether they say NRI is on: True, False, or
        None when no file says either way)."""
        from shim.tools.enable_nri import crio_effective, nri_disable, read_toml

        lines: list[str] = []
        on: bool | None = None
        root = self.env.etc_root
        path = os.path.join(root, "etc/containerd/config.toml")
        if os.path.isfile(path):
            try:
                doc = read_toml(path)
            except (OSError, ValueError) as e:
                lines.append(f"containerd: {path} unreadable: {e}")
            else:
                version, disable = doc.get("version", 1), nri_disable(doc)
                if disable is not None:
                    on = disable is False
                    lines.append(f'containerd: {path}: [plugins."io.containerd.nri.v1.nri"] disable = '
                                 f"{str(disable).lower()}")
                elif version == 3:
                    on = True
                    lines.append(f"containerd: {path} (version 3, containerd 2.x): NRI on by default")
                else:
                    lines.append(f"containerd: {path} (version {version}) does not set NRI: off on containerd 1.7 "
                                 "(its default), on for 2.x; 1.6 and older have no NRI")
        try:
            value, read = crio_effective(root)
        except (OSError, ValueError) as e:
            lines.append(f"cri-o: a configuration file is unreadable: {e}")
        else:
            if read:
                if value is None:
                    lines.append(f"cri-o: enable_nri not set ({len(read)} files): off before CRI-O 1.30, on from 1.30")
                else:
                    on = bool(value) if on is None else (on or bool(value))
                    lines.append(f"cri-o: [crio.nri] enable_nri = {str(value).lower()} (last of {len(read)} files)")
        return lines, on

    def nri_key_lines(self) -> list[str]:
        """Which container keys `memqos-shim nri` leaves to the kubelet (NRI ownership: in each
        container, every key the kubelet writes for it, whatever its version), one line."""
        from shim.node.kubelet import ownership

        try:
            writes, _, _ = self._ownership()
            owners = ownership(writes, self.cfg.policy, nri=True)
            keys = owners.kubelet_keys()
            by_kind = owners.owned_by_kind()
        except Exception as e:  # noqa: BLE001 - the kubelet check says what is wrong with its config
            return [f"NRI mode: which keys are the kubelet's is not known ({type(e).__name__}: {e})"[:300]]
        if not keys:
            return ["NRI mode: the kubelet writes no container memory.min / memory.low / memory.high: the plugin "
                    "sets them"]
        return [f"NRI mode: the kubelet's keys, left out of the adjustment of each container it writes them for "
                f"({by_kind}); the plugin sets the others as proxy mode does ({writes.summary()})"]

    def check_nri(self) -> Result:
        name = "nri"
        path = self.nri_socket_path()
        config, on = self._runtime_config()
        config = config + self.nri_key_lines()
        enable = ("to run `memqos-shim nri`: switch NRI on (docs/nri-mode.md, \"Switching NRI on\": "
                  "containerd 1.7 / CRI-O < 1.30) and restart the runtime; proxy mode does not need it")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if on:
                return Result(name, WARN, f"no socket at {path} although the configuration switches NRI on: "
                                          "restart the runtime (or NRI listens elsewhere: --nri-socket)", config)
            return Result(name, WARN, f"NRI not enabled: no socket at {path}", config + [enable])
        except PermissionError:
            return Result(name, WARN, f"cannot look at {path} as uid {os.geteuid()}: run doctor as root", config)
        if not stat.S_ISSOCK(st.st_mode):
            return Result(name, FAIL, f"{path} exists and is not a socket: the runtime cannot listen there", config)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.env.rpc_timeout)
        try:
            s.connect(path)
        except PermissionError:
            return Result(name, WARN, f"{path} is a socket, but uid {os.geteuid()} may not connect: "
                                      "run doctor as root", config)
        except OSError as e:
            why = "nobody accepts on it (a socket left behind by a runtime that stopped, or NRI was switched off)" \
                if e.errno == errno.ECONNREFUSED else f"connect failed: {e.strerror or e}"
            return Result(name, FAIL, f"{path}: {why}", config)
        finally:
            s.close()
        return Result(name, PASS, f"NRI on: {path} accepts connections (connected and closed, not registered)",
                      config)
