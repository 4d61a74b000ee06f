#!/usr/bin/env bash
# Fashion-MNIST CNN across emulated hosts (scripts/netbed: one network namespace, host name and
# /dev/shm per host, veth links shaped by tc tbf), one rank per host: epoch time and test accuracy
# of troupe's allreduce and compressed algorithms (examples/fashion_mnist) beside PyTorch DDP
# (gloo) with and without its PowerSGD comm hook (bench/fashion_mnist_torch.py), interleaved in
# one run, at each link rate.
#
#   bench/netbed_cnn.sh [results-dir]       (root; default build/bench/netbed_cnn)
#
# HOSTS (4), RATES ("100mbit 10mbit"), ROUNDS (1: every configuration once per round, rounds one
# after the other), EPOCHS (1), STRAGGLER (unset; "3": host 3's link at a tenth of RATE, a
# straggler link), ALGORITHMS (troupe's, default "allreduce powersgd:rank=2 topk:ratio=0.01
# bytegrad"), HOOKS (torch's, default "none powersgd"), TIMEOUT (seconds per run, 1800).
# Both sides: CNN 1x28x28 -> conv16 -> conv32 -> 128 -> 10, batch 64 per rank, SGD lr 0.05
# momentum 0.9, one intra-op thread per rank, each rank on its own quarter of the training set.
# Epoch time: rank 0's training loop (first batch to last step); accuracy: rank 0's model on
# the 10,000 test images after the last epoch. "MB sent per host" is what left each host's veth
# during the run (start-up and the final test included).
set -euo pipefail

script=netbed_cnn
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/bench/common.sh"
results="${1:-$root/build/bench/netbed_cnn}"
bin="${BUILD_BIN:-$root/build/bin}"
python=/usr/bin/python3
hosts=${HOSTS:-4}
rates=(${RATES:-100mbit 10mbit})
rounds=${ROUNDS:-1}
epochs=${EPOCHS:-1}
algorithms=(${ALGORITHMS:-allreduce powersgd:rank=2 topk:ratio=0.01 bytegrad})
hooks=(${HOOKS:-none powersgd})
timeout=${TIMEOUT:-1800}
straggler=${STRAGGLER:-}
export NETBED_NAME=${NETBED_NAME:-bc}
netbed="$root/scripts/netbed"

need_positive_int HOSTS "$hosts"
need_positive_int ROUNDS "$rounds"
need_positive_int EPOCHS "$epochs"
[[ -x "$bin/fashion_mnist" ]] || die "'$bin/fashion_mnist' not found: build the target fashion_mnist (or set BUILD_BIN)"
need_torch "$python"
[ -z "$straggler" ] || [[ "$straggler" =~ ^[0-9]+$ && "$straggler" -lt "$hosts" ]] ||
  die "STRAGGLER '$straggler': expected a host number below HOSTS=$hosts"
"$netbed" check >/dev/null

# "100mbit" -> "10mbit": a tenth of a rate, in the unit tc takes.
tenth() {
  [[ "$1" =~ ^([0-9]+)(kbit|mbit|gbit)$ ]] || die "rate '$1': expected a number and kbit, mbit or gbit"
  local num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
  if [ $((num % 10)) -ne 0 ]; then
    case "$unit" in gbit) num=$((num * 1000)); unit=mbit ;; mbit) num=$((num * 1000)); unit=kbit ;; esac
  fi
  echo "$((num / 10))$unit"
}

mkdir -p "$results"
table="$results/netbed_cnn.md"
echo "| link | round | run | epoch time (s) | test accuracy (%) | MB sent per host |" >"$table"
echo "|---|---|---|---|---|---|" >>"$table"

sent_mb() {  # what each host sent over its link during the run, as "a/b/c/d" (MB, 1e6)
  awk '{printf "%s%.1f", (NR > 1 ? "/" : ""), $6 / 1e6}' "$1/bytes" 2>/dev/null || echo "?"
}

port=29600
run_one() {  # run_one RATE ROUND LABEL PROG ARGS...: one job on the bed that is up
  local rate=$1 round=$2 label=$3; shift 3
  local logs="$results/${rate}${straggler:+_straggler$straggler}_r${round}_${label//[ :=,.]/_}"
  rm -rf "$logs"; mkdir -p "$logs"
  port=$((port + 1))
  echo "== $(date -u +%H:%M:%S) links $rate${straggler:+ (host $straggler at $(tenth "$rate"))}, round $round: $label" >&2
  local status=0
  "$netbed" run --quiet --timeout "$timeout" --port "$port" --logs "$logs" -- "$@" || status=$?
  local line time acc
  if [ "$label" = "${label#torch}" ]; then
    line=$(grep "epoch $epochs test accuracy" "$logs/rank0.log" | tail -1 || true)
    acc=$(sed -nE 's/.*accuracy ([0-9.]+)%.*/\1/p' <<<"$line")
    time=$(grep -o "epoch time [0-9.]* s" "$logs/rank0.log" | awk '{s += $3} END {if (NR) printf "%.1f", s}')
  else
    line=$(grep "test accuracy" "$logs/rank0.log" | tail -1 || true)
    acc=$(sed -nE 's/.*accuracy ([0-9.]+)%.*/\1/p' <<<"$line")
    time=$(sed -nE 's/.*epoch time ([0-9. ]+) s.*/\1/p' <<<"$line" | awk '{for (i = 1; i <= NF; i++) s += $i; printf "%.1f", s}')
  fi
  [ -n "$acc" ] || { acc="failed (status $status, $logs)"; time="-"; }
  echo "| $rate${straggler:+, host $straggler $(tenth "$rate")} | $round | $label | $time | $acc | $(sent_mb "$logs") |" |
    tee -a "$table" >&2
}

for rate in "${rates[@]}"; do
  up=("$hosts" --rate "$rate")
  [ -z "$straggler" ] || up+=(--link "$straggler=$(tenth "$rate")")
  "$netbed" up "${up[@]}" >&2
  trap '"$netbed" down >/dev/null 2>&1 || true' EXIT
  for ((round = 1; round <= rounds; round++)); do
    # Interleaved: troupe and torch alternate, so a change in the machine's load spreads over both.
    i=0
    while [ $i -lt ${#algorithms[@]} ] || [ $i -lt ${#hooks[@]} ]; do
      if [ $i -lt ${#algorithms[@]} ]; then
        algo=${algorithms[$i]}
        own_momentum=""
        case "$algo" in *momentum=*) own_momentum="--momentum 0" ;; esac
        run_one "$rate" "$round" "troupe $algo" "$bin/fashion_mnist" --model cnn --epochs "$epochs" \
          --lr 0.05 --log-every 100000 --algorithm "$algo" $own_momentum
      fi
      if [ $i -lt ${#hooks[@]} ]; then
        run_one "$rate" "$round" "torch DDP ${hooks[$i]}" "$python" "$root/bench/fashion_mnist_torch.py" \
          --from-env eth0 --model cnn --epochs "$epochs" --lr 0.05 --hook "${hooks[$i]}"
      fi
      i=$((i + 1))
    done
  done
  "$netbed" down >&2
  trap - EXIT
done
cat "$table"
