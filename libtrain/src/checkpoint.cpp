#include "slide/train/checkpoint.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "kernels/formulas.h"
#include "slide/core/file.h"

namespace slide::train {

namespace {

const char* st_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kI32: return "I32";
    case DType::kU8: return "U8";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

// Element i of a floating host tensor (f32, f64, f16, bf16) as a double.
double float_element(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF64: return t.data<double>()[i];
    case DType::kF16: return formulas::f16_to_f32(t.data<uint16_t>()[i]);
    case DType::kBF16: return formulas::bf16_to_f32(t.data<uint16_t>()[i]);
    default: return t.data<float>()[i];
  }
}

// The index of the first NaN or inf element of a floating tensor (f32, f64, f16, bf16), or -1
// (other dtypes: -1).
int64_t first_non_finite(const Tensor& t) {
  if (t.dtype() == DType::kF16 || t.dtype() == DType::kBF16) {
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(float_element(t, i))) return i;
  }
  if (t.dtype() == DType::kF32) {
    const float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return i;
  } else if (t.dtype() == DType::kF64) {
    const double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (!std::isfinite(p[i])) return i;
  }
  return -1;
}

}  // namespace

Status save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                        const std::map<std::string, std::string>& metadata, Backend* device) {
  nlohmann::json header = nlohmann::json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (t == nullptr || !t->defined()) return slide::core::invalid_argument(path + ": tensor '" + name + "' is undefined");
    if (!names.insert(name).second) return slide::core::invalid_argument(path + ": duplicate tensor name '" + name + "'");
    SLIDE_RETURN_IF_ERROR(check_transfer_backend(*t, device, path + ": tensor '" + name + "'"));
    header[name] = {{"dtype", st_dtype(t->dtype())}, {"shape", t->shape()}, {"data_offsets", {offset, offset + t->bytes()}}};
    offset += t->bytes();
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the format pads the header with spaces to 8 bytes
  std::vector<uint8_t> out(8 + h.size() + offset);
  const uint64_t n = h.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>(n >> (8 * i));
  std::memcpy(out.data() + 8, h.data(), h.size());
  uint8_t* data = out.data() + 8 + h.size();
  for (const auto& [name, t] : tensors) {
    if (t->device() == Device::kCpu) {
      std::memcpy(data, t->raw(), t->bytes());
    } else {
      SLIDE_ASSIGN_OR_RETURN(Tensor host, to_host(*device, *t, name + " (host copy)"));
      std::memcpy(data, host.raw(), host.bytes());
    }
    data += t->bytes();
  }
  return slide::core::write_file_atomic(path, out);
}
namespace {

// A PyTorch file given where safetensors are expected (torch.save's zip archive, "PK\x03\x04", or
// a bare pickle: the PROTO opcode 0x80 then protocol 2..5): kInvalidArgument naming the conversion
// script. `first` holds the file's first bytes (up to 9). A safetensors file starts with its
// header length, little-endian, whose low byte may well be 0x80 (a header of 640 bytes: 80 02 00
// ...), then the header's '{' at byte 8: such a file is never taken for PyTorch's. Else ok.
Status refuse_pytorch_file(const std::string& path, std::string_view first) {
  const bool safetensors_like = first.size() >= 9 && first[8] == '{' && first.substr(4, 4) == std::string_view("\0\0\0\0", 4);
  const bool zip = !safetensors_like && first.substr(0, 4) == std::string_view("PK\x03\x04", 4);
  const bool pickle = !safetensors_like && first.size() >= 2 && static_cast<uint8_t>(first[0]) == 0x80 &&
                      static_cast<uint8_t>(first[1]) >= 2 && static_cast<uint8_t>(first[1]) <= 5;
  if (!zip && !pickle) return slide::core::ok_status();
  return slide::core::invalid_argument(
      path + ": a PyTorch " + (zip ? "archive (torch.save)" : "pickle") +
      ", not safetensors: convert it once with /usr/bin/python3 scripts/convert_torchvision_weights.py " + path +
      " OUT.safetensors --model MODEL (it never runs the pickle's code; see the README's Security section)");
}

}  // namespace

