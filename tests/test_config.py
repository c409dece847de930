"""The typed settings: shim/app/settings.py is what scripts/gen-config makes from the options
table, and its Config is frozen, has one field per option with the table's default and type,
and nothing else."""
import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from shim.app.config import OPTIONS, Config, Option, add_arguments, resolve
from shim.app.config_doc import settings_source
from shim.app.settings import FIELDS
from shim.decision import Policy

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ROOT / "shim" / "app" / "settings.py"


def test_settings_module_is_current():
    text = SETTINGS.read_text(encoding="utf-8")
    assert settings_source(text) == text, "shim/app/settings.py is stale: run scripts/gen-config"


def test_gen_config_writes_the_settings_module(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-config"), str(tmp_path / "settings.py")], check=True)
    assert (tmp_path / "settings.py").read_text(encoding="utf-8") == SETTINGS.read_text(encoding="utf-8")


def test_a_changed_table_changes_only_the_fields():
    text = SETTINGS.read_text(encoding="utf-8")
    changed = tuple(dataclasses.replace(o, default=7.0) if o.name == "guard-window" else o for o in OPTIONS)
    changed += (Option("new-one", "int | None", None, int, "a new setting"),)
    new = settings_source(text, changed)
    assert "    guard_window: float = 30.0\n" in text and "new_one" not in text
    assert new.replace("    guard_window: float = 7.0\n", "    guard_window: float = 30.0\n").replace(
        "    #: --new-one: a new setting\n    new_one: int | None = None\n", "") == text
    with pytest.raises(ValueError):
        settings_source(text.replace("gen-config: end", "gen-config"))


def test_one_field_per_option_with_the_tables_default_and_type():
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert list(fields) == [o.name.replace("-", "_") for o in OPTIONS] + ["origin", "given_as"]
    assert FIELDS == tuple(o.name.replace("-", "_") for o in OPTIONS)
    cfg = Config()
    for o in OPTIONS:
        f = fields[o.name.replace("-", "_")]
        assert f.type == o.type, o.name
        assert f.default == o.default and type(f.default) is type(o.default), o.name
        assert getattr(cfg, f.name) == o.default
    assert cfg.policy is Policy.HARD and cfg.origin["policy"] == "default"


def test_the_table_types_are_what_the_parsers_return():
    kinds = {"str": str, "int": int, "float": float, "bool": bool, "Policy": Policy, "None": type(None),
             "tuple": tuple}
    samples = {"factor": ["0.5", "auto", "none"], "node-allocatable": ["1Gi"], "policy": ["soft"],
               "kubelet-config": ["/k.yaml", "none"], "socket-mode": ["0600"], "reclaim": ["true"],
               "record-methods": ["all", "default"], "metrics-address": ["9808", "none"],
               "classes": [{"batch": {"factor": 0.5}}], "namespace-classes": [{"default": ["batch"]}]}
    for o in OPTIONS:
        allowed = tuple(kinds[t.strip().split("[")[0]] for t in o.type.split(" | "))
        if o.default is not None:
            assert isinstance(o.default, allowed), o.name
        for raw in samples.get(o.name, []):
            value = o.parse(raw)
            assert isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed), (o.name, raw)


def test_frozen_and_no_other_attributes():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.reclaim = True
    with pytest.raises(AttributeError):
        cfg.no_such_setting
    with pytest.raises(AttributeError):
        object.__setattr__(cfg, "no_such_setting", 1)  # slots: no room for one
    with pytest.raises(TypeError):
        Config(no_such_setting=1)
    with pytest.raises(TypeError):
        cfg.origin["reclaim"] = "flag"


def test_variants_with_replace():
    cfg = Config()
    on = dataclasses.replace(cfg, reclaim=True, monitor_interval=2.0)
    assert (on.reclaim, on.monitor_interval, cfg.reclaim) == (True, 2.0, False)
    assert on != cfg and dataclasses.replace(on, reclaim=False, monitor_interval=5.0) == cfg
    assert hash(Config()) == hash(cfg)


def test_resolve_origin_and_as_dict(tmp_path):
    (tmp_path / "c.yaml").write_text("guard-window: 12\npolicy: soft\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = resolve(p.parse_args(["--config", str(tmp_path / "c.yaml"), "--reclaim", "true"]))
    assert isinstance(cfg, Config)
    assert (cfg.guard_window, cfg.policy, cfg.reclaim) == (12.0, Policy.SOFT, True)
    assert dict(cfg.origin) == {f: "default" for f in FIELDS} | {"guard_window": "file", "policy": "file",
                                                                  "reclaim": "flag"}
    d = cfg.as_dict()
    assert list(d) == list(FIELDS) and d["policy"] == "Soft" and d["reclaim"] is True
    assert cfg == dataclasses.replace(Config(), guard_window=12.0, policy=Policy.SOFT, reclaim=True)


def test_resolve_a_subset_leaves_the_rest_at_the_default(tmp_path):
    subset = tuple(o for o in OPTIONS if o.name in ("cgroup-root", "factor"))
    (tmp_path / "c.yaml").write_text("factor: 0.5\nreclaim: true\n")
    p = argparse.ArgumentParser()
    add_arguments(p, subset)
    cfg = resolve(p.parse_args(["--config", str(tmp_path / "c.yaml"), "--cgroup-root", "/cg"]), subset)
    assert (cfg.cgroup_root, cfg.factor, cfg.reclaim) == ("/cg", 0.5, False)
    assert (cfg.origin["cgroup_root"], cfg.origin["factor"], cfg.origin["reclaim"]) == ("flag", "file", "default")
