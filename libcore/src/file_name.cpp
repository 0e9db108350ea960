#include "slide/core/file_name.h"

#include <cstdint>
#include <cstdio>

namespace slide::core {
namespace {

// FNV-1a, 64 bit (Fowler, Noll, Vo; http://www.isthe.com/chongo/tech/comp/fnv/).
uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

std::string slide_file_stem(std::string_view slide_id) {
  std::string out;
  out.reserve(slide_id.size());
  for (unsigned char c : slide_id) {
    bool bad = c == '/' || c == '\\' || c < 0x20 || c == 0x7f;
    out.push_back(bad ? '_' : static_cast<char>(c));
  }
  if (out.empty()) out.push_back('_');
  if (out[0] == '.') out[0] = '_';
  constexpr size_t kSuffix = 13;  // "~" + 12 hex digits
  if (out == slide_id && out.size() <= kMaxSlideStemBytes) return out;
  if (out.size() > kMaxSlideStemBytes - kSuffix) out = utf8_prefix(out, kMaxSlideStemBytes - kSuffix);
  char hex[16];
  std::snprintf(hex, sizeof hex, "~%012llx",
                static_cast<unsigned long long>(fnv1a64(slide_id) & 0xffffffffffffull));
  return out + hex;
}

std::string utf8_prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  size_t cut = max_bytes;
  // Back up to the first byte of a UTF-8 character (continuation bytes are 10xxxxxx).
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return std::string(text.substr(0, cut));
}

}  // namespace slide::core
