// One rule for file names made from slide ids (bags, QC pictures, exports, heatmaps, attention
// files, predictions). Slide ids come from file names and from manifests users write, so they may
// hold anything: path separators, "..", control bytes, thousands of characters.
//
// slide_file_stem(id) returns a name component (no directory, no extension) that
//   - never leaves the directory it is joined to: '/', '\\', NUL and control bytes (< 0x20,
//     0x7f) become '_', and a leading '.' becomes '_' (so "", ".", ".." and hidden names are
//     impossible);
//   - keeps every other byte, UTF-8 included, so ordinary ids ("TCGA-A1-0001.svs" -> itself)
//     stay readable and unchanged;
//   - is unique: whenever the name differs from the id (a byte replaced, or shortened), it ends
//     in "~" and 12 hex digits of the 64-bit FNV-1a hash of the full id, so "a/b" and "a_b" (or
//     two long ids sharing a prefix) never collide;
//   - is at most kMaxSlideStemBytes bytes: longer ids are cut at a UTF-8 character boundary
//     before the hash suffix. 255 bytes is the name limit of ext4, XFS, btrfs and tmpfs; the
//     stem leaves 55 bytes for what tools append (suffixes such as "_t123_x4096_y8192", an
//     extension, and write_file_atomic's ".tmp.<pid>").
// The full id is always kept inside the file as well (the bag's slide_id attribute, a CSV
// column), so nothing is lost by shortening.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace slide::core {

inline constexpr size_t kMaxSlideStemBytes = 200;

[[nodiscard]] std::string slide_file_stem(std::string_view slide_id);

// The longest prefix of `text` of at most `max_bytes` bytes that does not split a UTF-8
// character (a cut inside one backs up to its first byte), so that a shortened message stays
// valid UTF-8 where it goes into JSON. `text` itself when it fits.
[[nodiscard]] std::string utf8_prefix(std::string_view text, size_t max_bytes);

// The length of the well-formed UTF-8 sequence at text[i] (1-4; Unicode 15, table 3-7: no
// overlong forms, no surrogates, nothing above U+10FFFF), or 0 when text[i] does not start one.
// i < text.size().
[[nodiscard]] size_t utf8_sequence_length(std::string_view text, size_t i);

// `text` with every byte that is not part of a well-formed UTF-8 sequence written as "%XX"
// (upper-case hex): valid UTF-8 comes back unchanged, anything else becomes valid UTF-8 without
// losing which bytes it had (a Latin-1 file name "Pr\xE4parat" becomes "Pr%E4parat"). For slide
// ids and labels, which go into JSON, HDF5 attributes and CSVs as text: a file name of another
// encoding would otherwise be replaced by U+FFFD there, and two names could become one.
[[nodiscard]] std::string utf8_or_escaped(std::string_view text);

}  // namespace slide::core
