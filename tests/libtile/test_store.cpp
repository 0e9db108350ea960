// Tests of the LMDB tile store (libtile/src/store.cpp, format in slide/tile/store.h).
//
// LMDB forbids opening one environment twice in a process at the same time, so every test closes
// (destroys) a writer before it reads the same store with a reader or with raw LMDB.
#include <doctest/doctest.h>
#include <lmdb.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "slide/tile/store.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace libtile_test_store {

namespace fs = std::filesystem;
using slide::core::StatusCode;
using namespace slide::tile;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("slidestream_test_store_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::permissions(path, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(path, ec);
  }
  std::string str(const std::string& sub = "") const { return sub.empty() ? path.string() : (path / sub).string(); }
};

// Deterministic pseudo-random bytes (xorshift), distinct per seed.
std::vector<uint8_t> make_payload(uint64_t seed, size_t size) {
  std::vector<uint8_t> out(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<uint8_t>(x);
  }
  return out;
}

StoreMeta test_meta() {
  StoreMeta m;
  m.tile_size_px = 64;
  m.stride_px = 48;
  m.target_mpp_um = 0.4999999999999999;  // needs all 17 digits to round-trip
  m.encoding = TileEncoding::kJpeg;
  m.jpeg_quality = 85;
  m.min_tissue = 0.25;
  m.shard = "1/3";
  m.command_line = "slide-tile --out store a.svs";
  m.label_names = {"normal"};
  return m;
}

TileHeader tile_at(int64_t x, int64_t y, int32_t label = -1) {
  TileHeader h;
  h.x_l0 = x;
  h.y_l0 = y;
  h.width = h.height = 64;
  h.label = label;
  return h;
}

// Adds `n` tiles whose payloads depend on (seed, i), then (if finish) finishes the slide.
void add_slide(StoreWriter& w, const std::string& id, int n, uint64_t seed, bool finish = true) {
  auto idx = w.begin_slide(id);
  REQUIRE(idx.ok());
  for (int i = 0; i < n; ++i)
    REQUIRE(w.add_tile(tile_at(i * 64, seed, -1), make_payload(seed * 1000 + static_cast<uint64_t>(i), 100 + i)).ok());
  if (finish) {
    SlideRecord rec;
    rec.slide_id = id;
    rec.path = "/data/" + id + ".svs";
    rec.vendor = "aperio";
    rec.width_l0 = 1000;
    rec.height_l0 = 800;
    rec.tissue_fraction = 0.375;
    REQUIRE(w.finish_slide(rec).ok());
  }
}

// Every key/value of the three databases, read with raw LMDB, for byte-for-byte comparisons.
using Dump = std::map<std::string, std::vector<std::pair<std::string, std::string>>>;
Dump dump_store(const std::string& dir) {
  Dump out;
  MDB_env* env = nullptr;
  REQUIRE(mdb_env_create(&env) == 0);
  REQUIRE(mdb_env_set_maxdbs(env, 4) == 0);
  REQUIRE(mdb_env_open(env, dir.c_str(), MDB_RDONLY, 0664) == 0);
  MDB_txn* txn = nullptr;
  REQUIRE(mdb_txn_begin(env, nullptr, MDB_RDONLY, &txn) == 0);
  for (const char* name : {"meta", "slides", "tiles"}) {
    MDB_dbi dbi;
    REQUIRE(mdb_dbi_open(txn, name, 0, &dbi) == 0);
    MDB_cursor* cur = nullptr;
    REQUIRE(mdb_cursor_open(txn, dbi, &cur) == 0);
    MDB_val k, v;
    auto& rows = out[name];
    for (int rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
      rows.emplace_back(std::string(static_cast<const char*>(k.mv_data), k.mv_size),
                        std::string(static_cast<const char*>(v.mv_data), v.mv_size));
    mdb_cursor_close(cur);
  }
  mdb_txn_abort(txn);
  mdb_env_close(env);
  return out;
}

size_t last_txnid(const std::string& dir) {
  MDB_env* env = nullptr;
  REQUIRE(mdb_env_create(&env) == 0);
  REQUIRE(mdb_env_set_maxdbs(env, 4) == 0);
  REQUIRE(mdb_env_open(env, dir.c_str(), MDB_RDONLY, 0664) == 0);
  MDB_envinfo info;
  REQUIRE(mdb_env_info(env, &info) == 0);
  mdb_env_close(env);
  return info.me_last_txnid;
}

void raw_put(const std::string& dir, const char* db, const std::string& key, const std::string& value) {
  MDB_env* env = nullptr;
  REQUIRE(mdb_env_create(&env) == 0);
  REQUIRE(mdb_env_set_maxdbs(env, 4) == 0);
  REQUIRE(mdb_env_open(env, dir.c_str(), 0, 0664) == 0);
  MDB_txn* txn = nullptr;
  REQUIRE(mdb_txn_begin(env, nullptr, 0, &txn) == 0);
  MDB_dbi dbi;
  REQUIRE(mdb_dbi_open(txn, db, MDB_CREATE, &dbi) == 0);
  MDB_val k{key.size(), const_cast<char*>(key.data())}, v{value.size(), const_cast<char*>(value.data())};
  REQUIRE(mdb_put(txn, dbi, &k, &v, 0) == 0);
  REQUIRE(mdb_txn_commit(txn) == 0);
  mdb_env_close(env);
}

std::string key_be(uint64_t i) {
  std::string k(8, '\0');
  for (int b = 0; b < 8; ++b) k[static_cast<size_t>(b)] = static_cast<char>(i >> (8 * (7 - b)));
  return k;
}

}  // namespace

