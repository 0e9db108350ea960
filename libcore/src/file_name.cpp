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

size_t utf8_sequence_length(std::string_view text, size_t i) {
  auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b = at(i);
  if (b < 0x80) return 1;
  // Unicode 15, table 3-7 (well-formed UTF-8 byte sequences): the lead byte fixes the length and
  // the range of the second byte (no overlong forms, no surrogates, nothing above U+10FFFF).
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) n = 2;
  else if (b == 0xE0) n = 3, lo = 0xA0;
  else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) n = 3;
  else if (b == 0xED) n = 3, hi = 0x9F;
  else if (b == 0xF0) n = 4, lo = 0x90;
  else if (b >= 0xF1 && b <= 0xF3) n = 4;
  else if (b == 0xF4) n = 4, hi = 0x8F;
  else return 0;
  if (i + n > text.size()) return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  return n;
}

std::string utf8_or_escaped(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = utf8_sequence_length(text, i);
    if (n > 0) {
      out.append(text.substr(i, n));
      i += n;
    } else {
      char hex[4];
      std::snprintf(hex, sizeof hex, "%%%02X", static_cast<unsigned>(static_cast<unsigned char>(text[i])));
      out += hex;
      ++i;
    }
  }
  return out;
}

}  // namespace slide::core
