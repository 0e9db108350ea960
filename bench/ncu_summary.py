"""Per-kernel GPU time from an Nsight Compute CSV log (ncu --metrics gpu__time_duration.sum --csv
--log-file F ...): kernels grouped by name, their total time, count and share of the whole, the
largest first. For scripts/device-run.sh's profile steps: where a training step's or an embedding
batch's GPU time goes (cuDNN's convolutions, cuBLAS's GEMMs, our own kernels).

usage: ncu_summary.py NCU.csv [--top 25]
"""
import argparse
import collections
import csv
import io

UNITS = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0, "s": 1.0}

ap = argparse.ArgumentParser()
ap.add_argument("log")
ap.add_argument("--top", type=int, default=25)
a = ap.parse_args()
with open(a.log, newline="") as f:
    lines = f.read().splitlines()
# ncu writes its own "==PROF==" lines and the program's output around the CSV: start at its header.
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    raise SystemExit("%s: no CSV header (\"ID\",...) found" % a.log)
rows = csv.DictReader(io.StringIO("\n".join(l for l in lines[start:] if l.startswith('"'))))
total = collections.defaultdict(float)
count = collections.Counter()
for r in rows:
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    seconds = float(r["Metric Value"].replace(",", "")) * UNITS.get(r.get("Metric Unit", "nsecond"), 1e-9)
    name = r["Kernel Name"]
    name = name[:100] + "..." if len(name) > 100 else name
    total[name] += seconds
    count[name] += 1
whole = sum(total.values())
print("kernels: %d launches, %d distinct, %.2f ms of GPU time" % (sum(count.values()), len(total), whole * 1e3))
for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:a.top]:
    print("%8.3f ms %5.1f%% %5dx  %s" % (t * 1e3, 100 * t / whole if whole else 0, count[name], name))
