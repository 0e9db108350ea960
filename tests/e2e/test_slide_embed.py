#!/usr/bin/python3
"""End-to-end tests of slide-embed on real tiles (the CMU-1 and TCGA sample slides, LC25000 lung
patches), with Debian's python3-h5py to read the bags and python3-torch / python3-torchvision for
the reference features (run by ctest, one class per test).

Environment: SLIDE_TILE, SLIDE_EMBED, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR (sample_data/),
SLIDE_CONVERT (scripts/convert_torchvision_weights.py).
"""
import csv
import io
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import h5py
import lmdb
import numpy as np
from PIL import Image
from e2e_util import report_tables, slide_file_stem, snapshot, store_tiles

TILE = os.environ["SLIDE_TILE"]
EMBED = os.environ["SLIDE_EMBED"]
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
CONVERT = os.environ["SLIDE_CONVERT"]
SLIDES = os.path.join(SAMPLE, "slides")
LC = os.path.join(SAMPLE, "patches", "lc25000-lung-subset")
PY = "/usr/bin/python3"


def run(args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)


def torch_features(model, layer, images):
    """torchvision's features: ImageNet-normalised images through the model up to `layer`, then
    global average pooling (for resnet50 layer3: CLAM's resnet50_baseline)."""
    import torch
    x = torch.from_numpy(images.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (x - mean) / std
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    body = torch.nn.Sequential(*[getattr(model, n) for n in names[:names.index(layer) + 1]],
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    body.eval()
    with torch.no_grad():
        return torch.cat([body(x[i:i + 16]) for i in range(0, len(x), 16)]).numpy()


def sha256_of(path):
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_text(path):
    with open(path) as f:
        return f.read()


def csv_rows(path):
    return list(csv.DictReader(io.StringIO(read_text(path))))


def bag_name(slide_id):
    return slide_file_stem(slide_id) + ".h5"


def listing(out):
    """The files of an output directory, without the writer's lock file and the run's report.html
    (TestLayout checks it)."""
    return sorted(n for n in os.listdir(out) if n not in ("writer.lock", "report.html"))


def rel_err(got, want):
    return float(np.abs(got.astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_embed_e2e_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @classmethod
    def tile(cls, name, *args):
        out = os.path.join(cls.tmp, name)
        r = run([TILE] + list(args) + ["-o", out, "-q"])
        assert r.returncode in (0, 3), r.stderr
        return out

    @classmethod
    def random_weights(cls, model, seed=0):
        """torchvision's random initialisation of `model`, saved with torch.save as a user's .pth
        would be, then converted by the committed script (which checks the names)."""
        import torch
        import torchvision
        torch.manual_seed(seed)
        m = getattr(torchvision.models, model)()
        # Batch norm statistics away from 0/1, so a wrong fold would show.
        g = torch.Generator().manual_seed(seed + 1)
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) * 0.4 - 0.2)
                mod.running_var.copy_(torch.rand(mod.num_features, generator=g) * 1.5 + 0.5)
                mod.weight.data.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
                mod.bias.data.copy_(torch.rand(mod.num_features, generator=g) * 0.4 - 0.2)
        pth = os.path.join(cls.tmp, "%s-%d.pth" % (model, seed))
        torch.save(m.state_dict(), pth)
        out = os.path.join(cls.tmp, "%s-%d.safetensors" % (model, seed))
        r = run([PY, CONVERT, pth, out, "--model", model])
        assert r.returncode == 0, r.stderr
        return m, out

    def embed(self, stores, out, *extra, **kw):
        stores = stores if isinstance(stores, list) else [stores]
        return run([EMBED] + stores + ["-o", out, "--threads", "2"] + list(extra), **kw)


class TestTorchvision(Base):
    """Features equal torchvision's on the same weights: CLAM's ResNet-50 layer3 cut on a real
    slide's JPEG tiles, and ResNet-18's penultimate features (float16 bags) on LC25000 patches."""

    def test_resnet50_layer3_on_cmu1_equals_torchvision(self):
        import torch
        torch.set_num_threads(2)
        store = self.tile("cmu", os.path.join(SLIDES, "CMU-1-Small-Region.svs"), "--mpp", "0.5")
        model, weights = self.random_weights("resnet50")
        out = os.path.join(self.tmp, "bags50")
        r = self.embed(store, out, "--weights", weights, "--model", "resnet50")
        self.assertEqual(r.returncode, 0, r.stderr)
        with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
            ours, coords = f["features"][:], f["coords"][:]
            self.assertEqual(f.attrs["layer"], "layer3")
        images, want_coords = store_tiles(store, "CMU-1-Small-Region")
        self.assertEqual(ours.shape, (29, 1024))
        np.testing.assert_array_equal(coords, want_coords)
        want = torch_features(model, "layer3", images)
        err = rel_err(ours, want)
        self.assertLess(err, 1e-4, "max |ours - torchvision| / scale = %.3g" % err)

    def test_resnet18_avgpool_float16_on_patches_equals_torchvision(self):
        import torch
        torch.set_num_threads(2)
        store = self.tile("lc", "--patches", LC, "--tile-size", "224")
        model, weights = self.random_weights("resnet18", seed=3)
        out = os.path.join(self.tmp, "bags18")
        ids = ["lung_aca/lungaca1", "lung_n/lungn10", "lung_scc/lungscc100"]
        r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--slides", ",".join(ids),
                       "--dtype", "float16", "--compression", "gzip")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(listing(out), sorted(["bags.csv"] + [bag_name(i) for i in ids]))
        for sid in ids:
            with h5py.File(os.path.join(out, bag_name(sid)), "r") as f:
                ours = f["features"][:]
                self.assertEqual(ours.dtype, np.float16)
                self.assertEqual(f.attrs["layer"], "avgpool")
            images, _ = store_tiles(store, sid)
            want = torch_features(model, "layer4", images)  # avgpool: layer4 + global average pool
            self.assertEqual(ours.shape, (1, 512))
            err = rel_err(ours.astype(np.float32), want)
            self.assertLess(err, 1e-3, "%s: float16 features vs torchvision: %.3g" % (sid, err))


class TestEngine(Base):
    """CNNs run one inference graph (batch norm folded, residual adds and ReLUs fused) on every
    backend: on the simulated device (the device paths without a GPU: weights prepared once, batches
    uploaded, features downloaded) the bags equal the host reference backend's bit for bit, cpu's
    (oneDNN's fused primitives) within float rounding, and torchvision's."""

    def test_resnet18_on_the_simulated_device_equals_host_and_torchvision(self):
        import torch
        torch.set_num_threads(2)
        store = self.tile("lc32", "--patches", LC, "--tile-size", "32")
        model, weights = self.random_weights("resnet18", seed=5)
        ids = ["lung_aca/lungaca1", "lung_n/lungn10", "lung_scc/lungscc100"]
        feats = {}
        for backend in ("reference", "reference-sim", "cpu"):
            out = os.path.join(self.tmp, "engine_" + backend)
            r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--slides", ",".join(ids),
                           "--backend", backend, "--batch-size", "2")
            self.assertEqual(r.returncode, 0, r.stderr)
            feats[backend] = {}
            for sid in ids:
                with h5py.File(os.path.join(out, bag_name(sid)), "r") as f:
                    feats[backend][sid] = f["features"][:]
                    self.assertEqual(f.attrs["layer"], "avgpool")
        for sid in ids:
            np.testing.assert_array_equal(feats["reference"][sid], feats["reference-sim"][sid])
            self.assertLess(rel_err(feats["cpu"][sid], feats["reference"][sid]), 1e-5, sid)
            images, _ = store_tiles(store, sid)
            want = torch_features(model, "layer4", images)
            self.assertEqual(feats["reference-sim"][sid].shape, (1, 512))
            err = rel_err(feats["reference-sim"][sid], want)
            self.assertLess(err, 1e-4, "%s: reference-sim features vs torchvision: %.3g" % (sid, err))

    def test_out_of_memory_on_the_device_reruns_in_micro_batches(self):
        """A forward pass that exceeds --memory-budget on the (simulated) device runs again in halves
        and later batches keep the smaller micro-batch: every bag is written and equals the
        unbudgeted run's bit for bit (no batch statistics at inference; the reference backend's rows
        do not depend on their batch). A budget that one tile alone exceeds fails every slide,
        naming the cause, and writes no bag."""
        store = self.tile("lc32oom", "--patches", LC, "--tile-size", "32")
        _, weights = self.random_weights("resnet18", seed=7)
        ids = ["lung_aca/lungaca%d" % i for i in range(1, 7)] + ["lung_n/lungn%d" % i for i in range(10, 16)]

        def embed(name, *extra):
            out = os.path.join(self.tmp, name)
            r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--slides", ",".join(ids),
                           "--backend", "reference-sim", *extra)
            summary = [l for l in r.stderr.splitlines() if " summary " in l]
            fields = dict(kv.split("=", 1) for kv in summary[-1].split()[3:]) if summary else {}
            return r, out, fields

        r1, _, one = embed("oom_b1", "--batch-size", "1")
        self.assertEqual(r1.returncode, 0, r1.stderr)
        r8, out8, eight = embed("oom_b8", "--batch-size", "8")
        self.assertEqual(r8.returncode, 0, r8.stderr)
        self.assertEqual(eight["micro_batch"], "8")
        peak1, peak8 = int(one["memory_peak_bytes"]), int(eight["memory_peak_bytes"])
        per_tile = (peak8 - peak1) / 7.0
        self.assertGreater(per_tile, 0)
        # Room for the weights and about 2.5 tiles: 8 and 4 tiles exceed it, 2 fit.
        budget = int(peak1 + 2.5 * per_tile)
        r, out, fields = embed("oom_budget", "--batch-size", "8", "--memory-budget", str(budget))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("out of memory in a forward pass", r.stderr)
        self.assertEqual(fields["micro_batch"], "2", r.stderr)
        self.assertLessEqual(int(fields["memory_peak_bytes"]), budget)
        self.assertEqual(listing(out), listing(out8))
        for sid in ids:
            with h5py.File(os.path.join(out, bag_name(sid)), "r") as f, \
                    h5py.File(os.path.join(out8, bag_name(sid)), "r") as g:
                np.testing.assert_array_equal(f["features"][:], g["features"][:])
                np.testing.assert_array_equal(f["coords"][:], g["coords"][:])
        # Weights fit, one tile does not: each slide fails with the reason; no bag is written.
        r, out, fields = embed("oom_none", "--batch-size", "8", "--memory-budget", str(int(peak1 - per_tile / 2)))
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("one image per forward pass", r.stderr)
        self.assertEqual(fields["slides_failed"], str(len(ids)))
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".h5") or n.endswith(".partial")])

    def test_a_patch_store_in_large_batches_keeps_few_files_open(self):
        """A patch store is one slide per tile: a batch of 100 spans 100 slides. Bags are created
        with their first rows, so few are open at once: under a 40-descriptor limit the 360-patch
        store embeds in batches of 100 (creating each slide's bag when its tile was queued held up to
        200 HDF5 files open, and every slide past the limit failed with EMFILE)."""
        store = self.tile("lc64fd", "--patches", LC, "--tile-size", "64")
        _, weights = self.random_weights("resnet18", seed=8)
        out = os.path.join(self.tmp, "fd_limit")

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

        r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--backend", "cpu",
                       "--batch-size", "100", preexec_fn=limit)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        bags = [n for n in listing(out) if n.endswith(".h5")]
        self.assertEqual(len(bags), 360, r.stderr[-2000:])
        with open(os.path.join(out, "bags.csv")) as f:
            self.assertEqual(len(list(csv.DictReader(f))), 360)

    def test_cuda_without_a_gpu_is_a_usage_error(self):
        store = self.tile("lc64b", "--patches", LC, "--tile-size", "64")
        _, weights = self.random_weights("resnet18", seed=6)
        out = os.path.join(self.tmp, "engine_cuda")
        r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--backend", "cuda")
        if r.returncode == 0:
            self.skipTest("a GPU is present")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--backend cuda", r.stderr)
        self.assertFalse(os.path.exists(out))  # refused before anything is written


