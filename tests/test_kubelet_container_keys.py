"""Which container keys a gate-on kubelet writes, container by container, and NRI mode deciding
as proxy mode does beside it.

The recorded gate-on trace (a real kubelet v1.23, ``tests/data/traces``) is replayed through both
front ends' decision paths: proxy mode's rewriter (``ContainerMemoryQoS.rewrite``, the kubelet's
``unified`` in the request) and NRI mode's handler (``NriMemoryQoS.create_container``, the
container as a containerd before 2.2 hands it to a plugin: without the kubelet's ``unified``).
For each container the values its cgroup ends with are compared key by key: equal, or the
documented exception -- the kubelet writes a value for that key of that container, which the
plugin cannot see, and the plugin leaves it to the kubelet (its audit record says so). The
same trace stands for other kubelet versions: the requests carry what such a kubelet sends
(``kubelet_unified``), the NRI side sees none of it either way.
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from shim.container.nri_handler import NriMemoryQoS
from shim.container.rewriter import ContainerMemoryQoS
from shim.cri import pb as cri
from shim.decision import NodeFacts, Policy
from shim.decision.memory import NEUTRAL
from shim.decision.qos import qos_class
from shim.evidence.trace import read_trace
from shim.nri import api_pb2 as pb
from shim.node.facts import load_kubelet_config, node_facts
from shim.node.kubelet import kubelet_writes, ownership
from shim.tools.kubelet_requests import kubelet_unified
from shim.transport.hooks import RpcCall
from memqos_dev.testing.traces import MEMQOS_ON, TRACES_DIR, trace_file
from tests.test_nri_confirm import nri_from_cri

CAPACITY = 2060419072  # the recording VM's MemTotal (tests/data/traces/README.md)
PAGE = 4096
KEYS = ("memory.min", "memory.low", "memory.high")
PROTECTION = ("memory.min", "memory.low")
CREATE = "/runtime.v1.RuntimeService/CreateContainer"

# (kubelet version, the recorded configuration changed how): the recorded kubelet itself; the
# issue's 1.28 (memoryThrottlingFactor unset: 0.9) and with the recorded 0.8; 1.36 and 1.37
CASES = [((1, 23), {}), ((1, 28), {"memory_throttling_factor": None}), ((1, 28), {}), ((1, 36), {}),
         ((1, 37), {})]
POLICIES = [Policy.HARD, Policy.SOFT, Policy.TIERED_RESERVATION, Policy.NONE]


def _creates() -> list[cri.CreateContainerRequest]:
    trace = read_trace(str(trace_file(MEMQOS_ON)))
    return [cri.CreateContainerRequest.FromString(c.request) for c in trace.calls if c.name == "CreateContainer"]


CREATES = _creates()


def effective(unified) -> dict[str, str]:
    """What the container's cgroup holds for the memory keys (a key nobody sets: its default)."""
    return {k: unified.get(k, NEUTRAL[k]) for k in KEYS}


def the_kubelets(req: cri.CreateContainerRequest, writes, node: NodeFacts) -> dict[str, str]:
    """The ``unified`` map the kubelet described by ``writes`` sends for the recorded container:
    the recorded one for the recorded kubelet, else ``kubelet_unified`` with the container's true
    request (the recorded kubelet's memory.min) and limit."""
    recorded = dict(req.config.linux.resources.unified)
    if writes.version == (1, 23):
        return recorded
    qos, _ = qos_class(req.sandbox_config.linux.cgroup_parent, req.config.linux.resources.oom_score_adj)
    return kubelet_unified(writes, qos.value, request=int(recorded.get("memory.min", 0)),
                           limit=req.config.linux.resources.memory_limit_in_bytes, allocatable=node.allocatable,
                           page_size=PAGE, oom_group=False)


