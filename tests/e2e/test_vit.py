#!/usr/bin/python3
"""The Vision Transformer (libtrain/include/slide/train/vit.h) against PyTorch, on real tiles.

TestTorchvision: torchvision's VisionTransformer (the ViT-B/16 architecture family, here 2 blocks
of width 192 so that Debian's reference-BLAS PyTorch stays fast) with random weights, its
parameter names mapped to timm's, run on real H&E tiles (sample_data's LC25000 patches, ImageNet
normalisation): our features equal torchvision's within 1e-4 relative, on the cpu and reference
backends.
TestTimmVariants: the options the foundation models use (layer scale as UNI, register tokens,
class token + mean of patch tokens as Virchow, mean pooling with fc_norm, no_embed_class) against a
float64 PyTorch transcription of timm's VisionTransformer.forward_features + pooling written here.
TestBadWeights: a missing or misshapen tensor is refused, naming it.
TestSlideEmbed: slide-embed --model vit on real slides' tiles against the same reference; tiles of
another size resized as PIL's Image.resize(BICUBIC) (the resampler itself against PIL on real
tiles: max difference and fraction of values that differ printed), --image-size with the
positional embedding resampled as timm's resample_abs_pos_embed (against F.interpolate).

Environment: SLIDE_GOLDEN_VIT (the driver), SLIDE_SAMPLE_DIR.
"""
import glob
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

GOLDEN = os.environ["SLIDE_GOLDEN_VIT"]
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
MEAN = np.array([0.485, 0.456, 0.406], np.float32)
STD = np.array([0.229, 0.224, 0.225], np.float32)


def real_tiles(n, size):
    paths = sorted(glob.glob(os.path.join(SAMPLE, "patches", "lc25000-lung-subset", "*", "*.jpeg")) +
                   glob.glob(os.path.join(SAMPLE, "patches", "lc25000-lung-subset", "*", "*.jpg")))
    assert len(paths) >= n, "sample_data has %d LC25000 patches" % len(paths)
    out = []
    for p in paths[:n]:
        img = Image.open(p).convert("RGB").resize((size, size), Image.BICUBIC)
        a = (np.asarray(img, np.float32) / 255.0 - MEAN) / STD
        out.append(a.transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(out).astype(np.float32))


def run_resample_jobs(tmp, jobs):
    """Runs the C++ resamplers (tests/libtrain/test_resample.cpp, suite resample_io, in the
    libtrain doctest binary beside golden_vit) on `jobs`: lines 'rgb IN W H OW OH OUT' or
    'pos IN PREFIX G0 G1 D OUT' over raw little-endian files."""
    binary = os.path.join(os.path.dirname(GOLDEN), "libtrain_tests")
    job = os.path.join(tmp, "jobs.txt")
    with open(job, "w") as f:
        f.write("\n".join(jobs) + "\n")
    r = subprocess.run([binary, "--test-suite=resample_io"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, SLIDE_RESAMPLE_JOB=job))
    assert r.returncode == 0, r.stdout + r.stderr


def cpp_resize_rgb(tmp, tag, a, ow, oh):
    """BicubicResizer on an H x W x 3 uint8 array -> oh x ow x 3."""
    src, dst = os.path.join(tmp, tag + ".in"), os.path.join(tmp, tag + ".out")
    np.ascontiguousarray(a, np.uint8).tofile(src)
    run_resample_jobs(tmp, ["rgb %s %d %d %d %d %s" % (src, a.shape[1], a.shape[0], ow, oh, dst)])
    return np.fromfile(dst, np.uint8).reshape(oh, ow, 3)


def timm_resample_abs_pos_embed(pos, new_grid, prefix):
    """timm's resample_abs_pos_embed (timm/layers/pos_embed.py), transcribed: the prefix rows kept,
    the grid reshaped to [1, D, g0, g0], F.interpolate(size, mode='bicubic', antialias=True)
    (align_corners False), back to tokens."""
    t = torch.from_numpy(pos).float()
    pre, grid = t[:, :prefix], t[:, prefix:]
    g0, D = int(math.sqrt(grid.shape[1])), grid.shape[-1]
    grid = grid.reshape(1, g0, g0, D).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new_grid, new_grid), mode="bicubic", antialias=True, align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, D)
    return torch.cat([pre, grid], dim=1).numpy()


def tile_cmu(test, store, tile_px, max_tiles):
    """A raw store of at most `max_tiles` tiles of `tile_px` px of CMU-1-Small-Region at 4 um/px
    (slide-tile asserted to succeed)."""
    r = subprocess.run([os.environ["SLIDE_TILE"], os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp",
                        "4", "--tile-size", str(tile_px), "--encoding", "raw", "--max-tiles-per-slide", str(max_tiles),
                        "-o", store, "-q"], capture_output=True, text=True)
    test.assertEqual(r.returncode, 0, r.stderr)


