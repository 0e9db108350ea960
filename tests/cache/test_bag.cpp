// HDF5 feature bags: write/read round trips (float32, float16, gzip, lzf), slices, atomic commit,
// the directory listing and manifest, float16 rounding, and corrupt or foreign files.
#include <doctest/doctest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "slide/cache/bag.h"
#include "slide/core/file.h"

// This file's own namespace: the suite compiles in unity batches (tests/CMakeLists.txt), where
// each file's helpers would otherwise meet the other files'.
namespace cache_test_bag {

using namespace slide::cache;
using slide::core::Status;
using slide::core::StatusCode;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    path = (fs::temp_directory_path() / ("cache_tests_" + std::to_string(::getpid()) + "_" +
                                         std::to_string(std::random_device{}()))).string();
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

BagAttributes attrs(const std::string& id) {
  BagAttributes a;
  a.slide_id = id;
  a.label = "LUAD";
  a.tile_size_px = 224;
  a.tile_size_l0_px = 448;
  a.mpp_um = 0.5;
  a.model = "resnet50";
  a.layer = "layer3";
  a.weights_sha256 = std::string(64, 'a');
  a.tool_version = "slide-embed test";
  return a;
}

// Rows with distinct values so any misplaced row shows.
void make_rows(int64_t n, int64_t d, uint64_t seed, std::vector<float>* f, std::vector<int64_t>* c) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 2.f);
  f->resize(static_cast<size_t>(n * d));
  c->resize(static_cast<size_t>(n * 2));
  for (auto& v : *f) v = nd(rng);
  for (int64_t i = 0; i < n; ++i) {
    (*c)[2 * i] = 1000 + 256 * i;
    (*c)[2 * i + 1] = 7 * i;
  }
}

std::string write_bag(const std::string& dir, const std::string& id, int64_t n, int64_t d, BagWriterOptions opt,
                      std::vector<float>* f, std::vector<int64_t>* c, int64_t append_rows = 7) {
  make_rows(n, d, 42 + n, f, c);
  const std::string path = dir + "/" + bag_file_name(id);
  auto w = BagWriter::create(path, d, attrs(id), opt);
  REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  for (int64_t r = 0; r < n; r += append_rows) {
    const int64_t k = std::min(append_rows, n - r);
    auto s = (*w)->append(k, std::span<const float>(f->data() + r * d, static_cast<size_t>(k * d)),
                          std::span<const int64_t>(c->data() + r * 2, static_cast<size_t>(k * 2)));
    REQUIRE_MESSAGE(s.ok(), s.to_string());
    // Never visible under the final name before commit.
    REQUIRE(!fs::exists(path));
    REQUIRE(fs::exists(path + ".partial"));
  }
  auto s = (*w)->commit();
  REQUIRE_MESSAGE(s.ok(), s.to_string());
  REQUIRE(fs::exists(path));
  REQUIRE(!fs::exists(path + ".partial"));
  return path;
}

}  // namespace

TEST_CASE("float16 conversion: round to nearest even, subnormals, overflow, exact widening") {
  CHECK(float_to_half(0.f) == 0x0000);
  CHECK(float_to_half(-0.f) == 0x8000);
  CHECK(float_to_half(1.f) == 0x3c00);
  CHECK(float_to_half(-2.f) == 0xc000);
  CHECK(float_to_half(65504.f) == 0x7bff);
  CHECK(float_to_half(65520.f) == 0x7c00);      // ties to even -> overflows to inf
  CHECK(float_to_half(65519.f) == 0x7bff);
  CHECK(float_to_half(1.f + 1.f / 2048) == 0x3c00);  // tie between 1 and 1+2^-10: even (1)
  CHECK(float_to_half(1.f + 3.f / 2048) == 0x3c02);  // tie: rounds up to even
  CHECK(float_to_half(std::ldexp(1.f, -24)) == 0x0001);  // smallest subnormal
  CHECK(float_to_half(std::ldexp(1.f, -25)) == 0x0000);  // tie with zero: even
  CHECK(float_to_half(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(float_to_half(std::ldexp(1.f, -14)) == 0x0400);  // smallest normal
  CHECK(std::isnan(half_to_float(float_to_half(std::nanf("")))));
  CHECK(std::isinf(half_to_float(float_to_half(1e10f))));
  // Every half value survives half -> float -> half, and the widening is the exact value.
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = half_to_float(h);
    if (std::isnan(f)) continue;
    REQUIRE(float_to_half(f) == h);
  }
  CHECK(half_to_float(0x0001) == std::ldexp(1.f, -24));
  CHECK(half_to_float(0x3555) == doctest::Approx(0.333251953125).epsilon(1e-12));
  // Random floats: the nearest half, ties aside, is within half an ulp.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1000.f, 1000.f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng);
    const float y = half_to_float(float_to_half(x));
    const float ulp = std::ldexp(1.f, std::ilogb(x) - 10);
    REQUIRE(std::fabs(x - y) <= 0.5f * ulp);
  }
}

