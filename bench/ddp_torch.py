#!/usr/bin/python3
"""Peer baseline: PyTorch DistributedDataParallel step time (gloo, loopback, CPU).

The figure to compare with `troupe bench ddp`. Each rank trains the same MLP
(784-2048-2048-1024-10, ReLU, float32, 7.9M parameters) with SGD (lr 0.01, momentum 0.9) on
one fixed random batch [B, 784] with random labels 0..9 (seed SEED + rank), loss
nll_loss(log_softmax(output)), one intra-op thread per rank.

  --world 1   no DistributedDataParallel and no process group: forward, backward and optimizer
              step alone -- the compute-only baseline that overheads are measured against.
  --world N   N processes on 127.0.0.1 (gloo), the model wrapped in
              torch.nn.parallel.DistributedDataParallel (default bucket_cap_mb 25).
  --compute-only  with --world N: N processes on 127.0.0.1 each train the plain model at once,
              with no DistributedDataParallel (gloo only to report the slowest rank): the
              baseline that leaves only the cost of DDP in a world-N figure.
  --hook H    a DDP communication hook (world > 1): none (plain allreduce), fp16
              (default_hooks.fp16_compress_hook), or powersgd (powerSGD_hook.powerSGD_hook,
              matrix_approximation_rank --rank, start_powerSGD_iter 2, warm start and error
              feedback on: its defaults).

  --device D  cpu (default) or cuda: the model, its batch and (with DDP) its buckets on that device;
              every rank on the same GPU (the two-processes-on-one-GPU case that troupe's
              `bench ddp --device cuda` also runs), gloo moving the CUDA tensors, and each timed
              step ending with torch.cuda.synchronize().

  --interleave  with --world N: every iteration runs, each after a barrier and in an order that
              rotates with the iteration, a DDP step; a compute step (every rank under
              model.no_sync(), then its optimizer step: all ranks computing at once, nothing
              reduced); and an alone step (rank 0 as in a compute step while the others wait at
              the next barrier). Each iteration's figure is the slowest rank's (the alone step's
              is rank 0's); overheads are the medians over iterations of the paired ratios, as
              `troupe bench ddp --interleave` reports them. JSON adds compute_step_sec,
              alone_step_sec, overhead_vs_alone, overhead_vs_compute, backward_sec and
              compute_backward_sec.

A step is zero_grad, forward, loss, backward, optimizer step, timed with time.perf_counter in a
loop with no barriers. The first 5 steps are warm-up and not counted. Each rank takes the median
of its S step times; step_sec is the largest of those medians over ranks (rank 0's own median is
shown in the human-readable line). With --json the output is exactly one JSON object:
{"impl": "torch_ddp", "hook": H, "world": N, "model": "mlp", "batch": B, "steps": S,
 "step_sec": sec}

    /usr/bin/python3 bench/ddp_torch.py --world 2 --model mlp --batch 64 --steps 50 [--json]
"""

import argparse
import json
import statistics
import sys
import time

from gloo_job import gloo_group, one_compute_thread, spawn

MODELS = ("mlp", "cnn")
WARMUP_STEPS = 5
SEED = 1234
IN_FEATURES = 784
CLASSES = 10


def positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}': expected a positive integer")
    return value



def build_mlp(torch):
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 1024), nn.ReLU(),
        nn.Linear(1024, CLASSES),
    )