TEST_CASE("test_store: tile record round trip and byte layout") {
  TileHeader h;
  h.slide_index = 0x01020304;
  h.label = -1;
  h.x_l0 = 0x1122334455667788ll;
  h.y_l0 = -5;
  h.width = 256;
  h.height = 224;
  h.channels = 3;
  h.encoding = TileEncoding::kRawRgb;
  // A raw payload is exactly width * height * 3 bytes (decode_tile_record checks it).
  std::vector<uint8_t> payload(256 * 224 * 3, 0);
  for (uint8_t i = 0; i < 5; ++i) payload[i] = static_cast<uint8_t>(9 - i);
  std::vector<uint8_t> rec = {0xAA};  // encode appends
  encode_tile_record(h, payload, &rec);
  REQUIRE(rec.size() == 1 + kTileHeaderBytes + payload.size());
  const uint8_t* p = rec.data() + 1;
  CHECK(std::memcmp(p, "SLT1", 4) == 0);
  CHECK(p[4] == 1);  // version, little-endian
  CHECK(p[5] == 0);
  CHECK(p[6] == 48);  // header bytes
  CHECK(p[8] == 0x04);  // slide index LE
  CHECK(p[11] == 0x01);
  CHECK(p[12] == 0xFF);  // label -1
  CHECK(p[15] == 0xFF);
  CHECK(p[16] == 0x88);  // x LE at 16
  CHECK(p[23] == 0x11);
  CHECK(p[24] == 0xFB);  // y = -5
  CHECK(p[32] == 0x00);  // width 256 = 0x100
  CHECK(p[33] == 0x01);
  CHECK(p[36] == 224);
  CHECK(p[40] == 3);
  CHECK(p[41] == 0);  // raw
  CHECK(p[42] == 0);
  CHECK(p[43] == 0);
  CHECK(p[44] == 0x00);  // payload bytes 172032 = 0x2A000, LE
  CHECK(p[45] == 0xA0);
  CHECK(p[46] == 0x02);
  CHECK(p[48] == 9);  // payload at 48
  CHECK(p[52] == 5);

  TileHeader back;
  std::span<const uint8_t> body;
  REQUIRE(decode_tile_record(std::span<const uint8_t>(rec).subspan(1), &back, &body).ok());
  CHECK(back.slide_index == h.slide_index);
  CHECK(back.label == -1);
  CHECK(back.x_l0 == h.x_l0);
  CHECK(back.y_l0 == -5);
  CHECK(back.width == 256);
  CHECK(back.height == 224);
  CHECK(back.channels == 3);
  CHECK(back.encoding == TileEncoding::kRawRgb);
  CHECK(back.payload_bytes == payload.size());
  CHECK(std::vector<uint8_t>(body.begin(), body.end()) == payload);

  // A hand-built header decodes to the documented fields.
  std::vector<uint8_t> hand(kTileHeaderBytes + 2, 0);
  std::memcpy(hand.data(), "SLT1", 4);
  hand[4] = 1;
  hand[6] = 48;
  hand[8] = 7;    // slide 7
  hand[12] = 2;   // label 2
  hand[16] = 0x00;
  hand[17] = 0x04;  // x = 1024
  hand[24] = 0x00;
  hand[25] = 0x08;  // y = 2048
  hand[32] = 64;
  hand[36] = 32;
  hand[40] = 3;
  hand[41] = 1;  // jpeg
  hand[44] = 2;
  hand[48] = 0xFF;
  hand[49] = 0xD8;
  REQUIRE(decode_tile_record(hand, &back, &body).ok());
  CHECK(back.slide_index == 7);
  CHECK(back.label == 2);
  CHECK(back.x_l0 == 1024);
  CHECK(back.y_l0 == 2048);
  CHECK(back.width == 64);
  CHECK(back.height == 32);
  CHECK(back.encoding == TileEncoding::kJpeg);
  REQUIRE(body.size() == 2);
  CHECK(body[0] == 0xFF);
  CHECK(body[1] == 0xD8);
}

