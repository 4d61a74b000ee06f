#!/usr/bin/env bash
# allreduce across emulated hosts (scripts/netbed: one network namespace, host name and /dev/shm
# per host, veth links shaped by tc tbf): troupe (ucx, tcp between hosts) beside
# torch.distributed gloo and the line-rate bound, in one run, at each link rate.
#
#   bench/netbed_allreduce.sh [results-dir]       (root; default build/bench/netbed)
#
# HOSTS (default 4), SIZE (default 64MiB), RATES (default "1gbit 100mbit") and MTU (default 1500;
# 9000 for jumbo frames) override the setup.
# TROUPE_ARGS: troupe configurations separated by ';', each a list of `troupe bench allreduce`
# options (default: one, the defaults, written ""): e.g. TROUPE_ARGS=";--chunk-bytes 8388608"
# runs troupe twice per round, with the default ring and with 8 MiB chunks (an empty configuration
# must come first: `read` drops a trailing one). ROUNDS (default 1):
# gloo and every troupe configuration, one after the other, ROUNDS times per rate, so that a
# change in the machine's load spreads over all of them; each row names its round.
# The bound: a ring allreduce sends 2 (W - 1) / W of the buffer out of every host, so over links
# of R bit/s the algbw (bytes / time) is at most R / 8 * W / (2 (W - 1)). Each row also gives the
# bytes that left every host's link during the run (all ranks, warm-up included), from the veths'
# counters, so a figure cannot come from a path that bypassed the network.
set -euo pipefail

script=netbed_allreduce
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/bench/netbed_common.sh"  # and bench/common.sh
export NETBED_NAME=${NETBED_NAME:-ba}
results="${1:-$root/build/bench/netbed}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
size=${SIZE:-64MiB}
IFS=';' read -r -a configs <<<"${TROUPE_ARGS:-}"
[ ${#configs[@]} -gt 0 ] || configs=("")
netbed_settings "1gbit 100mbit"
need_troupe "$troupe"

mkdir -p "$results"
table="$results/netbed_allreduce.md"
{
  echo "| link | W | size | round | troupe options | troupe algbw MB/s | gloo algbw MB/s | line-rate bound MB/s | troupe / bound | gloo / bound | troupe / gloo | MB sent per host, troupe | MB sent per host, gloo |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
} >"$table"

for rate in "${rates[@]}"; do
  for ((round = 1; round <= rounds; round++)); do
    echo "== $(date -u +%H:%M:%S) $hosts hosts, links $rate, round $round: gloo" >&2
    gloo_logs="$results/gloo_${rate}_r$round"
    "$netbed" job "$hosts" --rate "$rate" --mtu "${MTU:-1500}" --quiet --timeout 600 --logs "$gloo_logs" -- \
      "$python" "$root/bench/allreduce_gloo.py" --from-env eth0 --bytes "$size" --iters 3 --json
    gloo_json=$(grep '^{' "$gloo_logs/rank0.log" | tail -1)
    for c in "${!configs[@]}"; do
      args=${configs[$c]}
      echo "== $(date -u +%H:%M:%S) $hosts hosts, links $rate, round $round: troupe ${args:-(defaults)}" >&2
      troupe_logs="$results/troupe_${rate}_r${round}_c$c"
      # shellcheck disable=SC2086  # the options are words
      "$netbed" job "$hosts" --rate "$rate" --mtu "${MTU:-1500}" --quiet --timeout 600 --logs "$troupe_logs" -- \
        "$troupe" bench allreduce --as-rank --world "$hosts" --transport ucx --bytes "$size" --json $args
      troupe_json=$(grep '^{' "$troupe_logs/rank0.log" | tail -1)
      "$python" - "$rate" "$hosts" "$size" "$round" "${args:-defaults}" "$troupe_json" "$gloo_json" \
        "$(sent_mb "$troupe_logs/bytes")" "$(sent_mb "$gloo_logs/bytes")" >>"$table" <<'EOF'
import json, re, sys
rate, world, size, rnd, args, troupe, gloo, troupe_sent, gloo_sent = sys.argv[1:]
world = int(world)
num, unit = re.fullmatch(r"(\d+)([a-z]+)", rate).groups()
bits = int(num) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[unit]
bound = bits / 8 * world / (2 * (world - 1)) / 1e6
t = json.loads(troupe)["algbw_GBps"] * 1e3
g = json.loads(gloo)["algbw_GBps"] * 1e3
print(f"| {rate} | {world} | {size} | {rnd} | {args} | {t:.1f} | {g:.1f} | {bound:.1f} | "
      f"{t / bound:.0%} | {g / bound:.0%} | {t / g:.2f} | {troupe_sent} | {gloo_sent} |")
EOF
    done
  done
done
cat "$table"
