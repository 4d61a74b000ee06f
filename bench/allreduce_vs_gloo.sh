#!/usr/bin/env bash
# troupe's allreduce (ucx transport) beside torch.distributed gloo, same host, same sizes.
#
#   bench/allreduce_vs_gloo.sh [results-dir]      (default build/bench)
#
# Writes troupe_ucx_w{2,4}.jsonl and gloo_w{2,4}.jsonl to results-dir, then
# allreduce_vs_gloo.md (the tables, also printed) and allreduce_vs_gloo.png (algbw vs size).
# TROUPE_BIN overrides the troupe binary (default build/bin/troupe).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
results="${1:-$root/build/bench}"
troupe="${TROUPE_BIN:-$root/build/bin/troupe}"
python="${TROUPE_PYTHON:-$root/.venv/bin/python}"  # the torch troupe is built against
sizes=4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB
worlds=(2 4)

if [[ ! -x "$troupe" ]]; then
  echo "allreduce_vs_gloo: troupe binary '$troupe' not found or not executable;" \
       "build it first (cmake --build build) or set TROUPE_BIN" >&2
  exit 1
fi
if ! "$python" -c 'import torch.distributed, matplotlib' 2>/dev/null; then
  echo "allreduce_vs_gloo: $python needs torch and matplotlib" \
       "(scripts/setup puts torch in .venv; then .venv/bin/pip install matplotlib)" >&2
  exit 1
fi

mkdir -p "$results"
for world in "${worlds[@]}"; do
  echo "world $world: troupe (ucx)" >&2
  "$troupe" bench allreduce --world "$world" --bytes "$sizes" --transport ucx --json \
    > "$results/troupe_ucx_w$world.jsonl"
  echo "world $world: gloo" >&2
  "$python" "$root/bench/allreduce_gloo.py" --world "$world" --bytes "$sizes" --iters auto --json \
    > "$results/gloo_w$world.jsonl"
done

"$python" "$root/bench/plot_allreduce.py" \
  "$results"/troupe_ucx_w*.jsonl "$results"/gloo_w*.jsonl \
  --png "$results/allreduce_vs_gloo.png" | tee "$results/allreduce_vs_gloo.md"