TEST_CASE("test_store: corrupt tile records are DataLoss") {
  std::vector<uint8_t> good;
  encode_tile_record(tile_at(1, 2), make_payload(1, 10), &good);
  TileHeader h;
  std::span<const uint8_t> body;
  REQUIRE(decode_tile_record(good, &h, &body).ok());

  auto expect = [&](std::vector<uint8_t> rec, const char* pattern) {
    Status s = decode_tile_record(rec, &h, &body);
    CHECK(s.code() == StatusCode::kDataLoss);
    CHECK_MESSAGE(s.message().find(pattern) != std::string::npos, s.message());
  };
  expect(std::vector<uint8_t>(good.begin(), good.begin() + 47), "shorter");
  expect({}, "shorter");
  auto bad_magic = good;
  bad_magic[3] = '2';
  expect(bad_magic, "magic");
  auto bad_version = good;
  bad_version[4] = 2;
  expect(bad_version, "version");
  auto bad_encoding = good;
  bad_encoding[41] = 7;
  expect(bad_encoding, "encoding");
  auto truncated = good;
  truncated.pop_back();
  expect(truncated, "payload");
  auto longer = good;
  longer.push_back(0);
  expect(longer, "payload");
  // Size fields are checked before anyone allocates from them (issue 20, item 9).
  auto huge = good;
  huge[32] = 0xA0;  // width 100000 = 0x186A0
  huge[33] = 0x86;
  huge[34] = 0x01;
  expect(huge, "100000x64 px");
  auto zero = good;
  zero[36] = 0;  // height 0
  expect(zero, "64x0 px");
  auto channels = good;
  channels[40] = 4;
  expect(channels, "4 channels");
  TileHeader raw = tile_at(0, 0);
  raw.width = raw.height = 4;
  raw.encoding = TileEncoding::kRawRgb;
  std::vector<uint8_t> raw_ok, raw_bad;
  encode_tile_record(raw, make_payload(2, 4 * 4 * 3), &raw_ok);
  CHECK(decode_tile_record(raw_ok, &h, &body).ok());
  encode_tile_record(raw, make_payload(2, 4 * 4 * 3 - 1), &raw_bad);
  expect(raw_bad, "4x4x3 = 48 bytes but its payload is 47 bytes");
}

TEST_CASE("test_store: slide record JSON round trip and errors") {
  SlideRecord r;
  r.index = 3;
  r.slide_id = "case-01 \"quoted\"";
  r.path = "/data/case 01.svs";
  r.source_size_bytes = 123456789012;
  r.source_mtime_ns = 1700000000123456789;
  r.vendor = "aperio";
  r.backend = "openslide";
  r.width_l0 = 98304;
  r.height_l0 = 65536;
  r.source_mpp_um = 0.2527;
  r.mpp_source = "vendor";
  r.level = 1;
  r.downsample = 4.000123;
  r.tile_mpp_um = 1.0108;
  r.tissue_fraction = 0.1234567890123;
  r.candidate_tiles = 5000;
  r.tile_count = 1234;
  r.first_tile_index = 1ull << 40;
  r.label = "tumor";
  r.label_index = 1;
  r.passthrough = true;
  auto back = slide_record_from_json(slide_record_to_json(r));
  REQUIRE(back.ok());
  CHECK(back->index == r.index);
  CHECK(back->slide_id == r.slide_id);
  CHECK(back->path == r.path);
  CHECK(back->source_size_bytes == r.source_size_bytes);
  CHECK(back->source_mtime_ns == r.source_mtime_ns);
  CHECK(back->vendor == r.vendor);
  CHECK(back->backend == r.backend);
  CHECK(back->width_l0 == r.width_l0);
  CHECK(back->height_l0 == r.height_l0);
  CHECK(back->source_mpp_um == r.source_mpp_um);
  CHECK(back->mpp_source == r.mpp_source);
  CHECK(back->level == 1);
  CHECK(back->downsample == r.downsample);
  CHECK(back->tile_mpp_um == r.tile_mpp_um);
  CHECK(back->tissue_fraction == r.tissue_fraction);
  CHECK(back->candidate_tiles == 5000);
  CHECK(back->tile_count == 1234);
  CHECK(back->first_tile_index == r.first_tile_index);
  CHECK(back->label == "tumor");
  CHECK(back->label_index == 1);
  CHECK(back->passthrough);
  CHECK(back->status == "complete");

  for (const char* bad : {"", "{", "[1,2]", "{\"slide_id\":\"a\"}",
                          "{\"index\":-1,\"slide_id\":\"a\",\"tile_count\":1,\"first_tile_index\":0}",
                          "{\"index\":0,\"slide_id\":5,\"tile_count\":1,\"first_tile_index\":0}",
                          "{\"index\":0,\"slide_id\":\"a\",\"tile_count\":\"many\",\"first_tile_index\":0}"}) {
    auto r2 = slide_record_from_json(bad);
    CHECK_MESSAGE(r2.status().code() == StatusCode::kDataLoss, bad);
  }
}

