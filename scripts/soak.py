#!/usr/bin/python3
"""Soak run (issue 17 item 5; not in CI): the three tools killed (SIGKILL) at random moments and
rerun, over and over, on real data; the final outputs must equal an uninterrupted run's and peak
RSS must stay flat.

Stages, each first run once uninterrupted (the reference), then run again from nothing with KILLS
kills at uniformly random moments of the reference's duration, each followed by a rerun of the
same command (slide-tile and slide-embed resume by themselves; slide-train with --resume, or
--overwrite when no checkpoint was complete yet), and a last rerun to the end:
  train  slide-train on the LC25000 patches in sample_data (tiled first): final weights, bit for bit
  tile   slide-tile on COPIES hard links of SLIDE (default: the sample CMU-1-Small-Region.svs; the
         gigapixel one from ../shared/tools/make-big-slide.sh for a real soak): every tile's header
         and bytes, per slide
  embed  slide-embed of that store with the trained checkpoint as the model: every bag's features
         and coordinates

Prints a table (stage, runs, kills that landed, outputs equal, peak RSS of each run: min, max, and
its anonymous and file-backed parts, sampled every 20 ms from /proc/PID/status) and
writes it as JSON to WORK/soak.json. Exit status 1 when an output differs or a run failed.
  scripts/soak.sh [--slide PATH] [--copies 20] [--kills 5] [--work DIR] [--seed 1] [--build build]
Needs Debian's python3-lmdb, python3-h5py, python3-numpy (scripts/install-deps.sh).
"""
import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import lmdb
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_now(pid):
    """(RssAnon, RssFile) of a live process in MiB, from /proc/PID/status; None once it is gone.
    Anonymous memory is the process's own (heap, stacks); file-backed is mapped files' pages (LMDB's
    memory-mapped store), which the kernel reclaims under pressure."""
    try:
        with open("/proc/%d/status" % pid) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return (int(fields["RssAnon"].split()[0]) / 1024.0, int(fields["RssFile"].split()[0]) / 1024.0)
    except (OSError, KeyError, ValueError):
        return None


def run(cmd, log, kill_after=None):
    """Runs cmd (stderr to log); with kill_after (s), SIGKILLs it then if it still runs. Samples its
    anonymous and file-backed RSS every 20 ms. Returns (exit status as a shell reports it, peak RSS
    MiB (anonymous + file-backed, sampled), killed, seconds, peak anonymous RSS MiB, peak
    file-backed RSS MiB). Not ru_maxrss: Linux keeps the high-water mark of the mm a child had
    before exec, which is this (forked) Python process's, and after the digests have read the stores
    through LMDB's map that is the stores' size (11.9 GB in the 20-copy soak, reported for every
    slide-embed rerun whose own peak was 0.2 GB)."""
    t0 = time.monotonic()
    anon = filed = total = 0.0
    with open(log, "ab") as err:
        err.write(("\n$ " + " ".join(cmd) + "\n").encode())
        err.flush()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        killed = False
        deadline = None if kill_after is None else t0 + kill_after
        while True:
            pid, status, _ = os.wait4(p.pid, os.WNOHANG)
            if pid != 0:
                break
            sample = rss_now(p.pid)
            if sample is not None:
                anon, filed, total = max(anon, sample[0]), max(filed, sample[1]), max(total, sum(sample))
            if deadline is not None and not killed and time.monotonic() >= deadline:
                p.send_signal(signal.SIGKILL)
                killed = True
            time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)
    code = p.returncode if p.returncode >= 0 else 128 - p.returncode
    return code, total, killed and code == 128 + signal.SIGKILL, time.monotonic() - t0, anon, filed


