"""The real-kernel suite (scripts/e2e-vm) and checks of its own expectations.

`pytest -m vm tests/test_e2e_vm.py` boots the VM (several minutes under TCG); the default
addopts (-m 'not vm') leave that test out. The other tests here are quick and run with the
main suite: they check e2e/expect.py, the independent arithmetic the VM suite compares the
kernel's values with, against the reference's worked examples and against what the real
kubelet (MemoryQoS on) wrote in the recorded traces, and the guard scenario's own pieces
(its container's memory.high, e2e/hog.c's progress lines as the guest parses them).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from shim.evidence.trace import open_text
from memqos_dev.testing.traces import MEMQOS_OFF, MEMQOS_ON, TRACES_DIR, trace_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = str(TRACES_DIR)
sys.path.insert(0, os.path.join(ROOT, "e2e"))

import expect as X  # noqa: E402

MI = 1 << 20


@pytest.mark.parametrize("request_mi,factor,high_mi", [
    (0, 0.9, 900), (100, 0.9, 910), (500, 0.9, 950), (800, 0.9, 980), (900, 0.9, 990),
    (500, 0.6, 800), (800, 0.6, 920), (500, 0.8, 900), (850, 0.8, 970), (500, 0.4, 700),
])
def test_expect_matches_reference_worked_examples(request_mi, factor, high_mi):
    node = X.Node(capacity=4000 * MI, page=MI, factor=factor)
    if request_mi:  # the kubelet's own memory.min states the request
        e = X.container_expectation(X.BURSTABLE, 1000 * MI, 500, {"memory.min": str(request_mi * MI)}, node)
    else:  # oom_score_adj 999: request below capacity/500, lower bound 0
        e = X.container_expectation(X.BURSTABLE, 1000 * MI, 999, {}, node)
    assert e.request.bytes == request_mi * MI
    assert e.high == high_mi * MI


def test_expect_request_equal_limit_and_guaranteed_have_no_high():
    node = X.Node(capacity=4000 * MI, page=4096)
    assert X.container_expectation(X.BURSTABLE, 1000 * MI, 500, {"memory.min": str(1000 * MI)}, node).high is None
    g = X.container_expectation(X.GUARANTEED, 64 * MI, -997, {}, node)
    # memory.min a headroom of 8Mi under the limit, memory.low = the request
    assert (g.min, g.low, g.high, g.max) == (56 * MI, 64 * MI, None, 64 * MI)
    assert g.request.bytes == 64 * MI


def test_expect_float64_page_boundary():
    # reference: exact rational arithmetic differs from the kubelet's float64 here
    assert 368640 * 7 // 10 == 258048 == 63 * 4096  # exact: a whole page
    assert X.kubelet_high(0, 368640, 0.7, 4096) == 62 * 4096  # float64: 258047.99.. -> one page less


def test_kernel_reads_whole_pages():
    assert X.kernel_reads(32966706, 4096) == "32964608"
    assert X.kernel_reads(None, 4096) == "max"
    assert X.kernel_reads(0, 4096) == "0"


def _creates(trace_name):
    from shim.cri import api_pb2 as pb

    with open_text(str(trace_file(trace_name))) as f:
        lines = [json.loads(x) for x in f]
    for c in lines[1:]:
        if c["method"].endswith("/CreateContainer"):
            yield lines[0], pb.CreateContainerRequest.FromString(base64.b64decode(c["request"]))


def _manifest_requests():
    import yaml

    out = {}
    d = os.path.join(TRACES, "manifests")
    for fn in os.listdir(d):
        with open(os.path.join(d, fn)) as f:
            doc = yaml.safe_load(f)
        for c in (doc["spec"].get("initContainers") or []) + doc["spec"]["containers"]:
            r = c.get("resources") or {}
            req = (r.get("requests") or {}).get("memory") or (r.get("limits") or {}).get("memory")
            out[(doc["metadata"]["name"], c["name"])] = X.quantity(req)
    return out


@pytest.mark.parametrize("trace", [MEMQOS_OFF, MEMQOS_ON])
def test_expected_requests_never_exceed_the_manifests(trace):
    truth = _manifest_requests()
    seen = 0
    for header, req in _creates(trace):
        node = X.Node.from_trace_header(header)
        r = req.config.linux.resources
        qos = X.qos_from_cgroup_parent(req.sandbox_config.linux.cgroup_parent)
        e = X.container_expectation(qos, r.memory_limit_in_bytes, r.oom_score_adj, dict(r.unified), node)
        case = req.sandbox_config.labels["case"]
        true = truth[(case, req.config.metadata.name)]
        assert e.request.bytes <= true
        assert true - e.request.bytes < node.capacity // 1000 + 1  # oom_score_adj resolution
        if "memory.min" in r.unified:  # MemoryQoS on: the kubelet's own value is exact
            assert e.request.bytes == true
        seen += 1
    assert seen == 8


def test_pod_sums_match_the_kubelets_own_memory_qos():
    """With MemoryQoS on, the recorded kubelet wrote pod / burstable / kubepods memory.min
    itself (*.cgroups.txt): the suite's pod arithmetic must give the same numbers."""
    with open(os.path.join(TRACES, MEMQOS_ON + ".cgroups.txt")) as f:
        text = f.read()
    steady = text.split("### after")[0]
    kubelet = dict(re.findall(r"^(/kubepods(?:/burstable)?(?:/pod[0-9a-f]+)?) min=(\d+)", steady, re.M))
    pods: dict[str, dict] = {}
    inits = {("multi", "init")}
    for header, req in _creates(MEMQOS_ON):
        node = X.Node.from_trace_header(header)
        r = req.config.linux.resources
        parent = req.sandbox_config.linux.cgroup_parent
        qos = X.qos_from_cgroup_parent(parent)
        e = X.container_expectation(qos, r.memory_limit_in_bytes, r.oom_score_adj, dict(r.unified), node)
        p = pods.setdefault(parent, {"qos": qos, "regular": [], "init": []})
        key = (req.sandbox_config.labels["case"], req.config.metadata.name)
        p["init" if key in inits else "regular"].append(e.request.bytes)
    sums = {X.BURSTABLE: 0, X.GUARANTEED: 0}
    for parent, p in pods.items():
        want = X.pod_request(p["regular"], p["init"]) if p["qos"] != X.BESTEFFORT else 0
        if p["qos"] != X.BESTEFFORT:
            assert kubelet[parent] == str(want), parent
            sums[p["qos"]] += want
    assert kubelet["/kubepods/burstable"] == str(sums[X.BURSTABLE])
    assert kubelet["/kubepods"] == str(sums[X.BURSTABLE] + sums[X.GUARANTEED])