class TestLayout(Base):
    """The documented HDF5 layout, read back with h5py: names, shapes, dtypes, chunking,
    compression, attributes, coordinates from the store, and bags.csv."""

    def test_layout(self):
        store = self.tile("multi", os.path.join(SLIDES, "CMU-1-Small-Region.svs"),
                          os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs"), "--mpp", "1", "--source-mpp", "0.5",
                          "--tile-size", "64")
        _, weights = self.random_weights("resnet18")
        for dtype, comp in (("float32", "none"), ("float16", "gzip"), ("float32", "lzf")):
            out = os.path.join(self.tmp, "bags-%s-%s" % (dtype, comp))
            r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--layer", "layer2",
                           "--dtype", dtype, "--compression", comp, "--chunk-rows", "100")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("tiles/s", r.stderr)
            rows = csv_rows(os.path.join(out, "bags.csv"))
            self.assertEqual([x["slide_id"] for x in rows], ["CMU-1-Small-Region", "TCGA-CR-7395-01A-01-TS1"])
            # report.html: the model, the directory's bags as bags.csv lists them, this run's slides.
            tables, _ = report_tables(os.path.join(out, "report.html"))
            model = dict((k, v) for k, v in tables["model"])
            self.assertEqual((model["model"], model["layer"], model["feature dimension"]), ("resnet18", "layer2", "128"))
            self.assertEqual(model["weights SHA-256"], sha256_of(weights))
            bags = dict((k, v) for k, v in tables["bags"])
            self.assertEqual(int(bags["bags (bags.csv)"]), 2)
            self.assertEqual(int(bags["tiles"]), sum(int(x["num_tiles"]) for x in rows))
            self.assertEqual(bags["dtype"], dtype)
            self.assertEqual([(row[0], row[2], int(row[3])) for row in tables["slides"][1:]],
                             [(x["slide_id"], "written", int(x["num_tiles"])) for x in rows])
            for row in rows:
                sid = row["slide_id"]
                with h5py.File(os.path.join(out, row["file"]), "r") as f:
                    self.assertEqual(sorted(f.keys()), ["coords", "features"])
                    feats, coords = f["features"], f["coords"]
                    _, want_coords = store_tiles(store, sid)
                    n = len(want_coords)
                    self.assertEqual(feats.shape, (n, 128))
                    self.assertEqual(feats.dtype, np.dtype(dtype))
                    self.assertEqual(coords.shape, (n, 2))
                    self.assertEqual(coords.dtype, np.int32)
                    self.assertEqual(feats.chunks, (min(100, n), 128))  # no chunk larger than the bag
                    self.assertEqual(feats.maxshape, (None, 128))
                    self.assertEqual(feats.compression, None if comp == "none" else comp)
                    np.testing.assert_array_equal(coords[:], want_coords)
                    self.assertTrue(np.isfinite(feats[:].astype(np.float32)).all())
                    self.assertGreater(float(np.abs(feats[:].astype(np.float32)).max()), 0)
                    a = f.attrs
                    self.assertEqual(a["slide_id"], sid)
                    self.assertEqual(a["label"], "")
                    self.assertEqual(int(a["tile_size_px"]), 64)
                    self.assertAlmostEqual(float(a["mpp_um"]), 1.0, places=6)
                    self.assertEqual(a["model"], "resnet18")
                    self.assertEqual(a["layer"], "layer2")
                    self.assertEqual(int(a["feature_dim"]), 128)
                    self.assertEqual(a["weights_sha256"], sha256_of(weights))
                    self.assertTrue(a["tool_version"].startswith("slide-embed "))
                    self.assertEqual(int(a["format_version"]), 1)
                    self.assertNotIn("encoder_input_px", a)  # a CNN takes any size: tiles go in as stored
                    self.assertEqual(int(coords.attrs["patch_size"]), 64)
                    self.assertEqual(int(coords.attrs["patch_size_level0"]), 128)  # 64 px at 1 um/px over 0.5 um/px
                    self.assertEqual(int(coords.attrs["patch_level"]), 0)
                    self.assertEqual((int(row["num_tiles"]), int(row["feature_dim"]), row["dtype"]), (n, 128, dtype))
        # float16 bags hold the float32 features rounded.
        bag = lambda d: h5py.File(os.path.join(self.tmp, d, "CMU-1-Small-Region.h5"), "r")
        with bag("bags-float32-none") as f32, bag("bags-float16-gzip") as f16, bag("bags-float32-lzf") as lzf:
            np.testing.assert_array_equal(f32["features"][:].astype(np.float16), f16["features"][:])
            # lzf (h5py's own filter, read here by h5py natively) loses nothing.
            np.testing.assert_array_equal(f32["features"][:], lzf["features"][:])
            self.assertLess(os.path.getsize(lzf.filename), os.path.getsize(f32.filename))


    def test_slide_train_checkpoint_as_model(self):
        """A slide-train checkpoint directory names its model: the small CNN's pooled features."""
        store = self.tile("lc48", "--patches", LC, "--tile-size", "48")
        run_dir = os.path.join(self.tmp, "run48")
        r = run([os.environ["SLIDE_TRAIN"], "--data", store, "--out", run_dir, "--epochs", "1", "--batch-size", "32",
                 "--width", "8", "--threads", "2", "-q"])
        self.assertEqual(r.returncode, 0, r.stderr)
        ckpts = os.path.join(run_dir, "checkpoints")
        ckpt = os.path.join(ckpts, sorted(os.listdir(ckpts))[-1])
        out = os.path.join(self.tmp, "bags-ckpt")
        r = self.embed(store, out, "--weights", ckpt, "--slides", "lung_n/lungn1,lung_scc/lungscc1")
        self.assertEqual(r.returncode, 0, r.stderr)
        with h5py.File(os.path.join(out, bag_name("lung_n/lungn1")), "r") as f:
            self.assertEqual(f["features"].shape, (1, 32))  # 4 x width
            self.assertEqual(f.attrs["model"], "small")
            self.assertEqual(f.attrs["layer"], "avgpool")
            self.assertEqual(f.attrs["label"], "lung_n")
            self.assertEqual(f.attrs["weights_sha256"], sha256_of(os.path.join(ckpt, "model.safetensors")))
        r = self.embed(store, os.path.join(self.tmp, "bags-x"), "--weights", ckpt, "--model", "resnet18")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("holds a small", r.stderr)


