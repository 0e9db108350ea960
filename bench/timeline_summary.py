#!/usr/bin/python3
"""Summarises slide-train --dist-timeline (the gradient all-reduce's timeline per step): for the
steps from --from-step on, the median time (ms since the step's last micro-batch began) at which
backward ended (wait_start), each bucket's all-reduce started and was seen complete, and the step
ended; the exposed communication (step end - backward end) per step; then the full timeline of
the step with the median exposed time, bucket events against backward's layers.

usage: bench/timeline_summary.py TIMELINE.csv [--from-step N]
"""
import argparse
import csv
import statistics
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline")
    ap.add_argument("--from-step", type=int, default=1)
    a = ap.parse_args()
    steps = defaultdict(list)
    with open(a.timeline) as f:
        for r in csv.DictReader(f):
            if int(r["step"]) >= a.from_step:
                steps[int(r["step"])].append(r)
    if not steps:
        raise SystemExit("%s: no steps from %d on" % (a.timeline, a.from_step))

    def at(ev, kind, bucket=None):
        for r in ev:
            if r["event"] == kind and (bucket is None or r["bucket"] == str(bucket)):
                return float(r["t_ms"])
        return None

    buckets = sorted({int(r["bucket"]) for ev in steps.values() for r in ev if r["bucket"]})
    exposed = {s: at(ev, "step_end") - at(ev, "wait_start") for s, ev in steps.items()}
    med = statistics.median
    print("%d steps (from step %d): median ms since the step's last micro-batch began" % (len(steps), a.from_step))
    print("  backward ended (wait_start) %8.1f" % med(at(ev, "wait_start") for ev in steps.values()))
    for b in buckets:
        print("  bucket %-3d started %8.1f, seen complete %8.1f" %
              (b, med(at(ev, "bucket_start", b) for ev in steps.values()),
               med(at(ev, "bucket_done", b) for ev in steps.values())))
    print("  step ended                   %8.1f" % med(at(ev, "step_end") for ev in steps.values()))
    print("  exposed (step end - backward end): median %.1f ms, max %.1f ms" %
          (med(exposed.values()), max(exposed.values())))
    s = sorted(exposed, key=exposed.get)[len(exposed) // 2]
    print("step %d (the median exposed time), in full:" % s)
    for r in steps[s]:
        what = r["event"] + (" " + r["bucket"] if r["bucket"] else "") + (" " + r["name"] if r["name"] else "")
        print("  %9.1f ms  %s" % (float(r["t_ms"]), what))


if __name__ == "__main__":
    main()
