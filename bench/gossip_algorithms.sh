#!/usr/bin/env bash
# Fashion-MNIST (CNN), 8 ranks as threads of one process (troupe run), every decentralized and
# asynchronous algorithm against full allreduce: test accuracy of rank 0's model after the last
# epoch, the consensus distance, time per epoch and bytes rank 0 sent per step. Prints a
# Markdown table.
#   bench/gossip_algorithms.sh [build dir] [epochs] [algorithm ...]
# Algorithms: allreduce, dpsgd_ring, dpsgd_torus_ats, dpsgd_exponential, low_precision,
# async_average, async_gossip. Environment: WORLD (8), LINK (emulate every link, e.g.
# 1gbit,5ms), SLOW (one slow rank, e.g. 3=100mbit,20ms), LR (0.05).
set -euo pipefail
BUILD="${1:-build}"
EPOCHS="${2:-2}"
shift $(( $# > 2 ? 2 : $# ))
ALGORITHMS=("$@")
if [ ${#ALGORITHMS[@]} -eq 0 ]; then
  ALGORITHMS=(allreduce dpsgd_ring dpsgd_torus_ats dpsgd_exponential low_precision async_average
              async_gossip)
fi
WORLD="${WORLD:-8}"
LR="${LR:-0.05}"
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

algorithm_tables() {
  case "$1" in
    allreduce) printf '[algorithm]\nname = "allreduce"\n' ;;
    dpsgd_ring) printf '[topology]\nkind = "ring"\n[algorithm]\nname = "decentralized"\n' ;;
    dpsgd_torus_ats) printf '[topology]\nkind = "torus"\nrows = 2\ncols = %d\n[algorithm]\nname = "decentralized"\nexchange = "after_step"\n' $((WORLD / 2)) ;;
    dpsgd_exponential) printf '[topology]\nkind = "exponential"\n[algorithm]\nname = "decentralized"\n' ;;
    low_precision) printf '[topology]\nkind = "ring"\n[algorithm]\nname = "low_precision_decentralized"\n' ;;
    async_average) printf '[algorithm]\nname = "async_model_average"\nwarmup_steps = 50\nsync_interval_ms = 50\n' ;;
    async_gossip) printf '[topology]\nkind = "ring"\n[algorithm]\nname = "async_gossip"\nmin_interval_ms = 10\n' ;;
    *) echo "unknown algorithm $1" >&2; exit 64 ;;
  esac
}

echo "| algorithm | test accuracy (%) | vs allreduce (points) | consensus distance | time per epoch (s) | bytes/step (rank 0) |"
echo "|---|---|---|---|---|---|"
base_acc=""
for algo in "${ALGORITHMS[@]}"; do
  job="$DIR/$algo.toml"
  {
    printf '[job]\nworld_size = %d\nmode = "threads"\n' "$WORLD"
    algorithm_tables "$algo"
    printf '[trainer]\nepochs = %d\nlr = %s\nlog_every = 100000\n' "$EPOCHS" "$LR"
    if [ -n "${LINK:-}" ] || [ -n "${SLOW:-}" ]; then
      printf '[links]\n'
      [ -n "${LINK:-}" ] && printf 'all = "%s"\n' "$LINK"
      [ -n "${SLOW:-}" ] && printf 'ranks = { %s = "%s" }\n' "${SLOW%%=*}" "${SLOW#*=}"
    fi
  } > "$job"
  out=$("$BUILD/bin/troupe" run "$job" 2>&1) || {
    echo "| $algo | failed: $(echo "$out" | tail -1) | | | | |"; continue; }
  line=$(echo "$out" | grep "epoch $EPOCHS test accuracy" | tail -1)
  acc=$(echo "$line" | sed -E 's/.*accuracy ([0-9.]+)%.*/\1/')
  bytes=$(echo "$line" | sed -E 's/.*per step ([0-9]+) .*/\1/')
  consensus=$(echo "$line" | sed -E 's/.*consensus distance ([^ ]+).*/\1/')
  times=$(echo "$out" | grep "test accuracy" | sed -E 's/.*epoch time ([0-9.]+) s.*/\1/' | paste -sd+ | bc)
  per_epoch=$(echo "scale=1; $times / $EPOCHS" | bc)
  if [ -z "$base_acc" ]; then base_acc=$acc; fi
  delta=$(echo "$acc - $base_acc" | bc)
  printf "| %s | %s | %+.2f | %s | %s | %s |\n" "$algo" "$acc" "$delta" "$consensus" "$per_epoch" "$bytes"
done