TEST_CASE("test_store: write two slides, read them back") {
  TempDir tmp;
  const std::string dir = tmp.str("nested/store");  // the writer creates missing parents
  StoreWriterOptions opt;
  opt.tiles_per_txn = 3;
  {
    auto w = StoreWriter::open(dir, test_meta(), opt);
    REQUIRE_MESSAGE(w.ok(), w.status().to_string());
    CHECK((*w)->label_index("") == -1);
    CHECK((*w)->label_index("normal") == 0);
    CHECK((*w)->label_index("tumor") == 1);  // new: persisted with the next commit
    add_slide(**w, "a", 7, 1);
    add_slide(**w, "b", 2, 2);
    CHECK((*w)->next_tile_index() == 9);
    CHECK((*w)->next_slide_index() == 2);
    auto dup = (*w)->begin_slide("a");
    CHECK(dup.status().code() == StatusCode::kFailedPrecondition);
    REQUIRE((*w)->close().ok());
  }
  CHECK(fs::exists(dir + "/data.mdb"));
  CHECK(fs::exists(dir + "/lock.mdb"));

  {
  auto r = StoreReader::open(dir);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const StoreReader& rd = **r;
  CHECK(rd.tile_count() == 9);
  const StoreMeta& m = rd.meta();
  CHECK(m.format_version == 1);
  CHECK(m.tile_size_px == 64);
  CHECK(m.stride_px == 48);
  CHECK(m.target_mpp_um == 0.4999999999999999);  // exact: written with round-trip digits
  CHECK(m.encoding == TileEncoding::kJpeg);
  CHECK(m.jpeg_quality == 85);
  CHECK(m.min_tissue == 0.25);
  CHECK(m.shard == "1/3");
  CHECK(m.command_line == "slide-tile --out store a.svs");
  CHECK(m.label_names == std::vector<std::string>{"normal", "tumor"});
  REQUIRE(rd.slides().size() == 2);
  CHECK(rd.slides()[0].slide_id == "a");
  CHECK(rd.slides()[0].index == 0);
  CHECK(rd.slides()[0].first_tile_index == 0);
  CHECK(rd.slides()[0].tile_count == 7);
  CHECK(rd.slides()[0].status == "complete");
  CHECK(rd.slides()[0].path == "/data/a.svs");
  CHECK(rd.slides()[0].tissue_fraction == 0.375);
  CHECK(rd.slides()[1].slide_id == "b");
  CHECK(rd.slides()[1].index == 1);
  CHECK(rd.slides()[1].first_tile_index == 7);
  CHECK(rd.slides()[1].tile_count == 2);
  for (uint64_t i = 0; i < 9; ++i) {
    TileHeader h;
    std::vector<uint8_t> payload;
    REQUIRE(rd.read_tile(i, &h, &payload).ok());
    const uint64_t slide = i < 7 ? 0 : 1, k = i < 7 ? i : i - 7, seed = slide + 1;
    CHECK(h.slide_index == slide);
    CHECK(h.x_l0 == static_cast<int64_t>(k) * 64);
    CHECK(payload == make_payload(seed * 1000 + k, 100 + k));
  }
  TileHeader h;
  std::vector<uint8_t> payload;
  Status missing = rd.read_tile(9, &h, &payload);
  CHECK(missing.code() == StatusCode::kOutOfRange);
  CHECK(missing.message().find(dir) != std::string::npos);
  // Headers only, a range in one transaction: slide b's two tiles.
  std::vector<TileHeader> headers;
  REQUIRE(rd.read_tile_headers(7, 2, &headers).ok());
  REQUIRE(headers.size() == 2);
  for (uint64_t k = 0; k < 2; ++k) {
    CHECK(headers[k].slide_index == 1);
    CHECK(headers[k].x_l0 == static_cast<int64_t>(k) * 64);
    CHECK(headers[k].label == -1);
    CHECK(headers[k].payload_bytes == make_payload(2000 + k, 100 + k).size());
  }
  REQUIRE(rd.read_tile_headers(0, 9, &headers).ok());
  CHECK(headers.size() == 9);
  missing = rd.read_tile_headers(8, 2, &headers);
  CHECK(missing.code() == StatusCode::kOutOfRange);
  CHECK(missing.message().find(dir) != std::string::npos);
  CHECK(rd.read_tile_headers(~uint64_t{0}, 2, &headers).code() == StatusCode::kOutOfRange);  // no wrap-around
  }  // the reader is closed before raw LMDB opens the store

  // Raw layout: keys are 8-byte big-endian and dense; meta strings as documented.
  Dump d = dump_store(dir);
  REQUIRE(d["tiles"].size() == 9);
  for (uint64_t i = 0; i < 9; ++i) CHECK(d["tiles"][i].first == key_be(i));
  std::map<std::string, std::string> meta(d["meta"].begin(), d["meta"].end());
  CHECK(meta["format_version"] == "1");
  CHECK(meta["encoding"] == "jpeg");
  CHECK(meta["label_names"] == "[\"normal\",\"tumor\"]");
  CHECK(std::stod(meta["target_mpp_um"]) == 0.4999999999999999);
  REQUIRE(d["slides"].size() == 2);
  CHECK(d["slides"][0].first == "a");
}

