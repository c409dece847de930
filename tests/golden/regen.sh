#!/usr/bin/env bash
# Regenerate the replay golden files: one tests/golden/<trace>.replay.jsonl per trace in
# ../shared/traces (or the directory given as $1), from `memqos-shim replay TRACE --json`.
# Review the diff (git diff tests/golden) before committing: a change here is a change in
# what the shim writes into containers' cgroups for real kubelet traffic.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
traces=$(cd "${1:-$(bash "$root/scripts/shared-dir")/traces}" && pwd)
cd "$root"
for t in "$traces"/*.jsonl; do
    name=$(basename "$t" .jsonl)
    .venv/bin/python -m shim replay "$t" --json > "tests/golden/$name.replay.jsonl"
    echo "tests/golden/$name.replay.jsonl: $(wc -l < "tests/golden/$name.replay.jsonl") records"
done
