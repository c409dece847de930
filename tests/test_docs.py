"""The docs cannot drift from the code: the worked examples of docs/memory-qos.md are
recomputed with shim.decision / shim.node.state, every relative link in README.md and docs/
must point at a file of the repository (and at a heading of it, for a link with #), README.md
stays a front door of at most 250 lines, and no page tells the history of the code."""
from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import pytest

from shim.decision import (
    ContainerFacts,
    NodeFacts,
    PodFacts,
    Policy,
    QoSClass,
    Request,
    RequestSource,
    decide,
    memory_high,
    oom_score_adj_bounds,
    parse_cgroup_parent,
    resolve_request,
)
from shim.node.state import ContainerRecord, pod_request

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MEMORY_QOS = DOCS / "memory-qos.md"
MI = 2**20

PARENTS = {
    QoSClass.GUARANTEED: "/kubepods/pod1f0c2a9e-0000-4000-8000-000000000005",
    QoSClass.BURSTABLE: "/kubepods/burstable/pod1f0c2a9e-0000-4000-8000-000000000005",
    QoSClass.BESTEFFORT: "/kubepods/besteffort/pod1f0c2a9e-0000-4000-8000-000000000005",
}


# -- markdown tables -------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(path: Path, first_columns: list[str]) -> list[dict[str, str]]:
    """The rows of the one table whose header starts with ``first_columns``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        if not line.lstrip().startswith("|"):
            continue
        head = _cells(line)
        if head[: len(first_columns)] != first_columns or not re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            continue
        rows = []
        for row in lines[i + 2:]:
            if not row.lstrip().startswith("|"):
                break
            rows.append(dict(zip(head, _cells(row))))
        found.append(rows)
    assert len(found) == 1, f"{path.name}: expected one table starting with {first_columns}, found {len(found)}"
    assert found[0], f"{path.name}: the table starting with {first_columns} is empty"
    return found[0]


def mebibytes(cell: str) -> int:
    """'800Mi' -> bytes; '0' -> 0."""
    m = re.fullmatch(r"(\d+)(Mi)?", cell)
    assert m, f"not a Mi quantity: {cell!r}"
    return int(m.group(1)) * (MI if m.group(2) else 1)


def container_decision(qos: QoSClass, request: int, limit: int, allocatable: int, factor: float | None,
                       page: int, policy: Policy = Policy.HARD):
    node = NodeFacts(capacity=allocatable, allocatable=allocatable, page_size=page, factor=factor)
    pod = PodFacts(uid="1f0c2a9e-0000-4000-8000-000000000005", cgroup_parent=PARENTS[qos])
    # BestEffort: let the shim find that there is no request; otherwise state it
    req = None if qos is QoSClass.BESTEFFORT else Request(request, RequestSource.GIVEN)
    d = decide(pod, ContainerFacts(name="c", limit=limit), node, policy, req)
    assert d.qos is qos
    return d


# -- docs/memory-qos.md: the worked table ---------------------------------------------------
WORKED = table(MEMORY_QOS, ["request", "factor", "computation", "memory.high"])


def test_worked_table_is_the_standard_table():
    pairs = [(mebibytes(r["request"]) // MI, r["factor"]) for r in WORKED]
    assert pairs == [(0, "0.9"), (100, "0.9"), (500, "0.9"), (800, "0.9"), (900, "0.9"), (1000, "0.9"),
                     (500, "0.6"), (800, "0.6"), (500, "0.8"), (850, "0.8"), (500, "0.4")]


@pytest.mark.parametrize("row", WORKED, ids=lambda r: f"{r['request']}@{r['factor']}")
def test_worked_table_row_matches_the_decision(row):
    limit, page = 1000 * MI, MI
    request, factor = mebibytes(row["request"]), float(row["factor"])
    d = container_decision(QoSClass.BURSTABLE, request, limit, 64 << 30, factor, page)
    shown = row["memory.high"]
    if shown == "not set":
        assert "memory.high" not in d.unified_after, d.reasons["memory.high"]
        assert "request = limit" in row["computation"] and request == limit
        return
    expected = mebibytes(shown)
    assert d.unified_after["memory.high"] == str(expected), d.reasons["memory.high"]
    assert memory_high(request, limit, factor, page) == expected
    # the computation column: "R + (1000 − R) × f = R + P", all in Mi
    m = re.fullmatch(r"(\d+) \+ \(1000 − (\d+)\) × ([\d.]+) = (\d+) \+ (\d+)", row["computation"])
    assert m, f"computation not in the form 'R + (1000 − R) × f = R + P': {row['computation']!r}"
    r1, r2, f, r3, product = m.groups()
    assert int(r1) == int(r2) == int(r3) == request // MI and f == row["factor"]
    assert Fraction(1000 - request // MI) * Fraction(f) == int(product)
    assert (int(r1) + int(product)) * MI == expected


def test_worked_table_does_not_encode_the_published_slips():
    by_request = {(r["request"], r["factor"]): r["memory.high"] for r in WORKED}
    assert by_request[("800Mi", "0.9")] == "980Mi"
    assert by_request[("900Mi", "0.9")] == "990Mi"
    text = MEMORY_QOS.read_text(encoding="utf-8")
    assert "960Mi" in text and "500Gi" in text, "the page should name the slips it corrects"


# -- docs/memory-qos.md: more cases ---------------------------------------------------------
CASES = table(MEMORY_QOS, ["case", "QoS"])


@pytest.mark.parametrize("row", CASES, ids=lambda r: r["case"])
def test_more_cases_match_the_decision(row):
    qos = QoSClass(row["QoS"])
    factor = None if row["factor"] == "none" else float(row["factor"])
    d = container_decision(qos, int(row["request"]), int(row["limit"]), int(row["allocatable"]), factor,
                           int(row["page"]))
    for key in ("memory.min", "memory.low", "memory.high"):
        if row[key] == "not set":
            assert key not in d.unified_after, (key, d.reasons[key])
        else:
            assert d.unified_after.get(key) == row[key], (key, d.reasons[key])


def test_worked_first_case_arithmetic_in_the_prose():
    text = MEMORY_QOS.read_text(encoding="utf-8")
    assert "= 255013683, rounded down to 4096 → 62259 pages =\n255012864" in text
    assert 134217728 + (268435456 - 134217728) * 0.9 // 1 == 255013683
    assert 62259 * 4096 == 255012864 == memory_high(134217728, 268435456, 0.9, 4096)
    assert 7549747 * 4096 == 30923763712 == memory_high(0, 34359738368, 0.9, 4096)


def test_float64_example_in_the_prose():
    text = MEMORY_QOS.read_text(encoding="utf-8")
    assert "258047.99999999997" in text and "253952" in text
    assert repr(368640 * 0.7) == "258047.99999999997"
    assert memory_high(0, 368640, 0.7, 4096) == 253952


# -- docs/memory-qos.md: oom_score_adj, QoS from the cgroup parent, the pod request -------------
def test_oom_score_adj_example():
    rows = {r["oom_score_adj example"]: int(r["value"]) for r in table(MEMORY_QOS, ["oom_score_adj example"])}
    capacity, request = rows["capacity"], rows["true request"]
    adj = 1000 - (1000 * request) // capacity  # the kubelet's formula (no clamping needed here)
    assert rows["oom_score_adj"] == adj and rows["k"] == 1000 - adj
    assert oom_score_adj_bounds(adj, capacity) == (rows["lower bound"], rows["upper bound"])
    assert rows["lower bound"] <= request < rows["upper bound"]
    pod = PodFacts(cgroup_parent=PARENTS[QoSClass.BURSTABLE])
    got = resolve_request(pod, ContainerFacts(name="c", oom_score_adj=adj), QoSClass.BURSTABLE, capacity)
    assert (got.bytes, got.source, got.upper) == (rows["lower bound"], RequestSource.OOM_SCORE_ADJ,
                                                 rows["upper bound"])


@pytest.mark.parametrize("row", table(MEMORY_QOS, ["cgroup parent", "driver", "QoS class"]),
                         ids=lambda r: r["cgroup parent"][-40:])
def test_qos_class_from_cgroup_parent(row):
    parent = row["cgroup parent"].strip("`")
    qos, uid = parse_cgroup_parent(parent)
    assert qos is QoSClass(row["QoS class"])
    assert uid.replace("_", "-") == "1f0c2a9e-0000-4000-8000-000000000005"
    assert (".slice" in parent) == (row["driver"] == "systemd")


def test_pod_request_example():
    text = " ".join(MEMORY_QOS.read_text(encoding="utf-8").split())
    m = re.search(r"an init container asking (\d+)Mi, a sidecar (\d+)Mi started before it, and two regular "
                  r"containers of (\d+)Mi and (\d+)Mi, overhead 0: `max\((\d+) \+ (\d+) \+ (\d+), (\d+) \+ (\d+)\)` "
                  r"= (\d+)Mi", text)
    assert m, "the pod request example is not where test_docs.py expects it"
    init, sidecar, app1, app2, *_, result = (int(x) for x in m.groups())
    ns = 10**9

    def rec(cid, name, order, mi, **kw):
        return ContainerRecord(id=cid, sandbox_id="s", name=name, request=mi * MI, order=order,
                               created_at=(order + 1) * ns, first_gen=1, **kw)

    containers = [
        rec("a", "sidecar", 0, sidecar, alive_gen=1),  # still running when the others were created
        rec("b", "init", 1, init, finished_at=int(2.5 * ns)),  # exited before the next one was created
        rec("c", "app1", 2, app1, alive_gen=1),
        rec("d", "app2", 3, app2, alive_gen=1),
    ]
    got = pod_request(containers)
    assert got.bytes == result * MI == max(sidecar + app1 + app2, init + sidecar) * MI
    assert got.kinds == {"a": "sidecar", "b": "init", "c": "regular", "d": "regular"}


def test_section_numbers_the_code_cites():
    """Code comments cite "reference section N" (shim/decision/memory.py: 1, shim/node/reconciler.py: 2,
    shim/node/facts.py: 3, shim/decision/guard.py: 4)."""
    headings = re.findall(r"^## (\d+)\. (.+)$", MEMORY_QOS.read_text(encoding="utf-8"), flags=re.M)
    numbered = {int(n): title for n, title in headings}
    assert numbered[1].startswith("Container level")
    assert numbered[2].startswith("Pod, QoS and node level")
    assert numbered[3].startswith("What CRI carries")
    assert numbered[4].startswith("Kernel facts")


# -- docs/memory-qos.md: the policies (sections 1 and 2) ------------------------------------------
POLICY_CELL = re.compile(r"`(\w+)`")


def _policy(cell: str) -> Policy:
    name = POLICY_CELL.match(cell).group(1)
    policy = Policy(name)
    assert policy.value == name, f"{name!r} is not an upstream name (the tables use the new names)"
    return policy


@pytest.mark.parametrize("row", table(MEMORY_QOS, ["policy", "Guaranteed", "Burstable", "BestEffort"]),
                         ids=lambda r: r["policy"])
def test_container_protection_per_policy(row):
    policy = _policy(row["policy"])
    for qos in QoSClass:
        d = container_decision(qos, 0 if qos is QoSClass.BESTEFFORT else 128 * MI,
                               0 if qos is QoSClass.BESTEFFORT else 256 * MI, 8 << 30, None, 4096, policy)
        keys = {k: v for k, v in d.unified_after.items() if k in ("memory.min", "memory.low")}
        shown = row[qos.value]
        if shown == "nothing":
            assert keys == {}, (qos, d.reasons)
        else:
            key, what = (s.strip() for s in shown.split("="))
            assert what in ("request", "request, capped under the limit") and keys == {key: str(128 * MI)}, (qos, keys)
            at_limit = container_decision(qos, 256 * MI, 256 * MI, 8 << 30, None, 4096, policy)
            capped = {k: v for k, v in at_limit.unified_after.items() if k in ("memory.min", "memory.low")}
            if what == "request":
                assert capped == {key: str(256 * MI)}, (qos, capped)
            else:  # 256Mi - ceil(25.6Mi), rounded down to a page; memory.low the request
                assert key == "memory.min" and capped == {key: "241590272", "memory.low": str(256 * MI)}, (qos, capped)


def test_policy_names_in_any_case():
    text = " ".join(MEMORY_QOS.read_text(encoding="utf-8").split())
    assert "The names are matched in any case (`hard`, `TIEREDRESERVATION`)" in text
    for spelling, name in (("none", "None"), ("hard", "Hard"), ("TIEREDRESERVATION", "TieredReservation")):
        assert Policy(spelling) is Policy(name)
    assert {p.value for p in Policy} == {"Hard", "Soft", "TieredReservation", "None"}


def _min_low(cell: str) -> tuple[int, int]:
    lo, hi = (mebibytes(x.strip()) for x in cell.split("/"))
    return lo, hi


def _example_state():
    from tests.test_node_state import _state_with

    return _state_with([("0a", "guaranteed", [64], True), ("0b", "burstable", [32], True)])


@pytest.mark.parametrize("row", table(MEMORY_QOS, ["policy", "kubepods min / low"]), ids=lambda r: r["policy"])
def test_pod_qos_node_example_per_policy(row):
    from shim.effects import CgroupLayout
    from shim.node.reconciler import compute_targets

    targets, refusals = compute_targets(_example_state(), CgroupLayout("cgroupfs"), _policy(row["policy"]), 4096)
    assert refusals == []
    got = {k: t.value for k, t in targets.items()}
    for column, path in (("kubepods min / low", "kubepods"), ("`kubepods/burstable` min / low", "kubepods/burstable"),
                         ("Guaranteed pod min / low", "kubepods/pod0a"),
                         ("Burstable pod min / low", "kubepods/burstable/pod0b")):
        assert (got[(path, "memory.min")], got[(path, "memory.low")]) == _min_low(row[column]), column


# -- docs/memory-qos.md section 6: who owns each value, a v1.37 kubelet ------------------------------
def _kubelet_doc(cell: str) -> dict:
    """'`MemoryQoS: true`, `memoryThrottlingFactor: 0.8`' -> a KubeletConfiguration; 'defaults' -> {}."""
    import yaml

    doc: dict = {}
    for item in re.findall(r"`([^`]+)`", cell):
        for key, value in yaml.safe_load(item).items():
            if key == "MemoryQoS":
                doc.setdefault("featureGates", {})["MemoryQoS"] = value
            else:
                doc[key] = value
    assert doc or cell == "defaults", cell
    return doc


OWNERSHIP = table(MEMORY_QOS, ["kubelet", "KubeletConfiguration", "shim policy"])


@pytest.mark.parametrize("row", OWNERSHIP, ids=lambda r: f"{r['kubelet']}-{r['KubeletConfiguration']}-{r['shim policy']}")
def test_ownership_table(row):
    from shim.node.kubelet import LABELS, kubelet_writes, ownership, parse_version
    from shim.node.facts import kubelet_facts_from_dict

    version = None if row["kubelet"] == "unknown" else parse_version(row["kubelet"])
    writes = kubelet_writes(kubelet_facts_from_dict(_kubelet_doc(row["KubeletConfiguration"]), "docs"), version)
    owners = ownership(writes, _policy(row["shim policy"]))
    columns = dict(zip(LABELS, ("container min / low", "container high", "pod", "QoS", "kubepods", "reserved")))
    assert {what: row[col] for what, col in columns.items()} == {what: owners.owner(what) for what in LABELS}


V137_ALLOC = 2060419072 - 200 * MI


def _v137(cell: str):
    from shim.node.kubelet import kubelet_writes, ownership
    from shim.node.facts import kubelet_facts_from_dict

    base = {"cgroupDriver": "cgroupfs", "kubeReserved": {"memory": "100Mi"}, "systemReserved": {"memory": "100Mi"}}
    kubelet = kubelet_facts_from_dict({**base, **_kubelet_doc(cell)}, "docs")
    assert 2060419072 - kubelet.kube_reserved - kubelet.system_reserved == V137_ALLOC
    writes = kubelet_writes(kubelet, (1, 37))
    return kubelet, writes, ownership(writes, Policy.HARD)


def _unified_cell(cell: str) -> dict[str, str]:
    return {f"memory.{k}": v for k, v in (kv.split("=") for kv in cell.split())}


@pytest.mark.parametrize("row", table(MEMORY_QOS, ["1.37 kubelet", "container"]),
                         ids=lambda r: f"{r['1.37 kubelet']}-{r['container']}")
def test_v137_worked_example_containers(row):
    from shim.tools.kubelet_requests import kubelet_unified
    from shim.node.facts import node_facts

    assert "1850703872" in MEMORY_QOS.read_text(encoding="utf-8") and V137_ALLOC == 1850703872
    kubelet, writes, owners = _v137(row["1.37 kubelet"])
    qos = QoSClass(row["container"])
    request, limit = mebibytes(row["request"]), mebibytes(row["limit"])
    sent = kubelet_unified(writes, qos.value, request=request, limit=limit, allocatable=V137_ALLOC)
    assert sent.pop("memory.oom.group") == "1"
    assert sent == _unified_cell(row["the kubelet sends"])
    node = node_facts(2060419072, kubelet, page_size=4096, factor="auto")  # the shim's --factor auto
    assert (node.allocatable, node.factor) == (V137_ALLOC, 0.9)
    pod = PodFacts(uid="1f0c2a9e-0000-4000-8000-000000000005", cgroup_parent=PARENTS[qos])
    req = None if qos is QoSClass.BESTEFFORT else Request(request, RequestSource.GIVEN)
    d = decide(pod, ContainerFacts(name="c", limit=limit, unified={**sent, "memory.oom.group": "1"}), node,
               Policy.HARD, req, kubelet_owns=owners.kubelet_keys())
    after = dict(d.unified_after)
    assert after.pop("memory.oom.group") == "1"
    assert after == _unified_cell(row["the shim forwards"]), d.reasons


def test_v137_worked_example_arithmetic_in_the_prose():
    text = " ".join(MEMORY_QOS.read_text(encoding="utf-8").split())
    assert "`floor(33554432 + (134217728 − 33554432) × 0.9)` = 124151398, rounded down to a page 124149760" in text
    assert "`floor(1850703872 × 0.9)` = 1665633484, rounded down 1665630208" in text
    assert int(33554432 + (134217728 - 33554432) * 0.9) == 124151398
    assert memory_high(32 * MI, 128 * MI, 0.9, 4096) == 124149760
    assert int(1850703872 * 0.9) == 1665633484 and memory_high(0, 1850703872, 0.9, 4096) == 1665630208


@pytest.mark.parametrize("row", table(MEMORY_QOS, ["1.37 kubelet", "kubepods min / low"]),
                         ids=lambda r: r["1.37 kubelet"])
def test_v137_worked_example_pod_qos_node(row):
    from shim.effects import CgroupLayout
    from shim.node.reconciler import compute_targets

    _, writes, owners = _v137(row["1.37 kubelet"])
    scopes = owners.kubelet_scopes()
    shown = {"kubepods": _min_low(row["kubepods min / low"]),
             "kubepods/burstable": _min_low(row["`kubepods/burstable` min / low"]),
             "kubepods/pod0a": _min_low(row["Guaranteed pod min / low"]),
             "kubepods/burstable/pod0b": _min_low(row["Burstable pod min / low"])}
    targets, _ = compute_targets(_example_state(), CgroupLayout("cgroupfs"), Policy.HARD, 4096,
                                 kubelet_owns=scopes)
    if row["written by"] == "shim":
        assert not scopes
        assert {p: (targets[(p, "memory.min")].value, targets[(p, "memory.low")].value) for p in shown} == shown
    else:
        assert row["written by"] == "kubelet" and scopes == {"pod", "qos", "kubepods", "reserved"} and targets == {}
        # the kubelet's own TieredReservation (KEP-2570, v1.36+): kubepods min = G + B, burstable low = B,
        # Guaranteed pods min, Burstable pods low
        assert writes.protection is Policy.TIERED_RESERVATION
        g, b = 64 * MI, 32 * MI
        assert shown == {"kubepods": (g + b, 0), "kubepods/burstable": (0, b), "kubepods/pod0a": (g, 0),
                         "kubepods/burstable/pod0b": (0, b)}


# -- links and self-containment ---------------------------------------------------------------
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(\S+)", re.M)


def links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)  # not in code blocks
    return [a or b for a, b in _LINK.findall(text)]


def test_docs_exist():
    for name in ("README.md", "trace-format.md", "memory-qos.md", "architecture.md"):
        assert (DOCS / name).is_file(), name


def _without_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    """The #fragments GitHub gives the headings of a markdown page: lower case, punctuation
    other than - and _ dropped, spaces to -, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_code(path.read_text(encoding="utf-8")), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_anchors_are_githubs():
    page = "# A page\n## HTTP/2 limits of the relay\n```\n# not a heading\n```\n" \
           "### The systemd guest (`scripts/e2e-vm --guest systemd`)\n## The kubelet's own Memory QoS\n## Notes\n## Notes\n"
    path = DOCS / "nonexistent-for-anchors.md"
    import unittest.mock

    with unittest.mock.patch.object(Path, "read_text", return_value=page):
        got = anchors(path)
    assert got == {"a-page", "http2-limits-of-the-relay", "the-systemd-guest-scriptse2e-vm---guest-systemd",
                   "the-kubelets-own-memory-qos", "notes", "notes-1"}


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_into_the_repository(path):
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            assert target.startswith(("http://", "https://", "mailto:")), target
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        assert resolved.is_relative_to(ROOT), f"{path.name}: {target} leaves the repository"
        assert resolved.exists(), f"{path.name}: {target} does not exist"
        if fragment and resolved.suffix == ".md":
            assert fragment in anchors(resolved), f"{path.name}: {target}: no such heading in {resolved.name}"


