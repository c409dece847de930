"""Tools: the operator's commands beside `serve` (replay, trace show, reset, doctor, explain
--plot), the demo and the benchmarks. Nothing here runs inside `serve`."""