def test_guest_maps_recorded_ids_everywhere():
    from shim.cri import api_pb2 as pb
    import guest_replay

    req = pb.CreateContainerRequest(pod_sandbox_id="old-sb")
    req.config.image.image = "sha256:old"
    req.config.annotations["x"] = "old-sb"
    req.config.mounts.add(host_path="old-sb")
    assert guest_replay.substitute_ids(req, {"old-sb": "new-sb", "sha256:old": "sha256:new"}) == 4
    assert req.pod_sandbox_id == "new-sb" and req.config.image.image == "sha256:new"
    assert req.config.annotations["x"] == "new-sb" and req.config.mounts[0].host_path == "new-sb"


def test_guard_scenario_memory_high_is_well_below_the_limit():
    """The guard scenario's container: request 16Mi, limit 96Mi, factor 0.25 -> memory.high
    36Mi (the guest's 512M VM: MemTotal 466140 kB, as the suite's reports show)."""
    import guest_guard

    G = guest_guard.GuardScenario
    node = X.Node(capacity=466140 * 1024, page=4096, factor=G.FACTOR)
    adj = 1000 - (1000 * G.REQUEST) // node.capacity
    e = X.container_expectation(X.BURSTABLE, G.LIMIT, adj, {"memory.min": str(G.REQUEST)}, node)
    assert (e.min, e.high, e.max) == (16 * MI, 36 * MI, 96 * MI)
    assert G.TARGET_COMPLETE * MI < G.LIMIT < G.TARGET_OOM * MI  # one completes, one is OOM-killed
    assert e.high < G.TARGET_COMPLETE * MI  # both allocate past memory.high


