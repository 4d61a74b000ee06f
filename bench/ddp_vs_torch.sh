#!/usr/bin/env bash
# troupe's data-parallel step time beside PyTorch DistributedDataParallel (gloo), same host,
# same model (mlp, 7.9M params), batch 64 per rank, one intra-op thread per rank.
#
#   bench/ddp_vs_torch.sh [results-dir] [steps]      (defaults: build/bench, 50)
#
# Three configurations per implementation:
#   w1   world 1, compute alone (no reduction, no process group): the issue's baseline
#   w2c  world 2, every rank training alone at the same time (--compute-only): what two
#        processes cost each other on shared cores and caches, with no data parallelism
#   w2   world 2, data parallel (troupe DistributedModule over UCX / torch DDP over gloo)
# by running
#   troupe bench ddp --world W [--compute-only] --model mlp --batch 64 --steps S --json
#   bench/ddp_torch.py --world W [--compute-only] --model mlp --batch 64 --steps S --json
# interleaved (troupe w1, torch w1, troupe w2c, torch w2c, troupe w2, torch w2) and the whole
# round REPEATS times, since the machine is noisy (its speed drifts over minutes). Each run's JSON
# line goes to results-dir/ddp_{troupe,torch_ddp}_{w1,w2c,w2}_r{R}.json; the table (also
# printed) to results-dir/ddp_vs_torch.md. Overheads are paired within a round, then the median
# over rounds is taken:
#   overhead vs world 1 = median over rounds of w2 / w1 - 1 (the issue's figure)
#   overhead vs w2c     = median over rounds of w2 / w2c - 1 (data parallelism alone)
#
# Environment: TROUPE_BIN overrides the troupe binary (default build/bin/troupe);
# REPEATS overrides the number of rounds (default 2).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${1:-$root/build/bench}"
steps="${2:-50}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
repeats="${REPEATS:-2}"
python="${TROUPE_PYTHON:-$root/.venv/bin/python}"  # the torch troupe is built against
model=mlp
batch=64
configs=(w1 w2c w2)

script=ddp_vs_torch
source "$root/bench/common.sh"
need_positive_int steps "$steps"
need_positive_int REPEATS "$repeats"
need_troupe "$troupe"
need_torch "$python"

mkdir -p "$results"
rm -f "$results"/ddp_troupe_w*_r*.json "$results"/ddp_torch_ddp_w*_r*.json

# run IMPL CONFIG ROUND: one benchmark run; its stdout (one JSON object) goes to the results file.
run() {
  local impl="$1" config="$2" round="$3"
  local out="$results/ddp_${impl}_${config}_r${round}.json"
  local world=2 extra=()
  [[ "$config" == w1 ]] && world=1
  [[ "$config" == w2c ]] && extra=(--compute-only)
  local args=(--world "$world" "${extra[@]}" --model "$model" --batch "$batch" --steps "$steps"
              --json)
  echo "round $round/$repeats: $impl $config" >&2
  if [[ "$impl" == troupe ]]; then
    "$troupe" bench ddp "${args[@]}" > "$out" || die "'$troupe bench ddp ${args[*]}' failed"
  else
    "$python" "$root/bench/ddp_torch.py" "${args[@]}" > "$out" \
      || die "'bench/ddp_torch.py ${args[*]}' failed"
  fi
}

for round in $(seq 1 "$repeats"); do
  for config in "${configs[@]}"; do
    run troupe "$config" "$round"
    run torch_ddp "$config" "$round"
  done
done

"$python" - "$results" "$model" "$batch" "$steps" "$repeats" <<'EOF' | tee "$results/ddp_vs_torch.md"
import glob
import json
import os
import statistics
import sys

results, model, batch, steps, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
KEYS = ("impl", "world", "model", "batch", "steps", "step_sec")
IMPLS = (("troupe", "troupe"), ("torch_ddp", "torch_ddp"))  # (file tag, expected "impl")
CONFIGS = (("w1", 1, True), ("w2c", 2, True), ("w2", 2, False))  # (tag, world, compute only)


def fail(message):
    sys.exit(f"ddp_vs_torch: {message}")


def load(path, impl, world, compute_only):
    """The one JSON object in `path` (the last line that is one, so log lines are tolerated)."""
    with open(path) as f:
        lines = [line.strip() for line in f if line.strip().startswith("{")]
    if not lines:
        fail(f"{path}: no JSON object in the output")
    try:
        record = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        fail(f"{path}: not JSON ({err}): {lines[-1]}")
    missing = [key for key in KEYS if key not in record]
    if missing:
        fail(f"{path}: missing keys {missing}: {lines[-1]}")
    expected = {"impl": impl, "world": world, "model": model, "batch": batch, "steps": steps,
                "compute_only": compute_only}
    for key, value in expected.items():
        if record.get(key) != value:
            fail(f"{path}: {key} is {record.get(key)!r}, expected {value!r}")
    if not isinstance(record["step_sec"], (int, float)) or record["step_sec"] <= 0:
        fail(f"{path}: step_sec {record['step_sec']!r} is not a positive number")
    return record["step_sec"]


runs = {}  # (tag, config) -> step_sec by round
for tag, impl in IMPLS:
    for config, world, alone in CONFIGS:
        runs[tag, config] = [
            load(os.path.join(results, f"ddp_{tag}_{config}_r{r}.json"), impl, world, alone)
            for r in range(1, repeats + 1)]


def paired(tag, config, base):
    """Per-round overheads of `config` over `base`, and their median."""
    each = [a / b - 1 for a, b in zip(runs[tag, config], runs[tag, base])]
    return each, statistics.median(each)


def pct(x):
    return f"{x * 100:+.1f}%"


print(f"DDP step time, model {model}, batch {batch} per rank, {steps} steps, {repeats} "
      "interleaved rounds; step_sec is the median over rounds, overheads the median of the "
      "per-round ratios\n")
print("| impl | config | step_sec (ms) | overhead vs world 1 | overhead vs w2c | per round (vs world 1) |")
print("|---|---|---:|---:|---:|---|")
for tag, impl in IMPLS:
    for config, _, _ in CONFIGS:
        med = statistics.median(runs[tag, config]) * 1e3
        if config == "w1":
            over = alone = each = "—"
        else:
            rounds, median = paired(tag, config, "w1")
            over, each = pct(median), ", ".join(pct(x) for x in rounds)
            alone = pct(paired(tag, "w2", "w2c")[1]) if config == "w2" else "—"
        print(f"| {impl} | {config} | {med:.2f} | {over} | {alone} | {each} |")

troupe_over, torch_over = paired("troupe", "w2", "w1")[1], paired("torch_ddp", "w2", "w1")[1]
print(f"\noverhead vs world 1: troupe {pct(troupe_over)}, torch_ddp {pct(torch_over)}; "
      f"vs two ranks computing alone: troupe {pct(paired('troupe', 'w2', 'w2c')[1])}, "
      f"torch_ddp {pct(paired('torch_ddp', 'w2', 'w2c')[1])}")
EOF
