"""memqos-shim: a CRI proxy that gives containers, pods and the node memory QoS on cgroup v2."""
__version__ = "0.1.0"
