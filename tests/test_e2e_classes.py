"""The classes scenario of the real-kernel suite (e2e/guest_classes.py), checked on the host:
its expectations -- e2e/expect.py's own arithmetic with each class's factor and policy -- equal
what the product decides for every pod of the scenario, with the scenario's config file parsed
by the product's config loader and each container's class chosen by the product from its pod's
annotations. A class the config does not define as the scenario assumes, a refusal the product
does not make, or a formula that differs fails here before a VM boots."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from types import MappingProxyType

import pytest

from shim.app.config import add_arguments, resolve
from shim.app.config_classes import class_table
from shim.decision import ContainerFacts, NodeFacts, PodFacts, Policy
from shim.decision.classes import ContainerSettings, choose_class
from shim.decision.memory import decide, kernel_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import expect as X  # noqa: E402
import guest_classes as GC  # noqa: E402
from guest_common import Shim  # noqa: E402

MI = 1 << 20
CAPACITY, PAGE = 512 * MI - 37 * 4096, 4096  # a 512M guest's MemTotal is a little under 512 MiB


def scenario_config(tmp_path):
    """The config file exactly as the guest writes it (guest_common.Shim), read by the product."""
    shim = Shim("python3", str(tmp_path), GC.SCN, "kc.json", "/proc/meminfo", GC.NODE_SETTINGS, GC.CONFIG)
    path = shim.args[shim.args.index("--config") + 1]
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(["--config", path, *GC.NODE_SETTINGS]))


def product(cfg, spec: GC.Pod, c: GC.Ctr, limit: int):
    """(class choice, kernel values, settings) as the product decides them for this container."""
    node = NodeFacts(capacity=CAPACITY, allocatable=CAPACITY, page_size=PAGE, factor=GC.NODE_FACTOR)
    base = ContainerSettings(cls=None, node=node, policy=cfg.policy, reclaim=cfg.reclaim)
    table = class_table(cfg)
    pod = PodFacts(uid="u", namespace=spec.namespace, name=spec.name,
                   cgroup_parent="/kubepods/burstable/podu", annotations=MappingProxyType(dict(spec.annotations)))
    choice = choose_class(table, pod, c.name)
    settings = table.resolve(base)[choice.name]
    container = ContainerFacts(name=c.name, limit=limit, oom_score_adj=GC.oom_score_adj(c.request, CAPACITY))
    d = decide(pod, container, settings.node, settings.policy)
    return choice, kernel_values(d, {}), settings


def guest_values(c: GC.Ctr, limit: int) -> dict[str, str]:
    exp = GC.expected(c, X.Node(capacity=CAPACITY, page=PAGE, factor=GC.NODE_FACTOR), limit)
    return {"memory.min": str(exp.min) if exp.min else "0", "memory.low": str(exp.low) if exp.low else "0",
            "memory.high": "max" if exp.high is None else str(exp.high)}


CASES = [(p, c, c.limit) for p in GC.PODS for c in p.containers]
CASES.append(next((p, c, GC.RESIZED[2]) for p in GC.PODS for c in p.containers
                  if (p.name, c.name) == GC.RESIZED[:2]))


@pytest.mark.parametrize("spec,c,limit", CASES, ids=[f"{p.name}/{c.name}@{lim // MI}Mi" for p, c, lim in CASES])
def test_the_scenarios_expectations_are_the_products_decision(tmp_path, spec, c, limit):
    cfg = scenario_config(tmp_path)
    assert cfg.policy is Policy.HARD and cfg.reclaim is False  # the node's settings the scenario assumes
    choice, values, settings = product(cfg, spec, c, limit)
    assert choice.name == c.want_class
    assert choice.refused == c.refused
    assert values == guest_values(c, limit)
    assert settings.protects == GC.protects(c)
    assert settings.reclaim == (c.want_class == "batch")  # the reclaim check's premise: batch only


def test_the_scenario_covers_what_issue_33_asks():
    """Every refusal reason, a container key winning over the pod's, a class without protection,
    a class with reclaim on a page-cache reader beside its unannotated twin, and NRI pods."""
    ctrs = [(p, c) for p in GC.PODS for c in p.containers]
    assert {c.refused for _, c in ctrs} >= {"namespace-not-allowed", "malformed", "unknown-class"}
    assert any(GC.CONTAINER_PREFIX + c.name in p.annotations for p, c in ctrs)
    assert any(not GC.protects(c) for _, c in ctrs)
    readers = {c.want_class for _, c in ctrs if c.kind == "reader"}
    assert readers == {"batch", None}
    node = X.Node(capacity=CAPACITY, page=PAGE, factor=GC.NODE_FACTOR)
    by_name = {p.name: p for p in GC.PODS}
    for p in GC.PODS:
        if p.twin:  # a refused pod has the same shape as its twin, so the same values
            assert [(c.request, c.limit) for c in p.containers] == \
                   [(c.request, c.limit) for c in by_name[p.twin].containers]
    lc = GC.expected(by_name["cls-lc"].containers[0], node)
    twin = GC.expected(by_name["cls-twin"].containers[0], node)
    assert lc.high is None and twin.high is not None and lc.min == twin.min > 0
    batch, reader = (GC.expected(by_name[n].containers[0], node) for n in ("cls-batch", "cls-reader"))
    assert batch.high < reader.high  # factor 0.5 under the node's 0.9
    assert GC.pod_protection(by_name["cls-unprot"], node) == 0
    assert {p.name for p in GC.PODS if p.nri} >= {"cls-lc", "cls-twin", "cls-denied", "cls-unprot", "cls-mixed"}


def test_guest_runs_the_classes_scenario_in_the_all_boot():
    """scripts/e2e-vm's all (CI's 2.x:all+nri) passes --classes, nri with +nri; guest.py takes it."""
    text = open(os.path.join(ROOT, "scripts", "e2e-vm")).read()
    assert 'all) guest_cmd+=" --guard --guard-threshold $guard_threshold --guard-slack $guard_slack ' \
           '--classes $classes_mode"' in text
    assert '[ "$nri" = 0 ] || classes_mode=nri' in text
    import guest

    src = open(guest.__file__).read()
    assert 'ClassesScenario(args, report)' in src and 'args.classes == "nri"' in src


@pytest.mark.parametrize("scenario", ["classes", "classes+nri"])
def test_e2e_vm_knows_the_classes_scenario(scenario):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--scenario", scenario, "--stack", "9",
                        "--no-install"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 3 and "--stack must be one of" in p.stderr, p.stderr
