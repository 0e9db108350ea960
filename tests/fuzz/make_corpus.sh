#!/usr/bin/env bash
# Remakes the seed corpora under tests/fuzz/corpus/ from the repository's own files: three small
# stores made by slide-tile from sample_data/ (their data.mdb, slide records, tile records and a
# text dump for fuzz_store_meta), safetensors files written by tests/e2e/safetensors_io.py, and
# hand-written CSV lines, manifests and slide ids. Needs a built slide-tile (BUILD_DIR, default
# build) and python3 with lmdb and numpy (Debian: python3-lmdb python3-numpy).
#   tests/fuzz/make_corpus.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
tile="$root/${BUILD_DIR:-build}/apps/slide-tile"
py=${PYTHON:-/usr/bin/python3}
corpus="$here/corpus"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
slides="$root/sample_data/slides"
"$tile" -q -o s_raw --tile-size 8 --encoding raw --max-tiles-per-slide 3 --min-tissue 0 --source-mpp 1 --mpp 8 \
  "$slides/boxes.tiff"
"$tile" -q -o s_jpeg --tile-size 16 --max-tiles-per-slide 2 --min-tissue 0 --mpp 8 --jpeg-quality 30 --source-mpp 1 \
  "$slides/CMU-1-Small-Region.svs" "$slides/boxes.tiff"
"$tile" -q -o s_patch --patches "$root/sample_data/patches/kather2016-samples" --max-tiles-per-slide 1 --tile-size 8

for t in fuzz_tile_record fuzz_slide_record fuzz_csv fuzz_file_stem fuzz_store_meta fuzz_store_mdb fuzz_manifest \
  fuzz_safetensors; do
  rm -rf "${corpus:?}/$t"
  mkdir -p "$corpus/$t"
done
cp s_raw/data.mdb "$corpus/fuzz_store_mdb/raw_boxes.mdb"
cp s_jpeg/data.mdb "$corpus/fuzz_store_mdb/jpeg_two_slides.mdb"
"$py" - "$corpus" "$root/" <<'PY'
import sys
import lmdb
corpus, root = sys.argv[1], sys.argv[2].encode()
for name in ["s_raw", "s_jpeg", "s_patch"]:
    env = lmdb.open(name, readonly=True, lock=False, max_dbs=4)
    dbs = {n: env.open_db(n.encode(), create=False) for n in ["meta", "slides", "tiles"]}
    lines = []
    with env.begin() as txn:
        for k, v in txn.cursor(dbs["meta"]):
            lines.append(b"M" + k + b"=" + v.replace(root, b""))
        for i, (k, v) in enumerate(txn.cursor(dbs["slides"])):
            if i > 2:
                break
            v = v.replace(root, b"")
            lines.append(b"S" + k + b"=" + v)
            if i < 2:
                open(f"{corpus}/fuzz_slide_record/{name}_{i}.json", "wb").write(v)
        for i, (k, v) in enumerate(txn.cursor(dbs["tiles"])):
            if i < 2 and len(v) < 4096:
                open(f"{corpus}/fuzz_tile_record/{name}_{i}.bin", "wb").write(v)
            if i < 3 and len(v) < 700 and b"\n" not in v:
                lines.append(b"T" + v)
    open(f"{corpus}/fuzz_store_meta/{name}.txt", "wb").write(b"\n".join(lines) + b"\n")
PY
"$py" - "$corpus/fuzz_safetensors" "$root/tests/e2e" <<'PY'
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np
import safetensors_io as s
d = sys.argv[1]
s.write_safetensors(f"{d}/four.safetensors", {"w": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.ones(3, np.float32), "step": np.array([7], np.int32), "m": np.array([0.5, -2.0])})
s.write_safetensors(f"{d}/reordered_extra.safetensors", {"m": np.array([1.0, 2.0]),
    "extra": np.zeros((2, 2), np.float32), "step": np.array([1], np.int32), "b": np.zeros(3, np.float32),
    "w": np.full((2, 3), -1, np.float32)})
s.write_safetensors(f"{d}/wrong_shape.safetensors", {"w": np.zeros((3, 2), np.float32), "b": np.ones(3, np.float32)})
PY
c="$corpus"
printf 'slide_id,file,num_tiles,feature_dim,dtype,label\nCMU-1-Small-Region,CMU-1-Small-Region.h5,12,512,float16,tumor\nboxes,boxes.h5,3,512,float32,\n"a,b ""quoted""",a_b~0123456789ab.h5,0,8,float32,"normal"\n' >"$c/fuzz_manifest/bags.csv"
printf '\xef\xbb\xbfslide_id,file,num_tiles,feature_dim,dtype\r\n# a comment\r\n\r\nx,x.h5,1,2,float16\r\n' >"$c/fuzz_manifest/bom_crlf.csv"
printf 'slide_id,path,label\n' >"$c/fuzz_csv/header.csv"
printf '"a,b ""quoted""", plain ,\t,"#x",\xef\xbb\xbf' >"$c/fuzz_csv/quoted.csv"
printf '\xef\xbb\xbfTCGA-A1-0001.svs,slides/TCGA A1.svs,tumor\r' >"$c/fuzz_csv/bom_crlf.csv"
printf '# comment, with comma' >"$c/fuzz_csv/comment.csv"
printf 'TCGA-CR-7395-01A-01-TS1.svs' >"$c/fuzz_file_stem/tcga.txt"
printf '../../etc/passwd' >"$c/fuzz_file_stem/dotdot.txt"
printf '\xc3\xa9chantillon \xe6\x97\xa5\xe6\x9c\xac/x\n' >"$c/fuzz_file_stem/utf8.txt"
du -sh "$corpus"
