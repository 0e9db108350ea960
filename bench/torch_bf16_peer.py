"""PyTorch's bf16 inference on the CPU, the peer of slide-embed --precision bf16 (bench/embed_bench.sh):
torchvision's model under torch.autocast("cpu", bfloat16), which runs convolutions and matrix
products in bf16 through oneDNN (mkldnn) on CPUs with bf16 instructions. The same models and cut
as ../shared/peers/torch_peer.py embed (resnet50: CLAM's truncated ResNet-50, layer3 + global
average pooling; vit_b_16 / vit_l_16: class-token features), random weights and images; prints the
median images/s over the timed batches (the first is warm-up), in torch_peer.py's format.

usage: torch_bf16_peer.py --model resnet50|vit_b_16|vit_l_16 [--batch 16] [--size 224] [--threads 2] [--steps 3]
"""
import argparse
import time

import torch
import torchvision

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="resnet50")
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--size", type=int, default=224)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--steps", type=int, default=3)
a = ap.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(0)
if a.model == "resnet50":
    r = torchvision.models.resnet50()
    m = torch.nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2, r.layer3,
                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    m.eval()
else:
    m = getattr(torchvision.models, a.model)(image_size=a.size)
    m.heads = torch.nn.Identity()  # the class token's features
    # torch 1.13's eval-mode fast path of MultiheadAttention fails under autocast ("expected scalar
    # type BFloat16 but found Float"); in train mode it is not taken, and every dropout of
    # torchvision's ViT is 0, so the outputs are the same.
    m.train()
x = torch.randn(a.batch, 3, a.size, a.size)
times = []
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    for _ in range(a.steps + 1):
        t0 = time.perf_counter()
        m(x)
        times.append(time.perf_counter() - t0)
timed = sorted(times[1:])
print("mode=embed model=%s precision=bf16 batch=%d size=%d threads=%d images_per_s=%.2f"
      % (a.model, a.batch, a.size, a.threads, a.batch / timed[len(timed) // 2]))
