"""Classes in a recording: `serve --record` with classes and namespace-classes writes them into
the header's shim.settings in the config file's own form, and `replay` decides with them, so a
recording of pods asking for classes (chosen, refused for their namespace, unknown, per
container) replays to the audit records serve wrote, class fields included."""
from __future__ import annotations

import json

import yaml

from memqos_dev.testing.fake_runtime import FakeRuntimeServer
from shim.cli.main import main
from shim.cri import pb
from shim.evidence.trace import read_trace
from shim.tools.kubelet_requests import sandbox_config
from tests.test_serve import MI, Shim, create, short_dir

CLASSES = {"classes": {"latency-critical": {"factor": "none"}, "batch": {"factor": 0.5, "reclaim": True}},
           "namespace-classes": {"default": ["latency-critical", "batch"]}}
PODS = [  # name, namespace, pod annotations
    ("lc", "default", {"memqos.io/class": "latency-critical"}),
    ("per-container", "default", {"memqos.io/class": "latency-critical", "memqos.io/class.app": "batch"}),
    ("tenant", "tenant-a", {"memqos.io/class": "batch"}),
    ("unknown", "default", {"memqos.io/class": "gold"}),
    ("plain", "default", {}),
]


def test_a_recording_with_classes_replays_to_its_audit_records(capsys):
    base = short_dir()
    conf = base / "classes.yaml"
    conf.write_text(yaml.safe_dump(CLASSES))
    rec = base / "rec.jsonl"
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        shim = Shim(base, runtime.address, extra=("--config", str(conf), "--record", str(rec)))
        try:
            for i, (name, ns, annotations) in enumerate(PODS):
                sb = sandbox_config(name, f"uid-{i}", "burstable", namespace=ns, annotations=annotations)
                sid = shim.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sb), timeout=10).pod_sandbox_id
                create(shim, runtime.runtime, sid, sb, "app", "burstable", request=64 * MI, limit=256 * MI)
            served = shim.records(len(PODS))
        finally:
            shim.stop()
    by_pod = {r["pod"].split("/")[1]: r for r in served}
    assert by_pod["lc"]["class"] == "latency-critical"
    assert (by_pod["per-container"]["class"], by_pod["per-container"]["class_source"]) == \
        ("batch", "container-annotation")
    assert by_pod["tenant"]["class"] is None and by_pod["tenant"]["class_refused"] == "namespace-not-allowed"
    assert by_pod["unknown"]["class_refused"] == "unknown-class"
    assert by_pod["plain"]["class"] is None and "class_refused" not in by_pod["plain"]

    settings = read_trace(str(rec)).header.shim["settings"]
    assert settings["classes"] == {"batch": {"factor": 0.5, "reclaim": True}, "latency-critical": {"factor": "none"}}
    assert settings["namespace-classes"] == {"default": ["batch", "latency-critical"]}

    assert main(["replay", str(rec), "--json", "--expect", str(shim.audit)]) == 0
    out, err = capsys.readouterr()
    assert "DIFFERS" not in err and f"classes {json.dumps(settings['classes'])} (trace header)" in err
    replayed = {r["pod"].split("/")[1]: r for r in map(json.loads, out.splitlines()) if r.get("method")}
    for name, r in by_pod.items():
        assert replayed[name]["unified_after"] == r["unified_after"] and replayed[name]["class"] == r["class"]

    # without the header's classes (a --config naming none) the same recording decides otherwise
    plain = base / "none.yaml"
    plain.write_text("classes: {}\n")
    assert main(["replay", str(rec), "--json", "--config", str(plain), "--expect", str(shim.audit)]) == 1
    assert "DIFFERS" in capsys.readouterr().err
