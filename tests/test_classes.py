"""Memory QoS classes: the config keys `classes` and `namespace-classes` (parsed strictly, errors
naming the file, line and key), the pure choice of a container's class from its pod's
annotations (shim/decision/classes.py) and how a class turns the node's settings into the
container's."""
from __future__ import annotations

import argparse
from types import MappingProxyType

import pytest

from shim.app.config import ConfigError, add_arguments, resolve
from shim.app.config_classes import class_table
from shim.decision import NodeFacts, PodFacts, Policy
from shim.decision.classes import (
    FROM_CONTAINER,
    FROM_MEMORY,
    FROM_POD,
    MALFORMED,
    NAMESPACE_NOT_ALLOWED,
    NO_CLASS,
    UNKNOWN_CLASS,
    ContainerClass,
    ContainerSettings,
    apply_class,
    choose_class,
    make_table,
    remembered,
)

CONFIG = """\
policy: Soft
classes:
  latency-critical: {factor: none, guard-action: none}
  batch: {factor: 0.5, reclaim: true, policy: None}
  swappy: {swap: true, protection-headroom-ratio: 0.2, protection-headroom-min: 16Mi}
namespace-classes:
  default: [latency-critical, batch]
  "*": [swappy]
"""


def load(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(["--config", str(path)]))


def error_of(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, text)
    return str(e.value)


def pod(namespace="default", **annotations) -> PodFacts:
    return PodFacts(uid="u", namespace=namespace, name="p", annotations=MappingProxyType(annotations))


NODE = NodeFacts(capacity=8 << 30, allocatable=7 << 30, page_size=4096, factor=0.9)
BASE = ContainerSettings(None, NODE, Policy.HARD, "relax", False)


def test_the_config_keys_make_a_frozen_class_table(tmp_path):
    cfg = load(tmp_path, CONFIG)
    table = class_table(cfg)
    assert sorted(table.classes) == ["batch", "latency-critical", "swappy"]
    assert table.classes["latency-critical"] == ContainerClass("latency-critical", factor_set=True, factor=None,
                                                               guard_action="none")
    assert table.classes["batch"].policy is Policy.NONE and table.classes["batch"].reclaim is True
    assert table.classes["swappy"].headroom_min == 16 << 20 and table.classes["swappy"].swap
    assert table.allowed("default", "batch") and table.allowed("other", "swappy")
    assert not table.allowed("other", "batch")
    assert table.allowed_in("other") == ("swappy",)
    hash(cfg)  # a Config stays hashable with classes
    with pytest.raises(TypeError):
        table.classes["x"] = ContainerClass("x")  # type: ignore[index]
    # no classes: an empty table, which looks at no annotation
    assert not class_table(load(tmp_path, "policy: Soft\n"))


@pytest.mark.parametrize("text,said", [
    ("classes:\n  batch: {factor: 2}\n", ":1: classes: class 'batch': factor: must be in (0, 1]"),
    ("classes:\n  batch: {factor: auto}\n", ":1: classes: class 'batch': factor: a class's factor"),
    ("classes:\n  batch: {colour: blue}\n", ":1: classes: class 'batch': unknown setting 'colour'"),
    ("classes:\n  Batch: {}\n", ":1: classes: class 'Batch' is not a class name"),
    ("classes:\n  batch: {policy: firm}\n", ":1: classes: class 'batch': policy: policy must be one of"),
    ("classes:\n  batch: {guard-action: kill}\n", ":1: classes: class 'batch': guard-action: guard action must"),
    ("classes:\n  batch: {reclaim: maybe}\n", ":1: classes: class 'batch': reclaim: expected true or false"),
    ("classes:\n  batch: {swap: maybe}\n", ":1: classes: class 'batch': swap: expected true or false"),
    ("classes:\n  batch: {protection-headroom-ratio: 1}\n", ":1: classes: class 'batch': protection-headroom-ratio"),
    ("classes:\n  batch: {protection-headroom-min: lots}\n", ":1: classes: class 'batch': protection-headroom-min"),
    ("classes: [batch]\n", ":1: classes: expected a map"),
    ("classes:\n  batch: 3\n", ":1: classes: class 'batch': expected a map of settings"),
    ("policy: Hard\nclasses:\n  batch: {}\nnamespace-classes:\n  default: [batch, gold]\n",
     ":4: namespace-classes: namespace 'default' lists ['gold'], which classes does not define"),
    ("namespace-classes:\n  default: [gold]\n", ":1: namespace-classes: namespace 'default' lists ['gold']"),
    ("classes:\n  batch: {}\nnamespace-classes:\n  Default_NS: [batch]\n",
     ":3: namespace-classes: 'Default_NS' is not a namespace name"),
    ("classes:\n  batch: {}\nnamespace-classes:\n  default: {batch: 1}\n",
     ":3: namespace-classes: namespace 'default': expected a list"),
])
def test_a_bad_class_setting_names_the_file_line_and_key(tmp_path, text, said):
    msg = error_of(tmp_path, text)
    assert msg.startswith(str(tmp_path / "c.yaml") + said), msg


