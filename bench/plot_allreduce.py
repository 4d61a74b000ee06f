#!/usr/bin/python3
"""Compares troupe's allreduce with the gloo baseline from their JSON-lines results.

Reads the lines of `troupe bench allreduce --json` and bench/allreduce_gloo.py --json (keys
bytes, world, transport, sec, algbw_GBps, busbw_GBps; gloo rows have transport "gloo", every
other transport is troupe's), prints a markdown table per world size to stdout and writes a PNG
of algbw against message size, one line per (implementation, world).

    bench/plot_allreduce.py build/bench/*.jsonl --png build/bench/allreduce_vs_gloo.png
"""

import argparse
import json
import os
import sys
from collections import defaultdict

KEYS = ("bytes", "world", "transport", "sec", "algbw_GBps", "busbw_GBps")
UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(size):
    for unit, scale in UNITS:
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def input_files(paths):
    """Files named directly, plus every *.jsonl inside a named folder."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, name) for name in os.listdir(path)
                            if name.endswith(".jsonl"))
        else:
            files.append(path)
    return files


def read_results(files):
    """{(transport, world, bytes): record}; a later record for the same key replaces one before."""
    results = {}
    for path in files:
        with open(path) as stream:
            for number, line in enumerate(stream, 1):
                line = line.strip()
                if not line.startswith("{"):
                    continue  # log lines that share the stream
                record = json.loads(line)
                missing = [key for key in KEYS if key not in record]
                if missing:
                    raise SystemExit(f"{path}:{number}: record lacks {', '.join(missing)}; "
                                     f"expected keys {', '.join(KEYS)}")
                results[(record["transport"], int(record["world"]), int(record["bytes"]))] = record
    return results


def cell(value, fmt):
    return "—" if value is None else format(value, fmt)


def markdown(results, troupe_transport):
    worlds = sorted({world for _, world, _ in results})
    lines = []
    for world in worlds:
        sizes = sorted({size for _, w, size in results if w == world})
        lines.append(f"world {world}, troupe over {troupe_transport}:")
        lines.append("")
        lines.append("| size | troupe sec | gloo sec | troupe algbw GB/s | gloo algbw GB/s "
                     "| speedup |")
        lines.append("|---:|---:|---:|---:|---:|---:|")
        for size in sizes:
            ours = results.get((troupe_transport, world, size))
            peer = results.get(("gloo", world, size))
            speedup = peer["sec"] / ours["sec"] if ours and peer else None
            lines.append("| " + " | ".join([
                format_size(size),
                cell(ours and ours["sec"], ".6f"),
                cell(peer and peer["sec"], ".6f"),
                cell(ours and ours["algbw_GBps"], ".3f"),
                cell(peer and peer["algbw_GBps"], ".3f"),
                cell(speedup, ".2f") + ("×" if speedup is not None else ""),
            ]) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = defaultdict(list)
    for (transport, world, size), record in results.items():
        impl = "gloo" if transport == "gloo" else f"troupe ({transport})"
        series[(impl, world)].append((size, record["algbw_GBps"]))

    # Colour names the implementation, line style and marker the world size.
    impls = sorted({impl for impl, _ in series})
    worlds = sorted({world for _, world in series})
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    figure, axes = plt.subplots(figsize=(8, 5))
    for (impl, world), points in sorted(series.items()):
        points.sort()
        linestyle, marker = styles[worlds.index(world) % len(styles)]
        axes.plot([size for size, _ in points], [bw for _, bw in points],
                  color=f"C{impls.index(impl)}", linestyle=linestyle, marker=marker,
                  label=f"{impl}, world {world}")
    sizes = sorted({size for _, _, size in results})
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes)
    axes.set_xticklabels([format_size(size).replace(" ", "") for size in sizes], rotation=45)
    axes.set_xlabel("message size")
    axes.set_ylabel("algbw (GB/s)")
    axes.set_title("allreduce on one host: troupe vs torch.distributed gloo")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="JSON-lines files, or folders of *.jsonl")
    parser.add_argument("--png", default="allreduce_vs_gloo.png", help="plot to write")
    parser.add_argument("--troupe-transport", default="ucx",
                        help="troupe transport compared in the table")
    args = parser.parse_args()

    files = input_files(args.inputs)
    if not files:
        parser.error(f"no JSON-lines files in {', '.join(args.inputs)}")
    results = read_results(files)
    if not results:
        parser.error(f"no results in {', '.join(files)}")
    print(markdown(results, args.troupe_transport))
    plot(results, args.png)
    print(f"plot: {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
