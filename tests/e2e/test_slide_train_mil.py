#!/usr/bin/python3
"""End-to-end tests of slide-train --features (attention MIL, ABMIL) on feature bags made from real
tiles: the LC25000 lung subset in sample_data (run by ctest, one class per test).

The bags: each class folder's 120 patches, shuffled with a fixed seed, in chunks of 12 tiles: one
bag ("a slide") per chunk, 30 bags, 10 per class ("each LC25000 class folder chunk as a bag"). A
bag's tiles are laid out as a 4 x 3 mosaic of 224-px tiles: /coords are (col x 224, row x 224).
The per-tile features are computed here from the real pixels with numpy (768 values: the mean of
each RGB channel over a 16 x 16 grid of 14-px blocks, standardised per dimension), so the test needs no backbone
weights; the layout is slide/cache/bag.h's (h5py writes it: /features N x D float32, /coords N x 2
int32, root attributes slide_id, label, tile_size_px, feature_dim, format_version). TestPipeline
runs the real pipeline instead: slide-tile, slide-train (a small CNN), slide-embed, then MIL.

Environment: SLIDE_TRAIN, SLIDE_TILE, SLIDE_EMBED (binaries), SLIDE_SAMPLE_DIR (sample_data/).
"""
import collections
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

import h5py
import numpy as np
from safetensors_io import read_safetensors
from PIL import Image
from e2e_util import slide_file_stem, snapshot, write_bag

TRAIN = os.environ["SLIDE_TRAIN"]
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
LC = os.path.join(SAMPLE, "patches", "lc25000-lung-subset")
CLASSES = ["lung_aca", "lung_n", "lung_scc"]
BAG_TILES, COLS = 12, 4


def tile_features(path):
    """768 real features of one patch: RGB means over a 16 x 16 grid of 14-px blocks, in 0..1."""
    a = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    assert a.shape == (224, 224, 3), path
    return a.reshape(16, 14, 16, 14, 3).mean(axis=(1, 3)).reshape(-1)


_FEATURES = {}


def class_features():
    """{class: (120, 768) features of its patches in a fixed shuffled order}, computed once."""
    if not _FEATURES:
        rng = np.random.default_rng(7)
        for c in CLASSES:
            files = sorted(os.listdir(os.path.join(LC, c)))
            rng.shuffle(files)
            _FEATURES[c] = np.stack([tile_features(os.path.join(LC, c, f)) for f in files])
        # Standardised per dimension over all tiles (as one would a backbone's features).
        allf = np.concatenate(list(_FEATURES.values()))
        mean, std = allf.mean(axis=0), allf.std(axis=0) + 1e-6
        for c in CLASSES:
            _FEATURES[c] = (_FEATURES[c] - mean) / std
    return _FEATURES


