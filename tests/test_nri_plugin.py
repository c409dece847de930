"""The NRI plugin core (shim/nri): the event mask per runtime version, the replies' bytes, the
protocol handler's answers, and whole sessions against the fake NRI runtime over real unix
sockets (register, Configure, split Synchronize, CreateContainer, Unimplemented, a failing
handler, frames toward a Go reader, runtime restart and re-registration)."""
from __future__ import annotations

import asyncio
import os
import socket

import pytest

from shim.nri import api_pb2 as pb
from shim.nri import events
from shim.nri.handler import Handler, unified_adjustment, unified_update
from shim.nri.plugin import NriPlugin, NriProtocol, register_request
from memqos_dev.testing.fake_nri_runtime import CallFailed, FakeNriRuntime, socket_dir
from shim.transport.ttrpc_mux import TtrpcStatus
from shim.transport.wire import ttrpc

UNIFIED = {"memory.min": "268435456", "memory.high": "966367641"}


# -- bytes -----------------------------------------------------------------------------------

def test_register_plugin_request_bytes():
    # RegisterPluginRequest: plugin_name (field 1) "memqos", plugin_idx (field 2) "50" (nri.md §1.5)
    assert register_request("memqos", "50") == bytes.fromhex("0a06 6d656d716f73 1202 3530")


def configure(proto: NriProtocol, **fields) -> pb.ConfigureResponse:
    resp = proto.serve(ttrpc.Request("nri.pkg.api.v1alpha1.Plugin", "Configure",
                                     pb.ConfigureRequest(**fields).SerializeToString()))
    return resp.payload


def test_configure_response_bytes_per_runtime():
    # the default events: RunPodSandbox 1, RemovePodSandbox 3, CreateContainer 4, UpdateContainer 8,
    # RemoveContainer 11 -> bits 0x1|0x4|0x8|0x80|0x400 = 0x48d; UpdatePodSandbox 12 -> 0x800 where known.
    # ConfigureResponse.events is field 2 (tag 0x10); 0x48d as a varint is 8d 09, 0xc8d is 8d 19.
    assert configure(NriProtocol(Handler()), runtime_name="containerd", runtime_version="2.1.9+unknown") == \
        bytes.fromhex("108d09")
    assert configure(NriProtocol(Handler()), runtime_name="containerd", runtime_version="v2.2.0") == \
        bytes.fromhex("108d19")


@pytest.mark.parametrize("nri, name, version, valid", [
    ("", "containerd", "1.7.24", 0x7ff),
    ("", "containerd", "2.1.9+unknown", 0x7ff),
    ("", "containerd", "2.2.7", 0x3fff),
    ("", "cri-o", "1.33.2", 0x7ff),
    ("", "cri-o", "1.34.0", 0x3fff),
    ("v0.12.0", "containerd", "2.3.0", 0x3fff),
    ("v0.9.0", "containerd", "2.2.7", 0x7ff),  # the runtime's own NRI_version wins
    ("", "somethingelse", "9.9", 0x7ff),  # unknown: the oldest, never a bit it may not know
    ("", "containerd", "garbage", 0x7ff),
])
def test_event_mask_never_has_a_bit_the_runtime_does_not_know(nri, name, version, valid):
    v, _ = events.nri_version(nri, name, version)
    assert events.valid_events(v) == valid
    everything = range(1, 15)  # a handler asking for every event, Validate (0x2000) included
    assert events.event_mask(everything, v) == valid
    assert events.event_mask(Handler.events, v) == (0xc8d if valid == 0x3fff else 0x48d)


def test_create_container_response_with_a_unified_adjustment():
    # CreateContainerResponse.adjust (1) -> ContainerAdjustment.linux (6) -> LinuxContainerAdjustment
    # .resources (2) -> LinuxResources.unified (6), one map entry each {key (1), value (2)}, keys in
    # sorted order (deterministic serialization):
    #   entry "memory.high"=966367641: 0a 0b <11> 12 09 <9>  = 24 bytes -> 32 18 ...
    #   entry "memory.min"=268435456:  0a 0a <10> 12 09 <9>  = 23 bytes -> 32 17 ...
    #   LinuxResources 2+24+2+23 = 51 (0x33) -> 12 33; LinuxContainerAdjustment 53 (0x35) -> 32 35;
    #   ContainerAdjustment 55 (0x37) -> 0a 37; 57 bytes in all.
    want = (bytes.fromhex("0a37 3235 1233 3218 0a0b") + b"memory.high" + bytes.fromhex("1209") + b"966367641"
            + bytes.fromhex("3217 0a0a") + b"memory.min" + bytes.fromhex("1209") + b"268435456")
    got = pb.CreateContainerResponse(adjust=unified_adjustment(UNIFIED)).SerializeToString(deterministic=True)
    assert got == want and len(got) == 57


