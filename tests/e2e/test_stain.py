#!/usr/bin/python3
"""Stain normalisation (libtile/include/slide/tile/stain.h: Reinhard, Macenko, Vahadane) on real H&E tiles from two sources:
LC25000 lung patches (Borkowski et al. 2019) and Kather 2016 colorectal patches (another lab,
scanner and stain), and tiles of the CMU-1 slide. The C++ code runs through libtrain_tests'
`stain_io` suite (SLIDE_STAIN_JOB), through slide-tile (at tiling time) and through slide-embed;
the oracle is a NumPy transcription of
the documented algorithm written here (CIE L*a*b* for Reinhard, Macenko's steps), with NumPy's own
eigh / lstsq / percentile.

Environment: SLIDE_LIBTRAIN_TESTS, SLIDE_TILE, SLIDE_EMBED, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR
(sample_data/), SLIDE_CONVERT (scripts/convert_torchvision_weights.py).
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from PIL import Image

from e2e_util import store_tiles

SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
LIBTRAIN_TESTS = os.environ["SLIDE_LIBTRAIN_TESTS"]
LC = os.path.join(SAMPLE, "patches", "lc25000-lung-subset")
KATHER = os.path.join(SAMPLE, "patches", "kather2016-samples")
PY = "/usr/bin/python3"


def run(args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)


def first(pattern):
    paths = sorted(glob.glob(pattern))
    assert paths, pattern
    return paths[0]


def load_rgb(path):
    return np.asarray(Image.open(path).convert("RGB"))


# ---- NumPy transcription of stain.h -------------------------------------------------------------
# sRGB (IEC 61966-2-1) -> linear -> XYZ (D65, scikit-image's xyz_from_rgb) -> CIE L*a*b* (CIE 15:2004).
M_XYZ = np.array([[0.412453, 0.357580, 0.180423],
                  [0.212671, 0.715160, 0.072169],
                  [0.019334, 0.119193, 0.950227]])
WHITE = np.array([0.95047, 1.0, 1.08883])
DELTA = 6.0 / 29.0


def rgb_to_lab(rgb):
    c = rgb.reshape(-1, 3).astype(np.float64) / 255.0
    lin = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    t = (lin @ M_XYZ.T) / WHITE
    f = np.where(t > DELTA ** 3, np.cbrt(t), t / (3 * DELTA ** 2) + 4.0 / 29.0)
    return np.stack([116 * f[:, 1] - 16, 500 * (f[:, 0] - f[:, 1]), 200 * (f[:, 1] - f[:, 2])], axis=1)


def round_u8(v):
    return np.clip(np.floor(v + 0.5), 0, 255).astype(np.uint8)


def lab_to_rgb(lab):
    fy = (lab[:, 0] + 16) / 116
    f = np.stack([fy + lab[:, 1] / 500, fy, fy - lab[:, 2] / 200], axis=1)
    xyz = WHITE * np.where(f > DELTA, f ** 3, 3 * DELTA ** 2 * (f - 4.0 / 29.0))
    lin = np.clip(xyz @ np.linalg.inv(M_XYZ).T, 0, 1)
    c = np.where(lin <= 0.0031308, 12.92 * lin, 1.055 * lin ** (1 / 2.4) - 0.055)
    return round_u8(255 * c)


def reinhard_fit(rgb):
    lab = rgb_to_lab(rgb)
    return {"method": "reinhard", "reinhard_mean": lab.mean(0), "reinhard_std": lab.std(0)}


def reinhard_normalise(target, rgb):
    lab = rgb_to_lab(rgb)
    mean, sd = lab.mean(0), lab.std(0)
    scale = np.where(sd < 1e-9, 1.0, np.asarray(target["reinhard_std"]) / np.maximum(sd, 1e-300))
    out = (lab - mean) * scale + np.asarray(target["reinhard_mean"])
    return lab_to_rgb(out).reshape(rgb.shape)


BETA, ALPHA = 0.15, 1.0


def macenko_estimate(rgb):
    """(HE 3 x 2, max_c 2, concentrations 2 x n) or None (too little tissue / degenerate)."""
    od = -np.log((rgb.reshape(-1, 3).astype(np.float64) + 1) / 256)
    tissue = od[(od >= BETA).all(axis=1)]
    if len(tissue) < 2 or len(tissue) < 0.01 * len(od):
        return None
    _, v = np.linalg.eigh(np.cov(tissue, rowvar=False))
    e1, e2 = v[:, 2], v[:, 1]
    e1 = -e1 if e1[0] < 0 else e1
    e2 = -e2 if e2[0] < 0 else e2
    phi = np.arctan2(tissue @ e2, tissue @ e1)
    lo, hi = np.percentile(phi, ALPHA), np.percentile(phi, 100 - ALPHA)
    vmin = np.cos(lo) * e1 + np.sin(lo) * e2
    vmax = np.cos(hi) * e1 + np.sin(hi) * e2
    vmin, vmax = vmin / np.linalg.norm(vmin), vmax / np.linalg.norm(vmax)
    he = np.stack([vmin, vmax] if vmin[0] > vmax[0] else [vmax, vmin], axis=1)
    conc = np.linalg.lstsq(he, od.T, rcond=None)[0]
    max_c = np.percentile(conc, 99, axis=1)
    if not (max_c > 0).all():
        return None
    return he, max_c, conc


def matrix_fit(method, estimate, rgb):
    """A stain-matrix method's target (Macenko, Vahadane): {method, <method>_he, <method>_max_c}."""
    he, max_c, _ = estimate(rgb)
    return {"method": method, method + "_he": he, method + "_max_c": max_c}


