"""Kubelet 1.22 ... 1.38 Memory QoS semantics: the policies named after the kubelet's
memoryReservationPolicy (matched in any case), what each kubelet version
writes itself (shim.node.kubelet), who owns each value, and the requests such kubelets send
(shim.tools.kubelet_requests.kubelet_unified, checked against a recorded v1.23 kubelet)."""
from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys

import pytest

from shim.app.config import ConfigError, add_arguments, resolve
from shim.cri import pb
from shim.decision import ContainerFacts, NodeFacts, PodFacts, Policy, Request, RequestSource, decide
from shim.effects import CgroupLayout
from shim.node.kubelet import (
    CONTAINER_HIGH,
    CONTAINER_PROTECTION,
    KUBELET,
    KUBEPODS,
    POD,
    QOS,
    RESERVED,
    SHIM,
    detect_kubelet_version,
    kubelet_writes,
    ownership,
    parse_version,
)
from shim.tools.kubelet_requests import kubelet_unified
from shim.node.facts import KubeletFacts, kubelet_facts_from_dict
from shim.node.reconciler import compute_targets
from shim.tools.doctor import PASS as PASS_
from shim.tools.doctor import WARN as WARN_
from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, trace_file

Mi, Gi = 2**20, 2**30
G = PodFacts(cgroup_parent="/kubepods/pod0a")
B = PodFacts(cgroup_parent="/kubepods/burstable/pod0b")
BE = PodFacts(cgroup_parent="/kubepods/besteffort/pod0c")
NODE = NodeFacts(capacity=8 * Gi, allocatable=8 * Gi, page_size=4096, factor=0.9)


def facts(**doc) -> KubeletFacts:
    return kubelet_facts_from_dict(doc, "test")


# -- names ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling,policy", [
    ("Hard", Policy.HARD), ("hard", Policy.HARD), ("HARD", Policy.HARD),
    ("Soft", Policy.SOFT), ("soft", Policy.SOFT),
    ("TieredReservation", Policy.TIERED_RESERVATION), ("tieredreservation", Policy.TIERED_RESERVATION),
    ("None", Policy.NONE), ("none", Policy.NONE),
])
def test_upstream_names_in_any_case(spelling, policy, tmp_path):
    assert Policy(spelling) is policy
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policy: {spelling}\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert resolve(p.parse_args(["--config", str(cfg)])).policy is policy
    assert resolve(p.parse_args(["--policy", spelling])).policy is policy


def test_the_policies_are_the_upstream_four():
    assert [p.value for p in Policy] == ["Hard", "Soft", "TieredReservation", "None"]


def test_unknown_policy_is_refused_with_the_names():
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ConfigError) as e:
        resolve(p.parse_args(["--policy", "strict"]))
    assert all(name in str(e.value) for name in ("Hard", "Soft", "TieredReservation", "None"))


@pytest.mark.parametrize("spelling", ["request", "tiered"])
def test_a_config_with_a_name_that_is_not_upstream_stops_the_start(spelling, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"policy: {spelling}\n")
    p = shim_cli("serve", "--config", str(cfg))
    assert p.returncode == 2
    assert f"not {spelling!r}" in p.stderr
    assert all(name in p.stderr for name in ("Hard", "Soft", "TieredReservation", "None"))


def shim_cli(*args):
    return subprocess.run([sys.executable, "-m", "shim", *args], capture_output=True, text=True, timeout=60)


def test_help_and_explain_use_the_upstream_names():
    out = shim_cli("serve", "--help").stdout
    assert "TieredReservation" in out and "Soft" in out and "(default: Hard)" in out
    assert "--kubelet-version" in out
    doc = json.loads(shim_cli("explain", "--request", "128Mi", "--limit", "256Mi", "--allocatable", "8Gi",
                              "--policy", "tieredreservation", "--json").stdout)
    assert doc["policy"] == "TieredReservation" and doc["unified"]["memory.low"] == str(128 * Mi)
    assert "policy TieredReservation" in doc["reasons"]["memory.low"]
    doc = json.loads(shim_cli("explain", "--request", "128Mi", "--limit", "128Mi", "--allocatable", "8Gi",
                              "--policy", "Soft", "--json").stdout)
    assert doc["qos"] == "Guaranteed" and doc["unified"] == {"memory.low": str(128 * Mi)}