# -- the protocol handler ----------------------------------------------------------------------

class Recording(Handler):
    def __init__(self, fail: set = frozenset()):
        self.fail = fail
        self.synced = []
        self.seen = []

    def synchronize(self, pods, containers):
        self._maybe_fail("synchronize")
        self.synced.append(([p.id for p in pods], [c.id for c in containers]))
        return [unified_update(c.id, {"memory.min": "4096"}) for c in containers]

    def create_container(self, pod, container):
        self._maybe_fail("create_container")
        self.seen.append(("create", container.id))
        return unified_adjustment(UNIFIED)

    def update_container(self, pod, container, resources):
        self.seen.append(("update", container.id, dict(resources.unified)))
        return [unified_update(container.id, {"memory.high": "max"})]

    def event(self, event, pod, container):
        self.seen.append(("event", event, pod.id, container.id if container else None))

    def _maybe_fail(self, what):
        if what in self.fail:
            raise RuntimeError(f"{what} broke")


def call(proto, method, message, service="nri.pkg.api.v1alpha1.Plugin"):
    return proto.serve(ttrpc.Request(service, method, message.SerializeToString()))


def test_unknown_methods_and_services_are_unimplemented():
    proto = NriProtocol(Handler())
    for service, method in (("nri.pkg.api.v1alpha1.Plugin", "ValidateContainerAdjustment"),
                            ("nri.pkg.api.v1alpha1.Plugin", "NoSuchThing"),
                            ("nri.pkg.api.v1alpha1.Runtime", "RegisterPlugin")):
        with pytest.raises(TtrpcStatus) as err:
            call(proto, method, pb.Empty(), service)
        assert err.value.code == ttrpc.UNIMPLEMENTED
    assert proto.stats.unimplemented == 3


def test_a_failing_handler_and_a_bad_request_get_empty_replies():
    proto = NriProtocol(Recording(fail={"create_container", "synchronize"}))
    req = pb.CreateContainerRequest(pod=pb.PodSandbox(id="p"), container=pb.Container(id="c"))
    assert call(proto, "CreateContainer", req) == ttrpc.Response(b"")
    assert proto.serve(ttrpc.Request("nri.pkg.api.v1alpha1.Plugin", "CreateContainer", b"\x0a\x09x")) == \
        ttrpc.Response(b"")
    assert call(proto, "Synchronize", pb.SynchronizeRequest(more=True)).payload == bytes.fromhex("1001")
    assert call(proto, "Synchronize", pb.SynchronizeRequest()) == ttrpc.Response(b"")
    assert (proto.stats.handler_errors, proto.stats.undecodable) == (2, 1)


def test_split_sync_echoes_more_and_hands_everything_over_at_the_end():
    handler = Recording()
    proto = NriProtocol(handler)
    r1 = call(proto, "Synchronize", pb.SynchronizeRequest(pods=[pb.PodSandbox(id="p1")], more=True))
    r2 = call(proto, "Synchronize", pb.SynchronizeRequest(containers=[pb.Container(id="c1")], more=True))
    assert r1.payload == r2.payload == bytes.fromhex("1001")  # SynchronizeResponse{more (2) = true}, no update
    assert handler.synced == [] and not proto.synchronized
    last = pb.SynchronizeResponse.FromString(call(proto, "Synchronize", pb.SynchronizeRequest(
        pods=[pb.PodSandbox(id="p2")], containers=[pb.Container(id="c2")])).payload)
    assert handler.synced == [(["p1", "p2"], ["c1", "c2"])]
    assert [u.container_id for u in last.update] == ["c1", "c2"] and not last.more


