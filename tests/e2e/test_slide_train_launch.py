#!/usr/bin/python3
"""End-to-end tests of `slide-train --gpus N` on the CPU backend (run by ctest, one class per test,
label dist): the launcher starts N ranks itself, without MPI, joined over Unix sockets (the "socket"
communicator); on host backends --gpus N means N CPU ranks.

The same equivalences as test_slide_train_dist.py's under mpirun (P ranks == one rank with P
micro-batches), and the launcher's own promises: a killed rank takes the job down within the
deadline and the exit code and last line name it; a stopped rank times the others out; a Ctrl-C
at the terminal reaches only the launcher, which passes it on once, so the ranks stop after the
same step with one checkpoint; every case resumes to the uninterrupted run's weights, bit for bit.

Environment: SLIDE_TILE, SLIDE_TRAIN (the binaries), SLIDE_SAMPLE_DIR (sample_data/).
"""
import os
import signal
import subprocess
import sys
import time
import unittest

import test_slide_train_dist as dist
from test_slide_train_dist import ENV, params

TRAIN = os.environ["SLIDE_TRAIN"]


def launched_pids(launcher_pid):
    """{rank: pid} of the ranks the launcher started (its children carry SLIDE_LAUNCH_RANK)."""
    return dist.rank_pids(launcher_pid, b"SLIDE_LAUNCH_RANK")


class Launched(dist.Base):
    """Base with `ranks` > 0 meaning slide-train --gpus ranks instead of mpirun -np ranks."""

    def train(self, ranks, out, batch, epochs, *extra, timeout=300):
        cmd = self.args(out, batch, epochs, *extra)
        if ranks > 0:
            cmd += ["--gpus", str(ranks)]
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)

    def start(self, ranks, out, batch, epochs, *extra):
        # Its own session: a signal to its process group is what a terminal's Ctrl-C sends.
        return subprocess.Popen(self.args(out, batch, epochs, *extra) + ["--gpus", str(ranks)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                                start_new_session=True)

    def pids(self, p, ranks):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = launched_pids(p.pid)
            if len(pids) == ranks:
                return pids
            time.sleep(0.01)
        self.fail("the launcher's %d ranks were not found" % ranks)


class TestLaunchEquivalence(Launched):
    check = dist.TestEquivalence.check

    def test_two_ranks_odd_batch_equal_one_rank_with_two_micro_batches(self):
        # B = 5 over 2 ranks: 2 + 3 samples per step; 33 tiles: the last step has 3.
        self.check(2, 5, ["--accumulate", "2"], [])

    def test_three_ranks_oversubscribed_uneven_split(self):
        # B = 7 over 3 ranks: 2 + 2 + 3.
        self.check(3, 7, ["--accumulate", "3"], [])

    def test_usage_errors(self):
        out = os.path.join(self.tmp, "usage")
        for extra, message in ((["--gpus", "2", "--dist", "mpi"], "--gpus with --dist mpi"),
                               (["--gpus", "2", "--device", "0"], "--device is for one process"),
                               (["--gpus", "0"], "--gpus")):
            r = subprocess.run(self.args(out, 5, 1) + extra, capture_output=True, text=True, env=ENV)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)
            self.assertFalse(os.path.exists(os.path.join(out, "checkpoints")))
        r = subprocess.run(self.args(out, 5, 1, "--dist", "socket"), capture_output=True, text=True, env=ENV)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--dist socket is for the ranks that slide-train --gpus N starts", r.stderr)


class TestLaunchFailure(Launched):
    def test_a_killed_rank_takes_the_job_down_named_and_a_resume_is_exact(self):
        # 10 epochs, the kill after the second: the job must still be running when the test, slowed
        # like the ranks on a loaded machine, has found their pids (with 4 it could end first).
        ref = os.path.join(self.tmp, "ref_kill")
        r = self.train(2, ref, 5, 10)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp, "killed")
        p = self.start(2, out, 5, 10, "--dist-timeout", "20")
        self.wait_for(os.path.join(out, "checkpoints", "epoch-2-step-0"))
        pids = self.pids(p, 2)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        self.assertLess(time.monotonic() - t0, 25)
        # The exit code is the killed rank's (128 + SIGKILL), and the last line names it.
        self.assertEqual(p.returncode, 128 + signal.SIGKILL, err)
        self.assertIn("rank 1 (pid %d) was killed by SIGKILL; stopping the other ranks" % pids[1], err)
        self.assertIn("rank 1 failed (killed by SIGKILL); the other ranks were stopped", err.strip().splitlines()[-1])
        # Rank 0 saw its peer go at once (not at the deadline).
        self.assertRegex(err, r"rank 0: .*rank 1 closed its connection")
        for pid in pids.values():
            with self.assertRaises(ProcessLookupError):
                os.kill(pid, 0)
        r = self.train(2, out, 5, 10, "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_close(params(ref, 10), params(out, 10), rtol=0, atol=0)

    def test_a_stopped_rank_times_out_the_others_within_the_deadline(self):
        out = os.path.join(self.tmp, "stopped")
        p = self.start(2, out, 5, 6, "--dist-timeout", "4")
        self.wait_for(os.path.join(out, "checkpoints", "epoch-1-step-0"))
        pids = self.pids(p, 2)
        took, err = dist.hang_rank(p, pids, 1)  # hung, not dead: its socket stays open
        # Rank 0 times out after 4 s; the launcher stops rank 1 (SIGTERM, then SIGKILL 4 s later).
        self.assertLess(took, 30)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(err, r"rank 0 of 2 at step \d+: .* did not complete within 4 s \(--dist-timeout\) "
                              r"waiting for rank 1")
        self.assertIn("rank 0 failed (exit code 1)", err)

    def test_ctrl_c_reaches_the_launcher_once_and_resume_is_exact(self):
        # Enough epochs that the job still runs when the test has seen epoch 3's checkpoint and the
        # ranks' pids: 40 of the plain build's; 12 of a sanitizer build's, each epoch there several
        # times slower (ThreadSanitizer's run of this test: 31 s with 40, most of it the reference
        # and resumed runs' epochs after the interrupt point).
        epochs = 12 if os.environ.get("SLIDE_E2E_SANITIZED") else 40
        ref = os.path.join(self.tmp, "ref_int")
        r = self.train(2, ref, 4, epochs)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = os.path.join(self.tmp, "interrupted")
        p = self.start(2, out, 4, epochs)
        self.wait_for(os.path.join(out, "checkpoints", "epoch-3-step-0"))
        self.pids(p, 2)
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C: the launcher's group only
        _, err = p.communicate(timeout=60)
        self.assertEqual(p.returncode, 130, err)
        self.assertEqual(err.count("interrupted; checkpoint written"), 1, err)  # rank 0 alone writes and logs
        self.assertNotIn("epoch-%d-step-0" % epochs, os.listdir(os.path.join(out, "checkpoints")))
        r = self.train(2, out, 4, epochs, "--resume")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assert_close(params(ref, epochs), params(out, epochs), rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + sys.argv[1:])