def compare(version, change: dict, policy: Policy, *, shown: bool = False) -> list[dict]:
    """One row per recorded container: the values proxy mode and NRI mode leave it with, the
    kubelet's own, and which keys differ (``exceptions``: differing keys the kubelet writes and
    NRI leaves to it; ``wrong``: any other difference). ``shown``: the runtime shows the plugin
    the kubelet's unified (containerd 2.2 and later)."""
    kubelet = replace(load_kubelet_config(str(TRACES_DIR / "kubelet-config-memqos-on.json")), **change)
    writes = kubelet_writes(kubelet, version)
    node = node_facts(CAPACITY, kubelet, page_size=PAGE)
    proxy_records: list[dict] = []
    nri_records: list[dict] = []
    proxy = ContainerMemoryQoS(node, policy, proxy_records.append, ownership=ownership(writes, policy))
    nri = NriMemoryQoS(node, policy, nri_records.append, ownership=ownership(writes, policy, nri=True))
    rows = []
    for i, recorded in enumerate(CREATES):
        req = cri.CreateContainerRequest()
        req.CopyFrom(recorded)
        sent = the_kubelets(req, writes, node)
        unified = req.config.linux.resources.unified
        unified.clear()
        unified.update(sent)
        call = RpcCall(CREATE, time.time(), request=req.SerializeToString())
        forwarded = cri.CreateContainerRequest.FromString(proxy.rewrite(call)).config.linux.resources.unified
        pod, container = nri_from_cri(req, f"c{i}")
        if shown:
            container.linux.resources.unified.update(sent)
        adjust = nri.create_container(pod, container) or pb.ContainerAdjustment()
        # the runtime applies the kubelet's unified (from CRI), then the plugin's adjustment over it
        applied = {**sent, **adjust.linux.resources.unified}
        [record] = nri_records[-1:]
        want, got, kubelets = effective(forwarded), effective(applied), effective(sent)
        differ = [k for k in KEYS if want[k] != got[k]]
        exceptions, wrong = [], []
        for key in differ:
            # the kubelet wrote this key (a protection key: memory.min / memory.low, one request)
            wrote = any(kubelets[k] != NEUTRAL[k] for k in (PROTECTION if key in PROTECTION else (key,)))
            left = key in record.get("kubelet_owns", ()) and key not in adjust.linux.resources.unified \
                and "NRI" in record["reasons"][key]
            (exceptions if wrote and left and got[key] == kubelets[key] else wrong).append(key)
        rows.append({"container": f"{req.sandbox_config.metadata.name}/{req.config.metadata.name}",
                     "proxy": want, "nri": got, "kubelet": kubelets, "exceptions": exceptions, "wrong": wrong,
                     "reasons": {k: record["reasons"][k] for k in differ}})
    return rows


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.value)
@pytest.mark.parametrize("version, change", CASES, ids=[f"{v[0]}.{v[1]}{'-factor-unset' if c else ''}"
                                                          for v, c in CASES])
def test_nri_gives_each_recorded_container_what_proxy_mode_gives_it(version, change, policy):
    rows = compare(version, change, policy)
    assert len(rows) == 8
    wrong = [(r["container"], r["wrong"], r["proxy"], r["nri"], r["kubelet"]) for r in rows if r["wrong"]]
    assert not wrong


