"""Shared by the PyTorch baselines: local ranks joined in a gloo process group on loopback."""
import contextlib
import ctypes
import os
import socket


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_compute_thread(torch):
    """One compute thread, as troupe's set_compute_threads(1) gives its side: torch's intra-op
    threads, and OpenBLAS's own pool (a thread per core otherwise), which torch.set_num_threads
    does not reach, where the BLAS is OpenBLAS."""
    torch.set_num_threads(1)
    try:
        ctypes.CDLL("libblas.so.3", mode=os.RTLD_NOLOAD).openblas_set_num_threads(1)
    except (OSError, AttributeError):
        pass  # no libblas.so.3 loaded, or not OpenBLAS: nothing more to set


@contextlib.contextmanager
def gloo_group(rank, world, port, master_addr="127.0.0.1", ifname="lo"):
    """One intra-op thread, and a gloo process group (on loopback unless told otherwise) for the
    duration of the block."""
    import torch
    import torch.distributed as dist

    one_compute_thread(torch)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(port)
    # Keep gloo on that interface even where the host name resolves to another one.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
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


def rank_from_env():
    """(rank, world, master_addr, master_port) of a rank started by a launcher (troupe launch,
    torchrun, scripts/netbed) through RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT."""
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError) as e:
        raise SystemExit(f"--from-env: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set "
                         f"to integers and an address ({e!r})")
