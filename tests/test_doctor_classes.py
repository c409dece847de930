"""`memqos-shim doctor`'s class checks: classes defined, namespaces allowed, running containers
by the class recorded in the shim's memqos.io/request annotation (a real ListContainers on the
fake runtime), annotations refused (a real /metrics endpoint)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from shim.container.rewriter import container_note
from shim.cri import pb
from shim.cri.methods import RUNTIME_SERVICE
from shim.evidence.metrics import Metrics
from shim.tools.doctor import PASS, WARN, Doctor
from shim.tools.doctor.classes import refused_counts
from shim.tools.kubelet_requests import create_container, sandbox_config
from shim.transport.unary_client import UnaryClient
from tests.test_doctor import env, fake_proc

CLASSES = """
classes:
  latency-critical: {factor: none}
  batch: {factor: 0.5, reclaim: true}
namespace-classes:
  default: [latency-critical, batch]
"""


def config(tmp_path: Path, text: str = CLASSES, **flags):
    import argparse

    from shim.app.config import OPTIONS, resolve

    f = tmp_path / "config.yaml"
    f.write_text(text)
    ns = argparse.Namespace(config=str(f), **{o.name.replace("-", "_"): None for o in OPTIONS})
    ns.kubelet_config = "none"
    for k, v in flags.items():
        setattr(ns, k, v)
    return resolve(ns)


def by_name(results) -> dict:
    return {r.name: r for r in results}


def test_no_classes_is_one_pass_line(tmp_path):
    r = Doctor(config(tmp_path, "policy: Hard\n"), env(fake_proc(tmp_path))).check_classes()
    assert [x.name for x in r] == ["classes"] and r[0].verdict == PASS and "none defined" in r[0].summary


def test_classes_and_namespaces_without_a_runtime_or_metrics(tmp_path):
    c = config(tmp_path, upstream=f"unix://{tmp_path}/none.sock")
    r = by_name(Doctor(c, env(fake_proc(tmp_path))).check_classes())
    assert r["classes"].verdict == PASS and "2 defined: batch, latency-critical" in r["classes"].summary
    assert any("batch: {'factor': 0.5, 'reclaim': True}" in d for d in r["classes"].details)
    assert r["namespaces allowed"].verdict == PASS and "default: batch, latency-critical" in r["namespaces allowed"].details
    assert r["classes in use"].verdict == WARN and "cannot list containers" in r["classes in use"].summary
    assert r["annotations refused"].verdict == WARN and "metrics are off" in r["annotations refused"].summary


def test_a_class_no_namespace_may_use_warns(tmp_path):
    text = CLASSES.replace("[latency-critical, batch]", "[batch]")
    r = by_name(Doctor(config(tmp_path, text), env(fake_proc(tmp_path))).check_classes())
    assert r["namespaces allowed"].verdict == WARN and "no namespace may use latency-critical" in \
        r["namespaces allowed"].summary


def _run(client: UnaryClient, method: str, req, resp_cls):
    return resp_cls.FromString(client.call(RUNTIME_SERVICE + method, req.SerializeToString(), 5.0))


def test_classes_in_use_are_counted_from_the_container_annotation(tmp_path):
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer

    base = Path(tempfile.mkdtemp(prefix="mqc-"))
    with FakeRuntimeServer(base / "rt.sock") as rt:
        client = UnaryClient(rt.address)
        try:
            sb_cfg = sandbox_config("web", "uid-1", "burstable")
            sid = _run(client, "RunPodSandbox", pb.RunPodSandboxRequest(config=sb_cfg),
                       pb.RunPodSandboxResponse).pod_sandbox_id
            # the annotation as the rewriter writes it (with the class it chose, or none)
            notes = {"a": "batch", "b": "batch", "c": "gone", "d": None, "e": False, "f": "Not A Name"}
            for name, cls in notes.items():
                req = create_container(sid, sb_cfg, name, "burstable", request=64 << 20, limit=128 << 20)
                if cls is not False:
                    req.config.annotations["memqos.io/request"] = container_note(
                        64 << 20, "kubelet-unified", "Burstable", "kubepods/burstable/poduid-1", cls)
                cid = _run(client, "CreateContainer", req, pb.CreateContainerResponse).container_id
                if name != "b":  # b stays created, not running: not counted
                    _run(client, "StartContainer", pb.StartContainerRequest(container_id=cid),
                         pb.StartContainerResponse)
        finally:
            client.close()
        c = config(tmp_path, upstream=rt.address)
        r = by_name(Doctor(c, env(fake_proc(tmp_path))).check_classes())
    use = r["classes in use"]
    assert use.summary == "running containers by class: batch 1, gone 1, node settings 2"
    assert use.verdict == WARN and any("no longer defines: gone" in d for d in use.details)
    assert any(d.startswith("1 running container(s) without") for d in use.details)


def test_annotations_refused_are_read_from_the_running_shims_metrics(tmp_path):
    m = Metrics()
    host, port = m.serve("127.0.0.1:0")
    try:
        c = config(tmp_path, metrics_address=f"{host}:{port}")
        d = Doctor(c, env(fake_proc(tmp_path)))
        assert by_name(d.check_classes())["annotations refused"].summary == "since the shim started: none"
        for reason in ("unknown-class",) * 3 + ("namespace-not-allowed",):  # as serve's audit stream feeds it
            m.on_audit({"event": "rewrite", "method": "CreateContainer", "class": None, "class_refused": reason})
        r = by_name(d.check_classes())["annotations refused"]
        assert r.verdict == WARN
        assert r.summary == "since the shim started: namespace-not-allowed 1, unknown-class 3"
    finally:
        m.close()


def test_refused_counts_reads_only_its_own_series():
    text = ('# HELP memqos_class_refused_total x\nmemqos_class_refused_total{reason="malformed"} 2.0\n'
            'memqos_rewrites_total{method="CreateContainer"} 5.0\n'
            'memqos_class_refused_total{reason="../../etc"} 9.0\n')
    assert refused_counts(text) == {"malformed": 2}
