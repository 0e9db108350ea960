#!/usr/bin/python3
"""Convert PyTorch weights to a safetensors file with torchvision's parameter names, which
`slide-embed --weights FILE --model resnet50` (and slide-train's checkpoints) read.

usage:
  convert_torchvision_weights.py INPUT OUTPUT.safetensors [--model resnet50] [--unsafe-pickle]
      INPUT: a state_dict saved with torch.save (.pth/.pt/.bin: e.g. torchvision's
      resnet50-0676ba61.pth or a model hub's pytorch_model.bin, which you download yourself), a
      checkpoint dict holding one under "state_dict" / "model" / "model_state_dict", or a
      .safetensors file. "module." prefixes (DataParallel) are stripped and batch norm's
      num_batches_tracked counters dropped. With --model the names and shapes are checked
      against torchvision.models.<model>() (load_state_dict(strict=True)) before writing.

Safety: a .pth/.bin file is a pickle, and unpickling can run any code the file names. INPUT is
loaded with torch.load(weights_only=True), PyTorch's restricted unpickler (tensors, dicts, lists,
numbers, strings only); a file that needs anything else (a whole pickled nn.Module, custom
classes, argparse.Namespace in a checkpoint) is refused, naming the file and the global it wanted.
TorchScript archives are refused (loading one runs its code). --unsafe-pickle allows full
unpickling for a file you trust completely (it warns: the file can run any command as you).
.safetensors inputs are read without unpickling (with the safetensors package when installed, else
by this script's own reader of the same layout).
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
import pickle
import re
import struct
import sys
import zipfile


def fail(msg):
    print("convert_torchvision_weights: " + msg, file=sys.stderr)
    sys.exit(2)


SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
                      "I8": "i1", "U8": "u1", "BOOL": "?"}


def read_safetensors(path):
    """{name: torch.Tensor} of a .safetensors file; never unpickles. BF16 is widened to F32."""
    import numpy as np
    import torch
    try:
        from safetensors.torch import load_file  # the format's own reader, where installed
        return load_file(path)
    except ImportError:
        pass
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        fail("%s: not a safetensors file (shorter than its 8-byte header length)" % path)
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8:
        fail("%s: not a safetensors file (header length %d past the end of the file)" % (path, n))
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        fail("%s: safetensors header is not JSON (%s)" % (path, e))
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            shape, dtype = info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError):
            fail("%s: tensor %s: malformed entry %r" % (path, name, info))
        count = 1
        for d in shape:
            count *= d
        if not (0 <= begin <= end <= len(data) - base):
            fail("%s: tensor %s: data_offsets %r outside the file" % (path, name, info["data_offsets"]))
        raw = data[base + begin:base + end]
        if dtype == "BF16":
            if len(raw) != 2 * count:
                fail("%s: tensor %s: %d bytes for shape %r of BF16" % (path, name, len(raw), shape))
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        elif dtype in SAFETENSORS_DTYPES:
            arr = np.frombuffer(raw, dtype=SAFETENSORS_DTYPES[dtype])
            if arr.size != count:
                fail("%s: tensor %s: %d bytes for shape %r of %s" % (path, name, len(raw), shape, dtype))
        else:
            fail("%s: tensor %s: unsupported dtype %s" % (path, name, dtype))
        out[name] = torch.from_numpy(arr.copy().reshape(shape))
    return out


def refused_global(message):
    """The global (module.name) that torch's weights-only unpickler refused, from its message."""
    m = re.search(r"(?:[Uu]nsupported (?:class|global:?)\s*(?:GLOBAL\s*)?)([\w.<>' ]+?)(?:$|\s+(?:was|is)\b|[,;\n])",
                  message)
    return m.group(1).strip() if m else None


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, name):
        super().__init__("refused global " + name)
        self.name = name


