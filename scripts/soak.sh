#!/usr/bin/env bash
# Soak run of the three tools with random SIGKILLs and reruns (scripts/soak.py has the details):
#   scripts/soak.sh [--slide PATH] [--copies 20] [--kills 5] [--work DIR] [--seed 1] [--build build]
# Not part of CI. Debian's /usr/bin/python3 (its python3-lmdb, python3-h5py, python3-numpy).
set -euo pipefail
exec /usr/bin/python3 "$(dirname "$0")/soak.py" "$@"
