"""safetensors read and written with numpy only, from the format's spec (huggingface/safetensors
README): an 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets}}, "__metadata__" optional, then the tensors' bytes. Shared by the e2e tests."""
import json
import struct

import numpy as np

_DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64}


def read_safetensors(path):
    """{name: numpy array} of every tensor in the file."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(blob[8 + n + b:8 + n + end], _DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def write_safetensors(path, tensors):
    """Writes {name: numpy array} (float32, float64, int32 or int64); the header padded to 8 bytes."""
    header, blobs, offset = {}, [], 0
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
