"""The committed stubs in shim/cri and shim/nri are what scripts/gen-stubs makes from proto/ today,
and proto/ is what scripts/proto-from-reference makes from the field tables in proto/*.md."""
import filecmp
import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "proto" / "cri-api-v1.md"
REFERENCES = {  # field tables -> the proto written from them
    "cri-api-v1.md": "runtime/v1/api.proto",
    "nri-api-v1alpha1.md": "nri/pkg/api/v1alpha1/api.proto",
    "ttrpc-v1.md": "ttrpc/request.proto",
}


def test_stubs_match_proto(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-stubs"), str(tmp_path / "cri"), str(tmp_path / "nri"),
                    str(tmp_path / "grpc")], check=True, env=env)
    for made, committed in (("cri/api_pb2.py", "shim/cri/api_pb2.py"), ("nri/api_pb2.py", "shim/nri/api_pb2.py"),
                            ("nri/ttrpc_pb2.py", "shim/nri/ttrpc_pb2.py"),
                            ("grpc/cri_grpc.py", "memqos_dev/testing/cri_grpc.py")):
        assert filecmp.cmp(tmp_path / made, ROOT / committed, shallow=False), (
            f"{committed} is stale: run scripts/gen-stubs"
        )


@pytest.mark.parametrize("reference", sorted(REFERENCES))
def test_proto_matches_reference(reference):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "proto-from-reference"),
                          str(ROOT / "proto" / reference)], check=True, capture_output=True, text=True).stdout
    assert out == (ROOT / "proto" / REFERENCES[reference]).read_text()


def test_all_43_methods():
    from shim.cri import pb

    rt = pb.DESCRIPTOR.services_by_name["RuntimeService"].methods
    img = pb.DESCRIPTOR.services_by_name["ImageService"].methods
    assert (len(rt), len(img)) == (37, 6)
    assert pb.DESCRIPTOR.package == "runtime.v1"
    # wire facts spot-checked against the reference tables
    f = pb.LinuxContainerResources.DESCRIPTOR.fields_by_name
    assert (f["unified"].number, f["memory_limit_in_bytes"].number, f["oom_score_adj"].number) == (9, 4, 5)
    assert pb.CreateContainerRequest.DESCRIPTOR.fields_by_name["sandbox_config"].number == 3


def test_nri_api_v0_12_2():
    from shim.nri import pb, ttrpc_pb2

    assert pb.DESCRIPTOR.package == "nri.pkg.api.v1alpha1"
    plugin = pb.DESCRIPTOR.services_by_name["Plugin"].methods
    runtime = pb.DESCRIPTOR.services_by_name["Runtime"].methods
    assert (len(plugin), len(runtime)) == (18, 2)
    # wire facts spot-checked against the reference tables (field 1 of ConfigureResponse is unused)
    assert pb.ConfigureResponse.DESCRIPTOR.fields_by_name["events"].number == 2
    assert pb.ContainerAdjustment.DESCRIPTOR.fields_by_name["linux"].number == 6
    assert pb.LinuxContainerAdjustment.DESCRIPTOR.fields_by_name["resources"].number == 2
    assert pb.LinuxResources.DESCRIPTOR.fields_by_name["unified"].number == 6
    assert pb.SynchronizeResponse.DESCRIPTOR.fields_by_name["more"].number == 2
    assert pb.Container.DESCRIPTOR.fields_by_name["image"].number == 22
    assert (pb.UPDATE_POD_SANDBOX, pb.VALIDATE_CONTAINER_ADJUSTMENT, pb.LAST) == (12, 14, 15)
    assert [f.number for f in ttrpc_pb2.Request.DESCRIPTOR.fields] == [1, 2, 3, 4, 5]
    assert [f.name for f in ttrpc_pb2.Status.DESCRIPTOR.fields] == ["code", "message", "details"]