def make_bags(out, copies=1):
    """30 x copies bags of 12 tiles (copies > 1 repeats the 30 under new slide ids: more tiles, same bags)."""
    os.makedirs(out, exist_ok=True)
    coords = np.array([[(i % COLS) * 224, (i // COLS) * 224] for i in range(BAG_TILES)])
    bags = []
    for k in range(copies):
        for c, feats in class_features().items():
            for b in range(len(feats) // BAG_TILES):
                sid = f"{c}-{b:02d}" + (f"-copy{k}" if k else "")
                write_bag(os.path.join(out, sid + ".h5"), sid, c, feats[b * BAG_TILES:(b + 1) * BAG_TILES], coords)
                bags.append((sid, c))
    return bags


def run_train(*args, **kw):
    return subprocess.run([TRAIN] + [str(a) for a in args], capture_output=True, text=True, **kw)


MIL_ARGS = ["--mil-hidden", "64", "--mil-attention", "32", "--lr", "1e-3", "--val-fraction", "0.3", "--seed", "1"]


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_mil_e2e_")
        cls.bags_dir = os.path.join(cls.tmp, "bags")
        cls.bags = make_bags(cls.bags_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def history(self, out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(l) for l in f]


class TestLearns(Base):
    def test_learns_above_chance_and_writes_checkpoints_metrics_attention(self):
        out = os.path.join(self.tmp, "run")
        r = run_train("--features", self.bags_dir, "--out", out, "--epochs", 12, *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        h = self.history(out)
        self.assertEqual([e["epoch"] for e in h], list(range(1, 13)))
        # 9 validation bags (3 per class, split by slide); chance is 1/3 and 0.5.
        self.assertGreaterEqual(h[-1]["val_balanced_accuracy"], 0.66, h[-1])
        self.assertGreater(h[-1]["val_roc_auc"], 0.8, h[-1])
        self.assertLess(h[-1]["train_loss"], h[0]["train_loss"])
        self.assertEqual(len(h[-1]["val_recall"]), 3)
        # The validation bags' confusion matrix (rows true classes): its diagonal gives the recall.
        m = np.array(h[-1]["val_confusion"]).reshape(3, 3)
        self.assertEqual(m.sum(), 9)
        for k in range(3):
            self.assertAlmostEqual(m[k, k] / m[k].sum(), h[-1]["val_recall"][k], places=6)
        with open(os.path.join(out, "report.html"), encoding="utf-8") as f:
            page = f.read()
        self.assertIn('<table id="confusion">', page)
        self.assertIn("data:image/png;base64,", page)
        self.assertEqual(sorted(os.listdir(os.path.join(out, "checkpoints"))),
                         ["epoch-10-step-0", "epoch-11-step-0", "epoch-12-step-0"])
        ck = os.path.join(out, "checkpoints", "epoch-12-step-0")
        w = read_safetensors(os.path.join(ck, "model.safetensors"))
        # CLAM_SB's parameter names and shapes (768 -> 64 -> gated 32 -> 3 classes).
        self.assertEqual(w["attention_net.0.weight"].shape, (64, 768))
        self.assertEqual(w["attention_net.3.attention_a.0.weight"].shape, (32, 64))
        self.assertEqual(w["attention_net.3.attention_b.0.weight"].shape, (32, 64))
        self.assertEqual(w["attention_net.3.attention_c.weight"].shape, (1, 32))
        self.assertEqual(w["classifiers.weight"].shape, (3, 64))
        opt = read_safetensors(os.path.join(ck, "optimizer.safetensors"))
        self.assertIn("classifiers.weight.exp_avg", opt)  # AdamW, CLAM's optimizer, by default
        with open(os.path.join(ck, "state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["model"], "abmil")
        self.assertEqual(state["classes"], CLASSES)
        self.assertTrue(os.path.exists(os.path.join(out, "best.safetensors")))
        self.assertEqual(state["best_metric"], "val_balanced_accuracy")
        self.assertEqual(state["best_epoch"], max(h, key=lambda e: e["val_balanced_accuracy"])["epoch"])
        # --best-metric applies to MIL as to tile training: here the epoch of the lowest validation loss.
        out2 = os.path.join(self.tmp, "run_best_loss")
        r2 = run_train("--features", self.bags_dir, "--out", out2, "--epochs", 4, "--best-metric", "loss", *MIL_ARGS)
        self.assertEqual(r2.returncode, 0, r2.stderr)
        with open(os.path.join(out2, "checkpoints", "epoch-4-step-0", "state.json")) as f:
            state2 = json.load(f)
        self.assertEqual(state2["best_metric"], "val_loss")
        self.assertEqual(state2["best_epoch"], min(self.history(out2), key=lambda e: e["val_loss"])["epoch"])
        self.assertTrue(os.path.exists(os.path.join(out, "curves.png")))
        self.assertIn("bags cached in RAM", r.stderr)

        # Attention: one HDF5 file and one heatmap per bag, predictions for all 30.
        att = os.path.join(out, "attention")
        with open(os.path.join(att, "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f]
        self.assertEqual(rows[0][:4], ["slide_id", "split", "label", "tiles"])
        self.assertEqual(len(rows), 31)
        self.assertEqual(sum(r[1] == "val" for r in rows[1:]), 9)
        val_rows = [r for r in rows[1:] if r[1] == "val"]
        correct = sum(r[2] == r[7] for r in val_rows)
        self.assertAlmostEqual(correct / 9.0, h[-1]["val_accuracy"], places=6)
        for row in rows[1:]:
            sid = row[0]
            with h5py.File(os.path.join(att, row[8]), "r") as f:
                a = f["attention"][:]
                self.assertEqual(a.shape, (BAG_TILES,))
                self.assertAlmostEqual(float(a.sum()), 1.0, places=5)
                self.assertTrue((a > 0).all())
                with h5py.File(os.path.join(self.bags_dir, sid + ".h5"), "r") as bag:
                    self.assertTrue(np.array_equal(f["coords"][:], bag["coords"][:]))
                self.assertEqual(f.attrs["slide_id"], sid)
                self.assertEqual(f.attrs["predicted"], row[7])
            with Image.open(os.path.join(att, row[9])) as im:
                # One 8-px cell per tile under the 28-px title band, beside the colour bar's panel.
                self.assertEqual(im.size, (COLS * 8 + 110, 28 + max((BAG_TILES // COLS) * 8, 200)))
                px = im.convert("RGB")
                # The most attended tile is the reddest cell (jet colormap over attention ranks).
                top = int(np.argmax(a))
                r_, g_, b_ = px.getpixel(((top % COLS) * 8 + 4, 28 + (top // COLS) * 8 + 4))
                self.assertGreater(r_, 100)
                self.assertLess(b_, 60)
        self.assertFalse([n for n in os.listdir(att) if n.endswith(".partial")])

        # evaluate --features: the checkpoint on bags of one class only (matched by name).
        one = os.path.join(self.tmp, "scc_only")
        os.makedirs(one)
        for n in os.listdir(self.bags_dir):
            if n.startswith("lung_scc"):
                shutil.copy(os.path.join(self.bags_dir, n), one)
        ev = os.path.join(self.tmp, "eval")
        r = run_train("evaluate", "--checkpoint", ck, "--features", one, "--out", ev)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "metrics.json")) as f:
            m = json.load(f)
        with open(os.path.join(ev, "predictions.csv")) as f:
            ev_rows = [l.rstrip("\n").split(",") for l in f][1:]
        self.assertEqual(m["bags"], 10)
        self.assertEqual(m["classes"], CLASSES)
        self.assertAlmostEqual(m["accuracy"], sum(r[7] == "lung_scc" for r in ev_rows) / 10.0, places=6)
        self.assertGreaterEqual(m["accuracy"], 0.7)  # 7 of its 10 bags were training bags
        # All 10 bags are lung_scc: the confusion matrix's third row holds them, by prediction.
        self.assertEqual(m["confusion"][:2], [[0, 0, 0], [0, 0, 0]])
        self.assertEqual(m["confusion"][2], [sum(r[7] == c for r in ev_rows) for c in CLASSES])
        self.assertTrue(os.path.exists(os.path.join(ev, "report.html")))
        self.assertTrue(all(r[1] == "eval" for r in ev_rows))
        self.assertTrue(os.path.exists(os.path.join(ev, ev_rows[0][9])))
        # Neither --data nor --features: a usage error.
        r = run_train("evaluate", "--checkpoint", ck, "--out", ev)
        self.assertEqual(r.returncode, 2)

        # predict --features (issue 15): the same bags with their labels removed, as new slides.
        unl = os.path.join(self.tmp, "unlabelled")
        shutil.copytree(one, unl)
        for n in os.listdir(unl):
            with h5py.File(os.path.join(unl, n), "a") as f:
                del f.attrs["label"]
        pr = os.path.join(self.tmp, "predict")
        r = run_train("predict", "--checkpoint", ck, "--features", unl, "--out", pr)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(pr, "metrics.json")))  # no labels, no metrics
        with open(os.path.join(pr, "predictions.csv")) as f:
            pr_rows = [l.rstrip("\n").split(",") for l in f][1:]
        self.assertEqual(len(pr_rows), 10)
        self.assertTrue(all(r[1] == "predict" and r[2] == "" for r in pr_rows))
        # The probabilities, predictions and attention equal evaluate's on the labelled bags, bit for bit.
        self.assertEqual(sorted(r[:1] + r[3:8] for r in pr_rows), sorted(r[:1] + r[3:8] for r in ev_rows))
        for row in pr_rows:
            with h5py.File(os.path.join(pr, row[8]), "r") as a, h5py.File(os.path.join(ev, row[8]), "r") as b:
                np.testing.assert_array_equal(a["attention"][:], b["attention"][:])
                self.assertEqual(a.attrs["label"], "")
                self.assertEqual(a.attrs["predicted"], b.attrs["predicted"])
            self.assertTrue(os.path.exists(os.path.join(pr, row[9])))
        # With a labels CSV, predict adds metrics: those of evaluate. A run's best.safetensors is accepted.
        labels = os.path.join(self.tmp, "scc_labels.csv")
        with open(labels, "w") as f:
            f.write("slide_id,label\n" + "".join(f"{r[0]},lung_scc\n" for r in pr_rows))
        pr2 = os.path.join(self.tmp, "predict_labelled")
        r = run_train("predict", "--checkpoint", os.path.join(ck, "model.safetensors"), "--features", unl,
                      "--labels", labels, "--out", pr2)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(pr2, "metrics.json")) as f:
            m2 = json.load(f)
        self.assertEqual({k: v for k, v in m2.items() if k != "checkpoint"},
                         {k: v for k, v in m.items() if k != "checkpoint"})
        r = run_train("predict", "--checkpoint", os.path.join(out, "best.safetensors"), "--features", unl,
                      "--out", os.path.join(self.tmp, "predict_best"))
        self.assertEqual(r.returncode, 0, r.stderr)
        # Both --data and --features, or an ABMIL checkpoint on tile stores: usage errors naming the fix.
        r = run_train("predict", "--checkpoint", ck, "--features", unl, "--data", unl, "--out", pr + "x")
        self.assertEqual(r.returncode, 2)
        self.assertIn("not both", r.stderr)
        r = run_train("predict", "--checkpoint", ck, "--data", unl, "--out", pr + "y")
        self.assertEqual(r.returncode, 2)
        self.assertIn("attention-MIL model: give its feature bags with --features", r.stderr)


class TestStreamedEqualsRam(Base):
    def test_streamed_bags_give_the_weights_of_bags_in_ram(self):
        a, b = os.path.join(self.tmp, "ram"), os.path.join(self.tmp, "streamed")
        r = run_train("--features", self.bags_dir, "--out", a, "--epochs", 2, "--cache", "ram", "--no-attention", *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = run_train("--features", self.bags_dir, "--out", b, "--epochs", 2, "--cache", "none", "--batch-size", 4,
                      "--no-attention", *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("cached in RAM", r.stderr)
        r = run_train("--features", self.bags_dir, "--out", a + "4", "--epochs", 2, "--cache", "ram", "--batch-size", 4,
                      "--no-attention", *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        wa = read_safetensors(os.path.join(a + "4", "checkpoints", "epoch-2-step-0", "model.safetensors"))
        wb = read_safetensors(os.path.join(b, "checkpoints", "epoch-2-step-0", "model.safetensors"))
        self.assertTrue(all(np.array_equal(wa[k], wb[k]) for k in wa))
        # A cache that cannot fit the budget is an error when asked for.
        r = run_train("--features", self.bags_dir, "--out", os.path.join(self.tmp, "nocache"), "--cache", "ram",
                      "--memory-budget", "100K", *MIL_ARGS)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("budget", r.stderr)


class TestDevice(Base):
    def test_simulated_device_gives_the_host_reference_bit_for_bit(self):
        # The device path (model and optimizer state on the device, each bag uploaded, probabilities
        # and attention read back) on reference-sim, whose memory host code may not read, against the
        # reference backend on the host: the same weights, optimizer state, metrics and attention.
        # Dropout (its mask uploaded), batches of 4 bags, AdamW and a resume included.
        args = ["--features", self.bags_dir, "--epochs", 2, "--batch-size", 4, "--mil-dropout", "0.25",
                "--cache", "none", *MIL_ARGS]
        outs = {}
        for backend in ("reference", "reference-sim"):
            out = os.path.join(self.tmp, "device_" + backend)
            r = run_train("--out", out, "--backend", backend, *args)
            self.assertEqual(r.returncode, 0, r.stderr)
            outs[backend] = out
        host, sim = outs["reference"], outs["reference-sim"]
        for name in ("model", "optimizer"):
            a = read_safetensors(os.path.join(host, "checkpoints", "epoch-2-step-0", name + ".safetensors"))
            b = read_safetensors(os.path.join(sim, "checkpoints", "epoch-2-step-0", name + ".safetensors"))
            self.assertEqual(sorted(a), sorted(b))
            for k in a:
                self.assertTrue(np.array_equal(a[k], b[k]), name + " " + k)
        ha, hb = self.history(host), self.history(sim)
        for ea, eb in zip(ha, hb):
            for key in ("train_loss", "val_loss", "val_accuracy", "val_balanced_accuracy", "val_roc_auc"):
                self.assertEqual(ea[key], eb[key], key)
        with open(os.path.join(host, "attention", "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f][1:]
        self.assertEqual(len(rows), 30)
        for row in rows:
            with h5py.File(os.path.join(host, "attention", row[8]), "r") as fa, \
                    h5py.File(os.path.join(sim, "attention", row[8]), "r") as fb:
                self.assertTrue(np.array_equal(fa["attention"][:], fb["attention"][:]), row[0])
                self.assertTrue(np.array_equal(fa.attrs["probabilities"], fb.attrs["probabilities"]), row[0])
        # evaluate --features on the simulated device: the same attention as the host's.
        ev = os.path.join(self.tmp, "device_eval")
        ckpt = os.path.join(sim, "checkpoints", "epoch-2-step-0")
        r = run_train("evaluate", "--checkpoint", ckpt, "--features", self.bags_dir, "--out", ev,
                      "--backend", "reference-sim")
        self.assertEqual(r.returncode, 0, r.stderr)
        for row in rows:
            with h5py.File(os.path.join(host, "attention", row[8]), "r") as fa, \
                    h5py.File(os.path.join(ev, row[8]), "r") as fb:
                self.assertTrue(np.array_equal(fa["attention"][:], fb["attention"][:]), row[0])
        # A bag whose finite features overflow the model (float32's largest: the first layer's sums pass
        # float's range) is refused naming it, not predicted as class 0 from NaN probabilities.
        huge = os.path.join(self.tmp, "huge_bags")
        os.makedirs(huge, exist_ok=True)
        with h5py.File(os.path.join(self.bags_dir, self.bags[0][0] + ".h5"), "r") as f:
            feats, coords = f["features"][:].astype(np.float32), f["coords"][:]
        write_bag(os.path.join(huge, "huge.h5"), "huge", self.bags[0][1], np.full_like(feats, np.finfo(np.float32).max), coords)
        r = run_train("evaluate", "--checkpoint", ckpt, "--features", huge, "--out", os.path.join(self.tmp, "huge_ev"))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("huge.h5 (slide 'huge'): the model's probabilities are not finite", r.stderr)
        # Its --out may not be the bags' directory (the attention files take the bags' names).
        before = snapshot(self.bags_dir)
        r = run_train("evaluate", "--checkpoint", ckpt, "--features", self.bags_dir, "--out", self.bags_dir)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--out %s is the --features directory" % self.bags_dir, r.stderr)
        self.assertEqual(snapshot(self.bags_dir), before)
        # A resumed run on the device continues from the checkpoint's state: a third epoch equals
        # the host's third epoch.
        for backend, out in outs.items():
            r = run_train("--out", out, "--backend", backend, "--resume", *[a if a != 2 else 3 for a in args])
            self.assertEqual(r.returncode, 0, r.stderr)
        a = read_safetensors(os.path.join(host, "checkpoints", "epoch-3-step-0", "model.safetensors"))
        b = read_safetensors(os.path.join(sim, "checkpoints", "epoch-3-step-0", "model.safetensors"))
        for k in a:
            self.assertTrue(np.array_equal(a[k], b[k]), "resumed " + k)


class TestResume(Base):
    def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(self):
        bags = os.path.join(self.tmp, "bags_x8")
        make_bags(bags, copies=8)  # 240 bags: epochs long enough to interrupt one in the middle
        args = ["--features", bags, "--epochs", 3, "--schedule", "cosine", "--no-attention", "--cache", "none",
                "--mil-dropout", "0.25",
                *MIL_ARGS]
        full = os.path.join(self.tmp, "full")
        r = run_train("--out", full, *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        cut = os.path.join(self.tmp, "cut")
        p = subprocess.Popen([TRAIN, "--out", cut] + [str(a) for a in args], stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(cut, "metrics.jsonl")) and time.time() < deadline and p.poll() is None:
            time.sleep(0.005)
        time.sleep(0.1)
        p.send_signal(signal.SIGINT)  # in epoch 2: the step finishes, a checkpoint is written, exit 130
        _, err = p.communicate(timeout=120)
        if p.returncode == 0:
            self.skipTest("the run finished before the interrupt arrived")
        self.assertEqual(p.returncode, 130, err)
        names = sorted(os.listdir(os.path.join(cut, "checkpoints")))
        print("checkpoints at the interrupt:", names)
        r = run_train("--out", cut, "--resume", *args)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("resumed", r.stderr)
        wa = read_safetensors(os.path.join(full, "checkpoints", "epoch-3-step-0", "model.safetensors"))
        wb = read_safetensors(os.path.join(cut, "checkpoints", "epoch-3-step-0", "model.safetensors"))
        self.assertTrue(all(np.array_equal(wa[k], wb[k]) for k in wa))
        oa = read_safetensors(os.path.join(full, "checkpoints", "epoch-3-step-0", "optimizer.safetensors"))
        ob = read_safetensors(os.path.join(cut, "checkpoints", "epoch-3-step-0", "optimizer.safetensors"))
        self.assertTrue(all(np.array_equal(oa[k], ob[k]) for k in oa))
        # A resume with options that change the math is refused before any work, naming them;
        # the checkpoints are left as they were.
        before = sorted(os.listdir(os.path.join(cut, "checkpoints")))
        changed = [a if a != "1e-3" else "2e-3" for a in args] + ["--label-smoothing", "0.1"]
        r = run_train("--out", cut, "--resume", *changed)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made with other options:", r.stderr)
        self.assertIn("--lr 0.001 -> 0.002;", r.stderr)
        self.assertIn("--label_smoothing 0.0 -> 0.1;", r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(cut, "checkpoints"))), before)
        # So is a resume on relabelled bags (one bag's label attribute changed: the same bags, the
        # same split), which would train the checkpoint towards other targets.
        import h5py
        relabelled = os.path.join(bags, "lung_n-03-copy5.h5")
        with h5py.File(relabelled, "a") as f:
            f.attrs["label"] = "lung_scc"
        r = run_train("--out", cut, "--resume", *args)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made with other labels (per class then: lung_aca 80, lung_n 80, lung_scc 80; "
                      "now: lung_aca 80, lung_n 79, lung_scc 81)", r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(cut, "checkpoints"))), before)
        # So is a resume on other bags: one bag fewer moves bags between training and validation
        # (the split is drawn over the bags found), and the run would validate on bags it trained on.
        with open(os.path.join(cut, "checkpoints", before[-1], "state.json")) as f:
            split = json.load(f)["split"]
        self.assertEqual((split["train"], split["val"], split["test"]), (168, 72, 0))  # 240 bags, 0.3 to validation
        os.remove(os.path.join(bags, "lung_n-03-copy5.h5"))
        r = run_train("--out", cut, "--resume", *args)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made on another split of the data (168 train / 72 validation / 0 test slides then, "
                      "167 train / 72 validation / 0 test now)", r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(cut, "checkpoints"))), before)
        # A damaged split record (a count of the wrong type) is refused the same way, not a crash.
        state = os.path.join(cut, "checkpoints", before[-1], "state.json")
        with open(state) as f:
            doc = json.load(f)
        doc["split"]["train"] = "many"
        with open(state, "w") as f:
            json.dump(doc, f)
        r = run_train("--out", cut, "--resume", *args)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made on another split of the data (? train / 72 validation / 0 test slides then", r.stderr)
        # A damaged labels record (a count of the wrong type) is refused naming the file and the field.
        doc["labels"]["per_class"]["lung_n"] = "many"
        with open(state, "w") as f:
            json.dump(doc, f)
        r = run_train("--out", cut, "--resume", *args)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("state.json: field 'labels.per_class.lung_n' is \"many\", expected an integer >= 0", r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(cut, "checkpoints"))), before)


class TestMemoryFlat(Base):
    def peak(self, bags_dir, out, cache):
        """(peak RSS in bytes of the child, peak tensor bytes it reports)."""
        p = subprocess.Popen([TRAIN, "--features", bags_dir, "--out", out, "--epochs", "1", "--no-attention",
                              "--cache", cache] + MIL_ARGS, stderr=subprocess.PIPE, text=True)
        err = p.stderr.read()
        p.stderr.close()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        self.assertEqual(p.returncode, 0, err)
        tensor = int([l for l in err.splitlines() if l.startswith("peak tensor memory:")][0].split()[3])
        return usage.ru_maxrss * 1024, tensor

    def test_peak_memory_stays_flat_as_tiles_grow_when_streaming(self):
        big = os.path.join(self.tmp, "bags_x16")
        make_bags(big, copies=16)  # 480 bags, 5760 tiles: 17.7 MB of features vs 1.1 MB
        extra = (480 - 30) * BAG_TILES * 768 * 4
        rss_small, t_small = self.peak(self.bags_dir, os.path.join(self.tmp, "m1"), "none")
        rss_big, t_big = self.peak(big, os.path.join(self.tmp, "m2"), "none")
        print(f"streamed: 30 bags: peak RSS {rss_small / 2**20:.1f} MiB, tensors {t_small} B; "
              f"480 bags: peak RSS {rss_big / 2**20:.1f} MiB, tensors {t_big} B")
        # Tensors: the model, optimizer and one bag's activations (+ the prefetched bags), whatever
        # the number of bags.
        self.assertLessEqual(t_big, t_small * 1.05 + 64 * 1024)
        self.assertLess(rss_big - rss_small, extra / 4)  # generous: far below the features' growth
        # The control: with the bags pinned in RAM, the same measurement grows with the data.
        _, t_ram = self.peak(big, os.path.join(self.tmp, "m3"), "ram")
        self.assertGreater(t_ram, t_big + extra * 0.9)


    def test_peak_memory_is_bounded_when_every_bag_has_its_own_size(self):
        # Real slides have N tiles each, N different from slide to slide: caches keyed by shape
        # (freed blocks of the allocator, oneDNN's primitive descriptors) must stay bounded.
        feats = np.concatenate(list(class_features().values()))
        def bags_of_sizes(out, sizes):
            os.makedirs(out)
            for b, n in enumerate(sizes):
                idx = (np.arange(n) * 7 + b) % len(feats)
                coords = np.array([[(i % 16) * 224, (i // 16) * 224] for i in range(n)])
                write_bag(os.path.join(out, f"v{b:04d}.h5"), f"v{b:04d}", CLASSES[b % 3], feats[idx], coords)
        small, big = os.path.join(self.tmp, "var_small"), os.path.join(self.tmp, "var_big")
        bags_of_sizes(small, list(range(20, 221, 5)))           # 41 bags, 41 sizes
        bags_of_sizes(big, list(range(20, 220)) * 2)            # 400 bags, 200 sizes, same largest
        rss_small, _ = self.peak(small, os.path.join(self.tmp, "v1"), "none")
        rss_big, _ = self.peak(big, os.path.join(self.tmp, "v2"), "none")
        print(f"bags of varying size, streamed: 41 bags: peak RSS {rss_small / 2**20:.1f} MiB; "
              f"400 bags: {rss_big / 2**20:.1f} MiB")
        self.assertLess(rss_big - rss_small, 40 * 2**20)  # 147 MB more features; caches bounded

    def test_attention_outputs_hold_one_bag_at_a_time(self):
        # The attention files and heatmaps are written as each bag is scored (write_attention_outputs
        # through evaluate_mil's on_bag): the peak memory of evaluate does not grow with the
        # cohort's tiles. Before, every bag's attention (4 bytes a tile) was kept to the end: 25.6 MB
        # more for the 32 more bags of 200 000 tiles here.
        T, D = 200_000, 4
        rng = np.random.default_rng(5)
        coords = np.array([[(i % 16) * 224, ((i // 16) % 16) * 224] for i in range(T)])  # a 16 x 16 grid: small heatmaps

        def bags(out, n, tiles):
            os.makedirs(out)
            for b in range(n):
                feats = rng.standard_normal((tiles, D)).astype(np.float32) + (b % 3)
                write_bag(os.path.join(out, f"w{b:03d}.h5"), f"w{b:03d}", CLASSES[b % 3], feats, coords[:tiles])
        train_bags = os.path.join(self.tmp, "wide_train")
        bags(train_bags, 9, 50)
        run = os.path.join(self.tmp, "wide_run")
        r = run_train("--features", train_bags, "--out", run, "--epochs", "1", "--no-attention", *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        ck = os.path.join(run, "checkpoints", "epoch-1-step-0")
        small, big = os.path.join(self.tmp, "wide_8"), os.path.join(self.tmp, "wide_40")
        bags(small, 8, T)
        bags(big, 40, T)

        def peak(bags_dir, out):
            p = subprocess.Popen([TRAIN, "evaluate", "--checkpoint", ck, "--features", bags_dir, "--out", out],
                                 stderr=subprocess.PIPE, text=True)
            err = p.stderr.read()
            p.stderr.close()
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            self.assertEqual(p.returncode, 0, err)
            return usage.ru_maxrss * 1024
        rss_small = peak(small, os.path.join(self.tmp, "wide_ev8"))
        rss_big = peak(big, os.path.join(self.tmp, "wide_ev40"))
        ev = os.path.join(self.tmp, "wide_ev40")
        self.assertEqual(len([f for f in os.listdir(ev) if f.endswith(".h5")]), 40)
        with h5py.File(os.path.join(ev, "w039.h5"), "r") as f:
            self.assertEqual(f["attention"].shape[0], T)
        extra = 32 * T * 4
        print(f"evaluate with attention outputs, {T} tiles a bag: 8 bags: peak RSS {rss_small / 2**20:.1f} MiB; "
              f"40 bags: {rss_big / 2**20:.1f} MiB (kept to the end, the attention would add {extra / 2**20:.1f} MiB)")
        self.assertLess(rss_big - rss_small, extra / 3)


class TestBadInput(Base):
    def test_a_bag_whose_tiles_cannot_be_drawn_keeps_its_attention_without_a_heatmap(self):
        # Two tiles 4999 tile sides apart on both axes: a 5000 x 5000 tile grid (over 2^24 cells)
        # that no heatmap is drawn for. The run ends well; the bag keeps its attention file and
        # its predictions row, with an empty heatmap column, and a warning names it.
        bags = os.path.join(self.tmp, "sparse_bags")
        shutil.copytree(self.bags_dir, bags)
        feats = class_features()["lung_aca"][:2]
        write_bag(os.path.join(bags, "sparse.h5"), "sparse", "lung_aca", feats,
                  np.array([[0, 0], [4999 * 224, 4999 * 224]]))
        out = os.path.join(self.tmp, "sparse_run")
        r = run_train("--features", bags, "--out", out, "--epochs", 1, *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("no heatmap for this slide", r.stderr)
        self.assertIn("a tile grid of 5000 x 5000 cells is too large for a heatmap", r.stderr)
        att = os.path.join(out, "attention")
        with open(os.path.join(att, "predictions.csv")) as f:
            rows = {row[0]: row for row in (l.rstrip("\n").split(",") for l in list(f)[1:])}
        self.assertEqual(len(rows), 31)
        self.assertEqual(rows["sparse"][-1], "")
        self.assertTrue(os.path.exists(os.path.join(att, "sparse.h5")))
        self.assertFalse(os.path.exists(os.path.join(att, "sparse.png")))
        self.assertTrue(os.path.exists(os.path.join(att, rows["lung_n-03"][-1])))

    def test_errors_name_the_problem(self):
        out = os.path.join(self.tmp, "bad")
        # Tile-only options are refused with --features.
        r = run_train("--features", self.bags_dir, "--out", out, "--model", "resnet18")
        self.assertEqual(r.returncode, 2)
        self.assertIn("--model does not apply to --features", r.stderr)
        # A corrupt bag: the error names the file.
        bad = os.path.join(self.tmp, "badbags")
        shutil.copytree(self.bags_dir, bad)
        with open(os.path.join(bad, "lung_n-03.h5"), "r+b") as f:
            f.write(b"garbage" * 10)
        r = run_train("--features", bad, "--out", out, *MIL_ARGS)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("lung_n-03.h5", r.stderr)
        # A labels CSV that misses a slide names it; one with a patient column splits by patient.
        csv = os.path.join(self.tmp, "labels.csv")
        with open(csv, "w") as f:
            f.write("slide_id,label\n" + "".join(f"{s},{c}\n" for s, c in self.bags[1:]))
        r = run_train("--features", self.bags_dir, "--out", out, "--labels", csv, *MIL_ARGS)
        self.assertEqual(r.returncode, 2)
        self.assertIn(self.bags[0][0], r.stderr)
        # Nothing was written for a run refused at the start.
        self.assertFalse(os.path.exists(os.path.join(out, "metrics.jsonl")))
        # --batch-size auto sizes tile batches; for bags it is a usage error, not a division by 0.
        for batch in ("auto", "0"):
            r = run_train("--features", self.bags_dir, "--out", os.path.join(self.tmp, "auto"), "--batch-size", batch,
                          *MIL_ARGS)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--batch-size 0 with --features: give a number of bags per step", r.stderr)
        # Tile training's folds, test split, precision and fine-tuning are not built for bags: refused,
        # not silently ignored.
        for option in (["--folds", "5"], ["--test-fraction", "0.2"], ["--precision", "bf16"], ["--lr-backbone", "0"]):
            r = run_train("--features", self.bags_dir, "--out", os.path.join(self.tmp, "opt"), *option, *MIL_ARGS)
            self.assertEqual(r.returncode, 2, (option, r.stderr))
            self.assertIn("%s does not apply to --features" % option[0], r.stderr)
        # Class weights must be finite, non-negative and not all 0.
        for weights in ("inf,1", "1e39,1", "0,0", "-1,1"):
            r = run_train("--features", self.bags_dir, "--out", os.path.join(self.tmp, "cw"), "--class-weights",
                          weights, *MIL_ARGS)
            self.assertEqual(r.returncode, 2, (weights, r.stderr))
            self.assertIn("finite non-negative numbers, not all 0", r.stderr)
        # An attention directory that is the bags' own (the attention files take the bags' names)
        # is refused before anything runs, for training and for evaluate's --out; the bags stay.
        before = snapshot(self.bags_dir)
        r = run_train("--features", self.bags_dir, "--out", os.path.join(self.tmp, "att"), "--attention-dir",
                      self.bags_dir + "/", "--epochs", "1", *MIL_ARGS)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("is the --features directory", r.stderr)
        self.assertEqual(snapshot(self.bags_dir), before)


    def test_bags_of_another_encoder_are_refused(self):
        """Bags whose features another encoder made (their model / layer / weights_sha256
        attributes) are refused, naming both encoders: mixed into one training run, and against a
        checkpoint trained on another encoder's features (evaluate; state.json records it)."""
        other = os.path.join(self.tmp, "other_encoder")
        shutil.copytree(self.bags_dir, other)
        for n in os.listdir(other):
            with h5py.File(os.path.join(other, n), "r+") as f:
                f.attrs["model"] = "uni"
                f.attrs["layer"] = "fc"
                f.attrs["weights_sha256"] = "ab" * 32
        # The same feature width (768) and labels: only the attributes tell them apart.
        mixed = os.path.join(self.tmp, "mixed_encoders")
        shutil.copytree(self.bags_dir, mixed)
        shutil.copy(os.path.join(other, "lung_n-03.h5"), os.path.join(mixed, "lung_n-03.h5"))
        out = os.path.join(self.tmp, "mixed_out")
        r = run_train("--features", mixed, "--out", out, "--epochs", "1", *MIL_ARGS)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("lung_n-03.h5 holds features of uni fc, weights sha256 abababababab...", r.stderr)
        self.assertIn("of rgb_block_means 16x16: one model needs one encoder's features", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "metrics.jsonl")))
        # A second directory of another encoder's bag (of a slide of its own): the same.
        third = os.path.join(self.tmp, "third_encoder")
        os.makedirs(third)
        shutil.copy(os.path.join(other, "lung_n-03.h5"), os.path.join(third, "extra-00.h5"))
        with h5py.File(os.path.join(third, "extra-00.h5"), "r+") as f:
            f.attrs["slide_id"] = "extra-00"
        r = run_train("--features", self.bags_dir, third, "--out", out, "--epochs", "1", *MIL_ARGS)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("extra-00.h5 holds features of uni fc", r.stderr)
        # Trained on one encoder's bags, evaluated on the other's.
        out = os.path.join(self.tmp, "encoder_run")
        r = run_train("--features", self.bags_dir, "--out", out, "--epochs", "1", *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        ck = os.path.join(out, "checkpoints", "epoch-1-step-0")
        with open(os.path.join(ck, "state.json")) as f:
            self.assertEqual(json.load(f)["encoder"], {"model": "rgb_block_means", "layer": "16x16", "weights_sha256": ""})
        r = run_train("evaluate", "--checkpoint", ck, "--features", other, "--out", os.path.join(self.tmp, "encoder_ev"))
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("the model was trained on features of rgb_block_means 16x16; the bags given hold features of uni fc",
                      r.stderr)
        r = run_train("evaluate", "--checkpoint", ck, "--features", self.bags_dir, "--out",
                      os.path.join(self.tmp, "encoder_ev_same"))
        self.assertEqual(r.returncode, 0, r.stderr)
        # A damaged record (a field of another type) is a clear error naming it, not a crash.
        state = os.path.join(ck, "state.json")
        with open(state) as f:
            record = json.load(f)
        record["encoder"]["model"] = 5
        with open(state, "w") as f:
            json.dump(record, f)
        r = run_train("evaluate", "--checkpoint", ck, "--features", self.bags_dir, "--out",
                      os.path.join(self.tmp, "encoder_ev_bad"))
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(state + ": field 'encoder.model' is 5, expected a string", r.stderr)


class TestOutputSafety(Base):
    """Issue 20 for --features: one writer per --out, an earlier run kept unless --resume or
    --overwrite, evaluate's --out the same; refusals change nothing."""

    def test_earlier_run_and_second_writer(self):
        import fcntl
        out = os.path.join(self.tmp, "safe")
        args = ["--features", self.bags_dir, "--out", out, "--epochs", 1, *MIL_ARGS]
        r = run_train(*args)
        self.assertEqual(r.returncode, 0, r.stderr)
        before = snapshot(out)
        self.assertIn(os.path.join("attention", "predictions.csv"), before)
        r = run_train(*args)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--out %s holds an earlier run (checkpoints/, attention/, metrics.jsonl" % out, r.stderr)
        self.assertEqual(snapshot(out), before)
        with open(os.path.join(out, "writer.lock"), "a+") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            r = run_train(*args, "--overwrite")
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertRegex(r.stderr, r"output directory %s is being written by another process \(pid \d+" % out)
        self.assertEqual(snapshot(out), before)
        r = run_train(*args, "--overwrite")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(out, "checkpoints"))), ["epoch-1-step-0"])
        ev = os.path.join(self.tmp, "safe-eval")
        evaluate = ["evaluate", "--checkpoint", os.path.join(out, "checkpoints", "epoch-1-step-0"), "--features",
                    self.bags_dir, "--out", ev]
        self.assertEqual(run_train(*evaluate).returncode, 0)
        before = snapshot(ev)
        r = run_train(*evaluate)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("holds an earlier evaluation (predictions.csv, metrics.json)", r.stderr)
        self.assertEqual(snapshot(ev), before)
        self.assertEqual(run_train(*evaluate, "--overwrite").returncode, 0)


class TestSlideIdFileNames(unittest.TestCase):
    """Issue 22 part 3: slide ids that are not file names ("../../x", 300 characters) through the
    real pipeline: slide-tile --manifest, slide-embed, MIL training with attention outputs. Bags,
    attention files and heatmaps are named by slide_file_stem inside their output directories, the
    full ids stay inside the files (the bags' slide_id attribute, the CSV columns), and nothing is
    written anywhere else."""

    def test_hostile_ids_stay_inside_the_output_directories(self):
        tmp = tempfile.mkdtemp(prefix="slide_mil_ids_")
        self.addCleanup(shutil.rmtree, tmp, True)
        work = os.path.join(tmp, "a", "b")  # "../../x" joined to work/bags would land in tmp/a if it escaped
        os.makedirs(work)
        tile, embed = os.environ["SLIDE_TILE"], os.environ["SLIDE_EMBED"]
        cmu = os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")
        long_id = "L" * 300
        manifest, labels = os.path.join(work, "m.csv"), os.path.join(work, "labels.csv")
        with open(manifest, "w") as f:
            f.write("slide_id,path\n../../x,%s\n%s,%s\n" % (cmu, long_id, cmu))
        with open(labels, "w") as f:
            # Class names that CSV must quote: a comma, a double quote (RFC 4180 in, RFC 4180 out).
            f.write('slide_id,label\n../../x,"a, grade 1"\n%s,"b ""2"""\n' % long_id)
        store, lc, cnn, bags, out = (os.path.join(work, n) for n in ("store", "lc", "cnn", "bags", "mil"))
        for cmd in ([tile, "--manifest", manifest, "--mpp", "2.0", "--min-tissue", "0", "--tile-size", "64", "-o", store,
                     "-q"],
                    [tile, "--patches", LC, "--tile-size", "32", "-o", lc, "-q"],
                    [TRAIN, "--data", lc, "--out", cnn, "--epochs", "1", "--width", "4", "--threads", "2", "-q"],
                    [embed, store, "-o", bags, "--weights", os.path.join(cnn, "checkpoints", "epoch-1-step-0"), "-q"],
                    [TRAIN, "--features", bags, "--labels", labels, "--out", out, "--epochs", "1", "--val-fraction", "0",
                     "--mil-hidden", "8", "--mil-attention", "4", "-q"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, (cmd, r.stderr))
        stems = {sid: slide_file_stem(sid) for sid in ("../../x", long_id)}
        self.assertTrue(stems["../../x"].startswith("_._.._x~"))
        self.assertLessEqual(len(stems[long_id].encode()), 200)
        self.assertEqual(sorted(n for n in os.listdir(bags) if n.endswith(".h5")), sorted(s + ".h5" for s in stems.values()))
        for sid, stem in stems.items():
            with h5py.File(os.path.join(bags, stem + ".h5"), "r") as f:
                self.assertEqual(f.attrs["slide_id"], sid)  # the full id, inside the file
        import csv as csv_module
        with open(os.path.join(bags, "bags.csv")) as f:
            self.assertEqual(sorted(r["slide_id"] for r in csv_module.DictReader(f)), sorted(stems))
        att = os.path.join(out, "attention")
        self.assertEqual(sorted(n for n in os.listdir(att) if n != "predictions.csv"),
                         sorted([s + ".h5" for s in stems.values()] + [s + ".png" for s in stems.values()]))
        with open(os.path.join(att, "predictions.csv")) as f:
            rows = {r["slide_id"]: r for r in csv_module.DictReader(f)}
        self.assertEqual(sorted(rows), sorted(stems))
        for sid, stem in stems.items():
            self.assertEqual((rows[sid]["attention_file"], rows[sid]["heatmap"]), (stem + ".h5", stem + ".png"))
        classes = {"../../x": "a, grade 1", long_id: 'b "2"'}
        for sid, row in rows.items():
            self.assertEqual(row["label"], classes[sid])
            self.assertIn(row["predicted"], classes.values())
            self.assertAlmostEqual(float(row["p_a, grade 1"]) + float(row['p_b "2"']), 1.0, places=5)
        # Nothing anywhere else: every file of the temp tree is an input or inside an output directory.
        allowed = tuple(d + os.sep for d in (store, lc, cnn, bags, out))
        for root, _, files in os.walk(tmp):
            for name in files:
                p = os.path.join(root, name)
                self.assertTrue(p.startswith(allowed) or os.path.dirname(p) == work, "written outside: " + p)


class TestLabelsCsvPatients(Base):
    def train_with_labels(self, name, rows, *extra, seed="1"):
        """One epoch on the bags with a labels CSV of `rows` (its header first), `extra` options and
        `seed`; the run and each bag's side of the split, from attention/predictions.csv."""
        csv = os.path.join(self.tmp, name + ".csv")
        with open(csv, "w") as f:
            f.write("".join(",".join(row) + "\n" for row in rows))
        out = os.path.join(self.tmp, name)
        args = MIL_ARGS[:MIL_ARGS.index("--seed")] + ["--seed", seed] + MIL_ARGS[MIL_ARGS.index("--seed") + 2:]
        r = run_train("--features", self.bags_dir, "--out", out, "--labels", csv, "--epochs", 1, *args, *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "attention", "predictions.csv")) as f:
            return r, {l.split(",")[0]: l.split(",")[1] for l in f.read().splitlines()[1:]}

    def test_patient_column_keeps_a_patients_bags_on_one_side(self):
        # Two bags per "patient" (consecutive bags of a class); labels from the CSV, not the bags.
        _, split = self.train_with_labels("patients", [("slide_id", "label", "patient")] +
                                          [(s, c, f"p{i // 2}") for i, (s, c) in enumerate(self.bags)])
        for i in range(0, len(self.bags), 2):
            self.assertEqual(split[self.bags[i][0]], split[self.bags[i + 1][0]])
        self.assertEqual(sum(v == "val" for v in split.values()), 10)  # round(0.3 x 15 patients) x 2

    def test_a_class_on_one_side_of_the_split_is_warned(self):
        # One bag relabelled "rare": the split by slide puts it on one side, and the log says, before
        # training, that the other side has no bag of that class (as tile training says it of tiles).
        r, split = self.train_with_labels("rare", [("slide_id", "label")] +
                                          [(s, "rare" if i == 0 else c) for i, (s, c) in enumerate(self.bags)])
        other = "validation" if split[self.bags[0][0]] == "train" else "training"
        self.assertIn(f"a class has no {other} bag after the split class=rare seed=1", r.stderr)
        self.assertNotIn("a class has no training bag after the split class=lung", r.stderr)
        self.assertNotIn("a class has no validation bag after the split class=lung", r.stderr)

    def test_stratify_puts_every_class_on_both_sides_in_its_share(self):
        # Three bags relabelled "rare": --stratify validates round(0.3 x 3) = 1 of them and
        # round(0.3 x n) of each other class's n bags, whatever the seed; no class is missing from
        # either side. (Without it, seed 1 here leaves "rare" on one side: the case above.)
        rows = [("slide_id", "label")] + [(s, "rare" if i in (0, 10, 20) else c) for i, (s, c) in enumerate(self.bags)]
        counts = collections.Counter(label for _, label in rows[1:])
        for seed in ("1", "2"):
            r, split = self.train_with_labels("stratified-" + seed, rows, "--stratify", seed=seed)
            self.assertNotIn("a class has no", r.stderr)
            label = dict(rows[1:])
            val = collections.Counter(label[s] for s, side in split.items() if side == "val")
            self.assertEqual(val, {c: round(0.3 * n) for c, n in counts.items()}, seed)


class TestPipeline(unittest.TestCase):
    """The real pipeline: slide-tile (the LC25000 patches and the CMU-1 slide), slide-train (a small
    CNN, one epoch), slide-embed (its features into bags and bags.csv), then MIL on those bags."""

    def test_tile_train_embed_mil(self):
        tmp = tempfile.mkdtemp(prefix="slide_mil_pipeline_")
        self.addCleanup(shutil.rmtree, tmp, True)
        tile, embed = os.environ["SLIDE_TILE"], os.environ["SLIDE_EMBED"]
        lc, cmu, cnn, bags, out = (os.path.join(tmp, n) for n in ("lc", "cmu", "cnn", "bags", "mil"))
        for cmd in ([tile, "--patches", LC, "--tile-size", "48", "-o", lc, "-q"],
                    [tile, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "1", "--tile-size", "64",
                     "-o", cmu, "-q"],
                    [TRAIN, "--data", lc, "--out", cnn, "--epochs", "1", "--batch-size", "32", "--lr", "0.05",
                     "--width", "8", "--threads", "2", "-q"],
                    [embed, lc, cmu, "-o", bags, "--weights", os.path.join(cnn, "checkpoints", "epoch-1-step-0"), "-q"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, (cmd, r.stderr))
        # Labels: the patches' classes from bags.csv; the one real slide gets a class only so that
        # its attention heatmap is drawn (the LC25000 bags are one tile each, so it is the only bag
        # with a tile grid).
        with open(os.path.join(bags, "bags.csv")) as f:
            rows = [l.split(",") for l in f.read().splitlines()[1:]]
        self.assertEqual(len(rows), 361)
        labels = os.path.join(tmp, "labels.csv")
        with open(labels, "w") as f:
            f.write("slide_id,label\n" + "".join(f"{r[0]},{r[5] or 'lung_n'}\n" for r in rows))
        r = run_train("--features", bags, "--labels", labels, "--out", out, "--epochs", 4, "--batch-size", 8,
                      *MIL_ARGS)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            h = [json.loads(l) for l in f]
        self.assertGreater(h[-1]["val_balanced_accuracy"], 0.5, h[-1])  # chance 1/3
        att = os.path.join(out, "attention")
        with h5py.File(os.path.join(att, "CMU-1-Small-Region.h5"), "r") as f, \
                h5py.File(os.path.join(bags, "CMU-1-Small-Region.h5"), "r") as bag:
            self.assertEqual(f["attention"].shape, (bag["features"].shape[0],))
            self.assertAlmostEqual(float(f["attention"][:].sum()), 1.0, places=5)
            coords = bag["coords"][:]
            self.assertTrue(np.array_equal(f["coords"][:], coords))
            step = int(bag["coords"].attrs["patch_size_level0"])
        with Image.open(os.path.join(att, "CMU-1-Small-Region.png")) as im:
            cols = (coords[:, 0].max() - coords[:, 0].min()) // step + 1
            rows_ = (coords[:, 1].max() - coords[:, 1].min()) // step + 1
            # The map (8 px a tile) under a 28-px title band, beside a 110-px colour bar panel.
            self.assertEqual(im.size, (cols * 8 + 110, 28 + max(rows_ * 8, 200)))
            a = np.asarray(im.convert("RGB"))[28:28 + rows_ * 8, :cols * 8].reshape(-1, 3)
            self.assertEqual((a != 255).any(axis=1).sum(), len(coords) * 64)  # one coloured cell per tile
        # With the tile stores, the heatmap is drawn over the slide's thumbnail (evaluate, as training does).
        ev = os.path.join(tmp, "eval")
        r = run_train("evaluate", "--checkpoint", os.path.join(out, "checkpoints", "epoch-4-step-0"), "--features", bags,
                      "--labels", labels, "--out", ev, "--slide-stores", cmu, lc)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("heatmaps over the tile grid instead", r.stderr)  # the patches are not slides
        import openslide
        with openslide.OpenSlide(os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")) as sl:
            w0, h0 = sl.dimensions
        with Image.open(os.path.join(ev, "CMU-1-Small-Region.png")) as im:
            ds = w0 / (im.size[0] - 110)  # the thumbnail, then the colour bar's panel
            self.assertAlmostEqual(im.size[1] - 28, h0 / ds, delta=2)    # the whole slide, its aspect ratio
            self.assertAlmostEqual(max(w0, h0) / ds, 1024, delta=2)      # 1024 px on the longer side
            self.assertGreater(len(im.convert("RGB").getcolors(1 << 20)), 1000)  # the slide's pixels, tinted
        with Image.open(os.path.join(ev, slide_file_stem("lung_n/lungn1") + ".png")) as im:
            self.assertEqual(im.size, (8 + 110, 28 + 200))  # a patch: one grid cell, and the bar


if __name__ == "__main__":
    unittest.main()