TEST_CASE("test_store: a killed run's partial slide is removed and redone identically") {
  TempDir tmp;
  const std::string killed = tmp.str("killed"), clean = tmp.str("clean");
  StoreWriterOptions opt;
  opt.tiles_per_txn = 3;
  {
    auto w = StoreWriter::open(killed, test_meta(), opt);
    REQUIRE(w.ok());
    add_slide(**w, "a", 6, 1);  // its 6th tile fills a batch: finish_slide commits a whole
    add_slide(**w, "b", 4, 2, /*finish=*/false);  // the 4th add commits b's first 3
    // Destroyed without finish_slide/close: a SIGKILL as far as the store can tell.
  }
  {
    Dump d = dump_store(killed);
    CHECK(d["tiles"].size() == 9);  // a's 6 + b's first 3
    CHECK(d["slides"].size() == 1);
  }
  {
    StoreMeta resumed = test_meta();
    resumed.command_line = "slide-tile --resume";  // the stored command line is kept
    resumed.label_names = {};
    auto w = StoreWriter::open(killed, resumed, opt);
    REQUIRE_MESSAGE(w.ok(), w.status().to_string());
    CHECK((*w)->next_tile_index() == 6);
    CHECK((*w)->next_slide_index() == 1);
    CHECK((*w)->slides().size() == 1);
    CHECK((*w)->slides().count("a") == 1);
    CHECK((*w)->meta().command_line == "slide-tile --out store a.svs");
    CHECK((*w)->meta().label_names == std::vector<std::string>{"normal"});
    (*w).reset();
    Dump d = dump_store(killed);
    CHECK(d["tiles"].size() == 6);  // leftovers deleted at open, before any new tile
  }
  {
    auto w = StoreWriter::open(killed, test_meta(), opt);
    REQUIRE(w.ok());
    add_slide(**w, "b", 4, 2);
    add_slide(**w, "c", 1, 3);
    REQUIRE((*w)->close().ok());
  }
  {
    auto w = StoreWriter::open(clean, test_meta(), opt);
    REQUIRE(w.ok());
    add_slide(**w, "a", 6, 1);
    add_slide(**w, "b", 4, 2);
    add_slide(**w, "c", 1, 3);
    REQUIRE((*w)->close().ok());
  }
  Dump a = dump_store(killed), b = dump_store(clean);
  CHECK(a["tiles"].size() == 11);
  CHECK(a["meta"] == b["meta"]);
  CHECK(a["slides"] == b["slides"]);
  CHECK(a["tiles"] == b["tiles"]);
}