TEST_CASE("bag round trip: float32, several chunks, appends not aligned with chunks, slices") {
  TempDir tmp;
  std::vector<float> f;
  std::vector<int64_t> c;
  BagWriterOptions opt;
  opt.chunk_rows = 16;
  const std::string path = write_bag(tmp.path, "slide-1", 53, 24, opt, &f, &c);
  auto r = BagReader::open(path);
  REQUIRE_MESSAGE(r.ok(), r.status().to_string());
  const BagInfo& info = (*r)->info();
  CHECK(info.num_tiles == 53);
  CHECK(info.feature_dim == 24);
  CHECK(info.dtype == FeatureDtype::kFloat32);
  CHECK(info.compression == Compression::kNone);
  CHECK(info.attributes.slide_id == "slide-1");
  CHECK(info.attributes.label == "LUAD");
  CHECK(info.attributes.tile_size_px == 224);
  CHECK(info.attributes.tile_size_l0_px == 448);
  CHECK(info.attributes.mpp_um == 0.5);
  CHECK(info.attributes.model == "resnet50");
  CHECK(info.attributes.layer == "layer3");
  CHECK(info.attributes.weights_sha256 == std::string(64, 'a'));
  CHECK(info.attributes.tool_version == "slide-embed test");
  CHECK(info.file_bytes > 53 * 24 * 4);

  auto bag = (*r)->read_all();
  REQUIRE(bag.ok());
  CHECK(bag->features == f);
  for (size_t i = 0; i < c.size(); ++i) REQUIRE(bag->coords[i] == c[i]);

  // A slice across a chunk boundary.
  std::vector<float> slice(static_cast<size_t>(10 * 24));
  REQUIRE((*r)->read_features(12, 10, slice).ok());
  CHECK(std::equal(slice.begin(), slice.end(), f.begin() + 12 * 24));
  std::vector<int32_t> cs(20);
  REQUIRE((*r)->read_coords(12, 10, cs).ok());
  CHECK(cs[0] == 1000 + 256 * 12);
  CHECK(cs[19] == 7 * 21);
  // Out of range and wrong sizes are errors.
  std::vector<float> one(24);
  CHECK((*r)->read_features(53, 1, one).code() == StatusCode::kOutOfRange);
  CHECK((*r)->read_features(-1, 1, one).code() == StatusCode::kOutOfRange);
  CHECK((*r)->read_features(0, 2, one).code() == StatusCode::kInvalidArgument);
}