def build_cnn(torch):
    """The Fashion-MNIST CNN of examples/fashion_mnist (206,922 parameters)."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, CLASSES),
    )


def build_model(torch, name):
    return build_cnn(torch) if name == "cnn" else build_mlp(torch)


def input_shape(name, batch):
    return (batch, 1, 28, 28) if name == "cnn" else (batch, IN_FEATURES)


def finish_device_work(torch, device):
    """Waits for the kernels queued on a GPU (a CPU step has none in flight)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workload(torch, model, batch, rank, name="mlp", device="cpu"):
    """The optimizer (SGD, momentum) and a function returning the loss on one fixed random batch."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(SEED + rank)
    inputs = torch.randn(*input_shape(name, batch), generator=generator,
                         dtype=torch.float32).to(device)
    labels = torch.randint(0, CLASSES, (batch,), generator=generator).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return optimizer, lambda: F.nll_loss(F.log_softmax(model(inputs), dim=1), labels)


def train_and_time(torch, model, batch, steps, rank, name, device):
    """Per-step seconds of `steps` timed steps (after WARMUP_STEPS untimed ones)."""
    optimizer, loss_of_batch = workload(torch, model, batch, rank, name, device)

    def step():
        optimizer.zero_grad()
        loss_of_batch().backward()
        optimizer.step()
        finish_device_work(torch, device)

    for _ in range(WARMUP_STEPS):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def interleaved(torch, dist, model, args, rank):
    """Per-iteration seconds of the three interleaved kinds of step, the slowest rank's."""
    import contextlib

    device = torch.device(args.device)
    optimizer, loss_of_batch = workload(torch, model, args.batch, rank, args.model, device)
    kinds = ("dp", "compute", "alone")

    def run(kind):
        dist.barrier()
        if kind == "alone" and rank != 0:
            return 0.0, 0.0  # waits at the next barrier
        start = time.perf_counter()
        optimizer.zero_grad()
        with (model.no_sync() if kind != "dp" else contextlib.nullcontext()):
            loss = loss_of_batch()
            backward_start = time.perf_counter()
            loss.backward()
            backward_sec = time.perf_counter() - backward_start
        optimizer.step()
        finish_device_work(torch, device)
        return time.perf_counter() - start, backward_sec

    seconds = {kind: [] for kind in kinds}
    backward = {kind: [] for kind in kinds}
    for i in range(WARMUP_STEPS + args.steps):
        for k in range(3):
            kind = kinds[(i + k) % 3]
            sec, back = run(kind)
            if i >= WARMUP_STEPS:
                seconds[kind].append(sec)
                backward[kind].append(back)
    flat = [x for kind in kinds for x in seconds[kind]] + backward["dp"] + backward["compute"]
    slowest = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    n = args.steps
    out = {kind: values[j * n:(j + 1) * n] for j, kind in enumerate(kinds)}
    out["dp_backward"] = values[3 * n:4 * n]
    out["compute_backward"] = values[4 * n:5 * n]
    return out


def report_interleaved(args, runs):
    med = statistics.median

    def paired(a, b):
        return med(x / y - 1 for x, y in zip(runs[a], runs[b]))

    record = {"impl": "torch_ddp", "hook": args.hook, "world": args.world, "interleave": True,
              "device": args.device,
              "model": args.model, "batch": args.batch, "steps": args.steps,
              "step_sec": med(runs["dp"]), "compute_step_sec": med(runs["compute"]),
              "alone_step_sec": med(runs["alone"]),
              "overhead_vs_alone": paired("dp", "alone"),
              "overhead_vs_compute": paired("dp", "compute"),
              "backward_sec": med(runs["dp_backward"]),
              "compute_backward_sec": med(runs["compute_backward"])}
    if args.json:
        print(json.dumps(record), flush=True)
        return
    print(f"torch DDP (gloo, hook {args.hook}), interleaved: world {args.world}, model "
          f"{args.model}, batch {args.batch}, {args.steps} iterations: median step "
          f"{record['step_sec'] * 1e3:.2f} ms DDP, {record['compute_step_sec'] * 1e3:.2f} ms "
          f"every rank computing alone, {record['alone_step_sec'] * 1e3:.2f} ms rank 0 alone; "
          f"paired per iteration, DDP costs {record['overhead_vs_alone'] * 100:+.1f}% over rank 0 "
          f"alone and {record['overhead_vs_compute'] * 100:+.1f}% over every rank computing "
          "alone", flush=True)


