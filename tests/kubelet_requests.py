"""Kept for tests that import it from here; the builders live in shim.tools.kubelet_requests."""
from shim.tools.kubelet_requests import *  # noqa: F401,F403
from shim.tools.kubelet_requests import MI, CAPACITY  # noqa: F401
