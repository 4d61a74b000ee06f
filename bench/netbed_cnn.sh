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
# bytegrad"), HOOKS (torch's, default "none powersgd"), TIMEOUT (seconds per run, 1800),
# ALONE (1: also "compute alone", every host training its quarter by itself, world 1, at the same
# time; 0: not), MTU (1500; 9000 for jumbo frames).
# An algorithm is an --algorithm of fashion_mnist (allreduce, a compressor, diloco:h=50,...) or one
# of the gossip algorithms, run through a job file: dpsgd (D-PSGD on a ring), adpsgd (AD-PSGD,
# asynchronous pairwise gossip on a ring) and async_average (background model averaging); a
# suffix @N trains it N epochs instead of EPOCHS (e.g. diloco:h=50@2), for time to an accuracy;
# a suffix +overlap (allreduce+overlap, powersgd:rank=2+overlap) adds --overlap-next-forward.
# Each row gives per epoch the accuracy and the cumulative training time, and rank 0's
# communication wait (the time its step() waited for the network) and compute share
# (1 - wait / time). At the end: the fastest troupe run per epoch within 1 point of torch DDP
# without a hook (or the fastest, without one), and its time per epoch over compute alone's; then
# each troupe run's time to troupe allreduce's final accuracy (read from its per-epoch lines), how
# many times faster than allreduce's that is, and its compute utilisation (compute alone's time
# for the same epochs over that time).
# Both sides: CNN 1x28x28 -> conv16 -> conv32 -> 128 -> 10, batch 64 per rank, SGD lr 0.05
# momentum 0.9, one intra-op thread per rank, each rank on its own quarter of the training set.
# Epoch time: rank 0's training loop (first batch to last step); accuracy: rank 0's model on
# the 10,000 test images after the last epoch. "MB sent per host" is what left each host's veth
# during the run (start-up and the final test included).
set -euo pipefail

script=netbed_cnn
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/bench/netbed_common.sh"  # and bench/common.sh
results="${1:-$root/build/bench/netbed_cnn}"
bin="${BUILD_BIN:-$root/build/bin}"
epochs=${EPOCHS:-1}
algorithms=(${ALGORITHMS:-allreduce powersgd:rank=2 topk:ratio=0.01 bytegrad})
hooks=(${HOOKS:-none powersgd})
timeout=${TIMEOUT:-1800}
straggler=${STRAGGLER:-}
alone=${ALONE:-1}
export NETBED_NAME=${NETBED_NAME:-bc}
netbed_settings "100mbit 10mbit"
need_positive_int EPOCHS "$epochs"
[[ -x "$bin/fashion_mnist" ]] || die "'$bin/fashion_mnist' not found: build the target fashion_mnist (or set BUILD_BIN)"
[ -z "$straggler" ] || [[ "$straggler" =~ ^[0-9]+$ && "$straggler" -lt "$hosts" ]] ||
  die "STRAGGLER '$straggler': expected a host number below HOSTS=$hosts"

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
# rate, label, time, accuracy, epochs, by epoch ("acc @ cumulative s, ..."): for the ratios at the end
summary="$results/netbed_cnn.tsv"
: >"$summary"
{
  echo "| link | round | run | epoch time (s) | test accuracy (%) | by epoch: accuracy % @ cumulative s | rank 0 comm wait (s) | compute share | MB sent per host | load (1 min) |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
} >"$table"

# A job file for a gossip algorithm (fashion_mnist --job): world HOSTS as processes.
job_file() {  # job_file NAME EPOCHS FILE
  {
    printf '[job]\nworld_size = %d\nmode = "processes"\n' "$hosts"
    case "$1" in
      dpsgd) printf '[topology]\nkind = "ring"\n[algorithm]\nname = "decentralized"\n' ;;
      adpsgd) printf '[topology]\nkind = "ring"\n[algorithm]\nname = "async_gossip"\nmin_interval_ms = 10\n' ;;
      async_average) printf '[algorithm]\nname = "async_model_average"\nwarmup_steps = 50\nsync_interval_ms = 50\n' ;;
      *) die "unknown gossip algorithm '$1'" ;;
    esac
    printf '[trainer]\nmodel = "cnn"\nepochs = %d\nlr = 0.05\nmomentum = 0.9\nlog_every = 100000\nthreads = 1\n' "$2"
  } >"$3"
}