def store_tiles(store):
    """The raw (--encoding raw) tiles of a slide-tile store, in order: [(H x W x 3 uint8, (x, y))]."""
    import lmdb
    env = lmdb.open(store, readonly=True, lock=False, max_dbs=4)
    tiles_db = env.open_db(b"tiles")
    out = []
    with env.begin() as txn:
        for _, v in txn.cursor(db=tiles_db):
            _, _, hdr, _, _, x, y, tw, th, _, enc, _, n = struct.unpack_from("<4sHHIiqqIIBBHI", v)
            assert enc == 0, "not a raw tile"
            out.append((np.frombuffer(v[hdr:hdr + n], np.uint8).reshape(th, tw, 3).copy(), (x, y)))
    env.close()
    return out


def normalise(tiles_u8, mean=MEAN, std=STD):
    return np.ascontiguousarray(np.stack([((a.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)
                                          for a in tiles_u8]).astype(np.float32))


def run_golden(tmp, backend, weights, images, cfg):
    inp, out = os.path.join(tmp, "images.safetensors"), os.path.join(tmp, "features.safetensors")
    write_safetensors(inp, {"images": images})
    args = [GOLDEN, backend, weights, inp, out, str(images.shape[0])] + ["%s=%s" % kv for kv in cfg.items()]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    return r, (read_safetensors(out)["features"] if r.returncode == 0 else None)


def rel_err(a, b):
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(1.0, float(np.max(np.abs(b)))))


def torchvision_to_timm(sd, depth):
    out = {"cls_token": sd["class_token"], "pos_embed": sd["encoder.pos_embedding"],
           "patch_embed.proj.weight": sd["conv_proj.weight"], "patch_embed.proj.bias": sd["conv_proj.bias"],
           "norm.weight": sd["encoder.ln.weight"], "norm.bias": sd["encoder.ln.bias"]}
    for i in range(depth):
        tv, tm = "encoder.layers.encoder_layer_%d." % i, "blocks.%d." % i
        for a, b in [("ln_1", "norm1"), ("ln_2", "norm2"), ("self_attention.out_proj", "attn.proj"),
                     ("mlp.0", "mlp.fc1"), ("mlp.3", "mlp.fc2")]:
            out[tm + b + ".weight"] = sd[tv + a + ".weight"]
            out[tm + b + ".bias"] = sd[tv + a + ".bias"]
        out[tm + "attn.qkv.weight"] = sd[tv + "self_attention.in_proj_weight"]
        out[tm + "attn.qkv.bias"] = sd[tv + "self_attention.in_proj_bias"]
    return {k: v.detach().numpy().astype(np.float32) for k, v in out.items()}