def test_the_container_annotation_wins_over_the_pods():
    table = make_table({"batch": ContainerClass("batch"), "gold": ContainerClass("gold")},
                       {"default": ["batch", "gold"]})
    p = pod(**{"memqos.io/class": "batch", "memqos.io/class.db": "gold"})
    assert choose_class(table, p, "db") == choose_class(table, p, "db")
    assert (choose_class(table, p, "db").name, choose_class(table, p, "db").source) == ("gold", FROM_CONTAINER)
    assert (choose_class(table, p, "app").name, choose_class(table, p, "app").source) == ("batch", FROM_POD)
    assert choose_class(table, pod(), "app") is NO_CLASS
    assert choose_class(table, pod(**{"memqos.io/class.other": "gold"}), "app") is NO_CLASS


@pytest.mark.parametrize("namespace,value,reason", [
    ("default", "platinum", UNKNOWN_CLASS),
    ("tenant-a", "batch", NAMESPACE_NOT_ALLOWED),
    ("default", "Batch", MALFORMED),
    ("default", "", MALFORMED),
    ("default", "b" * 64, MALFORMED),
    ("default", "b" * 100_000, MALFORMED),
    ("default", "batch\udcff", MALFORMED),  # a surrogate: what undecodable bytes become
    ("default", "bätch", MALFORMED),
    ("default", "-batch", MALFORMED),
])
def test_a_refused_annotation_gives_the_nodes_settings_and_says_why(namespace, value, reason):
    table = make_table({"batch": ContainerClass("batch", policy=Policy.HARD)}, {"default": ["batch"]})
    choice = choose_class(table, pod(namespace, **{"memqos.io/class": value}), "app")
    assert choice.name is None and choice.refused == reason
    assert "memqos.io/class" in choice.note and len(choice.note) < 400
    choice.note.encode("ascii")  # the value is quoted escaped: no surrogate reaches a log or a record
    record = choice.record()
    assert record["class"] is None and record["class_refused"] == reason


def test_a_node_without_classes_looks_at_no_annotation():
    p = pod(**{"memqos.io/class": "NOT VALID"})
    assert choose_class(make_table({}, {}), p, "app") is NO_CLASS


def test_a_class_changes_only_the_settings_it_names():
    assert apply_class(None, BASE) is BASE
    s = apply_class(ContainerClass("lc", factor_set=True, factor=None), BASE)
    assert s.node.factor is None and s.node.allocatable == NODE.allocatable and s.policy is Policy.HARD
    assert (s.cls, s.guard_action, s.reclaim, s.swap, s.protects) == ("lc", "relax", False, False, True)
    s = apply_class(ContainerClass("b", policy=Policy.NONE, factor_set=True, factor=0.5, reclaim=True,
                                   guard_action="none", headroom_ratio=0.3, headroom_min=1, swap=True), BASE)
    assert (s.node.factor, s.node.headroom_ratio, s.node.headroom_min) == (0.5, 0.3, 1)
    assert (s.policy, s.guard_action, s.reclaim, s.swap, s.protects) == (Policy.NONE, "none", True, True, False)
    table = make_table({"b": ContainerClass("b", reclaim=True)}, {})
    resolved = table.resolve(BASE)
    assert resolved[None] is BASE and resolved["b"].reclaim and resolved["b"].node is NODE


def test_the_class_remembered_at_creation():
    table = make_table({"batch": ContainerClass("batch")}, {"default": ["batch"]})
    assert remembered(table, None) is NO_CLASS
    assert remembered(table, "batch") == remembered(table, "batch", "default")
    assert remembered(table, "batch").source == FROM_MEMORY and remembered(table, "batch").name == "batch"
    assert remembered(table, "gone").refused == UNKNOWN_CLASS and remembered(table, "gone").name is None
    assert remembered(table, "batch", "tenant").refused == NAMESPACE_NOT_ALLOWED
    assert remembered(table, 7).refused == MALFORMED


def _json_form(value):
    """A value as JSON types: a dataclass as an object of its fields, an enum as its value, a tuple
    as a list (how a recording's header holds a setting)."""
    import dataclasses
    import enum

    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return {f.name: _json_form(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_json_form(v) for v in value]
    return value


def test_the_parsers_take_back_the_json_form_of_their_own_result(tmp_path):
    import json

    from shim.app.config_classes import DECISION_SETTINGS, parse_classes, parse_namespace_classes

    cfg = load(tmp_path, CONFIG)
    for parse, value in ((parse_classes, cfg.classes), (parse_namespace_classes, cfg.namespace_classes)):
        assert parse(json.loads(json.dumps(_json_form(value)))) == value
        assert parse(None) is None
    assert DECISION_SETTINGS == ("classes", "namespace-classes")


def test_the_documented_examples_load(tmp_path):
    """The YAML of docs/configuration.md's and docs/memory-qos.md's class sections, and the
    commented class block of deploy/config.yaml uncommented, are valid configurations."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for doc, heading in (("configuration.md", "## Classes and namespace-classes"), ("memory-qos.md", "## 7. Classes")):
        text = (root / "docs" / doc).read_text(encoding="utf-8").split(heading, 1)[1]
        block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
        table = class_table(load(tmp_path, block))
        assert table and table.allowed("default", "latency-critical")
    deploy = (root / "deploy" / "config.yaml").read_text(encoding="utf-8")
    block = deploy.split("# classes:", 1)[1]
    uncommented = "classes:" + "\n".join(line[2:] if line.startswith("# ") else line for line in block.splitlines())
    assert sorted(class_table(load(tmp_path, uncommented)).classes) == ["batch", "latency-critical"]