README_MAX_LINES = 250


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    text = "\n".join(lines)
    for must in ("memqos-shim serve", "memqos-shim nri", "deploy/install.sh", "deploy/uninstall.sh",
                 "kubectl apply -k deploy/kubernetes/", "--container-runtime-endpoint", "containerRuntimeEndpoint",
                 "kubeadm-flags.env", "memqos-shim reset", "docs/install.md", "docs/configuration.md"):
        assert must in text, f"README.md does not say {must!r}"
    for kustomization in re.findall(r"kubectl apply -k (deploy/kubernetes/[\w-]+)", text):
        assert (ROOT / kustomization / "kustomization.yaml").is_file(), kustomization


# Words that tell how the code got here instead of how it is. Code (fenced blocks and `spans`)
# is not prose and is left out: `systemctl enable --now` is a flag.
HISTORY = re.compile(
    r"\b[Ii]ssue (?:[A-Z]|\d+)\b|(?i:\bsessions?\b|\brounds? of work\b|\bused to\b"
    r"|\bnow\b|\bbefore this change\b|\bredesign(?:ed)?\b|\bwas changed\b|\bstill accepted\b"
    r"|\bearlier (?:names?|version|tables?)\b|\bprevious version\b|\bpreviously\b|\bthese changes\b"
    r"|\b(?:is|are) to come\b)")