class TestTorchvision(unittest.TestCase):
    def test_features_equal_torchvision(self):
        torch.manual_seed(0)
        depth, width, heads, mlp = 2, 192, 3, 768
        model = torchvision.models.VisionTransformer(image_size=224, patch_size=16, num_layers=depth, num_heads=heads,
                                                     hidden_dim=width, mlp_dim=mlp)
        with torch.no_grad():  # torchvision zero-initialises some tensors; make every one matter
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.heads = torch.nn.Identity()
        model.eval()
        images = real_tiles(3, 224)
        with torch.no_grad():
            expected = model(torch.from_numpy(images)).double().numpy()
        tmp = tempfile.mkdtemp(prefix="vit_")
        try:
            weights = os.path.join(tmp, "vit.safetensors")
            write_safetensors(weights, torchvision_to_timm(model.state_dict(), depth))
            cfg = {"image": 224, "patch": 16, "width": width, "depth": depth, "heads": heads, "mlp": mlp}
            for backend in ("cpu", "reference"):
                with self.subTest(backend=backend):
                    r, got = run_golden(tmp, backend, weights, images, cfg)
                    self.assertEqual(r.returncode, 0, r.stderr)
                    self.assertEqual(got.shape, (3, width))
                    err = rel_err(got, expected)
                    print("torchvision ViT, %s backend: max relative error %.2e; %s" % (backend, err, r.stderr.strip()))
                    self.assertLess(err, 1e-4)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def timm_reference(p, x, cfg):
    """timm VisionTransformer.forward_features + pooling, in float64 (timm 1.0's
    vision_transformer.py: _pos_embed, Block = x + ls1(attn(norm1(x))) + ..., Attention with
    qkv.reshape(B, N, 3, H, Dh).permute(2, 0, 3, 1, 4), Mlp = fc2(GELU(fc1)), norm / fc_norm)."""
    t = {k: torch.from_numpy(v).double() for k, v in p.items()}
    D, H, eps = cfg["width"], cfg["heads"], 1e-6
    x = torch.from_numpy(x).double()
    B = x.shape[0]
    x = F.conv2d(x, t["patch_embed.proj.weight"], t["patch_embed.proj.bias"], stride=cfg["patch"])
    x = x.flatten(2).transpose(1, 2)
    prefix = []
    if cfg.get("class_token", 1):
        prefix.append(t["cls_token"].expand(B, -1, -1))
    if cfg.get("reg", 0):
        prefix.append(t["reg_token"].expand(B, -1, -1))
    if cfg.get("no_embed_class", 0):
        x = torch.cat(prefix + [x + t["pos_embed"]], dim=1)
    else:
        x = torch.cat(prefix + [x], dim=1) + t["pos_embed"]
    n_prefix = len(prefix) - (1 if cfg.get("reg", 0) else 0) + cfg.get("reg", 0)
    for i in range(cfg["depth"]):
        b = "blocks.%d." % i
        h = F.layer_norm(x, (D,), t[b + "norm1.weight"], t[b + "norm1.bias"], eps)
        qkv = F.linear(h, t[b + "attn.qkv.weight"], t[b + "attn.qkv.bias"])
        N = x.shape[1]
        q, k, v = qkv.reshape(B, N, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.softmax(q @ k.transpose(-2, -1) * (D // H) ** -0.5, dim=-1) @ v
        a = F.linear(a.transpose(1, 2).reshape(B, N, D), t[b + "attn.proj.weight"], t[b + "attn.proj.bias"])
        x = x + (a * t[b + "ls1.gamma"] if cfg.get("layer_scale", 0) else a)
        h = F.layer_norm(x, (D,), t[b + "norm2.weight"], t[b + "norm2.bias"], eps)
        f1 = F.linear(h, t[b + "mlp.fc1.weight"], t[b + "mlp.fc1.bias"])
        if cfg.get("swiglu", 0):  # timm GluMlp (SwiGLUPacked): x1, x2 = fc1(x).chunk(2); SiLU(x1) * x2
            x1, x2 = f1.chunk(2, dim=-1)
            f1 = F.silu(x1) * x2
        else:
            f1 = F.gelu(f1)
        m = F.linear(f1, t[b + "mlp.fc2.weight"], t[b + "mlp.fc2.bias"])
        x = x + (m * t[b + "ls2.gamma"] if cfg.get("layer_scale", 0) else m)
    pool = cfg.get("pool", "token")
    if not cfg.get("fc_norm", 0):
        x = F.layer_norm(x, (D,), t["norm.weight"], t["norm.bias"], eps)
    if pool == "tokens":  # forward_features' output, every token (CONCH's pooler takes it)
        return x
    mean = x[:, n_prefix:].mean(dim=1)
    if pool == "token":
        return x[:, 0].numpy()
    if pool == "mean":
        if cfg.get("fc_norm", 0):
            mean = F.layer_norm(mean, (D,), t["fc_norm.weight"], t["fc_norm.bias"], eps)
        return mean.numpy()
    return torch.cat([x[:, 0], mean], dim=1).numpy()  # Virchow: class token and mean of patch tokens


def random_timm_weights(cfg, seed):
    g = np.random.default_rng(seed)
    D, M, P, R = cfg["width"], cfg["mlp"], cfg["patch"], cfg.get("reg", 0)
    G = cfg["image"] // P
    prefix = int(cfg.get("class_token", 1)) + R
    r = lambda *s: (0.1 * g.standard_normal(s)).astype(np.float32)  # noqa: E731
    w = {"pos_embed": r(1, G * G if cfg.get("no_embed_class", 0) else G * G + prefix, D),
         "patch_embed.proj.weight": r(D, 3, P, P), "patch_embed.proj.bias": r(D)}
    if cfg.get("class_token", 1):
        w["cls_token"] = r(1, 1, D)
    if R:
        w["reg_token"] = r(1, R, D)
    for i in range(cfg["depth"]):
        b = "blocks.%d." % i
        w.update({b + "norm1.weight": 1 + r(D), b + "norm1.bias": r(D), b + "attn.qkv.weight": r(3 * D, D),
                  b + "attn.qkv.bias": r(3 * D), b + "attn.proj.weight": r(D, D), b + "attn.proj.bias": r(D),
                  b + "norm2.weight": 1 + r(D), b + "norm2.bias": r(D),
                  b + "mlp.fc1.weight": r(2 * M if cfg.get("swiglu", 0) else M, D),
                  b + "mlp.fc1.bias": r(2 * M if cfg.get("swiglu", 0) else M), b + "mlp.fc2.weight": r(D, M),
                  b + "mlp.fc2.bias": r(D)})
        if cfg.get("layer_scale", 0):
            w[b + "ls1.gamma"], w[b + "ls2.gamma"] = r(D), r(D)
    norm = "fc_norm" if cfg.get("fc_norm", 0) else "norm"
    w[norm + ".weight"], w[norm + ".bias"] = 1 + r(D), r(D)
    w["head.weight"] = r(5, D)  # a classifier head: extra entries are ignored
    return w


class TestTimmVariants(unittest.TestCase):
    BASE = {"image": 64, "patch": 16, "width": 48, "depth": 2, "heads": 4, "mlp": 96}
    VARIANTS = {
        "uni (layer scale, class token)": {"layer_scale": 1},
        "registers, class token + mean (Virchow's pooling)": {"reg": 4, "pool": "token_mean", "layer_scale": 1},
        "mean pooling with fc_norm": {"pool": "mean", "fc_norm": 1},
        "no class token, no_embed_class": {"class_token": 0, "pool": "mean", "no_embed_class": 1},
        "registers with no_embed_class": {"reg": 2, "no_embed_class": 1, "pool": "token_mean"},
        "virchow2-like (SwiGLU, layer scale, 4 registers, class token + mean)":
            {"swiglu": 1, "layer_scale": 1, "reg": 4, "pool": "token_mean"},
        "uni2-h-like (SwiGLU, 8 registers, no_embed_class)": {"swiglu": 1, "layer_scale": 1, "reg": 8,
                                                             "no_embed_class": 1},
    }

    def test_variants_equal_the_reference(self):
        images = real_tiles(2, 64)
        tmp = tempfile.mkdtemp(prefix="vit_")
        try:
            for i, (name, extra) in enumerate(self.VARIANTS.items()):
                with self.subTest(variant=name):
                    cfg = dict(self.BASE, **extra)
                    w = random_timm_weights(cfg, i)
                    weights = os.path.join(tmp, "w%d.safetensors" % i)
                    write_safetensors(weights, w)
                    expected = timm_reference(w, images, cfg)
                    r, got = run_golden(tmp, "cpu", weights, images, cfg)
                    self.assertEqual(r.returncode, 0, r.stderr)
                    self.assertEqual(got.shape, expected.shape)
                    self.assertLess(rel_err(got, expected), 1e-4, name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


    def test_half_activations_near_the_reference(self):
        """The trunk with f16 / bf16 activations (VisionTransformer::set_activation_dtype; what
        cuda runs under --precision fp16 / bf16), here on the reference backend, the oracle of the
        GPU's parity suite: features within a few roundings of the half type of the float64 timm
        transcription, on real tiles, and not the f32 run's features (the half path ran)."""
        images = real_tiles(2, 64)
        tmp = tempfile.mkdtemp(prefix="vit_half_")
        try:
            for i, name in enumerate(("uni (layer scale, class token)",
                                      "virchow2-like (SwiGLU, layer scale, 4 registers, class token + mean)")):
                cfg = dict(self.BASE, **self.VARIANTS[name])
                w = random_timm_weights(cfg, 40 + i)
                weights = os.path.join(tmp, "w%d.safetensors" % i)
                write_safetensors(weights, w)
                expected = timm_reference(w, images, cfg)
                r, f32 = run_golden(tmp, "reference", weights, images, dict(cfg, activations="f32"))
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertLess(rel_err(f32, expected), 1e-5, name)
                for act, u in (("f16", 2.0 ** -11), ("bf16", 2.0 ** -8)):
                    with self.subTest(variant=name, activations=act):
                        r, got = run_golden(tmp, "reference", weights, images, dict(cfg, activations=act))
                        self.assertEqual(r.returncode, 0, r.stderr)
                        err = rel_err(got, expected)
                        print("%s, %s activations: %.2f u of the float64 reference" % (name, act, err / u))
                        self.assertLess(err, 4 * u)  # measured 0.5 to 1.1 u
                        self.assertGreater(rel_err(got, f32), 0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_pos_embed_resampling_equals_torch(self):
        """resample_pos_embed (vit.h) against timm's resample_abs_pos_embed on F.interpolate(bicubic,
        antialias=True): up (a 14 x 14 grid to 16 x 16, a 224-px ViT-B/16 run at 256 px) and down
        (14 -> 10), with 1 and 5 prefix rows."""
        g = np.random.default_rng(5)
        tmp = tempfile.mkdtemp(prefix="vit_pos_")
        try:
            for prefix, g0, g1, D in ((1, 14, 16, 48), (5, 14, 10, 32), (0, 16, 14, 8)):
                with self.subTest(prefix=prefix, g0=g0, g1=g1):
                    pos = g.standard_normal((1, prefix + g0 * g0, D)).astype(np.float32)
                    src, dst = os.path.join(tmp, "pos.in"), os.path.join(tmp, "pos.out")
                    pos.tofile(src)
                    run_resample_jobs(tmp, ["pos %s %d %d %d %d %s" % (src, prefix, g0, g1, D, dst)])
                    got = np.fromfile(dst, np.float32).reshape(1, prefix + g1 * g1, D)
                    want = timm_resample_abs_pos_embed(pos, g1, prefix)
                    err = float(np.max(np.abs(got.astype(np.float64) - want)))
                    print("pos_embed %d -> %d (prefix %d): max |ours - F.interpolate| = %.2e" % (g0, g1, prefix, err))
                    np.testing.assert_array_equal(got[:, :prefix], pos[:, :prefix])
                    self.assertLess(err, 1e-5)
                    # Not PyTorch's plain bicubic (a = -0.75, no antialiasing): timm asks for antialias.
                    if g1 > g0:
                        plain = F.interpolate(torch.from_numpy(pos[:, prefix:]).reshape(1, g0, g0, D).permute(0, 3, 1, 2),
                                              size=(g1, g1), mode="bicubic", align_corners=False)
                        plain = plain.permute(0, 2, 3, 1).reshape(1, -1, D).numpy()
                        self.assertGreater(float(np.max(np.abs(plain - want[:, prefix:]))), 1e-3)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def conch_weights(cfg, E, seed):
    """Random weights in CONCH's open_clip layout: the timm trunk under visual.trunk., the
    contrastive attentional pooler (visual.attn_pool_contrast.*: nn.MultiheadAttention(E, H',
    kdim=D, vdim=D) with its separate q/k/v projection weights) and visual.ln_contrast, plus a
    captioning pooler and a text tower entry that the encoder ignores."""
    g = np.random.default_rng(seed)
    D = cfg["width"]
    r = lambda *s: (0.1 * g.standard_normal(s)).astype(np.float32)  # noqa: E731
    w = {"visual.trunk." + k: v for k, v in random_timm_weights(cfg, seed).items()}
    a = "visual.attn_pool_contrast."
    w.update({a + "query": r(1, E), a + "attn.q_proj_weight": r(E, E), a + "attn.k_proj_weight": r(E, D),
              a + "attn.v_proj_weight": r(E, D), a + "attn.in_proj_bias": r(3 * E), a + "attn.out_proj.weight": r(E, E),
              a + "attn.out_proj.bias": r(E), a + "ln_q.weight": 1 + r(E), a + "ln_q.bias": r(E),
              a + "ln_k.weight": 1 + r(D), a + "ln_k.bias": r(D), "visual.ln_contrast.weight": 1 + r(E),
              "visual.ln_contrast.bias": r(E), "visual.attn_pool_caption.query": r(4, E), "text.positional_embedding": r(8, E)})
    return w


def conch_reference(w, images, cfg, E, heads):
    """CONCH's VisualModel.forward_no_head (MahmoodLab/CONCH vision_tower.py): the trunk's
    forward_features, then AttentionalPooler (transformer.py: ln_k on the tokens, ln_q on the query,
    torch.nn.MultiheadAttention, here PyTorch's own module with the file's weights) and ln_contrast,
    in float64."""
    trunk = {k[len("visual.trunk."):]: v for k, v in w.items() if k.startswith("visual.trunk.")}
    x = torch.from_numpy(np.asarray(timm_reference(trunk, images, dict(cfg, pool="tokens"))))
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    a, D = "visual.attn_pool_contrast.", cfg["width"]
    mha = torch.nn.MultiheadAttention(E, heads, kdim=D, vdim=D, batch_first=True).double()
    mha.load_state_dict({"q_proj_weight": t[a + "attn.q_proj_weight"], "k_proj_weight": t[a + "attn.k_proj_weight"],
                         "v_proj_weight": t[a + "attn.v_proj_weight"], "in_proj_bias": t[a + "attn.in_proj_bias"],
                         "out_proj.weight": t[a + "attn.out_proj.weight"], "out_proj.bias": t[a + "attn.out_proj.bias"]})
    mha.eval()
    with torch.no_grad():
        k = F.layer_norm(x, (D,), t[a + "ln_k.weight"], t[a + "ln_k.bias"], 1e-5)
        q = F.layer_norm(t[a + "query"], (E,), t[a + "ln_q.weight"], t[a + "ln_q.bias"], 1e-5)
        out = mha(q.unsqueeze(0).expand(x.shape[0], -1, -1), k, k, need_weights=False)[0][:, 0]
        return F.layer_norm(out, (E,), t["visual.ln_contrast.weight"], t["visual.ln_contrast.bias"], 1e-5).numpy()


class TestConch(unittest.TestCase):
    """CONCH's vision tower (vit.h kAttentional, preset conch-vit-b) on a small random model of its
    layout: golden_vit and slide-embed --model vit --pool attention against PyTorch's
    MultiheadAttention on real tiles; the preset refuses a file of another shape."""
    E, HEADS = 32, 4

    def test_attentional_pooler_equals_torch(self):
        cfg = dict(TestTimmVariants.BASE)
        images = real_tiles(3, 64)
        tmp = tempfile.mkdtemp(prefix="vit_conch_")
        try:
            w = conch_weights(cfg, self.E, 31)
            weights = os.path.join(tmp, "conch.safetensors")
            write_safetensors(weights, w)
            expected = conch_reference(w, images, cfg, self.E, self.HEADS)
            for backend in ("cpu", "reference"):
                r, got = run_golden(tmp, backend, weights, images,
                                    dict(cfg, pool="attention", pool_dim=self.E, pool_heads=self.HEADS,
                                         prefix="visual.trunk."))
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertEqual(got.shape, (3, self.E))
                err = rel_err(got, expected)
                print("CONCH-layout ViT, attentional pooler, %s backend: max relative error %.2e" % (backend, err))
                self.assertLess(err, 1e-4, backend)
            # Missing a pooler tensor: named.
            del w["visual.attn_pool_contrast.attn.v_proj_weight"]
            write_safetensors(weights, w)
            r, _ = run_golden(tmp, "cpu", weights, images, dict(cfg, pool="attention", pool_dim=self.E,
                                                                pool_heads=self.HEADS, prefix="visual.trunk."))
            self.assertEqual(r.returncode, 1)
            self.assertIn("visual.attn_pool_contrast.attn.v_proj_weight", r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_slide_embed_attention_pooling(self):
        import h5py
        embed = os.environ["SLIDE_EMBED"]
        cfg = dict(TestTimmVariants.BASE)
        tmp = tempfile.mkdtemp(prefix="vit_conch_embed_")
        try:
            store = os.path.join(tmp, "store")
            tile_cmu(self, store, 64, 7)
            w = conch_weights(cfg, self.E, 32)
            weights = os.path.join(tmp, "conch.safetensors")
            write_safetensors(weights, w)
            out = os.path.join(tmp, "bags")
            # --model vit with CONCH's layout: the pooler's heads are CoCa's default 8 unless a
            # preset says otherwise, so this file (E 32) runs with 8 heads of 4.
            r = subprocess.run([embed, store, "-o", out, "--weights", weights, "--model", "vit", "--heads", "4",
                                "--pool", "attention", "--batch-size", "4"], capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            tiles = store_tiles(store)
            expected = conch_reference(w, normalise([a for a, _ in tiles]), cfg, self.E, 8)
            with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
                got = f["features"][()]
                self.assertEqual(f.attrs["layer"], "attention")
                self.assertEqual(f.attrs["feature_dim"], self.E)
            self.assertEqual(got.shape, (len(tiles), self.E))
            self.assertLess(rel_err(got, expected), 1e-4)
            # The preset is CONCH's published shape: this small file is refused, naming both.
            r = subprocess.run([embed, store, "-o", os.path.join(tmp, "b2"), "--weights", weights, "--model",
                                "conch-vit-b"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("conch-vit-b is width 768, depth 12, patch 16", r.stderr)
            # Attention pooling of a plain timm file: the missing pooler is named.
            plain = os.path.join(tmp, "plain.safetensors")
            write_safetensors(plain, random_timm_weights(cfg, 33))
            r = subprocess.run([embed, store, "-o", os.path.join(tmp, "b3"), "--weights", plain, "--model", "vit",
                                "--heads", "4", "--pool", "attention"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("attn_pool_contrast.query", r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class TestBadWeights(unittest.TestCase):
    def test_missing_and_misshapen_tensors_are_named(self):
        cfg = dict(TestTimmVariants.BASE, layer_scale=1)
        images = real_tiles(1, 64)
        tmp = tempfile.mkdtemp(prefix="vit_")
        try:
            w = random_timm_weights(cfg, 7)
            del w["blocks.1.ls2.gamma"]
            weights = os.path.join(tmp, "missing.safetensors")
            write_safetensors(weights, w)
            r, _ = run_golden(tmp, "cpu", weights, images, cfg)
            self.assertEqual(r.returncode, 1)
            self.assertIn("blocks.1.ls2.gamma", r.stderr)
            w = random_timm_weights(cfg, 7)
            w["blocks.0.attn.qkv.weight"] = w["blocks.0.attn.qkv.weight"][:, :-1].copy()
            weights = os.path.join(tmp, "misshapen.safetensors")
            write_safetensors(weights, w)
            r, _ = run_golden(tmp, "cpu", weights, images, cfg)
            self.assertEqual(r.returncode, 1)
            self.assertIn("blocks.0.attn.qkv.weight", r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class TestSlideEmbed(unittest.TestCase):
    """slide-embed --model vit: bags of a real slide's tiles equal the reference ViT's features."""

    def test_bags_equal_the_reference(self):
        import h5py
        embed = os.environ["SLIDE_EMBED"]
        cfg = dict(TestTimmVariants.BASE, layer_scale=1, reg=2)
        tmp = tempfile.mkdtemp(prefix="vit_embed_")
        try:
            store = os.path.join(tmp, "store")
            tile_cmu(self, store, 64, 12)
            w = random_timm_weights(cfg, 21)
            weights = os.path.join(tmp, "vit.safetensors")
            write_safetensors(weights, w)
            out = os.path.join(tmp, "bags")
            r = subprocess.run([embed, store, "-o", out, "--weights", weights, "--model", "vit", "--heads", "4",
                                "--pool", "token+mean", "--batch-size", "5"], capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            # The store's raw tiles, normalised with ImageNet's mean and std, through the reference.
            tiles = store_tiles(store)
            images, coords = normalise([a for a, _ in tiles]), [xy for _, xy in tiles]
            expected = timm_reference(w, images, dict(cfg, pool="token_mean"))
            with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
                got = f["features"][()]
                self.assertEqual(f.attrs["model"], "vit")
                self.assertEqual(f.attrs["layer"], "token+mean")
                self.assertEqual(f.attrs["feature_dim"], 2 * cfg["width"])
                self.assertEqual(f.attrs["attention_heads"], 4)
                np.testing.assert_array_equal(f["coords"][()], np.array(coords, np.int32))
            self.assertEqual(got.shape, (len(images), 2 * cfg["width"]))
            self.assertLess(rel_err(got, expected), 1e-4)
            # A rerun with other heads (other features from the same weights) does not take the
            # complete bag as its own.
            r = subprocess.run([embed, store, "-o", out, "--weights", weights, "--model", "vit", "--heads", "2",
                                "--pool", "token+mean"], capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertIn(", 4 attention heads (this run: vit, layer token+mean, 2 attention heads): remove it",
                          r.stderr)
            # The same bags through another backend (the op list's reference loops).
            out_ref = os.path.join(tmp, "bags_ref")
            r = subprocess.run([embed, store, "-o", out_ref, "--weights", weights, "--model", "vit", "--heads", "4",
                                "--pool", "token+mean", "--backend", "reference"], capture_output=True, text=True,
                               timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            with h5py.File(os.path.join(out_ref, "CMU-1-Small-Region.h5"), "r") as f:
                self.assertLess(rel_err(f["features"][()], expected), 1e-4)
            # A preset checks the architecture; --layer is a CNN's option.
            r = subprocess.run([embed, store, "-o", os.path.join(tmp, "b2"), "--weights", weights, "--model", "uni"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("is a ViT of width 48, depth 2, patch 16, layer scale, GELU MLP, 2 register tokens; "
                          "uni is width 1024, depth 24, patch 16", r.stderr)
            r = subprocess.run([embed, store, "-o", os.path.join(tmp, "b3"), "--weights", weights, "--model", "vit",
                                "--heads", "4", "--layer", "layer3"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            # A truncated or forged weight file is refused by its header, naming it; no bag is written.
            for name, blob in (("short.safetensors", b"\x10\x00"),
                               ("forged.safetensors", struct.pack("<Q", 1 << 40) + b"{}"),
                               ("notjson.safetensors", struct.pack("<Q", 4) + b"{{{{")):
                bad = os.path.join(tmp, name)
                with open(bad, "wb") as f:
                    f.write(blob)
                bad_out = os.path.join(tmp, "bad_" + name)
                r = subprocess.run([embed, store, "-o", bad_out, "--weights", bad, "--model", "vit", "--heads", "4"],
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn("DATA_LOSS: " + bad, r.stderr)
                self.assertFalse(glob.glob(os.path.join(bad_out, "*.h5")))
            # A store of another tile size (32 px) is resized up to the encoder's 64 px, as PIL would,
            # logged and recorded in the bag.
            store2 = os.path.join(tmp, "store2")
            tile_cmu(self, store2, 32, 3)
            r = subprocess.run([embed, store2, "-o", os.path.join(tmp, "b4"), "--weights", weights, "--model", "vit",
                                "--heads", "4"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("tiles of 32 px are resized to 64 px (bicubic, antialiased, as the encoder's transform)",
                          r.stderr)
            small = [Image.fromarray(a).resize((64, 64), Image.BICUBIC) for a, _ in store_tiles(store2)]
            expected = timm_reference(w, normalise([np.asarray(i) for i in small]), cfg)
            with h5py.File(os.path.join(tmp, "b4", "CMU-1-Small-Region.h5"), "r") as f:
                self.assertEqual(f.attrs["tile_size_px"], 32)
                self.assertEqual(f.attrs["encoder_input_px"], 64)
                err = rel_err(f["features"][()], expected)
                print("32-px tiles resized to 64 px: max relative error against PIL + reference %.2e" % err)
                self.assertLess(err, 1e-4)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def store_256(cls, tmp):
        """A raw store of 256-px tiles of a real slide (CMU-1 at 1 um/px)."""
        store = os.path.join(tmp, "store256")
        r = subprocess.run([os.environ["SLIDE_TILE"], os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"),
                            "--mpp", "1", "--tile-size", "256", "--encoding", "raw", "--max-tiles-per-slide", "6",
                            "-o", store, "-q"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return store

    def test_resizer_equals_pil_on_real_tiles(self):
        """BicubicResizer (resample.h) against PIL's Image.resize(BICUBIC) on real tiles: a slide's
        256-px tiles -> 224 (down), LC25000's 224-px JPEG patches -> 150 (down) and 256 (up),
        Kather's 150-px TIFF patches -> 224 (up). Within 1 grey level per channel."""
        tmp = tempfile.mkdtemp(prefix="vit_resize_")
        try:
            cases = [("slide 256 -> 224", a, 224) for a, _ in store_tiles(self.store_256(tmp))[:3]]
            lc = sorted(glob.glob(os.path.join(SAMPLE, "patches", "lc25000-lung-subset", "*", "*.jpeg")))[:2]
            for p in lc:
                a = np.asarray(Image.open(p).convert("RGB"))
                cases += [("LC25000 224 -> 150", a, 150), ("LC25000 224 -> 256", a, 256)]
            for p in sorted(glob.glob(os.path.join(SAMPLE, "patches", "kather2016-samples", "*", "*.tif")))[:3]:
                cases.append(("Kather 150 -> 224", np.asarray(Image.open(p).convert("RGB")), 224))
            jobs, outs = [], []
            for i, (name, a, size) in enumerate(cases):
                src, dst = os.path.join(tmp, "t%d.in" % i), os.path.join(tmp, "t%d.out" % i)
                np.ascontiguousarray(a).tofile(src)
                jobs.append("rgb %s %d %d %d %d %s" % (src, a.shape[1], a.shape[0], size, size, dst))
                outs.append(dst)
            run_resample_jobs(tmp, jobs)
            worst, differ, total = {}, {}, {}
            for (name, a, size), dst in zip(cases, outs):
                got = np.fromfile(dst, np.uint8).reshape(size, size, 3).astype(np.int16)
                want = np.asarray(Image.fromarray(a).resize((size, size), Image.BICUBIC)).astype(np.int16)
                d = np.abs(got - want)
                worst[name] = max(worst.get(name, 0), int(d.max()))
                differ[name] = differ.get(name, 0) + int((d > 0).sum())
                total[name] = total.get(name, 0) + d.size
            for name in worst:
                print("%s: max difference from PIL %d level(s), %.4f%% of values differ" %
                      (name, worst[name], 100.0 * differ[name] / total[name]))
                self.assertLessEqual(worst[name], 1, name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_256px_store_equals_pil_resize_then_reference(self):
        """A 224-px ViT on a store of 256-px tiles: slide-embed resizes them; the features equal PIL's
        resize -> normalise -> the transcription of timm's forward."""
        import h5py
        cfg = {"image": 224, "patch": 32, "width": 48, "depth": 2, "heads": 4, "mlp": 96, "layer_scale": 1, "reg": 1}
        tmp = tempfile.mkdtemp(prefix="vit_256_")
        try:
            store = self.store_256(tmp)
            w = random_timm_weights(cfg, 31)
            weights = os.path.join(tmp, "vit.safetensors")
            write_safetensors(weights, w)
            out = os.path.join(tmp, "bags")
            r = subprocess.run([os.environ["SLIDE_EMBED"], store, "-o", out, "--weights", weights, "--model", "vit",
                                "--heads", "4", "--decode-threads", "2", "--batch-size", "4"],
                               capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stderr.count("tiles of 256 px are resized to 224 px"), 1)
            tiles = store_tiles(store)
            resized = [np.asarray(Image.fromarray(a).resize((224, 224), Image.BICUBIC)) for a, _ in tiles]
            expected = timm_reference(w, normalise(resized), cfg)
            with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
                got = f["features"][()]
                self.assertEqual(f.attrs["tile_size_px"], 256)
                self.assertEqual(f.attrs["encoder_input_px"], 224)
            err = rel_err(got, expected)
            print("256-px store through a 224-px ViT: max relative error against PIL + reference %.2e" % err)
            self.assertLess(err, 1e-4)
            # A rerun with another input size does not reuse these bags.
            r = subprocess.run([os.environ["SLIDE_EMBED"], store, "-o", out, "--weights", weights, "--model", "vit",
                                "--heads", "4", "--image-size", "256"], capture_output=True, text=True, timeout=300)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertIn("tiles resized to 224 px (this run: vit, layer token)", r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_image_size_resamples_pos_embed_as_timm(self):
        """--image-size 256 on a ViT whose weights are at 224 px (a 14 x 14 grid, patch 16): the
        positional embedding resampled to 16 x 16 as timm does, on a store of 256-px tiles (not
        resized); against timm's resample_abs_pos_embed + the transcription of the forward."""
        import h5py
        tmp = tempfile.mkdtemp(prefix="vit_imgsize_")
        try:
            store = self.store_256(tmp)
            for name, extra in (("class token + 2 registers", {"reg": 2, "layer_scale": 1}),
                                ("no_embed_class, 4 registers", {"reg": 4, "no_embed_class": 1, "swiglu": 1})):
                with self.subTest(variant=name):
                    cfg = dict({"image": 224, "patch": 16, "width": 32, "depth": 2, "heads": 4, "mlp": 64}, **extra)
                    w = random_timm_weights(cfg, 41)
                    weights = os.path.join(tmp, "vit.safetensors")
                    write_safetensors(weights, w)
                    out = os.path.join(tmp, "bags_" + str(len(extra)))
                    r = subprocess.run([os.environ["SLIDE_EMBED"], store, "-o", out, "--weights", weights,
                                        "--model", "vit", "--heads", "4", "--image-size", "256"],
                                       capture_output=True, text=True, timeout=300)
                    self.assertEqual(r.returncode, 0, r.stderr)
                    self.assertIn("ViT positional embedding resampled", r.stderr)
                    self.assertNotIn("are resized", r.stderr)
                    prefix = 0 if cfg.get("no_embed_class", 0) else 1 + cfg["reg"]
                    w256 = dict(w, pos_embed=timm_resample_abs_pos_embed(w["pos_embed"], 16, prefix))
                    expected = timm_reference(w256, normalise([a for a, _ in store_tiles(store)]),
                                              dict(cfg, image=256))
                    with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
                        got = f["features"][()]
                        self.assertNotIn("encoder_input_px", f.attrs)
                    err = rel_err(got, expected)
                    print("--image-size 256 on 224-px weights (%s): max relative error %.2e" % (name, err))
                    self.assertLess(err, 1e-4)
            # Not a multiple of the patch size: refused, naming the file.
            r = subprocess.run([os.environ["SLIDE_EMBED"], store, "-o", os.path.join(tmp, "bad"), "--weights", weights,
                                "--model", "vit", "--heads", "4", "--image-size", "250"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--image-size 250 is not a multiple of the patch size 16 of " + weights, r.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
