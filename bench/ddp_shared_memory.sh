#!/usr/bin/env bash
# troupe's data-parallel step on one host, with the buckets reduced through shared memory
# (DdpOptions::shared_memory, the default) against through the UCX transport
# (--no-shared-memory), beside compute alone (world 1) and the world-N compute-only baseline.
#
#   bench/ddp_shared_memory.sh [rounds] [steps] [world]      (defaults: 4, 20, 2)
#
# Each round runs, one after the other:
#   troupe bench ddp --world 1 --model mlp --batch 64 --steps S --json
#   troupe bench ddp --world N --compute-only ... --json
#   troupe bench ddp --world N ... --json                       (shared memory)
#   troupe bench ddp --world N --no-shared-memory ... --json    (transport)
# and prints one line per run, then the medians over rounds of the step, the wait after backward
# and the other threads' CPU per step (UCX progress, CAF, the shared-memory worker), and the
# median over rounds of each path's step against the same round's world 1 and compute-only runs.
# Environment: TROUPE_BIN overrides the binary (default build/bin/troupe).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-4}"
steps="${2:-20}"
world="${3:-2}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"

script=ddp_shared_memory
source "$root/bench/common.sh"
need_positive_int rounds "$rounds"
need_positive_int steps "$steps"
need_positive_int world "$world"
need_troupe "$troupe"

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
common=(--model mlp --batch 64 --steps "$steps" --json)
for ((r = 1; r <= rounds; r++)); do
  for config in w1 w2c shm transport; do
    case "$config" in
      w1) args=(--world 1) ;;
      w2c) args=(--world "$world" --compute-only) ;;
      shm) args=(--world "$world") ;;
      transport) args=(--world "$world" --no-shared-memory) ;;
    esac
    line=$("$troupe" bench ddp "${args[@]}" "${common[@]}") ||
      die "'$troupe bench ddp ${args[*]} ${common[*]}' failed"
    echo "{\"round\": $r, \"config\": \"$config\", ${line#\{}" | tee -a "$out"
  done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in runs:
    by.setdefault(r["config"], {})[r["round"]] = r
med = statistics.median
print()
print("| config | median step (ms) | median wait after backward (ms) | other threads' CPU per step (ms) |")
print("|---|---|---|---|")
for c in ["w1", "w2c", "shm", "transport"]:
    rs = list(by[c].values())
    print(f"| {c} | {med(r['step_sec'] for r in rs) * 1e3:.1f} | "
          f"{med(r['comm_wait_sec'] for r in rs) * 1e3:.1f} | "
          f"{med(r['helper_cpu_sec'] for r in rs) * 1e3:.1f} |")
print()
print("| path | median over rounds of step / w1 - 1 | of step / w2c - 1 | of step / transport's |")
print("|---|---|---|---|")
for c in ["shm", "transport"]:
    rounds = sorted(by[c])
    vs1 = med(by[c][k]["step_sec"] / by["w1"][k]["step_sec"] - 1 for k in rounds)
    vsc = med(by[c][k]["step_sec"] / by["w2c"][k]["step_sec"] - 1 for k in rounds)
    vst = med(by[c][k]["step_sec"] / by["transport"][k]["step_sec"] for k in rounds)
    print(f"| {c} | {vs1:+.1%} | {vsc:+.1%} | {vst:.3f} |")
EOF
