#!/usr/bin/env bash
# The cost of data parallelism measured inside one job, troupe beside PyTorch DDP (gloo): MLP
# 784-2048-2048-1024-10, batch 64 per rank, one intra-op thread per rank, SGD with momentum.
#
#   bench/ddp_interleaved.sh [rounds] [iterations] [world]      (defaults: 3, 20, 2)
#
# Each round runs, one after the other (the first two swap places every other round):
#   troupe bench ddp --world N --interleave --model mlp --batch 64 --steps I --json
#   bench/ddp_torch.py --world N --interleave --model mlp --batch 64 --steps I --json
#   troupe bench ddp --world N --interleave --no-shared-memory ... --json
# In such a job every iteration runs a data-parallel step, a step of every rank computing alone
# (nothing reduced) and a step of rank 0 alone (the others wait), each after a barrier, in an
# order that rotates, so the machine's speed drifting over minutes cancels out of the paired
# per-iteration ratios. The script prints one JSON line per run, then per implementation the
# medians over rounds of: the step, the two baselines, and the two overheads (data parallel over
# every rank computing alone: what data parallelism costs; over rank 0 alone: what it costs and
# what two processes computing at once cost each other on this machine).
# Environment: TROUPE_BIN overrides the troupe binary (default build/bin/troupe); MODEL=cnn runs
# the Fashion-MNIST CNN instead of the MLP (both sides).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
iterations="${2:-20}"
world="${3:-2}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
python="${TROUPE_PYTHON:-$root/.venv/bin/python}"  # the torch troupe is built against

script=ddp_interleaved
source "$root/bench/common.sh"
need_positive_int rounds "$rounds"
need_positive_int iterations "$iterations"
need_positive_int world "$world"
(( world >= 2 )) || die "world '$world': expected >= 2 (the baselines run inside the job)"
need_troupe "$troupe"
need_torch "$python"

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
common=(--world "$world" --interleave --model "${MODEL:-mlp}" --batch 64 --steps "$iterations" --json)
run() {
  local impl="$1" round="$2" line
  case "$impl" in
    troupe) line=$("$troupe" bench ddp "${common[@]}") ;;
    troupe-transport) line=$("$troupe" bench ddp "${common[@]}" --no-shared-memory) ;;
    torch) line=$("$python" "$root/bench/ddp_torch.py" "${common[@]}") ;;
  esac || die "the $impl run of round $round failed"
  echo "{\"round\": $round, \"run\": \"$impl\", ${line#\{}" | tee -a "$out"
}
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then order=(troupe torch troupe-transport); else order=(torch troupe troupe-transport); fi
  for impl in "${order[@]}"; do run "$impl" "$r"; done
done

"$python" - "$out" <<'EOF'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
med = statistics.median
print()
print("| run | step (ms) | every rank computing alone (ms) | rank 0 alone (ms) "
      "| over computing alone, per round | median | over rank 0 alone, median |")
print("|---|---:|---:|---:|---|---:|---:|")
for impl in ("troupe", "troupe-transport", "torch"):
    rs = [r for r in runs if r["run"] == impl]
    each = ", ".join(f"{r['overhead_vs_compute']:+.1%}" for r in rs)
    print(f"| {impl} | {med(r['step_sec'] for r in rs) * 1e3:.1f} "
          f"| {med(r['compute_step_sec'] for r in rs) * 1e3:.1f} "
          f"| {med(r['alone_step_sec'] for r in rs) * 1e3:.1f} | {each} "
          f"| {med(r['overhead_vs_compute'] for r in rs):+.1%} "
          f"| {med(r['overhead_vs_alone'] for r in rs):+.1%} |")
EOF
