#include "slide/core/hash.h"

#include <openssl/evp.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

namespace slide::core {

namespace {

using DigestCtx = std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)>;

Result<DigestCtx> sha256_init() {
  DigestCtx ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) return internal_error("SHA-256 init");
  return ctx;
}

Result<std::string> sha256_hex(EVP_MD_CTX* ctx, const std::string& what) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx, md, &len) != 1) return internal_error(what + ": SHA-256 final");
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned i = 0; i < len; ++i) {
    hex += kHex[md[i] >> 4];
    hex += kHex[md[i] & 15];
  }
  return hex;
}

}  // namespace

Result<std::string> sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) return not_found(path + ": no such file");
    return permission_denied(path + ": cannot be read");
  }
  SLIDE_ASSIGN_OR_RETURN(DigestCtx ctx, sha256_init());
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (in.gcount() > 0 && EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(in.gcount())) != 1)
      return internal_error(path + ": SHA-256 update");
  }
  if (in.bad()) return internal_error(path + ": read error");
  return sha256_hex(ctx.get(), path);
}

Result<std::string> sha256_bytes(std::string_view bytes) {
  SLIDE_ASSIGN_OR_RETURN(DigestCtx ctx, sha256_init());
  if (EVP_DigestUpdate(ctx.get(), bytes.data(), bytes.size()) != 1) return internal_error("SHA-256 update");
  return sha256_hex(ctx.get(), "bytes");
}

}  // namespace slide::core