class TestClamLayout(Base):
    """--layout clam is CLAM's DATA_DIR (h5_files/, a dataset CSV) with CLAM's /coords convention;
    the default layout carries TRIDENT's attributes. Each reader's re-read of a tile, re-implemented
    from their code (CLAM: datasets/dataset_h5.py Whole_Slide_Bag_FP, read_region(coord,
    patch_level, (patch_size, patch_size)); TRIDENT: patches read at level 0 over patch_size_level0
    pixels and resized to patch_size), must give the stored tile's region."""

    def test_clam_and_trident_rereads_give_the_tiles(self):
        import openslide
        slide = os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs")
        sid = "TCGA-CR-7395-01A-01-TS1"
        store = self.tile("clam_store", slide, "--mpp", "2", "--source-mpp", "0.5", "--tile-size", "64")
        _, weights = self.random_weights("resnet18")
        clam, flat = os.path.join(self.tmp, "clam"), os.path.join(self.tmp, "flat")
        for out, layout in ((clam, "clam"), (flat, "flat")):
            r = self.embed(store, out, "--weights", weights, "--model", "resnet18", "--layer", "layer1",
                           "--layout", layout)
            self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(clam)), ["dataset.csv", "h5_files", "report.html", "writer.lock"])
        self.assertEqual(csv_rows(os.path.join(clam, "dataset.csv")), [{"case_id": sid, "slide_id": sid, "label": ""}])
        self.assertEqual([x["slide_id"] for x in csv_rows(os.path.join(clam, "h5_files", "bags.csv"))], [sid])
        tiles, coords = store_tiles(store, sid)
        with h5py.File(os.path.join(clam, "h5_files", sid + ".h5"), "r") as f, \
                h5py.File(os.path.join(flat, sid + ".h5"), "r") as g:
            np.testing.assert_array_equal(f["features"][:], g["features"][:])
            np.testing.assert_array_equal(f["coords"][:], coords)
            c, t = dict(f["coords"].attrs), dict(g["coords"].attrs)
        level, size, size0 = int(c["patch_level"]), int(c["patch_size"]), int(c["patch_size_level0"])
        self.assertEqual((int(t["patch_level"]), int(t["patch_size"])), (0, 64))  # TRIDENT's convention
        self.assertEqual(size0, 256)  # 64 px at 2 um/px over 0.5 um/px
        for a in (c, t):
            self.assertEqual((int(a["level0_magnification"]), int(a["target_magnification"]), int(a["overlap"])),
                             (20, 5, 0))
        with openslide.OpenSlide(slide) as sl:
            self.assertEqual((int(t["level0_width"]), int(t["level0_height"])), sl.dimensions)
            self.assertGreater(level, 0)  # read from a reduced level: the case CLAM's convention is about
            self.assertAlmostEqual(size * sl.level_downsamples[level], size0, delta=sl.level_downsamples[level])
            errs = {"CLAM": [], "TRIDENT": [], "patch_level 0 with the tile's size": []}
            for i in range(len(coords)):
                x, y = int(coords[i][0]), int(coords[i][1])
                reads = {"CLAM": sl.read_region((x, y), level, (size, size)),
                         "TRIDENT": sl.read_region((x, y), 0, (size0, size0)),
                         "patch_level 0 with the tile's size": sl.read_region((x, y), 0, (64, 64))}
                for name, img in reads.items():
                    img = img.convert("RGB").resize((64, 64), Image.BILINEAR)
                    errs[name].append(np.abs(np.asarray(img, dtype=np.float64) - tiles[i]).mean())
        mean = {k: float(np.mean(v)) for k, v in errs.items()}
        print("mean |re-read - stored tile| per pixel (0..255):", mean, file=sys.stderr)
        self.assertLess(mean["CLAM"], 8, mean)
        self.assertLess(mean["TRIDENT"], 8, mean)
        # Reading the tile's pixel size at level 0 (what patch_level 0 with patch_size 64 would
        # mean to CLAM) covers a sixteenth of the tile: far off.
        self.assertGreater(mean["patch_level 0 with the tile's size"], 2 * mean["CLAM"], mean)