@pytest.mark.skipif(not shutil.which("gcc"), reason="no gcc")
def test_hog_progress_as_the_guest_reads_it(tmp_path):
    """e2e/hog.c's lines, as containerd writes them to the CRI log, parsed by the guest_common."""
    import guest_common

    binary = tmp_path / "hog"
    subprocess.run(["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(binary),
                    os.path.join(ROOT, "e2e", "hog.c")], check=True)
    p = subprocess.run([str(binary), "3", "1", "exit"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    log = tmp_path / "0.log"
    log.write_text("".join(f"2026-01-01T00:00:00.{i:09d}Z stdout F {line}\n"
                           for i, line in enumerate(p.stdout.splitlines())))
    got = guest_common.hog_progress(str(log))
    assert got["mib"] == 3 and got["done"] and got["lines"] == 5
    assert got["done_wall"] >= got["started_wall"] > 0
    assert subprocess.run([str(binary), "0"], capture_output=True).returncode == 2


def test_guard_helpers_parse_kernel_files():
    import guest_common

    assert guest_common.parse_pressure("some avg10=80.10 avg60=1.00 avg300=0.20 total=1\n"
                                "full avg10=77.74 avg60=1.00 avg300=0.20 total=2\n") == {"some": 80.1, "full": 77.74}
    assert guest_common.parse_events("low 0\nhigh 718\nmax 3\noom 1\noom_kill 1\n")["oom_kill"] == 1
    m = {'memqos_guard_actions_total{action="relax"}': 2.0, 'memqos_guard_actions_created{action="relax"}': 9.0}
    assert guest_common.metric(m, "memqos_guard_actions_total", action="relax") == 2.0
    assert guest_common.metric(m, "memqos_guard_actions_total", action="report") is None


def test_e2e_vm_rejects_an_unknown_scenario():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--scenario", "bogus", "--no-install"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--scenario must be all, traces or guard" in p.stderr


@pytest.mark.parametrize("scenario", ["bogus+nri", "nri+nri", "all+", "+nri"])
def test_e2e_vm_rejects_an_unknown_scenario_with_nri(scenario):
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--scenario", scenario, "--no-install"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--scenario must be all, traces or guard" in p.stderr, p.stderr


def ci_default_entries() -> list[str]:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        m = re.search(r"\$\{MEMQOS_CI_E2E:-([^}]*)\}", f.read())
    assert m, ".ci/run has no default MEMQOS_CI_E2E entries"
    return m.group(1).split()


def test_ci_runs_the_protection_benchmark_checks():
    """.ci/run's default has the protection benchmark's short boot (docs/protection.md)."""
    assert "2.x:pressure" in ci_default_entries()


def test_ci_runs_the_nri_scenario_on_both_nri_stacks_in_boots_it_already_makes():
    """.ci/run's default: the NRI scenario on containerd 2.x and 1.7, each inside a VM boot that
    runs other scenarios too (no boot of its own), and every entry one scripts/e2e-vm accepts
    (a scenario it knows: it gets as far as the stack check)."""
    entries = ci_default_entries()
    vm_entries = [e.split(":") for e in entries if e != "systemd"]
    nri_stacks = {e[0] for e in vm_entries if e[1] == "nri" or e[1].endswith("+nri")}
    assert {"2.x", "1.7"} <= nri_stacks
    assert not [e for e in vm_entries if e[1] == "nri"]  # no boot for the NRI scenario alone
    runtime_boots = [e for e in vm_entries if e[1] != "pressure"]  # the protection benchmark needs no runtime
    assert len({e[0] for e in runtime_boots}) == len(runtime_boots)  # one boot per stack
    for stack, scenario, *trace in vm_entries:
        p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--scenario", scenario, "--stack", "9",
                            *(["--trace", trace[0]] if trace else []), "--no-install"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 3 and "--stack must be one of" in p.stderr, (scenario, p.stderr)


def test_nri_latency_bench_summary():
    """e2e/nri_bench.py's figures: nearest-rank percentiles per mode, the time the plugin and the
    proxy add over no plugin (and the ratio of medians), the handler's own time."""
    import nri_bench

    assert nri_bench.percentile([], 50) is None
    assert nri_bench.percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert nri_bench.percentile(list(range(1, 101)), 99) == 99
    samples = {"none": [10.0] * 50 + [20.0] * 50, "nri": [11.0] * 99 + [40.0], "proxy": [14.0] * 100}
    r = nri_bench.summarize(samples, [80, 100, 120])
    assert r["modes"]["none"] == {"n": 100, "p50_ms": 10.0, "p99_ms": 20.0}
    assert r["added"]["nri"] == {"p50_ms": 1.0, "p99_ms": -9.0, "p50_ratio": 1.1}
    assert r["added"]["proxy"]["p50_ms"] == 4.0 and r["added"]["proxy"]["p50_ratio"] == 1.4
    assert r["handler_us"] == {"n": 3, "p50": 100, "p99": 120}
    r.update(rounds=4, per_block=25)
    lines = nri_bench.summary_lines(r)
    assert any("NRI plugin" in line and "added p50 +1.0 ms" in line for line in lines)
    assert any("handler" in line and "p50 100 us" in line for line in lines)
    empty = nri_bench.summarize({"none": [], "nri": [1.0], "proxy": []}, [])
    assert empty["added"] == {} and empty["handler_us"]["p50"] is None


def test_nri_latency_bench_names_the_slowest_calls():
    """Every timed create is kept with its round, place in the block and time; the summary names
    the slowest three of each mode, so a tail can be matched with the plugin's log."""
    import nri_bench

    calls = [[0, 0, 10.0, 5.0], [1, 0, 20.0, 900.5], [1, 1, 20.9, 7.0], [2, 0, 30.0, 300.0], [2, 3, 31.0, 6.0]]
    assert nri_bench.slowest(calls) == [[1, 0, 20.0, 900.5], [2, 0, 30.0, 300.0], [1, 1, 20.9, 7.0]]
    assert nri_bench.slowest([]) == []
    r = nri_bench.summarize({"none": [1.0], "nri": [c[3] for c in calls], "proxy": [2.0]}, [])
    r.update(rounds=3, per_block=25, slowest={"none": [], "nri": nri_bench.slowest(calls), "proxy": []})
    lines = nri_bench.summary_lines(r)
    [line] = [x for x in lines if "slowest" in x]
    assert "NRI plugin" in line and "900.5 ms (round 2 call 1, t+20.0s)" in line and "300.0 ms (round 3 call 1" in line


@pytest.mark.vm
def test_real_kernel_suite(tmp_path):
    """Boot the VM and run the whole suite; every asserted cgroup file must match."""
    out = os.environ.get("E2E_OUT") or str(tmp_path / "e2e")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--out", out],
                       capture_output=True, text=True, timeout=int(os.environ.get("E2E_PYTEST_TIMEOUT", "4800")))
    print(p.stdout[-20000:])
    print(p.stderr[-5000:], file=sys.stderr)
    path = os.path.join(out, "report.json")
    assert os.path.exists(path), f"scripts/e2e-vm wrote no report (exit {p.returncode})"
    with open(path) as f:
        report = json.load(f)
    failed = [f"{c['file']}: expected {c['expected']}, actual {c['actual']} ({c['scenario']}/{c['step']})"
              for c in report["checks"] if not c["pass"]]
    assert not failed, "cgroup values differ:\n" + "\n".join(failed)
    assert report["status"] == "pass", report.get("errors")
    assert p.returncode == 0
    assert report["summary"]["passed"] > 0
    for c in report["checks"]:
        assert {"file", "expected", "actual", "pass"} <= set(c)
    # the guard scenario ran both phases and recorded its timings
    phases = report["guard"]["phases"]
    assert phases["control"]["timings"]["action_after_hot"] is not None
    for pod in ("guard-oom", "guard-complete"):
        assert phases["guard"][pod]["relax_record"]["new"] == "max"


def test_e2e_vm_rejects_an_unknown_stack():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--stack", "1.5", "--no-install"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--stack must be one of: 1.6 1.7 2.x" in p.stderr


def test_stack_config_templates_fill_the_same_placeholders():
    """Both containerd configs (1.x: version 2, 2.x: version 3) take the same placeholders, name
    the runc binary and the local sandbox image, and 2.x's uses 2.x's plugin names only."""
    import stacks

    texts = {}
    for name, spec in stacks.STACKS.items():
        with open(os.path.join(ROOT, "e2e", spec["config"])) as f:
            texts[name] = f.read()
        for ph in ("@ROOT@", "@SYSTEMD_CGROUP@", "@RUNC@"):
            assert ph in texts[name], (name, ph)
        assert re.search(r'BinaryName = "@RUNC@"', texts[name])
    assert "version = 2" in texts["1.7"] and 'sandbox_image = "localhost/pause:e2e"' in texts["1.7"]
    v3 = texts["2.x"]
    assert "version = 3" in v3 and "io.containerd.grpc.v1.cri" not in v3
    assert re.search(r'pinned_images\]\s+sandbox = "localhost/pause:e2e"', v3)


def test_nri_scenario_switches_nri_on_in_the_1x_config_only_when_asked():
    """containerd 1.7 runs NRI only with its section's `disable = false`: the guest puts it in the
    1.x config for the NRI scenario, leaves a bare comment otherwise (also for guest_systemd.py,
    which fills the template without knowing the placeholder), and 2.x's config needs none."""
    import tomllib

    import guest_stack

    with open(os.path.join(ROOT, "e2e", "containerd.toml.in")) as f:
        template = f.read()

    def fill(text: str, nri: bool) -> dict:
        text = text.replace("@ROOT@", "/run/e2e").replace("@SYSTEMD_CGROUP@", "false").replace("@RUNC@", "/runc")
        return tomllib.loads(text.replace("#@NRI@", guest_stack.NRI_ON_1X if nri else ""))

    assert fill(template, True)["plugins"]["io.containerd.nri.v1.nri"] == {"disable": False}
    assert "io.containerd.nri.v1.nri" not in fill(template, False)["plugins"]
    assert "io.containerd.nri.v1.nri" not in tomllib.loads(
        template.replace("@ROOT@", "/r").replace("@SYSTEMD_CGROUP@", "true").replace("@RUNC@", "runc"))["plugins"]
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "e2e-vm"), "--scenario", "nri", "--stack", "9",
                        "--no-install"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3 and "--stack must be one of" in p.stderr  # nri is a known scenario


