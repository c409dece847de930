"""Tools: the operator's commands beside `serve` (replay, trace show, reset, doctor, explain
--plot, enable-nri, demo). Nothing here runs inside `serve`."""