Status load_safetensors(const std::string& path, const std::vector<NamedTensor>& into, Backend* device) {
  SLIDE_ASSIGN_OR_RETURN(std::string bytes, slide::core::read_file(path));
  SLIDE_RETURN_IF_ERROR(refuse_pytorch_file(path, std::string_view(bytes).substr(0, 9)));
  if (bytes.size() < 8) return slide::core::data_loss(path + ": shorter than a safetensors header");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[static_cast<size_t>(i)])} << (8 * i);
  if (n > bytes.size() - 8) return slide::core::data_loss(path + ": header length " + std::to_string(n) + " exceeds the file");
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n), nullptr, false);
  if (header.is_discarded() || !header.is_object()) return slide::core::data_loss(path + ": header is not a JSON object");
  const size_t base = 8 + n;
  for (const auto& [name, t] : into) {
    if (!header.contains(name)) return slide::core::invalid_argument(path + ": no tensor '" + name + "'");
    SLIDE_RETURN_IF_ERROR(check_transfer_backend(*t, device, path + ": tensor '" + name + "'"));
    const auto& e = header[name];
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      return slide::core::data_loss(path + ": entry '" + name + "' is malformed");
    Shape shape;
    try {
      // Integers only: a float such as 1e300 converted to int64 is undefined behaviour, and a
      // negative offset would wrap to a huge unsigned one (found by tests/fuzz/fuzz_safetensors).
      auto integers = [](const nlohmann::json& a, bool non_negative) {
        if (!a.is_array()) return false;
        for (const auto& v : a)
          if (!(v.is_number_unsigned() || (!non_negative && v.is_number_integer()))) return false;
        return true;
      };
      if (!integers(e["shape"], true) || !integers(e["data_offsets"], true))
        return slide::core::data_loss(path + ": entry '" + name + "' has a shape or data offsets that are not "
                                      "non-negative integers");
      shape = e["shape"].get<Shape>();
      const auto off = e["data_offsets"].get<std::vector<uint64_t>>();
      if (e["dtype"].get<std::string>() != st_dtype(t->dtype()) || shape != t->shape())
        return slide::core::invalid_argument(path + ": tensor '" + name + "' is " + e["dtype"].get<std::string>() + " " +
                                             shape_string(shape) + ", expected " + st_dtype(t->dtype()) + " " +
                                             shape_string(t->shape()));
      if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != t->bytes() || off[1] > bytes.size() - base)
        return slide::core::data_loss(path + ": tensor '" + name + "' has data offsets outside the file");
      // A device tensor is read into a host copy, checked there, then uploaded: it never holds
      // the file's values unless they are all finite.
      Tensor host = *t;
      if (t->device() != Device::kCpu) {
        SLIDE_ASSIGN_OR_RETURN(host, Tensor::empty(t->shape(), t->dtype(), cpu_allocator(), name + " (host copy)"));
      }
      std::memcpy(host.raw(), bytes.data() + base + off[0], t->bytes());
      if (const int64_t bad = first_non_finite(host); bad >= 0) {
        const double v = float_element(host, bad);
        std::memset(host.raw(), 0, host.bytes());  // never left holding the file's non-finite values
        return slide::core::data_loss(path + ": tensor '" + name + "' holds " + (std::isnan(v) ? "NaN" : "inf") +
                                      " (element " + std::to_string(bad) + " of " + shape_string(shape) +
                                      "): refusing weights that are not finite");
      }
      if (t->device() != Device::kCpu) {
        Tensor dst = *t;  // shares t's storage
        SLIDE_RETURN_IF_ERROR(device->upload(host, dst));
      }
    } catch (const nlohmann::json::exception& ex) {
      return slide::core::data_loss(path + ": entry '" + name + "': " + ex.what());
    }
  }
  return slide::core::ok_status();
}

Result<std::map<std::string, Shape>> read_safetensors_shapes(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return slide::core::errno_status(errno, "open " + path);
  auto close = [&] { std::fclose(f); };
  uint8_t len_bytes[9];
  const size_t first = std::fread(len_bytes, 1, 9, f);
  if (auto s = refuse_pytorch_file(path, std::string_view(reinterpret_cast<const char*>(len_bytes), first)); !s.ok()) {
    close();
    return s;
  }
  if (first < 8) {
    close();
    return slide::core::data_loss(path + ": not a safetensors file (shorter than its 8-byte header length)");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  std::fseek(f, 0, SEEK_END);
  const long size = std::ftell(f);
  if (n > 100u << 20 || size < 0 || n > static_cast<uint64_t>(size) - 8) {
    close();
    return slide::core::data_loss(path + ": safetensors header length " + std::to_string(n) +
                                  " is past the end of the file or over 100 MB");
  }
  std::string header(n, '\0');
  std::fseek(f, 8, SEEK_SET);
  const size_t got = std::fread(header.data(), 1, n, f);
  close();
  if (got != n) return slide::core::data_loss(path + ": safetensors header is cut short");
  std::map<std::string, Shape> out;
  try {
    const auto j = nlohmann::json::parse(header);
    if (!j.is_object()) return slide::core::data_loss(path + ": safetensors header is not a JSON object");
    for (const auto& [name, entry] : j.items()) {
      if (name == "__metadata__") continue;
      Shape shape;
      // Non-negative integers only (a float's conversion to int64 is undefined past its range).
      for (const auto& d : entry.at("shape")) {
        if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          return slide::core::data_loss(path + ": safetensors tensor " + name + ": shape entry " + d.dump() +
                                        " is not a non-negative integer");
        shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
      }
      out[name] = shape;
    }
  } catch (const nlohmann::json::exception& e) {
    return slide::core::data_loss(path + ": safetensors header: " + e.what());
  }
  return out;
}

}  // namespace slide::train
