#!/usr/bin/env bash
# The data-parallel step of two troupe builds side by side in one session (a refactor's "within
# noise" check): `troupe bench ddp --world 2 --interleave --model mlp --batch 64 --steps I --json`
# of the old and the new binary, alternating (old first in odd rounds, new first in even ones).
#
#   bench/ddp_before_after.sh OLD_TROUPE NEW_TROUPE [rounds] [iterations]   (defaults: 8, 30)
#
# BENCH_ARGS adds options to every run, e.g.
#   BENCH_ARGS="--bind-cores --algorithm powersgd:rank=2,start_iter=2" bench/ddp_before_after.sh ...
#
# Prints one JSON line per run, then per build the medians over rounds of the step, of every rank
# computing alone and of the overhead over it, and per round the new/old step ratio and the
# difference in overhead (percentage points).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
script=ddp_before_after
source "$root/bench/common.sh"
(( $# >= 2 )) || die "usage: bench/ddp_before_after.sh OLD_TROUPE NEW_TROUPE [rounds] [iterations]"
old="$1" new="$2" rounds="${3:-8}" iterations="${4:-30}"
need_troupe "$old"
need_troupe "$new"
need_positive_int rounds "$rounds"
need_positive_int iterations "$iterations"

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then order=(old new); else order=(new old); fi
  for which in "${order[@]}"; do
    bin=$old
    [[ $which == new ]] && bin=$new
    line=$("$bin" bench ddp --world 2 --interleave --model mlp --batch 64 --steps "$iterations" \
             --json ${BENCH_ARGS:-} 2>/dev/null) || die "the $which run of round $r failed"
    echo "{\"round\": $r, \"build\": \"$which\", \"load\": $(cut -d' ' -f1 /proc/loadavg), ${line#\{}" |
      tee -a "$out"
  done
done

/usr/bin/python3 - "$out" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
med = statistics.median
print()
print("| build | step (ms) | every rank computing alone (ms) | over computing alone |")
print("|---|---:|---:|---:|")
for b in ("old", "new"):
    x = [r for r in runs if r["build"] == b]
    print(f"| {b} | {med(r['step_sec'] for r in x) * 1e3:.2f} | "
          f"{med(r['compute_step_sec'] for r in x) * 1e3:.2f} | "
          f"{med(r['overhead_vs_compute'] for r in x) * 100:+.1f}% |")
by = {(r["round"], r["build"]): r for r in runs}
ratios = [by[k, "new"]["step_sec"] / by[k, "old"]["step_sec"] for k in sorted({r["round"] for r in runs})]
points = [(by[k, "new"]["overhead_vs_compute"] - by[k, "old"]["overhead_vs_compute"]) * 100
          for k in sorted({r["round"] for r in runs})]
print()
print("new/old step per round:", ", ".join(f"{x:.3f}" for x in ratios), f"(median {med(ratios):.3f})")
print("new - old overhead per round (points):", ", ".join(f"{x:+.1f}" for x in points),
      f"(median {med(points):+.2f})")
PY