def test_stack_mirror_and_matrix(tmp_path, monkeypatch, capsys):
    import stacks

    monkeypatch.setenv("E2E_DEBIAN_MIRROR", "http://mirror.invalid/debian/")
    assert stacks.mirror() == "http://mirror.invalid/debian"
    reports = {"1.6": ("pass", 40, 0, 1), "2.x": ("fail", 38, 2, 1)}
    for name, (status, passed, failed, skipped) in reports.items():
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "report.json", "w") as f:
            json.dump({"status": status, "summary": {"passed": passed, "failed": failed, "skipped": skipped},
                       "stack": {"containerd_version": name + ".0", "runc_version": "1.1.5",
                                 "cgroup_driver": "cgroupfs", "kernel": "6.1.0-56-amd64"},
                       "host": {"wall_s": 300}}, f)
    assert stacks.matrix(str(tmp_path), ["1.6=0", "2.x=1", "1.7=3"]) == 3  # 1.7 wrote no report
    out = capsys.readouterr().out
    assert "MATRIX 2.x | 2.x.0 | 1.1.5 | cgroupfs | 6.1.0-56-amd64 | fail (exit 1) | 38/2/1 | 300s" in out
    assert "MATRIX 1.7 | None" in out and "no report" in out
    assert out.rstrip().endswith("e2e-vm: 78 passed, 2 failed, 2 skipped")
    with open(tmp_path / "matrix.json") as f:
        assert [r["stack"] for r in json.load(f)["stacks"]] == ["1.6", "2.x", "1.7"]
    assert stacks.matrix(str(tmp_path), ["1.6=0"]) == 0


