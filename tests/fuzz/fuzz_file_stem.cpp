// slide::core::slide_file_stem on arbitrary slide ids. Properties (slide/core/file_name.h):
// non-empty, at most kMaxSlideStemBytes bytes, no '/', '\\', NUL or control byte, no leading '.',
// deterministic; an id that is already a safe stem comes back unchanged, any other gets the
// "~" + 12 hex digits suffix.
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "slide/core/file_name.h"

namespace {

bool safe_byte(unsigned char c) { return c != '/' && c != '\\' && c >= 0x20 && c != 0x7f; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace slide::core;
  const std::string_view id(reinterpret_cast<const char*>(data), size);
  const std::string stem = slide_file_stem(id);
  SLIDE_FUZZ_CHECK(!stem.empty());
  SLIDE_FUZZ_CHECK(stem.size() <= kMaxSlideStemBytes);
  SLIDE_FUZZ_CHECK(stem.front() != '.');
  SLIDE_FUZZ_CHECK(stem != "." && stem != "..");
  for (unsigned char c : stem) SLIDE_FUZZ_CHECK(safe_byte(c));
  SLIDE_FUZZ_CHECK(slide_file_stem(id) == stem);

  bool id_is_safe = !id.empty() && id.size() <= kMaxSlideStemBytes && id.front() != '.';
  for (unsigned char c : id) id_is_safe = id_is_safe && safe_byte(c);
  if (id_is_safe) {
    SLIDE_FUZZ_CHECK(stem == id);
  } else {
    SLIDE_FUZZ_CHECK(stem.size() >= 13);
    const std::string_view suffix = std::string_view(stem).substr(stem.size() - 13);
    SLIDE_FUZZ_CHECK(suffix[0] == '~');
    for (char c : suffix.substr(1)) SLIDE_FUZZ_CHECK((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
  }
  return 0;
}
