"""The kubelet's checks: its configuration against the shim's policy, and the runtime endpoint it uses."""
from __future__ import annotations

import os

from shim.decision import Policy
from shim.tools.doctor.common import ENDPOINT_FLAG, FAIL, PASS, WARN, CheckBase, Result, read_text


class KubeletChecks(CheckBase):
    """Kubelet config, kubelet endpoint."""

    def check_kubelet_config(self) -> list[Result]:
        from shim.node.facts import node_facts, read_mem_total
        from shim.decision.quantity import format_bytes

        path = self.cfg.kubelet_config
        k = self.kubelet
        if not path:
            return [Result("kubelet config", WARN, "not read (--kubelet-config none): defaults are used",
                           ["cgroupfs driver, no reservations, factor 0.9 -- right only if the kubelet has the same"])]
        if not k.source:
            return [Result("kubelet config", WARN, '; '.join(k.problems) or f"{path}: not read", [
                "the shim then assumes the cgroupfs driver, no kubeReserved/systemReserved and factor 0.9;",
                "point --kubelet-config at the kubelet's --config file"])]
        out = []
        gate = {True: "on", False: "off", None: "not set (off)"}[k.memory_qos_gate]
        summary = (f"{path}: cgroupDriver {k.cgroup_driver}, kubeReserved {format_bytes(k.kube_reserved)}, "
                   f"systemReserved {format_bytes(k.system_reserved)}, memoryThrottlingFactor "
                   f"{k.memory_throttling_factor if k.memory_throttling_factor is not None else 'unset'}, "
                   f"MemoryQoS gate {gate}")
        out.append(Result("kubelet config", WARN if k.problems else PASS, summary, list(k.problems)))
        # cgroup driver: what the kubelet says against what is on disk
        on_disk, driver = self._driver()
        if on_disk is None:
            out.append(Result("cgroup driver", WARN, f"kubelet: {k.cgroup_driver}; no kubepods cgroup under "
                                                     f"{self.cfg.cgroup_root} to compare with (kubelet not started?)"))
        elif on_disk != k.cgroup_driver:
            out.append(Result("cgroup driver", FAIL, f"the kubelet config says {k.cgroup_driver}, the cgroup tree "
                                                     f"is laid out by {on_disk}", [
                "the shim and the reconciler would look for pods in the wrong place; is --kubelet-config the file",
                "the kubelet really reads?"]))
        else:
            out.append(Result("cgroup driver", PASS, f"{k.cgroup_driver}, as laid out under {self.cfg.cgroup_root}"))
        if not k.cgroups_per_qos:
            out.append(Result("cgroupsPerQOS", WARN, "false: no QoS cgroups, the reconciler has nothing to protect"))
        from shim.node.kubelet import keys_by_kind

        writes, owners, how = self._ownership()
        if writes.gate and (writes.writes_protection or writes.writes_high):
            out.append(Result("MemoryQoS gate", WARN, f"on in the kubelet ({writes.gate_reason}): it writes its own "
                                                      "memory values", [
                writes.summary(),
                "'ownership' says which values stay the kubelet's and which the shim writes; to let the shim do all,",
                "turn the gate off (featureGates: {MemoryQoS: false}) or unset memoryReservationPolicy and",
                "memoryThrottlingFactor (v1.36+)."]))
        else:
            out.append(Result("MemoryQoS gate", PASS, f"{gate} ({writes.gate_reason}): the kubelet writes no "
                                                      "memory.min / memory.low / memory.high itself"))
        details = [f"kubelet version: {how}", writes.summary()]
        if writes.gate:
            details.append(f"the kubelet writes, by container: {keys_by_kind(writes)}")
        details += [f"assumed: {a}" for a in writes.assumptions]
        details += owners.lines()
        kubelet_side = [w for w, who in owners.owners.items() if who == "kubelet"]
        uses_low = self.cfg.policy in (Policy.SOFT, Policy.TIERED_RESERVATION)
        low_capped = writes.gate and not writes.policy_aware and uses_low
        if low_capped:
            details.append(f"policy {self.cfg.policy.value} under a kubelet that writes memory.min itself (before "
                           "v1.36, gate on): containers get memory.low, but their pods keep memory.low 0, which "
                           "caps it: use policy Hard with this kubelet")
        out.append(Result("ownership", WARN if low_capped or (writes.version is None and writes.assumptions) else PASS,
                          ("kubelet owns " + ", ".join(kubelet_side) if kubelet_side else "the shim owns every value")
                          + f"; shim policy {self.cfg.policy.value}", details))
        # reservations and factor as the shim would use them
        try:
            capacity = read_mem_total(self.cfg.meminfo)
            node = node_facts(capacity, k, page_size=4096, allocatable=self.cfg.node_allocatable, factor=self.cfg.factor)
            from_kubelet = max(0, capacity - k.kube_reserved - k.system_reserved)
            notes = []
            verdict = PASS
            if self.cfg.node_allocatable is not None and self.cfg.node_allocatable != from_kubelet:
                verdict = WARN
                notes.append(f"--node-allocatable {format_bytes(self.cfg.node_allocatable)} differs from MemTotal - "
                             f"kubeReserved - systemReserved = {format_bytes(from_kubelet)} (the kubelet's value)")
            f = self.cfg.factor
            if isinstance(f, float) and k.memory_throttling_factor is not None and f != k.memory_throttling_factor:
                verdict = WARN
                notes.append(f"--factor {f} differs from the kubelet's memoryThrottlingFactor {k.memory_throttling_factor}")
            out.append(Result("reservations", verdict,
                              f"allocatable {format_bytes(node.allocatable)} of {format_bytes(capacity)}, "
                              f"factor {node.factor if node.factor is not None else 'none'}", notes))
        except (OSError, ValueError) as e:
            out.append(Result("reservations", FAIL, f"cannot read MemTotal from {self.cfg.meminfo}: {e}"))
        return out

    def _kubelet_processes(self) -> list[list[str]]:
        procs = []
        try:
            names = os.listdir(self.env.proc)
        except OSError:
            return procs
        for pid in names:
            if not pid.isdigit():
                continue
            comm = (read_text(os.path.join(self.env.proc, pid, "comm"), 256) or "").strip()
            if comm != "kubelet":
                continue
            raw = read_text(os.path.join(self.env.proc, pid, "cmdline")) or ""
            procs.append([a for a in raw.split("\x00") if a])
        return procs

    @staticmethod
    def _flag(args: list[str], flag: str) -> str | None:
        for i, a in enumerate(args):
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
            if a == flag and i + 1 < len(args):
                return args[i + 1]
        return None

    def discover_endpoint(self) -> tuple[str | None, str]:
        """(endpoint, where it was found)."""
        for args in self._kubelet_processes():
            ep = self._flag(args, "--container-runtime-endpoint")
            if ep:
                return ep, "the running kubelet's command line"
            cfg_path = self._flag(args, "--config")
            if cfg_path:
                ep = self._endpoint_in_config(cfg_path)
                if ep:
                    return ep, f"containerRuntimeEndpoint in {cfg_path} (the running kubelet's --config)"
            return None, "the running kubelet's command line (no --container-runtime-endpoint: containerd's default)"
        for f in self.env.kubelet_env_files:
            m = ENDPOINT_FLAG.search(read_text(f) or "")
            if m:
                return m.group(1), f
        for d in self.env.kubelet_unit_dirs:
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for n in names:
                m = ENDPOINT_FLAG.search(read_text(os.path.join(d, n)) or "")
                if m:
                    return m.group(1), os.path.join(d, n)
        if self.cfg.kubelet_config:
            ep = self._endpoint_in_config(self.cfg.kubelet_config)
            if ep:
                return ep, f"containerRuntimeEndpoint in {self.cfg.kubelet_config}"
        return None, ""

    @staticmethod
    def _endpoint_in_config(path: str) -> str | None:
        import yaml

        try:
            doc = yaml.safe_load(read_text(path) or "")
        except yaml.YAMLError:
            return None
        if isinstance(doc, dict) and isinstance(doc.get("containerRuntimeEndpoint"), str):
            return doc["containerRuntimeEndpoint"]
        return None

    def check_kubelet_endpoint(self) -> Result:
        from shim.transport.endpoints import socket_path

        name = "kubelet endpoint"
        ep, where = self.discover_endpoint()
        listen = socket_path(self.cfg.listen)
        if ep is None:
            if where:
                return Result(name, FAIL, f"{where}", [
                    f"the kubelet talks to containerd directly; set --container-runtime-endpoint=unix://{listen}"])
            return Result(name, WARN, "not discoverable: no kubelet process, no --container-runtime-endpoint in "
                                      f"{', '.join(self.env.kubelet_env_files)} or the kubelet's unit drop-ins, no "
                                      "containerRuntimeEndpoint in the kubelet config", [
                f"make sure the kubelet runs with --container-runtime-endpoint=unix://{listen}"])
        try:
            path = socket_path(ep)
        except ValueError as e:
            return Result(name, FAIL, f"{ep!r} (from {where}) is not a unix socket endpoint: {e}")
        if os.path.realpath(path) == os.path.realpath(listen):
            return Result(name, PASS, f"{ep} (from {where}) is the shim's socket")
        try:
            upstream = socket_path(self.cfg.upstream)
        except ValueError:
            upstream = None
        if upstream and os.path.realpath(path) == os.path.realpath(upstream):
            return Result(name, FAIL, f"{ep} (from {where}) is the runtime's own socket: the shim sees nothing", [
                f"set --container-runtime-endpoint=unix://{listen} and restart the kubelet"])
        return Result(name, FAIL, f"{ep} (from {where}) is neither the shim's socket ({listen}) nor the upstream")
