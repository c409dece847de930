"""Stand-ins for the world around the shim, for the tests and the benchmarks: a fake CRI runtime,
containerd's side of NRI, a rapid-reset HTTP/2 client, and where the recorded kubelet traces are."""
