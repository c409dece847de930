"""`scripts/bench`: the shim's cost, measured side by side with a direct connection.

One run starts a fake CRI runtime (``python -m memqos_dev.tools.bench upstream``: memqos_dev.testing.fake_runtime with
ExecSync answering a requested number of stdout bytes) and one ``memqos-shim serve`` process per
transport in front of it, each in its own process, so that the shim's CPU and RSS are read from
``/proc/<pid>``. This process is the client (grpcio: a sync channel for latencies, grpc.aio for
concurrency). Every latency measurement rotates between the targets (direct, then each shim)
call by call, so machine drift hits them alike; the figures are medians over ``--runs`` runs,
each with fresh processes.

Measured per target: p50/p99 of a small unary call (Version); p50 of 200 KB and 16 MiB
replies (ExecSync); calls/s with 32 concurrent callers; a quick call's latency while 100 slow
calls (PullImage, delayed 2 s by the runtime) are in flight; a CreateContainer (rewritten by the
shim) against a passthrough call of the same request size; the same two kinds of call sent back to
back by one client (each as soon as the answer to the one before is in: ~4 KB CreateContainer
calls and passthrough calls of their size, in blocks per target), with the shim's CPU per call
read after each block settles, so that work the shim does after an answer counts; shim CPU per 1000 small calls; shim
RSS idle, after 20k and 100k calls (RSS growth) and at the end; and a kubelet-like steady
load for a 110-pod node (the relist/status/stats mix of the recorded kubelet traces in tests/data/traces, per-container and
per-pod calls scaled to 110 pods, list replies as large as 110 pods make them), reporting the
shim's CPU share of one core during it.

    python -m memqos_dev.tools.bench [--quick] [--runs N] [--only back-to-back,...] [--json FILE]
"""
