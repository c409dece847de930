"""The committed stubs in shim/cri are what scripts/gen-stubs makes from proto/ today,
and proto/ is what scripts/proto-from-reference makes from the field tables in proto/cri-api-v1.md."""
import filecmp
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "proto" / "cri-api-v1.md"


def test_stubs_match_proto(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-stubs"), str(tmp_path)], check=True, env=env)
    for name in ("api_pb2.py", "api_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / name, ROOT / "shim" / "cri" / name, shallow=False), (
            f"shim/cri/{name} is stale: run scripts/gen-stubs"
        )


def test_proto_matches_reference():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "proto-from-reference"), str(REFERENCE)],
                         check=True, capture_output=True, text=True).stdout
    assert out == (ROOT / "proto" / "runtime" / "v1" / "api.proto").read_text()


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