# -- the decision per policy and QoS class ------------------------------------------------------
# (policy, pod, limit) -> protection keys; memory.high does not depend on the policy
DECISIONS = [
    (Policy.HARD, G, 128 * Mi, {"memory.min"}),
    (Policy.HARD, B, 256 * Mi, {"memory.min"}),
    (Policy.HARD, BE, 0, set()),
    (Policy.SOFT, G, 128 * Mi, {"memory.low"}),
    (Policy.SOFT, B, 256 * Mi, {"memory.low"}),
    (Policy.SOFT, BE, 0, set()),
    (Policy.TIERED_RESERVATION, G, 128 * Mi, {"memory.min"}),
    (Policy.TIERED_RESERVATION, B, 256 * Mi, {"memory.low"}),
    (Policy.TIERED_RESERVATION, BE, 0, set()),
    (Policy.NONE, G, 128 * Mi, set()),
    (Policy.NONE, B, 256 * Mi, set()),
    (Policy.NONE, BE, 0, set()),
]


@pytest.mark.parametrize("policy,pod,limit,keys", DECISIONS,
                         ids=[f"{p.value}-{q}" for p, (q, _), _, _ in
                              ((p, (["Guaranteed", "Burstable", "BestEffort"][[G, B, BE].index(pod)], 0), l, k)
                               for p, pod, l, k in DECISIONS)])
def test_protection_per_policy_and_qos(policy, pod, limit, keys):
    request = 0 if pod is BE else 128 * Mi
    d = decide(pod, ContainerFacts(limit=limit, unified={"memory.min": "0", "memory.low": "0"}), NODE, policy,
               Request(request, RequestSource.GIVEN) if request else None)
    protection = {k: v for k, v in d.unified_after.items() if k in ("memory.min", "memory.low")}
    want = {k: str(request) for k in keys}
    if keys == {"memory.min"} and limit == request:  # capped 10% under the limit (page), memory.low the request
        want = {"memory.min": "120795136", "memory.low": str(request)}
    assert protection == want
    high = decide(pod, ContainerFacts(limit=limit), NODE, Policy.HARD,
                  Request(request, RequestSource.GIVEN) if request else None).unified_after.get("memory.high")
    assert d.unified_after.get("memory.high") == high
    assert d.qos.value == ["Guaranteed", "Burstable", "BestEffort"][[G, B, BE].index(pod)]
    for key in keys:
        assert f"policy {policy.value}" in d.reasons[key]


def _state():
    from tests.test_node_state import _state_with

    return _state_with([("0a", "guaranteed", [64], True), ("0b", "burstable", [32], True)])


