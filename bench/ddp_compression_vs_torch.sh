#!/usr/bin/env bash
# troupe's compressed data-parallel step time beside PyTorch DDP's communication hooks (gloo),
# same host, same model (mlp, 7.9M params), batch 64 per rank, one intra-op thread per rank:
#   fp16:     troupe --algorithm fp16            vs  default_hooks.fp16_compress_hook
#   powersgd: troupe --algorithm powersgd:rank=2,start_iter=2
#                                                vs  powerSGD_hook (rank 2, start_powerSGD_iter 2)
# Each against its own compute alone (world 1), so overhead = step(world 2) / step(world 1) - 1.
# Runs are interleaved and the whole round repeated (REPEATS, default 2); medians over rounds.
#
#   bench/ddp_compression_vs_torch.sh [results-dir] [steps]      (defaults: build/bench, 30)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${1:-$root/build/bench}"
steps="${2:-30}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
repeats="${REPEATS:-2}"
python="${TROUPE_PYTHON:-$root/.venv/bin/python}"  # the torch troupe is built against
script=ddp_compression_vs_torch
source "$root/bench/common.sh"
need_positive_int steps "$steps"
need_positive_int REPEATS "$repeats"
need_troupe "$troupe"
need_torch "$python"
mkdir -p "$results"
out="$results/ddp_compression.jsonl"
: > "$out"
common=(--model mlp --batch 64 --steps "$steps" --json)
for round in $(seq 1 "$repeats"); do
  echo "round $round/$repeats" >&2
  "$troupe" bench ddp --world 1 "${common[@]}" | sed "s/^{/{\"round\": $round, \"config\": \"alone\", /" >> "$out"
  "$python" "$root/bench/ddp_torch.py" --world 1 "${common[@]}" | sed "s/^{/{\"round\": $round, \"config\": \"alone\", /" >> "$out"
  for config in fp16 powersgd; do
    algo=$config
    [[ $config == powersgd ]] && algo="powersgd:rank=2,start_iter=2"
    "$troupe" bench ddp --world 2 --algorithm "$algo" "${common[@]}" | sed "s/^{/{\"round\": $round, \"config\": \"$config\", /" >> "$out"
    "$python" "$root/bench/ddp_torch.py" --world 2 --hook "$config" "${common[@]}" | sed "s/^{/{\"round\": $round, \"config\": \"$config\", /" >> "$out"
  done
done
"$python" - "$out" "$steps" "$repeats" <<'PY' | tee "$results/ddp_compression_vs_torch.md"
import json, statistics, sys
path, steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = [json.loads(l) for l in open(path) if l.startswith("{")]
sec = {}
for impl in ("troupe", "torch_ddp"):
    for config in ("alone", "fp16", "powersgd"):
        values = [r["step_sec"] for r in rows if r["impl"] == impl and r["config"] == config]
        if len(values) != repeats:
            sys.exit(f"{impl} {config}: {len(values)} results, expected {repeats}")
        sec[impl, config] = statistics.median(values)
print(f"MLP 784-2048-2048-1024-10, batch 64 per rank, 2 ranks, {steps} steps, median of "
      f"{repeats} interleaved rounds; overhead against each implementation's compute alone\n")
print("| config | troupe step (ms) | troupe overhead | torch step (ms) | torch overhead |")
print("|---|---:|---:|---:|---:|")
for config in ("alone", "fp16", "powersgd"):
    cells = []
    for impl in ("troupe", "torch_ddp"):
        s = sec[impl, config]
        over = "—" if config == "alone" else f"{(s / sec[impl, 'alone'] - 1) * 100:+.1f}%"
        cells += [f"{s * 1e3:.1f}", over]
    print(f"| {config} | " + " | ".join(cells) + " |")
PY
