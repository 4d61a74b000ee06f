#!/usr/bin/env bash
# Goodput of an elastic job under repeated kills: 4 ranks of Fashion-MNIST (MLP) under
# `troupe launch --elastic --min-ranks 2`, once fault-free and once with a random live rank killed
# (SIGKILL, from outside the job) every PERIOD seconds and restarted by the launcher. Prints, as
# Markdown, the epochs per hour of both runs and their ratio, and the median times from a kill to
# every survivor stepping again and from a restart to the restarted rank stepping, taken from the
# logs (the launcher's "restarting rank slot S ... at unix ms" lines and fashion_mnist's "launch
# slot S stepping in generation G at unix ms" lines; the kill times are this script's).
#   bench/elastic_goodput.sh [build dir] [epochs] [period s] [max restarts]
# Only the launcher's own children (the ranks, named fashion_mnist) are ever killed.
set -euo pipefail
script=elastic_goodput.sh
source "$(dirname "$0")/common.sh"
BUILD="${1:-build}"
EPOCHS="${2:-8}"
PERIOD="${3:-30}"
RESTARTS="${4:-50}"
need_positive_int epochs "$EPOCHS"
need_positive_int "period" "$PERIOD"
need_positive_int "max restarts" "$RESTARTS"
[[ -x "$BUILD/bin/troupe" && -x "$BUILD/bin/fashion_mnist" ]] ||
  die "$BUILD/bin/troupe or $BUILD/bin/fashion_mnist missing; build the troupe and fashion_mnist targets"
dir=$(mktemp -d /tmp/troupe-goodput-XXXXXX)
launcher=""
cleanup() {
  [[ -n "$launcher" ]] && kill "$launcher" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
now_ms() { date +%s%3N; }

# run_job NAME RESTARTS KILL(0|1): runs the job, writes $dir/NAME.log (its output) and
# $dir/NAME.kills ("unix-ms pid" per kill), and prints the wall seconds.
run_job() {
  local name=$1 restarts=$2 kill=$3 start end
  : >"$dir/$name.kills"
  start=$(now_ms)
  "$BUILD/bin/troupe" launch --elastic --min-ranks 2 --max-restarts "$restarts" -n 4 -- \
    "$BUILD/bin/fashion_mnist" --model mlp --epochs "$EPOCHS" --threads 1 --log-every 100000 \
    >"$dir/$name.log" 2>&1 &
  launcher=$!
  if [[ "$kill" == 1 ]]; then
    while kill -0 "$launcher" 2>/dev/null; do
      # Wait PERIOD seconds, but not past the job's end (its wall time must not include the wait).
      local tenths=0
      while (( tenths < PERIOD * 10 )) && kill -0 "$launcher" 2>/dev/null; do
        sleep 0.1
        tenths=$((tenths + 1))
      done
      kill -0 "$launcher" 2>/dev/null || break
      local pids pid
      pids=$(pgrep -P "$launcher" -x fashion_mnist || true)
      [[ -z "$pids" ]] && continue
      pid=$(shuf -n1 <<<"$pids")
      # Still the launcher's child (not reaped and reused since pgrep)?
      [[ "$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null)" == "$launcher" ]] || continue
      echo "$(now_ms) $pid" >>"$dir/$name.kills"
      kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  local rc=0
  wait "$launcher" || rc=$?
  launcher=""
  end=$(now_ms)
  [[ $rc == 0 ]] || { tail -30 "$dir/$name.log" >&2; die "$name run failed (exit $rc)"; }
  echo "$(( end - start ))"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
clean_ms=$(run_job clean 0 0)
echo "load average after the fault-free run: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
faulty_ms=$(run_job faulty "$RESTARTS" 1)
echo "load average after the run with kills: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

python3 - "$dir" "$EPOCHS" "$clean_ms" "$faulty_ms" "$PERIOD" <<'PY'
import re, statistics, sys
d, epochs, clean_ms, faulty_ms, period = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
log = open(f"{d}/faulty.log").read()
kills = [int(l.split()[0]) for l in open(f"{d}/faulty.kills") if l.strip()]
restarts = [(int(m.group(2)), int(m.group(1))) for m in
            re.finditer(r"restarting rank slot (\d+) .*? at unix ms (\d+)", log)]
stepping = [(int(m.group(3)), int(m.group(1))) for m in
            re.finditer(r"launch slot (\d+) stepping in generation (\d+) at unix ms (\d+)", log)]
accuracy = re.findall(r"epoch (\d+) test accuracy ([0-9.]+)%", log)
survivors, heals = [], []
for k in kills:
    after = [r for r in restarts if r[0] >= k - 50]
    if not after:
        continue
    r_ms, slot = after[0]
    firsts = {}
    for t, s in stepping:
        if t >= k and s != slot and s not in firsts:
            firsts[s] = t
    if len(firsts) == 3:
        survivors.append((max(firsts.values()) - k) / 1000)
    healed = [t for t, s in stepping if t >= r_ms and s == slot]
    if healed:
        heals.append((healed[0] - r_ms) / 1000)
def eph(ms): return epochs * 3600 / (ms / 1000)
med = lambda v: f"{statistics.median(v):.2f} s (n={len(v)}, {min(v):.2f}-{max(v):.2f})" if v else "-"
print(f"| Run | wall s | epochs/hour | kills | final test accuracy |")
print(f"|---|---|---|---|---|")
last = accuracy[-1][1] + "%" if accuracy else "-"
clean_acc = re.findall(r"epoch (\d+) test accuracy ([0-9.]+)%", open(f"{d}/clean.log").read())
print(f"| fault-free | {clean_ms/1000:.1f} | {eph(clean_ms):.1f} | 0 | {clean_acc[-1][1] + '%' if clean_acc else '-'} |")
print(f"| a rank killed every {period} s | {faulty_ms/1000:.1f} | {eph(faulty_ms):.1f} | {len(kills)} | {last} |")
print()
print(f"goodput ratio: {clean_ms / faulty_ms * 100:.1f}%")
print(f"median kill to every survivor stepping again: {med(survivors)}")
print(f"median restart to the restarted rank stepping: {med(heals)}")
PY