TEST_CASE("test_store: abort_slide deletes committed tiles and the next slide reuses indices") {
  TempDir tmp;
  const std::string dir = tmp.str();
  StoreWriterOptions opt;
  opt.tiles_per_txn = 3;
  {
    auto w = StoreWriter::open(dir, test_meta(), opt);
    REQUIRE(w.ok());
    CHECK((*w)->abort_slide().ok());  // nothing open: a no-op
    add_slide(**w, "a", 2, 1);
    add_slide(**w, "bad", 5, 2, /*finish=*/false);  // tiles 2..5 committed, 6 pending
    REQUIRE((*w)->abort_slide().ok());
    CHECK((*w)->next_tile_index() == 2);
    CHECK((*w)->next_slide_index() == 1);
    CHECK((*w)->slides().count("bad") == 0);
    add_slide(**w, "c", 3, 3);
    REQUIRE((*w)->close().ok());
  }
  auto r = StoreReader::open(dir);
  REQUIRE(r.ok());
  CHECK((*r)->tile_count() == 5);
  REQUIRE((*r)->slides().size() == 2);
  CHECK((*r)->slides()[1].slide_id == "c");
  CHECK((*r)->slides()[1].index == 1);
  CHECK((*r)->slides()[1].first_tile_index == 2);
  for (uint64_t i = 2; i < 5; ++i) {
    TileHeader h;
    std::vector<uint8_t> payload;
    REQUIRE((*r)->read_tile(i, &h, &payload).ok());
    CHECK(h.slide_index == 1);
    CHECK(payload == make_payload(3 * 1000 + (i - 2), 100 + (i - 2)));
  }
}

TEST_CASE("test_store: reopening with different settings is FailedPrecondition") {
  TempDir tmp;
  const std::string dir = tmp.str();
  {
    auto w = StoreWriter::open(dir, test_meta());
    REQUIRE(w.ok());
    add_slide(**w, "a", 1, 1);
    REQUIRE((*w)->close().ok());
  }
  const size_t txn_before = last_txnid(dir);
  {
    // Same settings (mpp within the relative 1e-9 tolerance), different command line: accepted,
    // and nothing is written.
    StoreMeta same = test_meta();
    same.target_mpp_um *= 1 + 1e-12;
    same.command_line = "another";
    auto w = StoreWriter::open(dir, same);
    REQUIRE_MESSAGE(w.ok(), w.status().to_string());
    REQUIRE((*w)->close().ok());
  }
  CHECK(last_txnid(dir) == txn_before);

  StoreMeta other = test_meta();
  other.tile_size_px = 224;
  other.min_tissue = 0.5;
  auto w = StoreWriter::open(dir, other);
  REQUIRE(!w.ok());
  CHECK(w.status().code() == StatusCode::kFailedPrecondition);
  const std::string& msg = w.status().message();
  CHECK_MESSAGE(msg.find("tile_size_px=64, this run asks 224") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("min_tissue=0.25, this run asks 0.5") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("stride_px") == std::string::npos, msg);
  CHECK_MESSAGE(msg.find(dir) != std::string::npos, msg);

  other = test_meta();
  other.encoding = TileEncoding::kRawRgb;
  w = StoreWriter::open(dir, other);
  CHECK(w.status().code() == StatusCode::kFailedPrecondition);
  CHECK(w.status().message().find("encoding=jpeg, this run asks raw") != std::string::npos);

  // A store from a newer format is refused by writer and reader alike.
  raw_put(dir, "meta", "format_version", "2");
  w = StoreWriter::open(dir, test_meta());
  CHECK(w.status().code() == StatusCode::kFailedPrecondition);
  CHECK(w.status().message().find("format version 2") != std::string::npos);
  auto r = StoreReader::open(dir);
  CHECK(r.status().code() == StatusCode::kFailedPrecondition);
}

