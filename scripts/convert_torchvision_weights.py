#!/usr/bin/python3
"""Convert PyTorch weights to a safetensors file with torchvision's parameter names, which
`slide-embed --weights FILE --model resnet50` (and slide-train's checkpoints) read.

usage:
  convert_torchvision_weights.py INPUT.pth OUTPUT.safetensors [--model resnet50]
      INPUT: a state_dict saved with torch.save (e.g. torchvision's resnet50-0676ba61.pth, which
      you download yourself), a checkpoint dict holding one under "state_dict" / "model", or a
      whole pickled nn.Module. "module." prefixes (DataParallel) are stripped and batch norm's
      num_batches_tracked counters dropped. With --model the names and shapes are checked
      against torchvision.models.<model>() (load_state_dict(strict=True)) before writing.
  convert_torchvision_weights.py --random resnet50 OUTPUT.safetensors [--seed 0] [--classes 1000]
      torchvision's own random initialisation (no download): for tests and benchmarks.

Needs Debian's python3-torch and python3-torchvision (for --model / --random); run it with
/usr/bin/python3. Nothing is downloaded. The file is written as OUTPUT.partial and renamed.

safetensors layout (huggingface/safetensors README): u64 little-endian header length N, N bytes of
JSON {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}}, then the bytes.
"""
import argparse
import json
import os
import struct
import sys


def fail(msg):
    print("convert_torchvision_weights: " + msg, file=sys.stderr)
    sys.exit(2)


def state_dict_of(obj):
    import torch
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if key in obj and isinstance(obj[key], dict):
                return obj[key]
        return obj
    fail("the input holds a %s, not a state_dict or a model" % type(obj).__name__)


def clean(sd):
    import torch
    out = {}
    for name, value in sd.items():
        if not isinstance(value, torch.Tensor):
            continue
        if name.startswith("module."):
            name = name[len("module."):]
        if name.endswith("num_batches_tracked"):
            continue
        out[name] = value.detach().to("cpu", dtype=torch.float32).contiguous()
    if not out:
        fail("no tensors in the input")
    return out


def write_safetensors(path, tensors, metadata):
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(t.numpy().astype("<f4", copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", nargs="?", help="a .pth/.pt file (state_dict, checkpoint dict or model)")
    ap.add_argument("output", help="the .safetensors file to write")
    ap.add_argument("--model", help="torchvision architecture to check the names against (resnet18, resnet50, ...)")
    ap.add_argument("--random", metavar="MODEL", help="write torchvision's random initialisation of MODEL instead")
    ap.add_argument("--seed", type=int, default=0, help="seed for --random")
    ap.add_argument("--classes", type=int, default=1000, help="fc outputs for --random")
    a = ap.parse_args()
    import torch
    import torchvision
    if a.random:
        if a.input:
            fail("give either INPUT or --random, not both")
        torch.manual_seed(a.seed)
        model = getattr(torchvision.models, a.random)(num_classes=a.classes)
        sd, arch = clean(model.state_dict()), a.random
    else:
        if not a.input:
            fail("INPUT is required (or --random MODEL)")
        if not os.path.exists(a.input):
            fail("%s: no such file" % a.input)
        try:
            obj = torch.load(a.input, map_location="cpu")
        except Exception as e:  # pickle errors come in many types
            fail("%s: not a PyTorch file (%s)" % (a.input, e))
        sd, arch = clean(state_dict_of(obj)), a.model or ""
        if a.model:
            fc = sd.get("fc.weight")
            model = getattr(torchvision.models, a.model)(num_classes=fc.shape[0] if fc is not None else 1000)
            try:
                model.load_state_dict(sd, strict=True)
            except RuntimeError as e:
                fail("%s does not hold torchvision %s weights: %s" % (a.input, a.model, e))
    write_safetensors(a.output, sd, {"format": "pt", "source": os.path.basename(a.input or "random"), "model": arch})
    print("wrote %s: %d tensors" % (a.output, len(sd)))


if __name__ == "__main__":
    main()
