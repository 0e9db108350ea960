#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include <signal.h>
#include <sys/wait.h>

#include "slide/core/csv.h"
#include "slide/core/dir_lock.h"
#include "slide/core/durable.h"
#include "slide/core/file_name.h"
#include "slide/core/file.h"
#include "slide/core/hash.h"
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


TEST_CASE("commit_file renames a written file over the old one; on error the partial file is gone") {
  std::string dir = temp_dir("commit");
  const std::string path = dir + "/out.h5", partial = path + ".partial";
  REQUIRE(write_file_atomic(path, std::string_view("old")).ok());
  REQUIRE(write_file_atomic(partial, std::string_view("new and whole")).ok());
  REQUIRE(commit_file(partial, path).ok());
  CHECK(*read_file(path) == "new and whole");
  CHECK_FALSE(std::filesystem::exists(partial));
  // A target in a directory that is not there: the rename fails, naming both files, and the
  // partial file is removed (nothing half-written is left to be mistaken for output).
  REQUIRE(write_file_atomic(partial, std::string_view("x")).ok());
  Status s = commit_file(partial, dir + "/missing/out.h5");
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find("rename " + partial + " to " + dir + "/missing/out.h5") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(partial));
  CHECK(*read_file(path) == "new and whole");
  // No partial file at all: the error names it.
  s = commit_file(partial, path);
  CHECK(s.code() == StatusCode::kNotFound);
  CHECK(s.message().find(partial) != std::string::npos);
  CHECK(fsync_path(dir, true).ok());
  CHECK(fsync_path(dir + "/nope", true).code() == StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}


