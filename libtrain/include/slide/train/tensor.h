// Tensor: a shape, a dtype, a device and storage from that device's Allocator.
//
// Dense and contiguous, row-major over its shape (images NCHW: N samples, C channels, H rows,
// W columns; each op documents its shapes). Copies share storage (a shared_ptr); clone() copies
// the bytes; view() is a contiguous window of another tensor's elements, sharing its storage. Storage returns to its allocator when the last tensor using it goes away.
//
// Layout: an image tensor may instead be in one of oneDNN's channel-blocked layouts (Layout
// below), which only the cpu backend produces, so that training's activations stay blocked from
// layer to layer, or channels last, which only cuda produces (the inference graph's half-precision
// activations); Backend::to_plain gives the row-major view back. Anything that reads a tensor's
// elements on the host reads a plain one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "slide/core/status.h"
#include "slide/train/allocator.h"

namespace slide::train {

// kF64 exists for the reference backend's gradient checks (central differences in double).
// kU8 holds decoded images (the RAM dataset cache). kF16 (IEEE binary16) and kBF16 (bfloat16) are
// half-precision storage for mixed precision, held as their 16-bit patterns (uint16_t); the
// `cast` op converts them (kernels/formulas.h: round to nearest, ties to even).
enum class DType : uint8_t { kF32 = 0, kF64 = 1, kI32 = 2, kU8 = 3, kF16 = 4, kBF16 = 5 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);

// How the elements lie in storage. kPlain: row-major over the shape (NCHW for images), what every
// op accepts and the reference backend produces. kNChw8c / kNChw16c: oneDNN's channel-blocked
// image layouts, [N][C/b][H][W][b] with b = 8 or 16, on which its convolution, batch norm and
// pooling kernels run without reorders; used only for [N,C,H,W] with C a multiple of b, so the
// bytes are the plain ones' in another order (no padding). kNhwc: channels last, [N][H][W][C] for a
// [N, C, H, W] tensor, the layout cuDNN's tensor-core convolutions read and write (PyTorch's
// channels_last); only the cuda backend produces it, for the inference graph's half-precision
// activations (backend.h).
enum class Layout : uint8_t { kPlain = 0, kNChw8c = 1, kNChw16c = 2, kNhwc = 3 };
const char* layout_name(Layout l);

using Shape = std::vector<int64_t>;
std::string shape_string(const Shape& s);  // "[2, 3, 8, 8]"

class Tensor {
 public:
  Tensor() = default;  // undefined: no storage, numel() == 0

  // Uninitialised storage for `shape` (every extent >= 0) from `alloc`; `what` names the tensor
  // in a budget error. Errors: kInvalidArgument (negative extent or byte count overflow), those
  // of Allocator::allocate (kResourceExhausted when the budget is exceeded).
  [[nodiscard]] static Result<Tensor> empty(const Shape& shape, DType dtype, Allocator& alloc,
                                            const std::string& what = "tensor");
  // The same, filled with zeros.
  [[nodiscard]] static Result<Tensor> zeros(const Shape& shape, DType dtype, Allocator& alloc,
                                            const std::string& what = "tensor");

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  size_t rank() const { return shape_.size(); }
  int64_t numel() const { return numel_; }
  size_t bytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  Layout layout() const { return layout_; }
  // Relabels this tensor object's element order (not copies made before): for backends, which
  // set it on the outputs they write. Errors: kInvalidArgument for a blocked layout on a tensor
  // that is not [N,C,H,W] with C a multiple of the block, or kNhwc on one that is not [N,C,H,W].
  [[nodiscard]] Status set_layout(Layout layout);

