#!/usr/bin/python3
"""End-to-end tests of data-parallel slide-train over MPI ranks (mpirun) on real tiles: the LC25000
lung subset in sample_data, tiled by slide-tile (run by ctest, one class per test, label mpi).

The equivalences tested: P ranks with one micro-batch each take the same slices of every global
step as one rank with P micro-batches (--accumulate P), batch norm's per-micro-batch statistics
included, so the parameters must agree to float summation order; with --sync-bn, P ranks agree
with one rank and one micro-batch.

Environment: SLIDE_TILE, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR (sample_data/), SLIDE_MPIEXEC
(mpirun, or a command line that launches like it: test_slide_train_two_hosts.py gives the two-host
rig's), and Open MPI's settings for root, oversubscription and containers (tests/CMakeLists.txt).
"""
import glob
import json
import shlex
import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
from safetensors_io import read_safetensors

TILE = os.environ["SLIDE_TILE"]
TRAIN = os.environ["SLIDE_TRAIN"]
SAMPLE = os.environ["SLIDE_SAMPLE_DIR"]
MPIEXEC = shlex.split(os.environ.get("SLIDE_MPIEXEC", "mpirun"))
LC = os.path.join(SAMPLE, "patches", "lc25000-lung-subset")
# One oneDNN thread per rank: 2 ranks fill CI's 2 cores, 3 oversubscribe them.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def subset(src, dst, per_class, skip=0):
    """A patch folder with `per_class` images of each class (after skipping `skip`), as symlinks."""
    for cls in sorted(os.listdir(src)):
        os.makedirs(os.path.join(dst, cls))
        for f in sorted(os.listdir(os.path.join(src, cls)))[skip:skip + per_class]:
            os.symlink(os.path.join(src, cls, f), os.path.join(dst, cls, f))


def params(run_dir, epoch):
    """The trainable parameters of a checkpoint (batch norm's running statistics left out: with
    per-rank batch norm they are rank 0's, by design)."""
    t = read_safetensors(os.path.join(run_dir, "checkpoints", "epoch-%d-step-0" % epoch, "model.safetensors"))
    return {k: v for k, v in t.items() if "running_" not in k}