TEST_CASE("test_store: one writer at a time; readers need no lock") {
  TempDir tmp;
  const std::string dir = tmp.str();
  auto w = StoreWriter::open(dir, test_meta());
  REQUIRE(w.ok());
  add_slide(**w, "a", 3, 1);
  REQUIRE((*w)->flush().ok());
  auto second = StoreWriter::open(dir, test_meta());
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == StatusCode::kUnavailable);
  const std::string msg = second.status().message();
  CHECK_MESSAGE(msg.find("store " + dir + " is being written by another process (pid " +
                         std::to_string(getpid())) != std::string::npos, msg);
  auto r = StoreReader::open(dir);  // beside the writer and its writer.lock
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  CHECK((*r)->tile_count() == 3);
  REQUIRE((*w)->close().ok());  // releases the lock
  auto third = StoreWriter::open(dir, test_meta());
  CHECK_MESSAGE(third.ok(), third.status().to_string());
}

TEST_CASE("test_store: every tile-deciding setting round-trips and is compared") {
  TempDir tmp;
  const std::string dir = tmp.str();
  StoreMeta m = test_meta();
  m.max_tiles_per_slide = 100;
  m.seed = 18446744073709551615ull;
  m.thumbnail_mpp_um = 4.5;
  m.passthrough = false;
  {
    auto w = StoreWriter::open(dir, m);
    REQUIRE(w.ok());
    REQUIRE((*w)->close().ok());
  }
  {
    auto r = StoreReader::open(dir);
    REQUIRE(r.ok());
    const StoreMeta& back = (*r)->meta();
    CHECK(back.max_tiles_per_slide == 100);
    CHECK(back.seed == 18446744073709551615ull);
    CHECK(back.thumbnail_mpp_um == 4.5);
    CHECK_FALSE(back.passthrough);
  }
  StoreMeta other = m;
  other.max_tiles_per_slide = 0;
  other.seed = 1;
  other.thumbnail_mpp_um = 8;
  other.passthrough = true;
  other.shard = "0/1";
  auto w = StoreWriter::open(dir, other);
  REQUIRE_FALSE(w.ok());
  CHECK(w.status().code() == StatusCode::kFailedPrecondition);
  const std::string& msg = w.status().message();
  for (const char* want : {"max_tiles_per_slide=100, this run asks 0", "seed=18446744073709551615, this run asks 1",
                           "thumbnail_mpp_um=4.5, this run asks 8", "passthrough=false, this run asks true",
                           "shard=1/3, this run asks 0/1"})
    CHECK_MESSAGE(msg.find(want) != std::string::npos, msg);
}

TEST_CASE("test_store: a truncated data.mdb is DataLoss at open, not SIGBUS later") {
  TempDir tmp;
  const std::string dir = tmp.str("s");
  {
    auto w = StoreWriter::open(dir, test_meta());
    REQUIRE(w.ok());
    for (int i = 0; i < 8; ++i) add_slide(**w, "s" + std::to_string(i), 20, static_cast<uint64_t>(i));
    REQUIRE((*w)->close().ok());
  }
  const std::string data = dir + "/data.mdb";
  fs::resize_file(data, fs::file_size(data) / 2);
  auto r = StoreReader::open(dir);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == StatusCode::kDataLoss);
  CHECK_MESSAGE(r.status().message().find(data + " is truncated") != std::string::npos, r.status().message());
  auto w = StoreWriter::open(dir, test_meta());
  REQUIRE_FALSE(w.ok());
  CHECK(w.status().code() == StatusCode::kDataLoss);
  CHECK_MESSAGE(w.status().message().find(data + " is truncated") != std::string::npos, w.status().message());
}

TEST_CASE("test_store: the map grows from 64 KiB on MDB_MAP_FULL") {
  TempDir tmp;
  const std::string dir = tmp.str();
  StoreWriterOptions opt;
  opt.tiles_per_txn = 16;
  opt.initial_map_bytes = 1 << 16;
  constexpr int kTiles = 64;
  constexpr size_t kBytes = 32 * 1024;  // 2 MiB in all
  {
    auto w = StoreWriter::open(dir, test_meta(), opt);
    REQUIRE_MESSAGE(w.ok(), w.status().to_string());
    REQUIRE((*w)->begin_slide("big").ok());
    for (int i = 0; i < kTiles; ++i) {
      Status s = (*w)->add_tile(tile_at(i, 0), make_payload(static_cast<uint64_t>(i), kBytes));
      REQUIRE_MESSAGE(s.ok(), s.to_string());
    }
    REQUIRE((*w)->finish_slide(SlideRecord{}).ok());
    REQUIRE((*w)->close().ok());
  }
  CHECK(fs::file_size(dir + "/data.mdb") > 2 * 1024 * 1024);
  auto r = StoreReader::open(dir);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  REQUIRE((*r)->tile_count() == kTiles);
  for (int i = 0; i < kTiles; ++i) {
    TileHeader h;
    std::vector<uint8_t> payload;
    REQUIRE((*r)->read_tile(static_cast<uint64_t>(i), &h, &payload).ok());
    CHECK(payload == make_payload(static_cast<uint64_t>(i), kBytes));
  }
}