TEST_CASE("bag writer: chunk_rows past what HDF5 takes (a chunk of 4 GiB or more) is lowered, not an error") {
  // 2^20 rows of 2560-d float32 features (Virchow2's width) would be a 10 GiB chunk, which HDF5
  // refuses, and a 10 GiB buffer: the writer keeps chunks to kMaxChunkFeatureBytes.
  TempDir tmp;
  for (const FeatureDtype dtype : {FeatureDtype::kFloat32, FeatureDtype::kFloat16}) {
    std::vector<float> f;
    std::vector<int64_t> c;
    BagWriterOptions opt;
    opt.chunk_rows = int64_t{1} << 20;
    opt.dtype = dtype;
    const std::string id = dtype == FeatureDtype::kFloat32 ? "wide-f32" : "wide-f16";
    const std::string path = write_bag(tmp.path, id, 40, 2560, opt, &f, &c, 16);
    auto r = BagReader::open(path);
    REQUIRE_MESSAGE(r.ok(), r.status().to_string());
    CHECK((*r)->info().num_tiles == 40);
    auto bag = (*r)->read_all();
    REQUIRE(bag.ok());
    if (dtype == FeatureDtype::kFloat32) CHECK(bag->features == f);
    for (size_t i = 0; i < c.size(); ++i) REQUIRE(bag->coords[i] == c[i]);
  }
}

TEST_CASE("bag round trip: float16 with gzip, with lzf and uncompressed") {
  TempDir tmp;
  for (Compression comp : {Compression::kGzip, Compression::kLzf, Compression::kNone}) {
    CAPTURE(compression_name(comp));
    REQUIRE(compression_available(comp));  // lzf: registered by the cache library on liblzf
    BagWriterOptions opt;
    opt.dtype = FeatureDtype::kFloat16;
    opt.compression = comp;
    opt.chunk_rows = 32;
    std::vector<float> f;
    std::vector<int64_t> c;
    const std::string id = std::string("s-") + compression_name(comp);
    const std::string path = write_bag(tmp.path, id, 70, 40, opt, &f, &c, 70);
    auto bag = read_bag(path);
    REQUIRE_MESSAGE(bag.ok(), bag.status().to_string());
    CHECK(bag->info.dtype == FeatureDtype::kFloat16);
    CHECK(bag->info.compression == comp);
    REQUIRE(bag->features.size() == f.size());
    for (size_t i = 0; i < f.size(); ++i) REQUIRE(bag->features[i] == half_to_float(float_to_half(f[i])));
    // A float16 slice too (the in-place widening).
    auto r = BagReader::open(path);
    REQUIRE(r.ok());
    std::vector<float> s(static_cast<size_t>(3 * 40));
    REQUIRE((*r)->read_features(31, 3, s).ok());
    for (size_t i = 0; i < s.size(); ++i) REQUIRE(s[i] == bag->features[31 * 40 + i]);
  }
}

TEST_CASE("bag writer: nothing under the final name until commit; discard and destructor remove the partial") {
  TempDir tmp;
  const std::string path = tmp.path + "/a.h5";
  {
    auto w = BagWriter::create(path, 4, attrs("a"));
    REQUIRE(w.ok());
    std::vector<float> f(8, 1.f);
    std::vector<int64_t> c(4, 0);
    REQUIRE((*w)->append(2, f, c).ok());
    CHECK((*w)->rows() == 2);
    CHECK(fs::exists(path + ".partial"));
    CHECK(!fs::exists(path));
  }  // destroyed without commit
  CHECK(!fs::exists(path + ".partial"));
  CHECK(!fs::exists(path));

  // A leftover .partial (a killed run) is truncated by the next writer.
  { std::ofstream(path + ".partial") << "garbage from a killed run"; }
  auto w = BagWriter::create(path, 4, attrs("a"));
  REQUIRE_MESSAGE(w.ok(), w.status().to_string());
  std::vector<float> f(4, 2.f);
  std::vector<int64_t> c = {5, 6};
  CHECK((*w)->append(1, std::span<const float>(f.data(), 3), c).code() == StatusCode::kInvalidArgument);
  REQUIRE((*w)->append(1, f, c).ok());
  std::vector<int64_t> big = {int64_t{1} << 33, 0};
  CHECK((*w)->append(1, f, big).code() == StatusCode::kInvalidArgument);
  REQUIRE((*w)->commit().ok());
  auto bag = read_bag(path);
  REQUIRE(bag.ok());
  CHECK(bag->info.num_tiles == 1);
  CHECK(bag->coords == std::vector<int32_t>{5, 6});
  CHECK((*w)->append(1, f, c).code() == StatusCode::kFailedPrecondition);

  // An empty bag (zero rows) is valid.
  auto e = BagWriter::create(tmp.path + "/empty.h5", 16, attrs("empty"));
  REQUIRE(e.ok());
  REQUIRE((*e)->commit().ok());
  auto eb = read_bag(tmp.path + "/empty.h5");
  REQUIRE(eb.ok());
  CHECK(eb->info.num_tiles == 0);
  CHECK(eb->info.feature_dim == 16);
}

