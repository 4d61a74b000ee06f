#!/usr/bin/env bash
# Fashion-MNIST (CNN), 4 processes, the local-update algorithms (issue 19) side by side with full
# allreduce in the same run: test accuracy after the last epoch, bytes rank 0 sent over the whole
# run, how many times fewer than allreduce, and the most one synchronization sent (peak bytes per
# sync, CommStats::peak_sync_bytes_sent). Prints a Markdown table; every run's full output is kept
# in the log folder.
#   bench/diloco_cnn.sh [build dir] [epochs] [algorithm ...]
# The first algorithm is the baseline of the ratios (allreduce unless named otherwise).
# Environment: WORLD (4), LR (0.05), EXTRA (more fashion_mnist arguments, e.g. --seed 1),
# PARAMS (206922, the CNN's parameter count), LOGS (folder of the runs' output; default a new temporary folder).
# Bytes: "ring" is what a ring allreduce of the baseline's fp32 gradient sends per rank over a
# network, 2 (W-1)/W x 4 bytes x parameters per step; ranks on one host take the shared-memory
# path, whose measured count is smaller, so both ratios are printed.
set -euo pipefail
script=diloco_cnn.sh
source "$(dirname "$0")/common.sh"
BUILD="${1:-build}"
EPOCHS="${2:-2}"
shift $(( $# > 2 ? 2 : $# ))
ALGORITHMS=("$@")
if [ ${#ALGORITHMS[@]} -eq 0 ]; then
  # the paper's outer step (outer_lr 0.7, Nesterov momentum 0.9) unless named, then settings
  # that met issue 19's goals in docs/benchmarks.md
  ALGORITHMS=(allreduce diloco:h=50,compress=fp16 diloco:h=50,compress=fp16,outer_lr=1.0,outer_momentum=0.5
              diloco:h=16,compress=int4 streaming-diloco:h=64,fragments=4,delay=2,compress=int4
              sparseloco:h=50)
fi
WORLD="${WORLD:-4}"
LR="${LR:-0.05}"
PARAMS="${PARAMS:-206922}"  # the CNN's parameters (--model cnn)
need_positive_int "epochs" "$EPOCHS"
need_positive_int "WORLD" "$WORLD"
[[ -x "$BUILD/bin/fashion_mnist" && -x "$BUILD/bin/troupe" ]] ||
  die "no $BUILD/bin/fashion_mnist or $BUILD/bin/troupe; build them first"
LOGS="${LOGS:-$(mktemp -d /tmp/diloco_cnn.XXXXXX)}"
mkdir -p "$LOGS"
echo "runs' output in $LOGS; load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

echo "| algorithm | test accuracy (%) | vs first (points) | MB sent, rank 0 | fewer bytes than first (measured) | fewer bytes than a ring allreduce | peak KB per sync | wall (s) |"
echo "|---|---|---|---|---|---|---|---|"
base_acc="" base_bytes="" ring_bytes=""
i=0
for algo in "${ALGORITHMS[@]}"; do
  i=$((i + 1))
  log="$LOGS/$i.log"
  start=$(date +%s.%N)
  if ! "$BUILD/bin/troupe" launch -n "$WORLD" -- "$BUILD/bin/fashion_mnist" --epochs "$EPOCHS" \
        --lr "$LR" --log-every 100000 --algorithm "$algo" ${EXTRA:-} >"$log" 2>&1; then
    echo "| $algo | failed: $(tail -1 "$log") | | | | | | |"; continue
  fi
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  acc=$(grep "epoch $EPOCHS test accuracy" "$log" | tail -1 | sed -E 's/.*accuracy ([0-9.]+)%.*/\1/')
  per_step=$(grep "epoch $EPOCHS test accuracy" "$log" | tail -1 | sed -E 's/.*per step ([0-9.]+) .*/\1/')
  # the total is the mean per step (printed to the byte) x the steps: rank 0's "finished:" line
  # (local-update and decentralized algorithms) counts them; the bucket algorithms take one step
  # per full batch
  steps=$(grep -F "[rank 0] finished: " "$log" | grep -oE "finished: [0-9]+ steps" | grep -oE "[0-9]+" || true)
  [ -n "$steps" ] || steps=$(( EPOCHS * ( 60000 / WORLD / 64 ) ))
  mb=$(echo "scale=3; $per_step * $steps / 1000000" | bc)
  peak=$(grep -F "[rank 0] finished: " "$log" | sed -nE 's/.*peak ([0-9.]+) MB per sync.*/\1/p' || true)
  if [ -n "$peak" ]; then
    peak_kb=$(echo "$peak" | awk '{printf "%.0f", $1 * 1000}')
  else
    peak_kb=$(echo "$per_step" | awk '{printf "%.0f", $1 / 1000}')  # every step is one sync
  fi
  if [ -z "$base_acc" ]; then
    base_acc=$acc; base_bytes=$mb
    # every step of the baseline is one allreduce of the fp32 gradient
    ring_bytes=$(echo "scale=3; 2 * ($WORLD - 1) * 4 * $PARAMS * $steps / $WORLD / 1000000" | bc)
  fi
  delta=$(echo "$acc - $base_acc" | bc)
  ratio=$(awk -v a="$base_bytes" -v b="$mb" 'BEGIN { printf "%.1f", a / b }')
  ring=$(awk -v a="$ring_bytes" -v b="$mb" 'BEGIN { printf "%.1f", a / b }')
  printf "| %s | %s | %+.2f | %s | %sx | %sx | %s | %.0f |\n" "$algo" "$acc" "$delta" "$mb" "$ratio" \
    "$ring" "$peak_kb" "$wall"
done
[ -z "$ring_bytes" ] || echo "ring allreduce of the fp32 gradient over the first run's steps: $ring_bytes MB per rank" >&2
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
