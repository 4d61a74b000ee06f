#!/usr/bin/env bash
# What dropping the error-feedback state at a resume costs: Fashion-MNIST (MLP), 2 processes,
# top-k 1% with error feedback. One run saves a checkpoint at step STOP and stops there; it is
# resumed twice, with the whole state and with everything but the algorithm's (the error-feedback
# memory and the step counter: what a trainer that checkpoints only model and optimizer gets),
# and an uninterrupted run is the reference. Prints rank 0's training loss per step after the
# resume (mean over windows of WINDOW steps) for the three, as a Markdown table.
#   bench/checkpoint_resume_spike.sh [build dir] [stop step] [steps after]
# Environment: ALGORITHM (topk:ratio=0.01), MODEL (mlp), BATCH (64), LR (0.05), MOMENTUM (0.9),
# WINDOW (5), EXTRA (more fashion_mnist arguments).
set -euo pipefail
script=checkpoint_resume_spike.sh
source "$(dirname "$0")/common.sh"
BUILD="${1:-build}"
STOP="${2:-300}"
AFTER="${3:-60}"
need_positive_int "stop step" "$STOP"
need_positive_int "steps after" "$AFTER"
ALGORITHM="${ALGORITHM:-topk:ratio=0.01}"
WINDOW="${WINDOW:-5}"
need_positive_int WINDOW "$WINDOW"
dir=$(mktemp -d /tmp/troupe-spike-XXXXXX)
trap 'rm -rf "$dir"' EXIT
run() {
  "$BUILD/bin/troupe" launch -n 2 -- "$BUILD/bin/fashion_mnist" --model "${MODEL:-mlp}" \
    --batch "${BATCH:-64}" --lr "${LR:-0.05}" --momentum "${MOMENTUM:-0.9}" --threads 1 \
    --algorithm "$ALGORITHM" --log-every 1 ${EXTRA:-} "$@" 2>&1
}
# rank 0's "step N loss L" lines for steps STOP+1 .. STOP+AFTER, as "N L".
losses() { sed -n 's/^\[rank 0\] epoch [0-9]* step \([0-9]*\) loss \([0-9.]*\).*/\1 \2/p' |
           awk -v a="$STOP" -v b="$((STOP + AFTER))" '$1 > a && $1 <= b'; }
run --stop-step "$((STOP + AFTER))" | losses > "$dir/straight"
run --checkpoint "$dir/ckpt" --checkpoint-every "$STOP" --stop-step "$STOP" > /dev/null
run --resume "$dir/ckpt" --stop-step "$((STOP + AFTER))" | losses > "$dir/full"
run --resume "$dir/ckpt" --resume-without-algorithm-state --stop-step "$((STOP + AFTER))" |
  losses > "$dir/dropped"
echo "$ALGORITHM, resumed at step $STOP: rank 0's training loss, mean over $WINDOW steps"
echo
echo "| steps | uninterrupted | resumed with the whole state | resumed without the algorithm's state |"
echo "|---|---|---|---|"
paste "$dir/straight" "$dir/full" "$dir/dropped" |
  awk -v w="$WINDOW" -v a="$STOP" '{ i = int(($1 - a - 1) / w); s[i] += $2; f[i] += $4; d[i] += $6; n[i]++ }
       END { for (j = 0; j in n; j++)
               printf "| %d-%d | %.4f | %.4f | %.4f |\n", a + j * w + 1, a + (j + 1) * w,
                      s[j] / n[j], f[j] / n[j], d[j] / n[j] }'
