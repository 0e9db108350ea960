#!/usr/bin/python3
"""End-to-end tests of slide-tile on the real sample slides (run by ctest, one class per test).

Environment: SLIDE_TILE (the binary), SLIDE_SAMPLE_DIR (sample_data/), SLIDE_README (README.md).
"""
import io
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import lmdb
import numpy as np
import openslide
from PIL import Image
from e2e_util import report_tables, screenshot, slide_file_stem

TILE = os.environ["SLIDE_TILE"]
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
SLIDES = os.path.join(SAMPLE, "slides")
BAD = os.path.join(SAMPLE, "bad")
CMU = os.path.join(SLIDES, "CMU-1-Small-Region.svs")
HEADER = struct.Struct("<4sHHIiqqIIBBHI")


def run(args, **kw):
    return subprocess.run([TILE] + args, capture_output=True, text=True, **kw)


def dump(store):
    """Every record of every database, as {db: {key: value}} of bytes."""
    env = lmdb.open(store, readonly=True, lock=False, max_dbs=4)
    out = {}
    with env.begin() as txn:
        for name in (b"meta", b"slides", b"tiles"):
            db = env.open_db(name, txn=txn, create=False)
            out[name] = {k: v for k, v in txn.cursor(db=db)}
    env.close()
    out[b"meta"].pop(b"command_line", None)  # names the output path, which differs between runs
    return out


def store_diff(a, b):
    """A short description of how two dump()s differ, or None when equal (assertEqual on dumps
    of thousands of tiles would spend minutes in difflib)."""
    for name in sorted(set(a) | set(b)):
        da, db = a.get(name, {}), b.get(name, {})
        if da == db:
            continue
        only_a, only_b = sorted(set(da) - set(db)), sorted(set(db) - set(da))
        changed = sorted(k for k in set(da) & set(db) if da[k] != db[k])
        first = changed[:1]
        detail = ""
        if first:
            k = first[0]
            detail = "; first changed %r: %r... vs %r..." % (k, da[k][:80], db[k][:80])
        return "db %r: %d keys only in first, %d only in second, %d changed%s" % (
            name, len(only_a), len(only_b), len(changed), detail)
    return None


