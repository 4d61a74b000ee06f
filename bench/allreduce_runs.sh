#!/usr/bin/env bash
# Run-to-run spread of the one-host allreduce, quiet and beside busy processes: troupe (through
# shared memory, the one-host default), troupe over its transport (--no-shared-memory: UCX
# shared memory through UCX's progress thread), and torch.distributed gloo, interleaved, RUNS
# times each, at each LOADS level (that many `while :; do :; done` shells beside the ranks).
#
#   bench/allreduce_runs.sh [results-dir]         (default build/bench/runs)
#   RUNS=10 LOADS="0 2" WORLD=2 SIZES=4MiB,64MiB SECONDS_PER_SIZE=0.5 bench/allreduce_runs.sh
#
# Prints, per load, size and side: the median, min and max algbw (GB/s) over the runs, max/min
# (the spread), and the median's ratio to gloo's median. Raw lines in results-dir/*.jsonl.
# TROUPE_BIN and TROUPE_PYTHON as in allreduce_vs_gloo.sh.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${1:-$root/build/bench/runs}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
python="${TROUPE_PYTHON:-$root/.venv/bin/python}"
runs="${RUNS:-10}"
loads="${LOADS:-0 2}"
world="${WORLD:-2}"
sizes="${SIZES:-4MiB,64MiB}"
seconds="${SECONDS_PER_SIZE:-0.5}"

[[ -x "$troupe" ]] || { echo "allreduce_runs: no troupe binary at '$troupe' (TROUPE_BIN)" >&2; exit 1; }
"$python" -c 'import torch.distributed' 2>/dev/null ||
  { echo "allreduce_runs: $python has no torch (TROUPE_PYTHON)" >&2; exit 1; }

mkdir -p "$results"
hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  hogs=()
}
trap stop_hogs EXIT

for load in $loads; do
  for ((k = 0; k < load; ++k)); do
    bash -c 'while :; do :; done' &
    hogs+=($!)
  done
  for side in shm transport gloo; do : > "$results/load${load}_$side.jsonl"; done
  for ((run = 1; run <= runs; ++run)); do
    echo "load $load, run $run of $runs" >&2
    "$troupe" bench allreduce --world "$world" --bytes "$sizes" --transport ucx \
      --seconds "$seconds" --json >> "$results/load${load}_shm.jsonl"
    "$troupe" bench allreduce --world "$world" --bytes "$sizes" --transport ucx \
      --seconds "$seconds" --json --no-shared-memory >> "$results/load${load}_transport.jsonl"
    "$python" "$root/bench/allreduce_gloo.py" --world "$world" --bytes "$sizes" \
      --target-sec "$seconds" --json >> "$results/load${load}_gloo.jsonl"
  done
  stop_hogs
done

"$python" - "$results" $loads <<'EOF'
import json, statistics, sys
results, loads = sys.argv[1], sys.argv[2:]
names = {"shm": "troupe (shared memory)", "transport": "troupe --no-shared-memory", "gloo": "gloo"}
print("| busy shells | size | side | runs | median GB/s | min | max | max/min | median / gloo |")
print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
for load in loads:
    by = {}
    for side in names:
        for line in open(f"{results}/load{load}_{side}.jsonl"):
            row = json.loads(line)
            by.setdefault((row["bytes"], side), []).append(row["algbw_GBps"])
    for size in sorted({b for b, _ in by}):
        gloo = statistics.median(by[(size, "gloo")])
        for side, name in names.items():
            v = by[(size, side)]
            med = statistics.median(v)
            print(f"| {load} | {size >> 20} MiB | {name} | {len(v)} | {med:.3f} | {min(v):.3f} | "
                  f"{max(v):.3f} | {max(v) / min(v):.2f} | {med / gloo:.2f}x |")
EOF
