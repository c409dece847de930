"""Kept for tests that import it from here; the builders live in shim.kubelet_requests."""
from shim.kubelet_requests import *  # noqa: F401,F403
from shim.kubelet_requests import MI, CAPACITY  # noqa: F401