def matrix_normalise(method, estimate, target, rgb):
    """stain.h's step 7: the tile's concentrations scaled to the target's maxima, recomposed with
    the target's stains; a tile without an estimate unchanged."""
    est = estimate(rgb)
    if est is None:
        return rgb.copy()
    _, max_c, conc = est
    conc = conc * (np.asarray(target[method + "_max_c"]) / max_c)[:, None]
    od = np.asarray(target[method + "_he"]) @ conc
    return round_u8(256 * np.exp(-od) - 1).T.reshape(rgb.shape)


def macenko_fit(rgb):
    return matrix_fit("macenko", macenko_estimate, rgb)


def macenko_normalise(target, rgb):
    return matrix_normalise("macenko", macenko_estimate, target, rgb)


# Vahadane (stain.h): the same alternation, but each pixel's codes chosen by the KKT conditions of
# the non-negative lasso (stain.h compares the candidates' objectives instead), so that the two
# selections check each other.
LUMINOSITY, LAMBDA, CONC_LAMBDA, MAX_ITER, TOL = 80.0, 0.1, 0.01, 100, 1e-6
RUIFROK = np.array([[0.650, 0.704, 0.286], [0.072, 0.990, 0.105]]).T  # columns H, E


def nonnegative_lasso2(d, x, lam):
    """argmin_{a >= 0} 1/2 |x - D a|^2 + lam |a|_1 for every column of x (3 x n): 2 x n. The
    candidate (both stains, H only, E only, none) whose KKT conditions hold: a > 0 where active,
    gradient G a - q >= 0 where zero (q = D^T x - lam)."""
    g = d.T @ d
    q = d.T @ x - lam
    both = np.linalg.solve(g, q)
    only0 = np.maximum(q[0], 0) / g[0, 0]
    only1 = np.maximum(q[1], 0) / g[1, 1]
    a = np.zeros_like(q)
    pick_none = (q[0] <= 0) & (q[1] <= 0)
    pick0 = (q[0] > 0) & (g[0, 1] * only0 - q[1] >= 0)
    pick1 = (q[1] > 0) & (g[0, 1] * only1 - q[0] >= 0) & ~pick0
    pick_both = (both > 0).all(axis=0) & ~pick0 & ~pick1 & ~pick_none
    assert (pick_none | pick0 | pick1 | pick_both).all(), "a pixel without a KKT point"
    a[0] = np.where(pick0, only0, np.where(pick_both, both[0], 0))
    a[1] = np.where(pick1, only1, np.where(pick_both, both[1], 0))
    return a


def vahadane_estimate(rgb):
    pixels = rgb.reshape(-1, 3)
    od = -np.log((pixels.astype(np.float64) + 1) / 256)
    x = od[rgb_to_lab(pixels)[:, 0] < LUMINOSITY].T
    if x.shape[1] < 2 or x.shape[1] < 0.01 * len(od):
        return None
    d = RUIFROK / np.linalg.norm(RUIFROK, axis=0)
    for _ in range(MAX_ITER):
        a = nonnegative_lasso2(d, x, LAMBDA)
        big_a, big_b = a @ a.T, x @ a.T
        before = d.copy()
        for j in range(2):
            if big_a[j, j] > 0:
                u = np.maximum(d[:, j] + (big_b[:, j] - d @ big_a[:, j]) / big_a[j, j], 0)
                d[:, j] = u / max(np.linalg.norm(u), 1)
        if np.abs(d - before).max() < TOL:
            break
    d = d / np.linalg.norm(d, axis=0)
    he = d if d[0, 0] >= d[0, 1] else d[:, ::-1]
    conc = nonnegative_lasso2(he, od.T, CONC_LAMBDA)
    max_c = np.percentile(conc, 99, axis=1)
    if not (max_c > 0).all():
        return None
    return he, max_c, conc


