"""PyTorch on an NVIDIA GPU, the peer of our cuda backend's compute-only figures (bench/train_step and
bench/embed_step with --backend cuda; scripts/device-run.sh and bench/gpu_bench.sh run them side by
side on the same GPU):

  train: torchvision's model (resnet50 by default), random images, cross-entropy, SGD momentum 0.9,
         one optimizer step per batch (zero_grad, forward, loss, backward, step), as train_step.
  embed: the class-token features of a ViT (uni: timm's vit_large_patch16_224 with LayerScale
         init_values 1e-5 and no head, UNI's architecture; vit_l_16 / vit_b_16: torchvision's),
         random weights; each step uploads a host batch and downloads the features, as embed_step.

Precisions, as our --precision: fp32 (TF32 off: cuDNN/cuBLAS FP32 math, as ours at fp32); tf32
(allow_tf32 on for cuDNN and matmuls); bf16 and fp16 under torch.autocast (fp16 training with
GradScaler). autocast also keeps activations in 16 bits, which ours does not (our activations are
f32 at every precision). cudnn.benchmark is on. Prints the median images/s over the timed steps
after two warm-up steps:

  peer: PyTorch 2.11.0 mode=train model=resnet50 precision=tf32 batch=128 images_per_s=1234.5

usage: torch_gpu_peer.py train|embed [--model M] [--batch N] [--size 224] [--steps 10] [--precision P[,P...]]
"""
import argparse
import contextlib
import statistics
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=("train", "embed"))
ap.add_argument("--model", default=None)
ap.add_argument("--batch", type=int, default=None)
ap.add_argument("--size", type=int, default=224)
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--precision", default="fp32",
                help="fp32, tf32, bf16 or fp16, or several separated by commas (one line each, one process)")
ap.add_argument("--device", default="cuda", help="cuda (the figure); cpu checks this script where there is no GPU")
a = ap.parse_args()
model = a.model or ("resnet50" if a.mode == "train" else "uni")
batch = a.batch or (128 if a.mode == "train" else 64)
precisions = a.precision.split(",")
for p in precisions:
    if p not in ("fp32", "tf32", "bf16", "fp16"):
        ap.error("--precision %s is not one of fp32, tf32, bf16, fp16" % p)
torch.backends.cudnn.benchmark = True
dev = torch.device(a.device)
torch.manual_seed(0)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run(precision):
    """The median seconds of a step (train) or a batch (embed) at `precision`."""
    tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(dev.type, dtype=half) if half is not None else contextlib.nullcontext()
    times = []
    if a.mode == "train":
        import torchvision
        m = getattr(torchvision.models, model)(num_classes=3).to(dev)
        x = torch.randn(batch, 3, a.size, a.size, device=dev)
        y = torch.randint(0, 3, (batch,), device=dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        scaler = (torch.amp.GradScaler("cuda", enabled=precision == "fp16") if hasattr(torch.amp, "GradScaler")
                  else torch.cuda.amp.GradScaler(enabled=precision == "fp16"))
        lossf = torch.nn.CrossEntropyLoss()
        for _ in range(a.steps + 2):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = lossf(m(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sync()
            times.append(time.perf_counter() - t0)
    else:
        if model == "uni":
            import timm
            m = timm.create_model("vit_large_patch16_224", img_size=a.size, init_values=1e-5, num_classes=0)
        else:
            import torchvision
            m = getattr(torchvision.models, model)(image_size=a.size)
            m.heads = torch.nn.Identity()
        m = m.to(dev).eval()
        x = torch.randn(batch, 3, a.size, a.size)
        with torch.inference_mode():
            for _ in range(a.steps + 2):
                sync()
                t0 = time.perf_counter()
                with autocast:
                    f = m(x.to(dev))
                f.float().cpu()
                times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


for p in precisions:
    seconds = run(p)
    print("peer: PyTorch %s mode=%s model=%s precision=%s batch=%d images_per_s=%.1f"
          % (torch.__version__.split("+")[0], a.mode, model, p, batch, batch / seconds), flush=True)
