#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include "slide/core/csv.h"
#include "slide/core/file.h"
#include "slide/core/log.h"
#include "slide/core/status.h"
#include "slide/core/thread_pool.h"

using namespace slide::core;

namespace {
Result<int> parse_positive(int v) {
  if (v <= 0) return invalid_argument("not positive: " + std::to_string(v));
  return v;
}
Result<int> doubled(int v) {
  SLIDE_ASSIGN_OR_RETURN_CTX(int x, parse_positive(v), "doubling");
  return 2 * x;
}
Status check_all(const std::vector<int>& vs) {
  for (int v : vs) SLIDE_RETURN_IF_ERROR_CTX(parse_positive(v), "item " + std::to_string(v));
  return ok_status();
}
std::string temp_dir(const char* name) {
  auto p = std::filesystem::temp_directory_path() / (std::string("slide_core_") + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}
}  // namespace

TEST_CASE("Status carries code, message and context") {
  Status s = data_loss("Bogus marker length").with_context("tile (x0=1024, y0=2048) of a.svs");
  CHECK_FALSE(s.ok());
  CHECK(s.code() == StatusCode::kDataLoss);
  CHECK(s.message() == "tile (x0=1024, y0=2048) of a.svs: Bogus marker length");
  CHECK(s.to_string() == "DATA_LOSS: tile (x0=1024, y0=2048) of a.svs: Bogus marker length");
  CHECK(ok_status().with_context("ignored").ok());
  CHECK(std::string(status_code_name(StatusCode::kResourceExhausted)) == "RESOURCE_EXHAUSTED");
}

TEST_CASE("Result and the propagation macros") {
  auto good = doubled(21);
  REQUIRE(good.ok());
  CHECK(*good == 42);
  auto bad = doubled(-1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message() == "doubling: not positive: -1");
  Status s = check_all({1, 2, -3, 4});
  CHECK(s.message() == "item -3: not positive: -3");
}

TEST_CASE("errno maps to canonical codes") {
  CHECK(errno_status(ENOSPC, "write x").code() == StatusCode::kResourceExhausted);
  CHECK(errno_status(ENOENT, "open x").code() == StatusCode::kNotFound);
  CHECK(errno_status(EACCES, "open x").code() == StatusCode::kPermissionDenied);
  CHECK(errno_status(EIO, "read x").code() == StatusCode::kInternal);
  CHECK(errno_status(ENOENT, "open x").message().find("open x: ") == 0);
}

TEST_CASE("write_file_atomic replaces the file whole and leaves no temporary") {
  std::string dir = temp_dir("atomic");
  std::string path = dir + "/out.txt";
  REQUIRE(write_file_atomic(path, std::string_view("first")).ok());
  REQUIRE(write_file_atomic(path, std::string_view("second version")).ok());
  auto back = read_file(path);
  REQUIRE(back.ok());
  CHECK(*back == "second version");
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) {
    (void)e;
    ++files;
  }
  CHECK(files == 1);
  auto st = stat_file(path);
  REQUIRE(st.ok());
  CHECK(st->size_bytes == 14);
  std::filesystem::remove_all(dir);
}

TEST_CASE("write_file_atomic into a missing or unwritable directory is a clear error") {
  Status s = write_file_atomic("/nonexistent-dir-slide/x.txt", std::string_view("x"));
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("/nonexistent-dir-slide/x.txt") != std::string::npos);
  if (::geteuid() != 0) {  // root ignores directory permissions
    std::string dir = temp_dir("ro");
    ::chmod(dir.c_str(), 0555);
    CHECK(write_file_atomic(dir + "/x.txt", std::string_view("x")).code() == StatusCode::kPermissionDenied);
    ::chmod(dir.c_str(), 0755);
    std::filesystem::remove_all(dir);
  }
  CHECK(read_file("/nonexistent-dir-slide/x.txt").status().code() == StatusCode::kNotFound);
}


TEST_CASE("ThreadPool runs every task and returns results") {
  ThreadPool pool(3);
  CHECK(pool.size() == 3);
  std::atomic<int> sum{0};
  std::vector<std::future<int>> futs;
  for (int i = 1; i <= 100; ++i) futs.push_back(pool.submit([i, &sum] {
    sum += i;
    return i * i;
  }));
  long long squares = 0;
  for (auto& f : futs) squares += f.get();
  CHECK(sum == 5050);
  CHECK(squares == 338350);
}

TEST_CASE("ThreadPool destructor drains the queue") {
  std::atomic<int> ran{0};
  {
    ThreadPool pool(1);
    for (int i = 0; i < 50; ++i) (void)pool.submit([&ran] { ++ran; });
  }
  CHECK(ran == 50);
}

TEST_CASE("json_escape") {
  CHECK(json_escape("a\"b\\c\n") == "a\\\"b\\\\c\\n");
  CHECK(json_escape(std::string("\x01", 1)) == "\\u0001");
}

TEST_CASE("csv_quote: split_csv_line gives every field back, and no line reads as a comment") {
  const std::vector<std::string> fields = {"#slide-7", "plain", "a,b", "say \"hi\"", "", "x#y", "#"};
  std::string line;
  for (size_t i = 0; i < fields.size(); ++i) line += (i ? "," : "") + slide::core::csv_quote(fields[i]);
  CHECK_FALSE(slide::core::csv_line_is_blank(line));
  CHECK(slide::core::split_csv_line(line) == fields);
  CHECK(slide::core::csv_quote("plain") == "plain");
  CHECK(slide::core::csv_quote("#a") == "\"#a\"");
}