def vahadane_fit(rgb):
    return matrix_fit("vahadane", vahadane_estimate, rgb)


def vahadane_normalise(target, rgb):
    return matrix_normalise("vahadane", vahadane_estimate, target, rgb)


NUMPY = {"reinhard": (reinhard_fit, reinhard_normalise), "macenko": (macenko_fit, macenko_normalise),
         "vahadane": (vahadane_fit, vahadane_normalise)}
ESTIMATE = {"macenko": macenko_estimate, "vahadane": vahadane_estimate}
# Closed-form fits agree to rounding; Vahadane's iterations may stop one step apart (a step < TOL).
FIT_TOLERANCE = {"reinhard": 1e-9, "macenko": 1e-9, "vahadane": 1e-5}


class StainIo:
    """Batches fit/norm jobs for libtrain_tests --test-suite=stain_io."""

    def __init__(self, tmp):
        self.tmp, self.lines, self.n = tmp, [], 0

    def _raw(self, rgb):
        self.n += 1
        path = os.path.join(self.tmp, "in%d.rgb" % self.n)
        np.ascontiguousarray(rgb, dtype=np.uint8).tofile(path)
        return path

    def fit(self, method, rgb):
        out = os.path.join(self.tmp, "target%d.json" % self.n)
        self.lines.append("fit %s %s %d %d %s" % (method, self._raw(rgb), rgb.shape[1], rgb.shape[0], out))
        return out

    def norm(self, target_json, rgb):
        src = self._raw(rgb)
        out = os.path.join(self.tmp, "out%d.rgb" % self.n)
        self.lines.append("norm %s %s %d %d %s" % (target_json, src, rgb.shape[1], rgb.shape[0], out))
        return out

    def run(self):
        job = os.path.join(self.tmp, "job%d.txt" % self.n)
        with open(job, "w") as f:
            f.write("\n".join(self.lines) + "\n")
        self.lines = []
        r = run([LIBTRAIN_TESTS, "--test-suite=stain_io"], env=dict(os.environ, SLIDE_STAIN_JOB=job))
        assert r.returncode == 0, r.stdout + r.stderr


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_rgb(path, shape):
    return np.fromfile(path, dtype=np.uint8).reshape(shape)


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_stain_e2e_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)