def store_digest(store):
    """{slide_id: SHA-256 over its tiles' records (header and bytes) in order} of a tile store."""
    env = lmdb.open(store, max_dbs=4, readonly=True, lock=False)
    slides, tiles = env.open_db(b"slides", create=False), env.open_db(b"tiles", create=False)
    out = {}
    with env.begin() as txn:
        for key, value in txn.cursor(db=slides):
            rec = json.loads(value)
            h = hashlib.sha256()
            for i in range(rec["first_tile_index"], rec["first_tile_index"] + rec["tile_count"]):
                h.update(txn.get(i.to_bytes(8, "big"), db=tiles))
            out[rec["slide_id"]] = (rec["tile_count"], h.hexdigest())
    env.close()
    return out


def bags_digest(out_dir):
    """{bag file: SHA-256 of its features and coords} of a slide-embed directory."""
    digest = {}
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".h5"):
            continue
        with h5py.File(os.path.join(out_dir, name), "r") as f:
            h = hashlib.sha256()
            h.update(np.ascontiguousarray(f["features"][:]).tobytes())
            h.update(np.ascontiguousarray(f["coords"][:]).tobytes())
            digest[name] = h.hexdigest()
    return digest


def last_checkpoint(out):
    ckpts = os.path.join(out, "checkpoints")
    names = [n for n in os.listdir(ckpts) if re.fullmatch(r"epoch-\d+-step-\d+", n)]
    return sorted(names, key=lambda n: [int(x) for x in n.split("-")[1::2]])[-1]


def checkpoint_digest(out):
    """{the last checkpoint's name: SHA-256 of its model.safetensors} of a slide-train run."""
    last = last_checkpoint(out)
    with open(os.path.join(out, "checkpoints", last, "model.safetensors"), "rb") as f:
        return {last: hashlib.sha256(f.read()).hexdigest()}