class TwoSlides(Base):
    """A store of two real slides (CMU-1 and TCGA) at 64 px tiles, and random ResNet-18 weights."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.store = cls.tile("multi", os.path.join(SLIDES, "CMU-1-Small-Region.svs"),
                             os.path.join(SLIDES, "TCGA-CR-7395-01A-01-TS1.svs"), "--mpp", "1", "--source-mpp", "0.5",
                             "--tile-size", "64")
        _, cls.weights = cls.random_weights("resnet18")


class TestResume(TwoSlides):
    """Kill slide-embed (SIGKILL) mid-run and rerun: complete bags are skipped, the bags equal an
    uninterrupted run's, no .partial is left. Ctrl-C (SIGINT) exits 130 leaving no .partial."""

    def args(self, out):
        return [EMBED, self.store, "-o", out, "--weights", self.weights, "--model", "resnet18", "--layer", "layer2",
                "--batch-size", "8", "--threads", "2"]

    def reference(self):
        """The uninterrupted run's directory, made once for the class's tests that compare with it."""
        if getattr(type(self), "_reference", None) is None:
            ref = os.path.join(self.tmp, "ref")
            shutil.rmtree(ref, ignore_errors=True)
            r = run(self.args(ref))
            self.assertEqual(r.returncode, 0, r.stderr)
            type(self)._reference = ref
        return type(self)._reference

    def run_until_first_bag(self, out, sig):
        p = subprocess.Popen(self.args(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # Once the first bag is complete and the second is being written (its bag is created with
        # its first rows).
        first = os.path.join(out, "CMU-1-Small-Region.h5")
        second = os.path.join(out, "TCGA-CR-7395-01A-01-TS1.h5.partial")
        deadline = time.time() + 120
        while not (os.path.exists(first) and os.path.exists(second)) and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        self.assertTrue(os.path.exists(first), "the first bag never appeared")
        self.assertTrue(os.path.exists(second), "the second bag was never started")
        self.assertIsNone(p.poll(), "the run ended before it could be interrupted")
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        return p.returncode, err

    def test_kill_and_rerun_equals_uninterrupted(self):
        ref = self.reference()
        out = os.path.join(self.tmp, "killed")
        rc, _ = self.run_until_first_bag(out, signal.SIGKILL)
        self.assertEqual(rc, -signal.SIGKILL)
        names = os.listdir(out)
        self.assertNotIn("TCGA-CR-7395-01A-01-TS1.h5", names)  # an unfinished bag never looks complete
        self.assertIn("TCGA-CR-7395-01A-01-TS1.h5.partial", names)
        r = run(self.args(out))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("bags_skipped_complete=1", r.stderr)
        self.assertEqual(sorted(os.listdir(out)), sorted(os.listdir(ref)))
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".partial")])
        for name in ("CMU-1-Small-Region.h5", "TCGA-CR-7395-01A-01-TS1.h5"):
            with h5py.File(os.path.join(ref, name), "r") as a, h5py.File(os.path.join(out, name), "r") as b:
                np.testing.assert_array_equal(a["features"][:], b["features"][:])
                np.testing.assert_array_equal(a["coords"][:], b["coords"][:])
                self.assertEqual(dict(a.attrs), dict(b.attrs))
        self.assertEqual(read_text(os.path.join(ref, "bags.csv")), read_text(os.path.join(out, "bags.csv")))

    def test_full_disk_keeps_complete_bags_and_a_rerun_finishes(self):
        # Issue 17 item 4: a file-size limit makes the second bag's writes fail (EFBIG) the way a
        # full disk does (ENOSPC). The first bag stays complete, the failing one never looks
        # complete, the error names the file, and a rerun without the limit finishes the same bags.
        ref = self.reference()
        first, second = (os.path.getsize(os.path.join(ref, n)) for n in
                         ("CMU-1-Small-Region.h5", "TCGA-CR-7395-01A-01-TS1.h5"))
        cap = first + 64 * 1024
        self.assertGreater(second, cap)

        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))

        out = os.path.join(self.tmp, "full")
        r = subprocess.run(self.args(out), capture_output=True, text=True, preexec_fn=limit)
        print("slide-embed under a %d-byte file limit: exit %d; %s" % (cap, r.returncode, r.stderr.strip()[-600:]))
        self.assertEqual(r.returncode, 1, r.stderr)  # failed, not killed by a signal
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
        self.assertIn("TCGA-CR-7395-01A-01-TS1.h5.partial", r.stderr)
        names = os.listdir(out)
        self.assertIn("CMU-1-Small-Region.h5", names)
        self.assertNotIn("TCGA-CR-7395-01A-01-TS1.h5", names)
        with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as a, \
                h5py.File(os.path.join(ref, "CMU-1-Small-Region.h5"), "r") as b:
            np.testing.assert_array_equal(a["features"][:], b["features"][:])
        r = run(self.args(out))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".partial")])
        with h5py.File(os.path.join(out, "TCGA-CR-7395-01A-01-TS1.h5"), "r") as a, \
                h5py.File(os.path.join(ref, "TCGA-CR-7395-01A-01-TS1.h5"), "r") as b:
            np.testing.assert_array_equal(a["features"][:], b["features"][:])

    def test_ctrl_c_exits_130_and_leaves_no_partial(self):
        out = os.path.join(self.tmp, "interrupted")
        rc, err = self.run_until_first_bag(out, signal.SIGINT)
        self.assertEqual(rc, 130, err)
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".partial")], os.listdir(out))
        self.assertIn("CMU-1-Small-Region.h5", os.listdir(out))
        self.assertEqual(len(csv_rows(os.path.join(out, "bags.csv"))), 1)

    def test_rerun_with_another_cut_is_refused_per_slide(self):
        out = os.path.join(self.tmp, "other")
        r = run(self.args(out) + ["--slides", "CMU-1-Small-Region"])
        self.assertEqual(r.returncode, 0, r.stderr)
        args = self.args(out)
        args[args.index("--layer") + 1] = "layer1"
        r = run(args)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("exists but was made with", r.stderr)
        self.assertTrue(os.path.exists(os.path.join(out, "TCGA-CR-7395-01A-01-TS1.h5")))

    def test_rerun_on_a_slide_tiled_again_is_refused_not_taken_as_complete(self):
        """The same slide id tiled again into another store (here at 96 px tiles: other tiles,
        another count) and embedded into the --out that holds its bag: the old bag is not taken
        for this store's (its rows are other tiles); the slide fails naming both, the bag stays."""
        out = os.path.join(self.tmp, "retiled")
        r = run(self.args(out) + ["--slides", "CMU-1-Small-Region"])
        self.assertEqual(r.returncode, 0, r.stderr)
        bag = os.path.join(out, "CMU-1-Small-Region.h5")
        with h5py.File(bag, "r") as f:
            before = f["features"][:]
        again = self.tile("retiled-store", os.path.join(SLIDES, "CMU-1-Small-Region.svs"), "--mpp", "1",
                          "--source-mpp", "0.5", "--tile-size", "96")
        args = self.args(out)
        args[args.index(self.store)] = again
        r = run(args)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("exists but holds %d tiles of 64 px" % len(before), r.stderr)
        self.assertIn("tiles of 96 px for this slide (tiled again?)", r.stderr)
        with h5py.File(bag, "r") as f:
            np.testing.assert_array_equal(f["features"][:], before)