# -- the sampling check (e2e/protection.py): pure over samples ----------------------------------
POD_A = "/kubepods/burstable/poda"
POD_B = "/kubepods/burstable/podb"
POD_G = "/kubepods/podg"


def _sample(t, values, members=None, departed=(), excused=(), phase="p"):
    import protection as P

    vals = {(path, "memory.min"): v for path, v in values.items()}
    mem = {p: frozenset(ch) for p, ch in (members or {POD_A: {"sb-a", "c-a"}, POD_B: {"sb-b", "c-b"}}).items()}
    return P.Sample(t, vals, mem, frozenset(departed), frozenset(excused), phase)


def _levels(a=32, b=32, burst=None, kube=None):
    burst = a + b if burst is None else burst
    return {POD_A: a * MI, POD_B: b * MI, "/kubepods/burstable": burst * MI,
            "/kubepods": (burst if kube is None else kube) * MI}


def test_sampling_check_fails_a_drop_while_the_pods_stay():
    """The issue's case: the kubelet's values in force, then a write of 0 with every pod and
    container still there (the shim's reconciler at RunPodSandbox, gate on)."""
    import protection as P

    samples = [_sample(0.0, _levels()), _sample(0.1, _levels()),
               _sample(0.2, _levels(a=0, burst=0, kube=0), phase="create")]
    drops = P.find_drops(samples)
    assert {(d.path, d.old, d.new) for d in drops} == {
        (POD_A, 32 * MI, 0), ("/kubepods/burstable", 64 * MI, 0), ("/kubepods", 64 * MI, 0)}
    assert all(d.t_old == 0.1 and d.t_new == 0.2 and d.phase == "create" and not d.allowed for d in drops)
    # rising, or staying, is never a drop
    assert P.find_drops([_sample(0.0, _levels(a=0, burst=0, kube=0)), _sample(0.1, _levels())]) == []


