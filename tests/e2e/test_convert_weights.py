#!/usr/bin/python3
"""scripts/convert_torchvision_weights.py: a downloaded weight file never runs code (issue 22).

A pickle whose unpickling would create a file is refused (non-zero exit, the message names the
file and the global it wanted) and the file is not created, in torch's zip format, its legacy
format and as a bare pickle; a TorchScript archive is refused; --unsafe-pickle still converts a
whole pickled model, with a warning. Plain state dicts, checkpoint dicts, DataParallel prefixes, a
UNI-shaped (timm ViT) state dict as pytorch_model.bin, and .safetensors inputs (F32 and BF16)
convert to the same tensors.

Environment: SLIDE_CONVERT (the script). Run with Debian's /usr/bin/python3 (torch, torchvision).
"""
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
import torchvision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

CONVERT = os.environ["SLIDE_CONVERT"]
PY = "/usr/bin/python3"


def convert(*args):
    return subprocess.run([PY, CONVERT] + [str(a) for a in args], capture_output=True, text=True, timeout=300)


class Payload:
    """Unpickling this runs `touch MARKER` (the attack the issue reproduced)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def uni_shaped_state_dict(width=32, depth=2, patch=16, grid=14):
    """timm VisionTransformer's parameter names and shapes (UNI: ViT-L/16 with layer scale), small."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    sd = {"cls_token": r(1, 1, width), "pos_embed": r(1, grid * grid + 1, width),
          "patch_embed.proj.weight": r(width, 3, patch, patch), "patch_embed.proj.bias": r(width)}
    for i in range(depth):
        b = "blocks.%d." % i
        sd.update({b + "norm1.weight": r(width), b + "norm1.bias": r(width),
                   b + "attn.qkv.weight": r(3 * width, width), b + "attn.qkv.bias": r(3 * width),
                   b + "attn.proj.weight": r(width, width), b + "attn.proj.bias": r(width),
                   b + "ls1.gamma": r(width), b + "norm2.weight": r(width), b + "norm2.bias": r(width),
                   b + "mlp.fc1.weight": r(4 * width, width), b + "mlp.fc1.bias": r(4 * width),
                   b + "mlp.fc2.weight": r(width, 4 * width), b + "mlp.fc2.bias": r(width),
                   b + "ls2.gamma": r(width)})
    sd.update({"norm.weight": r(width), "norm.bias": r(width)})
    return sd


class TestSafeLoading(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="convert_")
        self.marker = os.path.join(self.tmp, "pwned")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def assert_refused(self, path, wanted="posix.system"):
        out = os.path.join(self.tmp, "out.safetensors")
        r = convert(path, out)
        self.assertNotEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn(path, r.stderr)
        self.assertIn(wanted, r.stderr)
        self.assertIn("state_dict()", r.stderr)  # says how to export a plain state dict
        self.assertFalse(os.path.exists(self.marker), "the pickle ran its command")
        self.assertFalse(os.path.exists(out))
        self.assertFalse(os.path.exists(out + ".partial"))

    def test_crafted_pickle_refused_in_every_format(self):
        payload = {"weight": torch.ones(2), "evil": Payload(self.marker)}
        zip_path = os.path.join(self.tmp, "evil.pth")
        torch.save(payload, zip_path)
        legacy = os.path.join(self.tmp, "evil_legacy.pth")
        torch.save(payload, legacy, _use_new_zipfile_serialization=False)
        bare = os.path.join(self.tmp, "pytorch_model.bin")
        with open(bare, "wb") as f:  # a bare pickle: no tensor (pickled tensors are refused first)
            pickle.dump({"evil": Payload(self.marker)}, f, protocol=2)
        # A float first: PyTorch 1.13's weights-only unpickler lacks BINFLOAT, so this one is
        # refused by the converter's second restricted unpickler.
        with_float = os.path.join(self.tmp, "evil_float.pth")
        torch.save({"best_acc": 0.5, "weight": torch.ones(2), "evil": Payload(self.marker)}, with_float)
        for path in (zip_path, legacy, bare, with_float):
            with self.subTest(path=os.path.basename(path)):
                self.assert_refused(path)

    def test_whole_module_refused_then_allowed_with_unsafe_pickle(self):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=3)
        path = os.path.join(self.tmp, "whole_model.pth")
        torch.save(model, path)
        self.assert_refused(path, wanted="torchvision.models.resnet.ResNet")
        out = os.path.join(self.tmp, "out.safetensors")
        r = convert(path, out, "--model", "resnet18", "--unsafe-pickle")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("WARNING: --unsafe-pickle", r.stderr)
        got = read_safetensors(out)
        np.testing.assert_array_equal(got["fc.weight"], model.fc.weight.detach().numpy())

    def test_torchscript_refused(self):
        path = os.path.join(self.tmp, "scripted.pt")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
        r = convert(path, os.path.join(self.tmp, "out.safetensors"))
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(path, r.stderr)
        self.assertIn("TorchScript", r.stderr)