class TestAgainstNumpy(Base):
    """The C++ fit and transform against the NumPy transcription, on a reference from one source
    (LC25000 lung adenocarcinoma) and tiles from the other classes and from Kather 2016."""

    def sources(self):
        paths = [first(os.path.join(LC, c, "*")) for c in ("lung_n", "lung_scc")]
        paths += [first(os.path.join(KATHER, c, "*")) for c in sorted(os.listdir(KATHER))]
        return [(os.path.relpath(p, SAMPLE), load_rgb(p)) for p in paths]

    def test_cpp_equals_numpy_and_moves_lab_means_to_the_reference(self):
        ref = load_rgb(first(os.path.join(LC, "lung_aca", "*")))
        sources = self.sources()
        io_ = StainIo(self.tmp)
        targets = {m: io_.fit(m, ref) for m in NUMPY}
        outs = {(m, name): io_.norm(targets[m], rgb) for m in NUMPY for name, rgb in sources}
        self_outs = {m: io_.norm(targets[m], ref) for m in NUMPY}
        io_.run()
        ref_lab_mean = rgb_to_lab(ref).mean(0)
        report = []
        for m, (fit, normalise) in NUMPY.items():
            ours = read_json(targets[m])
            want = fit(ref)
            self.assertEqual(ours["method"], m)
            for key in want:
                if key != "method":
                    np.testing.assert_allclose(np.asarray(ours[key]), want[key], rtol=FIT_TOLERANCE[m],
                                               atol=FIT_TOLERANCE[m], err_msg=key)
            # The reference against its own target: Reinhard within rounding; Macenko and Vahadane
            # lose each pixel's OD residual off the H-E plane (a projection), and Vahadane also its
            # concentrations' L1 shrinkage: a few grey levels on average.
            self_out = read_rgb(self_outs[m], ref.shape)
            d_self = np.abs(self_out.astype(int) - ref).mean()
            self.assertLessEqual(d_self, {"reinhard": 0.01, "macenko": 3.0, "vahadane": 4.0}[m],
                                 "%s: reference vs its own target: %.3f" % (m, d_self))
            report.append("%s: reference vs its own target: mean |diff| %.3f grey levels" % (m, d_self))
            closer = 0
            tissue = 0
            for name, rgb in sources:
                got = read_rgb(outs[(m, name)], rgb.shape)
                exp = normalise(ours, rgb)  # NumPy transform with the C++ target (checked above)
                diff = np.abs(got.astype(int) - exp.astype(int))
                report.append("%s %-70s C++ vs NumPy: mean |diff| %.4f, max %d; changed from the input: %.2f"
                              % (m, name, diff.mean(), diff.max(), np.abs(got.astype(int) - rgb).mean()))
                self.assertLessEqual(diff.mean(), 0.05, "%s %s" % (m, name))
                self.assertLessEqual(diff.max(), 2, "%s %s" % (m, name))
                before = np.linalg.norm(rgb_to_lab(rgb).mean(0) - ref_lab_mean)
                after = np.linalg.norm(rgb_to_lab(got).mean(0) - ref_lab_mean)
                report.append("    Lab mean distance to the reference's: before %.2f, after %.2f" % (before, after))
                if m == "reinhard":
                    # Mean matching: only the clipping of out-of-gamut colours and rounding stand
                    # between them.
                    self.assertLess(after, 0.5 * before, "%s %s" % (m, name))
                if m in ESTIMATE:
                    if ESTIMATE[m](rgb) is not None:
                        tissue += 1
                        closer += after < before
                    else:
                        np.testing.assert_array_equal(got, rgb)  # no tissue: unchanged
                        report.append("    (no tissue: unchanged)")
            if m in ESTIMATE:
                # Macenko and Vahadane match stains, not Lab means; still, most H&E tiles come closer.
                self.assertGreaterEqual(closer, 0.75 * tissue, "%d of %d tiles closer" % (closer, tissue))
                report.append("%s: %d of %d tissue tiles closer to the reference's Lab means" % (m, closer, tissue))
        print("\n".join(report), file=sys.stderr)


