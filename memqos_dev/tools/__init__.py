"""The measurements behind scripts/bench, bench-ab, bench-instructions, start-latency,
reset-storm, h2-limits, soak and nri-latency."""
