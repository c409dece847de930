"""A class decision in observe mode: the call goes upstream as the kubelet sent it, and the audit
record says what enforce would write with the class (its values, the class, or the refusal) and
is counted by class alike (docs/observe-mode.md, "Classes in observe")."""
from __future__ import annotations

from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb
from shim.cri.methods import CREATE_CONTAINER
from shim.decision import Policy
from shim.effects.rollout import Rollout
from shim.evidence.metrics import Metrics
from tests.kubelet_requests import create_container, sandbox_config
from tests.test_classes_paths import MI, NODE, TABLE, UID, run


def decided(records):
    return [r for r in records if r.get("event") in ("rewrite", "unchanged")]


def both(annotations: dict, **kw):
    """(enforce's records and request as sent, observe's records and request as sent)."""
    out = []
    for mode in ("enforce", "observe"):
        records: list = []
        hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append, classes=TABLE, rollout=Rollout(mode))
        sb = sandbox_config("p", UID, "burstable", annotations=annotations)
        req = create_container("s1", sb, "main", "burstable", request=256 * MI, limit=1024 * MI,
                               unified={"memory.min": str(256 * MI)})
        sent = req.SerializeToString()
        got = run(hooks, CREATE_CONTAINER, sent, pb.CreateContainerResponse(container_id="c1").SerializeToString())
        out.append((records, sent, got))
    return out


def test_observe_forwards_unchanged_and_audits_what_the_class_would_write():
    (enf, _, enf_sent), (obs, sent, obs_sent) = both({"memqos.io/class": "latency-critical"})
    assert obs_sent == sent  # the kubelet's bytes
    assert enf_sent != sent
    [e], [o] = decided(enf), decided(obs)
    assert o["rollout"] == "observe" and o["class"] == "latency-critical" == e["class"]
    assert o["unified_after"] == e["unified_after"]
    assert "memory.high" not in o["unified_after"]  # factor none: what enforce writes
    enforced = pb.CreateContainerRequest.FromString(enf_sent).config.linux.resources.unified
    assert dict(enforced) == e["unified_after"]


def test_observe_audits_a_refusal_and_counts_it():
    (enf, _, _), (obs, sent, obs_sent) = both({"memqos.io/class": "no-such-class"})
    assert obs_sent == sent
    [e], [o] = decided(enf), decided(obs)
    assert o["class"] is None and o["class_refused"] == e["class_refused"] == "unknown-class"
    m = Metrics().set_classes(c for c in TABLE.classes)
    for r in obs:
        m.on_audit(r)
    text = m.render().decode()
    assert 'memqos_class_refused_total{reason="unknown-class"} 1.0' in text
    assert 'class=""' in text and "memqos_rewrites_total{" in text


def test_observe_audits_the_swap_a_swap_class_would_allow():
    (enf, _, _), (obs, sent, obs_sent) = both({"memqos.io/class": "swappy"})
    assert obs_sent == sent
    [e], [o] = decided(enf), decided(obs)
    assert o["class"] == "swappy" and o["unified_after"] == e["unified_after"]
    assert o["unified_after"].get("memory.swap.max") == "max"


def test_observe_remembers_the_class_for_the_containers_updates_within_the_run():
    from shim.cri.methods import UPDATE_CONTAINER_RESOURCES
    from tests.kubelet_requests import update_resources

    records: list = []
    hooks = ContainerMemoryQoS(NODE, Policy.HARD, records.append, classes=TABLE, rollout=Rollout("observe"))
    sb = sandbox_config("p", UID, "burstable", annotations={"memqos.io/class": "latency-critical"})
    req = create_container("s1", sb, "main", "burstable", request=256 * MI, limit=1024 * MI)
    run(hooks, CREATE_CONTAINER, req.SerializeToString(), pb.CreateContainerResponse(container_id="c1").SerializeToString())
    upd = update_resources("c1", limit=2048 * MI, oom_score_adj=500).SerializeToString()
    assert run(hooks, UPDATE_CONTAINER_RESOURCES, upd) == upd
    last = decided(records)[-1]
    assert last["method"] == "UpdateContainerResources" and last["rollout"] == "observe"
    assert (last["class"], last["class_source"]) == ("latency-critical", "remembered")