def test_lifecycle_events_from_dedicated_rpcs_and_state_change():
    handler = Recording()
    proto = NriProtocol(handler)
    pod, ctr = pb.PodSandbox(id="p"), pb.Container(id="c")
    assert call(proto, "RunPodSandbox", pb.RunPodSandboxRequest(pod=pod)) == ttrpc.Response(b"")
    call(proto, "RemoveContainer", pb.RemoveContainerRequest(pod=pod, container=ctr))
    call(proto, "StateChange", pb.StateChangeEvent(event=pb.REMOVE_POD_SANDBOX, pod=pod))
    call(proto, "StateChange", pb.StateChangeEvent(event=pb.STOP_CONTAINER, pod=pod, container=ctr))
    upd = pb.UpdateContainerResponse.FromString(call(proto, "UpdateContainer", pb.UpdateContainerRequest(
        pod=pod, container=ctr, linux_resources=pb.LinuxResources(unified={"memory.max": "1"}))).payload)
    assert handler.seen == [("event", pb.RUN_POD_SANDBOX, "p", None), ("event", pb.REMOVE_CONTAINER, "p", "c"),
                            ("event", pb.REMOVE_POD_SANDBOX, "p", None), ("event", pb.STOP_CONTAINER, "p", "c"),
                            ("update", "c", {"memory.max": "1"})]
    assert upd.update[0].container_id == "c" and dict(upd.update[0].linux.resources.unified) == {"memory.high": "max"}


# -- sessions against the fake runtime ---------------------------------------------------------

def pods_and_containers(n: int):
    pods = [pb.PodSandbox(id=f"pod{i}", name=f"p{i}", uid=f"uid-{i}", namespace="default",
                          linux=pb.LinuxPodSandbox(cgroup_parent=f"kubepods-burstable-poduid_{i}.slice"))
            for i in range(n)]
    ctrs = [pb.Container(id=f"ctr{i}", pod_sandbox_id=f"pod{i}", name="app", state=pb.CONTAINER_RUNNING,
                         annotations={"filler": "x" * 300}) for i in range(n)]
    return pods, ctrs


async def with_plugin(runtime: FakeNriRuntime, handler, body, **kw):
    plugin = NriPlugin(handler, index="50", socket_path=runtime.path, backoff=(0.05, 0.2), env={}, **kw)
    stop = asyncio.Event()
    task = asyncio.ensure_future(plugin.run(stop))
    try:
        return await body(plugin)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_session_register_configure_split_sync_create_and_errors():
    pods, ctrs = pods_and_containers(150)  # each Synchronize piece is above 4096 bytes: Go-cut frames

    async def main():
        async with FakeNriRuntime(os.path.join(socket_dir(), "nri.sock"), pods=pods, containers=ctrs,
                                  sync_chunk=100) as rt:
            handler = Recording()

            async def body(plugin):
                p = await rt.next_plugin()
                assert rt.registrations == [("50", "memqos")] and (p.name, p.idx) == ("memqos", "50")
                assert p.events == 0x48d  # containerd 2.1.9: NRI v0.8, no UpdatePodSandbox bit
                assert [r.more for r in p.sync_requests] == [True, True, False]
                assert [(r.more, len(r.update)) for r in p.sync_replies] == [(True, 0), (True, 0), (False, 150)]
                assert handler.synced == [([f"pod{i}" for i in range(150)], [f"ctr{i}" for i in range(150)])]
                # the final reply (150 updates, above 4096 bytes) reached a reader that takes <= 4096-byte frames
                assert p.sync_replies[-1].ByteSize() > 4096 and rt.oversized_frames == 0

                resp = await p.create_container(pods[0], pb.Container(id="new", pod_sandbox_id="pod0"))
                assert dict(resp.adjust.linux.resources.unified) == UNIFIED
                with pytest.raises(CallFailed) as err:
                    await p.call("ValidateContainerAdjustment", pb.ValidateContainerAdjustmentRequest(),
                                 pb.ValidateContainerAdjustmentResponse)
                assert err.value.code == 12
                handler.fail = {"create_container"}
                resp = await p.create_container(pods[0], pb.Container(id="bad"))
                assert resp == pb.CreateContainerResponse()  # empty, not an error: the pod is created
                assert plugin.registered and not p.closed and rt.plugins == [p]
            await with_plugin(rt, handler, body)
    run(main())


def test_an_old_runtimes_unsplit_synchronize_above_4_mib_is_taken():
    # containerd < 1.7.26 (ttrpc <= 1.2.5) sends a large Synchronize whole, above ttrpc's 4 MiB
    pods, ctrs = pods_and_containers(2)
    ctrs[0].annotations["big"] = "y" * (4 << 20)

    async def main():
        async with FakeNriRuntime(os.path.join(socket_dir(), "nri.sock"), runtime_version="1.7.24",
                                  nri_version=(0, 6, 1), pods=pods, containers=ctrs) as rt:
            handler = Recording()

            async def body(plugin):
                p = await rt.next_plugin()
                assert p.sync_requests[0].ByteSize() > (4 << 20) and not p.sync_requests[0].more
                assert handler.synced == [(["pod0", "pod1"], ["ctr0", "ctr1"])] and rt.refused == []
            await with_plugin(rt, handler, body)
    run(main())


