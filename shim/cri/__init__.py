"""CRI runtime.v1 messages and service stubs, generated from proto/ (see scripts/gen-stubs)."""
from shim.cri import api_pb2 as pb  # noqa: F401