def report(args, step_sec, rank0_sec, params):
    if args.json:
        print(json.dumps({"impl": "torch_ddp", "hook": args.hook, "world": args.world,
                          "compute_only": args.world == 1 or args.compute_only,
                          "device": args.device,
                          "model": args.model,
                          "batch": args.batch, "steps": args.steps, "step_sec": step_sec}),
              flush=True)
        return
    import torch
    mode = ("compute alone (no DDP, no process group)" if args.world == 1
            else "compute alone on every rank (no DDP)" if args.compute_only
            else f"DistributedDataParallel, gloo, loopback, hook {args.hook}")
    print(f"torch {torch.__version__} {mode}: world {args.world}, model {args.model} "
          f"({params / 1e6:.1f}M params), batch {args.batch}, {args.steps} steps "
          f"(+{WARMUP_STEPS} warm-up), 1 thread per rank: "
          f"step_sec {step_sec * 1e3:.2f} ms (max over ranks of the median), "
          f"rank 0 median {rank0_sec * 1e3:.2f} ms", flush=True)


def register_hook(torch, model, args):
    if args.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=args.rank,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def run_alone(args):
    import torch

    one_compute_thread(torch)
    torch.manual_seed(SEED)
    device = torch.device(args.device)
    model = build_model(torch, args.model).to(device)
    params = sum(p.numel() for p in model.parameters())
    median = statistics.median(train_and_time(torch, model, args.batch, args.steps, 0, args.model,
                                              device))
    report(args, median, median, params)


def run_rank(rank, args, port):
    import torch

    with gloo_group(rank, args.world, port) as dist:
        torch.manual_seed(SEED + rank)  # DDP broadcasts rank 0's parameters at construction
        device = torch.device(args.device)
        model = build_model(torch, args.model).to(device)
        if not args.compute_only:
            model = torch.nn.parallel.DistributedDataParallel(model)
            register_hook(torch, model, args)
        if args.interleave:
            runs = interleaved(torch, dist, model, args, rank)
            if rank == 0:
                report_interleaved(args, runs)
            return
        params = sum(p.numel() for p in model.parameters())
        median = statistics.median(train_and_time(torch, model, args.batch, args.steps, rank,
                                                  args.model, device))
        slowest = torch.tensor([median], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            report(args, slowest.item(), median, params)


def main():
    parser = argparse.ArgumentParser(
        description="PyTorch DistributedDataParallel step time, gloo on loopback (peer "
                    "baseline for `troupe bench ddp`); --world 1 is compute alone, no DDP")
    parser.add_argument("--world", type=positive_int, default=2,
                        help="number of ranks (processes); 1 = no DDP, compute alone")
    parser.add_argument("--model", default="mlp",
                        help="model: 'mlp' (784-2048-2048-1024-10) or 'cnn' (the Fashion-MNIST "
                             "CNN: conv16, conv32, fc128, fc10; inputs 1x28x28)")
    parser.add_argument("--batch", type=positive_int, default=64, help="samples per rank")
    parser.add_argument("--steps", type=positive_int, default=50,
                        help=f"timed steps (after {WARMUP_STEPS} warm-up steps)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
    parser.add_argument("--compute-only", action="store_true",
                        help="with --world N: every rank trains alone, no DDP (the baseline)")
    parser.add_argument("--interleave", action="store_true",
                        help="with --world N: alternate DDP, compute-only and rank-0-alone steps "
                             "in one job and pair them per iteration")
    parser.add_argument("--hook", default="none", choices=("none", "fp16", "powersgd"),
                        help="DDP communication hook (world > 1)")
    parser.add_argument("--rank", type=positive_int, default=2,
                        help="PowerSGD matrix_approximation_rank")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where every rank trains (cuda: all on the one current GPU)")
    args = parser.parse_args()
    if args.model not in MODELS:
        parser.error(f"--model '{args.model}': unknown model; expected one of: "
                     f"{', '.join(MODELS)}")

    if args.interleave and (args.world < 2 or args.compute_only):
        parser.error(f"--interleave needs --world >= 2 and no --compute-only (got --world "
                     f"{args.world}{' with --compute-only' if args.compute_only else ''})")
    if args.world == 1:
        run_alone(args)
        return 0
    spawn(run_rank, args.world, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
