#!/usr/bin/env bash
# Goodput of an elastic job under repeated kills: 4 ranks of Fashion-MNIST (MLP) under
# `troupe launch --elastic --min-ranks 2`, once fault-free and once with a random live rank killed
# (SIGKILL, from outside the job) every PERIOD seconds and restarted by the launcher. Prints, as
# Markdown, the epochs per hour of both runs and their ratio, and the median times from a kill to
# every survivor stepping again and from a restart to the restarted rank stepping, taken from the
# logs (the launcher's "restarting rank slot S ... at unix ms" lines and fashion_mnist's "launch
# slot S stepping in generation G at unix ms" lines; the kill times are this script's).
# With SPARES > 0 the job runs with `--spares SPARES`: a spare waiting past its start-up takes the
# killed rank's place, and the times are from the kill to every member stepping again and to the
# spare stepping in the dead rank's place (the launcher's "spare slot S joins generation G").
# Waiting spares are named troupe-spare, so only ranks are killed.
#   bench/elastic_goodput.sh [build dir] [epochs] [period s] [max restarts] [spares]
# Only the launcher's own children (the ranks, named fashion_mnist) are ever killed.
set -euo pipefail
script=elastic_goodput.sh
source "$(dirname "$0")/common.sh"
BUILD="${1:-build}"
EPOCHS="${2:-8}"
PERIOD="${3:-30}"
RESTARTS="${4:-50}"
SPARES="${5:-0}"
need_positive_int epochs "$EPOCHS"
need_positive_int "period" "$PERIOD"
need_positive_int "max restarts" "$RESTARTS"
[[ "$SPARES" =~ ^[0-9]+$ ]] || die "spares '$SPARES' (expected an integer >= 0)"
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
  "$BUILD/bin/troupe" launch --elastic --min-ranks 2 --max-restarts "$restarts" \
    --spares "$SPARES" -n 4 -- \
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
      local slot
      slot=$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | sed -n 's/^RANK=//p')
      echo "$(now_ms) $pid ${slot:--1}" >>"$dir/$name.kills"
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

python3 - "$dir" "$EPOCHS" "$clean_ms" "$faulty_ms" "$PERIOD" "$SPARES" <<'PY'
import re, statistics, sys
d, epochs, clean_ms, faulty_ms, period = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
spares = int(sys.argv[6])
log = open(f"{d}/faulty.log").read()
kills = [int(l.split()[0]) for l in open(f"{d}/faulty.kills") if l.strip()]
restarts = [(int(m.group(2)), int(m.group(1))) for m in
            re.finditer(r"restarting rank slot (\d+) .*? at unix ms (\d+)", log)]
stepping = [(int(m.group(3)), int(m.group(1))) for m in
            re.finditer(r"launch slot (\d+) stepping in generation (\d+) at unix ms (\d+)", log)]
accuracy = re.findall(r"epoch (\d+) test accuracy ([0-9.]+)%", log)
survivors, heals = [], []
# With spares: generation G takes spare slot S ("spare slot S joins generation G"); after kill k,
# the first generation with a spare whose members step after k.
joins = [(int(m.group(2)), int(m.group(1))) for m in
         re.finditer(r"spare slot (\d+) joins generation (\d+)", log)]
stepping_g = [(int(m.group(3)), int(m.group(1)), int(m.group(2))) for m in
              re.finditer(r"launch slot (\d+) stepping in generation (\d+) at unix ms (\d+)", log)]
for i, k in enumerate(kills if spares else []):
    # A kill that hit a spare still starting up formed no generation: the next one is not its.
    next_k = kills[i + 1] if i + 1 < len(kills) else float("inf")
    for g, spare in joins:
        lines = [(t, s) for t, s, gen in stepping_g if gen == g]
        if not lines or min(t for t, _ in lines) < k:
            continue
        if min(t for t, _ in lines) > next_k:
            break
        firsts = {}
        for t, s in lines:
            firsts.setdefault(s, t)
        if spare in firsts:
            heals.append((firsts[spare] - k) / 1000)
        if len(firsts) == 4:
            survivors.append((max(firsts.values()) - k) / 1000)
        break
for k in ([] if spares else kills):
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
if spares:
    print(f"median kill to every member (the spare included) stepping again: {med(survivors)}")
    print(f"median kill to the spare stepping in the dead rank's place: {med(heals)}")
else:
    print(f"median kill to every survivor stepping again: {med(survivors)}")
    print(f"median restart to the restarted rank stepping: {med(heals)}")
PY
