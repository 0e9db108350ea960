"""Helpers shared by the e2e tests: the expected file name of a slide id, a snapshot of an
output directory to show that a refused run changed nothing, and report.html's tables and the
browser that renders it."""
import hashlib
import os
import shutil


def slide_file_stem(slide_id):
    """slide::core::slide_file_stem (libcore/include/slide/core/file_name.h), for the expected names:
    '/', '\\', control bytes -> '_', a leading '.' -> '_'; when changed or longer than 200 bytes,
    cut (at a UTF-8 boundary) and "~" + 12 hex digits of the id's 64-bit FNV-1a hash appended."""
    raw = slide_id.encode()
    out = bytearray(b"_"[0] if c in (0x2F, 0x5C) or c < 0x20 or c == 0x7F else c for c in raw) or bytearray(b"_")
    if out[0] == ord("."):
        out[0] = ord("_")
    if bytes(out) == raw and len(out) <= 200:
        return out.decode()
    if len(out) > 187:
        cut = 187
        while cut > 0 and (out[cut] & 0xC0) == 0x80:
            cut -= 1
        out = out[:cut]
    h = 0xCBF29CE484222325
    for c in raw:
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return out.decode() + "~%012x" % (h & 0xFFFFFFFFFFFF)


def snapshot(root):
    """{relative path: (size, mtime_ns, sha256)} of every file under root (but writer.lock, which each
    writer that takes the lock rewrites with its pid): to show that nothing changed."""
    snap = {}
    for d, _, files in os.walk(root):
        for n in files:
            if n == "writer.lock":
                continue
            p = os.path.join(d, n)
            st = os.stat(p)
            with open(p, "rb") as f:
                snap[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return snap


def store_tiles(store, slide_id):
    """(images N x H x W x 3 uint8, coords N x 2) of a slide, read as README's Python example does."""
    import io
    import json
    import struct

    import lmdb
    import numpy as np
    from PIL import Image
    env = lmdb.open(store, readonly=True, lock=False, max_dbs=4)
    slides, tiles = env.open_db(b"slides"), env.open_db(b"tiles")
    imgs, coords = [], []
    with env.begin() as txn:
        rec = json.loads(txn.get(slide_id.encode(), db=slides))
        for i in range(rec["first_tile_index"], rec["first_tile_index"] + rec["tile_count"]):
            val = txn.get(struct.pack(">Q", i), db=tiles)
            _, _, hdr, _, _, x, y, w, h, _, enc, _, n = struct.unpack_from("<4sHHIiqqIIBBHI", val)
            img = (Image.open(io.BytesIO(val[hdr:hdr + n])).convert("RGB") if enc == 1
                   else Image.frombytes("RGB", (w, h), val[hdr:hdr + n]))
            imgs.append(np.asarray(img))
            coords.append((x, y))
    env.close()
    return np.stack(imgs), np.array(coords, dtype=np.int64)


def report_tables(path):
    """{table id: [[cell text, ...] per row, header row first]} of a report.html."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.current, self.row, self.cell = {}, None, None, None
            self.images = []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "table":
                self.current = a.get("id", "")
                self.tables[self.current] = []
            elif tag == "tr" and self.current is not None:
                self.row = []
                self.tables[self.current].append(self.row)
            elif tag in ("td", "th") and self.row is not None:
                self.cell = ""
            elif tag == "img":
                self.images.append(a.get("src", ""))

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.row.append(self.cell)
                self.cell = None
            elif tag == "table":
                self.current = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    p = P()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    return p.tables, p.images


_CHROMIUM = []


def chromium():
    """A headless Chromium that runs here (it renders a one-line page), or None: not installed, or
    it cannot start in this environment (a missing library, no /dev/shm); the reason is printed."""
    import subprocess
    if _CHROMIUM:
        return _CHROMIUM[0]
    found = None
    for name in ("chromium-headless-shell", "chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            r = subprocess.run([path] + CHROMIUM_FLAGS + ["--dump-dom", "data:text/html,<p>probe</p>"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0 and "probe" in r.stdout:
                found = path
            else:
                print("%s cannot render here (exit %d): %s" % (path, r.returncode, r.stderr.strip()[-500:]))
            break
    _CHROMIUM.append(found)
    return found


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"]


def screenshot(html, png, width, height):
    """Renders the page `html` in headless Chromium into `png` (width x height px) and returns it as
    an RGB int array; None when no Chromium runs here (chromium()). Raises on a failed render."""
    import subprocess
    import numpy as np
    from PIL import Image
    browser = chromium()
    if browser is None:
        return None
    r = subprocess.run([browser] + CHROMIUM_FLAGS + ["--window-size=%d,%d" % (width, height), "--screenshot=" + png,
                                                     "file://" + os.path.abspath(html)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (browser, r.returncode, r.stderr[-2000:]))
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB")).astype(int)


def write_bag(path, slide_id, label, feats, coords):
    """A feature bag in slide/cache/bag.h's layout (features [N, D] f32, coords [N, 2] i32 at 224 px,
    the attributes slide-embed writes), written to path.partial and renamed, as the writer does."""
    import h5py
    import numpy as np
    with h5py.File(path + ".partial", "w") as f:
        f.create_dataset("features", data=feats.astype(np.float32), maxshape=(None, feats.shape[1]),
                         chunks=(min(256, len(feats)), feats.shape[1]))
        c = f.create_dataset("coords", data=coords.astype(np.int32), maxshape=(None, 2), chunks=(min(256, len(feats)), 2))
        c.attrs["patch_size"] = np.int32(224)
        c.attrs["patch_size_level0"] = np.int32(224)
        c.attrs["patch_level"] = np.int32(0)
        f.attrs["slide_id"] = slide_id
        f.attrs["label"] = label
        f.attrs["tile_size_px"] = np.int32(224)
        f.attrs["mpp_um"] = 0.0
        f.attrs["model"] = "rgb_block_means"
        f.attrs["layer"] = "16x16"
        f.attrs["feature_dim"] = np.int32(feats.shape[1])
        f.attrs["format_version"] = np.int32(1)
    os.rename(path + ".partial", path)