port=29600
run_one() {  # run_one RATE ROUND LABEL EPOCHS [netbed run options] -- PROG ARGS...: one job on the bed
  local rate=$1 round=$2 label=$3 run_epochs=$4; shift 4
  local -a options=()
  while [ "$1" != "--" ]; do options+=("$1"); shift; done
  shift
  local logs="$results/${rate}${straggler:+_straggler$straggler}_r${round}_${label//[ :=,.@()]/_}"
  rm -rf "$logs"; mkdir -p "$logs"
  port=$((port + 1))
  echo "== $(date -u +%H:%M:%S) links $rate${straggler:+ (host $straggler at $(tenth "$rate"))}, round $round: $label" >&2
  local status=0 load
  load=$(cut -d' ' -f1 /proc/loadavg)
  "$netbed" run --quiet --timeout "$timeout" --port "$port" --logs "$logs" "${options[@]}" -- "$@" ||
    status=$?
  load="$load-$(cut -d' ' -f1 /proc/loadavg)"
  # Lines "... test accuracy A% ... epoch time T s ...": fashion_mnist prints one per epoch, torch's
  # script one at the end with every epoch's time.
  local time acc by_epoch wait share
  acc=$(grep "test accuracy" "$logs/rank0.log" | tail -1 | sed -nE 's/.*accuracy ([0-9.]+)%.*/\1/p' || true)
  if [ "$label" = "${label#torch}" ]; then
    by_epoch=$(grep "test accuracy" "$logs/rank0.log" |
      sed -nE 's/.*accuracy ([0-9.]+)%.*epoch time ([0-9.]+) s.*/\1 \2/p' |
      awk '{s += $2; printf "%s%s @ %.1f", (NR > 1 ? ", " : ""), $1, s}')
    time=$(grep "test accuracy" "$logs/rank0.log" | sed -nE 's/.*epoch time ([0-9.]+) s.*/\1/p' |
      awk '{s += $1} END {if (NR) printf "%.1f", s}')
    wait=$(grep "test accuracy" "$logs/rank0.log" | sed -nE 's/.*communication wait ([0-9.]+) s.*/\1/p' |
      awk '{s += $1} END {if (NR) printf "%.1f", s}')
    share=$(awk -v t="$time" -v w="$wait" 'BEGIN {if (t > 0 && w != "") printf "%.0f%%", 100 * (t - w) / t}')
  else
    time=$(grep "test accuracy" "$logs/rank0.log" | tail -1 | sed -nE 's/.*epoch time ([0-9. ]+) s.*/\1/p' |
      awk '{for (i = 1; i <= NF; i++) s += $i; printf "%.1f", s}')
    by_epoch="$acc @ $time"; wait=""; share=""
  fi
  [ -n "$acc" ] || { acc="failed (status $status, $logs)"; time="-"; by_epoch="-"; }
  echo "| $rate${straggler:+, host $straggler $(tenth "$rate")} | $round | $label | $time | $acc | $by_epoch | ${wait:--} | ${share:--} | $(sent_mb "$logs/bytes" 1) | $load |" |
    tee -a "$table" >&2
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$rate" "$label" "$time" "$acc" "$run_epochs" "$by_epoch" >>"$summary"
}