def test_sampling_check_allows_a_decrease_where_a_pod_left():
    import protection as P

    gone = {POD_A: {"sb-a", "c-a"}, POD_B: {"sb-b"}}  # pod b's container stopped
    samples = [_sample(0.0, _levels()), _sample(0.1, _levels(b=0), gone)]
    assert P.find_drops(samples) == []
    d = {x.path: x for x in P.decreases(samples)}
    assert d[POD_B].allowed and d[POD_B].reason == f"left: {POD_B} (gone: c-b, 0.0s before)"
    assert d["/kubepods/burstable"].allowed and d["/kubepods"].allowed  # its ancestors too
    # ... but pod b leaving does not excuse pod a's value
    samples = [_sample(0.0, _levels()), _sample(0.1, _levels(a=0, b=0), gone)]
    assert [(x.path, x.new) for x in P.find_drops(samples)] == [(POD_A, 0)]
    # a Guaranteed pod leaving concerns kubepods, not the burstable QoS cgroup
    m0 = {POD_A: {"sb-a"}, POD_G: {"sb-g", "c-g"}}
    samples = [_sample(0.0, {POD_A: 0, "/kubepods/burstable": 8 * MI, "/kubepods": 72 * MI}, m0),
               _sample(0.1, {POD_A: 0, "/kubepods/burstable": 0, "/kubepods": 0}, {POD_A: {"sb-a"}})]
    assert [x.path for x in P.find_drops(samples)] == ["/kubepods/burstable"]


def test_sampling_check_departure_window():
    """A decrease may come a few samples after the departure (the shim reacts to the call), not
    before the value was last set, and not beyond the grace."""
    import protection as P

    samples = [_sample(0.0, _levels()), _sample(0.1, _levels(), departed=[POD_B]),
               _sample(0.2, _levels()), _sample(0.3, _levels(b=0))]
    assert P.find_drops(samples) == []
    late = samples[:3] + [_sample(0.2 + P.GRACE + 1, _levels(b=0))]
    assert [x.path for x in P.find_drops(late)] == [POD_B, "/kubepods/burstable", "/kubepods"]
    # pod b left, then its value was raised again: a later decrease needs a new departure
    again = samples[:3] + [_sample(0.3, _levels(b=48)), _sample(0.4, _levels(b=32))]
    assert [(x.path, x.old, x.new) for x in P.find_drops(again)] == [
        (POD_B, 48 * MI, 32 * MI), ("/kubepods/burstable", 80 * MI, 64 * MI), ("/kubepods", 80 * MI, 64 * MI)]