def test_old_runtime_without_timeouts_gets_a_mask_it_knows():
    class Greedy(Handler):
        events = frozenset(range(1, 15))  # Validate and UpdatePodSandbox included

    async def main():
        async with FakeNriRuntime(os.path.join(socket_dir(), "nri.sock"), runtime_version="1.7.24",
                                  nri_version=(0, 6, 1), send_timeouts=False) as rt:
            async def body(plugin):
                p = await rt.next_plugin()
                assert p.events == 0x7ff and rt.refused == []
            await with_plugin(rt, Greedy(), body)
    run(main())


def test_the_fake_runtime_refuses_unknown_event_bits(monkeypatch):
    # the fake's own check, which the test above relies on: 0x2000 (Validate) on NRI v0.8 is
    # refused, as containerd 2.1.5 refused it (c8s#620)
    monkeypatch.setattr("shim.nri.plugin.event_mask", lambda wanted, version: 0x2000)

    async def main():
        async with FakeNriRuntime(os.path.join(socket_dir(), "nri.sock")) as rt:
            async def body(plugin):
                while not rt.refused:
                    await asyncio.sleep(0.01)
                assert rt.refused[0] == "invalid plugin events: 0x2000" and rt.plugins == []
            await with_plugin(rt, Handler(), body)
    run(main())


def test_runtime_restart_and_eviction_lead_to_exactly_one_live_registration():
    async def main():
        path = os.path.join(socket_dir(), "nri.sock")
        handler = Recording()
        rt1 = FakeNriRuntime(path)
        await rt1.__aenter__()

        async def body(plugin):
            p1 = await rt1.next_plugin()
            await rt1.stop()  # containerd restarts: no Shutdown, the socket closes
            async with FakeNriRuntime(path) as rt2:
                p2 = await rt2.next_plugin()
                assert (await p2.create_container(pb.PodSandbox(id="p"), pb.Container(id="c"))).adjust.linux
                assert rt2.registrations == [("50", "memqos")] and rt2.plugins == [p2] and p1.closed
                # the runtime drops the plugin (as after a timeout): it comes back, once
                p2.close("failed to handle CreateContainer request: context deadline exceeded")
                p3 = await rt2.next_plugin()
                await p3.create_container(pb.PodSandbox(id="p"), pb.Container(id="c2"))
                assert rt2.registrations == [("50", "memqos")] * 2 and rt2.plugins == [p3]
                assert plugin.stats.registrations == 3
        await with_plugin(rt1, handler, body)
        assert handler.seen.count(("create", "c")) == 1
    run(main())


def test_plugin_started_by_the_runtime_uses_the_inherited_socket():
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        async with FakeNriRuntime(os.path.join(socket_dir(), "nri.sock")) as rt:
            await rt.adopt(ours)
            env = {"NRI_PLUGIN_SOCKET": str(theirs.fileno()), "NRI_PLUGIN_NAME": "memqos", "NRI_PLUGIN_IDX": "07"}
            plugin = NriPlugin(Handler(), index="50", socket_path="/nonexistent", env=env)
            task = asyncio.ensure_future(plugin.run())
            p = await rt.next_plugin()
            assert rt.registrations == [("07", "memqos")]
            p.close("runtime stopped")
            await asyncio.wait_for(task, 10)  # an inherited socket is not reconnected: run returns
            assert plugin.stats.connects == 1
        theirs.detach()
    run(main())


def test_plugin_waits_for_a_runtime_that_is_not_there_yet():
    async def main():
        path = os.path.join(socket_dir(), "nri.sock")

        async def body(plugin):
            while plugin.stats.failures < 2:  # connect refused (no socket yet), retried with backoff
                await asyncio.sleep(0.01)
            async with FakeNriRuntime(path) as rt:
                await rt.next_plugin()
                assert rt.registrations == [("50", "memqos")] and plugin.registered
        rt = FakeNriRuntime(path)
        await with_plugin(rt, Handler(), body)
    run(main())


@pytest.mark.parametrize("name, index", [("memqos", "5"), ("memqos", "ab"), ("mem qos", "50"), ("", "50")])
def test_identity_a_runtime_would_refuse_is_refused_up_front(name, index):
    with pytest.raises(ValueError):
        NriPlugin(Handler(), name=name, index=index, env={})