# Compute alone: every host trains its quarter of the images by itself (world 1, no
# communication), all at the same time, so the CPU is shared as in the jobs. Its epoch time is the
# hosts' mean; the row also shows the slowest host's (a synchronous job cannot end before it).
run_alone() {  # run_alone RATE ROUND
  local rate=$1 round=$2 label="compute alone (world 1 per host)"
  local logs="$results/${rate}${straggler:+_straggler$straggler}_r${round}_alone"
  rm -rf "$logs"; mkdir -p "$logs"
  echo "== $(date -u +%H:%M:%S) links $rate, round $round: $label" >&2
  local load status=0 time slowest acc
  load=$(cut -d' ' -f1 /proc/loadavg)
  "$netbed" run --quiet --timeout "$timeout" --logs "$logs" --env RANK=0 --env LOCAL_RANK=0 \
    --env WORLD_SIZE=1 --env LOCAL_WORLD_SIZE=1 -- "$bin/fashion_mnist" --model cnn \
    --epochs "$epochs" --lr 0.05 --log-every 100000 --subset $((60000 / hosts)) || status=$?
  load="$load-$(cut -d' ' -f1 /proc/loadavg)"
  time=$(cat "$logs"/rank*.log | sed -nE 's/.*epoch time ([0-9.]+) s.*/\1/p' |
    awk -v e="$epochs" '{s += $1} END {if (NR) printf "%.1f", s / (NR / e)}')
  # Per host, its epochs' total; the largest, per epoch.
  slowest=$(for log in "$logs"/rank*.log; do sed -nE 's/.*epoch time ([0-9.]+) s.*/\1/p' "$log" |
    awk '{s += $1} END {if (NR) print s}'; done | awk -v e="$epochs" '$1 > m {m = $1} END {if (NR) printf "%.1f", m / e}')
  acc=$(sed -nE 's/.*accuracy ([0-9.]+)%.*/\1/p' "$logs/rank0.log" | tail -1)
  local shown="$acc (host 0's model)"
  [ -n "$time" ] || { time="-"; slowest="-"; acc=""; shown="failed (status $status, $logs)"; }
  echo "| $rate | $round | $label | $time (slowest host $slowest) | $shown | - | - | 100% | $(sent_mb "$logs/bytes" 1) | $load |" |
    tee -a "$table" >&2
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$rate" "alone" "$time" "$acc" "$epochs" "-" "$slowest" >>"$summary"
}

# troupe's best run at RATE (fastest per epoch within 1 point of torch DDP without a hook, when
# there is one) against compute alone, per epoch; then every troupe run's time to troupe
# allreduce's final accuracy (the first epoch whose accuracy reaches it), how many times faster
# than allreduce that is, and its compute utilisation: compute alone's time for those epochs over
# the run's time to them. Lines of the report.
ratios() {  # ratios RATE
  awk -F'\t' -v rate="$1" '
    $1 != rate || $3 == "-" {next}
    $2 == "alone" {e = $3 / $5; if (alone == "" || e < alone) {alone = e; slowest = $7}; next}
    $2 == "torch DDP none" {ddp = (ddp == "" || $4 > ddp) ? $4 : ddp; e = $3 / $5; ddp_time = (ddp_time == "" || e < ddp_time) ? e : ddp_time; next}
    $2 == "troupe allreduce" {if (target == "" || $4 > target) {target = $4; target_time = $3}}
    $2 ~ /^troupe/ {n++; label[n] = $2; time[n] = $3; acc[n] = $4; epochs[n] = $5; by[n] = $6}
    END {
      best = 0
      for (i = 1; i <= n; i++)
        if ((ddp == "" || acc[i] >= ddp - 1) &&
            (best == 0 || time[i] / epochs[i] < time[best] / epochs[best])) best = i
      if (best == 0) print "links " rate ": no troupe run within 1 point of torch DDP (" ddp "%)"
      else {
        line = sprintf("links %s: troupe best %s, %.1f s per epoch at %s%%", rate, label[best],
                       time[best] / epochs[best], acc[best])
        if (ddp != "") line = line sprintf(" (torch DDP none %s%%, %.1f s per epoch: %.2fx faster)", ddp,
                                           ddp_time, ddp_time / (time[best] / epochs[best]))
        if (alone != "")
          line = line sprintf("; compute alone %.1f s per epoch, slowest host %s s; best / alone = %.2f, / slowest host = %.2f",
                              alone, slowest, time[best] / epochs[best] / alone,
                              time[best] / epochs[best] / slowest)
        print line
      }
      if (target == "") exit
      for (i = 1; i <= n; i++) {
        k = split(by[i], pairs, ", ")
        reached = 0
        for (j = 1; j <= k && !reached; j++) {
          split(pairs[j], p, " @ ")
          if (p[1] + 0 >= target + 0) {
            reached = 1
            line = sprintf("links %s: %s reaches allreduce'"'"'s %s%% after epoch %d at %.1f s: %.2fx allreduce'"'"'s %.1f s",
                           rate, label[i], target, j, p[2], target_time / p[2], target_time)
            if (alone != "") line = line sprintf("; utilisation %.0f%% (compute alone %.1f s for %d epochs)",
                                                 100 * j * alone / p[2], j * alone, j)
            print line
          }
        }
        if (!reached) printf "links %s: %s does not reach allreduce'"'"'s %s%% (%s%% after %d epochs)\n", rate, label[i], target, acc[i], epochs[i]
      }
    }' "$summary"
}

