"""Shared by the PyTorch baselines: local ranks joined in a gloo process group on loopback."""
import contextlib
import os
import socket


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank, world, port):
    """One intra-op thread, and a gloo process group on loopback for the duration of the block."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # Keep gloo on loopback even where the host name resolves to another interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield dist
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(run_rank, world, args):
    """Runs run_rank(rank, args, port) in `world` processes and waits for them."""
    import torch.multiprocessing as mp

    mp.spawn(run_rank, args=(args, free_port()), nprocs=world, join=True)
