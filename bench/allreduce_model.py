#!/usr/bin/python3
"""Data-parallel scaling on paper: the gradient all-reduce of ResNet-50 on 8 GPUs over NVLink, over
100 Gb/s between nodes, and at 64 and 512 GPUs, against the step's compute time, by the ring
all-reduce cost model. Prints one table; every constant is an argument, with its source below.

Model (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
IJHPCA 2005; Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009): a ring all-reduce of n bytes over p ranks sends 2 (p - 1) / p x n bytes
through each rank's slowest link in 2 (p - 1) steps:
    T_ring(p, n) = 2 (p - 1) alpha + 2 (p - 1) / p x n / beta
(NCCL's all_reduce_perf reports beta as "busbw" = algbw x 2 (p - 1) / p, the same factor). With g
GPUs per node the all-reduce is hierarchical, as NCCL does across nodes: a ring inside the node over
NVLink, and between the N = p / g nodes a ring over the network carrying each node's whole gradient
through its NIC:
    T(p) = T_ring(g, n) over NVLink + T_ring(N, n) over the network.
Efficiency at p GPUs = t_compute / (t_compute + t_exposed), with t_exposed = T (no overlap), or
max(T x bucket / n, T - f_backward x t_compute) when buckets are all-reduced while backward runs
(PyTorch DDP, and what our Communicator's all_reduce_async is for): backward is about 2/3 of a
step's FLOPs, and the last bucket (the first layers' gradients, ready only at the end of backward)
is never hidden.
The ring's latency term grows linearly in p: at 512 GPUs NCCL switches to trees (log p latency),
so the 512-GPU ring row is pessimistic on latency and exact on bandwidth.

usage: bench/allreduce_model.py [--params N] [--step-ms 85] [--nvlink-gbs 360] [--net-gbits 100] ...
"""
import argparse


def ring_s(p, n_bytes, alpha_s, beta_bytes_s):
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * n_bytes / beta_bytes_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--params", type=int, default=0,
                    help="parameter count (default: torchvision's model, else 25,557,032 for ResNet-50, "
                         "torchvision's documented count)")
    ap.add_argument("--bytes-per-param", type=int, default=4, help="gradient element size: 4 (f32), 2 (f16/bf16)")
    ap.add_argument("--step-ms", type=float, default=85.0,
                    help="compute time of one step on one GPU (assumed: per-GPU batch 256 at ~3000 img/s, "
                         "ResNet-50 mixed precision on an H100; pass a measured figure)")
    ap.add_argument("--backward-fraction", type=float, default=2 / 3)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket, MiB (PyTorch DDP's bucket_cap_mb)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nvlink-gbs", type=float, default=360.0,
                    help="NVLink bus bandwidth per GPU, GB/s (H100 SXM: 900 GB/s bidirectional = 450 GB/s each "
                         "way, NVIDIA H100 datasheet; 80%% of it achieved)")
    ap.add_argument("--nvlink-alpha-us", type=float, default=3.0, help="per ring step inside a node, us (assumed)")
    ap.add_argument("--net-gbits", type=float, default=100.0, help="network per node, Gb/s (the issue's 100 Gb/s)")
    ap.add_argument("--net-efficiency", type=float, default=0.9, help="fraction of line rate achieved (assumed)")
    ap.add_argument("--net-alpha-us", type=float, default=10.0, help="per ring step between nodes, us (assumed; RDMA)")
    ap.add_argument("--rig", metavar="FILE",
                    help="check the model against measurements instead: FILE has lines 'RANKS GBITS BYTES MS' "
                         "(one all-reduce of BYTES over RANKS ranks on a GBITS Gb/s link took MS ms; "
                         "bench/allreduce_rig.sh writes it); prints the model's time at line rate "
                         "(--net-efficiency 1) and with --net-alpha-us per step, and measured / model")
    a = ap.parse_args()
    if a.rig:
        check_rig(a.rig, a.net_alpha_us * 1e-6)
        return

    params = a.params
    if params == 0:
        try:
            import torchvision
            params = sum(p.numel() for p in getattr(torchvision.models, a.model)().parameters())
        except Exception:
            params = 25557032
    n = params * a.bytes_per_param
    t_c = a.step_ms / 1000
    nv = a.nvlink_gbs * 1e9
    net = a.net_gbits / 8 * 1e9 * a.net_efficiency
    g = a.gpus_per_node
    print("%s: %d parameters, %.1f MB of gradients all-reduced per step; compute %.0f ms per step per GPU"
          % (a.model, params, n / 1e6, a.step_ms))
    print("ring all-reduce: NVLink %.0f GB/s, alpha %.0f us; network %.0f Gb/s x %.0f%% = %.2f GB/s per node, alpha %.0f us"
          % (a.nvlink_gbs, a.nvlink_alpha_us, a.net_gbits, 100 * a.net_efficiency, net / 1e9, a.net_alpha_us))
    print("%-34s %6s %11s %13s %15s" % ("layout", "GPUs", "all-reduce", "efficiency", "eff. overlapped"))
    rows = [("1 node, 8 GPUs over NVLink", 8, 8, 1),
            ("8 nodes x 1 GPU over 100 Gb/s", 8, 1, 8),
            ("8 nodes x 8 GPUs (NVLink + net)", 64, g, 64 // g),
            ("64 nodes x 8 GPUs (NVLink + net)", 512, g, 512 // g)]
    for name, p, per_node, nodes in rows:
        t = ring_s(per_node, n, a.nvlink_alpha_us * 1e-6, nv) + ring_s(nodes, n, a.net_alpha_us * 1e-6, net)
        eff = t_c / (t_c + t)
        last_bucket = t * min(1.0, a.bucket_mb * 2**20 / n)
        eff_overlap = t_c / (t_c + max(last_bucket, t - a.backward_fraction * t_c))
        print("%-34s %6d %8.1f ms %12.1f%% %14.1f%%" % (name, p, 1000 * t, 100 * eff, 100 * eff_overlap))


def check_rig(path, alpha_s):
    """The ring model at line rate against measured all-reduces (the two-host rig): the model is the
    bound a network-limited ring can reach, so model / measured is the fraction of the link used."""
    print("%6s %8s %12s %12s %12s %10s" % ("ranks", "Gb/s", "MB", "measured ms", "model ms", "of model"))
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            p, gbits, n_bytes, ms = line.split()
            p, gbits, n_bytes, ms = int(p), float(gbits), float(n_bytes), float(ms)
            model = 1000 * ring_s(p, n_bytes, alpha_s, gbits / 8 * 1e9)
            print("%6d %8g %12.1f %12.2f %12.2f %9.0f%%" % (p, gbits, n_bytes / 1e6, ms, model, 100 * model / ms))


if __name__ == "__main__":
    main()
