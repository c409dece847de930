"""deploy/grafana and deploy/prometheus: the dashboard and the alert rules use only metric names
the shim exports (collected from the /metrics of a real `serve` and a real `nri`), the rules are
well-formed alerting rules (and pass `promtool check rules` where promtool is installed), and the
PrometheusRule object holds the same groups."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.tools import require_tool
import yaml

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy" / "grafana" / "memqos-shim.json"
RULES = REPO / "deploy" / "prometheus" / "memqos-shim-rules.yaml"
OPERATOR_RULES = REPO / "deploy" / "prometheus" / "memqos-shim-prometheusrule.yaml"
PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself for every target

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping
    clauses, Grafana variables and function names left out)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    e = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_names_finds_the_selected_series_only():
    assert metric_names('sum by (le, method) (rate(memqos_x_bucket{instance=~"$instance",code="A"}[$__rate_interval]))'
                        ) == {"memqos_x_bucket"}
    assert metric_names("time() - memqos_a > 120 or increase(memqos_b_total[5m]) > 0.5") == {"memqos_a",
                                                                                           "memqos_b_total"}


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape can hold: the samples, and what the TYPE lines announce
    (a family without samples yet is still a name the shim exports)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
        elif line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names


def scrape_serve() -> str:
    from memqos_dev.testing.fake_runtime import FakeRuntimeServer
    from tests.test_health_endpoints import get, metrics_address
    from tests.test_serve import Shim, short_dir

    base = short_dir()
    with FakeRuntimeServer(base / "runtime.sock") as runtime:
        shim = Shim(base, runtime.address, extra=("--metrics-address", "127.0.0.1:0", "--reclaim", "true",
                                                   "--monitor-interval", "0.1"))
        try:
            addr = metrics_address(shim, time.monotonic() + 60)
            return get(f"http://{addr}/metrics")[1]
        finally:
            shim.stop()


def scrape_nri(tmp: Path) -> str:
    import asyncio

    from memqos_dev.testing.fake_nri_runtime import FakeNriRuntime
    from tests.test_health_endpoints import get
    from tests.test_nri_front import Stack, run

    st = Stack(tmp, extra=("--metrics-address", "127.0.0.1:0", "--monitor-interval", "0.1", "--reclaim", "true"))

    async def main() -> str:
        service = st.service()
        await service.start()
        try:
            async with FakeNriRuntime(st.sock) as rt:
                await rt.next_plugin()
                host, port = service.metrics.address
                return (await asyncio.get_running_loop().run_in_executor(
                    None, get, f"http://{host}:{port}/metrics"))[1]
        finally:
            await service.stop()
    return run(main())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    serve, nri = scrape_serve(), scrape_nri(tmp_path_factory.mktemp("nri"))
    names = exposed_names(serve) | exposed_names(nri)
    # what the collection must have found for the check to mean anything
    assert {"memqos_fail_open_total", "memqos_cri_call_duration_seconds_bucket", "memqos_ready",
            "memqos_h2_limit_hits_total", "memqos_reclaim_writes_total"} <= exposed_names(serve)
    assert {"memqos_nri_registered", "memqos_nri_registrations_total", "memqos_healthy"} <= exposed_names(nri)
    return names


def dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))
    walk(doc["panels"])
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((\w+),\s*\w+\)", q)
            out.append((f"variable {var['name']}", inner.group(1) if inner else q))
    return out


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def alert_rules() -> list[dict]:
    return [r for g in rules_doc()["groups"] for r in g["rules"]]


def test_the_dashboard_uses_only_exported_metrics(exported):
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    unknown = {(title, n) for title, e in exprs for n in metric_names(e) - exported - PROMETHEUS_OWN}
    assert unknown == set()
    assert all(metric_names(e) for _, e in exprs)  # each panel shows some series


def test_the_alert_rules_use_only_exported_metrics(exported):
    unknown = {(r["alert"], n) for r in alert_rules() for n in metric_names(r["expr"]) - exported - PROMETHEUS_OWN}
    assert unknown == set()


def test_the_alerts_cover_what_an_operator_must_hear_about():
    used = set().union(*(metric_names(r["expr"]) for r in alert_rules()))
    for name in ("memqos_fail_open_total", "memqos_reconciler_errors_total", "memqos_reconciler_lag_seconds",
                 "memqos_guard_actions_total", "memqos_audit_records_dropped_total",
                 "memqos_transport_upstream_unreachable_total", "memqos_h2_limit_hits_total",
                 "memqos_nri_registered", "memqos_nri_registrations_total", "memqos_ready", "memqos_healthy"):
        assert name in used, name


DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}
GROUP_KEYS = {"name", "interval", "rules", "limit", "query_offset"}


def template_ok(text: str) -> bool:
    return text.count("{{") == text.count("}}") and all(
        re.fullmatch(r"\s*(\$labels\.\w+|\$value|\$value \| \w+)\s*", t) for t in re.findall(r"{{(.*?)}}", text))


def test_the_rules_file_is_well_formed():
    doc = rules_doc()
    assert set(doc) == {"groups"}
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names))
    alerts = []
    for g in doc["groups"]:
        assert set(g) <= GROUP_KEYS and g["rules"]
        for r in g["rules"]:
            assert set(r) <= RULE_KEYS, r
            assert ("alert" in r) != ("record" in r)
            assert isinstance(r["expr"], str) and r["expr"].strip()
            assert r["expr"].count("(") == r["expr"].count(")")
            if "for" in r:
                assert DURATION.match(r["for"]), r["for"]
            assert re.fullmatch(r"MemqosShim[A-Z][A-Za-z0-9]+", r["alert"])
            assert r["labels"]["severity"] in ("critical", "warning", "info")
            assert set(r["annotations"]) >= {"summary", "description"}
            assert all(template_ok(v) for v in r["annotations"].values()), r["alert"]
            alerts.append(r["alert"])
    assert len(alerts) == len(set(alerts))


def test_the_prometheusrule_holds_the_same_groups():
    doc = yaml.safe_load(OPERATOR_RULES.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["metadata"]["name"] == "memqos-shim"
    assert doc["spec"]["groups"] == rules_doc()["groups"]


def test_promtool_accepts_the_rules():
    out = subprocess.run([require_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each panel's query, with Grafana's variables filled in, as a recording rule: promtool
    parses the PromQL."""
    rules = [{"record": f"memqos:panel_{i}", "expr": e.replace("$__rate_interval", "5m").replace("$instance", ".*")}
             for i, (_, e) in enumerate(dashboard_exprs())]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run([require_tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
