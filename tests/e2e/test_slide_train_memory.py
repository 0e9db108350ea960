#!/usr/bin/python3
"""End-to-end tests of slide-train's memory features (issue 6) on real tiles: the LC25000 lung
subset in sample_data, tiled by slide-tile. One class per ctest entry.

TestPlan: --dry-run's predicted peak against a real run's measured peak; --batch-size auto.
TestOomRecovery: a budget that fits micro-batch 8 but not 32: --batch-size 32 finishes, logs the
  recovery once, and its weights equal those of an explicit --accumulate 4 run.
TestSweep: a trial SIGKILLed, one over its budget: both recorded as failed, the others finish; a
  rerun runs only the unfinished ones.

Environment: SLIDE_TILE, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR (sample_data/).
"""
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import unittest

import numpy as np
from safetensors_io import read_safetensors

TILE = os.environ["SLIDE_TILE"]
TRAIN = os.environ["SLIDE_TRAIN"]
LC = os.path.join(os.environ["SLIDE_SAMPLE_DIR"], "patches", "lc25000-lung-subset")


def mib(text):
    return float(text.split()[0]) * {"B": 1 / 2**20, "KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[text.split()[1]]


class Base(unittest.TestCase):
    TILE_PX = "64"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slide_train_memory_")
        cls.store = os.path.join(cls.tmp, "lc")
        r = subprocess.run([TILE, "--patches", LC, "--tile-size", cls.TILE_PX, "-o", cls.store, "-q"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def train(self, out, *extra, epochs=1):
        args = [TRAIN, "--data", self.store, "--out", out, "--epochs", str(epochs), "--lr", "0.05", "--width", "16",
                "--threads", "2", "--seed", "3", "--no-augment", "--cache", "none"] + list(extra)
        return subprocess.run(args, capture_output=True, text=True)


class TestPlan(Base):
    def test_dry_run_predicts_the_measured_peak(self):
        for model, batch in (("small", "32"), ("resnet18", "16")):
            out = os.path.join(self.tmp, "plan-" + model)
            r = self.train(out, "--model", model, "--batch-size", batch, "--dry-run")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("memory plan for micro-batch " + batch, r.stdout)
            self.assertFalse(os.path.exists(os.path.join(out, "metrics.jsonl")))  # nothing trained
            peak = re.search(r"^peak: ([0-9.]+) MiB", r.stdout, re.M)
            self.assertTrue(peak, r.stdout)
            predicted = float(peak.group(1))
            # One real epoch: the measured peak of live tensors, printed at the end.
            r = self.train(out, "--model", model, "--batch-size", batch)
            self.assertEqual(r.returncode, 0, r.stderr)
            measured = int(re.search(r"peak tensor memory: (\d+) bytes", r.stderr).group(1)) / 2**20
            print("%s batch %s: predicted %.1f MiB, measured %.1f MiB" % (model, batch, predicted, measured))
            self.assertLess(abs(predicted - measured), 0.15 * measured)

    def test_batch_size_auto_fills_the_budget(self):
        out = os.path.join(self.tmp, "auto")
        r = self.train(out, "--model", "small", "--batch-size", "auto", "--global-batch", "64",
                       "--memory-budget", "24M")
        self.assertEqual(r.returncode, 0, r.stderr)
        m = re.search(r"--batch-size auto micro_batch=(\d+) planned=(\d+) real_steps=(\d+) batch_size=64 "
                      r"accumulate=(\d+)", r.stderr)
        self.assertTrue(m, r.stderr)
        micro, accumulate = int(m.group(1)), int(m.group(4))
        self.assertEqual(accumulate, -(-64 // micro))
        # The last real step tried one more sample and did not fit; the chosen size did.
        self.assertIn("micro_batch=%d fits=yes" % micro, r.stderr)
        self.assertIn("micro_batch=%d fits=no" % (micro + 1), r.stderr)
        measured = int(re.search(r"peak tensor memory: (\d+) bytes", r.stderr).group(1))
        self.assertLessEqual(measured, 24 * 2**20)
        self.assertNotIn("out of memory in a step", r.stderr)  # auto's choice never needed recovery
        # A resume with more memory takes the run's batch and split, not a new timing (which would
        # give a larger micro-batch: other batch statistics, not the run it continues).
        r = self.train(out, "--model", "small", "--batch-size", "auto", "--global-batch", "64",
                       "--memory-budget", "96M", "--resume", epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--batch-size auto: the resumed run's batch_size=64 accumulate=%d" % accumulate, r.stderr)
        self.assertNotIn("real step", r.stderr)
        # Without --global-batch too (the timed batch was refused as another --batch-size).
        out2 = os.path.join(self.tmp, "auto2")
        r = self.train(out2, "--model", "small", "--batch-size", "auto", "--memory-budget", "24M")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = self.train(out2, "--model", "small", "--batch-size", "auto", "--memory-budget", "96M", "--resume",
                       epochs=2)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("--batch-size auto: the resumed run's", r.stderr)

    def test_checkpoint_activations_lowers_the_plan(self):
        peaks = {}
        for mode in ("none", "stage"):
            r = self.train(os.path.join(self.tmp, "ck-" + mode), "--model", "resnet18", "--batch-size", "16",
                           "--checkpoint-activations", mode, "--dry-run")
            self.assertEqual(r.returncode, 0, r.stderr)
            peaks[mode] = float(re.search(r"^total: .* saved activations ([0-9.]+)", r.stdout, re.M).group(1))
        self.assertLess(peaks["stage"], 0.6 * peaks["none"])
        r = self.train(os.path.join(self.tmp, "ck-bad"), "--checkpoint-activations", "often", "--dry-run")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("not one of none, stage, block", r.stderr)


class TestOomRecovery(Base):
    def test_batch_32_under_a_budget_for_8_gives_the_weights_of_4_micro_batches(self):
        # The budget: the dry-run's step bytes at micro-batch 8, plus a quarter.
        r = self.train(os.path.join(self.tmp, "p8"), "--model", "small", "--batch-size", "8", "--dry-run")
        self.assertEqual(r.returncode, 0, r.stderr)
        peak8 = float(re.search(r"^peak: ([0-9.]+) MiB", r.stdout, re.M).group(1))
        r = self.train(os.path.join(self.tmp, "p32"), "--model", "small", "--batch-size", "32", "--dry-run")
        peak32 = float(re.search(r"^peak: ([0-9.]+) MiB", r.stdout, re.M).group(1))
        budget = "%dK" % int(peak8 * 1.25 * 1024)
        self.assertGreater(peak32, 2 * peak8 * 1.25)  # 32 (and 16) cannot fit

        # --memory-strategy off: the step as asked, so the out-of-memory recovery in the step is what
        # fits it (auto would split it before the first step: the next test).
        tight = os.path.join(self.tmp, "tight")
        r = self.train(tight, "--model", "small", "--batch-size", "32", "--memory-budget", budget,
                       "--memory-strategy", "off")
        self.assertEqual(r.returncode, 0, r.stderr)
        warnings = [l for l in r.stderr.splitlines() if "out of memory in a step" in l]
        self.assertEqual(len(warnings), 1, r.stderr)  # logged once, with the new sizes
        self.assertIn("micro_batch_before=32 micro_batch_now=8", warnings[0])
        self.assertIn("accumulate_before=1 accumulate_now=4", warnings[0])
        self.assertIn("reruns=2", warnings[0])
        self.assertIn("RESOURCE_EXHAUSTED", warnings[0])
        measured = int(re.search(r"peak tensor memory: (\d+) bytes", r.stderr).group(1))
        self.assertLessEqual(measured, int(budget[:-1]) * 1024)

        # Without a budget, 4 micro-batches of 8 asked for: the same split, the same update; the
        # discarded tries left nothing behind (batch norm's running statistics included).
        four = os.path.join(self.tmp, "four")
        r = self.train(four, "--model", "small", "--batch-size", "32", "--accumulate", "4")
        self.assertEqual(r.returncode, 0, r.stderr)
        a = read_safetensors(os.path.join(tight, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        b = read_safetensors(os.path.join(four, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        self.assertEqual(sorted(a), sorted(b))
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)

        # Against one micro-batch of 32 the difference is batch norm's per-micro-batch statistics:
        # bounded, and far from zero only because of them (libtrain_memory shows exact equality
        # without batch norm).
        one = os.path.join(self.tmp, "one")
        r = self.train(one, "--model", "small", "--batch-size", "32")
        self.assertEqual(r.returncode, 0, r.stderr)
        c = read_safetensors(os.path.join(one, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        worst = max(float(np.abs(a[k] - c[k]).max() / max(1e-3, np.abs(c[k]).max())) for k in c
                    if "running" not in k)
        print("batch norm: largest relative weight difference, 8x4 against 32x1, one epoch: %.3g" % worst)
        self.assertLess(worst, 0.25)

        # --memory-strategy auto (the default): the planner splits the step before it runs (the small
        # CNN has no stages or blocks to checkpoint, so micro-batching is the only candidate): no
        # step runs out of memory, and the weights are the explicit --accumulate 4 run's, bit for bit.
        auto = os.path.join(self.tmp, "auto")
        r = self.train(auto, "--model", "small", "--batch-size", "32", "--memory-budget", budget)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn("out of memory", r.stderr)
        self.assertRegex(r.stderr, r"memory strategy chosen=micro-batch micro_batch=8 accumulate=4")
        measured = int(re.search(r"peak tensor memory: (\d+) bytes", r.stderr).group(1))
        self.assertLessEqual(measured, int(budget[:-1]) * 1024)
        d = read_safetensors(os.path.join(auto, "checkpoints", "epoch-1-step-0", "model.safetensors"))
        for k in b:
            np.testing.assert_array_equal(d[k], b[k], err_msg=k)
        with open(os.path.join(auto, "checkpoints", "epoch-1-step-0", "state.json")) as f:
            self.assertEqual(json.load(f)["memory"], {"strategy": "micro-batch", "segments": "none", "accumulate": 4,
                                                   "ranks": 1})
        # A damaged memory record is refused on --resume, naming the file and field; nothing changes.
        state_file = os.path.join(auto, "checkpoints", "epoch-1-step-0", "state.json")
        with open(state_file) as f:
            record = json.load(f)
        for bad, field in (({"strategy": "teleport", "segments": "none", "accumulate": 4, "ranks": 1},
                            "memory.strategy"),
                           ({"strategy": "micro-batch", "segments": "none", "accumulate": 0, "ranks": 1},
                            "memory.accumulate"),
                           ("micro-batch", "memory")):
            record["memory"] = bad
            with open(state_file, "w") as f:
                json.dump(record, f)
            before = {n: open(os.path.join(auto, "checkpoints", "epoch-1-step-0", n), "rb").read()
                      for n in os.listdir(os.path.join(auto, "checkpoints", "epoch-1-step-0"))}
            r = self.train(auto, "--model", "small", "--batch-size", "32", "--memory-budget", budget, "--resume")
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("DATA_LOSS", r.stderr)
            self.assertIn(state_file + ": field '" + field + "'", r.stderr)
            self.assertEqual(before, {n: open(os.path.join(auto, "checkpoints", "epoch-1-step-0", n), "rb").read()
                                      for n in os.listdir(os.path.join(auto, "checkpoints", "epoch-1-step-0"))})
        # The dry run shows the weighing.
        r = self.train(os.path.join(self.tmp, "auto-plan"), "--model", "small", "--batch-size", "32",
                       "--memory-budget", budget, "--dry-run")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("memory strategy: a step of 32 samples, micro-batch 32 asked for", r.stdout)
        self.assertRegex(r.stdout, r"micro-batch +8 +4 .*<- chosen")
        self.assertIn("memory plan for micro-batch 8", r.stdout)

    def test_offload_strategy_on_the_cpu_is_refused(self):
        r = self.train(os.path.join(self.tmp, "off-cpu"), "--model", "small", "--memory-strategy", "offload")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--memory-strategy offload moves activations from a device to host memory", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "off-cpu", "checkpoints")))
        r = self.train(os.path.join(self.tmp, "mixed"), "--model", "small", "--memory-strategy", "micro-batch",
                       "--checkpoint-activations", "2")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("the option names another mechanism", r.stderr)

    def test_no_split_left_is_a_clear_error(self):
        r = self.train(os.path.join(self.tmp, "tiny"), "--model", "small", "--batch-size", "4",
                       "--memory-budget", "600K")
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("RESOURCE_EXHAUSTED", r.stderr)


class TestSweep(Base):
    TILE_PX = "32"

    def sweep(self, out, grid):
        return subprocess.Popen([TRAIN, "sweep", "--grid", grid, "--out", out, "--parallel", "2", "--",
                                 "--data", self.store, "--epochs", "1", "--threads", "1", "--no-augment",
                                 "--batch-size", "32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def test_killed_and_out_of_memory_trials_fail_alone_and_a_rerun_finishes_them(self):
        out = os.path.join(self.tmp, "sweep")
        grid = os.path.join(self.tmp, "trials.csv")
        with open(grid, "w") as f:
            f.write("lr,width,memory-budget\n0.05,8,\n0.1,8,\n0.05,4,20K\n0.1,4,\n")
        p = self.sweep(out, grid)
        # SIGKILL trial t003 as soon as it runs (its pid file appears when it starts).
        pid_file = os.path.join(out, "trials", "t003", "pid")
        deadline = time.time() + 120
        while not os.path.exists(pid_file) and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        self.assertTrue(os.path.exists(pid_file), "trial t003 never started")
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        _, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 3, err)  # finished with some trials failed
        with open(os.path.join(out, "results.json")) as f:
            results = json.load(f)
        status = {t["trial"]: t for t in results["trials"]}
        self.assertEqual(status["t000"]["status"], "ok", status)
        self.assertEqual(status["t001"]["status"], "ok", status)
        self.assertEqual(status["t002"]["status"], "failed")
        self.assertTrue(status["t002"]["reason"].startswith("out of memory: RESOURCE_EXHAUSTED"), status["t002"])
        self.assertEqual(status["t003"]["status"], "failed")
        self.assertEqual(status["t003"]["reason"], "killed by signal SIGKILL")
        self.assertIn(results["best"], ("t000", "t001"))
        self.assertGreater(status[results["best"]]["best_val_balanced_accuracy"], 0.34)
        with open(os.path.join(out, "results.csv")) as f:
            rows = f.read().splitlines()
        self.assertEqual(rows[0], "trial,lr,width,memory-budget,status,reason,best_val_balanced_accuracy,seconds")
        self.assertEqual(len(rows), 5)
        done = {t: os.path.getmtime(os.path.join(out, "trials", t, "result.json")) for t in ("t000", "t001")}

        # The rerun: only t002 and t003; t003 completes, t002 runs out of memory again.
        p = self.sweep(out, grid)
        _, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 3, err)
        self.assertIn("to_run=2", err)
        self.assertIn("already_done=2", err)
        for t, mtime in done.items():
            self.assertEqual(os.path.getmtime(os.path.join(out, "trials", t, "result.json")), mtime)
        with open(os.path.join(out, "results.json")) as f:
            status = {t["trial"]: t for t in json.load(f)["trials"]}
        self.assertEqual(status["t003"]["status"], "ok", status["t003"])
        self.assertEqual(status["t002"]["status"], "failed")
        with open(os.path.join(out, "trials", "t003", "metrics.jsonl")) as f:
            self.assertEqual(len(f.read().splitlines()), 1)
        with open(os.path.join(out, "trials", "t001", "result.json")) as f:
            self.assertIn("--lr", json.load(f)["args"])  # what the trial ran with

        # The grid changed under a finished trial (t001: lr 0.1 -> 0.2): its numbers are not the new
        # settings', so the rerun is refused before any trial starts, naming both.
        with open(grid, "w") as f:
            f.write("lr,width,memory-budget\n0.05,8,\n0.2,8,\n0.05,4,20K\n0.1,4,\n")
        p = self.sweep(out, grid)
        _, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 2, err)
        self.assertIn("t001 ran with other options", err)
        self.assertIn("--lr 0.1 --width 8", err)
        self.assertIn("--lr 0.2 --width 8", err)
        self.assertNotIn("trial started", err)

    def test_signals_reach_each_trial_once_and_trials_stop_with_the_sweep(self):
        """A terminal's Ctrl-C (SIGINT to the sweep's whole process group) reaches the trials once,
        through the sweep: each checkpoints and exits 130. A SIGKILLed sweep's trials get SIGHUP
        (PR_SET_PDEATHSIG; the kernel sends it once per reparenting, twice here), checkpoint and
        stop instead of running on unwatched."""
        grid = os.path.join(self.tmp, "long.csv")
        with open(grid, "w") as f:
            f.write("lr\n0.05\n0.1\n")
        out = os.path.join(self.tmp, "signals")

        def start():
            return subprocess.Popen([TRAIN, "sweep", "--grid", grid, "--out", out, "--parallel", "2", "--",
                                     "--data", self.store, "--epochs", "500", "--threads", "1", "--no-augment",
                                     "--batch-size", "32", "--width", "4"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)

        def epochs():
            n = []
            for t in ("t000", "t001"):
                m = os.path.join(out, "trials", t, "metrics.jsonl")
                n.append(len(open(m).read().splitlines()) if os.path.exists(m) else 0)
            return n

        def wait_for_training(p):
            # Both trials one epoch further (a line of metrics.jsonl), so both are training.
            since = epochs()
            deadline = time.time() + 120
            while time.time() < deadline and p.poll() is None:
                if all(k > s for k, s in zip(epochs(), since)):
                    return
                time.sleep(0.1)
            self.fail("the trials never trained")

        def trial_pids():
            pids = []
            for t in ("t000", "t001"):
                with open(os.path.join(out, "trials", t, "pid")) as f:
                    pids.append(int(f.read()))
            return pids

        p = start()
        wait_for_training(p)
        pids = trial_pids()
        os.killpg(p.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 130, err)
        self.assertIn("the running trials checkpoint and stop", err)
        with open(os.path.join(out, "results.json")) as f:
            status = {t["trial"]: t for t in json.load(f)["trials"]}
        for t in ("t000", "t001"):
            self.assertEqual(status[t]["reason"], "interrupted (exit 130): rerun the sweep to finish it", status[t])
            with open(os.path.join(out, "trials", t, "log.txt")) as f:
                log = f.read()
            # One signal reached it (a second would have stopped it before its checkpoint).
            self.assertIn("interrupted; checkpoint written", log, log[-2000:])

        # The rerun resumes both; SIGKILL the sweep: its trials are told to stop (SIGHUP) and do.
        p = start()
        wait_for_training(p)
        pids = trial_pids()
        p.kill()
        p.communicate(timeout=60)
        deadline = time.time() + 120
        alive = list(pids)
        def running(q):  # not gone, not a zombie
            try:
                with open("/proc/%d/stat" % q) as f:
                    return f.read().split(") ")[-1][0] != "Z"
            except OSError:
                return False

        while alive and time.time() < deadline:
            alive = [q for q in alive if running(q)]
            time.sleep(0.1)
        self.assertEqual(alive, [], "trials still running after the sweep was killed")
        for t in ("t000", "t001"):
            with open(os.path.join(out, "trials", t, "log.txt")) as f:
                self.assertIn("interrupted; checkpoint written", f.read().split("resumed")[-1])

    def test_grid_quotes_and_comments(self):
        # What each trial ran with (result.json "args"); the trials fail at once (no such store).
        d = os.path.join(self.tmp, "quotes")
        os.makedirs(d)
        toml = os.path.join(d, "g.toml")
        with open(toml, "w") as f:
            f.write('lr = "0.1"  # a comment after a quoted value\nnote = ["a,b", \'c # d\']  # and a list\n')
        csv = os.path.join(d, "g.csv")
        with open(csv, "w") as f:
            f.write('lr,note\n  # an indented comment\n0.1,"say ""hi"", twice"\n0.2,\'x\'\n')
        for grid, want in ((toml, [["--lr", "0.1", "--note", "a,b"], ["--lr", "0.1", "--note", "c # d"]]),
                           (csv, [["--lr", "0.1", "--note", 'say "hi", twice'], ["--lr", "0.2", "--note", "'x'"]])):
            out = grid + ".out"
            r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", out, "--", "--data", os.path.join(d, "none")],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 3, r.stderr)
            for k, args in enumerate(want):
                with open(os.path.join(out, "trials", "t%03d" % k, "result.json")) as f:
                    self.assertEqual(json.load(f)["args"], ["--data", os.path.join(d, "none")] + args)

    def test_devices_spread_the_trials(self):
        # On the cpu backend a trial refuses --device, naming it: which GPU each trial was given.
        grid = os.path.join(self.tmp, "three.csv")
        with open(grid, "w") as f:
            f.write("lr\n0.05\n0.1\n0.2\n")
        out = os.path.join(self.tmp, "devices")
        r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", out, "--parallel", "2", "--devices", "3,5", "--",
                            "--data", self.store, "--epochs", "1"], capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 3, r.stderr)
        with open(os.path.join(out, "results.json")) as f:
            reasons = {t["trial"]: t["reason"] for t in json.load(f)["trials"]}
        self.assertIn("--device 3 is for --backend cuda", reasons["t000"])
        self.assertIn("--device 5 is for --backend cuda", reasons["t001"])
        self.assertRegex(reasons["t002"], "--device [35] is for --backend cuda")
        r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", out + "2", "--devices", "0,1", "--",
                            "--data", self.store, "--device", "1"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--device among the common options and --devices", r.stderr)

    def test_bad_grid_is_a_usage_error(self):
        grid = os.path.join(self.tmp, "bad.toml")
        with open(grid, "w") as f:
            f.write("lr = [0.1, 0.2\n")
        r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", os.path.join(self.tmp, "bad")],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("bad.toml:1", r.stderr)
        # An option both in the grid and among the common options would fail every trial (slide-train
        # refuses a repeated option): a usage error before any starts.
        good = os.path.join(self.tmp, "good.toml")
        with open(good, "w") as f:
            f.write("lr = [0.1, 0.2]\n")
        for common, message in ((["--lr", "0.3"], "--lr is both a common option and a grid option"),
                                (["--memory-budget=1G"], "--memory-budget among the common options and "
                                                          "--trial-memory-budget")):
            r = subprocess.run([TRAIN, "sweep", "--grid", good, "--out", os.path.join(self.tmp, "dup"),
                                "--trial-memory-budget", "2G", "--", "--data", self.store] + common,
                               capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)
        # Found by fuzz_sweep_grid: a product of long lists is refused before it fills memory, and
        # a name left with dashes ("----lr") would not be one option on a trial's command line.
        for name, text, message in (
                ("huge.toml", "lr = [%s]\nwidth = [%s]\n" % (",".join(str(i) for i in range(400)),
                                                                ",".join(str(i) for i in range(300))),
                 "huge.toml:2: the grid spans more than 100000 trials"),
                ("dashes.toml", "----lr = [0.1]\n", "dashes.toml:1: '--lr' is not an option name")):
            grid = os.path.join(self.tmp, name)
            with open(grid, "w") as f:
                f.write(text)
            r = subprocess.run([TRAIN, "sweep", "--grid", grid, "--out", os.path.join(self.tmp, name + ".out")],
                               capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)

    def test_toml_grid_is_a_product(self):
        grid = os.path.join(self.tmp, "grid.toml")
        with open(grid, "w") as f:
            f.write("# two learning rates x two widths\nlr = [0.05, 0.1]\nwidth = [4, 8]\nnesterov = true\n")
        out = os.path.join(self.tmp, "product")
        p = self.sweep(out, grid)
        _, err = p.communicate(timeout=300)
        self.assertEqual(p.returncode, 0, err)
        with open(os.path.join(out, "results.json")) as f:
            trials = json.load(f)["trials"]
        self.assertEqual([(t["options"]["lr"], t["options"]["width"]) for t in trials],
                         [("0.05", "4"), ("0.05", "8"), ("0.1", "4"), ("0.1", "8")])
        self.assertTrue(all(t["status"] == "ok" for t in trials))


if __name__ == "__main__":
    import sys
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:], verbosity=2)
