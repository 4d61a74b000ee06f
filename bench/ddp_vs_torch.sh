#!/usr/bin/env bash
# troupe's data-parallel step time beside PyTorch DistributedDataParallel (gloo), same host,
# same model (mlp, 7.9M params), batch 64 per rank, one intra-op thread per rank.
#
#   bench/ddp_vs_torch.sh [results-dir] [steps]      (defaults: build/bench, 50)
#
# For world 1 (compute alone: no reduction, no process group) and world 2 it runs
#   troupe bench ddp --world W --model mlp --batch 64 --steps S --json
#   bench/ddp_torch.py --world W --model mlp --batch 64 --steps S --json
# interleaved (troupe w1, torch w1, troupe w2, torch w2) and the whole round twice, since the
# machine is noisy; each configuration's step_sec is the median over the rounds. Each run's JSON
# line goes to results-dir/ddp_{troupe,torch_ddp}_w{W}_r{R}.json; the table (also printed) to
# results-dir/ddp_vs_torch.md:
#   overhead = step_sec(world 2) / step_sec(world 1) - 1, each implementation against its own
#   world-1 compute alone; "vs torch_ddp" = step_sec / torch_ddp's step_sec at the same world.
#
# Environment: TROUPE_BIN overrides the troupe binary (default build/bin/troupe);
# REPEATS overrides the number of rounds (default 2).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${1:-$root/build/bench}"
steps="${2:-50}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
repeats="${REPEATS:-2}"
python=/usr/bin/python3
model=mlp
batch=64
worlds=(1 2)

die() { echo "ddp_vs_torch: $*" >&2; exit 1; }

[[ "$steps" =~ ^[1-9][0-9]*$ ]] || die "steps '$steps': expected a positive integer"
[[ "$repeats" =~ ^[1-9][0-9]*$ ]] || die "REPEATS '$repeats': expected a positive integer"
if [[ ! -x "$troupe" ]]; then
  die "troupe binary '$troupe' not found or not executable;" \
      "build it first (cmake --build build) or set TROUPE_BIN"
fi
# CLI11 lists subcommands under "Subcommands:" in `bench --help`; an unknown one would only
# fail later, after minutes of torch runs.
if ! "$troupe" bench --help 2>&1 | grep -Eq '^[[:space:]]+ddp([[:space:]]|$)'; then
  die "'$troupe bench' has no 'ddp' subcommand (see '$troupe bench --help');" \
      "build a troupe that has it or set TROUPE_BIN"
fi
if ! "$python" -c 'import torch.distributed' 2>/dev/null; then
  die "$python needs torch (apt-get install -y python3-torch)"
fi

mkdir -p "$results"
rm -f "$results"/ddp_troupe_w*_r*.json "$results"/ddp_torch_ddp_w*_r*.json

# run IMPL WORLD ROUND: one benchmark run; its stdout (one JSON object) goes to the results file.
run() {
  local impl="$1" world="$2" round="$3"
  local out="$results/ddp_${impl}_w${world}_r${round}.json"
  local args=(--world "$world" --model "$model" --batch "$batch" --steps "$steps" --json)
  echo "round $round/$repeats: $impl world $world" >&2
  if [[ "$impl" == troupe ]]; then
    "$troupe" bench ddp "${args[@]}" > "$out" || die "'$troupe bench ddp ${args[*]}' failed"
  else
    "$python" "$root/bench/ddp_torch.py" "${args[@]}" > "$out" \
      || die "'bench/ddp_torch.py ${args[*]}' failed"
  fi
}

for round in $(seq 1 "$repeats"); do
  for world in "${worlds[@]}"; do
    run troupe "$world" "$round"
    run torch_ddp "$world" "$round"
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
WORLDS = (1, 2)


def fail(message):
    sys.exit(f"ddp_vs_torch: {message}")


def load(path, impl, world):
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
    expected = {"impl": impl, "world": world, "model": model, "batch": batch, "steps": steps}
    for key, value in expected.items():
        if record[key] != value:
            fail(f"{path}: {key} is {record[key]!r}, expected {value!r}")
    if not isinstance(record["step_sec"], (int, float)) or record["step_sec"] <= 0:
        fail(f"{path}: step_sec {record['step_sec']!r} is not a positive number")
    return record["step_sec"]


sec = {}
for tag, impl in IMPLS:
    for world in WORLDS:
        paths = sorted(glob.glob(os.path.join(results, f"ddp_{tag}_w{world}_r*.json")))
        if len(paths) != repeats:
            fail(f"expected {repeats} results for {tag} world {world}, found {len(paths)}")
        sec[tag, world] = statistics.median(load(path, impl, world) for path in paths)


def overhead(tag):
    return sec[tag, 2] / sec[tag, 1] - 1


print(f"DDP step time, model {model}, batch {batch} per rank, {steps} steps, "
      f"median of {repeats} interleaved rounds; world 1 = compute alone (no reduction)\n")
print("| impl | world | step_sec (ms) | overhead vs world 1 | vs torch_ddp |")
print("|---|---:|---:|---:|---:|")
for tag, impl in IMPLS:
    for world in WORLDS:
        over = "—" if world == 1 else f"{overhead(tag) * 100:+.1f}%"
        ratio = sec[tag, world] / sec["torch_ddp", world]
        print(f"| {impl} | {world} | {sec[tag, world] * 1e3:.2f} | {over} | {ratio:.3f}x |")

troupe_over, torch_over = overhead("troupe"), overhead("torch_ddp")
line = (f"\noverhead troupe {troupe_over * 100:+.1f}% vs torch_ddp {torch_over * 100:+.1f}%; "
        f"world-2 step time troupe/torch_ddp {sec['troupe', 2] / sec['torch_ddp', 2]:.3f}")
if torch_over > 0 and troupe_over >= 0:
    line += f"; overhead ratio troupe/torch_ddp {troupe_over / torch_over:.3f}"
print(line)
EOF
