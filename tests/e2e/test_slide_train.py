#!/usr/bin/python3
"""End-to-end tests of slide-train on real tiles: the LC25000 lung subset in sample_data, tiled by
slide-tile (run by ctest, one class per test).

Environment: SLIDE_TILE, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR (sample_data/).
"""
import collections
import csv
import json
import re
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
from safetensors_io import read_safetensors, write_safetensors
from e2e_util import CHROMIUM_FLAGS, chromium, report_tables, screenshot, snapshot

TILE = os.environ["SLIDE_TILE"]
TRAIN = os.environ["SLIDE_TRAIN"]
EMBED = os.environ.get("SLIDE_EMBED", "")
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
LC = os.path.join(SAMPLE, "patches", "lc25000-lung-subset")


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_train_e2e_")
        cls.store = cls.lc25000_store("lc", 48)

    @classmethod
    def lc25000_store(cls, name, px):
        """The LC25000 subset tiled at `px` pixels into the class's directory `name`; its path."""
        path = os.path.join(cls.tmp, name)
        r = subprocess.run([TILE, "--patches", LC, "--tile-size", str(px), "-o", path, "-q"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return path

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def train(self, out, *extra, epochs=6, batch=32, lr=0.05, **kw):
        args = [TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--batch-size", str(batch),
                "--lr", str(lr),
                "--width", "8", "--threads", "2", "--seed", "3"] + list(extra)
        return subprocess.run(args, capture_output=True, text=True, **kw)


class TestTrain(Base):
    def test_learns_and_writes_metrics_and_torchvision_named_weights(self):
        out = os.path.join(self.tmp, "run")
        r = self.train(out)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            history = [json.loads(l) for l in f]
        self.assertEqual([h["epoch"] for h in history], [1, 2, 3, 4, 5, 6])
        self.assertGreater(history[-1]["val_balanced_accuracy"], 0.7)   # chance: 1/3
        self.assertGreater(history[-1]["val_roc_auc"], 0.8)             # chance: 0.5
        self.assertEqual(len(history[-1]["val_recall"]), 3)
        self.assertLess(history[-1]["train_loss"], history[0]["train_loss"])
        with open(os.path.join(out, "metrics.csv")) as f:
            csv = f.read().splitlines()
        self.assertEqual(len(csv), 7)
        from PIL import Image
        with Image.open(os.path.join(out, "curves.png")) as im:
            self.assertEqual(im.size, (960, 392))  # two 480 x 360 panels under a title band
            a = np.asarray(im.convert("RGB"))
            colors = {c for _, c in im.convert("RGB").getcolors(1 << 16)}
            self.assertTrue({(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)} <= colors)
            # Loss on the left panel, accuracies on the right; text (ticks, labels, title) in black.
            def has(rgb, x0, x1):
                return bool((a[:, x0:x1] == rgb).all(axis=2).any())
            self.assertTrue(has((31, 119, 180), 0, 480) and has((255, 127, 14), 0, 480))
            self.assertTrue(has((44, 160, 44), 480, 960) and has((214, 39, 40), 480, 960))
            self.assertFalse(has((44, 160, 44), 0, 480))
            self.assertGreater(int((a[:32] < 80).all(axis=2).sum()), 100)  # the title's glyphs
        # best.safetensors is the epoch with the best validation balanced accuracy (the default --best-metric).
        with open(os.path.join(out, "checkpoints", "epoch-6-step-0", "state.json")) as f:
            state = json.load(f)
        best_epoch = max(history, key=lambda h: h["val_balanced_accuracy"])["epoch"]
        self.assertEqual(state["best_epoch"], best_epoch)
        self.assertEqual(state["best_metric"], "val_balanced_accuracy")
        best = read_safetensors(os.path.join(out, "best.safetensors"))
        if best_epoch >= 4:  # its checkpoint is still kept: the same weights
            kept = read_safetensors(os.path.join(out, "checkpoints", "epoch-%d-step-0" % best_epoch, "model.safetensors"))
            self.assertTrue(all(np.array_equal(best[k], kept[k]) for k in kept))
        self.assertEqual(best["0.weight"].shape, (8, 3, 3, 3))
        self.assertEqual(best["fc.weight"].shape, (3, 32))
        self.assertIn("1.running_var", best)
        self.assertTrue(all(np.isfinite(v).all() for v in best.values()))
        # The newest three checkpoints are kept.
        self.assertEqual(sorted(os.listdir(os.path.join(out, "checkpoints"))),
                         ["epoch-4-step-0", "epoch-5-step-0", "epoch-6-step-0"])

        # evaluate: per-tile predictions whose argmax agrees with the reported accuracy.
        ev = os.path.join(self.tmp, "eval")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "checkpoints", "epoch-6-step-0"),
                            "--data", self.store, "--out", ev], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f]
        self.assertEqual(rows[0][:4], ["slide_id", "x_l0", "y_l0", "label"])
        self.assertEqual(len(rows), 361)
        probs = np.array([[float(v) for v in row[4:7]] for row in rows[1:]])
        self.assertTrue(np.allclose(probs.sum(axis=1), 1.0, atol=1e-4))
        classes = ["lung_aca", "lung_n", "lung_scc"]
        correct = sum(classes[int(np.argmax(p))] == row[3] for p, row in zip(probs, rows[1:]))
        with open(os.path.join(ev, "metrics.json")) as f:
            metrics = json.load(f)
        self.assertAlmostEqual(metrics["accuracy"], correct / 360.0, places=6)
        # The confusion matrix (rows true classes, columns the argmax) from the same predictions.
        want = np.zeros((3, 3), dtype=int)
        for p, row in zip(probs, rows[1:]):
            want[classes.index(row[3]), int(np.argmax(p))] += 1
        self.assertEqual(metrics["confusion"], want.tolist())
        tables, _ = report_tables(os.path.join(ev, "report.html"))
        self.assertEqual([[int(v) for v in r[1:]] for r in tables["confusion"][1:]], want.tolist())
        self.assertEqual(dict((r[0], r[1]) for r in tables["metrics"])["accuracy"], "%.4f" % metrics["accuracy"])
        self.assertGreater(metrics["roc_auc"], 0.8)
        with open(os.path.join(ev, "slides.csv")) as f:
            self.assertEqual(len(f.read().splitlines()), 361)  # one patch per slide
        # The fused inference path (batch norm folded, ReLU fused) is the default; the engine's
        # forward (--no-fused) gives the same figures up to float rounding.
        self.assertEqual(metrics["inference"], "fused")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "checkpoints", "epoch-6-step-0"),
                            "--data", self.store, "--out", ev + "-engine", "--no-fused"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev + "-engine", "metrics.json")) as f:
            engine = json.load(f)
        self.assertEqual(engine["inference"], "engine")
        for key in ("loss", "accuracy", "balanced_accuracy", "roc_auc"):
            self.assertAlmostEqual(metrics[key], engine[key], delta=1e-5, msg=key)
        with open(os.path.join(ev + "-engine", "predictions.csv")) as f:
            engine_probs = np.array([[float(v) for v in l.split(",")[4:7]] for l in f.read().splitlines()[1:]])
        self.assertLess(np.abs(engine_probs - probs).max(), 1e-5)