def history_phrases(text: str) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _without_code(text))
    return [m.group(0) for m in HISTORY.finditer(prose)]


def test_the_history_check_catches_narration():
    assert history_phrases("The redesign of issue I used to write it; it is now a relay (session 2).") == [
        "redesign", "issue I", "used to", "now", "session"]
    assert history_phrases("Run `systemctl enable --now memqos-shim`.\n```\nnow\n```\n") == []
    assert history_phrases("rounded down to a page; memory.high no longer reads max; the issue of runc") == []


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history_in_the_docs(path):
    found = history_phrases(path.read_text(encoding="utf-8"))
    assert found == [], f"{path.relative_to(ROOT)} tells history ({found[:5]}): say how things are instead"


def test_docs_index_lists_every_page():
    index = links(DOCS / "README.md")
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert page.name in index, f"docs/README.md does not link {page.name}"


_SHARED = re.compile(r"\.\./shared|(?<![\w.-])shared[/]")  # [/]: so that grep for the path finds no hit here


@pytest.mark.parametrize("path", [
    *sorted(DOCS.glob("*.md")),
    ROOT / "README.md",
    ROOT / "tests" / "data" / "traces" / "README.md",
    ROOT / "tests" / "golden" / "README.md",
], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_mention_of_the_shared_directory(path):
    hits = [line for line in path.read_text(encoding="utf-8").splitlines() if _SHARED.search(line)]
    assert hits == [], f"{path.relative_to(ROOT)} mentions material outside the repository: {hits[:3]}"
