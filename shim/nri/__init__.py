"""The NRI protobuf boundary: the generated NRI messages (``api_pb2``, containerd/nri v0.12.2,
package nri.pkg.api.v1alpha1) and ttrpc's envelope (``ttrpc_pb2``), both from proto/ (see
scripts/gen-stubs); the event mask per runtime version (``events``), the plugin's protocol
handler (``plugin``) and the handler interface the front end implements (``handler``)."""
from shim.nri import api_pb2 as pb  # noqa: F401