class TestCache(Base):
    def test_ram_cache_gives_the_same_weights(self):
        a, b = os.path.join(self.tmp, "cached"), os.path.join(self.tmp, "streamed")
        r = self.train(a, "--cache", "ram")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("dataset cached in RAM", r.stderr)
        r = self.train(b, "--cache", "none")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("cached in RAM", r.stderr)
        wa = read_safetensors(os.path.join(a, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        wb = read_safetensors(os.path.join(b, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        self.assertTrue(all(np.array_equal(wa[k], wb[k]) for k in wa))
        # A cache that cannot fit the budget is an error when asked for.
        r = self.train(os.path.join(self.tmp, "nocache"), "--cache", "ram", "--memory-budget", "1M")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("decoded dataset (RAM cache)", r.stderr)


class TestResume(Base):
    def test_sigint_then_resume_gives_the_uninterrupted_weights(self):
        ref = os.path.join(self.tmp, "ref")
        t0 = time.monotonic()
        self.assertEqual(self.train(ref).returncode, 0)
        seconds = time.monotonic() - t0
        final = read_safetensors(os.path.join(ref, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        interrupted = 0
        for i, frac in enumerate((0.35, 0.7)):
            out = os.path.join(self.tmp, "int%d" % i)
            p = subprocess.Popen([TRAIN, "--data", self.store, "--out", out, "--epochs", "6", "--batch-size", "32",
                                  "--lr", "0.05", "--width", "8", "--threads", "2", "--seed", "3"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            time.sleep(frac * seconds)
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=120)
            if p.returncode == 130:
                interrupted += 1
                self.assertIn("checkpoint written", err)
            else:
                self.assertEqual(p.returncode, 0, err)
            r = self.train(out, "--resume")
            self.assertEqual(r.returncode, 0, r.stderr)
            got = read_safetensors(os.path.join(out, "checkpoints", "epoch-6-step-0", "model.safetensors"))
            for name, value in final.items():
                self.assertTrue(np.array_equal(got[name], value), "%s differs after resume %d" % (name, i))
        self.assertGreaterEqual(interrupted, 1, "the interrupts should land mid-run")

    def test_sigkill_then_resume_from_the_last_epoch(self):
        ref = os.path.join(self.tmp, "ref2")
        self.assertEqual(self.train(ref).returncode, 0)
        out = os.path.join(self.tmp, "killed")
        p = subprocess.Popen([TRAIN, "--data", self.store, "--out", out, "--epochs", "6", "--batch-size", "32",
                              "--lr", "0.05", "--width", "8", "--threads", "2", "--seed", "3"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.isdir(os.path.join(out, "checkpoints", "epoch-2-step-0")):
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
        r = self.train(out, "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        a = read_safetensors(os.path.join(ref, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        b = read_safetensors(os.path.join(out, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        self.assertTrue(all(np.array_equal(a[k], b[k]) for k in a))
        # A resume with options that change the math is refused, naming them.
        r = subprocess.run([TRAIN, "--data", self.store, "--out", out, "--epochs", "6", "--batch-size", "32",
                            "--lr", "0.2", "--width", "8", "--threads", "2", "--seed", "3", "--dropout", "0.1",
                            "--resume"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made with other options:", r.stderr)
        self.assertIn(" --lr 0.05 -> 0.2;", r.stderr)
        self.assertIn(" --dropout 0.0 -> 0.1;", r.stderr)
        # So is a resume on more data: a second store (a copy, its slides under store index 1) moves
        # slides between training and validation, and the run would validate on slides it trained on.
        with open(os.path.join(out, "checkpoints", "epoch-6-step-0", "state.json")) as f:
            split = json.load(f)["split"]
        self.assertEqual(split["train"] + split["val"], 360)  # the LC25000 subset: 360 patches, a slide each
        self.assertGreater(split["val"], 0)
        self.assertEqual(split["test"], 0)
        copy = os.path.join(self.tmp, "lc-copy")
        shutil.copytree(self.store, copy)
        r = subprocess.run([TRAIN, "--data", self.store, copy, "--out", out, "--epochs", "6", "--batch-size", "32",
                            "--lr", "0.05", "--width", "8", "--threads", "2", "--seed", "3", "--resume"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made on another split of the data (%d train / %d validation / 0 test slides then, "
                      % (split["train"], split["val"]), r.stderr)

    def test_resume_is_exact_with_dropout_colour_jitter_and_random_crops(self):
        extra = ["--dropout", "0.3", "--color-jitter", "0.2,0.2,0.2,0.05", "--random-resized-crop", "0.5"]
        ref = os.path.join(self.tmp, "ref3")
        r = self.train(ref, *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp, "killed3")
        p = subprocess.Popen([TRAIN, "--data", self.store, "--out", out, "--epochs", "6", "--batch-size", "32",
                              "--lr", "0.05", "--width", "8", "--threads", "2", "--seed", "3"] + extra,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.path.isdir(os.path.join(out, "checkpoints", "epoch-3-step-0")):
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
        r = self.train(out, "--resume", *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        a = read_safetensors(os.path.join(ref, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        b = read_safetensors(os.path.join(out, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        self.assertTrue(all(np.array_equal(a[k], b[k]) for k in a))
        # The augmented, dropped-out run still learns (chance: 1/3), and differs from a plain one.
        with open(os.path.join(ref, "metrics.jsonl")) as f:
            history = [json.loads(l) for l in f]
        self.assertGreater(history[-1]["val_balanced_accuracy"], 0.6)
        plain = os.path.join(self.tmp, "plain3")
        self.assertEqual(self.train(plain).returncode, 0)
        c = read_safetensors(os.path.join(plain, "checkpoints", "epoch-6-step-0", "model.safetensors"))
        self.assertFalse(np.array_equal(a["fc.weight"], c["fc.weight"]))


class TestReport(Base):
    """Issue 16 item 5: report.html beside a training run's outputs: self-contained (the curves
    inlined), its tables filled from the run's own figures, and rendered by a real browser."""

    def test_report_holds_the_runs_figures_and_renders_in_chromium(self):
        out = os.path.join(self.tmp, "report-run")
        r = self.train(out, epochs=3)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            history = [json.loads(l) for l in f]
        tables, images = report_tables(os.path.join(out, "report.html"))
        # The epochs: one row each, the figures metrics.jsonl has (to 4 places).
        epochs = tables["epochs"]
        self.assertEqual(len(epochs), 1 + 3)
        for row, h in zip(epochs[1:], history):
            self.assertEqual(int(row[0]), h["epoch"])
            self.assertAlmostEqual(float(row[1]), h["train_loss"], places=4)
            self.assertAlmostEqual(float(row[5]), h["val_balanced_accuracy"], places=4)
        # The confusion matrix of the last epoch: its rows are the val tiles of each class, its
        # diagonal over them the recall metrics.jsonl has, its total the val set's size.
        classes = ["lung_aca", "lung_n", "lung_scc"]
        confusion = tables["confusion"]
        self.assertEqual(confusion[0][1:], classes)
        m = np.array([[int(v) for v in row[1:]] for row in confusion[1:]])
        self.assertEqual(m.tolist(), np.array(history[-1]["val_confusion"]).reshape(3, 3).tolist())
        for k in range(3):
            self.assertAlmostEqual(m[k, k] / m[k].sum(), history[-1]["val_recall"][k], places=6)
        self.assertAlmostEqual(np.trace(m) / m.sum(), history[-1]["val_accuracy"], places=6)
        per_class = tables["classes"]
        self.assertEqual([row[0] for row in per_class[1:]], classes)
        # The best epoch as the last checkpoint's state.json records it.
        with open(os.path.join(out, "checkpoints", "epoch-3-step-0", "state.json")) as f:
            best = json.load(f)["best_epoch"]
        self.assertEqual(dict((row[0], row[1]) for row in tables["run"])["best epoch"],
                         "%d (by val_balanced_accuracy)" % best)
        self.assertEqual([int(row[1]) for row in per_class[1:]], m.sum(axis=1).tolist())
        # The curves, inlined: the same PNG as curves.png.
        import base64
        png = [src for src in images if src.startswith("data:image/png;base64,")]
        self.assertEqual(len(png), 1)
        with open(os.path.join(out, "curves.png"), "rb") as f:
            self.assertEqual(base64.b64decode(png[0].split(",", 1)[1]), f.read())
        with open(os.path.join(out, "report.html"), encoding="utf-8") as f:
            page = f.read()
        self.assertNotIn("<script", page)
        self.assertNotIn("http://", page)
        self.assertNotIn("https://", page)

        a = screenshot(os.path.join(out, "report.html"), os.path.join(self.tmp, "report.png"), 1280, 2400)
        if a is None:
            self.skipTest("no Chromium runs here (scripts/install-deps.sh installs chromium-headless-shell)")
        # The inlined curves were decoded and drawn: their line colours are on the screenshot
        # (the page itself has no colour but greys).
        for rgb in ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)):
            near = (np.abs(a - np.array(rgb)).sum(axis=2) <= 12).sum()
            self.assertGreater(near, 100, "colour %s of curves.png is not on the rendered page" % (rgb,))
        # The tables as the browser built them: every cell filled.
        r = subprocess.run([chromium()] + CHROMIUM_FLAGS + ["--dump-dom", "file://" + os.path.join(out, "report.html")],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        dom = r.stdout
        self.assertIn('<table id="confusion">', dom)
        self.assertNotIn("<td></td>", dom.split('<table class="kv" id="options">')[0])
        print("report.html: %d bytes, rendered by %s" % (len(page), os.path.basename(chromium())))


class TestFullDisk(Base):
    """Issue 17 item 4: slide-train on a small tmpfs fills it in epoch 2. The run fails with exit 1 and
    one line naming the checkpoint it could not write and the file; the unfinished checkpoint is
    removed (its space given back), the complete one stays; with room again, --resume finishes
    with the uninterrupted run's weights, bit for bit."""

    def test_full_disk_keeps_the_last_checkpoint_and_resume_is_exact(self):
        # Width 32: a checkpoint (model and momentum, 760 KB) outweighs every other write of an
        # epoch (best.safetensors 380 KB, report.html, curves.png, metrics: under 40 KB each).
        def train(out, *extra):
            return subprocess.run([TRAIN, "--data", self.store, "--out", out, "--epochs", "4", "--batch-size", "32",
                                   "--lr", "0.05", "--width", "32", "--threads", "2", "--seed", "3"] + list(extra),
                                  capture_output=True, text=True)

        ref = os.path.join(self.tmp, "ref-disk")
        r = train(ref, "--keep", "4")
        self.assertEqual(r.returncode, 0, r.stderr)
        mnt = tempfile.mkdtemp(prefix="tmpfs_", dir=self.tmp)
        # After epoch 1 the run holds ~1210 KiB in 4-KiB pages; epoch 2 peaks at ~1590 KiB while
        # best.safetensors is replaced, then needs ~1980 KiB for its checkpoint.
        m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1750k", "tmpfs", mnt], capture_output=True, text=True)
        if m.returncode != 0:
            self.skipTest("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): " + m.stderr.strip())
        try:
            out = os.path.join(mnt, "run")
            r = train(out)
            print("slide-train on a 1750-KiB tmpfs: exit %d; %s" % (r.returncode, r.stderr.strip().splitlines()[-1]))
            self.assertEqual(r.returncode, 1, r.stderr)
            last = r.stderr.strip().splitlines()[-1]
            self.assertIn("RESOURCE_EXHAUSTED", last)
            self.assertIn("No space left on device", last)
            self.assertIn("checkpoint %s/checkpoints/epoch-2-step-0 not written" % out, last)
            self.assertIn("epoch-1-step-0, is kept", last)
            self.assertEqual(os.listdir(os.path.join(out, "checkpoints")), ["epoch-1-step-0"])
            kept = read_safetensors(os.path.join(out, "checkpoints", "epoch-1-step-0", "model.safetensors"))
            want = read_safetensors(os.path.join(ref, "checkpoints", "epoch-1-step-0", "model.safetensors"))
            self.assertTrue(all(np.array_equal(kept[k], want[k]) for k in want))
            self.assertEqual(subprocess.run(["mount", "-o", "remount,size=16m", mnt]).returncode, 0)
            r = train(out, "--resume")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("resumed", r.stderr)
            a = read_safetensors(os.path.join(ref, "checkpoints", "epoch-4-step-0", "model.safetensors"))
            b = read_safetensors(os.path.join(out, "checkpoints", "epoch-4-step-0", "model.safetensors"))
            self.assertTrue(all(np.array_equal(a[k], b[k]) for k in a))
            with open(os.path.join(ref, "metrics.jsonl")) as fa, open(os.path.join(out, "metrics.jsonl")) as fb:
                drop = lambda h: {k: v for k, v in h.items() if k not in ("seconds", "images_per_s", "all_reduce_s")}
                self.assertEqual([drop(json.loads(l)) for l in fa], [drop(json.loads(l)) for l in fb])
        finally:
            subprocess.run(["umount", mnt])


class TestPrecision(Base):
    """--precision tf32|bf16: the convolutions' and matrix products' operands rounded (backend.h
    MathPrecision), storage f32. On the reference backend the rounding is exact (bf16 here), so the
    run differs from fp32's but learns as well; the precision is recorded, a resume at another one
    is refused, a resume at the same one continues bit for bit; evaluate and slide-embed take it
    too (bags record it). fp16 trains with dynamic loss scaling: a scale too large is backed off,
    its steps skipped, and a resumed run continues with the checkpoint's scale exactly."""

    @classmethod
    def setUpClass(cls):
        # Its own store at 16 px: the reference backend's exact loops are the cost here (this class
        # took 53 s at 32 px, 20 s at 16 px here, 2026-11-30).
        super().setUpClass()
        cls.store = cls.lc25000_store("lc16", 16)

    def fp32_run(self):
        # The fp32 run both tests compare with, made once (2 epochs; the schedule is constant, so
        # its epoch-1 checkpoint is a 1-epoch run's).
        if "_fp32" not in type(self).__dict__:
            out = os.path.join(self.tmp, "p_fp32")
            r = self.run_ref(out, 2)
            self.assertEqual(r.returncode, 0, r.stderr)
            type(self)._fp32 = out
        return type(self)._fp32

    def run_ref(self, out, epochs, *extra):
        args = [TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--batch-size", "32", "--lr", "0.05",
                "--width", "8", "--threads", "2", "--seed", "3", "--backend", "reference", "--schedule", "constant"]
        return subprocess.run(args + list(extra), capture_output=True, text=True)

    def weights(self, out, epoch):
        return read_safetensors(os.path.join(out, "checkpoints", "epoch-%d-step-0" % epoch, "model.safetensors"))

    def assert_near_fp32(self, out, epoch):
        """The weights after `epoch` are not fp32's but near them: the relative L2 distance over
        every parameter, returned, is above 0 and below 5%."""
        a, b = self.weights(self.fp32_run(), epoch), self.weights(out, epoch)
        diff = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a)
        norm = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a)
        self.assertGreater(diff, 0.0)
        self.assertLess((diff / norm) ** 0.5, 0.05)
        return (diff / norm) ** 0.5

    def test_cpu_bf16_runs_on_bf16_instructions_where_the_cpu_has_them(self):
        """The cpu backend: on a CPU with bf16 instructions (/proc/cpuinfo's avx512_bf16 or
        amx_bf16) bf16 training and embedding round the products' operands (results near fp32's,
        not equal; a resume continues bit for bit), and the log says so; elsewhere bf16 is fp32,
        bit for bit, and the log says that."""
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
        has_bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})

        def run(out, epochs, *extra):
            return subprocess.run([TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--batch-size",
                                   "32", "--lr", "0.05", "--width", "16", "--threads", "2", "--seed", "3",
                                   "--schedule", "constant"] + list(extra), capture_output=True, text=True)

        outs = {}
        for p in ("fp32", "bf16"):
            outs[p] = os.path.join(self.tmp, "cpu_" + p)
            r = run(outs[p], 2, "--precision", p)
            self.assertEqual(r.returncode, 0, r.stderr)
            if p == "bf16":
                self.assertIn("bf16 instructions" if has_bf16 else "the products run in fp32 on this CPU", r.stderr)
        a, b = self.weights(outs["fp32"], 2), self.weights(outs["bf16"], 2)
        diff = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a)
        norm = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a)
        if has_bf16:
            self.assertGreater(diff, 0.0)
            self.assertLess((diff / norm) ** 0.5, 0.05)
        else:
            self.assertEqual(diff, 0.0)
        # A bf16 run resumed from its epoch-1 checkpoint ends on the same weights.
        part = os.path.join(self.tmp, "cpu_bf16_resumed")
        self.assertEqual(run(part, 1, "--precision", "bf16").returncode, 0)
        r = run(part, 2, "--precision", "bf16", "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        c = self.weights(part, 2)
        self.assertTrue(all(np.array_equal(b[k], c[k]) for k in b))
        # slide-embed on cpu: bf16 features near fp32's, equal without bf16 instructions.
        import h5py
        ck = os.path.join(outs["fp32"], "checkpoints", "epoch-2-step-0")
        feats = {}
        for p in ("fp32", "bf16"):
            bags = os.path.join(self.tmp, "cpu_bags_" + p)
            r = subprocess.run([EMBED, self.store, "-o", bags, "--weights", ck, "--precision", p, "-q"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            name = sorted(n for n in os.listdir(bags) if n.endswith(".h5"))[0]
            with h5py.File(os.path.join(bags, name), "r") as f:
                feats[p] = f["features"][:]
        rel = np.abs(feats["bf16"] - feats["fp32"]).max() / np.abs(feats["fp32"]).max()
        if has_bf16:
            self.assertGreater(rel, 0.0)
            self.assertLess(rel, 0.05)
        else:
            self.assertEqual(rel, 0.0)
        sys.stderr.write("cpu bf16 (bf16 instructions: %s) against fp32: weights after 2 epochs %.2e relative L2, "
                         "embedded features %.2e of the largest\n" % (has_bf16, (diff / norm) ** 0.5, rel))

    def test_half_precision_activations_train_near_fp32_resume_exactly_and_evaluate_on_the_cpu(self):
        """--activations bf16 / f16 (what --backend cuda picks under --precision bf16 / fp16): the
        model's activations and their gradients in half precision between casts at its two ends,
        parameters, gradients and optimizer state f32 (layers.h enable_half_activations). On the
        reference backend, which emulates the half-precision ops exactly (the oracle of the cuda
        path), training lands near fp32's weights; a resume continues bit for bit; the checkpoint has
        fp32's tensor names, so the cpu backend evaluates it; cpu and f16 without fp16's loss scaling
        are refused. --channels-last on gives the same run bit for bit."""
        bf16 = os.path.join(self.tmp, "act_bf16")
        r = self.run_ref(bf16, 2, "--precision", "bf16", "--activations", "bf16")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("half-precision activations for training", r.stderr)
        self.assertIn("activations=bf16", r.stderr)
        distance = self.assert_near_fp32(bf16, 2)
        # The same precision without half storage is another run (the storage rounds too).
        plain = os.path.join(self.tmp, "act_bf16_plain")
        self.assertEqual(self.run_ref(plain, 1, "--precision", "bf16").returncode, 0)
        a, b = self.weights(plain, 1), self.weights(bf16, 1)
        self.assertEqual(sorted(a), sorted(b))  # the same tensors, by name
        self.assertFalse(all(np.array_equal(a[k], b[k]) for k in a))
        # fp16 with f16 activations: GradScaler's rules keep the loss finite and the weights near.
        f16 = os.path.join(self.tmp, "act_f16")
        r = self.run_ref(f16, 1, "--precision", "fp16", "--activations", "f16")
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(f16, "metrics.jsonl")) as f:
            h = [json.loads(l) for l in f]
        self.assertTrue(np.isfinite(h[-1]["train_loss"]))
        self.assert_near_fp32(f16, 1)
        # A resume continues exactly.
        part = os.path.join(self.tmp, "act_bf16_resumed")
        self.assertEqual(self.run_ref(part, 1, "--precision", "bf16", "--activations", "bf16").returncode, 0)
        r = self.run_ref(part, 2, "--precision", "bf16", "--activations", "bf16", "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        c, w2 = self.weights(part, 2), self.weights(bf16, 2)
        self.assertTrue(all(np.array_equal(w2[k], c[k]) for k in w2))
        # Channels last (--channels-last on; auto picks it on cuda): the reference stores the
        # activations [N][H][W][C] and computes each op on plain copies, so the run is the plain
        # one's bit for bit: what this checks is the model code that cuda runs channels last.
        last = os.path.join(self.tmp, "act_bf16_nhwc")
        r = self.run_ref(last, 1, "--precision", "bf16", "--activations", "bf16", "--channels-last", "on")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("channels last", r.stderr)
        w1, l1 = self.weights(bf16, 1), self.weights(last, 1)
        self.assertEqual(sorted(w1), sorted(l1))
        self.assertTrue(all(np.array_equal(w1[k], l1[k]) for k in w1))
        # ... and at f32 (--channels-last on with f32 activations, as cuda's tf32 would run it).
        last32 = os.path.join(self.tmp, "act_f32_nhwc")
        r = self.run_ref(last32, 1, "--channels-last", "on")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("channels-last activations for training", r.stderr)
        w1, l1 = self.weights(self.fp32_run(), 1), self.weights(last32, 1)
        self.assertTrue(all(np.array_equal(w1[k], l1[k]) for k in w1))
        # The cpu backend evaluates the checkpoint.
        ev = os.path.join(self.tmp, "act_eval")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(bf16, "checkpoints", "epoch-2-step-0"),
                            "--data", self.store, "--out", ev], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(os.path.join(ev, "predictions.csv")))
        # Refused, exit 2, naming the option.
        for extra, why in ((["--backend", "cpu", "--activations", "bf16"], "the cpu backend keeps f32 activations"),
                           (["--backend", "reference", "--activations", "f16"],
                            "--activations f16 needs --precision fp16"),
                           (["--backend", "cpu", "--channels-last", "on"],
                            "--channels-last on: the cpu backend keeps oneDNN's blocked layouts")):
            out = os.path.join(self.tmp, "act_refused")
            r = subprocess.run([TRAIN, "--data", self.store, "--out", out, "--epochs", "1", "--batch-size", "32",
                                "--width", "8", "--threads", "2"] + extra,
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(why, r.stderr)
        sys.stderr.write("reference, bf16 activations: weights after 2 epochs %.2e relative L2 from fp32's\n" % distance)

    def test_bf16_training_resume_evaluate_and_embed(self):
        fp32, bf16 = self.fp32_run(), os.path.join(self.tmp, "p_bf16")
        r = self.run_ref(bf16, 2, "--precision", "bf16")
        self.assertEqual(r.returncode, 0, r.stderr)
        distance = self.assert_near_fp32(bf16, 2)
        b = self.weights(bf16, 2)
        with open(os.path.join(fp32, "metrics.jsonl")) as f, open(os.path.join(bf16, "metrics.jsonl")) as g:
            h32, h16 = [json.loads(l) for l in f], [json.loads(l) for l in g]
        self.assertLess(abs(h16[-1]["train_loss"] - h32[-1]["train_loss"]), 0.05)
        with open(os.path.join(bf16, "checkpoints", "epoch-2-step-0", "state.json")) as f:
            self.assertEqual(json.load(f)["config"]["precision"], "bf16")
        with open(os.path.join(fp32, "checkpoints", "epoch-2-step-0", "state.json")) as f:
            self.assertNotIn("precision", json.load(f)["config"])  # fp32 runs keep their config as before
        # A resume at the same precision continues exactly; at another one it is refused.
        part = os.path.join(self.tmp, "p_bf16_resumed")
        r = self.run_ref(part, 1, "--precision", "bf16")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.run_ref(part, 2, "--resume")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--precision \"bf16\" -> (unset)", r.stderr)
        r = self.run_ref(part, 2, "--resume", "--precision", "bf16")
        self.assertEqual(r.returncode, 0, r.stderr)
        c = self.weights(part, 2)
        self.assertTrue(all(np.array_equal(b[k], c[k]) for k in b))
        # evaluate at bf16: the run's predictions, near fp32 evaluate's probabilities, not equal.
        ck = os.path.join(bf16, "checkpoints", "epoch-2-step-0")
        probs = {}
        for p in ("fp32", "bf16"):
            ev = os.path.join(self.tmp, "p_eval_" + p)
            r = subprocess.run([TRAIN, "evaluate", "--checkpoint", ck, "--data", self.store, "--out", ev,
                                "--backend", "reference", "--precision", p], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(ev, "predictions.csv")) as f:
                rows = f.read().splitlines()
            head = rows[0].split(",")
            cols = [i for i, n in enumerate(head) if n.startswith("p_")]
            probs[p] = np.array([[float(row.split(",")[i]) for i in cols] for row in rows[1:]])
        self.assertEqual(probs["fp32"].shape, (360, 3))
        gap = np.abs(probs["fp32"] - probs["bf16"]).max()
        self.assertGreater(gap, 0.0)
        self.assertLess(gap, 0.05)
        # slide-embed at bf16: the bag records it; a rerun at fp32 does not take that bag as its own.
        bags = os.path.join(self.tmp, "p_bags")
        embed = [EMBED, self.store, "-o", bags, "--weights", ck, "--backend", "reference", "-q"]
        r = subprocess.run(embed + ["--precision", "bf16"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        import h5py
        names = sorted(n for n in os.listdir(bags) if n.endswith(".h5"))
        self.assertTrue(names)
        with h5py.File(os.path.join(bags, names[0]), "r") as f:
            self.assertEqual(f.attrs["precision"], "bf16")
            features = f["features"][:]
        r = subprocess.run(embed, capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("precision bf16", r.stderr)
        self.assertIn("this run:", r.stderr)
        fp32_bags = os.path.join(self.tmp, "p_bags_fp32")
        r = subprocess.run([EMBED, self.store, "-o", fp32_bags, "--weights", ck, "--backend", "reference", "-q"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with h5py.File(os.path.join(fp32_bags, names[0]), "r") as f:
            self.assertNotIn("precision", f.attrs)
            ref = f["features"][:]
        rel = np.abs(features - ref).max() / np.abs(ref).max()
        self.assertGreater(rel, 0.0)
        self.assertLess(rel, 0.05)
        sys.stderr.write("bf16 against fp32: weights after 2 epochs %.2e relative L2, final train loss %.4f vs %.4f, "
                         "evaluate probabilities %.2e max abs, embedded features %.2e of the largest\n"
                         % (distance, h16[-1]["train_loss"], h32[-1]["train_loss"], gap, rel))

    def test_fp16_with_dynamic_loss_scaling(self):
        def history(out):
            with open(os.path.join(out, "metrics.jsonl")) as f:
                return [json.loads(l) for l in f]
        # GradScaler's initial scale (2^16): no step overflows on this model; it learns as fp32 does.
        fp32, fp16 = self.fp32_run(), os.path.join(self.tmp, "h_fp16")
        r = self.run_ref(fp16, 1, "--precision", "fp16")
        self.assertEqual(r.returncode, 0, r.stderr)
        distance = self.assert_near_fp32(fp16, 1)
        h = history(fp16)
        self.assertEqual([(e["loss_scale"], e["skipped_steps"]) for e in h], [(65536.0, 0)])
        self.assertNotIn("loss_scale", history(fp32)[0])
        # A scale of 2^30 overflows f16 in backward (the loss gradient alone is 2^30 / 32 > 65504):
        # steps are skipped and the scale halved until it fits; the run still learns.
        big = os.path.join(self.tmp, "h_fp16_big")
        r = self.run_ref(big, 2, "--precision", "fp16", "--loss-scale", str(2 ** 30))
        self.assertEqual(r.returncode, 0, r.stderr)
        h = history(big)
        self.assertGreater(h[0]["skipped_steps"], 0)
        scale = h[-1]["loss_scale"]
        self.assertLess(scale, 2 ** 30)
        self.assertEqual(scale, 2.0 ** round(np.log2(scale)))  # halved, so a power of two
        self.assertEqual(2 ** 30 / scale, 2 ** sum(e["skipped_steps"] for e in h))  # one halving per skip
        self.assertLess(h[-1]["train_loss"], h[0]["train_loss"])
        with open(os.path.join(big, "checkpoints", "epoch-2-step-0", "state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["loss_scaler"]["scale"], scale)
        self.assertEqual(state["config"]["precision"], "fp16")
        # Resumed after epoch 1, the run continues with the checkpoint's scale: the same weights.
        part = os.path.join(self.tmp, "h_fp16_big_resumed")
        r = self.run_ref(part, 1, "--precision", "fp16", "--loss-scale", str(2 ** 30))
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.run_ref(part, 2, "--precision", "fp16", "--loss-scale", str(2 ** 30), "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        c, d = self.weights(big, 2), self.weights(part, 2)
        self.assertTrue(all(np.array_equal(c[k], d[k]) for k in c))
        self.assertEqual(history(part), [dict(e, seconds=e2["seconds"], images_per_s=e2["images_per_s"])
                                         for e, e2 in zip(history(big), history(part))])
        # A damaged scaler record is refused on --resume, naming the field.
        state_file = os.path.join(part, "checkpoints", "epoch-2-step-0", "state.json")
        with open(state_file) as f:
            record = json.load(f)
        record["loss_scaler"]["scale"] = -1
        with open(state_file, "w") as f:
            json.dump(record, f)
        r = self.run_ref(part, 3, "--precision", "fp16", "--loss-scale", str(2 ** 30), "--resume")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn(state_file + ": field 'loss_scaler.scale'", r.stderr)
        sys.stderr.write("fp16 against fp32: weights after 1 epoch %.2e relative L2; from a 2^30 scale: %d steps "
                         "skipped, scale %g\n" % (distance, sum(e["skipped_steps"] for e in h), scale))

    def test_unknown_precisions_and_bad_loss_scales_are_usage_errors_that_write_nothing(self):
        for extra, what in ((("--precision", "fp64"), "expected fp32, tf32, bf16 or fp16"),
                            (("--precision", "fp16", "--loss-scale", "0"), "--loss-scale"),
                            (("--precision", "bf16", "--loss-scale", "1024"), "--loss-scale applies to --precision fp16")):
            out = os.path.join(self.tmp, "p_bad_" + "_".join(extra))
            r = self.run_ref(out, 1, *extra)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(what, r.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "checkpoints")))


class TestDevice(Base):
    """The device paths of slide-train without a GPU: --backend reference-sim keeps every tensor on
    the simulated device, which host code may not read (the process would abort), so model, batches,
    optimizer state, checkpoints and evaluation go through upload and download. Bit for bit the
    host run's; checkpoints move between the device and the host both ways."""

    @classmethod
    def setUpClass(cls):
        # Its own store at 16 px, as TestPrecision's: the reference backend's exact loops are the
        # cost here (this class took 44 s on the 48-px store here, 2026-11-30).
        super().setUpClass()
        cls.store = cls.lc25000_store("lc16", 16)

    def run3(self, out, backend, epochs, *extra):
        args = [TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--batch-size", "32", "--lr", "0.05",
                "--width", "8", "--threads", "2", "--seed", "3", "--backend", backend, "--schedule", "constant",
                "--dropout", "0.2", "--class-weights", "balanced", "--accumulate", "2"] + list(extra)
        return subprocess.run(args, capture_output=True, text=True)

    def weights(self, out, epoch, name="model"):
        return read_safetensors(os.path.join(out, "checkpoints", "epoch-%d-step-0" % epoch, name + ".safetensors"))

    def assert_same(self, a, b, what):
        self.assertEqual(sorted(a), sorted(b))
        for k in a:
            self.assertTrue(np.array_equal(a[k], b[k]), "%s: %s differs" % (what, k))

    def reference_run(self, backend):
        # The 3-epoch runs on the host (reference) and on the simulated device (reference-sim),
        # made once and shared by the tests: the schedule is constant, so a run's epoch-k
        # checkpoint is a k-epoch run's.
        runs = type(self).__dict__.get("_runs")
        if runs is None:
            runs = {}
            type(self)._runs = runs
        if backend not in runs:
            out = os.path.join(self.tmp, "dev_" + backend)
            r = self.run3(out, backend, 3)
            self.assertEqual(r.returncode, 0, r.stderr)
            runs[backend] = (out, r.stderr)
        return runs[backend]

    def test_offloaded_activations_give_the_host_run_with_a_lower_device_peak(self):
        # The small CNN's 14 layers in segments of 3: each segment's saved activations go to host
        # memory after its forward and come back before its backward (issue 13).
        host, _ = self.reference_run("reference")
        _, plain_log = self.reference_run("reference-sim")
        peak_plain = int(re.search(r"peak tensor memory: (\d+) bytes \(sim\)", plain_log).group(1))
        off = os.path.join(self.tmp, "off_offload")
        r = self.run3(off, "reference-sim", 1, "--offload-activations", "3")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("activation offload mode=3 segments=5", r.stderr)
        peak_off = int(re.search(r"peak tensor memory: (\d+) bytes \(sim\)", r.stderr).group(1))
        self.assertLess(peak_off, peak_plain)
        for name in ("model", "optimizer"):
            self.assert_same(self.weights(host, 1, name), self.weights(off, 1, name), name)
        # Both: layers checkpointed in pairs, the pairs' kept inputs offloaded in groups of 3 top-level
        # places; the same weights again, and the choice recorded for --resume.
        both = os.path.join(self.tmp, "off_both")
        r = self.run3(both, "reference-sim", 1, "--checkpoint-activations", "2", "--offload-activations", "3")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("activation checkpointing and offload mode=2+3 segments=13", r.stderr)
        for name in ("model", "optimizer"):
            self.assert_same(self.weights(host, 1, name), self.weights(both, 1, name), name)
        with open(os.path.join(both, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            memory = json.load(f)["memory"]
        self.assertEqual((memory["strategy"], memory["segments"]), ("checkpoint+offload", "2+3"))
        # On a host backend there is nothing to offload to: a usage error, nothing written.
        bad = os.path.join(self.tmp, "off_cpu")
        r = self.run3(bad, "cpu", 1, "--offload-activations", "stage")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("they are in host memory already", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(bad, "checkpoints")))

    def test_device_run_equals_host_run_and_checkpoints_cross_devices(self):
        host, _ = self.reference_run("reference")
        sim, sim_log = self.reference_run("reference-sim")
        self.assertIn("(sim)", sim_log)  # the peak reported is the device's
        for name in ("model", "optimizer"):
            self.assert_same(self.weights(host, 3, name), self.weights(sim, 3, name), name)
        self.assert_same(read_safetensors(os.path.join(host, "best.safetensors")),
                         read_safetensors(os.path.join(sim, "best.safetensors")), "best")
        with open(os.path.join(host, "metrics.jsonl")) as f, open(os.path.join(sim, "metrics.jsonl")) as g:
            drop = ("seconds", "images_per_s")
            self.assertEqual([{k: v for k, v in json.loads(l).items() if k not in drop} for l in f],
                             [{k: v for k, v in json.loads(l).items() if k not in drop} for l in g])
        # A device checkpoint resumes on the host, and a host one on the device: the same weights.
        for first, then, tag in (("reference-sim", "reference", "sim_to_host"), ("reference", "reference-sim", "host_to_sim")):
            out = os.path.join(self.tmp, "dev_" + tag)
            r = self.run3(out, first, 1)
            self.assertEqual(r.returncode, 0, r.stderr)
            r = self.run3(out, then, 2, "--resume")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assert_same(self.weights(host, 2), self.weights(out, 2), tag)
        # evaluate on the device: the host engine's predictions exactly.
        ck = os.path.join(sim, "checkpoints", "epoch-3-step-0")
        outs = {}
        for backend in ("reference", "reference-sim"):
            ev = os.path.join(self.tmp, "dev_eval_" + backend)
            r = subprocess.run([TRAIN, "evaluate", "--checkpoint", ck, "--data", self.store, "--out", ev,
                                "--backend", backend, "--no-fused"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(ev, "predictions.csv")) as f:
                outs[backend] = f.read()
        self.assertEqual(outs["reference"], outs["reference-sim"])
        self.assertEqual(len(outs["reference"].splitlines()), 361)

    def test_cache_device_equals_the_host_run(self):
        # --cache device: the decoded dataset on the (simulated) device, batches gathered, cropped,
        # jittered, flipped and normalised there from the host's draws: the host run's weights.
        extra = ("--color-jitter", "0.2,0.2,0.2,0.05", "--random-resized-crop", "0.5")
        host, sim = os.path.join(self.tmp, "cache_host"), os.path.join(self.tmp, "cache_sim")
        r = self.run3(host, "reference", 2, "--cache", "ram", *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.run3(sim, "reference-sim", 2, "--cache", "device", *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("dataset cached on the device", r.stderr)
        for name in ("model", "optimizer"):
            self.assert_same(self.weights(host, 2, name), self.weights(sim, 2, name), name)
        # On a host backend the RAM cache is the device cache.
        r = self.run3(os.path.join(self.tmp, "cache_host_dev"), "reference", 1, "--cache", "device")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("the RAM cache is its device cache", r.stderr)

    def test_cuda_without_a_gpu_is_a_usage_error_that_writes_nothing(self):
        out = os.path.join(self.tmp, "dev_cuda")
        r = self.train(out, "--backend", "cuda")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("cuda", r.stderr)
        self.assertFalse(os.path.exists(out))


class TestEvaluateRemap(Base):
    def test_stores_with_a_subset_of_the_classes_in_another_order(self):
        out = os.path.join(self.tmp, "run")
        r = self.train(out)
        self.assertEqual(r.returncode, 0, r.stderr)
        ckpt = os.path.join(out, "checkpoints", "epoch-6-step-0")
        # A store of two of the three classes: its own class list is [lung_n, lung_scc].
        sub = os.path.join(self.tmp, "sub")
        for c in ("lung_scc", "lung_n"):
            shutil.copytree(os.path.join(LC, c), os.path.join(sub, c))
        store = os.path.join(self.tmp, "substore")
        self.assertEqual(subprocess.run([TILE, "--patches", sub, "--tile-size", "48", "-o", store, "-q"]).returncode, 0)
        ev = os.path.join(self.tmp, "ev")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", ckpt, "--data", store, "--out", ev],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f]
        self.assertEqual(rows[0][4:8], ["p_lung_aca", "p_lung_n", "p_lung_scc", "predicted"])
        self.assertEqual(len(rows), 241)
        # Each row's label is its folder's: the labels were matched by name, not by index.
        # (A patch's slide id is "<class folder>/<file stem>".)
        self.assertTrue(all(row[0].split(":")[-1].split("/")[0] == row[3] for row in rows[1:]))
        self.assertEqual({row[3] for row in rows[1:]}, {"lung_n", "lung_scc"})
        with open(os.path.join(ev, "metrics.json")) as f:
            metrics = json.load(f)
        self.assertIsNone(metrics["recall"][0])  # no lung_aca tile: undefined, null
        self.assertGreater(metrics["accuracy"], 0.5)
        # A class the checkpoint does not know is named.
        os.rename(os.path.join(sub, "lung_n"), os.path.join(sub, "stroma"))
        store2 = os.path.join(self.tmp, "substore2")
        self.assertEqual(subprocess.run([TILE, "--patches", sub, "--tile-size", "48", "-o", store2, "-q"]).returncode, 0)
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", ckpt, "--data", store2, "--out", ev + "2"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("class 'stroma' of the stores is not one of the model's 3 classes", r.stderr)


class TestPredict(Base):
    """slide-train predict on a real slide tiled without labels: per-tile probabilities, per-slide HDF5
    and heatmaps; the same probabilities as evaluate's; metrics when labels are given."""

    def test_predict_on_an_unlabelled_slide_equals_evaluate(self):
        import h5py
        from PIL import Image
        out = os.path.join(self.tmp, "run")
        r = self.train(out, epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        cmu = os.path.join(self.tmp, "cmu")
        r = subprocess.run([TILE, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "2",
                            "--tile-size", "48", "-o", cmu, "-q"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        classes = ["lung_aca", "lung_n", "lung_scc"]

        def csv_rows(path):
            with open(path) as f:
                return [l.rstrip("\n").split(",") for l in f]

        # evaluate needs labels: the unlabelled store is refused, naming the slide.
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "best.safetensors"), "--data", cmu,
                            "--out", os.path.join(self.tmp, "ev-nolabel")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("'CMU-1-Small-Region' has no label", r.stderr)
        # predict needs none. The checkpoint as a run's best.safetensors.
        pred = os.path.join(self.tmp, "pred")
        r = subprocess.run([TRAIN, "predict", "--checkpoint", os.path.join(out, "best.safetensors"), "--data", cmu,
                            "--out", pred], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(pred, "metrics.json")))  # no labels, no metrics
        rows = csv_rows(os.path.join(pred, "predictions.csv"))
        self.assertEqual(rows[0], ["slide_id", "x_l0", "y_l0", "label", "p_lung_aca", "p_lung_n", "p_lung_scc",
                                   "predicted"])
        info = subprocess.run([TILE, "info", cmu], capture_output=True, text=True).stdout
        n = len(rows) - 1
        self.assertIn(str(n), info)
        self.assertGreater(n, 20)
        probs = np.array([[float(v) for v in row[4:7]] for row in rows[1:]])
        self.assertTrue(np.allclose(probs.sum(axis=1), 1.0, atol=1e-4))
        self.assertTrue(all(row[3] == "" for row in rows[1:]))
        self.assertTrue(all(row[7] == classes[int(np.argmax(p))] for p, row in zip(probs, rows[1:])))
        # The per-slide file: the same probabilities (full float precision) and coordinates.
        with h5py.File(os.path.join(pred, "predictions", "CMU-1-Small-Region.h5"), "r") as f:
            self.assertEqual(f["probs"].shape, (n, 3))
            self.assertEqual(f["probs"].dtype, np.float32)
            self.assertLess(np.abs(f["probs"][:] - probs).max(), 1e-6)
            self.assertTrue(np.array_equal(f["coords"][:], np.array([[int(r[1]), int(r[2])] for r in rows[1:]])))
            self.assertEqual(int(f["coords"].attrs["patch_size"]), 48)
            l0 = int(f["coords"].attrs["patch_size_level0"])
            self.assertAlmostEqual(l0, 48 * 2 / 0.499, delta=2)  # CMU-1's level 0 is 0.499 um/px
            self.assertEqual(json.loads(f.attrs["classes"]), classes)
            self.assertEqual(f.attrs["slide_id"], "CMU-1-Small-Region")
            self.assertEqual(f.attrs["label"], "")
            mean = f.attrs["mean_probabilities"]
            self.assertLess(np.abs(mean - probs.mean(axis=0)).max(), 1e-5)
            self.assertEqual(f.attrs["predicted_by_mean"], classes[int(np.argmax(mean))])
        slides = csv_rows(os.path.join(pred, "slides.csv"))
        self.assertEqual(slides[0][-2:], ["predictions_file", "heatmaps"])
        self.assertEqual(slides[1][-2], "predictions/CMU-1-Small-Region.h5")
        maps = slides[1][-1].split(";")
        self.assertEqual(maps, ["heatmaps/CMU-1-Small-Region.%s.png" % c for c in classes])
        # Each heatmap: the slide's thumbnail (aspect ratio kept, 1024 px on the longer side) with the
        # title band and colour bar; the tiles tinted by the class's probability on an absolute scale.
        import openslide
        with openslide.OpenSlide(os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")) as sl:
            w0, h0 = sl.dimensions
        checked = 0
        for c, m in enumerate(maps):
            with Image.open(os.path.join(pred, m)) as im:
                a = np.asarray(im.convert("RGB")).astype(int)
            th, tw = a.shape[0] - 28, a.shape[1] - 110
            self.assertAlmostEqual(max(th, tw), 1024, delta=4)
            self.assertAlmostEqual(w0 / tw, h0 / th, delta=0.02 * w0 / tw)
            ds = w0 / tw
            # The centre of the most and least probable tiles: the red and blue ends of jet, blended
            # half and half with the slide.
            hi, lo = int(np.argmax(probs[:, c])), int(np.argmin(probs[:, c]))
            def centre(i):
                x = int((int(rows[i + 1][1]) + l0 / 2) / ds)
                y = int((int(rows[i + 1][2]) + l0 / 2) / ds) + 28
                return a[y - 2:y + 3, x - 2:x + 3].reshape(-1, 3).mean(axis=0)
            if probs[hi, c] > 0.9:
                r_, g_, b_ = centre(hi)
                self.assertGreater(r_, b_ + 40, (m, hi))
            if probs[lo, c] < 0.1:
                r_, g_, b_ = centre(lo)
                self.assertGreater(b_, r_ + 20, (m, lo))
            checked += (probs[hi, c] > 0.9) + (probs[lo, c] < 0.1)

        self.assertGreaterEqual(checked, 2)  # at least one confident tile each way was looked at
        # The same probabilities as evaluate's, given the slide's label (same batches, same ops).
        labels = os.path.join(self.tmp, "cmu-labels.csv")
        with open(labels, "w") as f:
            f.write("slide_id,label\nCMU-1-Small-Region,lung_n\n")
        ev = os.path.join(self.tmp, "ev-cmu")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "best.safetensors"), "--data", cmu,
                            "--labels", labels, "--out", ev], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        ev_rows = csv_rows(os.path.join(ev, "predictions.csv"))
        self.assertEqual([r_[:3] + r_[4:] for r_ in ev_rows], [r_[:3] + r_[4:] for r_ in rows])
        self.assertTrue(all(r_[3] == "lung_n" for r_ in ev_rows[1:]))
        # predict with labels: metrics too, equal to evaluate's.
        pred2 = os.path.join(self.tmp, "pred-labelled")
        r = subprocess.run([TRAIN, "predict", "--checkpoint", os.path.join(out, "best.safetensors"), "--data", cmu,
                            "--labels", labels, "--out", pred2, "--no-heatmaps"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "metrics.json")) as f1, open(os.path.join(pred2, "metrics.json")) as f2:
            m1, m2 = json.load(f1), json.load(f2)
        for key in ("tiles", "loss", "accuracy", "balanced_accuracy", "recall", "roc_auc"):
            self.assertEqual(m1[key], m2[key], key)
        self.assertFalse(os.path.exists(os.path.join(pred2, "heatmaps")))
        self.assertTrue(os.path.exists(os.path.join(pred2, "predictions", "CMU-1-Small-Region.h5")))

    def test_checkpoint_forms_patch_heatmaps_and_output_safety(self):
        from PIL import Image
        out = os.path.join(self.tmp, "run2")
        r = self.train(out, epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        ckpt = os.path.join(out, "checkpoints", "epoch-1-step-0")
        # A directory and its model.safetensors give the same predictions; a labelled store adds metrics.
        outs = []
        for i, form in enumerate((ckpt, os.path.join(ckpt, "model.safetensors"))):
            p = os.path.join(self.tmp, "p%d" % i)
            r = subprocess.run([TRAIN, "predict", "--checkpoint", form, "--data", self.store, "--out", p,
                                "--threads", "2"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(p, "predictions.csv")) as f:
                outs.append(f.read())
        self.assertEqual(outs[0], outs[1])
        p = os.path.join(self.tmp, "p0")
        with open(os.path.join(p, "metrics.json")) as f:
            self.assertGreater(json.load(f)["tiles"], 0)
        # Patch images are not slides: each heatmap is one grid cell beside its colour bar.
        maps = sorted(os.listdir(os.path.join(p, "heatmaps")))
        self.assertEqual(len(maps), 360 * 3)
        with Image.open(os.path.join(p, "heatmaps", maps[0])) as im:
            self.assertEqual(im.size[1], 28 + 200)
        # A weights file with no model description beside it is refused, naming what to give.
        lone = os.path.join(self.tmp, "lone")
        os.makedirs(lone)
        shutil.copy(os.path.join(ckpt, "model.safetensors"), lone)
        r = subprocess.run([TRAIN, "predict", "--checkpoint", os.path.join(lone, "model.safetensors"), "--data",
                            self.store, "--out", os.path.join(self.tmp, "p-lone")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("needs its model's description", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "p-lone")))
        # An earlier prediction is not replaced without --overwrite; with it, stale files go.
        r = subprocess.run([TRAIN, "predict", "--checkpoint", ckpt, "--data", self.store, "--out", p],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("holds an earlier evaluation", r.stderr)
        stale = os.path.join(p, "predictions", "gone.h5")
        open(stale, "w").close()
        self.assertTrue(os.path.exists(os.path.join(p, "metrics.json")))
        # Replaced by an unlabelled prediction (CMU-1 tiled without labels): the labelled run's
        # metrics and report go too.
        cmu = os.path.join(self.tmp, "cmu-unlabelled")
        r = subprocess.run([TILE, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "2",
                            "--tile-size", "48", "-o", cmu, "-q"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = subprocess.run([TRAIN, "predict", "--checkpoint", ckpt, "--data", cmu, "--out", p, "--overwrite",
                            "--no-heatmaps"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(stale))
        self.assertFalse(os.path.exists(os.path.join(p, "heatmaps")))
        self.assertFalse(os.path.exists(os.path.join(p, "metrics.json")))
        self.assertFalse(os.path.exists(os.path.join(p, "report.html")))
        with open(os.path.join(p, "slides.csv")) as f:
            self.assertEqual(len(f.read().splitlines()), 2)  # the header and CMU-1
        # Slide ids whose file stems meet: "cmu@1" in the first store, "cmu" in the second (whose
        # stem gains "@1"). Each slide keeps its own per-slide file; none replaces the other.
        stores = []
        for sid in ("cmu@1", "cmu"):
            manifest = os.path.join(self.tmp, "meet-%d.csv" % len(stores))
            with open(manifest, "w") as f:
                f.write("slide_id,path\n%s,%s\n" % (sid, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")))
            stores.append(os.path.join(self.tmp, "meet-store-%d" % len(stores)))
            r = subprocess.run([TILE, "--manifest", manifest, "--mpp", "4", "--tile-size", "48", "-o", stores[-1], "-q"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
        pm = os.path.join(self.tmp, "p-meet")
        r = subprocess.run([TRAIN, "predict", "--checkpoint", ckpt, "--data", *stores, "--out", pm, "--no-heatmaps"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(pm, "predictions"))), ["cmu@1#1.h5", "cmu@1.h5"])
        import csv as csv_module
        with open(os.path.join(pm, "slides.csv")) as f:
            files = {row["slide_id"]: row["predictions_file"] for row in csv_module.DictReader(f)}
        self.assertEqual(files, {"0:cmu@1": "predictions/cmu@1.h5", "1:cmu": "predictions/cmu@1#1.h5"})


class TestFineTune(Base):
    """--init from torchvision-named weights (made by torchvision here), the classifier replaced for
    another class count, --freeze and --lr-backbone."""

    def test_init_starts_from_exactly_those_weights(self):
        import torch
        import torchvision
        from PIL import Image
        torch.set_num_threads(2)
        torch.manual_seed(0)
        classes = ["lung_aca", "lung_n", "lung_scc"]
        m = torchvision.models.resnet18(num_classes=3)
        state = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}  # num_batches_tracked too
        init = os.path.join(self.tmp, "init3.safetensors")
        write_safetensors(init, state)
        # One step over all 360 tiles (batch 360, no augmentation) at learning rate 0: the epoch's
        # training loss is the loss of the initial weights on the stored tiles, in training mode.
        out = os.path.join(self.tmp, "ft0")
        r = self.train(out, "--model", "resnet18", "--init", init, "--val-fraction", "0", "--no-augment", epochs=1,
                       batch=360, lr=0)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("initial weights", r.stderr)
        self.assertNotIn("classifier replaced", r.stderr)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            ours = json.loads(f.readline())["train_loss"]
        tiles = os.path.join(self.tmp, "tiles")
        r = subprocess.run([TILE, "export", self.store, "-o", tiles, "--index", "0-359"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        files = sorted(os.listdir(tiles))
        self.assertEqual(len(files), 360)
        mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
        x = np.stack([(np.asarray(Image.open(os.path.join(tiles, f)).convert("RGB"), dtype=np.float32) / 255 - mean) / std
                      for f in files]).transpose(0, 3, 1, 2)
        y = [next(i for i, c in enumerate(classes) if f.startswith(c + "_")) for f in files]
        m.train()
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(m(torch.from_numpy(np.ascontiguousarray(x))), torch.tensor(y)).item()
        print("first-step loss over 360 tiles: ours %.7f, PyTorch %.7f" % (ours, want), file=sys.stderr)
        self.assertAlmostEqual(ours, want, delta=1e-4 * max(1.0, abs(want)))
        # Every weight is the file's, bit for bit (lr 0 moves nothing).
        got = read_safetensors(os.path.join(out, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        for k, v in state.items():
            if k.endswith("weight") or k.endswith("bias"):
                self.assertTrue(np.array_equal(got[k], v), k)

        # ImageNet-shaped weights (1000 classes): the classifier is replaced and trained from scratch;
        # --freeze layer3 keeps conv1..layer3 bit for bit; --lr-backbone moves layer4 more slowly.
        m1000 = torchvision.models.resnet18(num_classes=1000)
        s1000 = {k: v.detach().numpy().copy() for k, v in m1000.state_dict().items()}
        init1000 = os.path.join(self.tmp, "init1000.safetensors")
        write_safetensors(init1000, s1000)
        out = os.path.join(self.tmp, "ft1")
        r = self.train(out, "--model", "resnet18", "--init", init1000, "--freeze", "layer3", "--lr-backbone", "0.005",
                       "--val-fraction", "0", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("classifier replaced", r.stderr)
        got = read_safetensors(os.path.join(out, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        self.assertEqual(got["fc.weight"].shape, (3, 512))
        for k, v in s1000.items():
            if not (k.endswith("weight") or k.endswith("bias")) or k.startswith("fc."):
                continue
            same = np.array_equal(got[k], v)
            self.assertEqual(same, not k.startswith("layer4."), k)
        with open(os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            config = json.load(f)["config"]
        self.assertEqual((config["init"], config["freeze"], config["lr_backbone"]), (init1000, "layer3", 0.005))
        # No optimizer state for the frozen layers.
        opt = read_safetensors(os.path.join(out, "checkpoints", "epoch-1-step-0", "optimizer.safetensors"))
        self.assertFalse(any(k.startswith(("conv1.", "layer1.", "layer3.")) for k in opt))
        self.assertTrue(any(k.startswith("layer4.") for k in opt))
        # Resuming it without --freeze and --lr-backbone would change its math: refused, naming both;
        # --init may be left out (the checkpoint's weights replace it).
        r = self.train(out, "--model", "resnet18", "--val-fraction", "0", "--resume", epochs=2)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn(' --freeze "layer3" -> (unset);', r.stderr)
        self.assertIn(" --lr_backbone 0.005 -> (unset);", r.stderr)
        self.assertNotIn("--init", r.stderr)

        # Bad input: another architecture, an unknown layer, the classifier frozen.
        m34 = torchvision.models.resnet34(num_classes=3)
        init34 = os.path.join(self.tmp, "init34.safetensors")
        write_safetensors(init34, {k: v.detach().numpy() for k, v in m34.state_dict().items()})
        for extra, msg in ((["--init", init34], "which this model lacks"),
                           (["--init", init, "--freeze", "layer9"], "not one of the model's layers"),
                           (["--freeze", "fc"], "would freeze the classifier"),
                           (["--lr-backbone", "0.01"], "give --lr > 0")):
            r = self.train(os.path.join(self.tmp, "bad"), "--model", "resnet18", *extra, epochs=1,
                           lr=0 if "--lr-backbone" in extra else 0.05)
            self.assertEqual(r.returncode, 2, (extra, r.stderr))
            self.assertIn(msg, r.stderr)


class TestRoughEdges(Base):
    """What a new user hit (issue 15 item 5): quiet means quiet, --log-json is JSON with numbers,
    --dry-run needs no --out, a .pth names the converter, other tiles are warned about, an
    unlabelled store says so, probabilities never exceed 1."""

    def test_stain_augment_trains_is_recorded_and_checked(self):
        # --stain-augment (issue 16 item 3): an epoch trains with it, the config records it (so a
        # resume without it is refused), and weights differ from the run without it.
        plain, stained = os.path.join(self.tmp, "nostain"), os.path.join(self.tmp, "stain")
        self.assertEqual(self.train(plain, epochs=1).returncode, 0)
        r = self.train(stained, "--stain-augment", "0.05", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(stained, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            self.assertAlmostEqual(json.load(f)["config"]["stain_augment"], 0.05, places=6)
        a = read_safetensors(os.path.join(plain, "best.safetensors"))
        b = read_safetensors(os.path.join(stained, "best.safetensors"))
        self.assertTrue(any(not np.array_equal(a[k], b[k]) for k in a))
        r = self.train(stained, "--resume", epochs=2)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("stain_augment", r.stderr)
        r = self.train(os.path.join(self.tmp, "stain-bad"), "--stain-augment", "0.9", epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("in [0, 0.5]", r.stderr)

    def test_logs_and_messages(self):
        # slide-tile -q on 360 patches: nothing on stderr; --log-json: JSON records only.
        store = os.path.join(self.tmp, "q")
        r = subprocess.run([TILE, "--patches", LC, "--tile-size", "48", "-o", store, "-q"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stderr, "")
        r = subprocess.run([TILE, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "2",
                            "--tile-size", "48", "-o", os.path.join(self.tmp, "cmu-json"), "--log-json"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        records = [json.loads(l) for l in r.stderr.splitlines() if l.strip()]  # every line is JSON
        summary = [x for x in records if x["msg"] == "summary"][0]
        self.assertEqual(summary["tiled"], 1)
        self.assertIsInstance(summary["tiles_written"], int)
        self.assertIsInstance(summary["seconds"], float)
        info = subprocess.run([TILE, "info", os.path.join(self.tmp, "cmu-json")], capture_output=True, text=True).stdout
        self.assertIn("none (unlabelled", info)
        self.assertNotIn("(none)", info)
        # slide-train --log-json: JSON lines only, numbers as numbers.
        out = os.path.join(self.tmp, "json-run")
        r = self.train(out, "--log-json", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        records = [json.loads(l) for l in r.stderr.splitlines() if l.strip()]
        epoch = [x for x in records if x["msg"] == "epoch"][0]
        self.assertIsInstance(epoch["train_loss"], float)
        self.assertIsInstance(epoch["epoch"], int)
        peak = [x for x in records if x["msg"] == "peak tensor memory"][0]
        self.assertIsInstance(peak["bytes"], int)
        # The model's tile geometry is recorded; predict warns on other tiles.
        with open(os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["tile_size_px"], 48)
        r = subprocess.run([TRAIN, "predict", "--checkpoint", os.path.join(out, "best.safetensors"), "--data",
                            os.path.join(self.tmp, "cmu-json"), "--out", os.path.join(self.tmp, "json-pred")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("another resolution", r.stderr)  # patches carry no resolution: nothing to compare
        with open(os.path.join(self.tmp, "json-pred", "predictions.csv")) as f:
            probs = [float(v) for l in f.read().splitlines()[1:] for v in l.split(",")[4:7]]
        self.assertTrue(all(0 <= p <= 1 for p in probs))
        big = os.path.join(self.tmp, "big")
        self.assertEqual(subprocess.run([TILE, "--patches", LC, "--tile-size", "64", "-o", big, "-q"]).returncode, 0)
        r = subprocess.run([TRAIN, "predict", "--checkpoint", os.path.join(out, "best.safetensors"), "--data", big,
                            "--out", os.path.join(self.tmp, "big-pred"), "--no-heatmaps"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("trained on tiles of another size", r.stderr)
        # Threads are named by what they do: --decode-threads (or the old --threads) and --compute-threads.
        r = self.train(os.path.join(self.tmp, "threads-run"), "--compute-threads", "1", "--decode-threads", "1",
                       "--log-json", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        rec = [json.loads(l) for l in r.stderr.splitlines() if '"training"' in l][0]
        self.assertEqual((rec["decode_threads"], rec["compute_threads"]), (1, 1))
        r = self.train(os.path.join(self.tmp, "threads-bad"), "--compute-threads", "-1", epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)
        # --dry-run needs no --out.
        r = subprocess.run([TRAIN, "--data", self.store, "--model", "resnet18", "--batch-size", "64", "--dry-run"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        # A PyTorch file where safetensors are expected names the converter.
        import torch
        pth = os.path.join(self.tmp, "w.pth")
        torch.save({"conv1.weight": torch.zeros(2)}, pth)
        r = self.train(os.path.join(self.tmp, "pth-run"), "--model", "resnet18", "--init", pth, epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("convert_torchvision_weights.py", r.stderr)
        self.assertIn("w.pth", r.stderr)


class TestCrossValidation(Base):
    """--folds K: one process per fold through the sweep, grouped by case (a labels CSV's case_id
    column), per-fold and mean +- sd metrics in results.json; resumable like a sweep."""

    def test_three_folds_by_case(self):
        classes = {"lung_aca": "lungaca", "lung_n": "lungn", "lung_scc": "lungscc"}
        rows = ["slide_id,label,case_id"]
        for c, stem in classes.items():
            for i in range(1, 121):  # 4 patches per case: 90 cases
                rows.append("%s/%s%d,%s,%s-%d" % (c, stem, i, c, c, i // 4))
        labels = os.path.join(self.tmp, "cases.csv")
        with open(labels, "w") as f:
            f.write("\n".join(rows) + "\n")
        out = os.path.join(self.tmp, "cv")
        r = self.train(out, "--labels", labels, "--folds", "3", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "results.json")) as f:
            res = json.load(f)
        cv = res["cross_validation"]
        self.assertEqual((cv["folds"], cv["complete_folds"]), (3, 3))
        self.assertEqual([p["fold"] for p in cv["per_fold"]], [0, 1, 2])
        bal = [p["val_balanced_accuracy"] for p in cv["per_fold"]]
        self.assertAlmostEqual(cv["mean"]["val_balanced_accuracy"], float(np.mean(bal)), places=9)
        self.assertAlmostEqual(cv["sd"]["val_balanced_accuracy"], float(np.std(bal, ddof=1)), places=9)
        for k in range(3):
            with open(os.path.join(out, "trials", "t%03d" % k, "checkpoints", "epoch-1-step-0", "state.json")) as f:
                config = json.load(f)["config"]
            self.assertEqual((config["folds"], config["fold"]), (3, k))
        # A rerun finds every fold done and only rewrites the summary.
        r = self.train(out, "--labels", labels, "--folds", "3", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("already_done=3", r.stderr)
        # A fold that fails is listed with its status and left out of the mean and sd (its
        # metrics.jsonl would hold only the epochs it finished). Fold 1 is made unfinished (its
        # result.json says failed) and unable to finish (another process holds its writer.lock);
        # its metrics.jsonl stays.
        import fcntl
        t1 = os.path.join(out, "trials", "t001")
        with open(os.path.join(t1, "result.json")) as f:
            rec = json.load(f)
        with open(os.path.join(t1, "result.json"), "w") as f:
            json.dump(dict(rec, status="failed"), f)
        self.assertTrue(os.path.getsize(os.path.join(t1, "metrics.jsonl")) > 0)
        with open(os.path.join(t1, "writer.lock"), "a+") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            r = self.train(out, "--labels", labels, "--folds", "3", epochs=1)
        self.assertNotEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "results.json")) as f:
            cv = json.load(f)["cross_validation"]
        self.assertEqual(cv["complete_folds"], 2)
        self.assertNotEqual(cv["per_fold"][1]["status"], "ok")
        self.assertNotIn("val_balanced_accuracy", cv["per_fold"][1])
        self.assertAlmostEqual(cv["mean"]["val_balanced_accuracy"], float(np.mean([bal[0], bal[2]])), places=9)
        # Bad combinations are usage errors.
        r = self.train(os.path.join(self.tmp, "cv-bad"), "--fold", "1", epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--fold needs --folds", r.stderr)

    def test_test_fraction_holds_out_cases_and_evaluates_them(self):
        classes = {"lung_aca": "lungaca", "lung_n": "lungn", "lung_scc": "lungscc"}
        rows = ["slide_id,label,case_id"]
        for c, stem in classes.items():
            for i in range(1, 121):
                rows.append("%s/%s%d,%s,%s-%d" % (c, stem, i, c, c, i // 4))
        labels = os.path.join(self.tmp, "cases-tf.csv")
        with open(labels, "w") as f:
            f.write("\n".join(rows) + "\n")
        case_of = {r.split(",")[0]: r.split(",")[2] for r in rows[1:]}
        out = os.path.join(self.tmp, "test-fraction")
        r = self.train(out, "--labels", labels, "--test-fraction", "0.2", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "test", "predictions.csv")) as f:
            test_rows = [l.split(",") for l in f.read().splitlines()[1:]]
        test_cases = {case_of[row[0].split(":", 1)[1]] for row in test_rows}
        all_cases = set(case_of.values())
        self.assertEqual(len(test_cases), round(0.2 * len(all_cases)))  # whole cases: 19 of 93
        self.assertEqual(len(test_rows), sum(1 for c in case_of.values() if c in test_cases))  # every patch of each
        trained = [l for l in r.stderr.splitlines() if "train_tiles=" in l][0]
        n_train = int(re.search(r"train_tiles=(\d+)", trained).group(1))
        n_val = int(re.search(r"val_tiles=(\d+)", trained).group(1))
        self.assertEqual(n_train + n_val + len(test_rows), 360)
        with open(os.path.join(out, "test", "metrics.json")) as f:
            self.assertEqual(json.load(f)["tiles"], len(test_rows))
        # evaluate finds the same test set again from the run's stores, labels, fraction and seed: the
        # held-out run's own evaluation, reproduced from its options. The seed (3, not the default 0)
        # is the checkpoint's when --seed is not given.
        with open(os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            config = json.load(f)["config"]
        self.assertEqual((config["test_fraction"], config["seed"]), (0.2, 3))

        def evaluate(name, *extra):
            ev = os.path.join(self.tmp, name)
            r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "best.safetensors"), "--data",
                                self.store, "--labels", labels, "--out", ev, *extra], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            return ev, r.stderr

        ev, err = evaluate("tf-eval", "--test-fraction", "0.2")
        self.assertNotIn("not the run's", err)
        self.assertNotIn("without --test-fraction", err)
        with open(os.path.join(out, "test", "predictions.csv")) as f, open(os.path.join(ev, "predictions.csv")) as g:
            self.assertEqual(f.read(), g.read())
        # Another seed, or no --test-fraction: another set of tiles, and the log says so.
        _, err = evaluate("tf-eval-seed", "--test-fraction", "0.2", "--seed", "4")
        self.assertIn("--seed is not the run's: these tiles are not the test set it held out", err)
        _, err = evaluate("tf-eval-all")
        self.assertIn("the checkpoint's run held out a test set of its stores; without --test-fraction", err)
        r = self.train(os.path.join(self.tmp, "tf-bad"), "--test-fraction", "0.2", "--test-data", self.store,
                       epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)

    def test_stratify_splits_each_class_in_its_share_and_evaluate_finds_the_test_set(self):
        # 30 cases of 4 patches per class. --stratify holds out round(0.2 x 30) = 6 cases of each
        # class as the test set, then validates round(0.2 x 24) = 5 of each class's other 24.
        classes = {"lung_aca": "lungaca", "lung_n": "lungn", "lung_scc": "lungscc"}
        rows = ["slide_id,label,case_id"] + ["%s/%s%d,%s,%s-%d" % (c, stem, i, c, c, (i - 1) // 4)
                                             for c, stem in classes.items() for i in range(1, 121)]
        labels = os.path.join(self.tmp, "cases-strat.csv")
        with open(labels, "w") as f:
            f.write("\n".join(rows) + "\n")
        out = os.path.join(self.tmp, "stratified")
        r = self.train(out, "--labels", labels, "--test-fraction", "0.2", "--stratify", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "test", "predictions.csv")) as f:
            test_ids = [l.split(",")[0].split(":", 1)[1] for l in f.read().splitlines()[1:]]
        self.assertEqual(collections.Counter(i.split("/")[0] for i in test_ids), {c: 24 for c in classes})
        trained = [l for l in r.stderr.splitlines() if "train_tiles=" in l][0]
        self.assertIn("train_tiles=228", trained)
        self.assertIn("val_tiles=60", trained)
        with open(os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            self.assertIs(json.load(f)["config"]["stratify"], True)
        # evaluate's --test-fraction finds the stratified test set again (the run's config says so).
        ev = os.path.join(self.tmp, "stratified-eval")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "best.safetensors"), "--data",
                            self.store, "--labels", labels, "--out", ev, "--test-fraction", "0.2"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "test", "predictions.csv")) as f, open(os.path.join(ev, "predictions.csv")) as g:
            self.assertEqual(f.read(), g.read())
        # A fixed validation set has nothing to stratify.
        r = self.train(os.path.join(self.tmp, "stratified-bad"), "--val-data", self.store, "--stratify", epochs=1)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--stratify splits --data; --val-data is a fixed split", r.stderr)

    def test_held_out_test_data_is_evaluated_with_the_best_weights(self):
        out = os.path.join(self.tmp, "with-test")
        r = self.train(out, "--test-data", self.store, epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("test set", r.stderr)
        # The same files as slide-train evaluate on best.safetensors.
        ev = os.path.join(self.tmp, "with-test-eval")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "best.safetensors"), "--data",
                            self.store, "--out", ev], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        for name in ("predictions.csv", "slides.csv"):
            with open(os.path.join(out, "test", name)) as f, open(os.path.join(ev, name)) as g:
                self.assertEqual(f.read(), g.read(), name)
        with open(os.path.join(out, "test", "metrics.json")) as f, open(os.path.join(ev, "metrics.json")) as g:
            a, b = json.load(f), json.load(g)
        for key in ("tiles", "loss", "accuracy", "balanced_accuracy", "roc_auc", "recall"):
            self.assertEqual(a[key], b[key], key)
        # --overwrite removes it with the rest of the run.
        r = self.train(out, "--overwrite", epochs=1)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "test")))


class TestAugment(unittest.TestCase):
    """Our colour jitter and resized crop against torchvision.transforms.functional on a real
    LC25000 patch: the same factors and box give the same pixels."""

    def test_matches_torchvision(self):
        import torch
        import torchvision.transforms.functional as F
        from PIL import Image
        src = os.path.join(LC, "lung_aca", sorted(os.listdir(os.path.join(LC, "lung_aca")))[0])
        with Image.open(src) as im:
            img = np.asarray(im.convert("RGB").crop((40, 60, 104, 124)), dtype=np.float32) / 255.0  # 64 x 64
        tmp = tempfile.mkdtemp(prefix="slide_aug_")
        try:
            path_in, path_out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            write_safetensors(path_in, {"image": img})
            t = torch.from_numpy(img.copy()).permute(2, 0, 1)

            def ours(*args):
                r = subprocess.run([os.environ["SLIDE_GOLDEN_AUGMENT"], path_in, path_out, "64"] + [str(a) for a in args],
                                   capture_output=True, text=True)
                self.assertEqual(r.returncode, 0, r.stderr)
                return read_safetensors(path_out)["image"]

            for b, c, s, h in [(1.3, 1, 1, 0), (0.7, 1, 1, 0), (1, 0.6, 1, 0), (1, 1.5, 1, 0), (1, 1, 0.3, 0),
                               (1, 1, 1.8, 0), (1, 1, 1, 0.1), (1, 1, 1, -0.35), (1.2, 0.8, 1.3, 0.04)]:
                want = t
                want = F.adjust_brightness(want, b) if b != 1 else want
                want = F.adjust_contrast(want, c) if c != 1 else want
                want = F.adjust_saturation(want, s) if s != 1 else want
                want = F.adjust_hue(want, h) if h != 0 else want
                want = want.permute(1, 2, 0).numpy()
                got = ours("jitter", b, c, s, h)
                err = float(np.abs(got - want).max())
                self.assertLess(err, 2e-5, "jitter %s: max |ours - torchvision| = %g" % ((b, c, s, h), err))
                self.assertGreater(float(np.abs(got - img).max()), 0.01)  # the transform did something
            for x, y, w, h in [(5, 9, 40, 33), (0, 0, 64, 64), (20, 3, 17, 61)]:
                want = F.resized_crop(t, y, x, h, w, [64, 64], F.InterpolationMode.BILINEAR)
                got = ours("crop", x, y, w, h)
                err = float(np.abs(got - want.permute(1, 2, 0).numpy()).max())
                self.assertLess(err, 1e-5, "crop %s: max |ours - torchvision| = %g" % ((x, y, w, h), err))
            # Stain augmentation (--stain-augment): HED jitter against scikit-image's rgb2hed / hed2rgb
            # written here in NumPy from its documented algorithm (skimage.color.colorconv).
            rgb_from_hed = np.array([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]])
            hed_from_rgb = np.linalg.inv(rgb_from_hed)
            log_adjust = np.log(1e-6)
            px = img.astype(np.float64).reshape(-1, 3)
            stains = np.maximum((np.log(np.maximum(px, 1e-6)) / log_adjust) @ hed_from_rgb, 0)
            for alpha, beta in [((1, 1, 1), (0, 0, 0)), ((1.04, 0.97, 1.01), (0.02, -0.03, 0.01)),
                                ((0.8, 1.2, 1.0), (-0.1, 0.1, 0.0))]:
                jittered = stains * np.array(alpha) + np.array(beta)
                want = np.clip(np.exp((jittered * log_adjust) @ rgb_from_hed), 0, 1).reshape(img.shape)
                got = ours("hed", *alpha, *beta)
                err = float(np.abs(got - want).max())
                self.assertLess(err, 2e-5, "hed %s %s: max |ours - numpy| = %g" % (alpha, beta, err))
                if beta != (0, 0, 0):
                    self.assertGreater(float(np.abs(got - img).max()), 0.01)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


class TestBadInput(Base):
    def test_errors_before_any_work(self):
        out = os.path.join(self.tmp, "bad")
        r = subprocess.run([TRAIN, "--data", os.path.join(self.tmp, "nope"), "--out", out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("nope", r.stderr)
        r = self.train(out, "--model", "vgg16")
        self.assertEqual(r.returncode, 2)
        self.assertIn("vgg16", r.stderr)
        # A store of a slide without labels.
        unlabelled = os.path.join(self.tmp, "cmu")
        cmu = os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs")
        self.assertEqual(subprocess.run([TILE, cmu, "--mpp", "1", "-o", unlabelled, "-q"]).returncode, 0)
        r = subprocess.run([TRAIN, "--data", unlabelled, "--out", out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("has no label", r.stderr)
        r = self.train(out, "--resume")
        self.assertEqual(r.returncode, 2)
        self.assertIn("no complete checkpoint", r.stderr)
        r = self.train(out, "--class-weights", "1,2")
        self.assertEqual(r.returncode, 2)
        self.assertIn("give 3 numbers", r.stderr)
        r = self.train(os.path.join(self.tmp, "balanced"), "--class-weights", "balanced")
        self.assertEqual(r.returncode, 0, r.stderr)
        # A budget too small for the model is a clear error, not a crash.
        r = self.train(out, "--memory-budget", "64K")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)
        self.assertIn("memory budget of 65536 bytes exceeded", r.stderr)
        # A budget that is not a size is a usage error naming the option, before any work.
        r = self.train(os.path.join(self.tmp, "budget-unit"), "--memory-budget", "12Q")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--memory-budget: '12Q': unknown unit 'Q'", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "budget-unit", "checkpoints")))
        # A count that must be positive says so (CLI11's own check printed its bounds as doubles:
        # "Value 0 not in range 0.000000 to 1797693...").
        r = self.train(out, epochs=0)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--epochs: must be a number above 0, not 0", r.stderr)
        self.assertNotIn("1797693", r.stderr)
        r = subprocess.run([TRAIN, "--data", self.store, "--out", out, "--device", "-1"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--device: must be a number >= 0, not -1", r.stderr)



class TestOutputSafety(Base):
    """Issue 20 (train side): option ranges at parse time, one writer per --out, an earlier run kept
    unless --resume or --overwrite, a malformed state.json or NaN weights refused on --resume and
    evaluate. Every refusal leaves what was written as it was."""

    def quick(self, out, *extra, epochs=1):
        return subprocess.run([TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--batch-size", "32",
                               "--width", "4", "--threads", "2", "--seed", "3", "-q"] + list(extra),
                              capture_output=True, text=True)

    def run_dir(self, name):
        """A finished one-epoch run, made once per name."""
        out = os.path.join(self.tmp, name)
        if not os.path.isdir(out):
            r = self.quick(out)
            self.assertEqual(r.returncode, 0, r.stderr)
        return out

    def test_out_of_range_options_are_usage_errors(self):
        out = os.path.join(self.tmp, "ranges")
        for option, value, says in (("--lr", "nan", "must be a finite number >= 0"),
                                    ("--lr", "-1", "must be a finite number >= 0"),
                                    ("--lr", "inf", "must be a finite number >= 0"),
                                    ("--momentum", "5", "must be in [0, 1)"),
                                    ("--momentum", "nan", "must be in [0, 1)"),
                                    ("--weight-decay", "-1", "must be a finite number >= 0"),
                                    ("--warmup-epochs", "-2", "must be a finite number >= 0"),
                                    ("--label-smoothing", "1.5", "must be in [0, 1)"),
                                    ("--val-fraction", "1", "must be in [0, 1)"),
                                    ("--dropout", "nan", "must be in [0, 0.95]"),
                                    # "never" as 1e10 s overflowed the 64-bit nanosecond deadlines
                                    ("--dist-timeout", "1e10", "must be in (0, 1e9] seconds"),
                                    ("--dist-timeout", "0", "must be in (0, 1e9] seconds")):
            r = self.quick(out, option, value)
            self.assertEqual(r.returncode, 2, (option, value, r.stderr))
            self.assertIn("%s: %s: %s" % (option, value, says), r.stderr)
            self.assertFalse(os.path.exists(out))  # refused before anything is written
        # The same for --features (MIL) and for a sweep's grid, before any trial starts.
        r = subprocess.run([TRAIN, "--features", self.tmp, "--out", out, "--lr", "nan"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--lr: nan: must be a finite number >= 0", r.stderr)
        r = subprocess.run([TRAIN, "--features", self.tmp, "--out", out, "--mil-dropout", "-0.5"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        grid = os.path.join(self.tmp, "bad-values.toml")
        with open(grid, "w") as f:
            f.write("lr = [0.1, nan]\nmomentum = 0.9\n")
        sweep = os.path.join(self.tmp, "bad-sweep")
        r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", sweep, "--", "--data", self.store],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("bad-values.toml: trial t001: --lr nan: must be a finite number >= 0", r.stderr)
        self.assertFalse(os.path.exists(sweep))
        with open(grid, "w") as f:
            f.write("lr = [0.1, 0.2]\n")
        r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", sweep, "--", "--data", self.store,
                            "--weight-decay", "-1"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--weight-decay -1: must be a finite number >= 0", r.stderr)

    def test_earlier_run_needs_resume_or_overwrite(self):
        out = os.path.join(self.tmp, "earlier")
        r = self.quick(out)
        self.assertEqual(r.returncode, 0, r.stderr)
        before = snapshot(out)
        r = self.quick(out)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--out %s holds an earlier run (checkpoints/, metrics.jsonl, metrics.csv, curves.png, "
                      "report.html, best.safetensors): continue it with --resume, replace it with --overwrite" % out, r.stderr)
        self.assertEqual(snapshot(out), before)
        r = self.quick(out, "--resume", "--overwrite")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("give one", r.stderr)
        self.assertEqual(snapshot(out), before)
        # The lock file alone is not a run: a directory holding only it trains without a flag.
        only_lock = os.path.join(self.tmp, "only-lock")
        os.makedirs(only_lock)
        open(os.path.join(only_lock, "writer.lock"), "w").close()
        self.assertEqual(self.quick(only_lock).returncode, 0)
        # --overwrite replaces the run: its old checkpoints are gone, a new run's files are there.
        os.makedirs(os.path.join(out, "checkpoints", "epoch-9-step-0"))
        r = self.quick(out, "--overwrite")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(out, "checkpoints"))), ["epoch-1-step-0"])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            self.assertEqual(len(f.read().splitlines()), 1)
        # evaluate's --out: an earlier evaluation is kept unless --overwrite.
        ev = os.path.join(self.tmp, "earlier-eval")
        ck = os.path.join(out, "checkpoints", "epoch-1-step-0")
        evaluate = [TRAIN, "evaluate", "--checkpoint", ck, "--data", self.store, "--out", ev]
        self.assertEqual(subprocess.run(evaluate, capture_output=True).returncode, 0)
        before = snapshot(ev)
        r = subprocess.run(evaluate, capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("holds an earlier evaluation (predictions.csv, slides.csv, metrics.json)", r.stderr)
        self.assertEqual(snapshot(ev), before)
        r = subprocess.run(evaluate + ["--overwrite"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_second_writer_fails_at_once(self):
        import fcntl
        out = self.run_dir("locked")
        before = snapshot(out)
        with open(os.path.join(out, "writer.lock"), "a+") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            holder.seek(0)
            holder.truncate()
            holder.write("%d python3\n" % os.getpid())
            holder.flush()
            before = snapshot(out)
            t0 = time.monotonic()
            r = self.quick(out, "--resume", epochs=2)
            seconds = time.monotonic() - t0
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("output directory %s is being written by another process (pid %d, python3)"
                          % (out, os.getpid()), r.stderr)
            self.assertLess(seconds, 10)
            # evaluate's --out is locked the same way.
            ev = os.path.join(self.tmp, "locked-eval")
            os.makedirs(ev)
            with open(os.path.join(ev, "writer.lock"), "a+") as ev_holder:
                fcntl.flock(ev_holder, fcntl.LOCK_EX)
                r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.join(out, "checkpoints", "epoch-1-step-0"),
                                    "--data", self.store, "--out", ev], capture_output=True, text=True)
                self.assertEqual(r.returncode, 1, r.stderr)
                self.assertIn("output directory %s is being written by another process" % ev, r.stderr)
        self.assertEqual(snapshot(out), before)
        # Released: the run continues, and --resume does not mistake writer.lock for anything.
        r = self.quick(out, "--resume", epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.isdir(os.path.join(out, "checkpoints", "epoch-2-step-0")))

    def test_sweep_locks_its_directory_and_trials_their_own(self):
        import fcntl
        grid = os.path.join(self.tmp, "lock-grid.toml")
        with open(grid, "w") as f:
            f.write("lr = [0.05]\n")
        sweep = os.path.join(self.tmp, "lock-sweep")
        args = [TRAIN, "sweep", "--grid", grid, "--out", sweep, "--", "--data", self.store, "--epochs", "1",
                "--width", "4", "--threads", "2"]
        os.makedirs(sweep)
        with open(os.path.join(sweep, "writer.lock"), "a+") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            r = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("sweep directory %s is being written by another process" % sweep, r.stderr)
        self.assertEqual(os.listdir(sweep), ["writer.lock"])
        # Unlocked: the sweep (holding its lock) and its trial (holding trials/t000's) run side by side.
        r = subprocess.run(args, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(os.path.exists(os.path.join(sweep, "trials", "t000", "writer.lock")))

    def test_resume_refuses_a_malformed_state_json(self):
        ref = self.run_dir("state-ref")
        for field, value, expected in (("epoch", "x", "an integer >= 0"), ("optimizer_steps", "x", "an integer >= 0"),
                                       ("history", 5, "an array"), ("model", 3, "a string"),
                                       ("epoch", -3, "an integer >= 0"), ("classes", "abc", "an array"),
                                       ("step_in_epoch", 1.5, "an integer >= 0")):
            out = os.path.join(self.tmp, "state-" + field)
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(ref, out)
            state_path = os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")
            with open(state_path) as f:
                state = json.load(f)
            state[field] = value
            with open(state_path, "w") as f:
                json.dump(state, f)
            before = snapshot(out)
            r = self.quick(out, "--resume", epochs=2)
            self.assertEqual(r.returncode, 1, (field, r.stderr))
            self.assertIn("%s: field '%s' is %s, expected %s" % (state_path, field, json.dumps(value), expected),
                          r.stderr)
            self.assertNotIn("terminate", r.stderr)  # no uncaught exception
            self.assertEqual(snapshot(out), before)
            r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.dirname(state_path), "--data", self.store,
                                "--out", os.path.join(out, "eval")], capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("field '%s'" % field, r.stderr)

    def test_resume_edge_cases_of_the_checkpoint_record(self):
        """A step_in_epoch past the epoch's steps is refused naming state.json; null validation
        metrics (JSON has no NaN) resume; only directories named exactly epoch-E-step-S are
        checkpoints (a newer-looking epoch-9-step-0.bak is not resumed from)."""
        ref = self.run_dir("state-ref")
        out = os.path.join(self.tmp, "state-edges")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(ref, out)
        ckpt = os.path.join(out, "checkpoints", "epoch-1-step-0")
        state_path = os.path.join(ckpt, "state.json")
        with open(state_path) as f:
            good = json.load(f)
        with open(state_path, "w") as f:
            json.dump(dict(good, step_in_epoch=999), f)
        r = self.quick(out, "--resume", epochs=2)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertRegex(r.stderr, re.escape(state_path) + r": step_in_epoch 999 is past the epoch's \d+ steps")
        self.assertFalse(os.path.isdir(os.path.join(out, "checkpoints", "epoch-2-step-0")))
        # Null validation metrics, and a stray directory that only starts like a checkpoint's name.
        state = json.loads(json.dumps(good))
        state["history"][0]["val_loss"] = None
        state["history"][0]["val_accuracy"] = None
        with open(state_path, "w") as f:
            json.dump(state, f)
        stray = os.path.join(out, "checkpoints", "epoch-9-step-0.bak")
        shutil.copytree(ckpt, stray)
        with open(os.path.join(stray, "state.json"), "w") as f:
            f.write("{")
        # The copy a stopped fallback rewrite left aside (<name>.old, no <name>) is the checkpoint.
        os.rename(ckpt, ckpt + ".old")
        r = self.quick(out, "--resume", epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "checkpoints", "epoch-2-step-0", "state.json")) as f:
            history = json.load(f)["history"]
        self.assertIsNone(history[0]["val_loss"])  # epoch 1 is the resumed one's (a fresh run's has a number)

    def test_nan_weights_are_refused_on_resume_and_evaluate(self):
        ref = self.run_dir("nan-ref")
        out = os.path.join(self.tmp, "nan-weights")
        shutil.copytree(ref, out)
        path = os.path.join(out, "checkpoints", "epoch-1-step-0", "model.safetensors")
        w = read_safetensors(path)
        w["fc.weight"] = w["fc.weight"].copy()
        w["fc.weight"].reshape(-1)[2] = np.nan
        write_safetensors(path, w)
        before = snapshot(out)
        r = self.quick(out, "--resume", epochs=2)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("%s: tensor 'fc.weight' holds NaN (element 2 of" % path, r.stderr)
        self.assertEqual(snapshot(out), before)  # no checkpoint written, NaN or other
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", os.path.dirname(path), "--data", self.store,
                            "--out", os.path.join(self.tmp, "nan-eval")], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("tensor 'fc.weight' holds NaN", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "nan-eval", "predictions.csv")))


class TestLabelsCsv(Base):
    def test_slide_labels_from_a_csv(self):
        store = os.path.join(self.tmp, "slides")
        slides = [os.path.join(SAMPLE, "slides", n) for n in
                  ("CMU-1-Small-Region.svs", "TCGA-CR-7395-01A-01-TS1.svs", "test3-DAPI-2-387.ndpi")]
        r = subprocess.run([TILE] + slides + ["--source-mpp", "0.5", "--mpp", "2", "--tile-size", "64",
                                              "--min-tissue", "0.25", "-o", store, "-q"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        labels = os.path.join(self.tmp, "labels.csv")
        with open(labels, "w") as f:
            f.write("patient,slide_id,label\np1,CMU-1-Small-Region,he\np2,TCGA-CR-7395-01A-01-TS1,he\n"
                    "p3,test3-DAPI-2-387,dapi\n")
        out = os.path.join(self.tmp, "csvrun")
        r = subprocess.run([TRAIN, "--data", store, "--labels", labels, "--out", out, "--epochs", "1",
                            "--width", "4", "--val-fraction", "0.34"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            self.assertEqual(json.load(f)["classes"], ["dapi", "he"])
        # Seed 0's split by slide holds out the one dapi slide: each side lacks a class, and the
        # log says so before training (the run goes on: a user may mean it).
        self.assertIn("a class has no training tile after the split class=dapi", r.stderr)
        self.assertIn("a class has no validation tile after the split class=he", r.stderr)
        # The CSV edited in place (two slides relabelled, the same slides and patients: the same
        # split): --resume refuses to go on training the checkpoint towards other labels, naming
        # the counts per class, and leaves the checkpoints as they were.
        with open(labels, "w") as f:
            f.write("patient,slide_id,label\np1,CMU-1-Small-Region,dapi\np2,TCGA-CR-7395-01A-01-TS1,he\n"
                    "p3,test3-DAPI-2-387,he\n")
        before = sorted(os.listdir(os.path.join(out, "checkpoints")))
        r = subprocess.run([TRAIN, "--data", store, "--labels", labels, "--out", out, "--epochs", "2",
                            "--width", "4", "--val-fraction", "0.34", "--resume"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("was made with other labels (per class then: dapi ", r.stderr)
        self.assertIn("the labels CSV or the stores' labels changed", r.stderr)
        self.assertEqual(sorted(os.listdir(os.path.join(out, "checkpoints"))), before)
        # A checkpoint from before the record (state.json without "labels") resumes, with a warning.
        state_path = os.path.join(out, "checkpoints", "epoch-1-step-0", "state.json")
        with open(state_path) as f:
            state = json.load(f)
        del state["labels"]
        with open(state_path, "w") as f:
            json.dump(state, f)
        r = subprocess.run([TRAIN, "--data", store, "--labels", labels, "--out", out, "--epochs", "2",
                            "--width", "4", "--val-fraction", "0.34", "--resume"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("the checkpoint does not record its labels (made before the record existed); not checked",
                      r.stderr)
        # Without labels the store cannot train; a slide missing from the CSV or a duplicate row is
        # named, with the file (and line).
        r = subprocess.run([TRAIN, "--data", store, "--out", out + "2"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--labels", r.stderr)
        with open(labels, "w") as f:
            f.write("slide_id,label\nCMU-1-Small-Region,he\n")
        r = subprocess.run([TRAIN, "--data", store, "--labels", labels, "--out", out + "3"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("no row for slide", r.stderr)
        with open(labels, "w") as f:
            f.write("slide_id,label\nCMU-1-Small-Region,he\nCMU-1-Small-Region,dapi\n")
        r = subprocess.run([TRAIN, "--data", store, "--labels", labels, "--out", out + "4"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 2)
        self.assertIn("labels.csv:3: slide 'CMU-1-Small-Region' appears twice", r.stderr)


class TestAnnotationLabels(Base):
    def test_tile_labels_from_annotations_are_trained_on(self):
        """A store tiled with --label-from-annotations: each tile's label is its header's (the
        GeoJSON's class), tiles no class covers are left out of training and evaluation and kept
        unlabelled by predict; the slide has no label of its own."""
        import lmdb
        import struct
        annot = os.path.join(self.tmp, "annot.geojson")
        # CMU-1-Small-Region is 2220 x 2967 level-0 px: "tumor" top left, "stroma" bottom right,
        # the rest unannotated.
        rect = lambda x0, y0, x1, y1: [[[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]]]
        with open(annot, "w") as f:
            json.dump({"type": "FeatureCollection", "features": [
                {"type": "Feature", "properties": {"classification": {"name": "tumor"}},
                 "geometry": {"type": "Polygon", "coordinates": rect(0, 0, 1024, 1536)}},
                {"type": "Feature", "properties": {"classification": {"name": "stroma"}},
                 "geometry": {"type": "Polygon", "coordinates": rect(1280, 1536, 2220, 2967)}}]}, f)
        store = os.path.join(self.tmp, "annotated")
        r = subprocess.run([TILE, os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"), "--mpp", "2",
                            "--tile-size", "32", "--min-tissue", "0", "--annotations", annot,
                            "--label-from-annotations", "-o", store, "-q"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        names = json.loads(subprocess.run([TILE, "info", store, "--json"], capture_output=True,
                                          text=True).stdout)["label_names"]
        self.assertEqual(names, ["tumor", "stroma"])
        env = lmdb.open(store, readonly=True, lock=False, max_dbs=4)
        with env.begin() as txn:
            headers = [struct.unpack_from("<4sHHIiqqIIBBHI", v) for _, v in txn.cursor(db=env.open_db(b"tiles", txn=txn))]
        env.close()
        want = {(h[5], h[6]): names[h[4]] for h in headers if h[4] >= 0}
        unlabelled = sum(h[4] < 0 for h in headers)
        counts = {n: sum(v == n for v in want.values()) for n in names}
        self.assertGreater(counts["tumor"], 10)
        self.assertGreater(counts["stroma"], 10)
        self.assertGreater(unlabelled, 10)

        out = os.path.join(self.tmp, "annot-run")
        r = subprocess.run([TRAIN, "--data", store, "--out", out, "--epochs", "1", "--batch-size", "16", "--width", "4",
                            "--val-fraction", "0", "--threads", "2"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        left_out = [l for l in r.stderr.splitlines() if "without a label from the annotations left out" in l]
        self.assertEqual(len(left_out), 1, r.stderr)
        self.assertIn(str(unlabelled), left_out[0])
        ckpt = os.path.join(out, "checkpoints", "epoch-1-step-0")
        with open(os.path.join(ckpt, "state.json")) as f:
            self.assertEqual(json.load(f)["classes"], names)
        # evaluate: one row per labelled tile, each with its own tile's label.
        ev = os.path.join(self.tmp, "annot-ev")
        r = subprocess.run([TRAIN, "evaluate", "--checkpoint", ckpt, "--data", store, "--out", ev],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f]
        self.assertEqual(rows[0][:4], ["slide_id", "x_l0", "y_l0", "label"])
        self.assertEqual({(int(x[1]), int(x[2])): x[3] for x in rows[1:]}, want)
        self.assertEqual(len(rows) - 1, len(want))
        # The slide's tiles have two classes: slides.csv gives it no label (it took its last tile's).
        with open(os.path.join(ev, "slides.csv")) as f:
            slide_rows = list(csv.DictReader(f))
        self.assertEqual([(x["label"], int(x["tiles"])) for x in slide_rows], [("", len(want))])
        # predict: every tile, the unannotated ones without a label.
        pred = os.path.join(self.tmp, "annot-pred")
        r = subprocess.run([TRAIN, "predict", "--checkpoint", ckpt, "--data", store, "--out", pred],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(pred, "predictions.csv")) as f:
            rows = [l.rstrip("\n").split(",") for l in f][1:]
        self.assertEqual(len(rows), len(headers))
        self.assertEqual({(int(x[1]), int(x[2])): x[3] for x in rows if x[3]}, want)
        self.assertEqual(sum(x[3] == "" for x in rows), unlabelled)

        # A patients-only labels CSV (no label column) groups the slides and keeps the tile labels
        # (a CSV with a label column gives slide labels instead).
        patients = os.path.join(self.tmp, "annot-patients.csv")
        with open(patients, "w") as f:
            f.write("slide_id,case_id\nCMU-1-Small-Region,case-1\n")
        out3 = os.path.join(self.tmp, "annot-run3")
        r = subprocess.run([TRAIN, "--data", store, "--labels", patients, "--out", out3, "--epochs", "1",
                            "--batch-size", "16", "--width", "4", "--val-fraction", "0", "--threads", "2"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(str(unlabelled), [l for l in r.stderr.splitlines() if "left out" in l][0])
        with open(os.path.join(out3, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            self.assertEqual(json.load(f)["classes"], names)

        # Tiled from a manifest whose label column gives the slide a label too: the store's
        # label_names then hold "LUAD" as well, which no tile has; it is not made a class.
        manifest = os.path.join(self.tmp, "annot-manifest.csv")
        with open(manifest, "w") as f:
            f.write("slide_id,path,label\ncmu,%s,LUAD\n" % os.path.join(SAMPLE, "slides", "CMU-1-Small-Region.svs"))
        store2 = os.path.join(self.tmp, "annotated-manifest")
        r = subprocess.run([TILE, "--manifest", manifest, "--mpp", "2", "--tile-size", "32", "--min-tissue", "0",
                            "--annotations", annot, "--label-from-annotations", "-o", store2, "-q"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("LUAD", json.loads(subprocess.run([TILE, "info", store2, "--json"], capture_output=True,
                                                        text=True).stdout)["label_names"])
        out2 = os.path.join(self.tmp, "annot-run2")
        r = subprocess.run([TRAIN, "--data", store2, "--out", out2, "--epochs", "2", "--batch-size", "16",
                            "--width", "4", "--val-fraction", "0", "--threads", "2"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(out2, "checkpoints", "epoch-2-step-0", "state.json")) as f:
            state = json.load(f)
        self.assertEqual(state["classes"], ["tumor", "stroma"])
        # No validation set: best.safetensors is the last epoch's (it stayed the first's).
        self.assertEqual((state["best_epoch"], state["best_metric"]), (2, "last_epoch"))

        # A damaged header (its slide index, or a label index past label_names) is a data-loss
        # error naming the store and the tile, before any training.
        key = len(headers) // 2

        def patched(name, offset, value):
            copy = os.path.join(self.tmp, name)
            shutil.copytree(store, copy)
            env = lmdb.open(copy, max_dbs=4)
            with env.begin(write=True) as txn:
                db = env.open_db(b"tiles", txn=txn)
                k = struct.pack(">Q", key)
                v = bytearray(txn.get(k, db=db))
                struct.pack_into("<i", v, offset, value)
                txn.put(k, bytes(v), db=db)
            env.close()
            return copy

        for name, offset, value, needle in (("bad-slide-index", 8, 3, "belongs to slide 3"),
                                            ("bad-label-index", 12, 7, "has label index 7")):
            bad = patched(name, offset, value)
            r = subprocess.run([TRAIN, "--data", bad, "--out", os.path.join(self.tmp, name + "-run"), "--epochs", "1",
                                "--batch-size", "16", "--width", "4", "--val-fraction", "0", "--threads", "2"],
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("store %s: tile %d %s" % (bad, key, needle), r.stderr)
            self.assertFalse(os.path.exists(os.path.join(self.tmp, name + "-run", "checkpoints", "epoch-1-step-0")))


class TestTorchvision(unittest.TestCase):
    """Numerics against PyTorch: torchvision's resnet18 with its own initial weights, one batch,
    forward in training mode, cross-entropy, backward, one SGD-momentum step; the logits, the
    loss, every parameter after the step and batch norm's running statistics must match ours."""

    def test_resnet18_forward_and_one_sgd_step(self):
        import torch
        import torchvision
        torch.set_num_threads(2)
        torch.manual_seed(0)
        tmp = tempfile.mkdtemp(prefix="slide_golden_")
        try:
            m = torchvision.models.resnet18(num_classes=3)
            state = {k: v.detach().numpy().copy() for k, v in m.state_dict().items()
                     if not k.endswith("num_batches_tracked")}
            write_safetensors(os.path.join(tmp, "model.safetensors"), state)
            x = torch.randn(4, 3, 64, 64)
            y = torch.tensor([0, 2, 1, 2])
            write_safetensors(os.path.join(tmp, "input.safetensors"),
                              {"x": x.numpy(), "y": y.numpy().astype(np.int32)})
            out = os.path.join(tmp, "out.safetensors")
            r = subprocess.run([os.environ["SLIDE_GOLDEN_STEP"], os.path.join(tmp, "model.safetensors"),
                                os.path.join(tmp, "input.safetensors"), out, "18", "3"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            ours = read_safetensors(out)

            m.train()
            opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            logits = m(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            opt.step()

            def close(name, got, want, tol):
                scale = max(1.0, float(np.abs(want).max()))
                err = float(np.abs(got - want).max()) / scale
                self.assertLess(err, tol, "%s: max |ours - torch| / scale = %.3g" % (name, err))

            close("logits", ours["logits"], logits.detach().numpy(), 1e-4)
            self.assertAlmostEqual(float(ours["loss"][0]), loss.item(), places=4)
            after = m.state_dict()
            for name, value in after.items():
                if name.endswith("num_batches_tracked"):
                    continue
                # Parameters moved by lr * grad; the gradients agree to f32 rounding through 18
                # layers, so the updated weights agree to a small fraction of the step.
                close(name, ours[name], value.numpy(), 1e-4)
            moved = float(np.abs(after["conv1.weight"].numpy() - state["conv1.weight"]).max())
            self.assertGreater(moved, 1e-6)  # the step did change the weights
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
