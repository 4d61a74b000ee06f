#!/usr/bin/env bash
# Fashion-MNIST (CNN), 4 processes over UCX, every gradient algorithm against full allreduce:
# test accuracy after the last epoch, and bytes rank 0 sent per step (mean over the run, and the
# last step, i.e. after any warm-up). Prints a Markdown table.
#   bench/fashion_mnist_algorithms.sh [build dir] [epochs] [algorithm ...]
# Environment: WORLD (4), LR (0.05), EXTRA (more fashion_mnist arguments, e.g. --seed 1),
# TROUPE_LINK (link emulation, e.g. 1gbit,5ms). An algorithm with momentum correction
# (topk:ratio=0.01,momentum=0.9) runs SGD with --momentum 0: its compressor applies the momentum.
set -euo pipefail
BUILD="${1:-build}"
EPOCHS="${2:-2}"
shift $(( $# > 2 ? 2 : $# ))
ALGORITHMS=("$@")
if [ ${#ALGORITHMS[@]} -eq 0 ]; then
  ALGORITHMS=(allreduce fp16 bf16 bytegrad sign topk:ratio=0.01 topk:ratio=0.01,momentum=0.9
              randomk:ratio=0.01,momentum=0.9 blockk:ratio=0.01,momentum=0.9 powersgd:rank=2)
fi
WORLD="${WORLD:-4}"
LR="${LR:-0.05}"
echo "| algorithm | test accuracy (%) | vs allreduce (points) | bytes/step, mean | bytes/step, last | fewer bytes than allreduce (last step) | wall (s) |"
echo "|---|---|---|---|---|---|---|"
base_acc=""
base_bytes=""
for algo in "${ALGORITHMS[@]}"; do
  start=$(date +%s.%N)
  own_momentum=""
  case "$algo" in *momentum=*) own_momentum="--momentum 0" ;; esac
  out=$("$BUILD/bin/troupe" launch -n "$WORLD" -- "$BUILD/bin/fashion_mnist" --epochs "$EPOCHS" \
        --lr "$LR" --log-every 100000 --algorithm "$algo" ${EXTRA:-} $own_momentum 2>&1) || {
    echo "| $algo | failed: $(echo "$out" | tail -1) | | | | | |"; continue; }
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  line=$(echo "$out" | grep "epoch $EPOCHS test accuracy" | tail -1)
  acc=$(echo "$line" | sed -E 's/.*accuracy ([0-9.]+)%.*/\1/')
  mean=$(echo "$line" | sed -E 's/.*per step ([0-9]+) .*/\1/')
  last=$(echo "$line" | sed -E 's/.*last step ([0-9]+)\).*/\1/')
  if [ -z "$base_acc" ]; then base_acc=$acc; base_bytes=$last; fi
  delta=$(echo "$acc - $base_acc" | bc)
  ratio=$(echo "scale=1; $base_bytes / $last" | bc)
  printf "| %s | %s | %+.2f | %s | %s | %sx | %.0f |\n" "$algo" "$acc" "$delta" "$mean" "$last" "$ratio" "$wall"
done
