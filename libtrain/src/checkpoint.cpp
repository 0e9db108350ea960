#include "slide/train/checkpoint.h"

#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "slide/core/file.h"

namespace slide::train {

namespace {

const char* st_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kI32: return "I32";
    case DType::kU8: return "U8";
  }
  return "?";
}

}  // namespace

Status save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (t == nullptr || !t->defined()) return slide::core::invalid_argument(path + ": tensor '" + name + "' is undefined");
    if (!names.insert(name).second) return slide::core::invalid_argument(path + ": duplicate tensor name '" + name + "'");
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
    std::memcpy(data, t->raw(), t->bytes());
    data += t->bytes();
  }
  return slide::core::write_file_atomic(path, out);
}

Status load_safetensors(const std::string& path, const std::vector<NamedTensor>& into) {
  SLIDE_ASSIGN_OR_RETURN(std::string bytes, slide::core::read_file(path));
  if (bytes.size() < 8) return slide::core::data_loss(path + ": shorter than a safetensors header");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[static_cast<size_t>(i)])} << (8 * i);
  if (n > bytes.size() - 8) return slide::core::data_loss(path + ": header length " + std::to_string(n) + " exceeds the file");
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n), nullptr, false);
  if (header.is_discarded() || !header.is_object()) return slide::core::data_loss(path + ": header is not a JSON object");
  const size_t base = 8 + n;
  for (const auto& [name, t] : into) {
    if (!header.contains(name)) return slide::core::invalid_argument(path + ": no tensor '" + name + "'");
    const auto& e = header[name];
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      return slide::core::data_loss(path + ": entry '" + name + "' is malformed");
    Shape shape;
    try {
      shape = e["shape"].get<Shape>();
      const auto off = e["data_offsets"].get<std::vector<uint64_t>>();
      if (e["dtype"].get<std::string>() != st_dtype(t->dtype()) || shape != t->shape())
        return slide::core::invalid_argument(path + ": tensor '" + name + "' is " + e["dtype"].get<std::string>() + " " +
                                             shape_string(shape) + ", expected " + st_dtype(t->dtype()) + " " +
                                             shape_string(t->shape()));
      if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != t->bytes() || base + off[1] > bytes.size())
        return slide::core::data_loss(path + ": tensor '" + name + "' has data offsets outside the file");
      std::memcpy(t->raw(), bytes.data() + base + off[0], t->bytes());
    } catch (const nlohmann::json::exception& ex) {
      return slide::core::data_loss(path + ": entry '" + name + "': " + ex.what());
    }
  }
  return slide::core::ok_status();
}

}  // namespace slide::train