def soak_stage(name, make_cmd, rerun_cmd, digest, ref_out, soak_out, kills, rng, log, expect_ok=(0,)):
    """The reference run, then the killed-and-rerun one; returns the stage's row."""
    code, rss, _, seconds, anon, filed = run(make_cmd(ref_out), log)
    if code not in expect_ok:
        sys.exit("soak: %s reference run failed (exit %d); see %s" % (name, code, log))
    rss_runs, anon_runs, file_runs, landed, runs, failures = [rss], [anon], [filed], 0, 1, []
    for k in range(kills):
        code, rss, killed, _, anon, filed = run(rerun_cmd(soak_out), log,
                                                kill_after=rng.uniform(0.05, 0.95) * seconds)
        runs += 1
        rss_runs.append(rss), anon_runs.append(anon), file_runs.append(filed)
        landed += killed
        if not killed and code not in expect_ok:
            failures.append("run %d exit %d" % (runs, code))
    code, rss, _, _, anon, filed = run(rerun_cmd(soak_out), log)
    runs += 1
    rss_runs.append(rss), anon_runs.append(anon), file_runs.append(filed)
    if code not in expect_ok:
        failures.append("last run exit %d" % code)
    want, got = digest(ref_out), digest(soak_out)
    rss_known = [r for r in rss_runs if r == r]
    row = {"stage": name, "runs": runs, "kills_landed": landed, "equal": want == got,
           "items": len(want), "reference_seconds": round(seconds, 2),
           "peak_rss_mib_min": round(min(rss_known), 1), "peak_rss_mib_max": round(max(rss_known), 1),
           "peak_rss_mib_runs": [round(r, 1) for r in rss_runs],
           "peak_anon_mib_runs": [round(r, 1) for r in anon_runs],
           "peak_file_mib_runs": [round(r, 1) for r in file_runs], "failures": failures}
    if want != got:
        row["differ"] = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))[:10]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slide", default=os.path.join(ROOT, "sample_data", "slides", "CMU-1-Small-Region.svs"))
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--work", default=None, help="working directory (default: a new temporary one, removed after)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--epochs", type=int, default=4)
    a = ap.parse_args()
    tile, embed, train = (os.path.join(a.build, "apps", t) for t in ("slide-tile", "slide-embed", "slide-train"))
    work = a.work or tempfile.mkdtemp(prefix="slide_soak_")
    os.makedirs(work, exist_ok=True)
    log = os.path.join(work, "soak.log")
    rng = random.Random(a.seed)
    rows = []

    # train: real patches, killed and resumed; the checkpoint then serves as slide-embed's model.
    patches = os.path.join(ROOT, "sample_data", "patches", "lc25000-lung-subset")
    lc = os.path.join(work, "lc")
    if not os.path.isdir(lc):
        code = run([tile, "--patches", patches, "--tile-size", "64", "-o", lc, "-q"], log)[0]
        if code != 0:
            sys.exit("soak: tiling the patches failed; see " + log)
    train_args = ["--data", lc, "--epochs", str(a.epochs), "--batch-size", "32", "--lr", "0.05", "--width", "8",
                  "--threads", "2", "--seed", "3", "--keep", "100"]

    def train_rerun(out):
        done = os.path.isdir(os.path.join(out, "checkpoints")) and any(
            not n.endswith(".partial") for n in os.listdir(os.path.join(out, "checkpoints")))
        started = os.path.isdir(out) and any(n != "writer.lock" for n in os.listdir(out))
        return [train, "--out", out] + train_args + (["--resume"] if done else ["--overwrite"] if started else [])

    rows.append(soak_stage("train", lambda out: [train, "--out", out] + train_args, train_rerun, checkpoint_digest,
                           os.path.join(work, "train-ref"), os.path.join(work, "train-soak"), a.kills, rng, log))
    model = os.path.join(work, "train-ref", "checkpoints", last_checkpoint(os.path.join(work, "train-ref")))

    # tile: COPIES hard links (distinct slide ids, no extra disk) of one slide.
    slides = os.path.join(work, "slides")
    os.makedirs(slides, exist_ok=True)
    base, ext = os.path.splitext(os.path.basename(a.slide))
    inputs = []
    for i in range(a.copies):
        link = os.path.join(slides, "%s-copy%02d%s" % (base, i, ext))
        if not os.path.exists(link):
            try:
                os.link(a.slide, link)
            except OSError:
                shutil.copyfile(a.slide, link)
        inputs.append(link)
    tile_cmd = lambda out: [tile] + inputs + ["--mpp", "0.5", "-o", out, "-q"]
    rows.append(soak_stage("tile", tile_cmd, tile_cmd, store_digest, os.path.join(work, "tile-ref"),
                           os.path.join(work, "tile-soak"), a.kills, rng, log))

    # embed: the reference store, the trained checkpoint as the model.
    embed_cmd = lambda out: [embed, os.path.join(work, "tile-ref"), "-o", out, "--weights", model, "--threads", "2"]
    rows.append(soak_stage("embed", embed_cmd, embed_cmd, bags_digest, os.path.join(work, "embed-ref"),
                           os.path.join(work, "embed-soak"), a.kills, rng, log))

    print("%-6s %5s %13s %6s %6s %10s %14s %14s %14s" % ("stage", "runs", "kills landed", "equal", "items", "ref s",
                                                        "peak RSS MiB", "of it anon", "file-backed"))
    for r in rows:
        print("%-6s %5d %13d %6s %6d %10.2f %6.1f..%-6.1f %6.1f..%-6.1f %6.1f..%-6.1f%s" % (
            r["stage"], r["runs"], r["kills_landed"], "yes" if r["equal"] else "NO", r["items"],
            r["reference_seconds"], r["peak_rss_mib_min"], r["peak_rss_mib_max"],
            min(r["peak_anon_mib_runs"]), max(r["peak_anon_mib_runs"]),
            min(r["peak_file_mib_runs"]), max(r["peak_file_mib_runs"]),
            ("  " + "; ".join(r["failures"])) if r["failures"] else ""))
    with open(os.path.join(work, "soak.json"), "w") as f:
        json.dump({"slide": a.slide, "copies": a.copies, "kills": a.kills, "seed": a.seed, "stages": rows}, f, indent=2)
    print("log: %s; table: %s" % (log, os.path.join(work, "soak.json")))
    ok = all(r["equal"] and not r["failures"] for r in rows)
    if a.work is None and ok:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