TEST_CASE("bag writer: bad arguments and unwritable places are clear errors") {
  TempDir tmp;
  CHECK(BagWriter::create(tmp.path + "/a.h5", 0, attrs("a")).status().code() == StatusCode::kInvalidArgument);
  CHECK(BagWriter::create(tmp.path + "/a.h5", 4, BagAttributes{}).status().code() == StatusCode::kInvalidArgument);
  BagWriterOptions opt;
  opt.compression = Compression::kGzip;
  opt.gzip_level = 11;
  CHECK(BagWriter::create(tmp.path + "/a.h5", 4, attrs("a"), opt).status().code() == StatusCode::kInvalidArgument);
  auto missing = BagWriter::create(tmp.path + "/no/such/dir/a.h5", 4, attrs("a"));
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK(missing.status().message().find("no/such/dir/a.h5.partial") != std::string::npos);
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(tmp.path + "/ro");
    fs::permissions(tmp.path + "/ro", fs::perms::owner_read | fs::perms::owner_exec);
    CHECK(BagWriter::create(tmp.path + "/ro/a.h5", 4, attrs("a")).status().code() == StatusCode::kPermissionDenied);
    fs::permissions(tmp.path + "/ro", fs::perms::owner_all);
  }
}

TEST_CASE("bag reader: corrupt and foreign files") {
  TempDir tmp;
  CHECK(BagReader::open(tmp.path + "/none.h5").status().code() == StatusCode::kNotFound);
  { std::ofstream(tmp.path + "/text.h5") << "not hdf5 at all"; }
  auto t = BagReader::open(tmp.path + "/text.h5");
  CHECK(t.status().code() == StatusCode::kDataLoss);
  CHECK(t.status().message().find("text.h5: not an HDF5 file") != std::string::npos);

  // A bag truncated mid-file (a copy cut short) fails to open or to read, never returns garbage.
  std::vector<float> f;
  std::vector<int64_t> c;
  BagWriterOptions opt;
  opt.chunk_rows = 64;
  const std::string good = write_bag(tmp.path, "big", 512, 64, opt, &f, &c, 512);
  const auto size = fs::file_size(good);
  fs::copy_file(good, tmp.path + "/cut.h5");
  fs::resize_file(tmp.path + "/cut.h5", size / 2);
  auto cut = BagReader::open(tmp.path + "/cut.h5");
  if (cut.ok()) {
    auto all = (*cut)->read_all();
    CHECK(!all.ok());
    CHECK(all.status().code() == StatusCode::kDataLoss);
  } else {
    CHECK(cut.status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("list_bags and the manifest") {
  TempDir tmp;
  std::vector<float> f;
  std::vector<int64_t> c;
  write_bag(tmp.path, "b/2", 5, 8, {}, &f, &c);
  write_bag(tmp.path, "a 1", 9, 8, {}, &f, &c);
  { std::ofstream(tmp.path + "/leftover.h5.partial") << "x"; }
  { std::ofstream(tmp.path + "/notes.txt") << "x"; }
  auto bags = list_bags(tmp.path);
  REQUIRE_MESSAGE(bags.ok(), bags.status().to_string());
  REQUIRE(bags->size() == 2);
  CHECK((*bags)[0].attributes.slide_id == "a 1");
  CHECK((*bags)[0].num_tiles == 9);
  CHECK((*bags)[1].attributes.slide_id == "b/2");
  CHECK(fs::path((*bags)[1].path).filename() == bag_file_name("b/2"));

  { std::ofstream(tmp.path + "/broken.h5") << "x"; }
  CHECK(list_bags(tmp.path).status().code() == StatusCode::kDataLoss);
  std::vector<slide::core::Status> skipped;
  auto some = list_bags(tmp.path, true, &skipped);
  REQUIRE(some.ok());
  CHECK(some->size() == 2);
  CHECK(skipped.size() == 1);

  (*bags)[0].attributes.label = "with, comma";
  REQUIRE(write_manifest(tmp.path, *bags).ok());
  auto m = read_manifest(tmp.path + "/bags.csv");
  REQUIRE_MESSAGE(m.ok(), m.status().to_string());
  REQUIRE(m->size() == 2);
  CHECK((*m)[0].slide_id == "a 1");
  CHECK((*m)[0].num_tiles == 9);
  CHECK((*m)[0].feature_dim == 8);
  CHECK((*m)[0].label == "with, comma");
  CHECK((*m)[1].path == tmp.path + "/" + bag_file_name("b/2"));
  CHECK(read_bag((*m)[1].path).ok());

  REQUIRE(slide::core::write_file_atomic(tmp.path + "/bad.csv", std::string("slide_id,file,num_tiles,feature_dim,dtype\nx,x.h5,ten,8,float32\n")).ok());
  auto bad = read_manifest(tmp.path + "/bad.csv");
  CHECK(bad.status().code() == StatusCode::kDataLoss);
  CHECK(bad.status().message().find("bad.csv:2") != std::string::npos);
}

TEST_CASE("bag_file_name is slide_file_stem's rule; the legacy rule is kept for old bags (issue 22)") {
  CHECK(bag_file_name("TCGA-AB-1234.01") == "TCGA-AB-1234.01.h5");
  CHECK(bag_file_name("CMU-1 (copy)") == "CMU-1 (copy).h5");  // no longer rewritten
  // Changed ids end in "~" + 12 hex digits of the id's hash: never outside the directory, unique.
  const std::string up = bag_file_name("../../x");
  CHECK(up.rfind("_._.._x~", 0) == 0);
  CHECK(up.size() == std::string("_._.._x~").size() + 12 + 3);
  CHECK(bag_file_name("a/b") != bag_file_name("a_b"));
  CHECK(bag_file_name("").rfind("_~", 0) == 0);
  const std::string long_name = bag_file_name(std::string(300, 'x'));
  CHECK(long_name.size() <= 203);
  CHECK(long_name.find('/') == std::string::npos);
  CHECK(legacy_bag_file_name("a/b c") == "a_b_c.h5");
  CHECK(legacy_bag_file_name("../x") == "_._x.h5");
  CHECK(legacy_bag_file_name("") == "_.h5");
}

TEST_CASE("bag writer refuses NaN, inf and float16 overflow; the reader names a NaN's bag, row and column (issue 20)") {
  TempDir tmp;
  std::vector<int64_t> c = {0, 0, 256, 0};
  for (FeatureDtype dt : {FeatureDtype::kFloat32, FeatureDtype::kFloat16}) {
    BagWriterOptions opt;
    opt.dtype = dt;
    auto w = BagWriter::create(tmp.path + "/w.h5", 3, attrs("w"), opt);
    REQUIRE(w.ok());
    std::vector<float> f = {1, 2, 3, 4, std::nanf(""), 6};
    Status s = (*w)->append(2, f, c);
    CHECK(s.code() == StatusCode::kOutOfRange);
    CHECK(s.message().find("row 1, column 1 is NaN") != std::string::npos);
    f[4] = HUGE_VALF;
    CHECK((*w)->append(2, f, c).code() == StatusCode::kOutOfRange);
    f[4] = 70000.f;  // finite, but float16 would store inf
    CHECK((*w)->append(2, f, c).ok() == (dt == FeatureDtype::kFloat32));
    (*w)->discard();
  }
  // A NaN that got into a file some other way (here: patched bytes) is refused on reading.
  std::vector<float> f;
  const std::string path = write_bag(tmp.path, "nan", 6, 4, {}, &f, &c);
  {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string needle(reinterpret_cast<const char*>(&f[4 * 3 + 2]), 4);  // row 3, column 2
    const size_t at = bytes.find(needle);
    REQUIRE(at != std::string::npos);
    REQUIRE(bytes.find(needle, at + 1) == std::string::npos);
    const float nan = std::nanf("");
    std::memcpy(bytes.data() + at, &nan, 4);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }
  auto r = BagReader::open(path);
  REQUIRE(r.ok());
  std::vector<float> rows(static_cast<size_t>(6 * 4));
  Status s = (*r)->read_features(0, 6, rows);
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK(s.message().find(path) != std::string::npos);
  CHECK(s.message().find("row 3 (tile 3), column 2 is NaN") != std::string::npos);
  std::vector<float> first(static_cast<size_t>(3 * 4));
  CHECK((*r)->read_features(0, 3, first).ok());  // rows before it read fine
}

TEST_CASE("bag writer: a failed write (file size limit) is an error, and the process then exits normally (issue 20)") {
  // In a child: RLIMIT_FSIZE makes HDF5's writes fail with EFBIG (SIGXFSZ ignored), as a full
  // disk would. HDF5 1.10 left a file whose close failed for its atexit clean-up, which then
  // crashed (exit 139); the child must exit normally with the error reported.
  TempDir tmp;
  const std::string path = tmp.path + "/big.h5";
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit rl{};
    ::getrlimit(RLIMIT_FSIZE, &rl);
    rl.rlim_cur = 64 * 1024;
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) std::exit(20);
    BagWriterOptions opt;
    opt.chunk_rows = 64;
    auto w = BagWriter::create(path, 256, attrs("big"), opt);
    if (!w.ok()) std::exit(21);
    std::vector<float> f(64 * 256, 0.5f);
    std::vector<int64_t> c(64 * 2, 0);
    Status s;
    for (int i = 0; i < 64 && s.ok(); ++i) s = (*w)->append(64, f, c);  // 4 MiB: far past the limit
    if (s.ok()) s = (*w)->commit();
    if (s.code() != StatusCode::kResourceExhausted) std::exit(22);
    if (s.message().find("big.h5.partial") == std::string::npos) std::exit(23);
    (*w)->discard();
    w->reset();
    if (fs::exists(path) || fs::exists(path + ".partial")) std::exit(24);
    std::exit(0);  // runs the atexit handlers, HDF5's included
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  CHECK_MESSAGE(!WIFSIGNALED(status), "killed by signal ", WTERMSIG(status));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("bag reader: read-only files, HDF5_USE_FILE_LOCKING=FALSE, and several readers of one bag at once") {
  TempDir tmp;
  std::vector<float> f;
  std::vector<int64_t> c;
  const std::string path = write_bag(tmp.path, "ro", 20, 8, {}, &f, &c);
  fs::permissions(path, fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  fs::permissions(tmp.path, fs::perms::owner_read | fs::perms::owner_exec);
  {
    // HDF5 reads the variable at each open; readers must honour it (network filesystems without
    // locks are where users set it).
    ::setenv("HDF5_USE_FILE_LOCKING", "FALSE", 1);
    auto a = BagReader::open(path);
    ::unsetenv("HDF5_USE_FILE_LOCKING");
    REQUIRE_MESSAGE(a.ok(), a.status().to_string());
    auto b = BagReader::open(path);  // with locking (shared read locks), while `a` is open
    REQUIRE_MESSAGE(b.ok(), b.status().to_string());
    auto ba = (*a)->read_all();
    auto bb = (*b)->read_all();
    REQUIRE(ba.ok());
    REQUIRE(bb.ok());
    CHECK(ba->features == f);
    CHECK(bb->features == f);
  }
  fs::permissions(tmp.path, fs::perms::owner_all);
}

}  // namespace cache_test_bag