def test_the_issues_besteffort_container_gets_proxy_modes_memory_high_in_nri_mode():
    """kubelet 1.28, gate on, factor 0.9: no memory.high from the kubelet for a container whose
    request equals its limit (BestEffort: both 0), so NRI mode sets the one proxy mode sets."""
    [row] = [r for r in compare((1, 28), {"memory_throttling_factor": None}, Policy.HARD)
             if r["container"].startswith("qos-besteffort")]
    assert row["kubelet"]["memory.high"] == "max"
    assert row["nri"]["memory.high"] == row["proxy"]["memory.high"] == str(int(1850703872 * 0.9) // PAGE * PAGE)


def test_where_the_recorded_kubelet_writes_a_value_nri_mode_leaves_it_and_says_why():
    """The recorded v1.23 kubelet writes memory.min for every container with a request and
    memory.high (its v1.22 formula) for the BestEffort one too: those are the exceptions."""
    rows = compare((1, 23), {}, Policy.HARD)
    besteffort = next(r for r in rows if "besteffort" in r["container"])
    assert besteffort["kubelet"]["memory.high"] == str(int(1850703872 * 0.8))
    assert besteffort["exceptions"] == ["memory.high"] and besteffort["nri"]["memory.high"] == \
        besteffort["kubelet"]["memory.high"]
    guaranteed = next(r for r in rows if "guaranteed" in r["container"])
    assert guaranteed["exceptions"] == ["memory.min", "memory.low"]
    assert guaranteed["nri"]["memory.min"] == str(64 * 1024 * 1024)


@pytest.mark.parametrize("version, change", CASES, ids=[f"{v[0]}.{v[1]}{'-factor-unset' if c else ''}"
                                                          for v, c in CASES])
def test_where_the_plugin_sees_the_kubelets_values_nri_mode_decides_exactly_as_proxy_mode(version, change):
    """containerd 2.2 and later hand plugins the kubelet's unified: nothing is hidden, no exception."""
    for policy in POLICIES:
        rows = compare(version, change, policy, shown=True)
        assert [(r["container"], r["proxy"], r["nri"]) for r in rows if r["proxy"] != r["nri"]] == []


# -- the rule itself (shim.decision.kubelet) -----------------------------------------------------

GI, MI_ = 1 << 30, 1 << 20
GRID = [("guaranteed", GI, GI), ("burstable", GI // 4, GI), ("burstable", GI // 4, 0), ("burstable", GI, GI),
        ("burstable", 0, 0), ("burstable", 1000 * MI_, 1001 * MI_), ("besteffort", 0, 0)]
CONFIGS = [dict(memory_qos_gate=True), dict(memory_qos_gate=True, memory_throttling_factor=0.8),
           dict(memory_qos_gate=True, memory_reservation_policy="TieredReservation"),
           dict(memory_qos_gate=True, memory_reservation_policy="TieredReservation", memory_throttling_factor=0.7),
           dict(memory_qos_gate=False, memory_throttling_factor=0.8)]


@pytest.mark.parametrize("version", [(1, 22), (1, 23), (1, 26), (1, 27), (1, 28), (1, 35), (1, 36), (1, 37)],
                         ids=lambda v: f"{v[0]}.{v[1]}")
def test_the_rule_agrees_with_the_kubelet_model_of_the_tests(version):
    """``shim.decision.kubelet`` (what both front ends use) against ``kubelet_unified`` (the
    kubelet model the tests and the demo send, written separately), every kind of container."""
    from shim.decision import QoSClass
    from shim.decision.kubelet import kubelet_values
    from shim.node.facts import KubeletFacts

    for config in CONFIGS:
        if "memory_reservation_policy" in config and version < (1, 36):
            continue
        writes = kubelet_writes(KubeletFacts(**config), version)
        [formula] = writes.high_formulas
        for qos, request, limit in GRID:
            model = kubelet_unified(writes, qos, request=request, limit=limit, allocatable=16 * GI, page_size=PAGE)
            want = {k: v for k, v in model.items() if k in KEYS and v != NEUTRAL[k]}
            got = kubelet_values(writes.rule(), formula, QoSClass[qos.upper()], request, limit, 16 * GI, PAGE)
            assert got == want, (config, qos, request, limit)


def _keys(version, qos, request, *, limit=0, config=None, nri=True, sent=None):
    from shim.node.facts import KubeletFacts

    writes = kubelet_writes(KubeletFacts(**(config or {"memory_qos_gate": True})), version)
    return dict(ownership(writes, Policy.HARD, nri=nri).container_keys()
                .for_container(qos, request, limit, 16 << 30, PAGE, sent or {}))


def test_per_container_keys_in_nri_mode_and_the_same_keys_everywhere_in_proxy_mode():
    from shim.decision import QoSClass, Request, RequestSource

    given = Request(256 * MI_, RequestSource.GIVEN)
    none = Request(0, RequestSource.NONE)
    # 1.28: BestEffort and request = limit get no memory.high from the kubelet
    assert set(_keys((1, 28), QoSClass.BESTEFFORT, none)) == set()
    assert set(_keys((1, 28), QoSClass.GUARANTEED, Request(GI, RequestSource.GUARANTEED_LIMIT), limit=GI)) == \
        {"memory.min", "memory.low"}
    assert set(_keys((1, 28), QoSClass.BURSTABLE, given, limit=GI)) == {"memory.min", "memory.low", "memory.high"}
    # 1.23 (v1.22 formula): BestEffort gets one; a version not known takes either formula
    assert set(_keys((1, 23), QoSClass.BESTEFFORT, none)) == {"memory.high"}
    assert set(_keys(None, QoSClass.BESTEFFORT, none)) == {"memory.high"}
    # the kubelet's values shown to the plugin: nothing is hidden
    assert _keys((1, 28), QoSClass.BURSTABLE, given, limit=GI, sent={"memory.min": str(256 * MI_)}) == {}
    # proxy mode: the keys of every container (none before v1.36; v1.36 with a factor: memory.high)
    for qos in QoSClass:
        assert _keys((1, 28), qos, given, limit=GI, nri=False) == {}
        assert set(_keys((1, 36), qos, given, limit=GI, nri=False)) == {"memory.high"}
        assert set(_keys((1, 36), qos, given, limit=GI)) == {"memory.high"}


def test_a_request_known_only_as_a_range_counts_as_written_where_any_value_in_it_would_be():
    """In NRI mode the request comes from oom_score_adj (a range) or an annotation (the tenant's
    word): a key the kubelet writes for some request the container can have stays the kubelet's."""
    from shim.decision import QoSClass, Request, RequestSource

    # 1.28: the limit inside the oom_score_adj range: request = limit (no memory.high) or not (one)
    straddles = Request(GI - MI_, RequestSource.OOM_SCORE_ADJ, upper=GI + MI_)
    assert "memory.high" in _keys((1, 28), QoSClass.BURSTABLE, straddles, limit=GI)
    below = Request(GI // 4, RequestSource.OOM_SCORE_ADJ, upper=GI // 4 + MI_)
    assert "memory.high" in _keys((1, 28), QoSClass.BURSTABLE, below, limit=GI)
    # an annotation says 1Gi = the limit: still taken as possibly anything
    claimed = Request(GI, RequestSource.ANNOTATION)
    assert set(_keys((1, 28), QoSClass.BURSTABLE, claimed, limit=GI)) == {"memory.min", "memory.low", "memory.high"}
    # the kubelet's own request, exact: request = limit, no memory.high
    exact = Request(GI, RequestSource.GIVEN)
    assert set(_keys((1, 28), QoSClass.BURSTABLE, exact, limit=GI)) == {"memory.min", "memory.low"}


DOC_ROWS = {  # the table's rows -> (kubelet versions, KubeletConfiguration)
    "1.22–1.26": ([(1, 22), (1, 26)], {"memory_qos_gate": True}),
    "1.27–1.35": ([(1, 27), (1, 35)], {"memory_qos_gate": True}),
    "1.36, defaults (policy `None`, factor 0.9)": ([(1, 36)], {"memory_qos_gate": True}),
    "1.36, `TieredReservation`": ([(1, 36)], {"memory_qos_gate": True,
                                              "memory_reservation_policy": "TieredReservation"}),
    "1.37, defaults": ([(1, 37)], {}),
    "1.37, `memoryThrottlingFactor: 0.9`": ([(1, 37)], {"memory_throttling_factor": 0.9}),
    "1.37, `TieredReservation`": ([(1, 37)], {"memory_reservation_policy": "TieredReservation"}),
}


def test_the_docs_table_of_the_keys_each_kubelet_writes_is_the_rules():
    from pathlib import Path

    from shim.decision import Request, RequestSource
    from shim.decision.kubelet import kubelet_writes_keys
    from shim.node.facts import KubeletFacts
    from shim.node.kubelet import KINDS

    text = (Path(__file__).resolve().parents[1] / "docs" / "memory-qos.md").read_text(encoding="utf-8")
    section = text.split("### Which keys the kubelet writes, container by container", 1)[1].split("\n### ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kubelet")]
    assert [r[0] for r in rows] == list(DOC_ROWS)
    for label, *cells in rows:
        versions, config = DOC_ROWS[label]
        for version in versions:
            rule = kubelet_writes(KubeletFacts(**config), version).rule()
            got = [", ".join(sorted(kubelet_writes_keys(rule, qos, Request(request, RequestSource.GIVEN), limit,
                                                        16 * GI, PAGE, together=False))) or "none"
                   for _, qos, request, limit in KINDS]
            assert got == cells, (label, version)


@pytest.mark.parametrize("version, args, keys", [
    ("1.23", [], ["memory.high"]),  # BestEffort: the v1.22 formula writes one
    ("1.28", [], []),  # BestEffort: request = limit (both 0), none
    ("1.28", ["--request", "32Mi", "--limit", "128Mi"], ["memory.high", "memory.min"]),
    ("1.28", ["--request", "96Mi", "--limit", "96Mi", "--qos", "burstable"], ["memory.min"]),
    ("1.37", [], []),  # its defaults: no factor, no policy
])
def test_explain_says_which_keys_a_kubelet_writes_for_the_container(version, args, keys):
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shim", "explain", "--allocatable", "1765Mi", "--page-size", "4096",
                          "--kubelet", version, "--json", *args], capture_output=True, text=True, check=True)
    assert sorted(json.loads(out.stdout)["kubelet_writes"]) == keys


def test_a_range_that_reaches_the_limit_only_at_the_limit_is_the_limit():
    """An oom_score_adj estimate whose low end is the limit: the request is the limit (never
    above it), so a 1.27+ kubelet writes no memory.high for it."""
    from shim.decision import QoSClass, Request, RequestSource
    from shim.decision.kubelet import request_range

    at_limit = Request(GI, RequestSource.OOM_SCORE_ADJ, upper=GI + 20 * MI_)
    assert request_range(QoSClass.BURSTABLE, at_limit, GI) == (GI, GI + 1)
    assert set(_keys((1, 28), QoSClass.BURSTABLE, at_limit, limit=GI)) == {"memory.min", "memory.low"}
    assert request_range(QoSClass.BURSTABLE, Request(0, RequestSource.NONE), GI) == (0, GI + 1)
    assert request_range(QoSClass.BURSTABLE, Request(0, RequestSource.NONE), 0) == (0, None)
