#include "slide/train/tensor.h"

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace slide::train {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kI32: return 4;
    case DType::kU8: return 1;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kI32: return "i32";
    case DType::kU8: return "u8";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kPlain: return "plain";
    case Layout::kNChw8c: return "nChw8c";
    case Layout::kNChw16c: return "nChw16c";
    case Layout::kNhwc: return "nhwc";
  }
  return "?";
}

void Tensor::host_access_failure() const {
  std::fprintf(stderr, "slidestream: internal error: host code read the elements of a %s tensor %s on %s "
               "(Tensor::data is for host tensors; download it through Backend::download)\n",
               dtype_name(dtype_), shape_string(shape_).c_str(), device_name(device_));
  std::abort();
}

std::string shape_string(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Tensor::Storage::~Storage() {
  if (alloc != nullptr && ptr != nullptr) alloc->deallocate(ptr, bytes);
}

namespace {
thread_local std::vector<Tensor::WeakStorage>* t_storage_capture = nullptr;
}  // namespace

std::vector<Tensor::WeakStorage>* Tensor::set_storage_capture(std::vector<WeakStorage>* sink) {
  std::vector<WeakStorage>* before = t_storage_capture;
  t_storage_capture = sink;
  return before;
}

Tensor Tensor::WeakStorage::lock() const {
  Tensor t;
  std::shared_ptr<Storage> s = storage_.lock();
  if (s == nullptr || s->alloc == nullptr) return t;
  t.storage_ = std::move(s);
  t.shape_ = {static_cast<int64_t>(t.storage_->bytes)};
  t.numel_ = t.shape_[0];
  t.dtype_ = DType::kU8;
  t.device_ = t.storage_->alloc->device();
  return t;
}

void Tensor::evict_storage() {
  if (storage_ == nullptr || storage_->alloc == nullptr || storage_->ptr == nullptr) return;
  storage_->alloc->deallocate(storage_->ptr, storage_->bytes);
  storage_->ptr = nullptr;
}

Status Tensor::restore_storage(const std::string& what) {
  if (!storage_evicted()) return slide::core::ok_status();
  SLIDE_ASSIGN_OR_RETURN(storage_->ptr, storage_->alloc->allocate(storage_->bytes, what));
  return slide::core::ok_status();
}

Result<Tensor> Tensor::empty(const Shape& shape, DType dtype, Allocator& alloc, const std::string& what) {
  int64_t n = 1;
  for (int64_t e : shape) {
    if (e < 0) return slide::core::invalid_argument(what + ": negative extent in shape " + shape_string(shape));
    if (e != 0 && n > std::numeric_limits<int64_t>::max() / 16 / e)
      return slide::core::invalid_argument(what + ": shape " + shape_string(shape) + " is too large");
    n *= e;
  }
  Tensor t;
  t.shape_ = shape;
  t.numel_ = n;
  t.dtype_ = dtype;
  t.device_ = alloc.device();
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>();
  if (bytes > 0) {
    SLIDE_ASSIGN_OR_RETURN(void* p, alloc.allocate(bytes, what + " " + shape_string(shape) + " " + dtype_name(dtype)));
    storage->alloc = &alloc;
    storage->ptr = p;
    storage->bytes = bytes;
  }
  t.storage_ = std::move(storage);
  if (t_storage_capture != nullptr && bytes > 0) {
    WeakStorage w;
    w.storage_ = t.storage_;
    t_storage_capture->push_back(std::move(w));
  }
  return t;
}

Result<Tensor> Tensor::zeros(const Shape& shape, DType dtype, Allocator& alloc, const std::string& what) {
  SLIDE_ASSIGN_OR_RETURN(Tensor t, empty(shape, dtype, alloc, what));
  SLIDE_RETURN_IF_ERROR(alloc.zero_bytes(t.raw(), t.bytes()));
  return t;
}

Result<Tensor> Tensor::clone(const std::string& what) const {
  if (!storage_) return Tensor();
  Allocator* alloc = storage_->alloc != nullptr ? storage_->alloc : &cpu_allocator();
  SLIDE_ASSIGN_OR_RETURN(Tensor t, empty(shape_, dtype_, *alloc, what));
  SLIDE_RETURN_IF_ERROR(alloc->copy_bytes(t.raw(), raw(), bytes()));
  t.layout_ = layout_;
  return t;
}

Result<Tensor> Tensor::view(int64_t offset, const Shape& shape) const {
  int64_t n = 1;
  for (int64_t e : shape) {
    if (e < 0) return slide::core::invalid_argument("view " + shape_string(shape) + ": negative extent");
    if (e != 0 && n > numel_ / e + 1) n = numel_ + 1;  // saturate: larger than this tensor anyway
    else n *= e;
  }
  if (offset < 0 || n > numel_ || offset > numel_ - n)
    return slide::core::invalid_argument("view of " + shape_string(shape) + " at element " + std::to_string(offset) +
                                         " does not fit in a tensor of " + shape_string(shape_));
  if (layout_ != Layout::kPlain)
    return slide::core::invalid_argument("view of a tensor in the " + std::string(layout_name(layout_)) + " layout");
  Tensor t = *this;
  t.shape_ = shape;
  t.numel_ = n;
  t.offset_bytes_ = offset_bytes_ + static_cast<size_t>(offset) * dtype_size(dtype_);
  return t;
}

Status Tensor::set_layout(Layout layout) {
  if (layout == Layout::kNhwc && rank() != 4)
    return slide::core::invalid_argument("layout nhwc for a tensor of shape " + shape_string(shape_) +
                                         ": needs [N, C, H, W]");
  const int64_t block = layout == Layout::kNChw8c ? 8 : layout == Layout::kNChw16c ? 16 : 1;
  if (block > 1 && (rank() != 4 || dim(1) % block != 0))
    return slide::core::invalid_argument(std::string("layout ") + layout_name(layout) + " for a tensor of shape " +
                                         shape_string(shape_) + ": needs [N, C, H, W] with C a multiple of " +
                                         std::to_string(block));
  layout_ = layout;
  return slide::core::ok_status();
}

Result<Tensor> Tensor::reshape(const Shape& shape) const {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  if (n != numel_)
    return slide::core::invalid_argument("reshape " + shape_string(shape_) + " to " + shape_string(shape) +
                                         ": element counts differ");
  if (layout_ != Layout::kPlain)
    return slide::core::invalid_argument("reshape " + shape_string(shape_) + " to " + shape_string(shape) + ": the tensor is in the " +
                                         layout_name(layout_) + " layout (Backend::to_plain first)");
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Status Tensor::copy_from(const Tensor& src) {
  if (src.shape_ != shape_ || src.dtype_ != dtype_ || src.layout_ != layout_ || src.device_ != device_)
    return slide::core::invalid_argument("copy of a " + std::string(dtype_name(src.dtype_)) + " " +
                                         shape_string(src.shape_) + " " + layout_name(src.layout_) + " tensor on " +
                                         device_name(src.device_) + " into a " + dtype_name(dtype_) + " " +
                                         shape_string(shape_) + " " + layout_name(layout_) + " one on " +
                                         device_name(device_));
  if (storage_ == nullptr || bytes() == 0 || raw() == src.raw()) return slide::core::ok_status();
  return storage_->alloc->copy_bytes(raw(), src.raw(), bytes());
}

Status Tensor::set_zero() {
  if (storage_ == nullptr || bytes() == 0) return slide::core::ok_status();
  return storage_->alloc->zero_bytes(raw(), bytes());
}

void Tensor::fill_zero() {
  assert(device_ == Device::kCpu && "Tensor::fill_zero is for host tensors (device tensors: Tensor::zeros)");
  if (bytes() > 0) std::memset(raw(), 0, bytes());
}

}  // namespace slide::train