TEST_CASE("sha256_bytes and sha256_file give FIPS 180-4's digests") {
  // FIPS 180-4's example "abc" (NIST's SHA-256 example values) and the empty message.
  CHECK(*sha256_bytes("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(*sha256_bytes("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  std::string dir = temp_dir("sha");
  REQUIRE(write_file_atomic(dir + "/abc", std::string_view("abc")).ok());
  CHECK(*sha256_file(dir + "/abc") == *sha256_bytes("abc"));
  CHECK(sha256_file(dir + "/missing").status().code() == StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
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

TEST_CASE("DirLock: one writer per directory; released on destruction and on process exit") {
  std::string dir = temp_dir("dirlock") + "/store";
  auto first = DirLock::acquire(dir, "store");
  REQUIRE(first.ok());
  CHECK(std::filesystem::exists(dir + "/writer.lock"));
  // A second acquirer in another process fails at once, naming the directory and our pid.
  // (flock locks belong to open file descriptions, so a child process sees the conflict.)
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    auto second = DirLock::acquire(dir, "store");
    std::string msg = second.ok() ? "ACQUIRED" : second.status().to_string();
    ssize_t w = ::write(pipefd[1], msg.data(), msg.size());
    (void)w;
    ::_exit(second.ok() ? 0 : 1);
  }
  ::close(pipefd[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = ::read(pipefd[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<size_t>(n));
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(msg.find("store " + dir + " is being written by another process (pid " + std::to_string(::getpid())) !=
        std::string::npos);
  CHECK(msg.find("UNAVAILABLE") != std::string::npos);
  first->reset();  // released: the next acquirer gets it
  auto again = DirLock::acquire(dir, "store");
  CHECK(again.ok());
  again->reset();
  // A holder killed by SIGKILL leaves no stale lock.
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid = ::fork();
  if (pid == 0) {
    auto held = DirLock::acquire(dir, "store");
    if (!held.ok()) ::_exit(2);
    ssize_t w = ::write(ready[1], "x", 1);
    (void)w;
    ::pause();
    ::_exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  REQUIRE(::read(ready[0], &byte, 1) == 1);  // the child holds the lock now
  ::close(ready[0]);
  CHECK_FALSE(DirLock::acquire(dir, "store").ok());
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  CHECK(DirLock::acquire(dir, "store").ok());
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path());
}

TEST_CASE("slide_file_stem: ordinary ids unchanged; separators, dots, control bytes replaced; long ids shortened; unique") {
  CHECK(slide_file_stem("TCGA-A1-0001.svs") == "TCGA-A1-0001.svs");
  CHECK(slide_file_stem("tumor 01 (ü)") == "tumor 01 (ü)");
  auto safe = [](const std::string& s) {
    return s.find('/') == std::string::npos && s.find('\\') == std::string::npos && !s.empty() && s[0] != '.' &&
           s.find('\0') == std::string::npos && s.size() <= kMaxSlideStemBytes;
  };
  for (std::string id : {std::string("../../x"), std::string(".."), std::string("."), std::string(""),
                         std::string(".hidden"), std::string("a/b"), std::string("a\\b"), std::string("a\nb"),
                         std::string("a\0b", 3), std::string("/etc/passwd"), std::string(300, 'x'),
                         std::string(300, '/')}) {
    std::string stem = slide_file_stem(id);
    CHECK_MESSAGE(safe(stem), stem);
    CHECK(stem != id);
    CHECK(stem.find('~') != std::string::npos);  // the hash suffix marks a changed name
  }
  CHECK(slide_file_stem("../../x").rfind("_._.._x~", 0) == 0);
  CHECK(slide_file_stem(std::string(300, 'x')).size() == kMaxSlideStemBytes);
  // Distinct ids, distinct names: "a/b" vs "a_b", two long ids sharing a 250-byte prefix.
  CHECK(slide_file_stem("a/b") != slide_file_stem("a_b"));
  CHECK(slide_file_stem("a_b") == "a_b");
  std::string prefix(250, 'p');
  CHECK(slide_file_stem(prefix + "1") != slide_file_stem(prefix + "2"));
  // Shortening never splits a UTF-8 character: 'é' is two bytes.
  std::string accents;
  for (int i = 0; i < 150; ++i) accents += "\xc3\xa9";
  std::string stem = slide_file_stem(accents);
  CHECK(stem.size() <= kMaxSlideStemBytes);
  size_t body = stem.find('~');
  REQUIRE(body != std::string::npos);
  CHECK(body % 2 == 0);
  // Deterministic: the same id, the same name, in any process.
  CHECK(slide_file_stem("a/b") == slide_file_stem("a/b"));
}

TEST_CASE("CSV: a UTF-8 byte-order mark (Excel's CSV UTF-8) before the header is skipped") {
  CHECK(split_csv_line("\xEF\xBB\xBFslide_id,path,label") == std::vector<std::string>{"slide_id", "path", "label"});
  CHECK(csv_line_is_blank("\xEF\xBB\xBF# comment"));
  CHECK(csv_line_is_blank("\xEF\xBB\xBF"));
  CHECK_FALSE(csv_line_is_blank("\xEF\xBB\xBFslide_id,path"));
}

TEST_CASE("utf8_prefix: at most N bytes, never half a character") {
  using slide::core::utf8_prefix;
  CHECK(utf8_prefix("abc", 5) == "abc");
  CHECK(utf8_prefix("abcdef", 3) == "abc");
  const std::string e = "a\xc3\xa9";  // "aé": é is 2 bytes
  CHECK(utf8_prefix(e, 2) == "a");    // the cut would split é: back to its first byte
  CHECK(utf8_prefix(e, 3) == e);
  const std::string euro = "\xe2\x82\xac\xe2\x82\xac";  // "€€", 3 bytes each
  CHECK(utf8_prefix(euro, 5) == "\xe2\x82\xac");
  CHECK(utf8_prefix(euro, 2).empty());
}

TEST_CASE("utf8_or_escaped: valid UTF-8 unchanged, every stray byte as %XX") {
  using slide::core::utf8_or_escaped;
  using slide::core::utf8_sequence_length;
  CHECK(utf8_or_escaped("TCGA-A1-0001") == "TCGA-A1-0001");
  CHECK(utf8_or_escaped("Pr\xc3\xa4parat \xe2\x82\xac \xf0\x9f\x94\xac") == "Pr\xc3\xa4parat \xe2\x82\xac \xf0\x9f\x94\xac");
  CHECK(utf8_or_escaped("Pr\xe4parat") == "Pr%E4parat");            // Latin-1 a-umlaut
  CHECK(utf8_or_escaped("my slide \xff") == "my slide %FF");
  CHECK(utf8_or_escaped("\xc0\xaf") == "%C0%AF");                   // overlong '/'
  CHECK(utf8_or_escaped("\xed\xa0\x80") == "%ED%A0%80");            // a surrogate
  CHECK(utf8_or_escaped("\xf4\x90\x80\x80") == "%F4%90%80%80");     // above U+10FFFF
  CHECK(utf8_or_escaped("\xe2\x82") == "%E2%82");                   // cut short
  CHECK(utf8_or_escaped("a\x80" "b") == "a%80b");                   // a lone continuation byte
  CHECK(utf8_or_escaped(std::string("\0x", 2)) == std::string("\0x", 2));  // NUL is valid UTF-8
  // Two names that differ only in a stray byte stay two ids.
  CHECK(utf8_or_escaped("a\xfe") != utf8_or_escaped("a\xff"));
  CHECK(utf8_sequence_length("\xf0\x9f\x94\xac", 0) == 4);
  CHECK(utf8_sequence_length("\xe0\x80\x80", 0) == 0);  // overlong 3-byte form
}