class TestSlideTile(Base):
    """slide-tile --stain-normalize: every tile of the store is the tile tiled without it,
    normalised (the NumPy transform with the recorded target, within rounding); the store records
    the target; pass-through is off; a rerun with another normalisation is refused."""

    def tile_and_compare(self, method, ref_path, mpp, tag, min_tiles, fit_tolerance):
        """Tiles CMU-1 at `mpp` (128-px raw tiles) without and with --stain-normalize `method`, and
        checks: the recorded target is NumPy's fit of the reference (within `fit_tolerance`); the
        same grid; every normalised tile is NumPy's transform of the plain one with that target
        (max 2 grey levels, worst mean 0.05), and the tiles did change. Returns (tile command
        arguments without -o, the normalised store, the target)."""
        tile = os.environ["SLIDE_TILE"]
        cmu = os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")
        plain, norm = os.path.join(self.tmp, tag + "_plain"), os.path.join(self.tmp, tag + "_norm")
        common = [cmu, "--mpp", str(mpp), "--tile-size", "128", "--encoding", "raw", "-q"]
        r = run([tile] + common + ["-o", plain])
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run([tile] + common + ["-o", norm, "--stain-normalize", method, "--stain-reference", ref_path])
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run([tile, "info", norm, "--json"])
        self.assertEqual(r.returncode, 0, r.stderr)
        target = json.loads(json.loads(r.stdout)["stain_normalization"])
        self.assertEqual(target["method"], method)
        fit, normalise = NUMPY[method]
        want = fit(load_rgb(ref_path))
        for key in want:
            if key != "method":
                np.testing.assert_allclose(np.asarray(target[key]), want[key], rtol=fit_tolerance, atol=fit_tolerance,
                                           err_msg=key)
        a, ca = store_tiles(plain, "CMU-1-Small-Region")
        b, cb = store_tiles(norm, "CMU-1-Small-Region")
        self.assertEqual(len(a), len(b))
        self.assertGreater(len(a), min_tiles)
        np.testing.assert_array_equal(ca, cb)
        worst = 0.0
        for i in range(len(a)):
            diff = np.abs(b[i].astype(int) - normalise(target, a[i]).astype(int))
            worst = max(worst, diff.mean())
            self.assertLessEqual(diff.max(), 2, "tile %d" % i)
        self.assertLessEqual(worst, 0.05)
        self.assertGreater(np.abs(b.astype(int) - a.astype(int)).mean(), 1.0)  # they did change
        print("slide-tile --stain-normalize %s: %d tiles, C++ vs NumPy worst mean |diff| %.4f"
              % (method, len(a), worst), file=sys.stderr)
        return common, norm, target

    def test_tiles_are_normalised_at_tiling_time_and_the_target_recorded(self):
        tile = os.environ["SLIDE_TILE"]
        ref_path = first(os.path.join(LC, "lung_aca", "*"))
        cmu = os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")
        common, norm, _ = self.tile_and_compare("reinhard", ref_path, "1.0", "tile", 10, 1e-9)
        stain = ["--stain-normalize", "reinhard", "--stain-reference", ref_path]
        self.assertIn("stain        {\"method\":\"reinhard\"", run([tile, "info", norm]).stdout)
        # A rerun into the store with another normalisation, or none, is refused as any other changed
        # setting is (exit 1, naming it: e2e_tile_TestSettings); the same one finds every slide complete.
        for other in (["--stain-normalize", "macenko", "--stain-reference", ref_path], []):
            r = run([tile] + common + ["-o", norm] + other)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("stain_normalization=", r.stderr)
        r = run([tile] + common + ["-o", norm] + stain)
        self.assertEqual(r.returncode, 0, r.stderr)
        # JPEG tiles aligned with the source's own (CMU at 0.5 um/px, 240 px) would be copied; with
        # normalisation they are decoded, normalised and encoded: pass-through is off.
        jpeg = os.path.join(self.tmp, "tile_jpeg")
        r = run([tile, cmu, "--mpp", "0.5", "--tile-size", "240", "--min-tissue", "0", "-q", "-o", jpeg] + stain)
        self.assertEqual(r.returncode, 0, r.stderr)
        rec = json.loads(run([tile, "info", jpeg, "--json"]).stdout)["slides"][0]
        self.assertFalse(rec["passthrough"])
        # A bad reference is a usage error naming the file.
        r = run([tile] + common + ["-o", os.path.join(self.tmp, "tile_bad"), "--stain-normalize", "reinhard",
                                   "--stain-reference", os.path.join(self.tmp, "nope.png")])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("nope.png", r.stderr)


    def test_vahadane_at_tiling_time(self):
        # The same path with Vahadane (the per-tile dictionary learning runs in slide-tile's
        # workers); its fit is iterative (FIT_TOLERANCE).
        self.tile_and_compare("vahadane", first(os.path.join(KATHER, "01_TUMOR", "*")), "2.0", "vtile", 5,
                              FIT_TOLERANCE["vahadane"])


def torch_features(model, images):
    """torchvision's ResNet penultimate features (layer4 + global average pooling) of uint8 images,
    ImageNet-normalised (tests/e2e/test_slide_embed.py's reference)."""
    import torch
    x = torch.from_numpy(images.astype(np.float32) / 255.0).permute(0, 3, 1, 2)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    x = (x - mean) / std
    names = ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"]
    body = torch.nn.Sequential(*[getattr(model, n) for n in names], torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten())
    body.eval()
    with torch.no_grad():
        return torch.cat([body(x[i:i + 16]) for i in range(0, len(x), 16)]).numpy()


def rel_err(got, want):
    return float(np.abs(got.astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))


