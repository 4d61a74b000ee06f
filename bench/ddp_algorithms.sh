#!/usr/bin/env bash
# Step time of every gradient algorithm against full allreduce: `troupe bench ddp` (MLP
# 784-2048-2048-1024-10, batch 64 per rank, one intra-op thread per rank), optionally over
# emulated links (LINK, e.g. "1gbit,5ms": TROUPE_LINK for every rank). Prints a Markdown table:
# median step, step relative to allreduce in the same run, and bytes rank 0 sent per step.
#   LINK=1gbit,5ms bench/ddp_algorithms.sh [build dir] [steps] [world] [algorithm ...]
set -euo pipefail
BUILD="${1:-build}"
STEPS="${2:-10}"
WORLD="${3:-2}"
shift $(( $# > 3 ? 3 : $# ))
ALGORITHMS=("$@")
if [ ${#ALGORITHMS[@]} -eq 0 ]; then
  ALGORITHMS=(allreduce fp16 bytegrad sign topk:ratio=0.01 randomk:ratio=0.01 blockk:ratio=0.01
              powersgd:rank=2,start_iter=2)
fi
if [ -n "${LINK:-}" ]; then export TROUPE_LINK="$LINK"; fi
echo "world $WORLD, $STEPS steps, links: ${TROUPE_LINK:-not emulated}"
echo
echo "| algorithm | median step (ms) | vs allreduce | wait after backward (ms) | MB sent per step |"
echo "|---|---:|---:|---:|---:|"
base=""
for algo in "${ALGORITHMS[@]}"; do
  line=$("$BUILD/bin/troupe" bench ddp --world "$WORLD" --model mlp --batch 64 --steps "$STEPS" \
         --algorithm "$algo" --json | grep '^{' | tail -1)
  read -r step wait bytes < <(/usr/bin/python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(r["step_sec"], r["comm_wait_sec"], r["bytes_sent_per_step"])' "$line")
  [ -z "$base" ] && base=$step
  /usr/bin/python3 -c 'import sys; a,s,w,b,base=sys.argv[1],*map(float,sys.argv[2:]); print(f"| {a} | {s*1e3:.1f} | {s/base:.2f}x | {w*1e3:.1f} | {b/1e6:.2f} |")' "$algo" "$step" "$wait" "$bytes" "$base"
done
