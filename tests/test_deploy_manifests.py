"""deploy/kubernetes: the kustomize base and the enable-nri overlay, built here the way
`kubectl kustomize` builds them (resources, strategic-merge patches, namespace, images; any
other kustomization key is refused, so nothing kubectl would apply is skipped), then every
object validated against the Kubernetes OpenAPI schemas that kubernetes-validate ships
(offline; strict: an unknown field is an error) for 1.28 and 1.33, and the project's rules
for the plugin's pod checked one by one. Where kubectl is installed (scripts/install-test-deps
unpacks Debian sid's; with MEMQOS_REQUIRE_TOOLS=1 a missing one is a failure), its own
`kubectl kustomize` output is validated the same way and must equal this builder's."""
from __future__ import annotations

import argparse
import copy
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from shim.app.config import OPTIONS, resolve
from tests.tools import require_tool

REPO = Path(__file__).resolve().parents[1]
KUBE = REPO / "deploy" / "kubernetes"
VERSIONS = ("1.28.0", "1.33.0")
CLUSTER_SCOPED = {"Namespace"}
KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}


# -- a small kustomize ------------------------------------------------------------------------
def merge(base, patch):
    """Strategic merge as kustomize does it for these manifests: maps merge key by key, lists of
    named maps (containers, volumes, volumeMounts, ...) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if "$patch" in patch:
            raise ValueError("$patch directives are not supported by this builder")
        out = dict(base)
        for k, v in patch.items():
            out[k] = merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(
            isinstance(x, dict) and "name" in x for x in base + patch):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for x in patch:
            if x["name"] in index:
                out[index[x["name"]]] = merge(out[index[x["name"]]], x)
            else:
                out.append(copy.deepcopy(x))
        return out
    return copy.deepcopy(patch)


def pod_containers(obj):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def build(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN_KEYS
    assert not unknown, f"{directory}: kustomization keys this builder does not apply: {unknown}"
    assert k["kind"] == "Kustomization"
    objs: list[dict] = []
    for r in k.get("resources", []):
        p = (directory / r).resolve()
        objs += build(p) if p.is_dir() else [d for d in yaml.safe_load_all(p.read_text()) if d]
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"only file patches are supported: {patch}"
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            hits = [i for i, o in enumerate(objs)
                    if o["kind"] == doc["kind"] and o["metadata"]["name"] == doc["metadata"]["name"]]
            assert len(hits) == 1, f"patch {patch['path']} matches {len(hits)} objects"
            objs[hits[0]] = merge(objs[hits[0]], doc)
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    for img in k.get("images", []):
        for o in objs:
            for c in pod_containers(o):
                name, tag = re.match(r"^([^:@]+)(?::([^@]+))?", c["image"]).groups()
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag or 'latest')}"
    return objs


def find(objs, kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


# -- fixtures -----------------------------------------------------------------------------------
BUILDS = {"base": KUBE / "base", "enable-nri": KUBE / "enable-nri"}


@pytest.fixture(params=sorted(BUILDS))
def built(request):
    return request.param, build(BUILDS[request.param])


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)


def dockerfile_entrypoint() -> list[str]:
    m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", (REPO / "Dockerfile").read_text(), re.M)
    return yaml.safe_load(m.group(1))


# -- schema -------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(built, version):
    name, objs = built
    assert {o["kind"] for o in objs} == {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"}
    for o in objs:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {o['kind']}/{o['metadata']['name']} against {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_a_broken_manifest_fails_validation():
    """The validator used above does reject what the API server would: a misspelt field, a
    wrong type, a missing required field."""
    ds = find(build(KUBE / "base"), "DaemonSet")
    for breakage in (lambda d: d["spec"]["template"]["spec"].__setitem__("priorityClass", "x"),
                     lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("resources", "lots"),
                     lambda d: d["spec"].pop("selector")):
        bad = copy.deepcopy(ds)
        breakage(bad)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_the_builder_refuses_what_it_would_not_apply(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("apiVersion: kustomize.config.k8s.io/v1beta1\n"
                                                 "kind: Kustomization\nresources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(AssertionError, match="commonLabels"):
        build(tmp_path)


def named_lists_sorted(x):
    """Lists of named maps in name order: kustomize puts a patch's new items first, this
    builder last; the API server does not care."""
    if isinstance(x, dict):
        return {k: named_lists_sorted(v) for k, v in x.items()}
    if isinstance(x, list):
        x = [named_lists_sorted(v) for v in x]
        return sorted(x, key=lambda v: v["name"]) if all(isinstance(v, dict) and "name" in v for v in x) else x
    return x


def kubectl_kustomize(directory: Path) -> list[dict]:
    kubectl = require_tool("kubectl")
    r = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_kubectl_kustomize_output_validates(name, version):
    """What `kubectl apply -k` would send, rendered by kubectl itself, not the patch files."""
    objs = kubectl_kustomize(BUILDS[name])
    assert sorted(o["kind"] for o in objs) == ["ConfigMap", "DaemonSet", "Namespace", "ServiceAccount"]
    for o in objs:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"kubectl kustomize {name}: {o['kind']}/{o['metadata']['name']} against {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")
    _, spec, c = plugin(objs)
    assert c["image"] == f"memqos-shim:{project_version()}"
    assert ("initContainers" in spec) == (name == "enable-nri")


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_builder_agrees_with_kubectl_kustomize(name):
    theirs = [named_lists_sorted(d) for d in kubectl_kustomize(BUILDS[name])]
    mine = [named_lists_sorted(d) for d in build(BUILDS[name])]
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(mine, key=key)


# -- the project's rules -----------------------------------------------------------------------
def plugin(objs):
    ds = find(objs, "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "memqos-shim"]
    return ds, spec, c


def mounts_by_volume(spec, c) -> dict:
    vols = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in c.get("volumeMounts", [])}


def test_plugin_pod_follows_the_rules(built):
    _, objs = built
    ds, spec, c = plugin(objs)
    ns = find(objs, "Namespace")["metadata"]["name"]
    assert all(o["metadata"].get("namespace") == ns for o in objs if o["kind"] != "Namespace")
    assert spec["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in spec["tolerations"]
    assert spec.get("hostNetwork", False) is False and spec.get("hostPID", False) is False
    assert spec["automountServiceAccountToken"] is False
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"]
    assert 0 < spec["terminationGracePeriodSeconds"] <= 60
    # image and command: the Dockerfile's entry point, the `nri` front end, the mounted config
    for x in pod_containers(ds):
        assert x["image"] == f"memqos-shim:{project_version()}", x["name"]
    assert c["command"][:2] == [dockerfile_entrypoint()[0], "nri"]
    assert c["command"][2:] == ["--config", "/etc/memqos-shim/config.yaml"]
    # resources
    r = c["resources"]
    assert r["requests"]["memory"] and r["requests"]["cpu"] and r["limits"]["memory"]
    # privileges: none beyond uid 0
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]


def test_host_mounts(built):
    _, objs = built
    _, spec, c = plugin(objs)
    m = mounts_by_volume(spec, c)
    mount, vol = m["/var/run/nri"]
    assert vol["hostPath"]["path"] == "/var/run/nri", "the NRI socket's directory, never the socket file"
    assert vol["hostPath"]["type"] in ("Directory", "DirectoryOrCreate")
    mount, vol = m["/sys/fs/cgroup"]
    assert vol["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"} and not mount.get("readOnly")
    mount, vol = m["/var/lib/kubelet/config.yaml"]
    assert vol["hostPath"]["path"] == "/var/lib/kubelet/config.yaml" and mount["readOnly"] is True
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert not any("containerd.sock" in p or "crio.sock" in p for p in host_paths)
    assert not any(v["hostPath"].get("type") == "Socket" for v in spec["volumes"] if "hostPath" in v)


def config_of(objs, tmp_path):
    data = find(objs, "ConfigMap")["data"]["config.yaml"]
    f = tmp_path / "config.yaml"
    f.write_text(data)
    ns = argparse.Namespace(config=str(f), **{o.name.replace("-", "_"): None for o in OPTIONS})
    return resolve(ns)  # the shim's own loader: an unknown key or a bad value raises


def test_configmap_is_a_valid_shim_config_and_matches_the_pod(built, tmp_path):
    _, objs = built
    cfg = config_of(objs, tmp_path)
    _, spec, c = plugin(objs)
    m = mounts_by_volume(spec, c)
    assert m["/etc/memqos-shim"][1]["configMap"]["name"] == find(objs, "ConfigMap")["metadata"]["name"]
    assert cfg.kubelet_config in m and cfg.cgroup_root in m
    # the heartbeat the probes read is the one the plugin writes, on a writable volume
    assert cfg.health_file and any(cfg.health_file.startswith(p + "/") for p in m)
    for probe in (c["livenessProbe"], c["readinessProbe"]):
        cmd = probe["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "shim.evidence.health"]
        assert cmd[cmd.index("--file") + 1] == cfg.health_file
    assert "--ready" in c["readinessProbe"]["exec"]["command"]
    assert "--ready" not in c["livenessProbe"]["exec"]["command"]
    assert cfg.guard_state and any(cfg.guard_state.startswith(p + "/") for p in m)


def test_enable_nri_overlay_adds_only_the_init_container(tmp_path):
    base, over = build(KUBE / "base"), build(KUBE / "enable-nri")
    _, bspec, bc = plugin(base)
    _, ospec, oc = plugin(over)
    assert "initContainers" not in bspec
    assert oc == bc  # the plugin container itself is unchanged
    (init,) = ospec["initContainers"]
    assert init["command"][:3] == ["python", "-m", "shim.tools.enable_nri"] and "--exit-zero" in init["command"]
    assert "restart" not in " ".join(init["command"])
    m = mounts_by_volume(ospec, init)
    assert m["/host/etc/containerd"][1]["hostPath"]["path"] == "/etc/containerd"
    assert m["/host/etc/crio"][1]["hostPath"]["path"] == "/etc/crio"
    assert init["securityContext"]["privileged"] is False
    assert {v["name"] for v in bspec["volumes"]} < {v["name"] for v in ospec["volumes"]}
