#!/usr/bin/python3
"""Peer baseline: torch.distributed allreduce (gloo backend) on loopback.

Spawns `--world` processes on 127.0.0.1, each with one intra-op thread, and allreduces
(sum) float32 tensors of each size in `--bytes`. Rank 0 prints, per size, the median time of
one allreduce, algbw = bytes / sec and busbw = algbw * 2 * (world - 1) / world (GB/s, 1e9).

The time of an iteration is the slowest rank's time for it, so a rank that returns early
does not flatter the figure. With --json the output is one JSON object per line with the keys
bytes, world, transport, sec, algbw_GBps, busbw_GBps -- the same keys as
`troupe bench allreduce --json`, so bench/plot_allreduce.py reads both.

    bench/allreduce_gloo.py --world 2 --bytes 4KiB,1MiB,64MiB --iters auto [--json]
"""

import argparse
import json
import re
import statistics
import sys
import time

from gloo_job import gloo_group, rank_from_env, spawn

UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
FLOAT32_BYTES = 4
WARMUP_ITERS = 5
MIN_ITERS = 3


def parse_size(text):
    """'64MiB' -> 67108864. Accepts B, KiB, MiB, GiB or a bare byte count."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2) not in UNITS:
        raise argparse.ArgumentTypeError(
            f"size '{text}': expected a whole number with an optional unit B, KiB, MiB or GiB "
            f"(e.g. 4KiB)")
    size = int(match.group(1)) * UNITS[match.group(2)]
    if size <= 0 or size % FLOAT32_BYTES:
        raise argparse.ArgumentTypeError(
            f"size '{text}' = {size} bytes: expected a positive multiple of {FLOAT32_BYTES} "
            f"(float32 elements)")
    return size


def parse_sizes(text):
    return [parse_size(part) for part in text.split(",") if part.strip()]


def parse_iters(text):
    if text == "auto":
        return None
    try:
        iters = int(text)
    except ValueError:
        iters = 0
    if iters < 1:
        raise argparse.ArgumentTypeError(f"iters '{text}': expected 'auto' or a positive integer")
    return iters


def format_size(size):
    for unit in ("GiB", "MiB", "KiB"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]}{unit}"
    return f"{size}B"



def time_allreduce(dist, tensor):
    start = time.perf_counter()
    dist.all_reduce(tensor)
    return time.perf_counter() - start


def measure(torch, dist, size, fixed_iters, target_sec):
    """(median seconds of one allreduce of `size` bytes, iterations); the same on every rank.

    With fixed_iters None, iterations run in batches of doubling length until the slowest rank
    has spent target_sec (and at least MIN_ITERS ran); ranks agree after each batch, so all
    of them stop at the same allreduce.
    """
    tensor = torch.ones(size // FLOAT32_BYTES, dtype=torch.float32)
    for _ in range(WARMUP_ITERS):
        dist.all_reduce(tensor)

    times = []
    if fixed_iters is not None:
        times = [time_allreduce(dist, tensor) for _ in range(fixed_iters)]
    else:
        batch = 1
        while True:
            times += [time_allreduce(dist, tensor) for _ in range(batch)]
            spent = torch.tensor([sum(times)], dtype=torch.float64)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            if spent.item() >= target_sec and len(times) >= MIN_ITERS:
                break
            batch *= 2

    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist()), len(times)


def run_rank(rank, args, port, master_addr="127.0.0.1", ifname="lo"):
    import torch

    with gloo_group(rank, args.world, port, master_addr, ifname) as dist:
        if rank == 0 and not args.json:
            print(f"torch {torch.__version__} gloo allreduce, world {args.world}, "
                  f"float32 sum, 1 thread per rank, {ifname}", flush=True)
            print(f"{'size':>8} {'bytes':>11} {'iters':>6} {'sec':>11} "
                  f"{'algbw GB/s':>11} {'busbw GB/s':>11}", flush=True)
        for size in args.bytes:
            sec, iters = measure(torch, dist, size, args.iters, args.target_sec)
            if rank != 0:
                continue
            algbw = size / sec / 1e9
            busbw = algbw * 2 * (args.world - 1) / args.world
            if args.json:
                print(json.dumps({"bytes": size, "world": args.world, "transport": "gloo",
                                  "sec": sec, "algbw_GBps": algbw, "busbw_GBps": busbw}),
                      flush=True)
            else:
                print(f"{format_size(size):>8} {size:>11} {iters:>6} {sec:>11.6f} "
                      f"{algbw:>11.3f} {busbw:>11.3f}", flush=True)


def main():
    parser = argparse.ArgumentParser(
        description="torch.distributed gloo allreduce on loopback (peer baseline for "
                    "`troupe bench allreduce`)")
    parser.add_argument("--world", type=int, default=2, help="number of ranks (processes)")
    parser.add_argument("--bytes", type=parse_sizes, default=parse_sizes("4KiB,1MiB,64MiB"),
                        help="comma-separated sizes, units B, KiB, MiB, GiB")
    parser.add_argument("--iters", type=parse_iters, default=None,
                        help="'auto' (about --target-sec, at least 3) or a fixed count")
    parser.add_argument("--target-sec", type=float, default=0.5,
                        help="time to spend on each size with --iters auto")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--from-env", metavar="IFNAME",
                        help="run as the one rank that RANK, WORLD_SIZE, MASTER_ADDR and "
                             "MASTER_PORT name (as scripts/netbed starts it), gloo on IFNAME")
    args = parser.parse_args()
    if args.from_env:
        rank, args.world, master_addr, port = rank_from_env()
        run_rank(rank, args, port, master_addr, args.from_env)
        return 0
    if args.world < 2:
        parser.error(f"--world {args.world}: expected at least 2 ranks")
    if not args.bytes:
        parser.error("--bytes: expected at least one size")

    spawn(run_rank, args.world, args)


if __name__ == "__main__":
    sys.exit(main())