  // The elements, for host code: a tensor in host memory (device cpu) only. Host code never reads
  // a device tensor's elements (docs/design.md, section 5): it downloads them (Backend::download).
  // Calling data<T>() on a tensor of another device is a programming error, and ends the process
  // with a message naming the tensor's shape and device (a device pointer read on the host would
  // fault anyway, or worse, read garbage on a simulated device).
  template <typename T>
  T* data() const {
    if (device_ != Device::kCpu) host_access_failure();
    return static_cast<T*>(raw());
  }
  // The elements' address on the tensor's own device, for backends and allocators (which know
  // their device), never dereferenced by host code.
  template <typename T>
  T* ptr() const { return static_cast<T*>(raw()); }
  void* raw() const { return storage_ ? static_cast<char*>(storage_->ptr) + offset_bytes_ : nullptr; }

  // A view: `shape`'s elements starting `offset` elements into this tensor's, sharing its storage
  // (writes through either are seen by both; the storage lives while any view does). For a flat
  // buffer that tensors are carved from (the gradient buckets). Errors: kInvalidArgument when the
  // view does not fit inside this tensor, for a negative offset or extent, or for a tensor in a
  // blocked layout.
  [[nodiscard]] Result<Tensor> view(int64_t offset, const Shape& shape) const;
  // True when both see the same storage (views of one buffer, or copies).
  bool shares_storage(const Tensor& other) const { return storage_ != nullptr && storage_ == other.storage_; }
  // A deep copy (same layout) from the same allocator. Errors: those of empty().
  [[nodiscard]] Result<Tensor> clone(const std::string& what = "tensor copy") const;
  // The same storage seen with another shape of the same element count. Errors: kInvalidArgument,
  // also for a tensor in a blocked layout.
  [[nodiscard]] Result<Tensor> reshape(const Shape& shape) const;
  // Copies src's bytes into this tensor's storage on their (common) device, through the storage's
  // allocator (Allocator::copy_bytes). Errors: kInvalidArgument when shapes, dtypes, layouts or
  // devices differ; the device's.
  [[nodiscard]] Status copy_from(const Tensor& src);
  // Sets every element to zero (host tensors only).
  void fill_zero();
  // Sets every element to zero on any device, through the storage's allocator (Allocator::zero_bytes,
  // in its stream order). Errors: the device's; no-op for an undefined tensor.
  [[nodiscard]] Status set_zero();

  // ---- Moving a storage out of its device and back (activation offload, offload.h) ----
 private:
  struct Storage;

 public:
  // A weak reference to a tensor's storage: lock() gives the whole storage as a flat [bytes] u8
  // tensor (plain, offset 0) while some tensor still holds it, else an undefined tensor.
  class WeakStorage {
   public:
    Tensor lock() const;

   private:
    friend class Tensor;
    std::weak_ptr<Storage> storage_;
  };
  // While a sink is set on this thread, every storage Tensor::empty makes is appended to it (a
  // weak reference: the capture keeps nothing alive). Returns the sink it replaces, so scopes nest
  // (an inner scope's storages go only to the inner sink). Pass nullptr to end a capture.
  static std::vector<WeakStorage>* set_storage_capture(std::vector<WeakStorage>* sink);
  // Frees the device memory of this tensor's storage, for every tensor sharing it, whose bytes
  // the caller has copied elsewhere; raw() is null until restore_storage(). No-op when already
  // evicted or undefined.
  void evict_storage();
  // Allocates the storage again from its allocator after evict_storage() (the caller then copies
  // the bytes back). No-op when not evicted. Errors: the allocator's (kResourceExhausted).
  [[nodiscard]] Status restore_storage(const std::string& what);
  bool storage_evicted() const { return storage_ != nullptr && storage_->bytes > 0 && storage_->ptr == nullptr; }

 private:
  struct Storage {
    Allocator* alloc = nullptr;
    void* ptr = nullptr;
    size_t bytes = 0;
    ~Storage();
  };
  [[noreturn]] void host_access_failure() const;
  std::shared_ptr<Storage> storage_;
  size_t offset_bytes_ = 0;  // where this tensor's elements start in storage_ (views)
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  Layout layout_ = Layout::kPlain;
};

}  // namespace slide::train
