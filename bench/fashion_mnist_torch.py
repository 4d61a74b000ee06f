#!/usr/bin/python3
"""Peer baseline: the Fashion-MNIST models of examples/fashion_mnist trained with PyTorch
DistributedDataParallel (gloo, CPU), with or without torch's PowerSGD hook, to put troupe's
accuracy and epoch time next to torch's on the same task.

Same settings as `bench/fashion_mnist_algorithms.sh`: --model mlp is the MLP 784-256-10 (ReLU,
log_softmax), --model cnn the CNN (conv 1->16 3x3 pad 1, ReLU, max-pool 2; conv 16->32 3x3 pad 1,
ReLU, max-pool 2; 1568-128 ReLU; 128-10; log_softmax), images normalised as (x / 255 - 0.2860) / 0.3530, each of --world ranks on a
contiguous 1/world slice of one permutation of the training set (seed --seed), batch 64 per rank
reshuffled per epoch, SGD lr --lr (0.05) momentum 0.9 under --lr-schedule (constant or cosine),
--epochs epochs; prints rank 0's test accuracy and the time of the training loop per epoch
(rank 0's, from its first batch to its last step, as fashion_mnist's "epoch time").
The shards and batch orders are drawn with torch's generator, not troupe's, so the runs see the
same data in another order.

  --hook none       plain DDP allreduce
  --hook powersgd   powerSGD_hook, matrix_approximation_rank --rank, start_powerSGD_iter 10,
                    error feedback and warm start on (as troupe's PowerSGD defaults)

    /usr/bin/python3 bench/fashion_mnist_torch.py --world 4 --epochs 2 --hook powersgd --seed 1

With --from-env IFNAME the process is the one rank that RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT name (as scripts/netbed or torchrun start it), gloo on interface IFNAME.
"""

import argparse
import gzip
import math
import time

import numpy as np

from gloo_job import gloo_group, rank_from_env, spawn

DATA = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530


def load(split):
    import torch

    prefix = "train" if split == "train" else "t10k"
    with gzip.open(f"{DATA}/{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(f"{DATA}/{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    x = (torch.from_numpy(images.astype(np.float32)) / 255.0 - MEAN) / STD
    return x, torch.from_numpy(labels.astype(np.int64))


def make_model(name):
    import torch.nn as nn

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def run_rank(rank, args, port, master_addr="127.0.0.1", ifname="lo"):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    with gloo_group(rank, args.world, port, master_addr, ifname):
        x, y = load("train")
        tx, ty = load("test")
        g = torch.Generator().manual_seed(args.seed)
        order = torch.randperm(len(x), generator=g)
        per = len(x) // args.world
        mine = order[rank * per:(rank + 1) * per]
        x, y = x[mine], y[mine]
        torch.manual_seed(args.seed)
        model = make_model(args.model)
        ddp = nn.parallel.DistributedDataParallel(model)
        if args.hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=args.rank,
                                                start_powerSGD_iter=10)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        steps = args.epochs * (len(x) // args.batch)
        step = 0
        epoch_times = []
        for epoch in range(args.epochs):
            perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed + epoch))
            epoch_start = time.perf_counter()
            for start in range(0, len(x) - args.batch + 1, args.batch):
                idx = perm[start:start + args.batch]
                if args.lr_schedule == "cosine":
                    for group in opt.param_groups:
                        group["lr"] = args.lr * 0.5 * (1 + math.cos(math.pi * step / steps))
                step += 1
                opt.zero_grad()
                F.nll_loss(F.log_softmax(ddp(x[idx]), 1), y[idx]).backward()
                opt.step()
            epoch_times.append(time.perf_counter() - epoch_start)
        if rank == 0:
            with torch.no_grad():
                acc = (model(tx).argmax(1) == ty).float().mean().item()
            times = " ".join(f"{t:.1f}" for t in epoch_times)
            print(f"torch {args.hook}: test accuracy {acc * 100:.2f}% epoch time {times} s "
                  f"({args.model}, {step} steps)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="cosine: lr (1 + cos(pi step / steps)) / 2 over the run, as fashion_mnist")
    p.add_argument("--hook", choices=("none", "powersgd"), default="none")
    p.add_argument("--rank", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--from-env", metavar="IFNAME",
                   help="run as the one rank that RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                        "name (as scripts/netbed starts it), gloo on IFNAME")
    args = p.parse_args()
    if args.from_env:
        rank, args.world, master_addr, port = rank_from_env()
        run_rank(rank, args, port, master_addr, args.from_env)
        return
    spawn(run_rank, args.world, args)


if __name__ == "__main__":
    main()
