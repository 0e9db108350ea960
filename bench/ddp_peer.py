#!/usr/bin/python3
"""The peer for bench/dist_bench.sh: PyTorch DistributedDataParallel (gloo, CPU) training steps of a
torchvision model on random tiles, with the same global batch split over the ranks.

usage: ddp_peer.py --ranks P --threads T [--model resnet18] [--batch 32] [--size 112] [--steps 6]
prints one line: ranks=P threads=T images_per_s=R (global images per second, median of the timed
steps after one warm-up step; ranks started with torch.multiprocessing on this machine)
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision


def worker(rank, a, port, out):
    torch.set_num_threads(a.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=3)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if a.ranks > 1 else model
    per_rank = a.batch // a.ranks + (1 if rank < a.batch % a.ranks else 0)
    x = torch.randn(per_rank, 3, a.size, a.size)
    y = torch.randint(0, 3, (per_rank,))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(a.steps + 1):
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        loss(ddp(x), y).backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t)
    if rank == 0:
        out.put(a.batch / statistics.median(times[1:]))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, a, port, out)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    ips = out.get()
    for p in procs:
        p.join()
    print("ranks=%d threads=%d images_per_s=%.2f" % (a.ranks, a.threads, ips))


if __name__ == "__main__":
    main()