def info(store):
    r = run(["info", store, "--json"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tiles_of(store):
    d = dump(store)[b"tiles"]
    out = []
    for k, v in sorted(d.items()):
        f = HEADER.unpack_from(v)
        out.append((struct.unpack(">Q", k)[0], f, v[f[2]:f[2] + f[12]]))
    return out


def composite_white(region):
    """OpenSlide's RGBA (not premultiplied in Python) over white, as uint8 RGB."""
    a = np.asarray(region).astype(np.float64)
    rgb, alpha = a[..., :3], a[..., 3:4] / 255.0
    return np.round(rgb * alpha + 255.0 * (1 - alpha)).astype(np.uint8)


def area_resample(src, x0, y0, scale, size):
    """Exact area average (what INTER_AREA computes): output pixel (i, j) is the mean of source
    [x0 + i * scale, + scale) x [y0 + j * scale, + scale), partial pixels weighted by overlap.
    PIL's BOX filter is not this at non-integer scales (it differs by ~1 level on noise)."""
    def weights(origin, n):
        m = np.zeros((size, n))
        for i in range(size):
            a = origin + i * scale
            for k in range(int(np.floor(a)), int(np.ceil(a + scale))):
                m[i, min(k, n - 1)] += max(0.0, min(a + scale, k + 1) - max(a, k)) / scale
        return m
    wy, wx = weights(y0, src.shape[0]), weights(x0, src.shape[1])
    return np.einsum("ij,jkc,lk->ilc", wy, src.astype(np.float64), wx, optimize=True)


# ---------------------------------------------------------------------------------------------
# Issue 20: inputs built by the tests themselves (tiny, deterministic).

def forged_huge_tiff(path, w=10_000_000, h=10_000_000):
    """A 100-byte TIFF whose header declares w x h RGB px, uncompressed, in one 3-byte strip."""
    pixel_off, ifd_off = 8, 16
    entries = [(256, 4, 1, w), (257, 4, 1, h), (258, 3, 3, None), (259, 3, 1, 1), (262, 3, 1, 2),
               (273, 4, 1, pixel_off), (277, 3, 1, 3), (278, 4, 1, h), (279, 4, 1, 3)]
    bps_off = ifd_off + 2 + 12 * len(entries) + 4
    out = bytearray(b"II*\x00" + struct.pack("<I", ifd_off) + b"\xff\x00\x00" + b"\x00" * 5)
    out += struct.pack("<H", len(entries))
    for tag, typ, count, value in entries:
        if tag == 258:
            out += struct.pack("<HHII", tag, typ, count, bps_off)
        elif typ == 3 and count == 1:
            out += struct.pack("<HHIHH", tag, typ, count, value, 0)
        else:
            out += struct.pack("<HHII", tag, typ, count, value)
    out += struct.pack("<I", 0) + struct.pack("<HHH", 8, 8, 8)
    with open(path, "wb") as f:
        f.write(bytes(out))


def jpeg_pyramid(path, size=1024, tile=256, levels=3, corrupt=None):
    """A generic tiled JPEG TIFF pyramid (OpenSlide's generic-tiff: level 0 then reduced levels),
    each tile a complete JPEG stream from PIL. corrupt=(col, row): 64 bytes in the middle of that
    level-0 tile's entropy-coded data are zeroed; the coarser levels (which the tissue thumbnail
    reads) stay intact."""
    rng = np.random.default_rng(1)
    base = np.full((size, size, 3), 255, np.uint8)
    yy, xx = np.mgrid[0:size, 0:size]
    blob = (xx - size / 2) ** 2 + (yy - size / 2) ** 2 < (size * 0.4) ** 2
    noise = rng.integers(0, 60, (size, size, 1))
    base[blob] = (np.array([200, 110, 170]) + noise[blob] - 30).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(base)
    out = bytearray(b"II*\x00\x00\x00\x00\x00")
    next_ptr = 4
    for lv in range(levels):
        s = size >> lv
        im = img.resize((s, s), Image.BOX) if lv else img
        n = (s + tile - 1) // tile
        offsets, counts = [], []
        for r in range(n):
            for c in range(n):
                t = Image.new("RGB", (tile, tile), "white")
                t.paste(im.crop((c * tile, r * tile, min(s, (c + 1) * tile), min(s, (r + 1) * tile))))
                b = io.BytesIO()
                t.save(b, "JPEG", quality=90, subsampling=2)
                data = bytearray(b.getvalue())
                if lv == 0 and corrupt == (c, r):
                    sos = data.index(b"\xff\xda")
                    mid = sos + (len(data) - sos) // 2
                    data[mid:mid + 64] = b"\x00" * 64
                offsets.append(len(out))
                counts.append(len(data))
                out += data + b"\x00" * (len(data) % 2)

        def array(fmt, values):
            off = len(out)
            out.extend(struct.pack("<%d%s" % (len(values), fmt), *values))
            return off
        off_value = array("I", offsets) if len(offsets) > 1 else offsets[0]
        cnt_value = array("I", counts) if len(counts) > 1 else counts[0]
        bps = array("H", [8, 8, 8])
        entries = [(254, 4, 1, 1 if lv else 0), (256, 4, 1, s), (257, 4, 1, s), (258, 3, 3, bps), (259, 3, 1, 7),
                   (262, 3, 1, 6), (277, 3, 1, 3), (284, 3, 1, 1), (322, 4, 1, tile), (323, 4, 1, tile),
                   (324, 4, len(offsets), off_value), (325, 4, len(counts), cnt_value), (530, 3, 2, 2 | (2 << 16))]
        ifd = len(out)
        struct.pack_into("<I", out, next_ptr, ifd)
        out += struct.pack("<H", len(entries))
        for tag, typ, count, value in entries:
            if typ == 3 and count == 1:
                out += struct.pack("<HHIHH", tag, typ, count, value, 0)
            else:
                out += struct.pack("<HHII", tag, typ, count, value)
        next_ptr = len(out)
        out += struct.pack("<I", 0)
    with open(path, "wb") as f:
        f.write(bytes(out))


def failed_lines(stderr):
    return [line for line in stderr.splitlines() if "FAILED" in line or "slide failed" in line]


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slide_e2e_")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, *p):
        return os.path.join(self.tmp, *p)


class TestSample(Base):
    """The README's sample run, and the README's Python reader example on its store."""

    def test_readme_sample_and_python_reader(self):
        store, qc = self.path("cmu1"), self.path("qc")
        r = run([CMU, "--mpp", "0.5", "-o", store, "--qc-dir", qc])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1 tiled", r.stderr)
        j = info(store)
        self.assertEqual(len(j["slides"]), 1)
        rec = j["slides"][0]
        self.assertEqual(rec["slide_id"], "CMU-1-Small-Region")
        self.assertEqual(rec["vendor"], "aperio")
        self.assertEqual(rec["status"], "complete")
        self.assertGreater(rec["tile_count"], 0)
        self.assertEqual(j["tile_count"], rec["tile_count"])
        # The QC picture at --qc-mpp 8 (2220 x 2967 px at 0.499 um/px: 138 x 185 px, rounded down by
        # the thumbnail), under a title, over a legend band, at least 420 px wide.
        from PIL import Image
        with Image.open(os.path.join(qc, "CMU-1-Small-Region.png")) as im:
            self.assertEqual(im.width, 420)
            self.assertIn(im.height - 28 - 30, (184, 185))
        # A finer --qc-mpp gives a larger picture (4 um/px: 277 x 370).
        r = run([CMU, "--mpp", "0.5", "-o", self.path("cmu1b"), "--qc-dir", qc + "4", "--qc-mpp", "4", "-q"])
        self.assertEqual(r.returncode, 0, r.stderr)
        with Image.open(os.path.join(qc + "4", "CMU-1-Small-Region.png")) as im:
            self.assertIn(im.height - 28 - 30, (369, 370))
        # The README's example, verbatim.
        with open(os.environ["SLIDE_README"]) as f:
            readme = f.read()
        m = re.search(r"<!-- python-reader-example -->\s*```python\n(.*?)```", readme, re.S)
        self.assertIsNotNone(m, "README has no python reader example")
        script = self.path("reader.py")
        with open(script, "w") as f:
            f.write(m.group(1))
        self.assertLessEqual(len(m.group(1).strip().splitlines()), 14)
        p = subprocess.run([sys.executable, script, store], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(lines[0], "tile size 256")
        self.assertEqual(lines[1], "CMU-1-Small-Region %d tiles" % rec["tile_count"])
        self.assertEqual(len(lines), 2 + rec["tile_count"])
        self.assertTrue(lines[2].startswith("0 0 -1 "), lines[2])
        self.assertTrue(lines[2].endswith("(256, 256)"), lines[2])


class TestBadSlides(Base):
    def test_each_bad_file_fails_alone(self):
        store = self.path("s")
        inputs = [os.path.join(BAD, "broken.svs"), CMU, os.path.join(BAD, "unopenable.tiff"),
                  os.path.join(BAD, "unreadable.svs"), os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs")]
        r = run(inputs + ["--mpp", "1.0", "-o", store])
        self.assertEqual(r.returncode, 3, r.stderr)
        err = r.stderr
        self.assertRegex(err, r"broken\s+FAILED.*INVALID_ARGUMENT.*broken\.svs.*not a slide")
        self.assertRegex(err, r"unopenable\s+FAILED.*DATA_LOSS.*unopenable\.tiff.*Unsupported TIFF compression: 52479")
        self.assertRegex(err, r"unreadable\s+FAILED.*DATA_LOSS.*unreadable\.svs.*Bogus marker length")
        self.assertRegex(err, r"TCGA-CR-7395-01A-01-TS1\s+FAILED.*FAILED_PRECONDITION.*no resolution.*--source-mpp")
        self.assertIn("1 tiled", err)
        self.assertIn("4 failed", err)
        j = info(store)
        self.assertEqual([s["slide_id"] for s in j["slides"]], ["CMU-1-Small-Region"])
        # The store holds exactly the good slide's tiles: nothing of the failed ones.
        self.assertEqual(j["tile_count"], j["slides"][0]["tile_count"])
        # A rerun retries only the failed slides and fails them the same way.
        r2 = run(inputs + ["--mpp", "1.0", "-o", store])
        self.assertEqual(r2.returncode, 3)
        self.assertIn("1 already complete", r2.stderr)

    def test_missing_input_is_a_usage_error(self):
        r = run([self.path("nope.svs"), "--mpp", "0.5", "-o", self.path("s")])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("nope.svs", r.stderr)
        self.assertIn("NOT_FOUND", r.stderr)


class TestReport(Base):
    """Issue 16 item 5: report.html in the store's directory after a run: the store's slides as
    slide-tile info has them, this run's failures with their errors, the QC pictures inlined, and a
    page a real browser renders."""

    def test_report_lists_slides_failures_and_qc_pictures(self):
        store, qc = self.path("s"), self.path("qc")
        r = run([os.path.join(BAD, "broken.svs"), CMU, "--mpp", "1.0", "-o", store, "--qc-dir", qc])
        self.assertEqual(r.returncode, 3, r.stderr)
        tables, images = report_tables(os.path.join(store, "report.html"))
        j = info(store)
        slides = tables["slides"]
        self.assertEqual(slides[0][:4], ["slide", "label", "tiles", "candidates"])
        self.assertEqual([(row[0], int(row[2]), int(row[3])) for row in slides[1:]],
                         [(s["slide_id"], s["tile_count"], s["candidate_tiles"]) for s in j["slides"]])
        run_facts = dict((row[0], row[1]) for row in tables["run"])
        self.assertEqual((run_facts["tiled"], run_facts["failed"]), ("1", "1"))
        failures = tables["failures"]
        self.assertEqual(len(failures), 2)
        self.assertEqual(failures[1][:2], ["broken", "failed"])
        self.assertTrue(failures[1][2].endswith("broken.svs"))
        self.assertIn("INVALID_ARGUMENT", failures[1][3])
        self.assertIn("not a slide", failures[1][3])
        import base64
        with open(os.path.join(qc, "CMU-1-Small-Region.png"), "rb") as f:
            self.assertEqual([base64.b64decode(src.split(",", 1)[1]) for src in images], [f.read()])
        # A rerun (nothing left to tile but the broken slide) keeps the store's slides in it.
        r = run([os.path.join(BAD, "broken.svs"), CMU, "--mpp", "1.0", "-o", store, "--qc-dir", qc])
        self.assertEqual(r.returncode, 3, r.stderr)
        tables, _ = report_tables(os.path.join(store, "report.html"))
        self.assertEqual([row[0] for row in tables["slides"][1:]], ["CMU-1-Small-Region"])
        self.assertEqual(dict((row[0], row[1]) for row in tables["run"])["already complete"], "1")

        a = screenshot(os.path.join(store, "report.html"), self.path("report.png"), 1280, 2000)
        if a is None:
            self.skipTest("no Chromium runs here (scripts/install-deps.sh installs chromium-headless-shell)")
        # The QC picture was decoded and drawn: its green tissue mask is on the page (which has
        # only greys of its own).
        green = ((a[..., 1] > 150) & (a[..., 0] < 100) & (a[..., 2] < 100)).sum()
        self.assertGreater(green, 200)


def make_reference(tmp, args):
    """The uninterrupted run: its store's records and how long it took (s)."""
    ref = os.path.join(tmp, "reference")
    t0 = time.monotonic()
    r = run(args + ["-o", ref])
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    return dump(ref), seconds


# Three slides, ~2000 small raw tiles in transactions of 16: a run of a second or two with
# ~130 commits, so kills land before, between and inside slides.
RESUME_ARGS = [os.path.join(SLIDES, "test3-DAPI-2-387.ndpi"), CMU, os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs"),
               "--source-mpp", "0.25", "--mpp", "0.5", "--tile-size", "64", "--min-tissue", "0.1",
               "--threads", "1", "--txn-tiles", "16", "--encoding", "raw", "-q"]


class TestResume(Base):
    def test_sigkill_at_several_points_then_resume_is_identical(self):
        ref_dump, seconds = make_reference(self.tmp, RESUME_ARGS)
        n_tiles = len(ref_dump[b"tiles"])
        self.assertGreater(n_tiles, 1000)
        killed_mid_run = 0
        # Kill points as fractions of the reference run's time, so they land mid-run on any machine.
        for i, delay in enumerate(f * seconds for f in (0.02, 0.2, 0.4, 0.6, 0.85)):
            store = self.path("k%d" % i)
            p = subprocess.Popen([TILE] + RESUME_ARGS + ["-o", store], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            rc = p.wait()
            if rc == -signal.SIGKILL and os.path.exists(os.path.join(store, "data.mdb")):
                try:
                    partial = dump(store)
                except lmdb.Error:
                    partial = None  # killed while the store was being created: no database yet
                if partial is not None and len(partial[b"tiles"]) < n_tiles:
                    killed_mid_run += 1
            # A second kill during the resume, then a full resume.
            p = subprocess.Popen([TILE] + RESUME_ARGS + ["-o", store], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.15 * seconds)
            p.send_signal(signal.SIGKILL)
            p.wait()
            r = run(RESUME_ARGS + ["-o", store])
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIsNone(store_diff(dump(store), ref_dump), "store resumed after a kill at %.2f s" % delay)
        self.assertGreaterEqual(killed_mid_run, 2, "the kills should land mid-run")


class TestInterrupt(Base):
    def test_ctrl_c_exits_130_and_resumes(self):
        ref_dump, seconds = make_reference(self.tmp, RESUME_ARGS)
        store = self.path("s")
        p = subprocess.Popen([TILE] + RESUME_ARGS + ["-o", store], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5 * seconds)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 130, err)
        self.assertIn("interrupted", err)
        r = run(RESUME_ARGS + ["-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIsNone(store_diff(dump(store), ref_dump))


class TestStoreErrors(Base):
    def test_unwritable_output(self):
        blocker = self.path("file")
        with open(blocker, "w") as f:
            f.write("x")
        r = run([CMU, "--mpp", "0.5", "-o", os.path.join(blocker, "store")])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(os.path.join(blocker, "store"), r.stderr)

    def test_settings_mismatch_is_refused(self):
        store = self.path("s")
        self.assertEqual(run([CMU, "--mpp", "1.0", "-o", store]).returncode, 0)
        before = dump(store)
        r = run([CMU, "--mpp", "1.0", "--tile-size", "224", "-o", store])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("FAILED_PRECONDITION", r.stderr)
        self.assertIn("tile_size_px", r.stderr)
        self.assertIsNone(store_diff(dump(store), before))

    def test_full_disk_keeps_committed_slides(self):
        # A file-size limit makes the store's writes fail (EFBIG) the way a full disk does (ENOSPC).
        store = self.path("s")
        common = ["--mpp", "2.0", "--min-tissue", "0", "--encoding", "raw", "--txn-tiles", "8", "-o", store]
        self.assertEqual(run([CMU] + common + ["-q"]).returncode, 0)
        first = info(store)
        size = os.path.getsize(os.path.join(store, "data.mdb"))

        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 256 * 1024, size + 256 * 1024))

        big = [os.path.join(SLIDES, "test3-DAPI-2-387.ndpi"), "--source-mpp", "0.25"]
        r = subprocess.run([TILE, CMU] + big + common, capture_output=True, text=True, preexec_fn=limit)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
        self.assertIn("file-size limit", r.stderr)
        self.assertEqual(r.stderr.count(store), 1, r.stderr)  # named once, not once per layer
        after = info(store)
        self.assertEqual(after["slides"], first["slides"])
        self.assertEqual(after["tile_count"], first["tile_count"])
        # Without the limit the same command finishes the store.
        r = run([CMU] + big + common)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(info(store)["slides"]), 2)


class TestPatches(Base):
    def test_tile_size_defaults_to_the_patches_own_size(self):
        # 150-px Kather patches with no --tile-size: 150-px tiles (the default 256 would refuse them:
        # patches are never upsampled); a folder of mixed sizes keeps the default and says so.
        store = self.path("k150")
        r = run(["--patches", os.path.join(SAMPLE, "patches", "kather2016-samples"), "-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--tile-size from the patches", r.stderr)
        j = info(store)
        self.assertEqual((j["tile_size_px"], j["tile_count"]), (150, 24))
        mixed = self.path("mixed")
        for cls, src in (("a", os.path.join(SAMPLE, "patches", "kather2016-samples", "01_TUMOR")),
                         ("b", os.path.join(SAMPLE, "patches", "lc25000-lung-subset", "lung_n"))):
            os.makedirs(os.path.join(mixed, cls))
            for name in sorted(os.listdir(src))[:2]:
                shutil.copy(os.path.join(src, name), os.path.join(mixed, cls, name))
        r = run(["--patches", mixed, "-o", self.path("mixed-store")])
        self.assertIn("patches of several sizes", r.stderr)
        self.assertEqual(r.returncode, 3, r.stderr)  # 256 px: the 150- and 224-px patches are refused
        self.assertIn("upsampling is refused", r.stderr)

    def test_kather_patch_folder(self):
        store = self.path("k")
        r = run(["--patches", os.path.join(SAMPLE, "patches", "kather2016-samples"), "--tile-size", "128", "-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        j = info(store)
        self.assertEqual(j["label_names"], ["01_TUMOR", "02_STROMA", "03_COMPLEX", "04_LYMPHO", "05_DEBRIS",
                                            "06_MUCOSA", "07_ADIPOSE", "08_EMPTY"])
        self.assertEqual(len(j["slides"]), 24)
        self.assertEqual(j["tile_count"], 24)
        tiles = tiles_of(store)
        labels = [f[4] for _, f, _ in tiles]
        self.assertEqual(labels, [i // 3 for i in range(24)])
        for _, f, payload in tiles:
            self.assertEqual((f[7], f[8]), (128, 128))
            self.assertEqual(Image.open(io.BytesIO(payload)).size, (128, 128))
        # Tile 0 is the first TUMOR patch (150 x 150) area-resampled to 128: equal to the exact area
        # average up to rounding in a raw store, and within JPEG's error in the default one.
        tumor = os.path.join(SAMPLE, "patches", "kather2016-samples", "01_TUMOR")
        src = np.asarray(Image.open(os.path.join(tumor, sorted(os.listdir(tumor))[0])).convert("RGB"))
        self.assertEqual(src.shape, (150, 150, 3))
        want = area_resample(src, 0, 0, 150 / 128, 128)
        got = np.asarray(Image.open(io.BytesIO(tiles[0][2])).convert("RGB")).astype(float)
        # JPEG's own error on this texture: libjpeg (through PIL) at the store's quality, 4:2:0.
        buf = io.BytesIO()
        Image.fromarray(np.round(want).astype(np.uint8)).save(buf, "JPEG", quality=j["jpeg_quality"], subsampling=2)
        jpeg_error = np.abs(want - np.asarray(Image.open(buf).convert("RGB")).astype(float)).mean()
        self.assertLess(np.abs(want - got).mean(), 1.1 * jpeg_error + 0.1)
        raw = self.path("raw")
        r = run(["--patches", os.path.join(SAMPLE, "patches", "kather2016-samples"), "--tile-size", "128",
                 "--encoding", "raw", "-o", raw])
        self.assertEqual(r.returncode, 0, r.stderr)
        got = np.frombuffer(tiles_of(raw)[0][2], np.uint8).reshape(128, 128, 3).astype(float)
        self.assertLessEqual(np.abs(want - got).max(), 0.5 + 1e-6)

    def test_patch_smaller_than_tile_fails_alone(self):
        r = run(["--patches", os.path.join(SAMPLE, "patches", "kather2016-samples"), "--tile-size", "224",
                 "-o", self.path("k")])
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("smaller than the tile size 224", r.stderr)


class TestManifestShards(Base):
    def test_manifest_labels_and_shards(self):
        csv = self.path("m.csv")
        with open(csv, "w") as f:
            f.write("slide_id,path,label\n")
            f.write("cmu,%s,tumor\n" % CMU)
            f.write("tcga,%s,normal\n" % os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs"))
            f.write("ndpi,%s,tumor\n" % os.path.join(SLIDES, "test3-DAPI-2-387.ndpi"))
        common = ["--manifest", csv, "--mpp", "2.0", "--source-mpp", "0.25", "--min-tissue", "0.25"]
        full = self.path("full")
        r = run(common + ["-o", full])
        self.assertEqual(r.returncode, 0, r.stderr)
        j = info(full)
        self.assertEqual(j["label_names"], ["tumor", "normal"])
        by_id = {s["slide_id"]: s for s in j["slides"]}
        self.assertEqual(set(by_id), {"cmu", "tcga", "ndpi"})
        self.assertEqual(by_id["tcga"]["label_index"], 1)
        self.assertEqual(by_id["tcga"]["mpp_source"], "override")
        self.assertEqual(by_id["cmu"]["mpp_source"], "vendor")
        for _, f, _ in tiles_of(full):
            self.assertEqual(f[4], [0, 1, 0][f[3]])
        s0, s1 = self.path("s0"), self.path("s1")
        self.assertEqual(run(common + ["--shard", "0/2", "-o", s0]).returncode, 0)
        self.assertEqual(run(common + ["--shard", "1/2", "-o", s1]).returncode, 0)
        self.assertEqual([s["slide_id"] for s in info(s0)["slides"]], ["cmu", "ndpi"])
        self.assertEqual([s["slide_id"] for s in info(s1)["slides"]], ["tcga"])
        self.assertEqual(info(s0)["tile_count"] + info(s1)["tile_count"], j["tile_count"])

    def test_manifest_with_utf8_bom(self):  # issue 20, item 14: as Excel saves "CSV UTF-8"
        csv = self.path("m.csv")
        with open(csv, "w", encoding="utf-8-sig") as f:
            f.write("slide_id,path,label\r\ncmu,%s,tumor\r\n" % CMU)
        with open(csv, "rb") as f:
            self.assertEqual(f.read(3), b"\xef\xbb\xbf")
        store = self.path("s")
        r = run(["--manifest", csv, "--mpp", "2.0", "-o", store, "-q"])
        self.assertEqual(r.returncode, 0, r.stderr)
        j = info(store)
        self.assertEqual([s["slide_id"] for s in j["slides"]], ["cmu"])
        self.assertEqual(j["label_names"], ["tumor"])

    def test_bad_manifest(self):
        csv = self.path("m.csv")
        with open(csv, "w") as f:
            f.write("id,file\nx,y\n")
        r = run(["--manifest", csv, "--mpp", "1", "-o", self.path("s")])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("m.csv:1", r.stderr)


class TestPixels(Base):
    def test_raw_tiles_equal_openslide_reads(self):
        store = self.path("s")
        r = run([CMU, "--mpp", "0.5", "--encoding", "raw", "--tile-size", "256", "-o", store, "-v"])
        self.assertEqual(r.returncode, 0, r.stderr)
        # The path under test: source JPEG tiles decoded by TurboJPEG, not openslide_read_region.
        self.assertIn("direct decode on for a level", r.stderr)
        s = openslide.OpenSlide(CMU)
        tiles = tiles_of(store)
        self.assertGreater(len(tiles), 10)
        for _, f, payload in tiles[::7]:
            x, y, w, h = f[5], f[6], f[7], f[8]
            got = np.frombuffer(payload, np.uint8).reshape(h, w, 3)
            want = composite_white(s.read_region((x, y), 0, (w, h)))
            self.assertTrue(np.array_equal(got, want), "tile at (%d, %d) differs from OpenSlide" % (x, y))

    def test_resampled_tiles_are_exact_area_averages(self):
        # 1.0 um/px on a 0.499 um/px slide: level 0 area-resampled by 2.004. Tile (col, row) covers
        # level-0 [col * 128 * 2.004, + 256.5) in x (likewise y); the header's x, y are that rounded.
        store = self.path("s")
        r = run([CMU, "--mpp", "1.0", "--encoding", "raw", "--tile-size", "128", "-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        s = openslide.OpenSlide(CMU)
        scale = 1.0 / float(s.properties["openslide.mpp-x"])
        tiles = tiles_of(store)
        self.assertEqual(len(tiles), 29)
        for _, f, payload in tiles[::4]:
            fx, fy = round(f[5] / (128 * scale)) * 128 * scale, round(f[6] / (128 * scale)) * 128 * scale
            self.assertEqual((round(fx), round(fy)), (f[5], f[6]))
            ix, iy = int(np.floor(fx)), int(np.floor(fy))
            region = composite_white(s.read_region((ix, iy), 0, (260, 260)))
            want = area_resample(region, fx - ix, fy - iy, scale, 128)
            got = np.frombuffer(payload, np.uint8).reshape(128, 128, 3).astype(float)
            self.assertLessEqual(np.abs(got - want).max(), 0.5 + 1e-6, "tile at (%d, %d)" % (f[5], f[6]))


class TestPassthrough(Base):
    def test_aligned_grid_copies_source_jpeg_tiles(self):
        store = self.path("s")
        r = run([CMU, "--mpp", "0.5", "--tile-size", "240", "--min-tissue", "0", "-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        rec = info(store)["slides"][0]
        self.assertTrue(rec["passthrough"])
        self.assertEqual(rec["tile_count"], (2220 // 240) * (2967 // 240))
        s = openslide.OpenSlide(CMU)
        for _, f, payload in tiles_of(store)[::9]:
            x, y = f[5], f[6]
            self.assertEqual((x % 240, y % 240), (0, 0))
            got = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB")).astype(float)
            want = composite_white(s.read_region((x, y), 0, (240, 240))).astype(float)
            self.assertLess(np.abs(got - want).mean(), 1.0)
        # --no-passthrough decodes and re-encodes: same tiles, not the same bytes.
        store2 = self.path("s2")
        r = run([CMU, "--mpp", "0.5", "--tile-size", "240", "--min-tissue", "0", "--no-passthrough", "-o", store2])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(info(store2)["slides"][0]["passthrough"])
        self.assertEqual(len(tiles_of(store2)), rec["tile_count"])


class TestExport(Base):
    def test_export_tiles_as_files(self):
        store, out = self.path("s"), self.path("out")
        self.assertEqual(run([CMU, "--mpp", "1.0", "-o", store, "-q"]).returncode, 0)
        r = run(["export", store, "-o", out, "--slide", "CMU-1-Small-Region", "--limit", "5"])
        self.assertEqual(r.returncode, 0, r.stderr)
        files = sorted(os.listdir(out))
        self.assertEqual(len(files), 5)
        self.assertTrue(files[0].startswith("CMU-1-Small-Region_t0_x"))
        self.assertEqual(Image.open(os.path.join(out, files[0])).size, (256, 256))
        r = run(["export", store, "-o", out, "--slide", "nope"])
        self.assertEqual(r.returncode, 1)
        self.assertIn("'nope' is not in store", r.stderr)


class TestSlides(Base):
    """Every sample slide at two resolutions: vendor, backend, mpp, the level read and the tiles kept.

    The expected (level, tiles) were fixed after checking each run's QC picture by eye (tissue
    mask on the tissue, the grid on the mask). boxes.tiff and kidney-48-5.tif carry no resolution;
    they get a coarse --source-mpp so that their objects are larger than the tissue mask's
    smallest object (20000 µm²). The DAPI slide is fluorescence: --stain auto detects it (a dark
    thumbnail) and thresholds brightness, so the four dark corner tiles at 0.5 um/px are dropped;
    saturation-based detection (CLAM's, the Python peer's, --stain brightfield) sees its dark
    background as tissue and keeps every tile (test_fluorescence_tissue below).
    """
    # slide, extra args, tile px, vendor, backend, level-0 size, source mpp, {target mpp: (level read, tiles kept)}
    CASES = [
        ("CMU-1-Small-Region.svs", [], 256, "aperio", "openslide", (2220, 2967), 0.499,
         {0.5: (0, 29), 1.0: (0, 6)}),
        ("TCGA-CR-7395-01A-01-TS1.svs", ["--source-mpp", "0.5"], 256, "aperio", "openslide", (4443, 3567), 0.5,
         {1.0: (1, 35), 4.0: (1, 2)}),
        ("test3-DAPI-2-387.ndpi", [], 256, "hamamatsu", "openslide", (3968, 4864), 0.2281750559,
         {0.5: (1, 52), 2.0: (3, 2)}),
        ("kidney-48-5.tif", ["--source-mpp", "8", "--min-tissue", "0.25"], 16, "tiff", "libtiff", (1493, 901), 8.0,
         {8.0: (0, 18), 16.0: (0, 5)}),
        ("boxes.tiff", ["--source-mpp", "4"], 32, "generic-tiff", "openslide", (300, 250), 4.0,
         {4.0: (0, 35), 8.0: (1, 7)}),
    ]

    def test_every_slide_at_two_resolutions(self):
        for name, extra, tile, vendor, backend, size, mpp, expected in self.CASES:
            for target, (level, count) in expected.items():
                with self.subTest(slide=name, mpp=target):
                    store = self.path("%s_%s" % (name, target))
                    r = run([os.path.join(SLIDES, name), "--mpp", str(target), "--tile-size", str(tile),
                             "-o", store, "-q"] + extra)
                    self.assertEqual(r.returncode, 0, r.stderr)
                    rec = info(store)["slides"][0]
                    self.assertEqual(rec["vendor"], vendor)
                    self.assertEqual(rec["backend"], backend)
                    self.assertEqual((rec["width_l0"], rec["height_l0"]), size)
                    self.assertAlmostEqual(rec["source_mpp_um"], mpp, places=6)
                    self.assertEqual(rec["level"], level)
                    self.assertEqual(rec["tile_count"], count)
                    self.assertEqual(len(tiles_of(store)), count)

    def test_fluorescence_tissue(self):
        # Issue 16 item 2: the DAPI slide's tissue covers most of the section but not the dark corners
        # (about 86% of the thumbnail, checked by eye on a contrast-stretched thumbnail); brightfield
        # detection calls all of it tissue.
        dapi = os.path.join(SLIDES, "test3-DAPI-2-387.ndpi")
        fractions = {}
        for stain in ("auto", "fluorescence", "brightfield"):
            store = self.path("dapi_" + stain)
            r = run([dapi, "--mpp", "0.5", "-o", store, "-v", "--stain", stain])
            self.assertEqual(r.returncode, 0, r.stderr)
            rec = info(store)["slides"][0]
            fractions[stain] = (rec["tissue_fraction"], rec["tile_count"])
            # -v says what the mask is and what its filters removed.
            self.assertRegex(r.stderr, r"debug tissue slide=test3-DAPI-2-387 stain=%s signal=%s threshold=\d+" %
                             (("brightfield", "saturation") if stain == "brightfield" else ("fluorescence", "brightness")))
            self.assertIn("objects_removed=", r.stderr)
            self.assertIn("holes_filled_um2=", r.stderr)
        self.assertEqual(fractions["auto"], fractions["fluorescence"])
        self.assertGreater(fractions["auto"][0], 0.75)
        self.assertLess(fractions["auto"][0], 0.95)
        self.assertEqual(fractions["brightfield"], (1.0, 56))
        self.assertEqual(fractions["auto"][1], 52)
        # A brightfield slide: auto is brightfield, the same mask and tiles.
        got = []
        for stain in ("auto", "brightfield"):
            store = self.path("cmu_" + stain)
            self.assertEqual(run([CMU, "--mpp", "1", "-o", store, "-q", "--stain", stain]).returncode, 0)
            rec = info(store)["slides"][0]
            got.append((rec["tissue_fraction"], rec["tile_count"]))
        self.assertEqual(got[0], got[1])
        # The knobs move the mask: a fixed threshold above H&E's saturation finds no tissue, and no tile.
        store = self.path("cmu_t250")
        self.assertEqual(run([CMU, "--mpp", "1", "-o", store, "-q", "--tissue-threshold", "250"]).returncode, 0)
        self.assertEqual(info(store)["slides"][0]["tissue_fraction"], 0.0)
        self.assertEqual(run([CMU, "--mpp", "1", "-o", self.path("x"), "--tissue-threshold", "300"]).returncode, 2)
        self.assertEqual(run([CMU, "--mpp", "1", "-o", self.path("y"), "--stain", "ihc"]).returncode, 2)


# A small, quick store for the tests below: CMU at 2 um/px, every tile kept (a few dozen tiles).
SMALL = [CMU, "--mpp", "2.0", "--min-tissue", "0", "-q"]
SMALL_TABLE = SMALL[:-1]  # without -q: the per-slide table and the summary line (-q prints them only on failures)


class TestWriterLock(Base):
    """Issue 20, item 1: one writer per store; a second fails at once and changes nothing."""

    def test_second_writer_fails_naming_the_holder(self):
        import fcntl
        store = self.path("s")
        self.assertEqual(run(SMALL + ["-o", store]).returncode, 0)
        before = dump(store)
        lock_path = os.path.join(store, "writer.lock")
        self.assertTrue(os.path.exists(lock_path))
        with open(lock_path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running slide-tile holds
            f.truncate(0)
            f.write("%d python3\n" % os.getpid())
            f.flush()
            t0 = time.monotonic()
            r = run(SMALL + ["-o", store], timeout=60)
            self.assertLess(time.monotonic() - t0, 10, "the second writer must fail at once, not wait")
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertRegex(r.stderr, r"UNAVAILABLE: store %s is being written by another process \(pid %d" %
                             (re.escape(store), os.getpid()))
            self.assertNotIn("MDB_KEYEXIST", r.stderr)
            # Readers take no lock.
            self.assertEqual(info(store)["tile_count"], len(before[b"tiles"]))
            fcntl.flock(f, fcntl.LOCK_UN)
        self.assertIsNone(store_diff(dump(store), before))
        # Released: the next writer runs (and finds the slide complete).
        r = run(SMALL_TABLE + ["-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1 already complete", r.stderr)
        self.assertIsNone(store_diff(dump(store), before))

    def test_two_concurrent_runs_lose_nothing(self):
        # Two real slide-tile processes on one store: exactly one writes; the other exits 1.
        store = self.path("s")
        args = [CMU, "--mpp", "0.5", "--min-tissue", "0", "--encoding", "raw", "--threads", "1", "-q", "-o", store]
        p1 = subprocess.Popen([TILE] + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(store, "data.mdb")) and time.monotonic() < deadline:
            time.sleep(0.005)
        r2 = run(args, timeout=60)
        _, err1 = p1.communicate(timeout=60)
        codes = sorted([p1.returncode, r2.returncode])
        if codes == [0, 0]:
            self.skipTest("the first run finished before the second started (machine too fast to overlap)")
        self.assertEqual(codes, [0, 1], err1 + r2.stderr)
        loser = r2.stderr if r2.returncode == 1 else err1
        self.assertIn("is being written by another process (pid ", loser)
        j = info(store)
        self.assertEqual(len(j["slides"]), 1)
        self.assertEqual(j["tile_count"], j["slides"][0]["tile_count"])


class TestHostile(Base):
    """Issue 20: hostile inputs fail their slide alone, with a message naming the file once."""

    def test_symlink_loop_in_slide_directory(self):  # item 11
        d = self.path("slides")
        os.mkdir(d)
        os.symlink(CMU, os.path.join(d, "cmu.svs"))
        os.symlink("loop.svs", os.path.join(d, "loop.svs"))
        os.symlink("other", os.path.join(d, "other"))  # not named like a slide: ignored
        store = self.path("s")
        r = run([d, "--mpp", "2.0", "-o", store], timeout=60)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertNotIn("filesystem_error", r.stderr)
        self.assertRegex(r.stderr, r"loop\s+FAILED\s.*INVALID_ARGUMENT: %s: Too many levels of symbolic links" %
                         re.escape(os.path.join(d, "loop.svs")))
        self.assertEqual([s["slide_id"] for s in info(store)["slides"]], ["cmu"])
        # The loop given directly is the same per-slide failure.
        r = run([os.path.join(d, "loop.svs"), "--mpp", "2.0", "-o", store], timeout=60)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("symbolic links", r.stderr)
        self.assertEqual([s["slide_id"] for s in info(store)["slides"]], ["cmu"])

    def test_fifo_named_like_a_slide_is_refused(self):  # item 12
        d = self.path("slides")
        os.mkdir(d)
        fifo = os.path.join(d, "fifo.svs")
        os.mkfifo(fifo)
        store = self.path("s")
        for inputs in ([fifo, CMU], [d, CMU]):
            # A timeout, not a hang, if the FIFO is opened (nobody ever writes to it).
            r = run(inputs + ["--mpp", "2.0", "-o", store], timeout=60)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertRegex(r.stderr, r"fifo\s+FAILED\s.*INVALID_ARGUMENT: %s: is a FIFO, not a slide" %
                             re.escape(fifo))
            self.assertNotIn("Interrupted system call", r.stderr)
        self.assertEqual([s["slide_id"] for s in info(store)["slides"]], ["CMU-1-Small-Region"])
        manifest = self.path("manifest.csv")
        os.mkfifo(manifest)
        r = run(["--manifest", manifest, "--mpp", "2.0", "-o", store], timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("manifest %s: not a regular file" % manifest, r.stderr)
        self.assertEqual([s["slide_id"] for s in info(store)["slides"]], ["CMU-1-Small-Region"])

    def test_huge_declared_size_fails_that_slide_alone(self):  # item 8
        forged = self.path("huge.tif")
        forged_huge_tiff(forged)
        self.assertLess(os.path.getsize(forged), 200)
        store = self.path("s")
        r = run([forged, CMU, "--mpp", "2.0", "--min-tissue", "0", "--source-mpp", "0.5", "-o", store], timeout=120)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertNotIn("bad_alloc", r.stderr)
        self.assertRegex(r.stderr, r"huge\s+FAILED\s.*RESOURCE_EXHAUSTED: .*%s: a thumbnail band .*10000000x\d+ px "
                         r"is larger than the 1024 MiB limit" % re.escape(forged))
        self.assertIn("1 tiled", r.stderr)
        j = info(store)
        self.assertEqual([s["slide_id"] for s in j["slides"]], ["CMU-1-Small-Region"])
        self.assertEqual(j["tile_count"], j["slides"][0]["tile_count"])

    def test_bad_slide_path_named_once(self):  # item 15
        bad = self.path("a.svs")
        shutil.copy(os.path.join(BAD, "unreadable.svs"), bad)
        r = run([bad, "--mpp", "1.0", "-o", self.path("s")])
        self.assertEqual(r.returncode, 3, r.stderr)
        lines = failed_lines(r.stderr)
        self.assertEqual(len(lines), 2, r.stderr)  # the log record and the summary row
        for line in lines:
            self.assertEqual(line.count(bad), 1, line)
            self.assertRegex(line, r"DATA_LOSS: tissue mask: thumbnail band \(level 0, rows \d+\.\.\d+\): %s: "
                             r"Bogus marker length" % re.escape(bad))

    def test_corrupt_source_jpeg_tile_is_not_passed_through(self):  # item 3
        good, corrupt = self.path("good.tif"), self.path("corrupt.tif")
        jpeg_pyramid(good)
        jpeg_pyramid(corrupt, corrupt=(2, 1))
        store = self.path("s")
        args = ["--mpp", "0.5", "--source-mpp", "0.5", "--min-tissue", "0", "-o", store]
        # The intact pyramid passes through: the test's slide exercises the pass-through path.
        r = run([good] + args)
        self.assertEqual(r.returncode, 0, r.stderr)
        j = info(store)
        self.assertTrue(j["slides"][0]["passthrough"])
        self.assertEqual(j["tile_count"], 16)
        before = dump(store)
        r = run([good, corrupt] + args)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertRegex(r.stderr, r"corrupt\s+FAILED\s+0 tiles.*DATA_LOSS: %s: tile \(x0=512, y0=256\): JPEG check: "
                         r"Corrupt JPEG data" % re.escape(corrupt))
        for line in failed_lines(r.stderr):
            self.assertEqual(line.count(corrupt), 1, line)
        # Nothing of the corrupt slide reached the store (its first tiles were deleted).
        self.assertIsNone(store_diff(dump(store), before))


class TestCorruptStore(Base):
    """Issue 20: a damaged store is an error naming it, never a crash."""

    def test_truncated_data_mdb(self):  # item 6
        store = self.path("s")
        self.assertEqual(run(SMALL + ["-o", store]).returncode, 0)
        cut = self.path("cut")
        shutil.copytree(store, cut)
        data = os.path.join(cut, "data.mdb")
        os.truncate(data, os.path.getsize(data) // 2)
        with open(data, "rb") as f:
            cut_bytes = f.read()
        r = run(["info", cut])
        self.assertEqual(r.returncode, 1, r.stderr)  # not -SIGBUS
        self.assertIn("DATA_LOSS: %s is truncated" % data, r.stderr)
        r = run(["export", cut, "-o", self.path("out")])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("DATA_LOSS: %s is truncated" % data, r.stderr)
        r = run(SMALL + ["-o", cut])  # the writer checks too, and writes nothing
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("DATA_LOSS: %s is truncated" % data, r.stderr)
        with open(data, "rb") as f:
            self.assertEqual(f.read(), cut_bytes)

    def test_export_of_a_forged_raw_tile_header(self):  # item 9
        store = self.path("s")
        self.assertEqual(run(SMALL + ["--encoding", "raw", "-o", store]).returncode, 0)
        env = lmdb.open(store, max_dbs=4)
        with env.begin(write=True) as txn:
            db = env.open_db(b"tiles", txn=txn, create=False)
            key = struct.pack(">Q", 1)
            rec = bytearray(txn.get(key, db=db))
            struct.pack_into("<II", rec, 32, 100000, 100000)
            txn.put(key, bytes(rec), db=db)
        env.close()
        before = dump(store)
        out = self.path("out")
        r = run(["export", store, "-o", out, "--index", "1"], timeout=60)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertNotIn("bad_alloc", r.stderr)
        self.assertRegex(r.stderr, r"DATA_LOSS: store %s: tile 1: tile record says the tile is 100000x100000 px" %
                         re.escape(store))
        self.assertEqual(os.listdir(out) if os.path.isdir(out) else [], [])
        self.assertIsNone(store_diff(dump(store), before))
        # The intact tile next to it still exports.
        r = run(["export", store, "-o", out, "--index", "0"])
        self.assertEqual(r.returncode, 0, r.stderr)


class TestSettings(Base):
    """Issue 20, item 5: every option that decides the tiles is recorded and compared on reopen."""

    def test_changed_options_are_refused(self):
        store = self.path("s")
        self.assertEqual(run(SMALL + ["-o", store]).returncode, 0)
        before = dump(store)
        meta = {k.decode(): v.decode() for k, v in before[b"meta"].items()}
        self.assertEqual(meta["max_tiles_per_slide"], "0")
        self.assertEqual(meta["passthrough"], "true")
        self.assertEqual(meta["shard"], "0/1")
        cases = [(["--max-tiles-per-slide", "3"], "max_tiles_per_slide=0, this run asks 3"),
                 (["--thumbnail-mpp", "4"], "thumbnail_mpp_um=%s, this run asks 4" % meta["thumbnail_mpp_um"]),
                 (["--no-passthrough"], "passthrough=true, this run asks false"),
                 (["--shard", "0/2"], "shard=0/1, this run asks 0/2"),
                 (["--tissue-threshold", "20"],
                  "tissue_options='stain=auto threshold=otsu median_px=7 close_px=5 min_object_um2=20000 "
                  "min_hole_um2=20000', this run asks 'stain=auto threshold=20 median_px=7")]
        for extra, want in cases:
            with self.subTest(extra=extra):
                r = run(SMALL + extra + ["-o", store])
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn("FAILED_PRECONDITION: store %s was made with " % store, r.stderr)
                self.assertIn(want, r.stderr)
        # All at once: each difference named.
        r = run(SMALL + ["--max-tiles-per-slide", "3", "--seed", "7", "--no-passthrough", "-o", store])
        self.assertEqual(r.returncode, 1, r.stderr)
        for want in ("max_tiles_per_slide=0", "seed=0, this run asks 7", "passthrough=true"):
            self.assertIn(want, r.stderr)
        # The seed alone decides nothing without sampling, nor does --source-mpp for a slide that
        # has its own mpp (it is per slide, kept in each slide record): accepted.
        r = run(SMALL + ["--seed", "7", "--source-mpp", "0.3", "-o", store])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIsNone(store_diff(dump(store), before))

    def test_sampled_store_compares_the_seed(self):
        store = self.path("s")
        self.assertEqual(run(SMALL + ["--max-tiles-per-slide", "3", "--seed", "1", "-o", store]).returncode, 0)
        self.assertEqual(info(store)["tile_count"], 3)
        r = run(SMALL + ["--max-tiles-per-slide", "3", "--seed", "2", "-o", store])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("seed=1, this run asks 2", r.stderr)

    def test_store_without_the_new_keys_means_old_defaults(self):
        store = self.path("s")
        self.assertEqual(run(SMALL + ["-o", store]).returncode, 0)
        env = lmdb.open(store, max_dbs=4)
        with env.begin(write=True) as txn:
            db = env.open_db(b"meta", txn=txn, create=False)
            for k in (b"max_tiles_per_slide", b"seed", b"thumbnail_mpp_um", b"passthrough"):
                self.assertTrue(txn.delete(k, db=db))
        env.close()
        before = dump(store)
        r = run(SMALL_TABLE + ["-o", store])  # the defaults: accepted, nothing written
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("1 already complete", r.stderr)
        self.assertIsNone(store_diff(dump(store), before))
        r = run(SMALL + ["--max-tiles-per-slide", "3", "-o", store])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("max_tiles_per_slide=0, this run asks 3", r.stderr)



def clip_area(poly, x0, y0, x1, y1):
    """Area of a convex or simple polygon clipped to a rectangle (Sutherland-Hodgman, shoelace)."""
    def clip(pts, inside, cut):
        out = []
        for i, cur in enumerate(pts):
            prev = pts[i - 1]
            if inside(cur):
                if not inside(prev):
                    out.append(cut(prev, cur))
                out.append(cur)
            elif inside(prev):
                out.append(cut(prev, cur))
        return out

    def cut_x(x):
        return lambda a, b: (x, a[1] + (b[1] - a[1]) * (x - a[0]) / (b[0] - a[0]))

    def cut_y(y):
        return lambda a, b: (a[0] + (b[0] - a[0]) * (y - a[1]) / (b[1] - a[1]), y)

    pts = list(poly)
    for inside, cut in ((lambda p: p[0] >= x0, cut_x(x0)), (lambda p: p[0] <= x1, cut_x(x1)),
                        (lambda p: p[1] >= y0, cut_y(y0)), (lambda p: p[1] <= y1, cut_y(y1))):
        pts = clip(pts, inside, cut) if pts else pts
    return abs(sum(pts[i - 1][0] * p[1] - p[0] * pts[i - 1][1] for i, p in enumerate(pts))) / 2


class TestAnnotations(Base):
    """--annotations with --roi-only and --label-from-annotations on CMU-1-Small-Region (2220x2967),
    against coverage computed here: a grid-aligned rectangle with a hole and a diagonal triangle."""

    T = 256  # --mpp 0.499 is the slide's own mpp: level 0, one tile = 256 level-0 px
    TUMOR = ([[256, 256], [1280, 256], [1280, 1280], [256, 1280], [256, 256]],
             [[512, 512], [1024, 512], [1024, 1024], [512, 1024], [512, 512]])
    STROMA = [[1536, 1536], [2048, 1536], [1536, 2048], [1536, 1536]]

    def write_geojson(self, name, features):
        d = self.path("annot")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            f.write(features if isinstance(features, str) else json.dumps(features))
        return d

    def two_classes(self):
        return {"type": "FeatureCollection", "features": [
            {"type": "Feature", "properties": {"classification": {"name": "tumor", "colorRGB": -1}},
             "geometry": {"type": "Polygon", "coordinates": [self.TUMOR[0], self.TUMOR[1]]}},
            {"type": "Feature", "properties": {"classification": {"name": "stroma"}},
             "geometry": {"type": "MultiPolygon", "coordinates": [[self.STROMA]]}}]}

    def expected(self, x, y, min_label=0.5):
        """(roi fraction, label name or None) of the tile at level-0 (x, y)."""
        t = self.T
        rect = lambda r: clip_area([tuple(p) for p in r[:-1]], x, y, x + t, y + t)
        tumor = rect(self.TUMOR[0]) - rect(self.TUMOR[1])
        stroma = clip_area([tuple(p) for p in self.STROMA[:-1]], x, y, x + t, y + t)
        a = t * t
        label = None
        best = -1
        for name, area in (("tumor", tumor), ("stroma", stroma)):
            if area / a >= min_label and area > best:
                label, best = name, area
        return (tumor + stroma) / a, label

    def tile(self, extra, name="CMU-1-Small-Region.geojson", features=None):
        d = self.write_geojson(name, features if features is not None else self.two_classes())
        store = self.path("s%d" % len(os.listdir(self.tmp)))
        r = run([CMU, "--mpp", "0.499", "--min-tissue", "0", "-o", store, "--annotations", d] + extra)
        return r, store

    def positions(self, store):
        names = info(store).get("label_names", [])
        return {(f[5], f[6]): (names[f[4]] if f[4] >= 0 else None) for _, f, _ in tiles_of(store)}

    def test_roi_only_and_labels(self):
        base = self.path("base")
        r = run([CMU, "--mpp", "0.499", "--min-tissue", "0", "-o", base])
        self.assertEqual(r.returncode, 0, r.stderr)
        grid = sorted(self.positions(base))
        self.assertGreater(len(grid), 60)
        exp = {p: self.expected(*p) for p in grid}

        r, store = self.tile(["--roi-only"])
        self.assertEqual(r.returncode, 0, r.stderr)
        got = self.positions(store)
        want = sorted(p for p, (roi, _) in exp.items() if roi >= 0.5)
        self.assertEqual(len(want), 12 + 3)  # tumour 16 - 4 in the hole; the triangle's 1 + 2 halves
        self.assertEqual(sorted(got), want)
        self.assertTrue(all(v is None for v in got.values()))  # --roi-only alone labels nothing
        # --max-tiles-per-slide samples the tiles the ROI keeps (not the grid, then the ROI: that
        # would keep about 5 x 15 / 70 of them).
        r, store = self.tile(["--roi-only", "--max-tiles-per-slide", "5", "--seed", "3"])
        self.assertEqual(r.returncode, 0, r.stderr)
        sampled = sorted(self.positions(store))
        self.assertEqual(len(sampled), 5)
        self.assertTrue(set(sampled) <= set(want))

        r, store = self.tile(["--roi-only", "--label-from-annotations"])
        self.assertEqual(r.returncode, 0, r.stderr)
        got = self.positions(store)
        self.assertEqual(got, {p: exp[p][1] for p in want})
        self.assertEqual(sum(v == "tumor" for v in got.values()), 12)
        self.assertEqual(sum(v == "stroma" for v in got.values()), 3)

        r, store = self.tile(["--label-from-annotations", "--min-label-overlap", "0.6"])
        self.assertEqual(r.returncode, 0, r.stderr)
        got = self.positions(store)
        self.assertEqual(sorted(got), grid)  # without --roi-only every tile stays; unlabelled: -1
        self.assertEqual(got, {p: self.expected(*p, min_label=0.6)[1] for p in grid})
        self.assertEqual(sum(v == "tumor" for v in got.values()), 12)
        self.assertEqual(sum(v == "stroma" for v in got.values()), 1)  # the two half tiles lose theirs

    def test_store_records_the_annotations(self):
        import hashlib
        r, store = self.tile(["--roi-only", "--label-from-annotations"])
        self.assertEqual(r.returncode, 0, r.stderr)
        j = info(store)
        self.assertEqual(j["annotation_options"],
                         "roi_only=1 min_roi_overlap=0.5 label_from_annotations=1 min_label_overlap=0.5")
        geojson = os.path.join(self.path("annot"), "CMU-1-Small-Region.geojson")
        with open(geojson, "rb") as f:
            want = hashlib.sha256(f.read()).hexdigest()
        rec = j["slides"][0]
        self.assertEqual((rec["annotations_path"], rec["annotations_sha256"]), (geojson, want))
        base = [CMU, "--mpp", "0.499", "--min-tissue", "0", "-o", store, "--annotations", self.path("annot")]
        # Other annotation options on the same store: refused, naming them.
        r = run(base + ["--roi-only"])
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("annotation_options='roi_only=1 min_roi_overlap=0.5 label_from_annotations=1 "
                      "min_label_overlap=0.5', this run asks 'roi_only=1 min_roi_overlap=0.5 label_from_annotations=0",
                      r.stderr)
        # The same options, the file unchanged: already complete, quietly.
        r = run(base + ["--roi-only", "--label-from-annotations"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("annotations changed", r.stderr)
        # The file edited since: the rerun says the store's tiles follow the old file.
        feats = self.two_classes()
        feats["features"] = feats["features"][:1]
        self.write_geojson("CMU-1-Small-Region.geojson", feats)
        r = run(base + ["--roi-only", "--label-from-annotations"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("annotations changed since the slide was tiled", r.stderr)
        # A store without annotations records "none".
        plain = self.path("plain")
        self.assertEqual(run([CMU, "--mpp", "2", "-o", plain, "-q"]).returncode, 0)
        self.assertEqual(info(plain)["annotation_options"], "none")
        self.assertNotIn("annotations_sha256", info(plain)["slides"][0])

    def test_bad_annotations_fail_the_slide(self):
        bow = {"type": "Feature", "properties": {"classification": {"name": "x"}},
               "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [100, 100], [100, 0], [0, 100], [0, 0]]]}}
        outside = {"type": "Feature", "properties": {"classification": {"name": "x"}},
                   "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [3000, 0], [3000, 10], [0, 0]]]}}
        point = {"type": "Feature", "geometry": {"type": "Point", "coordinates": [1, 2]}}
        for features, message in (("{oops", "not valid JSON"), (bow, "Self-intersection"),
                                  (outside, "outside the slide"), (point, "'Point' is not supported")):
            r, _ = self.tile(["--roi-only"], features=features)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertIn("CMU-1-Small-Region.geojson", r.stderr)
            self.assertIn(message, r.stderr)
            self.assertIn("1 failed", r.stderr)
            shutil.rmtree(self.path("annot"))


class TestFileNames(Base):
    """Issue 22 part 3: QC pictures and exports are named by slide_file_stem and stay in their folders."""

    def test_hostile_slide_ids(self):
        work = self.path("work")
        os.makedirs(os.path.join(work, "a", "b"))
        csv = os.path.join(work, "a", "b", "m.csv")
        long_id = "L" * 300
        with open(csv, "w") as f:
            f.write("slide_id,path\n../../x,%s\n%s,%s\n" % (CMU, long_id, CMU))
        store, qc, out = (os.path.join(work, "a", "b", n) for n in ("store", "qc", "out"))
        r = run(["--manifest", csv, "--mpp", "2.0", "--min-tissue", "0", "-o", store, "--qc-dir", qc, "-q"])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(s["slide_id"] for s in info(store)["slides"]), sorted(["../../x", long_id]))
        r = run(["export", store, "-o", out, "--slide", "../../x", "--slide", long_id, "--limit", "1"])
        self.assertEqual(r.returncode, 0, r.stderr)
        stem_x, stem_long = slide_file_stem("../../x"), slide_file_stem(long_id)
        self.assertTrue(stem_x.startswith("_._.._x~"), stem_x)
        self.assertLessEqual(len(stem_long), 200)
        self.assertEqual(sorted(os.listdir(qc)), sorted([stem_x + ".png", stem_long + ".png"]))
        exported = sorted(os.listdir(out))
        self.assertEqual(len(exported), 2)
        self.assertTrue(any(n.startswith(stem_x + "_t") for n in exported), exported)
        self.assertTrue(any(n.startswith(stem_long + "_t") for n in exported), exported)
        # Nothing anywhere else: every file of the temp tree is the manifest or inside store/qc/out.
        allowed = (store + os.sep, qc + os.sep, out + os.sep)
        for root, _, files in os.walk(self.tmp):
            for name in files:
                p = os.path.join(root, name)
                self.assertTrue(p == csv or p.startswith(allowed), "written outside its folder: " + p)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