class TestMemory(Base):
    """Peak RSS of embedding is flat in the number of tiles: 124 tiles vs 1564 tiles of CMU-1."""

    def peak_rss_mb(self, args):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read().decode()
        p.stderr.close()
        self.assertEqual(p.returncode, 0, err)
        return usage.ru_maxrss / 1024.0

    def test_peak_memory_flat_in_tiles(self):
        svs = os.path.join(SLIDES, "CMU-1-Small-Region.svs")
        # 124 = 3 x 32 + 28 and 1564 = 48 x 32 + 28: the same batch shapes (full batches of 32 and a
        # last one of 28), so that only the number of tiles differs. With 100 (a last batch of 4) the
        # larger run alone held a second near-full batch's activations in the caching allocator, 24
        # to 34 MB on an AVX-512 host, which is not a per-tile cost.
        small = self.tile("small", svs, "--mpp", "0.5", "--tile-size", "64", "--min-tissue", "0",
                          "--max-tiles-per-slide", "124")
        large = self.tile("large", svs, "--mpp", "0.5", "--tile-size", "64", "--min-tissue", "0")
        _, weights = self.random_weights("resnet18")
        peaks = []
        for store in (small, large):
            out = os.path.join(self.tmp, "bags-" + os.path.basename(store))
            peaks.append(self.peak_rss_mb([EMBED, store, "-o", out, "--weights", weights, "--model", "resnet18",
                                           "--layer", "layer4", "--threads", "2", "-q"]))
            with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
                n = f["features"].shape[0]
        self.assertEqual(n, 1564)
        # 1440 more tiles: decoded they would be 1440 x 3 x 64 x 64 x 4 B = 71 MB, their features
        # 3 MB. The bound allows allocator noise, not a per-tile cost.
        print("peak RSS: %.1f MB at 124 tiles, %.1f MB at 1564 tiles" % tuple(peaks), file=sys.stderr)
        self.assertLess(peaks[1] - peaks[0], 24.0, "peak RSS grew with the number of tiles: %s" % peaks)


