"""Testing: stand-ins for the world around the shim, shipped for the demo, the benchmarks, the
replays and the tests: a fake CRI runtime, a runtime that answers from a trace, kubelet-shaped
requests, and where the recorded kubelet traces are."""
