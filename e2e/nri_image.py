"""The NRI scenario's plugin started from the project's image, the way the DaemonSet's pod runs it
(scripts/e2e-vm --plugin-image DIR, DIR written by scripts/build-image).

The guest has no kubelet: the plugin container of the rendered DaemonSet (DIR/deploy-base.yaml,
`kubectl kustomize deploy/kubernetes/base`) is translated into a `ctr run` of the image imported
into the guest's containerd (namespace memqos-e2e, beside the CRI's k8s.io): the same command,
user, read-only root, dropped capabilities, seccomp profile, memory limit and volume mounts
(hostPath as a bind of the guest's path, the ConfigMap as a directory of its files, emptyDir as
an empty directory). What the scenario changes is said in one place, `TEST_SOURCES` and
`CONFIG_OVERRIDES`: the kubelet config file is the trace's, and the config's audit-log and
meminfo point at two mounts the test adds (the audit the checks read, the trace's node size).
The probes of the manifest are run with `ctr tasks exec` and checked. A change of the manifest
changes what runs here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import yaml

from guest_common import CONTAINERD_SOCK, InfraError, RUN  # noqa: E402
from guest_stack import load_stack  # noqa: E402
from nri_plugin import Plugin

NS = "memqos-e2e"
CID = "memqos-shim-nri"
CONTAINER = "memqos-shim"
AUDIT_DIR = "/var/log/memqos-e2e"
MEMINFO = "/etc/memqos-e2e/meminfo"
# containerd's default capability set (ctr run): `drop: [ALL]` drops each of them
DEFAULT_CAPS = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
UNITS = {"": 1, "k": 1000, "M": 1000 ** 2, "G": 1000 ** 3, "Ki": 1024, "Mi": 1024 ** 2, "Gi": 1024 ** 3}


def quantity(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G|)", str(q))
    if not m:
        raise InfraError(f"memory quantity {q!r} not understood")
    return int(m.group(1)) * UNITS[m.group(2)]


def image_ref(name: str) -> str:
    """The reference the kubelet pulls for a pod's image name (docker.io/library/ for a bare name)."""
    first = name.split("/", 1)[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." in first or ":" in first or first == "localhost":
        return name
    return f"docker.io/{name}"


def translate(docs: list[dict], sources: dict[str, str], overrides: dict, work: str) -> dict:
    """The DaemonSet's plugin container as `ctr run` needs it: image, command, user, security,
    memory limit, mounts (with each volume's guest source made ready under `work`), probes.
    `sources` maps a hostPath to the guest path bound in its place; `overrides` are keys set in
    the ConfigMap's config.yaml. Anything of the pod spec that cannot be carried over raises."""
    (ds,) = [d for d in docs if d.get("kind") == "DaemonSet"]
    maps = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "ConfigMap"}
    spec = ds["spec"]["template"]["spec"]
    (c,) = [x for x in spec["containers"] if x["name"] == CONTAINER]
    if spec.get("hostPID") or spec.get("hostIPC"):
        raise InfraError("hostPID / hostIPC are not translated")
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = []
    for m in c.get("volumeMounts", []):
        v = vols[m["name"]]
        if "hostPath" in v:
            path = v["hostPath"]["path"]
            src = sources.get(path, path)
            kind = v["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                os.makedirs(src, exist_ok=True)
            elif kind == "Directory" and not os.path.isdir(src) or kind == "File" and not os.path.isfile(src):
                raise InfraError(f"hostPath {path} ({kind}): {src} missing in the guest")
        elif "configMap" in v:
            src = os.path.join(work, "configmap-" + v["name"])
            os.makedirs(src, exist_ok=True)
            for key, text in maps[v["configMap"]["name"]]["data"].items():
                if key == "config.yaml" and overrides:
                    text = yaml.safe_dump({**yaml.safe_load(text), **overrides}, sort_keys=False)
                with open(os.path.join(src, key), "w") as f:
                    f.write(text)
        elif "emptyDir" in v:
            src = os.path.join(work, "emptydir-" + v["name"])
            shutil.rmtree(src, ignore_errors=True)
            os.makedirs(src)
        else:
            raise InfraError(f"volume {v['name']}: kind not translated ({sorted(v)})")
        mounts.append({"src": src, "dst": m["mountPath"], "ro": bool(m.get("readOnly"))})
    sc = c.get("securityContext", {})
    drop = sc.get("capabilities", {}).get("drop", [])
    caps = DEFAULT_CAPS if "ALL" in drop else [x if x.startswith("CAP_") else "CAP_" + x for x in drop]
    if sc.get("capabilities", {}).get("add"):
        raise InfraError("capabilities.add is not translated")
    return {
        "image": image_ref(c["image"]), "command": c["command"] + c.get("args", []),
        "env": [f"{e['name']}={e['value']}" for e in c.get("env", [])],
        "user": f"{sc.get('runAsUser', 0)}:{sc.get('runAsGroup', 0)}",
        "read_only": bool(sc.get("readOnlyRootFilesystem")), "privileged": bool(sc.get("privileged")),
        "no_new_privileges": sc.get("allowPrivilegeEscalation") is False,
        "cap_drop": caps, "seccomp": (sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault",
        "memory_limit": quantity(c["resources"]["limits"]["memory"]) if "limits" in c.get("resources", {}) else 0,
        "host_network": bool(spec.get("hostNetwork")), "mounts": mounts,
        "probes": {k: c[k]["exec"]["command"] for k in ("livenessProbe", "readinessProbe") if k in c},
    }


def ctr_run_args(t: dict, extra_mounts: list[dict], log_uri: str) -> list[str]:
    args = ["run", "-d", "--log-uri", log_uri, "--user", t["user"]]
    args += ["--read-only"] * t["read_only"] + ["--privileged"] * t["privileged"] + ["--net-host"] * t["host_network"]
    args += ["--seccomp"] * t["seccomp"] + ["--allow-new-privs"] * (not t["no_new_privileges"])  # ctr: on by default
    for cap in t["cap_drop"]:
        args += ["--cap-drop", cap]
    if t["memory_limit"]:
        args += ["--memory-limit", str(t["memory_limit"])]
    for e in t["env"]:
        args += ["--env", e]
    for m in t["mounts"] + extra_mounts:
        args += ["--mount", f"type=bind,src={m['src']},dst={m['dst']},options=rbind:{'ro' if m['ro'] else 'rw'}"]
    return args + [t["image"], CID, *t["command"]]


class Task:
    """The plugin container's process (its host PID), with the Popen calls the scenario makes."""

    def __init__(self, plugin: "ImagePlugin", pid: int):
        self.plugin, self.pid, self.returncode = plugin, pid, None

    def poll(self):
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                alive = False
            if not alive:  # `ctr tasks delete` exits with the task's exit status
                self.returncode = self.plugin.ctr("tasks", "delete", CID).returncode
        return self.returncode

    def wait(self, timeout: float | None = None):
        deadline = time.time() + (timeout or 1e9)
        while self.poll() is None:
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(f"task {CID}", timeout)
            time.sleep(0.1)
        return self.returncode


class ImagePlugin(Plugin):
    """`memqos-shim nri` as the DaemonSet's container, in the guest's containerd."""

    def __init__(self, image_dir: str, ctr: str, logs: str, kubelet_config: str, meminfo: str):
        self.ctr_bin, self.logs = ctr, logs
        self.audit_log = os.path.join(logs, "nri-audit.jsonl")
        self.log = os.path.join(logs, "nri-plugin.log")
        self.args = ["--meminfo", meminfo]  # nri_bench's proxy reads the same node size
        self.proc: Task | None = None
        with open(os.path.join(image_dir, "image.json")) as f:
            self.info = json.load(f)
        with open(self.info["manifests"]) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        self.work = os.path.join(RUN, "nri-image")
        os.makedirs(self.work, exist_ok=True)
        self.spec = translate(docs, {"/var/lib/kubelet/config.yaml": kubelet_config},
                              {"audit-log": f"{AUDIT_DIR}/nri-audit.jsonl", "meminfo": MEMINFO}, self.work)
        self.extra = [{"src": logs, "dst": AUDIT_DIR, "ro": False}, {"src": meminfo, "dst": MEMINFO, "ro": True}]
        self.kubelet_config = kubelet_config
        t = time.time()
        p = self.ctr("images", "import", self.info["archive"], timeout=900)
        if p.returncode != 0:
            raise InfraError(f"ctr images import {self.info['archive']} failed: {p.stderr.strip()[-500:]}")
        self.import_s = time.time() - t
        if self.spec["image"] not in self.ctr("images", "ls", "-q").stdout.split():
            raise InfraError(f"{self.spec['image']} (the DaemonSet's image) not in the archive: {p.stdout[-300:]}")

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        p = subprocess.run([self.ctr_bin, "-a", CONTAINERD_SOCK, "-n", NS, *args],
                           capture_output=True, text=True, timeout=timeout)
        with open(self.log, "a") as f:
            f.write(f"$ ctr -n {NS} {' '.join(args)}\n{p.stdout}{p.stderr}exit {p.returncode}\n")
        return p

    def start(self) -> None:
        self.ctr("tasks", "delete", "-f", CID)  # a stopped or killed earlier run, if any
        self.ctr("containers", "delete", CID)
        p = self.ctr(*ctr_run_args(self.spec, self.extra, "file://" + os.path.join(self.logs, "nri-plugin-container.log")))
        if p.returncode != 0:
            raise InfraError(f"ctr run of {self.spec['image']} failed: {p.stderr.strip()[-500:]}")
        rows = [line.split() for line in self.ctr("tasks", "ls").stdout.splitlines()[1:]]
        pids = [int(r[1]) for r in rows if len(r) >= 3 and r[0] == CID]
        if not pids:
            raise InfraError(f"ctr run of {self.spec['image']}: no task {CID}")
        self.proc = Task(self, pids[0])

    def use_kubelet_config(self, path: str) -> str:
        """Bind ``path`` where the DaemonSet mounts the kubelet's config, from the next start on;
        returns the file bound before."""
        before = self.kubelet_config
        for m in self.spec["mounts"]:
            if m["src"] == before:
                m["src"] = path
        self.kubelet_config = path
        return before

    def status(self) -> dict:
        """CapEff and NoNewPrivs of the running plugin process (/proc/PID/status)."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("CapEff", "NoNewPrivs", "Uid", "Seccomp"):
                    out[k] = v.split()[0]
        return out

    def probe(self, name: str) -> tuple[int, str]:
        p = self.ctr("tasks", "exec", "--exec-id", f"{name.lower()}-{time.time_ns()}", CID,
                     *self.spec["probes"][name])
        return p.returncode, (p.stdout + p.stderr).strip()[-300:]

    def check_pod(self, scn) -> None:
        """After the first Synchronize: the probes pass and the process runs as the manifest says."""
        scn.note(f"plugin from the image {self.spec['image']} ({self.info.get('base')}), imported in "
                 f"{self.import_s:.1f}s, run as the DaemonSet's container: {' '.join(self.spec['command'])}")
        for name in sorted(self.spec["probes"]):
            rc, out = self.probe(name)
            scn.check("plugin from the image", f"{name} exec probe", " ".join(self.spec["probes"][name]),
                      "0", str(rc), f"the manifest's probe in the container: {out}", source="nri-image")
        st = self.status()
        scn.check("plugin from the image", "effective capabilities", f"/proc/{self.proc.pid}/status CapEff",
                  "0000000000000000", st.get("CapEff", "?"), "capabilities drop [ALL]", source="nri-image")
        scn.check("plugin from the image", "uid", f"/proc/{self.proc.pid}/status Uid",
                  self.spec["user"].split(":")[0], st.get("Uid", "?"), "runAsUser", source="nri-image")
        scn.check("plugin from the image", "no new privileges", f"/proc/{self.proc.pid}/status NoNewPrivs",
                  "1" if self.spec["no_new_privileges"] else "0", st.get("NoNewPrivs", "?"),
                  "allowPrivilegeEscalation", source="nri-image")
        if self.spec["seccomp"]:
            scn.check("plugin from the image", "seccomp filter", f"/proc/{self.proc.pid}/status Seccomp",
                      "2", st.get("Seccomp", "?"), "seccompProfile RuntimeDefault", source="nri-image")
        scn.report.data["nri"]["image"] = {**self.info, "status": st, "import_s": round(self.import_s, 1),
                                           "ctr_run": ctr_run_args(self.spec, self.extra, "file://...")}


def plugin_for(args, logs: str, kubelet_config: str, meminfo: str):
    """The image's plugin when the run has one (--nri-image), else None (the checkout's process)."""
    if not getattr(args, "nri_image", ""):
        return None
    ctr = load_stack(args.stack)["ctr"] if args.stack else shutil.which("ctr") or "ctr"
    return ImagePlugin(args.nri_image, ctr, logs, kubelet_config, meminfo)
