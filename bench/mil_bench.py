#!/usr/bin/python3
"""slide-train --features (ABMIL, gated attention) against the same model in PyTorch, in one run.

CLAM_SB's sizes (D = 1024 features per tile, as ResNet-50 layer3; fc 512; gated attention 256;
2 classes), AdamW, one bag per step, bags of N tiles. Timing only: the bags hold random features
(speed does not depend on the values), written in slide/cache/bag.h's layout with h5py. Both
train from RAM (slide-train --cache ram; PyTorch tensors) on the same thread count; the second
epoch is timed (the first pays for oneDNN's kernel generation). Prints bags/s and tiles/s of
each, the ratio, and the GFLOP/s each reaches beside the machine's oneDNN sgemm peak on the same
threads (bench/sgemm_peak): Debian's PyTorch links a generic BLAS, so for this Linear-bound model
the fraction of peak is the fairer figure. FLOPs per bag: 2 x (2 N D L [fc forward and weight
gradient; no input gradient] + 3 x 2 N L A [the gates: forward, data and weight gradients]
+ 3 x 2 N L [pooling, attention_c]), the classifier negligible.

usage: bench/mil_bench.py [--build build] [--bags 24] [--tiles 4000] [--threads 2]
(needs Debian's python3-torch and python3-h5py)
"""
import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import h5py
import numpy as np
import torch

D, L, A, C = 1024, 512, 256, 2


class GatedAbmil(torch.nn.Module):
    """CLAM_SB's attention_net + classifiers (Lu et al. 2021; Ilse et al. 2018, eq. 9)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Sequential(torch.nn.Linear(D, L), torch.nn.ReLU())
        self.attention_a = torch.nn.Sequential(torch.nn.Linear(L, A), torch.nn.Tanh())
        self.attention_b = torch.nn.Sequential(torch.nn.Linear(L, A), torch.nn.Sigmoid())
        self.attention_c = torch.nn.Linear(A, 1)
        self.classifiers = torch.nn.Linear(L, C)

    def forward(self, x):
        h = self.fc(x)
        a = torch.softmax(self.attention_c(self.attention_a(h) * self.attention_b(h)).T, dim=1)
        return self.classifiers(a @ h)


def peer_epoch(bags, labels):
    model = GatedAbmil()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=1e-5)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        for x, y in zip(bags, labels):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return times[-1]


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--build", default=os.path.join(here, "build"))
    ap.add_argument("--bags", type=int, default=24)
    ap.add_argument("--tiles", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    tmp = tempfile.mkdtemp(prefix="mil_bench_")
    try:
        rng = np.random.default_rng(0)
        feats, labels = [], []
        for b in range(args.bags):
            x = rng.standard_normal((args.tiles, D), dtype=np.float32)
            with h5py.File(os.path.join(tmp, f"b{b:03d}.h5"), "w") as f:
                f.create_dataset("features", data=x, chunks=(256, D), maxshape=(None, D))
                f.create_dataset("coords", data=np.zeros((args.tiles, 2), np.int32), chunks=(256, 2), maxshape=(None, 2))
                f.attrs["slide_id"] = f"b{b:03d}"
                f.attrs["label"] = "ab"[b % 2]
                f.attrs["feature_dim"] = np.int32(D)
                f.attrs["format_version"] = np.int32(1)
            feats.append(torch.from_numpy(x))
            labels.append(torch.tensor([b % 2]))
        out = os.path.join(tmp, "out")
        r = subprocess.run([os.path.join(args.build, "apps", "slide-train"), "--features", tmp, "--out", out,
                            "--epochs", "2", "--val-fraction", "0", "--cache", "ram", "--no-attention", "--lr", "2e-4",
                            "--mil-hidden", str(L), "--mil-attention", str(A), "-q"],
                           capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            ours = json.loads(f.read().splitlines()[-1])["seconds"]
        peer = peer_epoch(feats, labels)
        n = args.bags
        flops = 2.0 * args.tiles * (2 * D * L + 6 * L * A + 6 * L) * n
        peak_bin = os.path.join(args.build, "bench", "sgemm_peak")
        peak = ""
        if os.path.exists(peak_bin):
            g = float(subprocess.run([peak_bin], capture_output=True, text=True, env=env).stdout.split("gflops=")[1])
            peak = (f"   GFLOP/s {flops / ours / 1e9:.1f} vs {flops / peer / 1e9:.1f} of sgemm peak {g:.1f} "
                    f"({100 * flops / ours / 1e9 / g:.0f}% vs {100 * flops / peer / 1e9 / g:.0f}%)")
        print(f"ABMIL D={D} L={L} A={A}, {n} bags x {args.tiles} tiles, {args.threads} threads, AdamW, 1 bag/step: "
              f"slide-train {n / ours:6.2f} bags/s ({n * args.tiles / ours:8.0f} tiles/s)   "
              f"pytorch {n / peer:6.2f} bags/s ({n * args.tiles / peer:8.0f} tiles/s)   ratio {peer / ours:.2f}x" + peak)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