def rank_pids(mpirun_pid, rank_variable=b"OMPI_COMM_WORLD_RANK", marker=None):
    """{rank: pid} of the processes a launcher started (mpirun's children carry OMPI_COMM_WORLD_RANK,
    slide-train --gpus's SLIDE_LAUNCH_RANK). With `marker` (a run's --out), the ranks are found by
    their command line instead of their parent: on the two-host rig a remote rank is the child of
    Open MPI's daemon there, not of mpirun."""
    out = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            if marker is not None:
                with open(os.path.join(d, "cmdline"), "rb") as f:
                    if marker.encode() not in f.read().split(b"\0"):
                        continue
            else:
                with open(os.path.join(d, "stat")) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != mpirun_pid:
                    continue
            with open(os.path.join(d, "environ"), "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
            if rank_variable in env:
                out[int(env[rank_variable])] = int(os.path.basename(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def kill_all(pids):
    """SIGKILL every pid still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def hang_rank(p, pids, rank, timeout=60):
    """Stops rank `rank` (SIGSTOP: hung, not dead, its connections open) and waits for the job `p`
    to end; every rank is SIGKILLed afterwards, ended or not. Returns (seconds it took, stderr)."""
    os.kill(pids[rank], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=timeout)
    finally:
        kill_all(pids.values())
    return time.monotonic() - t0, err


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_train_dist_")
        # 33 training tiles (11 per class) and 15 validation tiles: 33 is odd, prime to 4, 5 and 7.
        for name, per_class, skip in (("train", 11, 0), ("val", 5, 11)):
            subset(LC, os.path.join(cls.tmp, name + "_patches"), per_class, skip)
            r = subprocess.run([TILE, "--patches", os.path.join(cls.tmp, name + "_patches"), "--tile-size", "48",
                                "-o", os.path.join(cls.tmp, name), "-q"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        cls.train_store = os.path.join(cls.tmp, "train")
        cls.val_store = os.path.join(cls.tmp, "val")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def args(self, out, batch, epochs, *extra):
        return [TRAIN, "--data", self.train_store, "--val-data", self.val_store, "--out", out, "--epochs", str(epochs),
                "--batch-size", str(batch), "--lr", "0.05", "--width", "8", "--threads", "1", "--seed", "3",
                "--cache", "none"] + list(extra)

    def train(self, ranks, out, batch, epochs, *extra, timeout=300):
        cmd = self.args(out, batch, epochs, *extra)
        if ranks > 0:
            cmd = MPIEXEC + ["-np", str(ranks)] + cmd
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)

    def wait_for(self, path, seconds=120):
        """Waits until `path` (a checkpoint directory) exists: progress, not a sleep."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not os.path.isdir(path):
            time.sleep(0.01)
        self.assertTrue(os.path.isdir(path), path)

    def assert_close(self, a, b, rtol=2e-4, atol=2e-5):
        self.assertEqual(sorted(a), sorted(b))
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)

    def history(self, out):
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


class TestEquivalence(Base):
    def check(self, ranks, batch, extra_single, extra_ranks, epochs=2, same_validation=False, rtol=2e-4, atol=2e-5,
              places=4):
        one = os.path.join(self.tmp, "one_%d_%d_%s" % (ranks, batch, "_".join(extra_single)))
        many = os.path.join(self.tmp, "many_%d_%d_%s" % (ranks, batch, "_".join(extra_ranks)))
        r = self.train(0, one, batch, epochs, *extra_single)
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.train(ranks, many, batch, epochs, *extra_ranks)
        self.assertEqual(r.returncode, 0, r.stderr)
        # Only rank 0 logs: one "training" record, naming the ranks.
        self.assertEqual(r.stderr.count("training"), 1, r.stderr)
        self.assertIn("ranks=%d" % ranks, r.stderr)
        a, b = params(one, epochs), params(many, epochs)
        # Equal parameters are not a given: the last epoch moved them well beyond the tolerance.
        before = params(one, epochs - 1)
        self.assertGreater(max(float(np.abs(a[k] - before[k]).max()) for k in a), 1e-2)
        self.assert_close(a, b, rtol=rtol, atol=atol)
        # The training statistics are reduced over the ranks: the single rank's.
        for h1, h2 in zip(self.history(one), self.history(many)):
            self.assertAlmostEqual(h1["train_loss"], h2["train_loss"], places=places)
            self.assertAlmostEqual(h1["train_accuracy"], h2["train_accuracy"], places=6)
        # Validation, split over the ranks and reduced, scores the checkpoint rank 0 wrote (its
        # running statistics): what `slide-train evaluate` of that checkpoint finds.
        ev = os.path.join(self.tmp, "eval_" + os.path.basename(many))
        r = subprocess.run([TRAIN, "--threads", "1", "evaluate", "--checkpoint",
                            os.path.join(many, "checkpoints", "epoch-%d-step-0" % epochs), "--data", self.val_store,
                            "--out", ev], capture_output=True, text=True, env=ENV)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(os.path.join(ev, "metrics.json")) as f:
            m = json.load(f)
        last = self.history(many)[-1]
        self.assertAlmostEqual(m["loss"], last["val_loss"], places=5)
        self.assertAlmostEqual(m["accuracy"], last["val_accuracy"], places=6)
        self.assertAlmostEqual(m["roc_auc"], last["val_roc_auc"], places=5)
        if same_validation:
            # --sync-bn: the running statistics are the single rank's too.
            for h1, h2 in zip(self.history(one), self.history(many)):
                self.assertAlmostEqual(h1["val_loss"], h2["val_loss"], places=places)
                self.assertAlmostEqual(h1["val_accuracy"], h2["val_accuracy"], places=6)

    def test_two_ranks_odd_batch_equal_one_rank_with_two_micro_batches(self):
        # B = 5 over 2 ranks: 2 + 3 samples per step; 33 tiles: the last step has 3.
        self.check(2, 5, ["--accumulate", "2"], [])

    def test_two_ranks_when_the_last_step_has_one_sample(self):
        # B = 4: 33 = 8 x 4 + 1, so in the last step rank 0 has no sample and still all-reduces.
        self.check(2, 4, ["--accumulate", "2"], [])

    def test_three_ranks_oversubscribed_uneven_split(self):
        # B = 7 over 3 ranks: 2 + 2 + 3; the last step of 5: 1 + 2 + 2. 3 ranks on 2 cores.
        self.check(3, 7, ["--accumulate", "3"], [])

    def test_ranks_compose_with_gradient_accumulation(self):
        # 2 ranks x 2 micro-batches of a step of 8 = 4 micro-batches of 2 on one rank.
        self.check(2, 8, ["--accumulate", "4"], ["--accumulate", "2"])

    def test_two_ranks_on_the_simulated_device(self):
        # Device gradients with an MPI communicator: the flat buffer is staged through host memory;
        # parameters and optimizer state are broadcast through host copies. Two ranks on the
        # simulated device equal one rank on it with two micro-batches.
        self.check(2, 5, ["--accumulate", "2", "--backend", "reference-sim"], ["--backend", "reference-sim"])
        # ... and the host reference backend's run (the device paths change no number).
        host = os.path.join(self.tmp, "host_2_5")
        r = self.train(0, host, 5, 2, "--accumulate", "2", "--backend", "reference")
        self.assertEqual(r.returncode, 0, r.stderr)
        a, b = params(host, 2), params(os.path.join(self.tmp, "one_2_5_--accumulate_2_--backend_reference-sim"), 2)
        for k in a:
            self.assertTrue(np.array_equal(a[k], b[k]), k)
        # --sync-bn on the device: the backend's per-channel sums stay on it and are all-reduced
        # through host copies (MPI); the same parameters and running statistics as two ranks of the
        # host reference backend, bit for bit.
        models = {}
        for backend in ("reference-sim", "reference"):
            out = os.path.join(self.tmp, "sync_bn_" + backend)
            r = self.train(2, out, 6, 1, "--backend", backend, "--sync-bn")
            self.assertEqual(r.returncode, 0, r.stderr)
            models[backend] = read_safetensors(
                os.path.join(out, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        self.assertTrue(any("running_var" in k for k in models["reference"]))
        self.assertEqual(sorted(models["reference"]), sorted(models["reference-sim"]))
        for k in models["reference"]:
            self.assertTrue(np.array_equal(models["reference"][k], models["reference-sim"][k]), k)

    def test_bucket_size_and_overlap_change_no_number(self):
        # Buckets of 10 KiB (several, each all-reduced as soon as backward has finished it) or every
        # bucket after backward (--no-overlap): the default's parameters, bit for bit.
        # Both also write --dist-timeline, checked below.
        runs = {}
        timelines = {}
        for tag, extra in (("default", []), ("small", ["--bucket-mb", "0.01"]), ("after", ["--no-overlap"])):
            out = os.path.join(self.tmp, "buckets_" + tag)
            if tag != "default":
                timelines[tag] = os.path.join(self.tmp, "timeline_" + tag + ".csv")
                extra = extra + ["--dist-timeline", timelines[tag]]
            r = self.train(2, out, 5, 1, *extra)
            self.assertEqual(r.returncode, 0, r.stderr)
            runs[tag] = params(out, 1)
        for tag in ("small", "after"):
            for k in runs["default"]:
                self.assertTrue(np.array_equal(runs["default"][k], runs[tag][k]), (tag, k))
        # The timeline: per step, every bucket started and completed once, after the layers that
        # finish its gradients; overlapped, the buckets start during backward (before wait_start),
        # with --no-overlap only after it, and no layer event is recorded.
        for tag, path in list(timelines.items()):
            timelines[tag + " rank 1"] = path + ".rank1"  # the other rank's, checked the same way
        for tag, path in timelines.items():
            tag = tag.split()[0]
            with open(path) as f:
                rows = list(csv.DictReader(f))
            self.assertTrue(rows, tag)
            steps = sorted({int(r["step"]) for r in rows})
            self.assertEqual(steps, list(range(1, len(steps) + 1)), tag)
            self.assertGreaterEqual(len(steps), 2, tag)
            for step in steps:
                ev = [r for r in rows if int(r["step"]) == step]
                t = [float(r["t_ms"]) for r in ev]
                self.assertEqual(t, sorted(t), (tag, step))
                kinds = [r["event"] for r in ev]
                self.assertEqual(kinds[-1], "step_end", (tag, step))
                self.assertEqual(kinds.count("wait_start"), 1, (tag, step))
                wait_at = kinds.index("wait_start")
                starts = [int(r["bucket"]) for r in ev if r["event"] == "bucket_start"]
                dones = sorted(int(r["bucket"]) for r in ev if r["event"] == "bucket_done")
                self.assertEqual(starts, list(range(1, len(starts) + 1)), (tag, step))
                self.assertEqual(dones, starts, (tag, step))
                first_start = kinds.index("bucket_start")
                layers = [r["name"] for r in ev if r["event"] == "layer_done"]
                if tag == "small":
                    self.assertGreaterEqual(len(starts), 3, step)  # 10 KiB buckets: several
                    self.assertLess(first_start, wait_at, step)
                    self.assertEqual(layers[0], "fc.weight", step)  # backward's first layer: the head
                    self.assertLess(max(i for i, k in enumerate(kinds) if k == "layer_done"), wait_at)
                else:
                    self.assertEqual(layers, [], step)
                    self.assertGreater(first_start, wait_at, step)

    def test_sync_bn_two_ranks_equal_one_rank_with_the_whole_batch(self):
        self.check(2, 6, [], ["--sync-bn"], same_validation=True)
        self.assert_close(read_safetensors(os.path.join(self.tmp, "one_2_6_", "best.safetensors")),
                          read_safetensors(os.path.join(self.tmp, "many_2_6_--sync-bn", "best.safetensors")))

    def test_class_weights_two_ranks_equal_one_rank_with_the_whole_batch(self):
        # The loss is each step's weighted mean over all its samples (PyTorch's
        # CrossEntropyLoss(weight)): a rank's gradient counts by its share of the step's weight, not
        # of its samples (--sync-bn, so that batch norm sees the whole batch too).
        # The ranks' shares of the weight (e.g. 4.5 / 8.5) are not exact in f32 as halves of the
        # samples are, and 12 steps of SGD with momentum grow the rounding to ~5e-5 in the weights
        # and ~1e-4 in the validation loss; splitting by samples instead (the bug this guards
        # against) is off by percents.
        w = ["--class-weights", "1,3,0.5"]
        self.check(2, 6, w, ["--sync-bn"] + w, same_validation=True, rtol=1e-3, atol=2e-4,
                   places=3)


class TestFailure(Base):
    def start(self, ranks, out, batch, epochs, *extra):
        cmd = MPIEXEC + ["-np", str(ranks)] + self.args(out, batch, epochs, *extra)
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)


    def test_a_stopped_rank_times_out_the_others_and_a_resume_continues(self):
        ref = os.path.join(self.tmp, "ref_stop")
        self.assertEqual(self.train(2, ref, 5, 4).returncode, 0)
        out = os.path.join(self.tmp, "stopped")
        p = self.start(2, out, 5, 4, "--dist-timeout", "5")
        self.wait_for(os.path.join(out, "checkpoints", "epoch-1-step-0"))
        pids = rank_pids(p.pid, marker=out)
        self.assertEqual(sorted(pids), [0, 1])
        # A hung rank (stopped, not dead: the launcher sees nothing wrong).
        took, err = hang_rank(p, pids, 1)
        self.assertLess(took, 40)
        self.assertNotEqual(p.returncode, 0)
        # The collective that times out is the one rank 0 reached first after the stop: usually a
        # gradient bucket's; on a fast CPU (an epoch of this run takes 40 ms) validation's, or the
        # epoch's training statistics' (seen once in CI: the stop landed after the last step's
        # buckets).
        self.assertRegex(err, r"rank 0: .*rank 0 of 2 at step \d+: (all-reduce of gradient bucket 1 of 1 .*|"
                              r"all-(reduce|gather) of validation \w+ |"
                              r"all-reduce of the epoch's training statistics )did not complete within 5 s")
        # The newest complete checkpoint is intact: the same 2 ranks resume to the same weights.
        r = self.train(2, out, 5, 4, "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_close(params(ref, 4), params(out, 4), rtol=0, atol=0)

    def test_an_interrupt_of_one_rank_stops_every_rank_after_the_same_step_and_resume_is_exact(self):
        ref = os.path.join(self.tmp, "ref_int")
        self.assertEqual(self.train(2, ref, 4, 40).returncode, 0)
        out = os.path.join(self.tmp, "interrupted")
        p = self.start(2, out, 4, 40)
        self.wait_for(os.path.join(out, "checkpoints", "epoch-3-step-0"))
        # Only rank 1 is interrupted (Ctrl-C reaches mpirun, which passes SIGTERM on to the ranks
        # odls_base_sigkill_timeout seconds later; scancel signals every task): the stop request
        # travels with the gradients, so rank 0 stops after the same step and writes the checkpoint.
        os.kill(rank_pids(p.pid, marker=out)[1], signal.SIGINT)
        _, err = p.communicate(timeout=60)
        self.assertNotEqual(p.returncode, 0, "the interrupt should land mid-run")
        self.assertEqual(err.count("interrupted; checkpoint written"), 1, err)  # rank 0 alone writes and logs
        self.assertNotIn("epoch-40-step-0", os.listdir(os.path.join(out, "checkpoints")))
        r = self.train(2, out, 4, 40, "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stderr, r"resumed .*epoch-\d+-step-[1-9]")  # inside an epoch
        self.assert_close(params(ref, 40), params(out, 40), rtol=0, atol=0)

    def test_a_killed_rank_takes_the_job_down_and_a_resume_with_another_world_size_continues(self):
        # Reference: one rank with 2 micro-batches, the same math as 2 ranks (see TestEquivalence).
        ref = os.path.join(self.tmp, "ref_kill")
        self.assertEqual(self.train(0, ref, 5, 4, "--accumulate", "2").returncode, 0)
        out = os.path.join(self.tmp, "killed")
        p = self.start(2, out, 5, 4, "--dist-timeout", "20")
        self.wait_for(os.path.join(out, "checkpoints", "epoch-2-step-0"))
        pids = rank_pids(p.pid, marker=out)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        self.assertLess(time.monotonic() - t0, 30)
        self.assertNotEqual(p.returncode, 0, err)
        # Resume on one rank (2 micro-batches) and then on 3 ranks: the same global schedule.
        r = self.train(0, out, 5, 4, "--resume", "--accumulate", "2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_close(params(ref, 4), params(out, 4))
        self.assertEqual([h["epoch"] for h in self.history(out)], [1, 2, 3, 4])


class TestWorldSize(Base):
    def test_resume_with_more_ranks_continues_the_same_schedule(self):
        # 3 epochs on one rank (3 micro-batches), the reference.
        ref = os.path.join(self.tmp, "ref_ws")
        r = self.train(0, ref, 7, 3, "--accumulate", "3", "--warmup-epochs", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        # The same run as if it had died during epoch 2: only the epoch-1 checkpoint is left.
        out = os.path.join(self.tmp, "ws")
        shutil.copytree(ref, out)
        for e in (2, 3):
            shutil.rmtree(os.path.join(out, "checkpoints", "epoch-%d-step-0" % e))
        # Resumed on 3 ranks (oversubscribed), one micro-batch each: the same slices of each step.
        r = self.train(3, out, 7, 3, "--resume", "--warmup-epochs", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRegex(r.stderr, r"resumed .*epoch-1-step-0")
        self.assert_close(params(ref, 3), params(out, 3))
        # The learning-rate schedule (warm-up, then cosine over the global steps) goes on unchanged.
        self.assertEqual([h["lr"] for h in self.history(out)], [h["lr"] for h in self.history(ref)])
        self.assertEqual([h["epoch"] for h in self.history(out)], [1, 2, 3])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
