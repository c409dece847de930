"""The node's checks: kernel, PSI, cgroup v2 and the memory controller along the kubepods tree."""
from __future__ import annotations

import os

from shim.tools.doctor.common import (
    FAIL,
    MIN_KERNEL_FAIL,
    MIN_KERNEL_WARN,
    PASS,
    WARN,
    CheckBase,
    Result,
    cgroup_mounts,
    kernel_version,
    read_text,
    words,
)


class NodeChecks(CheckBase):
    """Kernel, PSI, cgroup v2, memory controller."""

    # kernel
    def check_kernel(self) -> Result:
        release = self.env.kernel_release()
        v = kernel_version(release)
        if v is None:
            return Result("kernel", WARN, f"cannot parse the kernel release {release!r}")
        if v < MIN_KERNEL_FAIL:
            return Result("kernel", FAIL, f"{release}: older than 4.5, no cgroup v2 memory controller")
        if v < MIN_KERNEL_WARN:
            return Result("kernel", WARN, f"{release}: older than 5.9", [
                "memory.high throttling on kernels before 5.9 is harsher than what the shim's defaults assume",
                "(reference section 4): containers past memory.high crawl worse; consider --factor none or a newer kernel"])
        return Result("kernel", PASS, f"{release} (5.9 or newer)")

    def check_psi(self) -> Result:
        path = os.path.join(self.env.proc, "pressure", "memory")
        text = read_text(path)
        if text is None or "full" not in text:
            return Result("PSI", WARN, f"{path} is not readable: the kernel has no PSI (or was booted with psi=0)", [
                "the memory.high guard cannot see a crawling container and never acts; /metrics has no",
                "memory.pressure series. Boot with psi=1 (CONFIG_PSI)."])
        return Result("PSI", PASS, f"{path} readable: the guard can see memory pressure")


    def check_cgroup_v2(self) -> Result:
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        if is_cgroup_v2(root):
            controllers = " ".join(words(os.path.join(root, "cgroup.controllers")))
            return Result("cgroup v2", PASS, f"{root} is a cgroup v2 hierarchy (controllers: {controllers or 'none'})")
        details = []
        mounts = cgroup_mounts(self.env.proc)
        v1 = sorted({o for mp, t, opts in mounts if t == "cgroup" and mp.startswith(root.rstrip("/") + "/")
                     for o in opts.split(",") if o not in ("rw", "ro", "relatime") and not o.startswith("name=")})
        if v1:
            details.append(f"cgroup v1 hierarchies are mounted under {root}: {', '.join(v1)}")
        for mp, t, _ in mounts:
            if t == "cgroup2":
                ctl = " ".join(words(os.path.join(mp, "cgroup.controllers")))
                mem = "" if "memory" in ctl.split() else " -- no memory controller: it stays with v1"
                details.append(f"a cgroup2 hierarchy is mounted at {mp} (hybrid mode), controllers: {ctl or 'none'}{mem}")
        details += [
            "On cgroup v1 runc rejects `unified`, so the shim forwards every call unchanged: no memory QoS",
            "on this node. Boot with systemd.unified_cgroup_hierarchy=1 (and cgroup_no_v1=all) to switch.",
        ]
        return Result("cgroup v2", FAIL, f"{root} is not a cgroup v2 hierarchy (no cgroup.controllers)", details)

    def check_memory_controller(self) -> Result:
        from shim.node.facts import is_cgroup_v2

        root = self.cfg.cgroup_root
        name = "memory controller"
        if not is_cgroup_v2(root):
            v1 = [mp for mp, t, opts in cgroup_mounts(self.env.proc) if t == "cgroup" and "memory" in opts.split(",")]
            where = f"; the memory controller is on the cgroup v1 hierarchy at {', '.join(v1)}" if v1 else ""
            return Result(name, FAIL, f"no cgroup v2 hierarchy at {root}: no memory.min / memory.high{where}")
        if "memory" not in words(os.path.join(root, "cgroup.controllers")):
            return Result(name, FAIL, f"{root}/cgroup.controllers has no memory controller",
                          ["the memory controller is bound to a cgroup v1 hierarchy; unmount it (cgroup_no_v1=memory)"])
        on_disk, driver = self._driver()
        from shim.effects.layout import CgroupLayout
        from shim.decision import QoSClass

        try:
            layout = CgroupLayout(driver, self.kubelet.cgroup_root)
        except ValueError as e:
            return Result(name, FAIL, str(e))
        chain = [("", "the root")]
        kp = layout.kubepods
        parts = kp.split("/")
        for i in range(1, len(parts) + 1):
            chain.append(("/".join(parts[:i]), "/".join(parts[:i])))
        for q in (QoSClass.BURSTABLE, QoSClass.BESTEFFORT):
            chain.append((layout.qos(q), layout.qos(q)))
        missing, checked, absent = [], [], []
        for rel, label in chain:
            d = os.path.join(root, rel) if rel else root
            if not os.path.isdir(d):
                absent.append(label)
                continue
            checked.append(label)
            if "memory" not in words(os.path.join(d, "cgroup.subtree_control")):
                missing.append(label)
        if missing:
            return Result(name, FAIL, f"memory is not in cgroup.subtree_control of {', '.join(missing)}", [
                "cgroups below those get no memory.min / memory.high files: the shim's values cannot apply.",
                "The kubelet enables it when it creates kubepods; something turned it off (or the kubelet runs",
                "with cgroupsPerQOS=false)."])
        if absent and kp in absent:
            return Result(name, WARN, f"memory enabled at the root; {root}/{kp} does not exist yet "
                                      f"(kubelet not started? driver {driver})")
        return Result(name, PASS, f"memory in cgroup.subtree_control along {', '.join(checked)}")