def test_sampling_check_excuses_the_suites_own_writes_and_unreadable_values():
    import protection as P

    samples = [_sample(0.0, _levels()), _sample(0.1, _levels(a=0, burst=0, kube=64),
                                                excused=[POD_A, "/kubepods/burstable"])]
    assert P.find_drops(samples) == [] and all(d.allowed for d in P.decreases(samples))
    none = _sample(0.1, _levels())
    none.values[(POD_A, "memory.min")] = None  # unreadable for a moment: compared with the last value read
    assert P.find_drops([_sample(0.0, _levels()), none, _sample(0.2, _levels())]) == []
    lower = _sample(0.2, _levels(a=0, burst=64, kube=64))
    assert [(d.path, d.old, d.new, d.t_old) for d in P.find_drops([_sample(0.0, _levels()), none, lower])] == [
        (POD_A, 32 * MI, 0, 0.0)]


def test_sampling_gap_stats():
    import protection as P

    samples = [_sample(t, _levels()) for t in (0.0, 0.1, 0.2, 0.5, 0.6)]
    s = P.gap_stats(samples)
    assert s["samples"] == 5 and s["max_gap_ms"] == 300.0 and s["gaps_over_200ms"] == 1


def test_sampler_reads_a_cgroupfs_tree(tmp_path):
    import time

    import protection as P

    def put(rel, mn, low="0"):
        d = tmp_path / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.min").write_text(mn + "\n")
        (d / "memory.low").write_text(low + "\n")

    s = P.Sampler(root=str(tmp_path), interval=0.01)
    s.start()  # before kubepods exists, as in the guest
    put("kubepods", "100")
    put("kubepods/burstable", "60")
    put("kubepods/besteffort", "0")
    put("kubepods/burstable/podx", "60", "7")
    put("kubepods/burstable/podx/sandbox1", "0")
    put("kubepods/podg", "40")
    (tmp_path / "kubepods/podg/c1").mkdir()
    values, members = P.read_tree(str(tmp_path))
    assert values[("/kubepods", "memory.min")] == 100 and values[("/kubepods/burstable/podx", "memory.low")] == 7
    assert values[("/kubepods/podg", "memory.min")] == 40
    assert members == {"/kubepods/burstable/podx": frozenset({"sandbox1"}), "/kubepods/podg": frozenset({"c1"})}
    deadline = time.time() + 5
    while not any(smp.members == members for smp in s.samples):
        assert time.time() < deadline
        time.sleep(0.01)
    (tmp_path / "kubepods/burstable/podx/memory.min").write_text("0\n")
    while not any(smp.values.get(("/kubepods/burstable/podx", "memory.min")) == 0 for smp in s.samples):
        assert time.time() < deadline
        time.sleep(0.01)
    s.stop()
    assert [(d.path, d.old, d.new) for d in P.find_drops(s.samples)] == [("/kubepods/burstable/podx", 60, 0)]


def test_kubelet_reproduction_writes_what_the_recorded_kubelet_wrote(tmp_path):
    """The guest's stand-in for a gate-on v1.23 kubelet: pod values from the manifests, QoS and
    kubepods sums of the admitted pods, equal to the recorded *.cgroups.txt at steady state and
    after the two removals."""
    import protection as P

    sys.path.insert(0, os.path.join(ROOT, "e2e"))
    import guest_common

    with open_text(str(trace_file(MEMQOS_ON))) as f:
        calls = [json.loads(x) for x in f][1:]
    pods = P.trace_pods(calls, guest_common.load_manifests(os.path.join(TRACES, "manifests")))
    with open(os.path.join(TRACES, MEMQOS_ON + ".cgroups.txt")) as f:
        steady, removed = f.read().split("### after qos-besteffort")[:2]

    def mins(text):
        return {p: int(v) for p, v in re.findall(r"^(/kubepods(?:/burstable)?(?:/pod[0-9a-f]+)?) min=(\d+)", text, re.M)}

    k = P.KubeletMemoryQoS(pods, root=str(tmp_path))
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    k.admit_all()
    for uid in pods:
        k.before_sandbox(uid)
    got = {p: int((tmp_path / p.lstrip("/") / "memory.min").read_text()) for p in mins(steady)}
    assert got == mins(steady)
    assert [w["path"] for w in k.writes[:2]] == ["/kubepods", "/kubepods/burstable"]  # before any pod cgroup
    for uid, p in pods.items():
        if p["name"].startswith(("qos-besteffort", "multi")):
            k.removed(uid)
    for path in ("/kubepods", "/kubepods/burstable"):
        assert int((tmp_path / path.lstrip("/") / "memory.min").read_text()) == mins(removed)[path]


