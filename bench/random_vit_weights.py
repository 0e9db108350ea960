#!/usr/bin/env python3
"""Writes a random ViT weight file in timm's layout at a named preset's shapes, for benchmarks that
need the published encoders' sizes but not their (gated) values: speed does not depend on them.

    bench/random_vit_weights.py PRESET OUT.safetensors

PRESET: uni (timm vit_large_patch16_224 with init_values, i.e. layer scale: UNI's model card) or
vit-b16 (vit_base_patch16_224). The shapes match libtrain/src/vit.cpp's presets; slide-embed refuses
a file that does not. Needs numpy only (the writer is tests/e2e/safetensors_io.py); f32, about 1.2 GB
for uni.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
from safetensors_io import write_safetensors  # noqa: E402

PRESETS = {
    # width, depth, MLP hidden, patch, image, layer scale
    "uni": (1024, 24, 4096, 16, 224, True),
    "vit-b16": (768, 12, 3072, 16, 224, False),
}


def weights(preset, seed=0):
    D, depth, M, P, image, layer_scale = PRESETS[preset]
    g = np.random.default_rng(seed)
    r = lambda *s: (0.02 * g.standard_normal(s, dtype=np.float32))  # noqa: E731
    G = image // P
    w = {"cls_token": r(1, 1, D), "pos_embed": r(1, G * G + 1, D),
         "patch_embed.proj.weight": r(D, 3, P, P), "patch_embed.proj.bias": r(D),
         "norm.weight": 1 + r(D), "norm.bias": r(D)}
    for i in range(depth):
        b = "blocks.%d." % i
        w.update({b + "norm1.weight": 1 + r(D), b + "norm1.bias": r(D), b + "attn.qkv.weight": r(3 * D, D),
                  b + "attn.qkv.bias": r(3 * D), b + "attn.proj.weight": r(D, D), b + "attn.proj.bias": r(D),
                  b + "norm2.weight": 1 + r(D), b + "norm2.bias": r(D), b + "mlp.fc1.weight": r(M, D),
                  b + "mlp.fc1.bias": r(M), b + "mlp.fc2.weight": r(D, M), b + "mlp.fc2.bias": r(D)})
        if layer_scale:
            w[b + "ls1.gamma"], w[b + "ls2.gamma"] = 1e-5 + r(D), 1e-5 + r(D)
    return w


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in PRESETS:
        sys.exit("usage: random_vit_weights.py {%s} OUT.safetensors" % ",".join(PRESETS))
    write_safetensors(sys.argv[2], weights(sys.argv[1]))


if __name__ == "__main__":
    main()
