"""Container: memory QoS of one container on the CRI path. The rewriter parses CreateContainer and
UpdateContainerResources, asks shim.decision, changes `unified`, and audits the decision."""