for rate in "${rates[@]}"; do
  up=("$hosts" --rate "$rate" --mtu "${MTU:-1500}")
  [ -z "$straggler" ] || up+=(--link "$straggler=$(tenth "$rate")")
  "$netbed" up "${up[@]}" >&2
  trap '"$netbed" down >/dev/null 2>&1 || true' EXIT
  for ((round = 1; round <= rounds; round++)); do
    # Interleaved: troupe and torch alternate, so a change in the machine's load spreads over both.
    i=0
    while [ $i -lt ${#algorithms[@]} ] || [ $i -lt ${#hooks[@]} ]; do
      if [ $i -lt ${#algorithms[@]} ]; then
        algo=${algorithms[$i]}
        algo_epochs=$epochs
        if [[ "$algo" == *@* ]]; then
          algo_epochs=${algo##*@}; algo=${algo%@*}
          need_positive_int "epochs of $algo" "$algo_epochs"
        fi
        label="troupe $algo"
        [ "$algo_epochs" = "$epochs" ] || label+=" ($algo_epochs epochs)"
        case "$algo" in
          dpsgd|adpsgd|async_average)
            job_file "$algo" "$algo_epochs" "$results/$algo.toml"
            run_one "$rate" "$round" "$label" "$algo_epochs" -- "$bin/fashion_mnist" --job "$results/$algo.toml" ;;
          *)
            own_momentum=""
            # a compressor's own momentum (topk:...,momentum=0.9) replaces SGD's; outer_momentum does not
            case "$algo" in *[:,]momentum=*) own_momentum="--momentum 0" ;; esac
            # "+overlap": the step's reductions run on into the next forward (--overlap-next-forward)
            overlap=""
            case "$algo" in *+overlap) overlap="--overlap-next-forward" ;; esac
            run_one "$rate" "$round" "$label" "$algo_epochs" -- "$bin/fashion_mnist" --model cnn \
              --epochs "$algo_epochs" --lr 0.05 --log-every 100000 --algorithm "${algo%+overlap}" \
              $own_momentum $overlap ;;
        esac
      fi
      if [ $i -lt ${#hooks[@]} ]; then
        run_one "$rate" "$round" "torch DDP ${hooks[$i]}" "$epochs" -- "$python" "$root/bench/fashion_mnist_torch.py" \
          --from-env eth0 --model cnn --epochs "$epochs" --lr 0.05 --hook "${hooks[$i]}"
      fi
      i=$((i + 1))
    done
    [ "$alone" = 0 ] || run_alone "$rate" "$round"
  done
  "$netbed" down >&2
  trap - EXIT
done
cat "$table"
for rate in "${rates[@]}"; do ratios "$rate"; done