class TestConverts(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="convert_")
        torch.manual_seed(0)
        self.model = torchvision.models.resnet18(num_classes=5)
        self.sd = {k: v for k, v in self.model.state_dict().items() if not k.endswith("num_batches_tracked")}

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def check_same(self, out, expected):
        got = read_safetensors(out)
        self.assertEqual(sorted(got), sorted(expected))
        for k, v in expected.items():
            np.testing.assert_array_equal(got[k], v.float().numpy(), err_msg=k)

    def test_state_dict_checkpoint_and_dataparallel(self):
        inputs = {
            "plain.pth": self.model.state_dict(),
            "checkpoint.pth": {"state_dict": self.model.state_dict(), "epoch": 7, "best_acc": 0.9,
                               "optimizer": {"lr": [0.1]}},
            "dp.pth": {"model": {"module." + k: v for k, v in self.model.state_dict().items()}},
            "legacy_checkpoint.pth": {"model_state_dict": self.model.state_dict(), "best_acc": 0.5},
        }
        for name, obj in inputs.items():
            with self.subTest(name=name):
                path, out = os.path.join(self.tmp, name), os.path.join(self.tmp, name + ".safetensors")
                torch.save(obj, path, _use_new_zipfile_serialization=not name.startswith("legacy"))
                r = convert(path, out, "--model", "resnet18")
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertNotIn("WARNING", r.stderr)
                self.check_same(out, self.sd)

    def test_uni_shaped_bin(self):
        sd = uni_shaped_state_dict()
        path, out = os.path.join(self.tmp, "pytorch_model.bin"), os.path.join(self.tmp, "uni.safetensors")
        torch.save(sd, path)
        r = convert(path, out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_same(out, sd)

    def test_safetensors_input_f32_and_bf16(self):
        sd = uni_shaped_state_dict()
        f32 = os.path.join(self.tmp, "in.safetensors")
        write_safetensors(f32, {k: v.numpy() for k, v in sd.items()})
        out = os.path.join(self.tmp, "out.safetensors")
        r = convert(f32, out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_same(out, sd)
        # BF16 (how ViT weights are often published), written by hand: the top 16 bits of F32.
        import json
        import struct
        bf = {k: v.to(torch.bfloat16) for k, v in sd.items()}
        header, blobs, off = {}, [], 0
        for k, v in bf.items():
            raw = v.view(torch.int16).numpy().astype("<i2").tobytes()
            header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [off, off + len(raw)]}
            blobs.append(raw)
            off += len(raw)
        h = json.dumps(header).encode()
        bf_path = os.path.join(self.tmp, "bf16.safetensors")
        with open(bf_path, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
        r = convert(bf_path, out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.check_same(out, {k: v.float() for k, v in bf.items()})

    def test_truncated_safetensors_refused(self):
        path = os.path.join(self.tmp, "cut.safetensors")
        write_safetensors(path, {"w": np.ones((64, 64), np.float32)})
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        r = convert(path, os.path.join(self.tmp, "out.safetensors"))
        self.assertEqual(r.returncode, 2)
        self.assertIn(path, r.stderr)
        self.assertIn("outside the file", r.stderr)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
