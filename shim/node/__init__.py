"""Node: what the shim knows of this node (facts read once at start, what the kubelet writes
itself), the pods and containers on it (state, fed by finished CRI calls and the runtime's
listings), and the side thread that keeps pod, QoS-class and node values right (reconciler)."""
