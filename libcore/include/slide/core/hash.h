// Content hashes of files (what a store or a bag records to know its inputs again).
#pragma once

#include <string>
#include <string_view>

#include "slide/core/status.h"

namespace slide::core {

// The SHA-256 (FIPS 180-4, by OpenSSL's libcrypto EVP interface) of the file at `path`, as 64
// lowercase hex digits, read in 1 MiB blocks (memory flat in the file's size). Errors: kNotFound
// (no such file), kPermissionDenied (it cannot be opened), kInternal (a read error, or OpenSSL's).
[[nodiscard]] Result<std::string> sha256_file(const std::string& path);

// The SHA-256 of `bytes` (the same digest and hex form). Errors: kInternal (OpenSSL's).
[[nodiscard]] Result<std::string> sha256_bytes(std::string_view bytes);

}  // namespace slide::core