def check_pickle_globals(path):
    """Reads the pickles of a torch.save file without executing any of them (pickletools.genops
    only decodes opcodes) and raises RefusedGlobal for the first global outside torch's own
    weights-only allowlist (torch._weights_only_unpickler). Zip format: every *.pkl member; the
    legacy format: its five leading pickles (magic number, protocol, sys info, the object, the
    storage keys), as torch's _legacy_load reads them. Protocol-4 STACK_GLOBAL and the extension
    registry (EXT1/2/4) name globals indirectly, and are refused rather than resolved."""
    import io
    import pickletools
    from torch import _weights_only_unpickler as wo
    allowed = wo._get_allowed_globals()

    def scan(f):
        for op, arg, _ in pickletools.genops(f):
            if op.name in ("GLOBAL", "INST"):
                full = arg.replace(" ", ".", 1)
                if full not in allowed:
                    raise RefusedGlobal(full)
            elif op.name in ("STACK_GLOBAL", "EXT1", "EXT2", "EXT4"):
                raise RefusedGlobal("(a global named indirectly by %s, which is not checked)" % op.name)

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith(".pkl"):
                    scan(io.BytesIO(z.read(name)))
        return
    with open(path, "rb") as f:
        for _ in range(5):
            scan(f)


def load_pickle(path, unsafe):
    """torch.load of a .pth/.pt/.bin file; restricted to weights unless `unsafe`."""
    import torch
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            if any(n.endswith("constants.pkl") for n in z.namelist()):
                fail("%s is a TorchScript archive (torch.jit.save), which holds code, not a state dict: "
                     "export the weights with torch.save(model.state_dict(), PATH) and convert that" % path)
    if unsafe:
        print("convert_torchvision_weights: WARNING: --unsafe-pickle: fully unpickling %s; a pickle can "
              "run any command as you: use this only for a file you made or trust completely" % path,
              file=sys.stderr)
        return torch.load(path, map_location="cpu")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # PyTorch < 2.1's weights-only unpickler lacks some opcodes (BINFLOAT: a float such as a
            # checkpoint's "best_acc"). Then every global the file's pickles name is checked
            # against the same allowlist without running them, and only a file naming none
            # outside it is unpickled. (torch.load(pickle_module=...) cannot restrict it: 1.13
            # replaces any pickle_module by pickle when weights_only is False.)
            if "Unsupported operand" not in str(e):
                raise
            check_pickle_globals(path)
            return torch.load(path, map_location="cpu")
    except Exception as e:  # pickle.UnpicklingError wrapping the restricted unpickler's refusal
        text = str(e)
        if "Weights only load failed" in text or "WeightsUnpickler" in text or isinstance(e, RefusedGlobal):
            wanted = e.name if isinstance(e, RefusedGlobal) else refused_global(text)
            fail("%s: refused: the file needs %s to load, and unpickling it could run code "
                 "(only tensors, dicts, lists, numbers and strings are loaded safely). If it holds a whole "
                 "model, export a plain state dict where you made it: torch.save(model.state_dict(), PATH). "
                 "If you made the file yourself or trust its source completely, rerun with --unsafe-pickle." %
                 (path, "the global " + wanted if wanted else "more than weights (" + text.split("error: ")[-1] + ")"))
        raise


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
    ap.add_argument("input", nargs="?", help="a .pth/.pt/.bin file (state_dict or checkpoint dict) or .safetensors")
    ap.add_argument("output", help="the .safetensors file to write")
    ap.add_argument("--model", help="torchvision architecture to check the names against (resnet18, resnet50, ...)")
    ap.add_argument("--random", metavar="MODEL", help="write torchvision's random initialisation of MODEL instead")
    ap.add_argument("--seed", type=int, default=0, help="seed for --random")
    ap.add_argument("--classes", type=int, default=1000, help="fc outputs for --random")
    ap.add_argument("--unsafe-pickle", action="store_true",
                    help="fully unpickle INPUT (can run code: only for files you trust completely)")
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
        if not os.path.isfile(a.input):
            fail("%s: not a regular file" % a.input)
        with open(a.input, "rb") as f:
            magic = f.read(16)
        if a.input.endswith(".safetensors"):
            obj = read_safetensors(a.input)
        else:
            try:
                obj = load_pickle(a.input, a.unsafe_pickle)
            except SystemExit:
                raise
            except Exception as e:  # pickle errors come in many types
                fail("%s: not a PyTorch file (%s; starts with %r)" % (a.input, e, magic[:8]))
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
