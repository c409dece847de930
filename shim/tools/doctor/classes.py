"""Memory QoS classes (config ``classes`` / ``namespace-classes``, shim.decision.classes): which
classes the node defines and which namespaces may use them, how many running containers were
created with each (the class recorded in the shim's container annotation ``memqos.io/request``,
from a CRI ListContainers on the upstream runtime), and how many annotations `serve` refused
(``memqos_class_refused_total`` on its ``/metrics``: the one count of refusals the doctor can
read on every deployment where the metrics are on; the audit log's ``class_refused`` records may
go to stdout, out of the doctor's reach)."""
from __future__ import annotations

import re

from shim.tools.doctor.common import PASS, WARN, CheckBase, Result, rpc_error

REFUSED_METRIC = "memqos_class_refused_total"
_SAMPLE = re.compile(r'^memqos_class_refused_total\{reason="([a-z-]{1,40})"\}\s+([0-9.e+]+)\s*$')
MAX_METRICS_BYTES = 8 << 20  # what the doctor reads of /metrics
SHOWN = 10  # namespaces listed


def refused_counts(text: str) -> dict[str, int]:
    """reason -> count from a Prometheus exposition (only memqos_class_refused_total)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1)] = int(float(m.group(2)))
            except ValueError:
                continue
    return out


def class_counts(containers) -> tuple[dict[str, int], int, int]:
    """(class -> running containers, running containers without a class, running containers the
    shim did not annotate) from CRI Container messages."""
    from shim.cri import pb
    from shim.decision.pod import note_class, parse_annotation

    per: dict[str, int] = {}
    none = unannotated = 0
    for c in containers:
        if c.state != pb.CONTAINER_RUNNING:
            continue
        note = parse_annotation(c.annotations)
        if note is None:
            unannotated += 1
            continue
        cls = note_class(note)
        if cls:
            per[cls] = per.get(cls, 0) + 1
        else:
            none += 1
    return per, none, unannotated


class ClassChecks(CheckBase):
    """Classes defined, namespaces allowed, classes in use, annotations refused."""

    def _running_containers(self):
        from shim.node.runtime_client import RuntimeClient

        client = RuntimeClient(self.cfg.upstream, timeout=self.env.rpc_timeout)
        try:
            return client.list_containers()
        finally:
            client.close()

    def _metrics_text(self) -> str:
        import http.client

        from shim.evidence.metrics import split_address

        host, port = split_address(self.cfg.metrics_address)
        conn = http.client.HTTPConnection(host, port, timeout=self.env.rpc_timeout)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            if resp.status != 200:
                raise OSError(f"HTTP {resp.status}")
            return resp.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
        finally:
            conn.close()

    def check_classes(self) -> list[Result]:
        from shim.app.config_classes import class_table

        table = class_table(self.cfg)
        if not table:
            return [Result("classes", PASS, "none defined: every container gets the node's settings "
                                            "(memqos.io/class annotations are not looked at)")]
        out = []
        names = sorted(table.classes)
        details = [f"{n}: {table.classes[n].settings() or 'the node settings'}" for n in names]
        out.append(Result("classes", PASS, f"{len(names)} defined: {', '.join(names)}", details))
        # namespaces allowed
        ns = dict(table.namespaces)
        usable = set().union(*ns.values()) if ns else set()
        unused = [n for n in names if n not in usable]
        lines = [f"{k}: {', '.join(sorted(v)) or 'none'}" for k, v in sorted(ns.items())[:SHOWN]]
        if len(ns) > SHOWN:
            lines.append(f"... and {len(ns) - SHOWN} more namespaces")
        if not ns:
            out.append(Result("namespaces allowed", WARN, "namespace-classes is empty: no pod may use a class",
                              ["a namespace namespace-classes does not name may use none; '*' names every one"]))
        elif unused:
            out.append(Result("namespaces allowed", WARN, f"no namespace may use {', '.join(unused)}", lines))
        else:
            every = ns.get("*")
            summary = f"{len(ns)} namespace{'s' if len(ns) > 1 else ''} named" + (f"; every namespace may use {', '.join(sorted(every))}" if every else "")
            out.append(Result("namespaces allowed", PASS, summary, lines))
        out.append(self._in_use(table))
        out.append(self._refused())
        return out

    def _in_use(self, table) -> Result:
        name = "classes in use"
        try:
            per, none, unannotated = class_counts(self._running_containers())
        except Exception as e:  # the runtime not there: say so, never fail the command
            return Result(name, WARN, f"cannot list containers at {self.cfg.upstream}: {rpc_error(e)}")
        parts = [f"{n} {per[n]}" for n in sorted(per)[:SHOWN]] + [f"node settings {none}"]
        details = [f"... and {len(per) - SHOWN} more class names"] if len(per) > SHOWN else []
        if unannotated:
            details.append(f"{unannotated} running container(s) without the shim's memqos.io/request annotation "
                           "(created before the shim, or not through it)")
        gone = sorted(n for n in per if n not in table.classes)
        if gone:
            details.append(f"created with classes this configuration no longer defines: {', '.join(gone[:SHOWN])} "
                           "(an update or a restart gives them the node's settings)")
        return Result(name, WARN if gone else PASS, "running containers by class: " + ", ".join(parts), details)

    def _refused(self) -> Result:
        name = "annotations refused"
        if not self.cfg.metrics_address:
            return Result(name, WARN, "not counted here: metrics are off (--metrics-address)", [
                f"the doctor reads {REFUSED_METRIC} from the running shim's /metrics; the audit log's "
                "class_refused records name each one"])
        try:
            counts = refused_counts(self._metrics_text())
        except Exception as e:  # not running, or not answering
            return Result(name, WARN, f"http://{self.cfg.metrics_address}/metrics did not answer: "
                                      f"{e.__class__.__name__}: {e}")
        total = sum(counts.values())
        text = ", ".join(f"{r} {n}" for r, n in sorted(counts.items()) if n) or "none"
        return Result(name, WARN if total else PASS, f"since the shim started: {text}",
                      ["the audit log's records with class_refused name the pod and the value"] if total else [])