def _values(t):
    return {k: v.value // Mi for k, v in t.items() if v.value}


@pytest.mark.parametrize("policy,expect", [
    (Policy.HARD, {("kubepods", "memory.min"): 96, ("kubepods/burstable", "memory.min"): 32,
                   ("kubepods/pod0a", "memory.min"): 64, ("kubepods/burstable/pod0b", "memory.min"): 32}),
    (Policy.SOFT, {("kubepods", "memory.low"): 96, ("kubepods/burstable", "memory.low"): 32,
                   ("kubepods/pod0a", "memory.low"): 64, ("kubepods/burstable/pod0b", "memory.low"): 32}),
    (Policy.TIERED_RESERVATION, {("kubepods", "memory.min"): 64, ("kubepods", "memory.low"): 96,
                                 ("kubepods/burstable", "memory.low"): 32, ("kubepods/pod0a", "memory.min"): 64,
                                 ("kubepods/burstable/pod0b", "memory.low"): 32}),
    (Policy.NONE, {}),
])
def test_pod_qos_and_kubepods_values_per_policy(policy, expect):
    t, _ = compute_targets(_state(), CgroupLayout("cgroupfs"), policy, 4096)
    assert _values(t) == expect
    # the other file of each pair is managed too (kept at 0)
    assert {(p, f) for p, f in t} >= {("kubepods", "memory.min"), ("kubepods", "memory.low"),
                                     ("kubepods/besteffort", "memory.min"), ("kubepods/besteffort", "memory.low")}


def test_scopes_the_kubelet_owns_are_left_out():
    t, _ = compute_targets(_state(), CgroupLayout("cgroupfs"), Policy.HARD, 4096,
                           kubelet_owns=frozenset({"pod", "qos", "kubepods", "reserved"}))
    assert t == {}
    t, _ = compute_targets(_state(), CgroupLayout("cgroupfs"), Policy.HARD, 4096, kubelet_owns=frozenset({"pod"}))
    assert {p for p, _ in t} == {"kubepods", "kubepods/burstable", "kubepods/besteffort"}


def test_decide_keeps_what_the_kubelet_owns():
    before = {"memory.min": "0", "memory.low": str(128 * Mi), "memory.high": "240000000", "memory.oom.group": "1"}
    owns = {"memory.min": "tiered", "memory.low": "tiered", "memory.high": "factor"}
    d = decide(B, ContainerFacts(limit=256 * Mi, unified=before), NODE, Policy.HARD, kubelet_owns=owns)
    assert dict(d.unified_after) == before and not d.changed
    assert d.request.bytes == 128 * Mi and d.request.source is RequestSource.KUBELET_UNIFIED
    assert "kept" in d.reasons["memory.high"]
    # only memory.high the kubelet's: the shim still protects
    d = decide(B, ContainerFacts(limit=256 * Mi, unified={"memory.min": "0", "memory.low": "0", "memory.high": "1"}),
               NODE, Policy.HARD, Request(64 * Mi, RequestSource.GIVEN), kubelet_owns={"memory.high": "factor"},
               reset_absent=True)
    assert dict(d.unified_after) == {"memory.min": str(64 * Mi), "memory.low": "0", "memory.high": "1"}
    # an owned key the kubelet did not send stays absent even in an update
    d = decide(B, ContainerFacts(limit=256 * Mi), NODE, Policy.HARD, Request(64 * Mi, RequestSource.GIVEN),
               kubelet_owns={"memory.high": "factor"}, reset_absent=True)
    assert "memory.high" not in d.unified_after


# -- the kubelet's version -----------------------------------------------------------------------
@pytest.mark.parametrize("text,version", [("v1.37.2", (1, 37)), ("1.36", (1, 36)), ("Kubernetes v1.23.16", (1, 23)),
                                          ("v1.38.0-rc.1", (1, 38)), ("", None), ("kubelet", None), (None, None)])
def test_parse_version(text, version):
    assert parse_version(text) == version


def _fake_kubelet(path, out="Kubernetes v1.37.1"):
    path.write_text(f"#!/bin/sh\necho '{out}'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_detect_kubelet_version(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    assert detect_kubelet_version("1.36") == ((1, 36), "--kubelet-version 1.36")
    assert detect_kubelet_version("unknown")[0] is None
    exe = _fake_kubelet(tmp_path / "kubelet")
    v, how = detect_kubelet_version("auto", proc_root=str(proc), candidates=(exe,))
    assert v == (1, 37) and "Kubernetes v1.37.1" in how
    v, how = detect_kubelet_version("auto", proc_root=str(proc), candidates=(str(tmp_path / "missing"),))
    assert v is None and "no kubelet executable" in how
    # the running kubelet's executable comes first
    running = _fake_kubelet(tmp_path / "kubelet-running", "Kubernetes v1.38.0")
    (proc / "4242").mkdir()
    (proc / "4242" / "comm").write_text("kubelet\n")
    os.symlink(running, proc / "4242" / "exe")
    assert detect_kubelet_version("auto", proc_root=str(proc), candidates=(exe,))[0] == (1, 38)


def test_kubelet_version_setting(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert resolve(p.parse_args([])).kubelet_version == "auto"
    assert resolve(p.parse_args(["--kubelet-version", "v1.37.2"])).kubelet_version == "v1.37.2"
    with pytest.raises(ConfigError):
        resolve(p.parse_args(["--kubelet-version", "latest"]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kubelet-version: 1.30\n")  # YAML's number 1.3: refused, not misread
    with pytest.raises(ConfigError):
        resolve(p.parse_args(["--config", str(cfg)]))


def test_reservation_policy_is_read_and_checked():
    assert facts(memoryReservationPolicy="TieredReservation").memory_reservation_policy == "TieredReservation"
    assert facts().memory_reservation_policy is None
    k = facts(memoryReservationPolicy="Tiered")
    assert k.memory_reservation_policy is None and "memoryReservationPolicy" in k.problems[0]


# -- what each kubelet writes, and who owns what ------------------------------------------------
TIERED = {"memoryReservationPolicy": "TieredReservation"}
GATE_ON = {"featureGates": {"MemoryQoS": True}}
GATE_OFF = {"featureGates": {"MemoryQoS": False}}
# (id, version, config, gate, protection, factor, formula)
WRITES = [
    ("1.23-off", (1, 23), {}, False, None, None, "v1.22"),
    ("1.23-on-0.8", (1, 23), {**GATE_ON, "memoryThrottlingFactor": 0.8}, True, Policy.HARD, 0.8, "v1.22"),
    ("1.25-on", (1, 25), GATE_ON, True, Policy.HARD, 0.8, "v1.22"),
    ("1.30-on", (1, 30), GATE_ON, True, Policy.HARD, 0.9, "v1.27"),
    ("1.36-default", (1, 36), {}, False, None, None, "v1.27"),
    ("1.36-on", (1, 36), GATE_ON, True, None, 0.9, "v1.27"),
    ("1.36-on-tiered", (1, 36), {**GATE_ON, **TIERED}, True, Policy.TIERED_RESERVATION, 0.9, "v1.27"),
    ("1.36-tiered-gate-default", (1, 36), TIERED, False, None, None, "v1.27"),
    ("1.37-default", (1, 37), {}, True, None, None, "v1.27"),
    ("1.37-tiered", (1, 37), TIERED, True, Policy.TIERED_RESERVATION, None, "v1.27"),
    ("1.37-factor", (1, 37), {"memoryThrottlingFactor": 0.9}, True, None, 0.9, "v1.27"),
    ("1.37-gate-off-tiered", (1, 37), {**GATE_OFF, **TIERED}, False, None, None, "v1.27"),
    ("1.38-hard", (1, 38), {"memoryReservationPolicy": "Hard"}, True, Policy.HARD, None, "v1.27"),
    ("1.38-soft", (1, 38), {"memoryReservationPolicy": "Soft"}, True, Policy.SOFT, None, "v1.27"),
    ("unknown-default", None, {}, False, None, None, "v1.27"),
    ("unknown-tiered", None, TIERED, True, Policy.TIERED_RESERVATION, None, "v1.27"),
    ("unknown-factor", None, {"memoryThrottlingFactor": 0.7}, True, None, 0.7, "v1.27"),
    ("unknown-gate-on", None, GATE_ON, True, Policy.HARD, 0.9, "v1.27"),
]


@pytest.mark.parametrize("version,doc,gate,protection,factor,formula", [w[1:] for w in WRITES],
                         ids=[w[0] for w in WRITES])
def test_what_each_kubelet_writes(version, doc, gate, protection, factor, formula):
    w = kubelet_writes(facts(**doc), version)
    assert (w.gate, w.protection, w.factor, w.formula) == (gate, protection, factor, formula)
    if version is None and (gate or doc):
        assert w.assumptions, "an unknown version is said to be assumed"


def _owners(version, doc, policy=Policy.HARD):
    o = ownership(kubelet_writes(facts(**doc), version), policy)
    return {k: o.owner(k) for k in (CONTAINER_PROTECTION, CONTAINER_HIGH, POD, QOS, KUBEPODS, RESERVED)}


ALL_SHIM = dict.fromkeys((CONTAINER_PROTECTION, CONTAINER_HIGH, POD, QOS, KUBEPODS, RESERVED), SHIM)
PROTECTION_KUBELET = {**dict.fromkeys((CONTAINER_PROTECTION, POD, QOS, KUBEPODS, RESERVED), KUBELET),
                      CONTAINER_HIGH: SHIM}


@pytest.mark.parametrize("version,doc,policy,owners", [
    ((1, 37), {}, Policy.HARD, ALL_SHIM),  # default 1.37: the kubelet writes nothing
    ((1, 37), TIERED, Policy.HARD, PROTECTION_KUBELET),
    ((1, 37), TIERED, Policy.NONE, PROTECTION_KUBELET),
    ((1, 37), {"memoryThrottlingFactor": 0.9}, Policy.HARD, {**ALL_SHIM, CONTAINER_HIGH: KUBELET}),
    ((1, 37), {**TIERED, "memoryThrottlingFactor": 0.9}, Policy.SOFT, dict.fromkeys(ALL_SHIM, KUBELET)),
    ((1, 36), GATE_ON, Policy.HARD, {**ALL_SHIM, CONTAINER_HIGH: KUBELET}),  # v1.36 factor default 0.9
    ((1, 36), {}, Policy.TIERED_RESERVATION, ALL_SHIM),
    # a 1.22-1.35 kubelet with the gate on writes pod / QoS / node memory.min itself: left to it
    # whatever the shim's policy; the container keys stay the shim's
    ((1, 23), {**GATE_ON, "memoryThrottlingFactor": 0.8}, Policy.HARD,
     {CONTAINER_PROTECTION: SHIM, CONTAINER_HIGH: SHIM, **dict.fromkeys((POD, QOS, KUBEPODS, RESERVED), KUBELET)}),
    ((1, 23), GATE_ON, Policy.TIERED_RESERVATION,
     {CONTAINER_PROTECTION: SHIM, CONTAINER_HIGH: SHIM, **dict.fromkeys((POD, QOS, KUBEPODS, RESERVED), KUBELET)}),
    ((1, 23), {}, Policy.SOFT, ALL_SHIM),
    (None, TIERED, Policy.HARD, PROTECTION_KUBELET),  # unknown version: the conservative case
])
def test_ownership(version, doc, policy, owners):
    assert _owners(version, doc, policy) == owners


def test_ownership_keys_and_scopes():
    o = ownership(kubelet_writes(facts(**TIERED, memoryThrottlingFactor=0.8), (1, 37)), Policy.HARD)
    assert set(o.kubelet_keys()) == {"memory.min", "memory.low", "memory.high"}
    assert o.kubelet_scopes() == {"pod", "qos", "kubepods", "reserved"}
    assert len(o.lines()) == 6 and all(("kubelet" in line) or ("shim" in line) for line in o.lines())


# -- the requests such kubelets send ---------------------------------------------------------------
def _w(version, **doc):
    return kubelet_writes(facts(**doc), version)


@pytest.mark.parametrize("writes,qos,req,lim,expect", [
    # 1.37 defaults: gate on, policy None, factor unset: neutral values only
    (_w((1, 37)), "burstable", 128 * Mi, 256 * Mi,
     {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": "max"}),
    # 1.37 TieredReservation
    (_w((1, 37), **TIERED), "burstable", 128 * Mi, 256 * Mi,
     {"memory.oom.group": "1", "memory.min": "0", "memory.low": str(128 * Mi), "memory.high": "max"}),
    (_w((1, 37), **TIERED), "guaranteed", 128 * Mi, 128 * Mi,
     {"memory.oom.group": "1", "memory.min": str(128 * Mi), "memory.low": "0", "memory.high": "max"}),
    # 1.37 with a factor: memory.high by the v1.27 formula, BestEffort included
    (_w((1, 37), memoryThrottlingFactor=0.9), "burstable", 128 * Mi, 256 * Mi,
     {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": "255012864"}),
    (_w((1, 37), memoryThrottlingFactor=0.9), "besteffort", 0, 0,
     {"memory.oom.group": "1", "memory.min": "0", "memory.low": "0", "memory.high": str(8 * Gi * 9 // 10 // 4096 * 4096)}),
    # 1.37 with the gate off: memory.high=max clears an earlier value
    (_w((1, 37), **GATE_OFF), "burstable", 128 * Mi, 256 * Mi, {"memory.oom.group": "1", "memory.high": "max"}),
    # 1.36 defaults (gate off): nothing but memory.oom.group
    (_w((1, 36)), "burstable", 128 * Mi, 256 * Mi, {"memory.oom.group": "1"}),
])
def test_kubelet_unified(writes, qos, req, lim, expect):
    assert kubelet_unified(writes, qos, request=req, limit=lim, allocatable=8 * Gi) == expect


@pytest.mark.parametrize("name", [MEMQOS_ON, MEMQOS_OFF])
def test_kubelet_unified_reproduces_the_recorded_v1_23_kubelet(name):
    """The model of what a kubelet sends, against what a real v1.23 kubelet sent."""
    from shim.evidence.trace import read_trace
    from tests.test_replay_expectations import TRUTH

    trace = read_trace(str(trace_file(name)))
    kc = trace.header.kubelet_config
    k = kubelet_facts_from_dict(kc, "trace")
    w = kubelet_writes(k, parse_version(trace.header.source))
    alloc = trace.header.mem_total_bytes - k.kube_reserved - k.system_reserved
    seen = 0
    for call in trace.calls:
        if call.method != "/runtime.v1.RuntimeService/CreateContainer":
            continue
        req = pb.CreateContainerRequest.FromString(call.request)
        pod = req.sandbox_config.metadata.name.removesuffix("-virtme-ng")
        request, limit, qos = TRUTH[(pod, req.config.metadata.name)]
        got = kubelet_unified(w, qos, request=request, limit=limit, allocatable=alloc)
        assert got == dict(req.config.linux.resources.unified), (pod, req.config.metadata.name)
        seen += 1
    assert seen == 8


# -- doctor -------------------------------------------------------------------------------------
@pytest.mark.parametrize("doc,version,kubelet_side,verdict", [
    ("memoryReservationPolicy: TieredReservation\n", "1.37", {"pod", "qos", "kubepods", "reserved"}, PASS_),
    ("memoryThrottlingFactor: 0.9\n", "1.37", set(), PASS_),
    ("", "1.37", set(), PASS_),
    ("memoryReservationPolicy: TieredReservation\n", "unknown", {"pod", "qos", "kubepods", "reserved"}, WARN_),
])
def test_doctor_says_who_owns_each_value(tmp_path, doc, version, kubelet_side, verdict):
    from tests.test_doctor import cfg, env, fake_proc, v2_tree

    from shim.tools.doctor import Doctor

    v2_tree(tmp_path / "cg")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\n" + doc)
    c = cfg(cgroup_root=str(tmp_path / "cg"), meminfo=str(tmp_path / "meminfo"),
            kubelet_config=str(tmp_path / "kubelet.yaml"), kubelet_version=version)
    results = {r.name: r for r in Doctor(c, env(fake_proc(tmp_path))).check_kubelet_config()}
    r = results["ownership"]
    assert r.verdict == verdict
    rows = {line.split("  ")[0].strip(): line for line in r.details if line.startswith(("container", "pod", "QoS",
                                                                                       "kubepods", "kube-"))}
    assert len(rows) == 6
    owners = {k: "kubelet" if f" {'kubelet':8} " in v else "shim" for k, v in rows.items()}
    scope = {"pod memory.min / memory.low": "pod", "QoS cgroups (burstable, besteffort)": "qos",
             "kubepods": "kubepods", "kube-reserved / system-reserved": "reserved"}
    assert {scope[k] for k, who in owners.items() if who == "kubelet" and k in scope} == kubelet_side
    if "Factor" in doc:
        assert owners["container memory.high"] == "kubelet"
    assert results["MemoryQoS gate"].verdict == (WARN_ if doc else PASS_)


@pytest.mark.parametrize("policy,verdict", [("Hard", PASS_), ("Soft", WARN_), ("TieredReservation", WARN_)])
def test_doctor_warns_when_a_memory_low_policy_meets_a_kubelet_writing_memory_min(tmp_path, policy, verdict):
    """A v1.22-v1.35 kubelet with the gate on keeps the pod / QoS / node values (memory.min, memory.low 0):
    a container's memory.low under such a pod counts for nothing, so doctor tells the operator."""
    from tests.test_doctor import cfg, env, fake_proc, v2_tree

    from shim.tools.doctor import Doctor

    v2_tree(tmp_path / "cg")
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\n")
    (tmp_path / "kubelet.yaml").write_text("cgroupDriver: cgroupfs\nfeatureGates:\n  MemoryQoS: true\n")
    c = cfg(cgroup_root=str(tmp_path / "cg"), meminfo=str(tmp_path / "meminfo"),
            kubelet_config=str(tmp_path / "kubelet.yaml"), kubelet_version="1.30", policy=policy)
    r = {r.name: r for r in Doctor(c, env(fake_proc(tmp_path))).check_kubelet_config()}["ownership"]
    assert r.verdict == verdict
    assert any("use policy Hard" in d for d in r.details) == (verdict == WARN_)
