"""e2e/nri_image.py: the DaemonSet's plugin container translated into the `ctr run` the VM
suite's NRI scenario starts from the image (scripts/e2e-vm --plugin-image). The translation reads
the manifests as kustomize builds them, so a change of the manifest changes what the VM runs."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import yaml

from tests.test_deploy_manifests import KUBE, build, plugin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))


@pytest.fixture
def nri_image():
    import nri_image

    return nri_image


def sources(tmp_path) -> dict[str, str]:
    kubelet = tmp_path / "kubelet-config.json"
    kubelet.write_text("{}")
    return {"/var/lib/kubelet/config.yaml": str(kubelet), "/var/run/nri": str(tmp_path / "nri"),
            "/run/memqos-shim": str(tmp_path / "state")}


def test_the_plugin_container_runs_as_the_manifest_says(nri_image, tmp_path):
    objs = build(KUBE / "base")
    _, spec, c = plugin(objs)
    t = nri_image.translate(objs, sources(tmp_path), {"meminfo": "/etc/memqos-e2e/meminfo"}, str(tmp_path))
    assert t["command"] == c["command"]
    assert t["image"] == "docker.io/library/" + c["image"]
    assert t["user"] == "0:0" and t["read_only"] and not t["privileged"] and t["seccomp"]
    assert set(t["cap_drop"]) == set(nri_image.DEFAULT_CAPS)
    assert t["memory_limit"] == 256 * 1024 * 1024
    assert {m["dst"]: m["ro"] for m in t["mounts"]} == {m["mountPath"]: bool(m.get("readOnly"))
                                                        for m in c["volumeMounts"]}
    assert t["probes"] == {"livenessProbe": c["livenessProbe"]["exec"]["command"],
                           "readinessProbe": c["readinessProbe"]["exec"]["command"]}
    # the ConfigMap's file, with the test's key set, in the directory bound at /etc/memqos-shim
    (cfg,) = [m for m in t["mounts"] if m["dst"] == "/etc/memqos-shim"]
    written = yaml.safe_load(open(os.path.join(cfg["src"], "config.yaml")))
    shipped = yaml.safe_load([o for o in objs if o["kind"] == "ConfigMap"][0]["data"]["config.yaml"])
    assert written == {**shipped, "meminfo": "/etc/memqos-e2e/meminfo"}
    # hostPaths: the guest's paths, or the test's in their place; DirectoryOrCreate made
    by_dst = {m["dst"]: m["src"] for m in t["mounts"]}
    assert by_dst["/sys/fs/cgroup"] == "/sys/fs/cgroup"
    assert by_dst["/var/lib/kubelet/config.yaml"] == str(tmp_path / "kubelet-config.json")
    assert os.path.isdir(tmp_path / "nri") and os.path.isdir(tmp_path / "state")
    args = nri_image.ctr_run_args(t, [], "file:///log")
    assert args[-len(c["command"]):] == c["command"] and nri_image.CID in args
    assert "--read-only" in args and "--seccomp" in args and "--privileged" not in args
    assert "--allow-new-privs" not in args and t["no_new_privileges"]
    assert "type=bind,src=/sys/fs/cgroup,dst=/sys/fs/cgroup,options=rbind:rw" in args


def test_a_change_of_the_manifest_changes_the_run(nri_image, tmp_path):
    objs = build(KUBE / "base")
    changed = copy.deepcopy(objs)
    _, spec, c = plugin(changed)
    c["command"] = c["command"] + ["--log-level", "debug"]
    c["securityContext"]["readOnlyRootFilesystem"] = False
    c["securityContext"]["allowPrivilegeEscalation"] = True
    c["resources"]["limits"]["memory"] = "300Mi"
    spec["volumes"].append({"name": "extra", "emptyDir": {}})
    c["volumeMounts"].append({"name": "extra", "mountPath": "/extra"})
    before = nri_image.ctr_run_args(nri_image.translate(objs, sources(tmp_path), {}, str(tmp_path)), [], "file:///l")
    after = nri_image.ctr_run_args(nri_image.translate(changed, sources(tmp_path), {}, str(tmp_path)), [], "file:///l")
    assert after[-2:] == ["--log-level", "debug"] and "--read-only" in before and "--read-only" not in after
    assert str(300 * 1024 * 1024) in after
    assert "--allow-new-privs" in after and "--allow-new-privs" not in before
    assert any(a.endswith("dst=/extra,options=rbind:rw") for a in after)


@pytest.mark.parametrize("breakage", ["add-capability", "unknown-volume", "missing-file", "host-pid"])
def test_what_cannot_be_carried_over_is_refused(nri_image, tmp_path, breakage):
    objs = copy.deepcopy(build(KUBE / "base"))
    _, spec, c = plugin(objs)
    src = sources(tmp_path)
    if breakage == "add-capability":
        c["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    elif breakage == "unknown-volume":
        spec["volumes"].append({"name": "s", "secret": {"secretName": "x"}})
        c["volumeMounts"].append({"name": "s", "mountPath": "/s"})
    elif breakage == "missing-file":
        src["/var/lib/kubelet/config.yaml"] = str(tmp_path / "absent.yaml")
    else:
        spec["hostPID"] = True
    with pytest.raises(nri_image.InfraError):
        nri_image.translate(objs, src, {}, str(tmp_path))


@pytest.mark.parametrize("name,ref", [("memqos-shim:0.1.0", "docker.io/library/memqos-shim:0.1.0"),
                                      ("org/memqos-shim:1", "docker.io/org/memqos-shim:1"),
                                      ("registry.example:5000/m/s:1", "registry.example:5000/m/s:1"),
                                      ("localhost/memqos-shim:1", "localhost/memqos-shim:1")])
def test_image_names_resolve_as_the_kubelet_pulls_them(nri_image, name, ref):
    assert nri_image.image_ref(name) == ref


def test_quantities(nri_image):
    assert nri_image.quantity("256Mi") == 268435456 and nri_image.quantity("1G") == 10 ** 9
    with pytest.raises(nri_image.InfraError):
        nri_image.quantity("lots")
