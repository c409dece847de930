"""Transport: the gRPC server the kubelet talks to and the one upstream channel to the runtime."""
