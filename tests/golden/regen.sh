#!/usr/bin/env bash
# Regenerate the replay golden files: one tests/golden/<trace>.replay.jsonl per trace in
# tests/data/traces (or the directory given as $1; .jsonl, .jsonl.xz and .jsonl.gz), from
# `memqos-shim replay TRACE --json`.
# Review the diff (git diff tests/golden) before committing: a change here is a change in
# what the shim writes into containers' cgroups for real kubelet traffic.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
traces=$(cd "${1:-$root/tests/data/traces}" && pwd)
cd "$root"
shopt -s nullglob
for t in "$traces"/*.jsonl "$traces"/*.jsonl.xz "$traces"/*.jsonl.gz; do
    name=$(basename "$t"); name=${name%.xz}; name=${name%.gz}; name=${name%.jsonl}
    .venv/bin/python -m shim replay "$t" --json > "tests/golden/$name.replay.jsonl"
    echo "tests/golden/$name.replay.jsonl: $(wc -l < "tests/golden/$name.replay.jsonl") records"
done