TEST_CASE("test_store: reader errors name the store") {
  TempDir tmp;
  auto r = StoreReader::open(tmp.str("missing"));
  CHECK(r.status().code() == StatusCode::kNotFound);
  CHECK(r.status().message().find(tmp.str("missing")) != std::string::npos);

  fs::create_directories(tmp.str("empty"));
  r = StoreReader::open(tmp.str("empty"));
  CHECK(r.status().code() == StatusCode::kNotFound);

  fs::create_directories(tmp.str("garbage"));
  {
    std::vector<char> junk(16384, 'x');
    FILE* f = std::fopen(tmp.str("garbage/data.mdb").c_str(), "wb");
    REQUIRE(f);
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  r = StoreReader::open(tmp.str("garbage"));
  CHECK_MESSAGE(r.status().code() == StatusCode::kDataLoss, r.status().to_string());
  auto w = StoreWriter::open(tmp.str("garbage"), test_meta());
  CHECK_MESSAGE(w.status().code() == StatusCode::kDataLoss, w.status().to_string());

  // Somebody else's LMDB environment: not a slidestream store, and the writer leaves it alone.
  fs::create_directories(tmp.str("foreign"));
  raw_put(tmp.str("foreign"), "other", "k", "v");
  r = StoreReader::open(tmp.str("foreign"));
  CHECK(r.status().code() == StatusCode::kDataLoss);
  w = StoreWriter::open(tmp.str("foreign"), test_meta());
  CHECK(w.status().code() == StatusCode::kDataLoss);
}

TEST_CASE("test_store: read-only store directory") {
  TempDir tmp;
  const std::string dir = tmp.str();
  {
    auto w = StoreWriter::open(dir, test_meta());
    REQUIRE(w.ok());
    add_slide(**w, "a", 3, 1);
    REQUIRE((*w)->close().ok());
  }
  if (geteuid() == 0) {
    MESSAGE("running as root, which ignores permissions: read-only fallback (MDB_NOLOCK) not exercised");
    return;
  }
  // A copy without lock.mdb in a directory nobody may write: LMDB cannot create its lock file.
  const std::string ro = tmp.str("ro");
  fs::create_directories(ro);
  fs::copy_file(dir + "/data.mdb", ro + "/data.mdb");
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read |
                          fs::perms::group_exec | fs::perms::others_read | fs::perms::others_exec);
  auto r = StoreReader::open(ro);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  CHECK((*r)->tile_count() == 3);
  TileHeader h;
  std::vector<uint8_t> payload;
  CHECK((*r)->read_tile(2, &h, &payload).ok());
  CHECK(payload == make_payload(1000 + 2, 102));
  // And the writer reports the directory as not writable.
  auto w = StoreWriter::open(ro, test_meta());
  CHECK_MESSAGE(w.status().code() == StatusCode::kPermissionDenied, w.status().to_string());
}

TEST_CASE("test_store: concurrent reads from four threads") {
  TempDir tmp;
  const std::string dir = tmp.str();
  constexpr int kTiles = 200;
  {
    StoreWriterOptions opt;
    opt.tiles_per_txn = 37;
    auto w = StoreWriter::open(dir, test_meta(), opt);
    REQUIRE(w.ok());
    add_slide(**w, "a", kTiles, 5);
    REQUIRE((*w)->close().ok());
  }
  auto r = StoreReader::open(dir);
  REQUIRE(r.ok());
  const StoreReader& rd = **r;
  std::atomic<int> bad{0}, read{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int pass = 0; pass < 3; ++pass) {
        for (int k = 0; k < kTiles; ++k) {
          const int i = (k * 7 + t * 50) % kTiles;  // each thread in its own order
          TileHeader h;
          std::vector<uint8_t> payload;
          Status s = rd.read_tile(static_cast<uint64_t>(i), &h, &payload);
          if (!s.ok() || h.x_l0 != i * 64 || payload != make_payload(5000 + static_cast<uint64_t>(i), 100 + i))
            ++bad;
          ++read;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad.load() == 0);
  CHECK(read.load() == 4 * 3 * kTiles);
}

}  // namespace libtile_test_store
