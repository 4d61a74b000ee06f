#!/usr/bin/python3
"""Allreduce bandwidth over message size across emulated hosts: troupe, gloo and the line rate.

Reads the tables that bench/netbed_allreduce.sh writes (netbed_allreduce.md, one per results
folder: run it once per SIZE), prints one markdown row per (link, size) with the median over the
rounds, and writes a PNG of algbw against message size per link rate: troupe (its default
configuration), gloo, the line-rate bound of a ring allreduce, and that bound times the TCP
payload of a 1514-byte frame (1448 bytes: what any allreduce over TCP can reach).

    for s in 256KiB 1MiB 4MiB 16MiB 64MiB; do
      SIZE=$s RATES=1gbit bench/netbed_allreduce.sh /tmp/sweep/$s; done
    bench/plot_netbed_allreduce.py /tmp/sweep/* --png docs/img/netbed_allreduce.png
"""

import argparse
import os
import re
import statistics
import sys
from collections import defaultdict

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
PAYLOAD = 1448 / 1514


def size_bytes(text):
    match = re.fullmatch(r"(\d+)(KiB|MiB|GiB)", text)
    if not match:
        sys.exit(f"plot_netbed_allreduce: size '{text}': expected e.g. 64MiB")
    return int(match.group(1)) * UNITS[match.group(2)]


def tables(paths):
    for path in paths:
        if os.path.isdir(path):
            path = os.path.join(path, "netbed_allreduce.md")
        if not os.path.isfile(path):
            sys.exit(f"plot_netbed_allreduce: no table at '{path}'")
        yield path


def read_rows(paths):
    """(link, size) -> {'troupe': [...], 'gloo': [...], 'bound': MB/s} from the defaults rows."""
    rows = defaultdict(lambda: {"troupe": [], "gloo": [], "bound": None})
    for path in tables(paths):
        for line in open(path):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 8 or cells[0] in ("link", "---") or cells[0].startswith("-"):
                continue
            link, _world, size, _round, options = cells[:5]
            if options != "defaults":
                continue
            row = rows[(link, size_bytes(size))]
            row["troupe"].append(float(cells[5]))
            row["gloo"].append(float(cells[6]))
            row["bound"] = float(cells[7])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="netbed_allreduce.md files or their folders")
    parser.add_argument("--png", help="write the plot here (needs matplotlib)")
    args = parser.parse_args()
    rows = read_rows(args.paths)
    if not rows:
        sys.exit("plot_netbed_allreduce: no rows of troupe's defaults in the tables given")
    print("| link | size | troupe MB/s | gloo MB/s | bound MB/s | troupe / bound | gloo / bound | troupe / gloo |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (link, size), row in sorted(rows.items()):
        t, g = statistics.median(row["troupe"]), statistics.median(row["gloo"])
        b = row["bound"]
        name = next(f"{size // s} {u}" for u, s in reversed(UNITS.items()) if size >= s)
        print(f"| {link} | {name} | {t:.1f} | {g:.1f} | {b:.1f} | {t / b:.0%} | {g / b:.0%} | "
              f"{t / g:.2f} |")
    if not args.png:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = sorted({link for link, _ in rows})
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links):
        sizes = sorted(size for l, size in rows if l == link)
        pick = lambda key: [statistics.median(rows[(link, s)][key]) for s in sizes]
        bound = [rows[(link, s)]["bound"] for s in sizes]
        ax.plot(sizes, pick("troupe"), "o-", label="troupe (ucx over tcp)")
        ax.plot(sizes, pick("gloo"), "s-", label="gloo (torch.distributed)")
        ax.plot(sizes, bound, "k--", label="line-rate bound")
        ax.plot(sizes, [b * PAYLOAD for b in bound], "k:", label="bound x TCP payload (1448/1514)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([next(f"{s // v}{u}" for u, v in reversed(UNITS.items()) if s >= v)
                            for s in sizes])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("message size")
        ax.set_ylabel("algbw (MB/s)")
        ax.set_title(f"allreduce across 4 emulated hosts, links {link}")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