def test_call_gate_pauses_new_calls_and_waits_for_those_in_flight():
    import threading
    import time

    import protection as P

    gate = P.CallGate()
    order = []
    started = threading.Event()

    def call(name, hold):
        with gate:
            started.set()
            order.append(name + " in")
            time.sleep(hold)
            order.append(name + " out")

    t1 = threading.Thread(target=call, args=("first", 0.2))
    t1.start()
    started.wait(5)
    with gate.paused():
        order.append("paused")
        t2 = threading.Thread(target=call, args=("second", 0))
        t2.start()
        time.sleep(0.1)
        order.append("resume")
    t1.join(5)
    t2.join(5)
    assert order == ["first in", "first out", "paused", "resume", "second in", "second out"]


def test_sampling_check_values_left_over_from_before_sampling(tmp_path):
    """A kubepods tree already there when sampling begins (an earlier scenario's pods the runtime
    could not remove) holds values for pods that left unseen: lowering them is a departure's.
    A tree that appears after the start gets no such allowance."""
    import protection as P

    samples = [_sample(0.0, _levels(), departed=[POD_A, POD_B, "/kubepods/burstable", "/kubepods"]),
               _sample(0.1, _levels(a=0, burst=32, kube=32))]
    assert P.find_drops(samples) == []
    assert all("left before sampling began" in d.reason for d in P.decreases(samples))
    for rel, value in (("kubepods", "64"), ("kubepods/burstable", "64"), ("kubepods/burstable/poda", "32")):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "memory.min").write_text(value + "\n")
    s = P.Sampler(root=str(tmp_path), interval=3600)
    s.start()
    (tmp_path / "kubepods/burstable/memory.min").write_text("32\n")
    s.stop()
    assert s.samples[0].departed == {"/kubepods", "/kubepods/burstable", "/kubepods/burstable/poda"}
    assert P.find_drops(s.samples) == [] and len(P.decreases(s.samples)) == 1
    fresh = P.Sampler(root=str(tmp_path / "none"), interval=3600)
    fresh.start()
    fresh.stop()
    assert fresh.samples[0].departed == frozenset()


def test_stack_check_names_the_binary_through_a_symlinked_directory(tmp_path, monkeypatch):
    """The stack's binaries named through a symlinked directory (a checkout whose out/ is a
    link) are the processes' /proc/PID/exe, which has every link resolved."""
    import guest_common
    import guest_stack

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    exe = os.path.realpath(sys.executable)

    class FakeCri:
        def __init__(self, sock):
            pass

        def call(self, name, msg, timeout=0):
            from shim.cri import api_pb2 as pb
            return pb.VersionResponse(runtime_version="1.7.24")

        def close(self):
            pass

    monkeypatch.setattr(guest_stack, "Cri", FakeCri)
    monkeypatch.setattr(guest_stack, "pids_named", lambda comm: [os.getpid()])
    os.symlink(exe, real / "python")
    linked = str(tmp_path / "link" / "python")
    report = guest_common.Report(str(tmp_path / "out"))
    report.data.setdefault("stack", {})
    guest_stack.check_stack_binaries(report, {"name": "t", "containerd": linked, "containerd-shim-runc-v2": linked,
                                        "containerd_version": "1.7.24"}, os.getpid())
    assert [c["pass"] for c in report.data["checks"]] == [True, True, True]


def test_ci_entry_point_and_shell_scripts_parse():
    """`bash -n` of .ci/run and every shell script under scripts/ and deploy/: a syntax error
    there fails CI after the whole unit suite has run, or an operator's install."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = [root / ".ci" / "run", *sorted((root / "deploy").glob("*.sh"))]
    scripts += [p for p in sorted((root / "scripts").iterdir())
                if p.is_file() and p.read_text(errors="replace").startswith("#!/usr/bin/env bash")]
    assert len(scripts) > 5
    for script in scripts:
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, f"{script.relative_to(root)}: {p.stderr}"