class TestBadInput(TwoSlides):
    """Usage errors before any work (exit 2), and a corrupt tile failing its slide alone (exit 3)."""

    def test_usage_errors(self):
        out = os.path.join(self.tmp, "u")
        r = self.embed(self.store, out, "--weights", os.path.join(self.tmp, "missing.safetensors"), "--model", "resnet18")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("missing.safetensors", r.stderr)
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--layer", "layer7")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("layer4", r.stderr)
        r = self.embed(self.store, out, "--weights", self.weights)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--model", r.stderr)
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--slides", "nope")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("nope", r.stderr)
        ids = os.path.join(self.tmp, "ids.csv")
        with open(ids, "w") as f:
            f.write("slide_id,label\nCMU-1-Small-Region,a\nmissing-slide,b\n")
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--slides-file", ids)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("missing-slide", r.stderr)
        r = self.embed(os.path.join(self.tmp, "no-store"), out, "--weights", self.weights, "--model", "resnet18")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("no-store", r.stderr)
        # An unknown model names the CNNs and the ViT presets; --image-size is a ViT's option.
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "ctranspath")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("is not one of small, resnet18, resnet34, resnet50 (or a ViT: vit, vit-b16, vit-l16, uni, "
                      "uni2-h, virchow2, gigapath, hoptimus0, conch-vit-b)", r.stderr)
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--image-size", "224")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--image-size apply to ViTs", r.stderr)
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--memory-budget", "8 GB")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--memory-budget: '8 GB'", r.stderr)
        # A file that is not safetensors.
        bad = os.path.join(self.tmp, "bad.safetensors")
        with open(bad, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
        r = self.embed(self.store, out, "--weights", bad, "--model", "resnet18")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("bad.safetensors", r.stderr)

    def test_corrupt_tile_fails_its_slide_only(self):
        store = os.path.join(self.tmp, "corrupt")
        shutil.copytree(self.store, store)
        env = lmdb.open(store, max_dbs=4)
        slides, tiles = env.open_db(b"slides"), env.open_db(b"tiles")
        with env.begin(write=True) as txn:
            rec = json.loads(txn.get(b"TCGA-CR-7395-01A-01-TS1", db=slides))
            key = struct.pack(">Q", rec["first_tile_index"] + 5)
            val = bytearray(txn.get(key, db=tiles))
            hdr = struct.unpack_from("<H", val, 6)[0]
            val[hdr + 2:hdr + 200] = b"\xff" * 198  # the JPEG's markers and tables destroyed
            txn.put(key, bytes(val), db=tiles)
        env.close()
        out = os.path.join(self.tmp, "c")
        r = self.embed(store, out, "--weights", self.weights, "--model", "resnet18", "--layer", "layer1")
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("TCGA-CR-7395-01A-01-TS1", r.stderr)
        self.assertIn("tile %d" % (rec["first_tile_index"] + 5), r.stderr)
        self.assertEqual(listing(out), ["CMU-1-Small-Region.h5", "bags.csv"])

    def test_corrupt_tile_in_a_batch_spanning_slides(self):
        """Patches are one-tile slides: one batch holds several slides; the corrupt one fails alone
        and the others' rows are the same as in a clean run."""
        store = self.tile("lc64", "--patches", LC, "--tile-size", "64")
        ids = ["lung_aca/lungaca1", "lung_aca/lungaca10", "lung_aca/lungaca100", "lung_n/lungn1", "lung_n/lungn10"]
        args = ["--weights", self.weights, "--model", "resnet18", "--layer", "layer1", "--slides", ",".join(ids)]
        clean = os.path.join(self.tmp, "lc-clean")
        r = self.embed(store, clean, *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        bad = os.path.join(self.tmp, "lc-bad-store")
        shutil.copytree(store, bad)
        env = lmdb.open(bad, max_dbs=4)
        slides, tiles = env.open_db(b"slides"), env.open_db(b"tiles")
        with env.begin(write=True) as txn:
            rec = json.loads(txn.get(b"lung_aca/lungaca100", db=slides))
            key = struct.pack(">Q", rec["first_tile_index"])
            val = bytearray(txn.get(key, db=tiles))
            hdr = struct.unpack_from("<H", val, 6)[0]
            val[hdr + 2:hdr + 200] = b"\xff" * 198
            txn.put(key, bytes(val), db=tiles)
        env.close()
        out = os.path.join(self.tmp, "lc-bad")
        r = self.embed(bad, out, *args)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("lung_aca/lungaca100", r.stderr)
        names = listing(out)
        self.assertEqual(names, sorted(["bags.csv"] + [bag_name(i) for i in ids if i != "lung_aca/lungaca100"]))
        for name in names[1:]:
            with h5py.File(os.path.join(clean, name), "r") as a, h5py.File(os.path.join(out, name), "r") as b:
                np.testing.assert_array_equal(a["features"][:], b["features"][:])

    def test_slides_file_restricts_the_run(self):
        ids = os.path.join(self.tmp, "one.txt")
        with open(ids, "w") as f:
            f.write("# one id per line\nTCGA-CR-7395-01A-01-TS1\n")
        out = os.path.join(self.tmp, "one")
        r = self.embed(self.store, out, "--weights", self.weights, "--model", "resnet18", "--layer", "layer1",
                       "--slides-file", ids)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(listing(out), ["TCGA-CR-7395-01A-01-TS1.h5", "bags.csv"])



class TestOutputSafety(TwoSlides):
    """Issue 20: one writer per output directory (a second fails at once, naming the holder), weights
    with a NaN refused at load, a bag with a NaN row refused by MIL training, and a write that runs
    out of space reported as an error, never a crash (exit 1, not 139). Each leaves what was
    already written as it was."""

    ARGS = ["--model", "resnet18", "--layer", "layer1", "-q"]

    def test_second_writer_fails_at_once(self):
        import fcntl
        out = os.path.join(self.tmp, "locked")
        r = self.embed(self.store, out, "--weights", self.weights, "--slides", "CMU-1-Small-Region", *self.ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        before = snapshot(out)
        with open(os.path.join(out, "writer.lock"), "a+") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            t0 = time.monotonic()
            r = self.embed(self.store, out, "--weights", self.weights, *self.ARGS)
            seconds = time.monotonic() - t0
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, r"output directory %s is being written by another process \(pid \d+" % out)
        self.assertLess(seconds, 10)  # at once, not after waiting
        self.assertEqual(snapshot(out), before)
        # Released (the holder's file closed): the same run goes through, and bags.csv ignores the lock file.
        r = self.embed(self.store, out, "--weights", self.weights, *self.ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual([x["slide_id"] for x in csv_rows(os.path.join(out, "bags.csv"))],
                         ["CMU-1-Small-Region", "TCGA-CR-7395-01A-01-TS1"])

    def test_weights_with_a_nan_are_refused(self):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from safetensors_io import read_safetensors, write_safetensors
        w = read_safetensors(self.weights)
        for bad_value, word in ((np.nan, "NaN"), (np.inf, "inf")):
            bad = dict(w)
            bad["layer1.0.conv2.weight"] = w["layer1.0.conv2.weight"].copy()
            bad["layer1.0.conv2.weight"].reshape(-1)[7] = bad_value
            path = os.path.join(self.tmp, "nan-weights.safetensors")
            write_safetensors(path, bad)
            out = os.path.join(self.tmp, "nan-bags")
            r = self.embed(self.store, out, "--weights", path, *self.ARGS)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("nan-weights.safetensors: tensor 'layer1.0.conv2.weight' holds %s (element 7 of" % word,
                          r.stderr)
            self.assertEqual(listing(out), [])  # no bag, no bags.csv

    def test_mil_refuses_a_bag_with_a_nan_row(self):
        bags = os.path.join(self.tmp, "real-bags")
        r = self.embed(self.store, bags, "--weights", self.weights, *self.ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        labels = os.path.join(self.tmp, "two-labels.csv")
        with open(labels, "w") as f:
            f.write("slide_id,label\nCMU-1-Small-Region,a\nTCGA-CR-7395-01A-01-TS1,b\n")
        train = [os.environ["SLIDE_TRAIN"], "--features", None, "--labels", labels, "--out", None, "--epochs", "1",
                 "--mil-hidden", "8", "--mil-attention", "4", "--val-fraction", "0", "--no-attention", "-q"]
        def mil(features, out):
            args = list(train)
            args[2], args[6] = features, out
            return run(args)
        r = mil(bags, os.path.join(self.tmp, "mil-clean"))
        self.assertEqual(r.returncode, 0, r.stderr)  # the control: the real bags train
        nan_bags = os.path.join(self.tmp, "nan-row-bags")
        shutil.copytree(bags, nan_bags, ignore=shutil.ignore_patterns("writer.lock"))
        victim = os.path.join(nan_bags, "TCGA-CR-7395-01A-01-TS1.h5")
        with h5py.File(victim, "r+") as f:
            feats = f["features"][:]
            self.assertGreater(len(feats), 3)
            feats[3, 5] = np.nan
            f["features"][...] = feats
        before = snapshot(nan_bags)
        for cache in ("ram", "none"):
            out = os.path.join(self.tmp, "mil-nan-" + cache)
            r = mil(nan_bags, out)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("bag %s: /features row 3 (tile 3), column 5 is NaN" % victim, r.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "metrics.jsonl")))
            ckpts = os.path.join(out, "checkpoints")
            self.assertEqual(os.listdir(ckpts) if os.path.isdir(ckpts) else [], [])  # no checkpoint, NaN or other
        self.assertEqual(snapshot(nan_bags), before)

    def test_bag_under_the_earlier_name_rule_is_reused(self):
        """Issue 22: bags are named by slide_file_stem now ("lung_n/lungn1" -> "lung_n_lungn1~<hash>.h5");
        a complete bag of an earlier version under the old name ("lung_n_lungn1.h5") holding the slide
        is still found by a rerun and skipped, not embedded a second time."""
        store = self.tile("lc32", "--patches", LC, "--tile-size", "32")
        out = os.path.join(self.tmp, "legacy")
        ids = "lung_n/lungn1,lung_scc/lungscc1"
        r = self.embed(store, out, "--weights", self.weights, "--slides", ids, *self.ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        os.rename(os.path.join(out, bag_name("lung_n/lungn1")), os.path.join(out, "lung_n_lungn1.h5"))
        r = self.embed(store, out, "--weights", self.weights, "--slides", ids, *self.ARGS[:-1])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("bags_skipped_complete=2", r.stderr)
        self.assertEqual(listing(out), sorted(["bags.csv", "lung_n_lungn1.h5", bag_name("lung_scc/lungscc1")]))
        rows = {x["slide_id"]: x["file"] for x in csv_rows(os.path.join(out, "bags.csv"))}
        self.assertEqual(rows["lung_n/lungn1"], "lung_n_lungn1.h5")

    def test_out_of_space_is_an_error_not_a_crash(self):
        import resource

        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))

        out = os.path.join(self.tmp, "full")
        r = run([EMBED, self.store, "-o", out, "--weights", self.weights, "--model", "resnet18", "--layer", "layer2",
                 "--threads", "2", "-q"], preexec_fn=limit)
        self.assertEqual(r.returncode, 1, r.stderr)  # before the fix: -11 (SIGSEGV at exit)
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
        self.assertIn("File too large", r.stderr)
        self.assertIn("stopped: no space left for bags in " + out, r.stderr)
        self.assertFalse([n for n in os.listdir(out) if n.endswith(".h5") or n.endswith(".partial")], os.listdir(out))


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
