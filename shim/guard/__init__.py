"""Guard: the side thread that samples every managed container's cgroup (the monitor), the
memory.high safety guard it runs on the samples, its episodes kept across restarts, and
proactive reclaim. The verdicts are shim.decision's; the writes go through shim.effects."""
