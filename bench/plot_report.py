#!/usr/bin/python3
"""The two plots of docs/benchmarks.md that no benchmark script draws from its own results.

    .venv/bin/python bench/plot_report.py            # needs matplotlib
    .venv/bin/python bench/plot_report.py --out /tmp/img

Writes step_time_per_algorithm.png and accuracy_vs_bytes.png (default: docs/img). The numbers
below are measured figures transcribed from the tables of docs/benchmarks-archive.md, one run's
table per panel, troupe beside its PyTorch peers of that run; nothing here is computed. Each
table names the archive section and the date it comes from. A new run goes into its table here
and into docs/benchmarks.md together.
"""

import argparse
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# docs/benchmarks-archive.md, "Compressed step time vs PyTorch DDP's fp16 and PowerSGD hooks"
# (2026-11-26, LibTorch 2.15 and torch 2.15, MKL): MLP 784-2048-2048-1024-10, batch 64 per rank,
# 2 processes on one host, `REPEATS=2 bench/ddp_compression_vs_torch.sh /tmp/bench 20`.
# Step (ms): (configuration, troupe, torch).
MLP_STEP_MS = [
    ("compute alone", 42.8, 48.7),
    ("fp16", 59.0, 89.8),
    ("PowerSGD rank 2", 80.0, 101.8),
]

# docs/benchmarks-archive.md, "The CNN across 4 hosts at 100 Mbit/s: the next forward overlaps
# the last reductions (session 16)", round "ov4 round 1" (2026-11-27, LibTorch 2.15, torch 2.15):
# Fashion-MNIST CNN, 1 epoch, 4 hosts of scripts/netbed, one rank each, links 100 Mbit/s.
# Epoch (s): (run, seconds, is torch's).
CNN_EPOCH_S = [
    ("troupe allreduce", 29.9, False),
    ("troupe allreduce,\n--overlap-next-forward", 25.9, False),
    ("troupe PowerSGD r2", 13.4, False),
    ("troupe PowerSGD r2,\n--overlap-next-forward", 11.1, False),
    ("torch DDP", 36.4, True),
]
# The same section: 297.5 MB left each host in the epoch, 23.8 s at 12.5 MB/s.
CNN_BYTES_BOUND_S = 23.8

# docs/benchmarks-archive.md, "Fashion-MNIST CNN across 4 emulated hosts: troupe vs PyTorch DDP
# (2026-11-23/24)", link 100mbit, round 1 (troupe 46dc560 on LibTorch 1.13, torch 1.13): 1 epoch,
# 4 hosts, one rank each. (run, test accuracy %, MB sent per host 0/1/2/3, is torch's); the plot
# uses host 0's (rank 0's) bytes.
CNN_ACCURACY_MB = [
    ("troupe allreduce", 86.70, (295.8, 295.2, 295.2, 295.2), False),
    ("troupe bytegrad", 86.57, (77.6, 76.9, 76.9, 76.9), False),
    ("troupe powersgd:rank=2", 82.28, (24.0, 23.4, 23.4, 23.4), False),
    ("troupe topk:ratio=0.01", 84.63, (15.5, 14.8, 14.9, 14.8), False),
    ("torch DDP", 85.00, (293.7, 292.8, 292.0, 292.0), True),
    ("torch DDP, PowerSGD hook", 82.79, (23.1, 22.3, 21.5, 21.5), True),
]

TROUPE, TORCH = "C0", "C1"


def step_time_plot(plt, path):
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4),
                                      gridspec_kw={"width_ratios": [1, 1.25]})
    names = [name for name, _, _ in MLP_STEP_MS]
    xs = range(len(names))
    width = 0.38
    left.bar([x - width / 2 for x in xs], [t for _, t, _ in MLP_STEP_MS], width,
             color=TROUPE, label="troupe")
    left.bar([x + width / 2 for x in xs], [t for _, _, t in MLP_STEP_MS], width,
             color=TORCH, label="torch DDP (gloo), its fp16 / PowerSGD hooks")
    for x, (_, ours, theirs) in zip(xs, MLP_STEP_MS):
        left.text(x - width / 2, ours, f"{ours}", ha="center", va="bottom", fontsize=8)
        left.text(x + width / 2, theirs, f"{theirs}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(list(xs))
    left.set_xticklabels(names)
    left.set_ylim(0, 125)
    left.set_ylabel("step time (ms)")
    left.set_title("MLP 7.9M parameters, 2 ranks, one host\n2026-11-26, LibTorch 2.15",
                   fontsize=10)
    left.legend(loc="upper left", fontsize=8)
    left.grid(axis="y", alpha=0.3)

    labels = [name for name, _, _ in CNN_EPOCH_S]
    times = [seconds for _, seconds, _ in CNN_EPOCH_S]
    colors = [TORCH if torch else TROUPE for _, _, torch in CNN_EPOCH_S]
    ys = range(len(labels))
    right.barh(list(ys), times, color=colors)
    for y, seconds in zip(ys, times):
        right.text(seconds + 0.4, y, f"{seconds} s", va="center", fontsize=8)
    right.axvline(CNN_BYTES_BOUND_S, color="k", linestyle="--", linewidth=1,
                  label=f"allreduce's bytes at the line rate ({CNN_BYTES_BOUND_S} s)")
    right.set_yticks(list(ys))
    right.set_yticklabels(labels, fontsize=8)
    right.invert_yaxis()
    right.set_xlim(0, 50)
    right.set_xlabel("epoch time (s)")
    right.set_title("Fashion-MNIST CNN, 4 emulated hosts, 100 Mbit/s links\n"
                    "2026-11-27, round ov4 1, LibTorch 2.15", fontsize=10)
    right.legend(loc="center right", fontsize=8)
    right.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def accuracy_plot(plt, path):
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for name, accuracy, hosts, torch in CNN_ACCURACY_MB:
        ax.scatter(hosts[0], accuracy, s=45, color=TORCH if torch else TROUPE,
                   marker="s" if torch else "o", zorder=3)
        ax.annotate(name, (hosts[0], accuracy), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
    ax.scatter([], [], color=TROUPE, marker="o", label="troupe")
    ax.scatter([], [], color=TORCH, marker="s", label="torch DDP (gloo)")
    ax.set_xscale("log")
    ax.set_xlim(10, 1000)
    ticks = [10, 20, 50, 100, 200, 500, 1000]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_ylim(81.5, 87.5)
    ax.set_xlabel("MB sent by host 0 in the epoch (MB, log scale)")
    ax.set_ylabel("test accuracy after 1 epoch (%)")
    ax.set_title("Fashion-MNIST CNN, 4 emulated hosts, 100 Mbit/s links, 1 epoch\n"
                 "2026-11-23/24, round 1, LibTorch 1.13 and torch 1.13", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img"),
                        help="folder for the two PNGs (default docs/img)")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.out, exist_ok=True)
    for name, draw in (("step_time_per_algorithm.png", step_time_plot),
                       ("accuracy_vs_bytes.png", accuracy_plot)):
        path = os.path.join(args.out, name)
        draw(plt, path)
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
