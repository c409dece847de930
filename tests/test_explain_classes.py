"""`memqos-shim explain --class NAME --config FILE [--namespace NS]`: the values a container of a
class gets, through the shim's own class choice (an unknown class, a class the namespace may not
use, a malformed name: the node's values and the refusal, as serve does)."""
from __future__ import annotations

import json

import pytest

from shim.cli.main import build_parser

CLASSES = """
classes:
  latency-critical: {factor: none}
  batch: {factor: 0.5, reclaim: true, policy: Soft}
  swapper: {swap: true, guard-action: none}
namespace-classes:
  default: [latency-critical, batch]
  "*": [swapper]
"""
BASE = ["explain", "--request", "128Mi", "--limit", "256Mi", "--allocatable", "32Gi", "--page-size", "4096"]


def explain(capsys, *extra: str, config: str | None = None) -> tuple[int, dict | str, str]:
    argv = BASE + list(extra) + (["--config", config] if config else [])
    args = build_parser().parse_args(argv)
    rc = args.func(args)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if "--json" in extra and rc == 0 else out), err


@pytest.fixture
def conf(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text(CLASSES)
    return str(f)


def test_without_a_class_the_values_are_the_nodes(capsys):
    rc, out, _ = explain(capsys, "--json")
    assert rc == 0 and out["unified"] == {"memory.min": "134217728", "memory.high": "255012864"}
    assert "class" not in out


def test_a_class_changes_policy_factor_and_reclaim(capsys, conf):
    rc, out, _ = explain(capsys, "--class", "batch", "--json", config=conf)
    assert rc == 0
    assert out["unified"] == {"memory.low": "134217728", "memory.high": "201326592"}  # Soft; 128Mi + 128Mi x 0.5
    assert out["class"] == "batch" and out["policy"] == "Soft" and out["factor"] == 0.5 and out["reclaim"] is True
    rc, text, _ = explain(capsys, "--class", "batch", config=conf)
    assert "class batch: guard action relax, reclaim on" in text and "policy Soft" in text


def test_factor_none_gives_no_memory_high_and_never_more_than_the_request(capsys, conf):
    rc, out, _ = explain(capsys, "--class", "latency-critical", "--json", config=conf)
    assert rc == 0 and out["unified"] == {"memory.min": "134217728"} and out["factor"] is None


def test_a_namespace_the_class_is_not_allowed_in_gets_the_nodes_values(capsys, conf):
    _, node, _ = explain(capsys, "--json")
    rc, out, _ = explain(capsys, "--class", "batch", "--namespace", "tenant-a", "--json", config=conf)
    assert rc == 0 and out["unified"] == node["unified"]
    assert out["class"] is None and out["class_refused"] == "namespace-not-allowed"
    rc, text, _ = explain(capsys, "--class", "batch", "--namespace", "tenant-a", config=conf)
    assert "class: refused (namespace-not-allowed)" in text and "'tenant-a'" in text
    # allowed where namespace-classes says so: default by name, swapper everywhere ("*")
    assert explain(capsys, "--class", "batch", "--namespace", "default", "--json", config=conf)[1]["class"] == "batch"
    out = explain(capsys, "--class", "swapper", "--namespace", "tenant-a", "--json", config=conf)[1]
    assert out["class"] == "swapper" and out["swap"] is True and out["guard_action"] == "none"


@pytest.mark.parametrize("name,reason", [("nope", "unknown-class"), ("Not_A-Name", "malformed"),
                                         ("x" * 300, "malformed")])
def test_unknown_and_malformed_classes_are_refused(capsys, conf, name, reason):
    _, node, _ = explain(capsys, "--json")
    rc, out, _ = explain(capsys, "--class", name, "--json", config=conf)
    assert rc == 0 and out["class_refused"] == reason and out["unified"] == node["unified"]
    assert len(out["class_note"]) < 300


def test_class_needs_a_config_and_a_bad_config_is_named(capsys, tmp_path):
    rc, _, err = explain(capsys, "--class", "batch")
    assert rc == 2 and "--class needs --config" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  batch: {factor: 7}\n")
    rc, _, err = explain(capsys, "--class", "batch", config=str(bad))
    assert rc == 2 and "bad.yaml:1: classes: class 'batch': factor" in err


def test_namespace_without_a_class_is_refused(capsys, conf):
    rc, _, err = explain(capsys, "--namespace", "default", config=conf)
    assert rc == 2 and "go with --class" in err