class TestSlideEmbed(Base):
    """slide-embed --stain-normalize on the CMU-1 slide's tiles with an LC25000 reference: the bags
    hold the features of the normalised tiles and record the target; reruns with another setting
    are refused; bad references are usage errors naming the file."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch
        import torchvision
        torch.set_num_threads(2)
        cls.store = os.path.join(cls.tmp, "cmu")
        r = run([os.environ["SLIDE_TILE"], os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "0.5",
                 "-o", cls.store, "-q"])
        assert r.returncode in (0, 3), r.stderr
        torch.manual_seed(5)
        cls.model = torchvision.models.resnet18()
        cls.model.eval()
        pth = os.path.join(cls.tmp, "r18.pth")
        torch.save(cls.model.state_dict(), pth)
        cls.weights = os.path.join(cls.tmp, "r18.safetensors")
        r = run([PY, os.environ["SLIDE_CONVERT"], pth, cls.weights, "--model", "resnet18"])
        assert r.returncode == 0, r.stderr
        cls.ref = first(os.path.join(LC, "lung_aca", "*"))

    def embed(self, out, *extra):
        return run([os.environ["SLIDE_EMBED"], self.store, "-o", out, "--threads", "2", "--weights", self.weights,
                    "--model", "resnet18"] + list(extra))

    def bag(self, out):
        import h5py
        with h5py.File(os.path.join(out, "CMU-1-Small-Region.h5"), "r") as f:
            return f["features"][:], dict(f.attrs)

    def test_bags_hold_the_normalised_tiles_features(self):
        plain, stained = os.path.join(self.tmp, "plain"), os.path.join(self.tmp, "macenko")
        r = self.embed(plain)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.embed(stained, "--stain-normalize", "macenko", "--stain-reference", self.ref)
        self.assertEqual(r.returncode, 0, r.stderr)
        f_plain, a_plain = self.bag(plain)
        f_stain, a_stain = self.bag(stained)
        self.assertNotIn("stain_normalization", a_plain)
        target = json.loads(a_stain["stain_normalization"])
        self.assertEqual(target["method"], "macenko")
        # The recorded target is the reference's, as NumPy fits it (PIL's decode of the JPEG).
        want = macenko_fit(load_rgb(self.ref))
        np.testing.assert_allclose(np.asarray(target["macenko_he"]), want["macenko_he"], atol=1e-6)
        np.testing.assert_allclose(np.asarray(target["macenko_max_c"]), want["macenko_max_c"], rtol=1e-6)
        changed = rel_err(f_stain, f_plain)
        self.assertGreater(changed, 0.05, "stain normalisation changed the features by only %.3g" % changed)
        # The tiles normalised by the C++ code (stain_io) through torchvision: the bag's features,
        # within the ResNet feature tests' tolerance (tests/e2e/test_slide_embed.py: 1e-4).
        images, _ = store_tiles(self.store, "CMU-1-Small-Region")
        target_path = os.path.join(self.tmp, "bag_target.json")
        with open(target_path, "w") as f:
            f.write(a_stain["stain_normalization"])
        io_ = StainIo(self.tmp)
        outs = [io_.norm(target_path, im) for im in images]
        io_.run()
        cpp_tiles = np.stack([read_rgb(p, im.shape) for p, im in zip(outs, images)])
        np_tiles = np.stack([macenko_normalise(target, im) for im in images])
        tile_diff = np.abs(cpp_tiles.astype(int) - np_tiles.astype(int))
        err_cpp = rel_err(f_stain, torch_features(self.model, cpp_tiles))
        err_np = rel_err(f_stain, torch_features(self.model, np_tiles))
        print("CMU-1 tiles (%d), macenko: C++ vs NumPy tiles mean |diff| %.4f max %d; bag vs torchvision on "
              "C++-normalised tiles %.3g, on NumPy-normalised tiles %.3g; without normalisation %.3g"
              % (len(images), tile_diff.mean(), tile_diff.max(), err_cpp, err_np, changed), file=sys.stderr)
        self.assertLessEqual(tile_diff.mean(), 0.05)
        self.assertLess(err_cpp, 1e-4)
        self.assertLess(err_np, 1e-4)
        # The recorded target reused as a .json reference, without the image: the same bag.
        again = os.path.join(self.tmp, "from_json")
        r = self.embed(again, "--stain-normalize", "macenko", "--stain-reference", target_path)
        self.assertEqual(r.returncode, 0, r.stderr)
        f_again, a_again = self.bag(again)
        np.testing.assert_array_equal(f_again, f_stain)
        self.assertEqual(a_again["stain_normalization"], a_stain["stain_normalization"])
        # Reruns into the same --out: the same setting reuses the bag; another is refused.
        r = self.embed(stained, "--stain-normalize", "macenko", "--stain-reference", self.ref)
        self.assertEqual(r.returncode, 0, r.stderr)
        for other in (["--stain-normalize", "reinhard", "--stain-reference", self.ref], []):
            r = self.embed(stained, *other)
            self.assertEqual(r.returncode, 3, r.stderr)
            self.assertIn("exists but was made with", r.stderr)
            self.assertIn("stain normalisation", r.stderr)
        r = self.embed(plain, "--stain-normalize", "reinhard", "--stain-reference", self.ref)
        self.assertEqual(r.returncode, 3, r.stderr)
        f_now, _ = self.bag(stained)
        np.testing.assert_array_equal(f_now, f_stain)

    def test_bad_references_are_usage_errors_naming_the_file(self):
        out = os.path.join(self.tmp, "bad")
        corrupt = os.path.join(self.tmp, "corrupt.jpg")
        with open(corrupt, "wb") as f:
            f.write(b"\xff\xd8\xff\xe0 not a jpeg at all" * 10)
        white = os.path.join(self.tmp, "white.png")
        Image.new("RGB", (64, 64), (255, 255, 255)).save(white)
        missing = os.path.join(self.tmp, "missing.png")
        for method, ref, says in (("macenko", corrupt, corrupt), ("reinhard", missing, missing),
                                  ("macenko", white, "too few tissue"), ("macenko", "", "--stain-reference"),
                                  ("none", self.ref, "--stain-normalize")):
            args = ["--stain-normalize", method] + (["--stain-reference", ref] if ref else [])
            r = self.embed(out, *args)
            self.assertEqual(r.returncode, 2, "%s %s: %s" % (method, ref, r.stderr))
            self.assertIn(says, r.stderr)
            if ref:
                self.assertIn(ref, r.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "CMU-1-Small-Region.h5")))


def csv_rows(path):
    import csv
    with open(path) as f:
        return list(csv.DictReader(f))


def probabilities(path):
    """{(slide_id, x, y): [p_class...]} of a predictions.csv."""
    out = {}
    for row in csv_rows(path):
        out[(row["slide_id"], row["x_l0"], row["y_l0"])] = [float(v) for k, v in row.items() if k.startswith("p_")]
    return out


class TestSlideTrain(Base):
    """slide-train --stain-normalize: the fitted target lands in state.json's config, and evaluate
    and predict apply it from the checkpoint: their probabilities on the stored tiles equal those of
    the same checkpoint without the record on tiles normalised beforehand by the NumPy Macenko (raw
    tiles, lossless), and differ from those on the tiles as stored."""

    def tile(self, out, patches):
        r = run([os.environ["SLIDE_TILE"], "--patches", patches, "--tile-size", "48", "--encoding", "raw", "-o", out,
                 "-q"])
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_checkpoint_records_and_evaluate_and_predict_apply_the_target(self):
        train = os.environ["SLIDE_TRAIN"]
        # 20 patches per class (3 classes) from LC25000: a small training store of 48-px raw tiles.
        patches = os.path.join(self.tmp, "patches")
        for cls in ("lung_aca", "lung_n", "lung_scc"):
            os.makedirs(os.path.join(patches, cls))
            for p in sorted(glob.glob(os.path.join(LC, cls, "*")))[:20]:
                shutil.copy(p, os.path.join(patches, cls))
        store = os.path.join(self.tmp, "store")
        self.tile(store, patches)
        # The reference: a Kather 2016 tumour patch (another lab and stain).
        ref = first(os.path.join(KATHER, "01_TUMOR", "*"))
        out = os.path.join(self.tmp, "run")
        r = run([train, "--data", store, "--out", out, "--epochs", "2", "--batch-size", "16", "--lr", "0.05",
                 "--width", "8", "--threads", "2", "--seed", "3", "--stain-normalize", "macenko",
                 "--stain-reference", ref])
        self.assertEqual(r.returncode, 0, r.stderr)
        ckpt = sorted(glob.glob(os.path.join(out, "checkpoints", "epoch-*")))[-1]
        state = read_json(os.path.join(ckpt, "state.json"))
        target = state["config"]["stain_normalization"]
        want = macenko_fit(load_rgb(ref))
        self.assertEqual(target["method"], "macenko")
        np.testing.assert_allclose(np.asarray(target["macenko_he"]), want["macenko_he"], atol=1e-6)
        np.testing.assert_allclose(np.asarray(target["macenko_max_c"]), want["macenko_max_c"], rtol=1e-6)
        # The same checkpoint without the record.
        bare = os.path.join(self.tmp, "bare")
        shutil.copytree(ckpt, bare)
        del state["config"]["stain_normalization"]
        with open(os.path.join(bare, "state.json"), "w") as f:
            json.dump(state, f)
        # The stored tiles normalised by NumPy, as lossless PNGs under the same names: a second store.
        import lmdb
        env = lmdb.open(store, readonly=True, lock=False, max_dbs=4)
        slides_db = env.open_db(b"slides")
        with env.begin() as txn:
            ids = [k.decode() for k, _ in txn.cursor(db=slides_db)]
        env.close()
        pre = os.path.join(self.tmp, "prenormalised")
        unchanged = 0
        for sid in ids:
            (tile,), _ = store_tiles(store, sid)
            normed = macenko_normalise(target, tile)
            unchanged += int((normed == tile).all())
            os.makedirs(os.path.join(pre, os.path.dirname(sid)), exist_ok=True)
            Image.fromarray(normed).save(os.path.join(pre, sid + ".png"))
        self.assertLess(unchanged, len(ids) // 2)
        store_pre = os.path.join(self.tmp, "store_pre")
        self.tile(store_pre, pre)

        def infer(mode, checkpoint, data, name, *extra):
            dest = os.path.join(self.tmp, name)
            r = run([train, mode, "--checkpoint", checkpoint, "--data", data, "--out", dest] + list(extra))
            self.assertEqual(r.returncode, 0, r.stderr)
            return probabilities(os.path.join(dest, "predictions.csv")), r.stderr

        p_eval, log = infer("evaluate", ckpt, store, "ev")
        self.assertIn("stain normalisation from the checkpoint", log)
        p_pred, _ = infer("predict", ckpt, store, "pred", "--no-heatmaps")
        p_pre, _ = infer("evaluate", bare, store_pre, "ev_pre")
        p_plain, _ = infer("evaluate", bare, store, "ev_plain")
        self.assertEqual(len(p_eval), len(ids))
        key = lambda k: (k[0].split(":")[-1], k[1], k[2])  # the store's name prefix aside
        pre_by = {key(k): v for k, v in p_pre.items()}
        err_pre = max(abs(a - b) for k, v in p_eval.items() for a, b in zip(v, pre_by[key(k)]))
        err_pred = max(abs(a - b) for k, v in p_eval.items() for a, b in zip(v, p_pred[k]))
        err_plain = max(abs(a - b) for k, v in p_eval.items() for a, b in zip(v, p_plain[k]))
        print("slide-train: evaluate vs the bare checkpoint on NumPy-normalised tiles: max |dp| %.3g; vs predict "
              "%.3g; vs the bare checkpoint on the stored tiles %.3g" % (err_pre, err_pred, err_plain),
              file=sys.stderr)
        self.assertLess(err_pre, 1e-4)
        self.assertLess(err_pred, 1e-6)
        self.assertGreater(err_plain, 1e-3)
        # A checkpoint whose recorded target is corrupt (a stain vector that is not numbers, a negative
        # max concentration) is refused naming the field; no prediction is written.
        for bad in ({"macenko_he": "x"}, {"macenko_max_c": [-1.0, 1.0]}):
            forged = os.path.join(self.tmp, "forged")
            shutil.rmtree(forged, ignore_errors=True)
            shutil.copytree(ckpt, forged)
            with open(os.path.join(forged, "state.json")) as f:
                st = json.load(f)
            st["config"]["stain_normalization"].update(bad)
            with open(os.path.join(forged, "state.json"), "w") as f:
                json.dump(st, f)
            dest = os.path.join(self.tmp, "ev_forged")
            r = run([train, "evaluate", "--checkpoint", forged, "--data", store, "--out", dest])
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("config.stain_normalization", r.stderr)
            self.assertFalse(os.path.exists(os.path.join(dest, "predictions.csv")))
        # Training saw the normalised tiles: the same run without the option on the pre-normalised
        # store gives the same losses and the same weights, bit for bit.
        out_pre = os.path.join(self.tmp, "run_pre")
        r = run([train, "--data", store_pre, "--out", out_pre, "--epochs", "2", "--batch-size", "16", "--lr", "0.05",
                 "--width", "8", "--threads", "2", "--seed", "3"])
        self.assertEqual(r.returncode, 0, r.stderr)
        hist = lambda o: [{k: v for k, v in json.loads(l).items() if k != "seconds" and not k.endswith("_per_s")}
                          for l in open(os.path.join(o, "metrics.jsonl"))]
        self.assertEqual(hist(out), hist(out_pre))
        with open(os.path.join(ckpt, "model.safetensors"), "rb") as a, \
                open(os.path.join(out_pre, "checkpoints", os.path.basename(ckpt), "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read())
        # --resume without the option is refused.
        r = run([train, "--data", store, "--out", out, "--epochs", "3", "--batch-size", "16", "--lr", "0.05",
                 "--width", "8", "--threads", "2", "--seed", "3", "--resume"])
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("stain", r.stderr)
        self.assertIn("-> (unset);", r.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[1:], verbosity=2)
