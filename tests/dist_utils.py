"""Run a function on N gloo processes on loopback (real torch.distributed, no mocks)."""

import os
import pickle
import queue as queue_module
import time
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue, pg_timeout_s):
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s))
    try:
        queue.put((rank, ("ok", pickle.dumps(fn(rank, world, *args)))))  # plain bytes: no shared-memory handles
    except BaseException:
        queue.put((rank, ("error", traceback.format_exc())))
    finally:
        dist.destroy_process_group()


ERROR_GRACE_S = 30  # after a rank fails, how long its peers get to finish before they are killed


def run_distributed(fn, world: int, *args, timeout: float = 120, pg_timeout_s: float = 300) -> list:
    """fn(rank, world, *args) on `world` processes; returns the per-rank results in rank order.

    pg_timeout_s: how long a collective waits for a missing peer before it raises (torch.distributed's timeout)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, pg_timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        try:
            rank, out = queue.get(timeout=1.0)
            results[rank] = out
            if out[0] == "error":  # its peers may now wait on it in a collective: give them ERROR_GRACE_S to end
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                    p.join(timeout=10)
                if _errors(results):
                    raise RuntimeError("\n".join([*_errors(results), "(the other ranks, waiting on it, were killed)"]))
                raise RuntimeError(f"ranks {dead or 'all'} died or timed out after {timeout}s without a result")
    for p in procs:
        p.join(timeout=timeout)
    if _errors(results):
        raise RuntimeError("\n".join(_errors(results)))
    return [pickle.loads(results[r][1]) for r in range(world)]


def _errors(results: dict) -> list[str]:
    """"rank R:\n<traceback>" of every rank that reported an error, in rank order."""
    return [f"rank {r}:\n{out}" for r, (status, out) in sorted(results.items()) if status == "error"]


def _nccl_entry(rank, world, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        queue.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_nccl(fn, world: int, *args, timeout: float = 600) -> list:
    """fn(rank, world, *args) on `world` GPUs under nccl (GPU tests only); per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_nccl_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {r: (s, out) for r, s, out in (queue.get(timeout=timeout) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    errors = [f"rank {r}:\n{out}" for r, (s, out) in sorted(results.items()) if s == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [pickle.loads(results[r][1]) for r in range(world)]
