// The cuda backend (cuda_backend.h): argument checks (op_checks.h, with the device set to cuda),
// then cuDNN, cuBLAS or our kernels on the device's stream. Mirrors reference_backend.cpp op for op.
#include "cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "conv_plan.h"
#include "cublas_api.h"
#include "cuda_fence.h"
#include "slide/core/log.h"
#include "slide/train/copy_engine.h"
#include "cuda_check.h"
#include "kernels.h"
#include "kernels/formulas.h"
#include "kernels/launch.h"
#include "op_checks.h"

namespace slide::train::cuda {
namespace {

using slide::core::ok_status;
using slide::core::StatusCode;

constexpr detail::DTypes kDTypes{true, false, false, Device::kCuda};
// The ops of backend.h's half-precision storage list also take f16 / bf16.
constexpr detail::DTypes kHalfDTypes{true, false, false, Device::kCuda, true};
// ... and, for the inference graph's half-precision ops (fused convolution, max pooling), tensors in
// a non-plain layout: channels last (kNhwc) is read, the blocked ones refused (plain_or_nhwc).
constexpr detail::DTypes kHalfLayoutDTypes{true, false, true, Device::kCuda, true};

// OK when every defined tensor is plain or channels last (the layouts cuda reads).
Status plain_or_nhwc(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t != nullptr && t->defined() && t->layout() != Layout::kPlain && t->layout() != Layout::kNhwc)
      return slide::core::invalid_argument(std::string(op) + ": a tensor in the " + layout_name(t->layout()) +
                                           " layout, which cuda does not read");
  return ok_status();
}

// Channels last in training (backend.h): the image tensors of one call (the defined ones among
// `images`) all plain or all kNhwc; `params` (filters, biases) plain. True when channels last.
Result<bool> channels_last(const char* op, std::initializer_list<const Tensor*> images,
                           std::initializer_list<const Tensor*> params = {}) {
  SLIDE_RETURN_IF_ERROR(plain_or_nhwc(op, images));
  const Tensor* first = nullptr;
  for (const Tensor* t : images) {
    if (!t->defined()) continue;
    if (first == nullptr) first = t;
    if (t->layout() != first->layout())
      return slide::core::invalid_argument(std::string(op) + ": image tensors in two layouts (" +
                                           layout_name(first->layout()) + " and " + layout_name(t->layout()) +
                                           "); one layout per call");
  }
  for (const Tensor* t : params)
    if (t->defined() && t->layout() != Layout::kPlain)
      return slide::core::invalid_argument(std::string(op) + ": a parameter in the " + layout_name(t->layout()) +
                                           " layout; parameters are plain");
  return first != nullptr && first->layout() == Layout::kNhwc;
}
Layout layout_of(bool nhwc) { return nhwc ? Layout::kNhwc : Layout::kPlain; }

// --- Device state (one per device, for the process's life) ---------------------------------------

class CudaDeviceMemory final : public RawDeviceMemory {
 public:
  CudaDeviceMemory(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  Device device() const override { return Device::kCuda; }
  Result<void*> malloc(size_t bytes) override {
    SLIDE_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // cudaMalloc's error is not sticky; clear it for the next check
      return cuda_status(e, "cudaMalloc", SLIDE_CUDA_WHERE);
    }
    return p;
  }
  void free(void* p) override {
    // cudaFree waits for the device's queued work; its error (only at teardown) has no caller.
    (void)cudaSetDevice(device_);
    (void)cudaFree(p);
  }
  Status zero(void* p, size_t bytes) override {
    if (bytes == 0) return ok_status();
    SLIDE_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return ok_status();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return ok_status();
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    return ok_status();
  }

 private:
  int device_;
  cudaStream_t stream_;
};

// Pinned (page-locked) host memory for the copy engine: cudaMemcpyAsync from and to it is a DMA
// that runs beside the compute stream; from pageable memory it would be staged by the host.
// Cached by size (CachingDeviceAllocator) since cudaHostAlloc costs milliseconds. Tensors on it
// are host tensors (Device::kCpu).
class PinnedHostMemory final : public RawDeviceMemory {
 public:
  explicit PinnedHostMemory(int device) : device_(device) {}
  Device device() const override { return Device::kCpu; }
  Result<void*> malloc(size_t bytes) override {
    SLIDE_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_status(e, "cudaHostAlloc", SLIDE_CUDA_WHERE);
    }
    return p;
  }
  void free(void* p) override { (void)cudaFreeHost(p); }  // teardown only: no caller to report to
  Status zero(void* p, size_t bytes) override {
    std::memset(p, 0, bytes);
    return ok_status();
  }
  Status copy(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return ok_status();
  }

 private:
  int device_;
};

// Activation offload's copies (copy_engine.h) on a copy stream of their own. Each copy is queued
// after everything the compute stream holds so far (an event recorded there, waited for by the
// copy stream: the data to send is written, and the memory to fill is no longer read), and
// records an event of its own that wait() synchronises the host on. So after wait() the bytes are
// there, the source may be freed (its block goes back to the caching allocator, whose next user
// is queued on the compute stream after the copy is complete) and later compute sees the
// destination. Host buffers are pinned (PinnedHostMemory). Its calls may come from several
// threads (the trainer's prefetch thread starts input copies that the training thread orders its
// ops after): a mutex guards its events.
class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(int device, cudaStream_t compute) : device_(device), compute_(compute) {}
  ~CudaCopyEngine() override {
    (void)cudaSetDevice(device_);
    for (auto& [ticket, e] : pending_) (void)cudaEventSynchronize(e), (void)cudaEventDestroy(e);
    for (cudaEvent_t e : spare_) (void)cudaEventDestroy(e);
    if (ready_ != nullptr) (void)cudaEventDestroy(ready_);
    if (copy_ != nullptr) (void)cudaStreamDestroy(copy_);
  }
  Status init() {
    SLIDE_CUDA_CHECK(cudaSetDevice(device_));
    SLIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    SLIDE_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    pinned_ = std::make_unique<CachingDeviceAllocator>(std::make_unique<PinnedHostMemory>(device_));
    return ok_status();
  }

  Result<uint64_t> start(Backend& be, const Tensor& src, Tensor& dst, CopyDirection dir) override {
    return start_after(be, nullptr, src, dst, dir);
  }

  // With a fence: the copy stream waits for the fence's event only (a CudaFence of this device's
  // compute stream); without: for everything queued on the compute stream so far.
  Result<uint64_t> start_after(Backend& be, const DeviceFence* after, const Tensor& src, Tensor& dst,
                               CopyDirection dir) override {
    SLIDE_RETURN_IF_ERROR(validate_copy(be, src, dst, dir));
    const auto* fence = dynamic_cast<const CudaFence*>(after);
    if (after != nullptr && fence == nullptr)
      return slide::core::invalid_argument("cuda copy engine: the fence is not a cuda fence");
    std::lock_guard<std::mutex> lock(mu_);
    SLIDE_CUDA_CHECK(cudaSetDevice(device_));
    cudaEvent_t done = nullptr;
    if (!spare_.empty()) {
      done = spare_.back();
      spare_.pop_back();
    } else {
      SLIDE_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    }
    // The copy stream waits for the compute stream's work so far, or up to the fence
    // (cudaStreamWaitEvent uses the event as recorded at the time of the call, so ready_ can be
    // recorded again next time). Should a call fail, the event goes back to the spares: no
    // ticket is handed out for it.
    Status queued = [&]() -> Status {
      if (fence != nullptr) {
        SLIDE_CUDA_CHECK(cudaStreamWaitEvent(copy_, fence->event(), 0));
      } else {
        SLIDE_CUDA_CHECK(cudaEventRecord(ready_, compute_));
        SLIDE_CUDA_CHECK(cudaStreamWaitEvent(copy_, ready_, 0));
      }
      if (src.bytes() > 0)
        SLIDE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), src.bytes(),
                                         dir == CopyDirection::kToHost ? cudaMemcpyDeviceToHost
                                                                       : cudaMemcpyHostToDevice,
                                         copy_));
      SLIDE_CUDA_CHECK(cudaEventRecord(done, copy_));
      return ok_status();
    }();
    if (!queued.ok()) {
      spare_.push_back(done);
      return queued;
    }
    const uint64_t ticket = ++last_;
    pending_[ticket] = done;
    return ticket;
  }

  // The host waits without the engine's lock, so that a copy another thread starts or orders
  // meanwhile does not queue behind this one's completion (the ticket's event is this call's alone
  // once taken out of pending_).
  Status wait(uint64_t ticket) override {
    cudaEvent_t e = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(ticket);
      if (it == pending_.end())
        return slide::core::invalid_argument("cuda copy engine: no copy " + std::to_string(ticket));
      e = it->second;
      pending_.erase(it);
    }
    cudaError_t r = cudaSetDevice(device_);
    const char* call = "cudaSetDevice (activation offload copy)";
    if (r == cudaSuccess) {
      r = cudaEventSynchronize(e);
      call = "cudaEventSynchronize (activation offload copy)";
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      spare_.push_back(e);
    }
    if (r != cudaSuccess) return cuda_status(r, call, SLIDE_CUDA_WHERE);
    return ok_status();
  }

  // The compute stream waits for the copy's event on the device; the event stays pending until
  // wait() (cudaStreamWaitEvent used it as recorded now).
  Status order_ops_after(Backend& be, uint64_t ticket) override {
    (void)be;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(ticket);
    if (it == pending_.end()) return slide::core::invalid_argument("cuda copy engine: no copy " + std::to_string(ticket));
    SLIDE_CUDA_CHECK(cudaSetDevice(device_));
    SLIDE_CUDA_CHECK(cudaStreamWaitEvent(compute_, it->second, 0));
    return ok_status();
  }

  bool asynchronous() const override { return true; }
  Allocator* host_allocator() override { return pinned_.get(); }

 private:
  std::mutex mu_;
  int device_;
  cudaStream_t compute_;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  std::unordered_map<uint64_t, cudaEvent_t> pending_;
  std::vector<cudaEvent_t> spare_;
  uint64_t last_ = 0;
  std::unique_ptr<CachingDeviceAllocator> pinned_;
};

struct DeviceState {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  const CublasApi* blas = nullptr;  // cuBLAS, opened on the first device's creation (cublas_api.h)
  cublasHandle_t cublas = nullptr;
  std::unique_ptr<CachingDeviceAllocator> alloc;
  std::unique_ptr<CudaCopyEngine> copy;  // made on first use (CudaBackend::copy_engine)
  bool copy_failed = false;
  std::mutex mu;  // guards algos, unfused, planned_workspace and nondeterministic
  std::unordered_map<ConvKey, AlgoCandidate, ConvKeyHash> algos;  // the algorithm (and math type) that ran per shape
  std::unordered_set<ConvKey, ConvKeyHash> unfused;     // fused shapes cuDNN answered NOT_SUPPORTED
  // conv_workspace_bytes's answers for shapes with no algorithm cached yet (planned_workspace).
  std::unordered_map<ConvKey, size_t, ConvKeyHash> planned_workspace;
  // Shapes that run on a non-deterministic algorithm (conv_plan.h choose_candidates), warned once.
  std::unordered_set<ConvKey, ConvKeyHash> nondeterministic;
};

Status init_device(int device, DeviceState* st) {
  SLIDE_ASSIGN_OR_RETURN(const int count, usable_device_count());
  if (device < 0 || device >= count)
    return slide::core::unavailable("cuda: no device " + std::to_string(device) + " (this machine has " +
                                    std::to_string(count) + ")");
  st->device = device;
  SLIDE_CUDA_CHECK(cudaSetDevice(device));
  SLIDE_CUDA_CHECK(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking));
  SLIDE_CUDNN_CHECK(cudnnCreate(&st->cudnn));
  SLIDE_CUDNN_CHECK(cudnnSetStream(st->cudnn, st->stream));
  SLIDE_ASSIGN_OR_RETURN(st->blas, cublas_api());
  SLIDE_CUBLAS_CHECK(st->blas->cublasCreate(&st->cublas));
  SLIDE_CUBLAS_CHECK(st->blas->cublasSetStream(st->cublas, st->stream));
  // Split-K partial sums of a GEMM with half-precision output in the f32 compute type, not the
  // output's (the flag's documented meaning): each output element is rounded once, as backend.h
  // promises (cuBLAS may otherwise add the partials in f16 / bf16).
  SLIDE_CUBLAS_CHECK(st->blas->cublasSetMathMode(
      st->cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  st->alloc = std::make_unique<CachingDeviceAllocator>(std::make_unique<CudaDeviceMemory>(device, st->stream));
  return ok_status();
}

// The device's state, created on first use; never destroyed (the driver frees it at exit).
Result<DeviceState*> device_state(int device) {
  static std::mutex mu;
  static std::map<int, DeviceState*> states;
  std::lock_guard<std::mutex> lock(mu);
  auto it = states.find(device);
  if (it != states.end()) return it->second;
  auto* st = new DeviceState;
  if (Status s = init_device(device, st); !s.ok()) {
    // What was made before the failure, in reverse order (a later call may try again: a failure
    // is not cached). Their own errors are moot beside the one returned.
    if (st->cublas != nullptr) (void)st->blas->cublasDestroy(st->cublas);
    if (st->cudnn != nullptr) (void)cudnnDestroy(st->cudnn);
    if (st->stream != nullptr) (void)cudaStreamDestroy(st->stream);
    (void)cudaGetLastError();
    delete st;
    return s;
  }
  states[device] = st;
  return st;
}

// --- cuDNN descriptors (RAII) ----------------------------------------------------------------------

struct TensorDesc {
  cudnnTensorDescriptor_t d = nullptr;
  ~TensorDesc() {
    if (d) (void)cudnnDestroyTensorDescriptor(d);
  }
  // dt: CUDNN_DATA_FLOAT, or CUDNN_DATA_HALF / CUDNN_DATA_BFLOAT16 for half-precision storage;
  // format: CUDNN_TENSOR_NCHW, or CUDNN_TENSOR_NHWC (channels last: Layout::kNhwc).
  Status set(int64_t n, int64_t c, int64_t h, int64_t w, cudnnDataType_t dt = CUDNN_DATA_FLOAT,
             cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW) {
    if (!fits_cudnn_descriptor(n, c, h, w))
      return slide::core::resource_exhausted("cuda: a " + std::to_string(n) + "x" + std::to_string(c) + "x" +
                                             std::to_string(h) + "x" + std::to_string(w) +
                                             " tensor is past cuDNN's 2^31-1 elements; a smaller micro-batch runs");
    SLIDE_CUDNN_CHECK(cudnnCreateTensorDescriptor(&d));
    SLIDE_CUDNN_CHECK(cudnnSetTensor4dDescriptor(d, format, dt, static_cast<int>(n), static_cast<int>(c),
                                                 static_cast<int>(h), static_cast<int>(w)));
    return ok_status();
  }
};

struct FilterDesc {
  cudnnFilterDescriptor_t d = nullptr;
  ~FilterDesc() {
    if (d) (void)cudnnDestroyFilterDescriptor(d);
  }
  // format CUDNN_TENSOR_NHWC: the filter stored [K][R][S][C] (dimensions still given k, c, r, s).
  Status set(int64_t k, int64_t c, int64_t r, int64_t s, cudnnDataType_t dt = CUDNN_DATA_FLOAT,
             cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW) {
    SLIDE_CUDNN_CHECK(cudnnCreateFilterDescriptor(&d));
    SLIDE_CUDNN_CHECK(cudnnSetFilter4dDescriptor(d, dt, format, static_cast<int>(k), static_cast<int>(c),
                                                 static_cast<int>(r), static_cast<int>(s)));
    return ok_status();
  }
};

struct ConvDesc {
  cudnnConvolutionDescriptor_t d = nullptr;
  ~ConvDesc() {
    if (d) (void)cudnnDestroyConvolutionDescriptor(d);
  }
  // math: conv_plan.h's ConvMath (CUDNN_FMA_MATH for fp32; CUDNN_DEFAULT_MATH, TF32 tensor cores
  // permitted, for tf32 and bf16; CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION, f16 tensor cores, for fp16).
  static cudnnMathType_t cudnn_math(ConvMath math) {
    switch (math) {
      case ConvMath::kTensorOp:
        return CUDNN_DEFAULT_MATH;
      case ConvMath::kTensorOpConvert:
        return CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
      case ConvMath::kFma:
        break;
    }
    return CUDNN_FMA_MATH;
  }
  Status set(Conv2dParams p, ConvMath math) {
    SLIDE_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&d));
    SLIDE_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(d, p.pad, p.pad, p.stride, p.stride, 1, 1,
                                                      CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    SLIDE_CUDNN_CHECK(cudnnSetConvolutionMathType(d, cudnn_math(math)));
    return ok_status();
  }
};

struct ActivationDesc {
  cudnnActivationDescriptor_t d = nullptr;
  ~ActivationDesc() {
    if (d) (void)cudnnDestroyActivationDescriptor(d);
  }
  // ReLU, NaN not propagated: the op list's relu maps NaN to 0 on every other path (formulas::relu,
  // which the reference, the unfused and the half-precision cuda paths run; oneDNN's relu on cpu),
  // so the fused f32 convolution must not give NaN where cuda's own unfused fallback gives 0.
  // (torch.relu propagates NaN; the op list follows oneDNN, the CPU backend's library.)
  Status set_relu() {
    SLIDE_CUDNN_CHECK(cudnnCreateActivationDescriptor(&d));
    SLIDE_CUDNN_CHECK(cudnnSetActivationDescriptor(d, CUDNN_ACTIVATION_RELU, CUDNN_NOT_PROPAGATE_NAN, 0.0));
    return ok_status();
  }
};

// The descriptors of one convolution, checked against the op list's geometry. dt: the tensors'
// and filter's data type; the convolution computes in f32 either way (cuDNN's FLOAT_CONFIG, or
// PSEUDO_HALF_CONFIG / PSEUDO_BFLOAT16_CONFIG for half-precision storage).
struct ConvDescs {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  // format: of x, w and y alike (NCHW, or NHWC with the filter KRSC).
  Status set(const detail::ConvDims& d, Conv2dParams p, ConvMath math, cudnnDataType_t dt = CUDNN_DATA_FLOAT,
             cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW) {
    SLIDE_RETURN_IF_ERROR(x.set(d.N, d.C, d.H, d.W, dt, format));
    SLIDE_RETURN_IF_ERROR(w.set(d.K, d.C, d.R, d.S, dt, format));
    SLIDE_RETURN_IF_ERROR(conv.set(p, math));
    SLIDE_RETURN_IF_ERROR(y.set(d.N, d.K, d.P, d.Q, dt, format));
    int n = 0, c = 0, h = 0, wd = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(conv.d, x.d, w.d, &n, &c, &h, &wd));
    if (n != d.N || c != d.K || h != d.P || wd != d.Q)
      return slide::core::internal_error("cuda conv2d: cuDNN's output " + std::to_string(n) + "x" + std::to_string(c) +
                                         "x" + std::to_string(h) + "x" + std::to_string(wd) +
                                         " differs from the op list's " + std::to_string(d.N) + "x" + std::to_string(d.K) +
                                         "x" + std::to_string(d.P) + "x" + std::to_string(d.Q));
    return ok_status();
  }
};

template <typename Perf>
std::vector<AlgoCandidate> candidates_of(const Perf* perf, int n) {
  std::vector<AlgoCandidate> out;
  for (int i = 0; i < n; ++i)
    out.push_back({static_cast<int>(perf[i].algo), perf[i].status == CUDNN_STATUS_SUCCESS,
                   perf[i].determinism == CUDNN_DETERMINISTIC, perf[i].memory, static_cast<int>(perf[i].mathType)});
  return out;
}

float* f32(const Tensor& t) { return t.ptr<float>(); }
double* f64(const Tensor& t) { return t.ptr<double>(); }
// A floating tensor's storage for the kernels (f32, f16, bf16) and for cuBLAS.
CastType storage(DType t) {
  return t == DType::kF16 ? CastType::kF16 : t == DType::kBF16 ? CastType::kBF16 : CastType::kF32;
}
cudaDataType_t cublas_type(DType t) {
  return t == DType::kF16 ? CUDA_R_16F : t == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
}
cudnnDataType_t cudnn_type(DType t) {
  return t == DType::kF16 ? CUDNN_DATA_HALF : t == DType::kBF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
}
ConvStorage conv_storage(DType t) {
  return t == DType::kF16 ? ConvStorage::kF16 : t == DType::kBF16 ? ConvStorage::kBF16 : ConvStorage::kF32;
}

// A fused convolution's weights prepared on cuda: the default prepare's f32 device copies, and
// their half-precision copies for the inference graph's f16 / bf16 activations, made on first use
// and kept (one half type at a time; not thread-safe, like the backend).
class CudaFusedConvWeights final : public FusedConvWeights {
 public:
  using FusedConvWeights::FusedConvWeights;
  mutable Tensor w_half, w_half_krsc, b_half;  // w_half_krsc: [K][R][S][C] for channels last (undefined until used)
  mutable DType half = DType::kF32;            // kF32: no half copies yet
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(DeviceState* st) : st_(st) {}

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::kCuda; }
  Allocator& allocator() override { return *st_->alloc; }
  // Half-precision storage under fp16 / bf16 (backend.h): the ViT trunk's GEMMs then read f16 / bf16
  // operands (cuBLAS's tensor-core kernels, f32 accumulation) instead of converting f32 ones, the
  // CNNs' inference graph runs cuDNN's half convolutions, and slide-train's CNNs train on half
  // activations (enable_half_activations: half the bytes for batch norm, ReLU, pooling and adds).
  DType activation_dtype() const override {
    return math_precision_ == MathPrecision::kFp16   ? DType::kF16
           : math_precision_ == MathPrecision::kBf16 ? DType::kBF16
                                                     : DType::kF32;
  }

  // --- Host <-> device ---
  // Transfers may come from another thread than the one that made the backend (the trainer
  // uploads the next micro-batch from its prefetch thread), whose current device is not set:
  // each sets it (a per-thread setting, cheap) before using the device's stream.
  Status upload(const Tensor& host, Tensor& dst) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_transfer("upload", host, dst, Device::kCuda));
    if (host.bytes() == 0) return ok_status();
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), host.raw(), host.bytes(), cudaMemcpyHostToDevice, st_->stream));
    // From pageable memory the call returns once the source is staged; pinned sources are not
    // used here, so `host` may be reused at once. Synchronise anyway to surface errors here.
    SLIDE_CUDA_CHECK(cudaStreamSynchronize(st_->stream));
    return ok_status();
  }
  Status download(const Tensor& src, Tensor& host) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_transfer("download", host, src, Device::kCuda));
    if (src.bytes() == 0) return ok_status();
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(host.raw(), src.raw(), src.bytes(), cudaMemcpyDeviceToHost, st_->stream));
    SLIDE_CUDA_CHECK(cudaStreamSynchronize(st_->stream));
    return ok_status();
  }

  Status synchronize() override {
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    SLIDE_CUDA_CHECK(cudaStreamSynchronize(st_->stream));
    return ok_status();
  }

  // An event on the compute stream, after every op queued so far.
  Result<std::unique_ptr<DeviceFence>> fence() override {
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    cudaEvent_t e = nullptr;
    SLIDE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    auto f = std::make_unique<CudaFence>(e);  // destroys the event on the error path too
    SLIDE_CUDA_CHECK(cudaEventRecord(e, st_->stream));
    return std::unique_ptr<DeviceFence>(std::move(f));
  }

  // The device's copy engine, made on first use. Should its stream or events not be made, offload
  // copies synchronously instead (said once).
  CopyEngine* copy_engine() override {
    if (!st_->copy && !st_->copy_failed) {
      auto engine = std::make_unique<CudaCopyEngine>(st_->device, st_->stream);
      if (Status s = engine->init(); !s.ok()) {
        st_->copy_failed = true;
        slide::core::log_warn("cuda: no copy stream for activation offload; its copies will be synchronous",
                              {{"why", s.to_string()}});
        return nullptr;
      }
      st_->copy = std::move(engine);
    }
    return st_->copy.get();
  }

  // Another copy stream, for the trainer's input batches (uploaded from its prefetch thread while
  // the compute stream runs the micro-batch before); null, with a warning, should it not be made
  // (the batches are then uploaded on the compute stream).
  std::unique_ptr<CopyEngine> new_copy_engine() override {
    auto engine = std::make_unique<CudaCopyEngine>(st_->device, st_->stream);
    if (Status s = engine->init(); !s.ok()) {
      slide::core::log_warn("cuda: no copy stream for input batches; they are uploaded on the compute stream",
                            {{"why", s.to_string()}});
      return nullptr;
    }
    return engine;
  }

  Result<size_t> available_memory_bytes() override {
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    size_t free_bytes = 0, total_bytes = 0;
    SLIDE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return free_bytes;  // (blocks our caching allocator holds unused are not counted: a lower bound)
  }

  // --- Convolution ---
  Status conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_conv2d_forward(x, w, b, p, y, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("conv2d_forward", {&x}, {&w, &b}));
    SLIDE_RETURN_IF_ERROR(y.set_layout(layout_of(nhwc)));
    if (nhwc || detail::is_half(x.dtype())) return conv_forward_typed(x, w, b, p, y, d, nhwc);
    if (d.N * d.K * d.P * d.Q == 0) return ok_status();
    ConvDescs ds;
    const ConvKey key = conv_key(ConvDirection::kForward, d, p);
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math));
    auto candidates = [&] { return forward_candidates(ds); };
    auto workspace = [&](int algo) { return forward_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, zero = 0;
      SLIDE_CUDNN_CHECK(cudnnConvolutionForward(st_->cudnn, &one, ds.x.d, f32(x), ds.w.d, f32(w), ds.conv.d,
                                                static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws, ws_bytes, &zero,
                                                ds.y.d, f32(y)));
      return ok_status();
    };
    SLIDE_RETURN_IF_ERROR(run_conv(key, ds, candidates, workspace, run));
    if (b.defined()) SLIDE_CUDA_CHECK(launch_bias_add(f32(y), f32(b), d.N, d.K, d.P * d.Q, st_->stream));
    return ok_status();
  }

  // --- Training on half-precision storage (backend.h; layers.h enable_half_activations) ---
  // The convolution's three passes on f16 / bf16 tensors and filter with f32 compute (cuDNN's
  // PSEUDO_HALF_CONFIG / PSEUDO_BFLOAT16_CONFIG, as PyTorch's autocast convolutions), the
  // algorithms chosen and cached per shape as for f32 (the key carries the storage type and the
  // layout). Channels last (any storage): the tensors NHWC, and the filter relaid out to KRSC for
  // the pass (krsc_filter: cuDNN's NHWC filter; the layer keeps its KCRS weights), the filter
  // gradient written KRSC and relaid out before it is added; the copies are part of the pass's
  // planned workspace (conv_workspace_bytes).
  // y = conv(x, w) by cudnnConvolutionForward on `half` storage (f32 compute), y overwritten: the
  // training forward (NCHW) and the inference graph's fused convolution (fused_conv_half) alike.
  Status half_convolution(const detail::ConvDims& d, Conv2dParams p, DType half, bool nhwc, const void* x,
                          const void* w, void* y) {
    const ConvKey key = conv_key(ConvDirection::kForward, d, p, half, nhwc);
    ConvDescs ds;
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math, cudnn_type(half), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW));
    auto candidates = [&] { return forward_candidates(ds); };
    auto workspace = [&](int algo) { return forward_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, zero = 0;  // cuDNN's scaling factors are float for half data
      SLIDE_CUDNN_CHECK(cudnnConvolutionForward(st_->cudnn, &one, ds.x.d, x, ds.w.d, w, ds.conv.d,
                                                static_cast<cudnnConvolutionFwdAlgo_t>(algo), ws, ws_bytes, &zero,
                                                ds.y.d, y));
      return ok_status();
    };
    return run_conv(key, ds, candidates, workspace, run);
  }
  // y = conv(x, w) (+ b, in f32, rounded once by the epilogue kernel: cuDNN's output is rounded
  // first, as the op list allows), half-precision or channels last (y labelled by the caller).
  Status conv_forward_typed(const Tensor& x, const Tensor& w, const Tensor& b, Conv2dParams p, Tensor& y,
                            const detail::ConvDims& d, bool nhwc) {
    if (d.N * d.K * d.P * d.Q == 0) return ok_status();
    const DType t = x.dtype();
    Tensor filter = w;
    if (nhwc) {
      SLIDE_ASSIGN_OR_RETURN(filter, krsc_filter(w));
    }
    SLIDE_RETURN_IF_ERROR(half_convolution(d, p, t, nhwc, x.raw(), filter.raw(), y.raw()));
    if (b.defined())
      SLIDE_CUDA_CHECK(launch_conv_epilogue(storage(t), nhwc, y.raw(), b.raw(), nullptr, y.raw(), d.N, d.K, d.P * d.Q,
                                            false, st_->stream));
    return ok_status();
  }
  // w [K, C, R, S] stored [K][R][S][C] (cuDNN's NHWC filter), a copy from the budgeted allocator.
  Result<Tensor> krsc_filter(const Tensor& w) {
    SLIDE_ASSIGN_OR_RETURN(Tensor krsc, Tensor::empty(w.shape(), w.dtype(), *st_->alloc, "channels-last filter (KRSC)"));
    SLIDE_RETURN_IF_ERROR(permute_storage(w, w.shape(), {0, 2, 3, 1}, krsc));
    return krsc;
  }
  // dx = the transpose of the convolution applied to dy, half-precision or channels last.
  Status conv_backward_data_typed(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx,
                                  const detail::ConvDims& d, bool nhwc) {
    if (d.N * d.C * d.H * d.W == 0) return ok_status();
    const DType t = dy.dtype();
    Tensor filter = w;
    if (nhwc) {
      SLIDE_ASSIGN_OR_RETURN(filter, krsc_filter(w));
    }
    const ConvKey key = conv_key(ConvDirection::kBackwardData, d, p, t, nhwc);
    ConvDescs ds;
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math, cudnn_type(t), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW));
    auto candidates = [&] { return backward_data_candidates(ds); };
    auto workspace = [&](int algo) { return backward_data_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, zero = 0;  // dx is overwritten
      SLIDE_CUDNN_CHECK(cudnnConvolutionBackwardData(st_->cudnn, &one, ds.w.d, filter.raw(), ds.y.d, dy.raw(),
                                                     ds.conv.d, static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws,
                                                     ws_bytes, &zero, ds.x.d, dx.raw()));
      return ok_status();
    };
    return run_conv(key, ds, candidates, workspace, run);
  }
  // dw (f32, KCRS) += the filter gradient, which cuDNN writes in x's type (its half configurations
  // take one data type for x, dy and dw; channels last, KRSC) into scratch that is then relaid out
  // (channels last) and added to dw in f32; db (f32) += the sum of dy in double. The scratch is
  // allocated before the pass's workspace and is part of its planned bytes (conv_workspace_bytes).
  Status conv_backward_weights_typed(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db,
                                     const detail::ConvDims& d, bool nhwc) {
    if (d.N * d.K * d.P * d.Q == 0) return ok_status();  // nothing to accumulate
    const DType t = x.dtype();
    const ConvKey key = conv_key(ConvDirection::kBackwardFilter, d, p, t, nhwc);
    ConvDescs ds;
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math, cudnn_type(t), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW));
    SLIDE_ASSIGN_OR_RETURN(Tensor product, Tensor::empty(dw.shape(), t, *st_->alloc, "weight gradient product"));
    Tensor kcrs = product;
    if (nhwc) {
      SLIDE_ASSIGN_OR_RETURN(kcrs, Tensor::empty(dw.shape(), t, *st_->alloc, "weight gradient product (KCRS)"));
    }
    auto candidates = [&] { return backward_filter_candidates(ds); };
    auto workspace = [&](int algo) { return backward_filter_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, zero = 0;  // the product alone, then added to dw below
      SLIDE_CUDNN_CHECK(cudnnConvolutionBackwardFilter(st_->cudnn, &one, ds.x.d, x.raw(), ds.y.d, dy.raw(), ds.conv.d,
                                                       static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws,
                                                       ws_bytes, &zero, ds.w.d, product.raw()));
      return ok_status();
    };
    SLIDE_RETURN_IF_ERROR(run_conv(key, ds, candidates, workspace, run));
    if (nhwc) SLIDE_RETURN_IF_ERROR(permute_storage(product, {d.K, d.R, d.S, d.C}, {0, 3, 1, 2}, kcrs));
    SLIDE_CUDA_CHECK(launch_binary(Binary::kAdd, CastType::kF32, dw.raw(), storage(t), kcrs.raw(), dw.raw(),
                                   dw.numel(), st_->stream));
    // Channels last, dy is [N P Q, K]: the bias kernel's [N', K, 1] with N' = N P Q.
    if (db.defined())
      SLIDE_CUDA_CHECK(launch_bias_grad(storage(t), dy.raw(), f32(db), nhwc ? d.N * d.P * d.Q : d.N, d.K,
                                        nhwc ? 1 : d.P * d.Q, st_->stream));
    return ok_status();
  }

  // The fused inference convolution on cudnnConvolutionBiasActivationForward (cuDNN's legacy API,
  // as every convolution here): y = ReLU(1 * conv(x) + alpha2 * z + bias), alpha2 = 1 with a
  // residual z, else 0 with z = y (as PyTorch's cudnn_convolution_relu). cuDNN runs the identity
  // activation only with IMPLICIT_PRECOMP_GEMM, so a convolution without ReLU (a downsample) is
  // conv2d_forward (+ add). A residual that is y itself is first copied aside: an algorithm that
  // cuDNN runs as convolution, then epilogue, would write y before reading z. A shape cuDNN
  // answers NOT_SUPPORTED for is remembered and runs composed (conv2d_forward, add, relu_forward).
  // The weights are the default prepare's: plain copies on the device.
  Result<std::shared_ptr<const FusedConvWeights>> prepare_fused_conv2d(const Tensor& w, const Tensor& b) override {
    SLIDE_ASSIGN_OR_RETURN(std::shared_ptr<const FusedConvWeights> plain, Backend::prepare_fused_conv2d(w, b));
    return std::shared_ptr<const FusedConvWeights>(
        std::make_shared<CudaFusedConvWeights>(this, plain->weight(), plain->bias()));
  }
  Status fused_conv2d_inference(const Tensor& x, const FusedConvWeights& wts, Conv2dParams p, bool relu,
                                const Tensor* residual, Tensor& y) override {
    const bool half = detail::is_half(y.dtype());
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_fused_conv2d_inference(this, x, wts, p, residual, y,
                                                                   half ? kHalfLayoutDTypes : kHalfDTypes));
    if (half) SLIDE_RETURN_IF_ERROR(plain_or_nhwc("fused_conv2d_inference", {&x, residual}));
    if (d.N * d.K * d.P * d.Q == 0) return ok_status();
    if (half) return fused_conv_half(x, wts, p, relu, residual, y, d);
    const Tensor& w = wts.weight();
    const Tensor& b = wts.bias();
    Tensor aside;
    const Tensor* z = residual;
    if (z != nullptr && z->raw() == y.raw()) {
      SLIDE_ASSIGN_OR_RETURN(aside, Tensor::empty(z->shape(), DType::kF32, *st_->alloc, "fused convolution residual"));
      SLIDE_CUDA_CHECK(cudaMemcpyAsync(aside.raw(), z->raw(), z->bytes(), cudaMemcpyDeviceToDevice, st_->stream));
      z = &aside;
    }
    auto composed = [&]() -> Status {
      SLIDE_RETURN_IF_ERROR(conv2d_forward(x, w, b, p, y));
      if (z != nullptr) SLIDE_RETURN_IF_ERROR(add(y, *z, y));
      if (relu) SLIDE_RETURN_IF_ERROR(relu_forward(y, y));
      return ok_status();
    };
    const ConvKey key = conv_key(ConvDirection::kForwardFused, d, p);
    bool unsupported = !relu;
    if (!unsupported) {
      std::lock_guard<std::mutex> lock(st_->mu);
      unsupported = st_->unfused.count(key) > 0;
    }
    if (unsupported) return composed();
    ConvDescs ds;
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math));
    TensorDesc bias_d;
    SLIDE_RETURN_IF_ERROR(bias_d.set(1, d.K, 1, 1));
    ActivationDesc act;
    SLIDE_RETURN_IF_ERROR(act.set_relu());
    auto candidates = [&] { return forward_candidates(ds); };
    auto workspace = [&](int algo) { return forward_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, alpha2 = z != nullptr ? 1.f : 0.f;
      SLIDE_CUDNN_CHECK(cudnnConvolutionBiasActivationForward(
          st_->cudnn, &one, ds.x.d, f32(x), ds.w.d, f32(w), ds.conv.d, static_cast<cudnnConvolutionFwdAlgo_t>(algo),
          ws, ws_bytes, &alpha2, ds.y.d, z != nullptr ? f32(*z) : f32(y), bias_d.d, f32(b), act.d, ds.y.d, f32(y)));
      return ok_status();
    };
    const Status fused = run_conv(key, ds, candidates, workspace, run);
    if (fused.code() != StatusCode::kUnimplemented) return fused;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->unfused.insert(key);
    }
    return composed();
  }

  // fused_conv2d_inference on half-precision storage (the inference graph under fp16 / bf16):
  // cudnnConvolutionForward on f16 / bf16 tensors and filter with f32 compute (cuDNN's
  // PSEUDO_HALF_CONFIG / PSEUDO_BFLOAT16_CONFIG, the configuration PyTorch's half convolutions
  // use), then one kernel for bias, residual and ReLU (launch_conv_epilogue), rather than
  // cudnnConvolutionBiasActivationForward, whose half-precision bias type and algorithm limits
  // could not be checked without a GPU. The convolution goes to scratch when y is the residual.
  Status fused_conv_half(const Tensor& x, const FusedConvWeights& wts, Conv2dParams p, bool relu,
                         const Tensor* residual, Tensor& y, const detail::ConvDims& d) {
    const auto* cw = dynamic_cast<const CudaFusedConvWeights*>(&wts);
    if (cw == nullptr)
      return slide::core::internal_error("cuda fused_conv2d_inference: weights not prepared by prepare_fused_conv2d");
    const DType half = y.dtype();
    // Channels last, the layout of cuDNN's tensor-core kernels (PyTorch's channels_last), unless a
    // residual in NCHW says otherwise (y takes the residual's layout: it may be the residual).
    const bool nhwc = residual == nullptr || residual->layout() == Layout::kNhwc;
    const Layout out_layout = nhwc ? Layout::kNhwc : Layout::kPlain;
    if (cw->half != half) {
      SLIDE_ASSIGN_OR_RETURN(Tensor wh, Tensor::empty(cw->weight().shape(), half, *st_->alloc, "fused convolution weights"));
      SLIDE_ASSIGN_OR_RETURN(Tensor bh, Tensor::empty(cw->bias().shape(), half, *st_->alloc, "fused convolution bias"));
      SLIDE_RETURN_IF_ERROR(cast(cw->weight(), wh));
      SLIDE_RETURN_IF_ERROR(cast(cw->bias(), bh));
      cw->w_half = std::move(wh);
      cw->w_half_krsc = Tensor();
      cw->b_half = std::move(bh);
      cw->half = half;
    }
    if (nhwc && !cw->w_half_krsc.defined()) {
      // [K, C, R, S] -> [K, R, S, C]: the NHWC filter.
      SLIDE_ASSIGN_OR_RETURN(Tensor krsc, Tensor::empty(cw->w_half.shape(), half, *st_->alloc, "fused convolution weights (KRSC)"));
      SLIDE_RETURN_IF_ERROR(permute_storage(cw->w_half, cw->w_half.shape(), {0, 2, 3, 1}, krsc));
      cw->w_half_krsc = std::move(krsc);
    }
    // x in the output's layout (the stem's images come NCHW; a block's tensors are already NHWC).
    Tensor xin = x;
    if ((x.layout() == Layout::kNhwc) != nhwc) {
      SLIDE_ASSIGN_OR_RETURN(xin, Tensor::empty(x.shape(), half, *st_->alloc, "fused convolution input (relaid out)"));
      SLIDE_RETURN_IF_ERROR(relayout(x, out_layout, xin));
    }
    Tensor c = y;
    if (residual != nullptr && residual->raw() == y.raw()) {
      SLIDE_ASSIGN_OR_RETURN(c, Tensor::empty(y.shape(), half, *st_->alloc, "fused convolution output"));
    }
    const Tensor& w = nhwc ? cw->w_half_krsc : cw->w_half;
    SLIDE_RETURN_IF_ERROR(half_convolution(d, p, half, nhwc, xin.raw(), w.raw(), c.raw()));
    SLIDE_CUDA_CHECK(launch_conv_epilogue(storage(half), nhwc, c.raw(), cw->b_half.raw(),
                                          residual != nullptr ? residual->raw() : nullptr, y.raw(), d.N, d.K,
                                          d.P * d.Q, relu, st_->stream));
    return y.set_layout(out_layout);
  }

  // y (x's shape, dtype and storage size) = x's elements in `to`'s order: plain <-> channels last
  // for [N, C, H, W] (permute's kernel over the stored order). y is labelled `to`.
  Status relayout(const Tensor& x, Layout to, Tensor& y) {
    if (x.rank() != 4 || y.shape() != x.shape() || y.dtype() != x.dtype() ||
        (to != Layout::kPlain && to != Layout::kNhwc) || (x.layout() != Layout::kPlain && x.layout() != Layout::kNhwc))
      return slide::core::invalid_argument("cuda relayout: " + shape_string(x.shape()) + " " + layout_name(x.layout()) +
                                           " to " + layout_name(to));
    if (x.layout() == to) {
      SLIDE_CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), x.bytes(), cudaMemcpyDeviceToDevice, st_->stream));
    } else if (to == Layout::kNhwc) {
      SLIDE_RETURN_IF_ERROR(permute_storage(x, x.shape(), {0, 2, 3, 1}, y));  // [N, C, H, W] -> [N, H, W, C]
    } else {
      // Stored [N, H, W, C] -> [N, C, H, W].
      SLIDE_RETURN_IF_ERROR(permute_storage(x, {x.dim(0), x.dim(2), x.dim(3), x.dim(1)}, {0, 3, 1, 2}, y));
    }
    return y.set_layout(to);
  }
  // permute's kernel from x's storage, read as a plain tensor of shape `stored` (x's element count),
  // into y's storage, whatever their labels: y's stored elements are `stored` permuted by perm
  // (permute's rule: y extent i = stored[perm[i]]).
  Status permute_storage(const Tensor& x, const Shape& stored, const std::vector<int>& perm, Tensor& y) {
    int64_t count = 1;
    for (int64_t e : stored) count *= e;
    if (stored.size() != perm.size() || perm.size() > 6 || count != x.numel() || y.numel() != x.numel() ||
        y.dtype() != x.dtype())
      return slide::core::invalid_argument("cuda permute_storage: shapes, sizes or dtypes differ");
    PermuteGeometry g;
    g.rank = static_cast<int>(perm.size());
    int64_t x_stride[6] = {0}, stride = 1;
    for (int i = g.rank - 1; i >= 0; --i) x_stride[i] = stride, stride *= stored[static_cast<size_t>(i)];
    for (int i = 0; i < g.rank; ++i) {
      g.y_extent[i] = stored[static_cast<size_t>(perm[static_cast<size_t>(i)])];
      g.in_stride[i] = x_stride[perm[static_cast<size_t>(i)]];
    }
    SLIDE_CUDA_CHECK(launch_permute(dtype_size(x.dtype()), x.raw(), y.raw(), x.numel(), g, st_->stream));
    return ok_status();
  }

  // Channels last back to plain (a copy); plain tensors as they are.
  Result<Tensor> to_plain(const Tensor& x) override {
    if (x.layout() == Layout::kPlain) return x;
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), *st_->alloc, "plain copy"));
    SLIDE_RETURN_IF_ERROR(relayout(x, Layout::kPlain, y));
    return y;
  }
  // A plain [N, C, H, W] relaid out channels last (a copy); channels-last tensors as they are.
  Result<Tensor> to_channels_last(const Tensor& x) override {
    if (x.layout() == Layout::kNhwc) return x;
    if (x.rank() != 4 || x.layout() != Layout::kPlain || x.device() != Device::kCuda)
      return slide::core::invalid_argument("to_channels_last: a " + shape_string(x.shape()) + " " +
                                           layout_name(x.layout()) + " tensor on " + device_name(x.device()) +
                                           "; needs a plain [N, C, H, W] on cuda");
    SLIDE_ASSIGN_OR_RETURN(Tensor y, Tensor::empty(x.shape(), x.dtype(), *st_->alloc, "channels-last copy"));
    SLIDE_RETURN_IF_ERROR(relayout(x, Layout::kNhwc, y));
    return y;
  }

  // Backend::conv_workspace_bytes: the workspace each pass's run_conv would take (planned_workspace).
  Result<size_t> conv_workspace_bytes(ConvPass pass, const Tensor& x, const Tensor& w, Conv2dParams p,
                                      const Tensor& y) override {
    // Shapes and dtypes only: the planner's placeholders live on no device. Half-precision x with
    // backward weights' f32 dw (in w's place) is the half training pass.
    // Channels-last placeholders are read as the ops read them (kHalfLayoutDTypes): refusing them
    // failed every channels-last plan, so every slide-train run under fp16 / bf16.
    const bool half = detail::is_half(x.dtype());
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           pass == ConvPass::kBackwardWeights
                               ? detail::validate_conv2d_backward_weights(x, y, p, w, Tensor(),
                                                                          detail::shapes_only(kHalfLayoutDTypes))
                               : detail::validate_conv2d_forward(x, w, Tensor(), p, y,
                                                                 detail::shapes_only(kHalfLayoutDTypes)));
    // Channels last: x and y (forward: x, y; backward data: dx, dy; backward weights: x, dy)
    // labelled kNhwc, as the planner's placeholders are (planner.cpp follows the backends' labels);
    // one layout for both, the filter (or its gradient) plain.
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("conv_workspace_bytes", {&x, &y}, {&w}));
    if (d.N * d.K * d.P * d.Q == 0 || d.N * d.C * d.H * d.W == 0) return size_t{0};  // the ops return early
    const ConvDirection direction = pass == ConvPass::kForward        ? ConvDirection::kForward
                                    : pass == ConvPass::kBackwardData ? ConvDirection::kBackwardData
                                                                      : ConvDirection::kBackwardFilter;
    const ConvKey key = conv_key(direction, d, p, x.dtype(), nhwc);
    ConvDescs ds;
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math, cudnn_type(x.dtype()), nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW));
    // A filter-sized copy in x's type: the KRSC filter (channels last), the filter gradient's scratch.
    const size_t filter_copy = static_cast<size_t>(w.numel()) * dtype_size(x.dtype());
    switch (pass) {
      case ConvPass::kForward: {
        SLIDE_ASSIGN_OR_RETURN(const size_t ws, planned_workspace(key, ds, [&] { return forward_candidates(ds); },
                                                                  [&](int algo) { return forward_workspace(ds, algo); }));
        return ws + (nhwc ? filter_copy : 0);
      }
      case ConvPass::kBackwardData: {
        SLIDE_ASSIGN_OR_RETURN(const size_t ws,
                               planned_workspace(key, ds, [&] { return backward_data_candidates(ds); },
                                                 [&](int algo) { return backward_data_workspace(ds, algo); }));
        return ws + (nhwc ? filter_copy : 0);
      }
      case ConvPass::kBackwardWeights: {
        SLIDE_ASSIGN_OR_RETURN(const size_t ws,
                               planned_workspace(key, ds, [&] { return backward_filter_candidates(ds); },
                                                 [&](int algo) { return backward_filter_workspace(ds, algo); }));
        // ... and the filter gradient's scratch (conv_backward_weights_typed): the product, and
        // its KCRS copy when channels last.
        return ws + (half || nhwc ? filter_copy : 0) + (nhwc ? filter_copy : 0);
      }
    }
    return size_t{0};
  }

  Status conv2d_backward_data(const Tensor& dy, const Tensor& w, Conv2dParams p, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_conv2d_backward_data(dy, w, p, dx, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("conv2d_backward_data", {&dy}, {&w}));
    SLIDE_RETURN_IF_ERROR(dx.set_layout(layout_of(nhwc)));
    if (nhwc || detail::is_half(dy.dtype())) return conv_backward_data_typed(dy, w, p, dx, d, nhwc);
    if (d.N * d.C * d.H * d.W == 0) return ok_status();
    ConvDescs ds;
    const ConvKey key = conv_key(ConvDirection::kBackwardData, d, p);
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math));
    auto candidates = [&] { return backward_data_candidates(ds); };
    auto workspace = [&](int algo) { return backward_data_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1, zero = 0;  // dx is overwritten
      SLIDE_CUDNN_CHECK(cudnnConvolutionBackwardData(st_->cudnn, &one, ds.w.d, f32(w), ds.y.d, f32(dy), ds.conv.d,
                                                     static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), ws, ws_bytes,
                                                     &zero, ds.x.d, f32(dx)));
      return ok_status();
    };
    return run_conv(key, ds, candidates, workspace, run);
  }

  Status conv2d_backward_weights(const Tensor& x, const Tensor& dy, Conv2dParams p, Tensor& dw, Tensor& db) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::ConvDims d,
                           detail::validate_conv2d_backward_weights(x, dy, p, dw, db, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("conv2d_backward_weights", {&x, &dy}, {&dw, &db}));
    if (nhwc || detail::is_half(x.dtype())) return conv_backward_weights_typed(x, dy, p, dw, db, d, nhwc);
    if (d.N * d.K * d.P * d.Q == 0) return ok_status();  // nothing to accumulate
    ConvDescs ds;
    const ConvKey key = conv_key(ConvDirection::kBackwardFilter, d, p);
    SLIDE_RETURN_IF_ERROR(ds.set(d, p, key.math));
    auto candidates = [&] { return backward_filter_candidates(ds); };
    auto workspace = [&](int algo) { return backward_filter_workspace(ds, algo); };
    auto run = [&](int algo, void* ws, size_t ws_bytes) -> Status {
      const float one = 1;  // dw += (the op list's accumulate rule): beta = 1
      SLIDE_CUDNN_CHECK(cudnnConvolutionBackwardFilter(st_->cudnn, &one, ds.x.d, f32(x), ds.y.d, f32(dy), ds.conv.d,
                                                       static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), ws,
                                                       ws_bytes, &one, ds.w.d, f32(dw)));
      return ok_status();
    };
    SLIDE_RETURN_IF_ERROR(run_conv(key, ds, candidates, workspace, run));
    if (db.defined())
      SLIDE_CUDA_CHECK(launch_bias_grad(CastType::kF32, dy.raw(), f32(db), d.N, d.K, d.P * d.Q, st_->stream));
    return ok_status();
  }

  // --- Batch norm ---
  Status batch_norm_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                     double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                                     Tensor& save_mean, Tensor& save_invstd) override {
    return bn_training("batch_norm_forward_training", false, x, gamma, beta, eps, momentum, running_mean, running_var,
                       y, save_mean, save_invstd);
  }
  // Batch norm + ReLU: the normalising pass stores max(y, 0) (kernels.h launch_bn_forward_training).
  Status batch_norm_relu_forward_training(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                                          double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y,
                                          Tensor& save_mean, Tensor& save_invstd) override {
    return bn_training("batch_norm_relu_forward_training", true, x, gamma, beta, eps, momentum, running_mean,
                       running_var, y, save_mean, save_invstd);
  }
  Status bn_training(const char* op, bool relu, const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps,
                     double momentum, Tensor& running_mean, Tensor& running_var, Tensor& y, Tensor& save_mean,
                     Tensor& save_invstd) {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_training(x, gamma, beta, running_mean, running_var, y, save_mean,
                                                                save_invstd, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last(op, {&x}, {&gamma, &beta}));
    SLIDE_RETURN_IF_ERROR(y.set_layout(layout_of(nhwc)));
    SLIDE_ASSIGN_OR_RETURN(Tensor scratch, bn_scratch(kernels::bn_forward_scratch_doubles(d.N, d.C, d.HW, nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_forward_training(storage(x.dtype()), nhwc, x.raw(), f32(gamma), f32(beta), eps, momentum,
                                                f32(running_mean), f32(running_var), y.raw(), f32(save_mean),
                                                f32(save_invstd), relu, d.N, d.C, d.HW, f64(scratch), st_->stream));
    return ok_status();
  }
  Status batch_norm_forward_inference(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                      const Tensor& running_mean, const Tensor& running_var, double eps,
                                      Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_inference(
                                                       x, gamma, beta, running_mean, running_var, y, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_forward_inference", {&x}, {&gamma, &beta}));
    SLIDE_RETURN_IF_ERROR(y.set_layout(layout_of(nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_forward_inference(storage(x.dtype()), nhwc, x.raw(), f32(gamma), f32(beta), f32(running_mean),
                                                 f32(running_var), eps, y.raw(), d.N, d.C, d.HW, st_->stream));
    return ok_status();
  }
  Status batch_norm_backward(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                             const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) override {
    return bn_backward("batch_norm_backward", x, nullptr, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
  }
  // Batch norm + ReLU: both reducing and element-wise passes read dy masked by y > 0 (no scratch).
  Status batch_norm_relu_backward(const Tensor& x, const Tensor& y, const Tensor& dy, const Tensor& gamma,
                                  const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma,
                                  Tensor& dbeta) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("batch_norm_relu_backward", x, y, nullptr, kHalfLayoutDTypes));
    return bn_backward("batch_norm_relu_backward", x, &y, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
  }
  Status bn_backward(const char* op, const Tensor& x, const Tensor* relu_y, const Tensor& dy, const Tensor& gamma,
                     const Tensor& save_mean, const Tensor& save_invstd, Tensor& dx, Tensor& dgamma, Tensor& dbeta) {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_backward(x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta,
                                                                kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, relu_y != nullptr ? channels_last(op, {&x, relu_y, &dy}, {&gamma})
                                                              : channels_last(op, {&x, &dy}, {&gamma}));
    SLIDE_RETURN_IF_ERROR(dx.set_layout(layout_of(nhwc)));
    SLIDE_ASSIGN_OR_RETURN(Tensor scratch, bn_scratch(kernels::bn_backward_scratch_doubles(d.N, d.C, d.HW, nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_backward(storage(x.dtype()), nhwc, x.raw(), dy.raw(),
                                        relu_y != nullptr ? relu_y->raw() : nullptr, f32(gamma), f32(save_mean),
                                        f32(save_invstd), dx.raw(), f32(dgamma), f32(dbeta), d.N, d.C, d.HW,
                                        f64(scratch), st_->stream));
    return ok_status();
  }

  // Batch norm's f64 scratch on the device (kernels.h: the segments' partial sums, then the
  // per-channel sums), from the budgeted allocator, freed (stream-ordered) when the op returns.
  Result<Tensor> bn_scratch(int64_t doubles) {
    return Tensor::empty({std::max<int64_t>(doubles, 1)}, DType::kF64, *st_->alloc, "batch norm partial sums");
  }
  size_t batch_norm_scratch_bytes(bool backward, const Tensor& x) override {
    if (x.rank() != 4) return 0;
    return static_cast<size_t>(kernels::bn_scratch_bytes(backward, x.dim(0), x.dim(1), x.dim(2) * x.dim(3),
                                                         x.layout() == Layout::kNhwc));
  }
  // Synchronised batch norm's pieces: what batch_norm_forward_training and batch_norm_backward run
  // in turn (kernels.h); the f64 sums stay on the device between the pieces (NCCL all-reduces them
  // in place; a host communicator stages them, dist/sync_batch_norm.cpp).
  Status batch_norm_stats(const Tensor& x, Tensor& stats) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_stats(x, stats, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_stats", {&x}, {&stats}));
    SLIDE_ASSIGN_OR_RETURN(Tensor partials, bn_scratch(kernels::bn_partials(d.N, d.C, d.HW, nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_stats(storage(x.dtype()), nhwc, x.raw(), f64(stats), d.N, d.C, d.HW, f64(partials), st_->stream));
    return ok_status();
  }
  Status batch_norm_deviations(const Tensor& x, const Tensor& stats, Tensor& devs) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_deviations(x, stats, devs, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_deviations", {&x}, {&stats, &devs}));
    SLIDE_ASSIGN_OR_RETURN(Tensor partials, bn_scratch(kernels::bn_partials(d.N, d.C, d.HW, nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_deviations(storage(x.dtype()), nhwc, x.raw(), f64(stats), f64(devs), d.N, d.C, d.HW, f64(partials), st_->stream));
    return ok_status();
  }
  Status batch_norm_forward_from_stats(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& stats,
                                       const Tensor& devs, double eps, double momentum, Tensor& running_mean,
                                       Tensor& running_var, Tensor& y, Tensor& save_mean,
                                       Tensor& save_invstd) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_forward_from_stats(x, gamma, beta, stats, devs, running_mean,
                                                                          running_var, y, save_mean, save_invstd,
                                                                          kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_forward_from_stats", {&x}, {&gamma, &beta}));
    SLIDE_RETURN_IF_ERROR(y.set_layout(layout_of(nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_forward_from_stats(storage(x.dtype()), nhwc, x.raw(), f32(gamma), f32(beta), f64(stats),
                                                  f64(devs), eps, momentum, f32(running_mean), f32(running_var),
                                                  y.raw(), f32(save_mean), f32(save_invstd), false, d.N, d.C, d.HW,
                                                  st_->stream));
    return ok_status();
  }
  Status batch_norm_backward_reduce(const Tensor& x, const Tensor& dy, const Tensor& save_mean,
                                    const Tensor& save_invstd, Tensor& sums, Tensor& dgamma, Tensor& dbeta) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d, detail::validate_batch_norm_backward_reduce(
                                                       x, dy, save_mean, save_invstd, sums, dgamma, dbeta,
                                                       kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_backward_reduce", {&x, &dy}, {&sums}));
    SLIDE_ASSIGN_OR_RETURN(Tensor partials, bn_scratch(2 * kernels::bn_partials(d.N, d.C, d.HW, nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_backward_reduce(storage(x.dtype()), nhwc, x.raw(), dy.raw(), nullptr, f32(save_mean),
                                               f32(save_invstd), f64(sums), f32(dgamma), f32(dbeta), d.N, d.C, d.HW,
                                               f64(partials), st_->stream));
    return ok_status();
  }
  Status batch_norm_backward_elemt(const Tensor& x, const Tensor& dy, const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_invstd, const Tensor& stats, const Tensor& sums,
                                   Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_batch_norm_backward_elemt(x, dy, gamma, save_mean, save_invstd, stats, sums,
                                                                      dx, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("batch_norm_backward_elemt", {&x, &dy}, {&gamma}));
    SLIDE_RETURN_IF_ERROR(dx.set_layout(layout_of(nhwc)));
    SLIDE_CUDA_CHECK(launch_bn_backward_elemt(storage(x.dtype()), nhwc, x.raw(), dy.raw(), nullptr, f32(gamma),
                                              f32(save_mean), f32(save_invstd), f64(stats), f64(sums), dx.raw(), d.N,
                                              d.C, d.HW, st_->stream));
    return ok_status();
  }

  // --- Element-wise ---
  // ReLU and add are element-wise: channels-last tensors (backend.h) as flat arrays of one layout,
  // the output labelled alike.
  Status relu_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("relu_forward", {&x}));
    SLIDE_RETURN_IF_ERROR(unary("relu_forward", Unary::kRelu, x, y, kHalfLayoutDTypes));
    return y.set_layout(layout_of(nhwc));
  }
  Status relu_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("relu_backward", {&y, &dy}));
    SLIDE_RETURN_IF_ERROR(unary_grad("relu_backward", UnaryGrad::kRelu, y, dy, dx, kHalfLayoutDTypes));
    return dx.set_layout(layout_of(nhwc));
  }
  Status add(const Tensor& a, const Tensor& b, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_add(a, b, y, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("add", {&a, &b}));
    SLIDE_CUDA_CHECK(launch_binary(Binary::kAdd, storage(a.dtype()), a.raw(), storage(b.dtype()), b.raw(), y.raw(),
                                   a.numel(), st_->stream));
    return y.set_layout(layout_of(nhwc));
  }
  Status mul(const Tensor& a, const Tensor& b, Tensor& y) override { return binary("mul", Binary::kMul, a, b, y); }
  Status tanh_forward(const Tensor& x, Tensor& y) override { return unary("tanh_forward", Unary::kTanh, x, y); }
  Status tanh_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    return unary_grad("tanh_backward", UnaryGrad::kTanh, y, dy, dx);
  }
  Status sigmoid_forward(const Tensor& x, Tensor& y) override {
    return unary("sigmoid_forward", Unary::kSigmoid, x, y, kHalfDTypes);
  }
  Status sigmoid_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    return unary_grad("sigmoid_backward", UnaryGrad::kSigmoid, y, dy, dx);
  }

  // --- Vision Transformer ops ---
  Status gelu_forward(const Tensor& x, Tensor& y) override {
    return unary("gelu_forward", Unary::kGelu, x, y, kHalfDTypes);
  }
  Status gelu_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    return unary_grad("gelu_backward", UnaryGrad::kGelu, x, dy, dx);
  }
  Status cast(const Tensor& x, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_cast(x, y, kDTypes));
    auto type = [](DType d) {
      return d == DType::kF16 ? CastType::kF16 : d == DType::kBF16 ? CastType::kBF16 : CastType::kF32;
    };
    SLIDE_CUDA_CHECK(launch_cast(x.raw(), type(x.dtype()), y.raw(), type(y.dtype()), x.numel(), st_->stream));
    return ok_status();
  }
  Status gather_augment(const Tensor& tiles, const Tensor& records, Tensor& images) override {
    SLIDE_ASSIGN_OR_RETURN(const int64_t B, detail::validate_gather_augment(tiles, records, images, kDTypes));
    // Records are checked on the host before upload (TileDataset); the kernel writes NaN for a bad index.
    // Called from the trainer's prefetch thread: that thread's current device must be ours.
    SLIDE_CUDA_CHECK(cudaSetDevice(st_->device));
    SLIDE_CUDA_CHECK(launch_gather_augment(tiles.ptr<uint8_t>(), tiles.dim(0), tiles.dim(1),
                                           reinterpret_cast<const AugmentRecord*>(records.ptr<uint8_t>()), B,
                                           images.ptr<float>(), st_->stream));
    return ok_status();
  }
  Status sum_of_squares(const Tensor& x, double* out) override { return sum_of_squares_each({&x}, out); }
  // Every reduction queued on the stream (one partial-sum scratch, reused in stream order), each
  // total into its slot of one device array, then one copy back and one wait.
  Status sum_of_squares_each(const std::vector<const Tensor*>& xs, double* out) override {
    for (const Tensor* x : xs)
      SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("sum_of_squares", *x, *x, nullptr, kDTypes));
    if (xs.empty()) return ok_status();
    const int64_t n = static_cast<int64_t>(xs.size());
    SLIDE_ASSIGN_OR_RETURN(Tensor totals, Tensor::zeros({n}, DType::kF64, *st_->alloc, "sums of squares"));
    SLIDE_ASSIGN_OR_RETURN(Tensor partial,
                           Tensor::empty({kSumOfSquaresBlocks}, DType::kF64, *st_->alloc, "sum of squares"));
    for (int64_t i = 0; i < n; ++i) {
      const Tensor& x = *xs[static_cast<size_t>(i)];
      if (x.numel() == 0) continue;  // its slot stays 0
      const int64_t blocks = std::min<int64_t>(kernels::launch_1d(x.numel(), 256).blocks, kSumOfSquaresBlocks);
      SLIDE_CUDA_CHECK(launch_sum_of_squares(f32(x), x.numel(), partial.ptr<double>(), blocks,
                                             totals.ptr<double>() + i, st_->stream));
    }
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(out, totals.ptr<double>(), static_cast<size_t>(n) * sizeof(double),
                                     cudaMemcpyDeviceToHost, st_->stream));
    SLIDE_CUDA_CHECK(cudaStreamSynchronize(st_->stream));
    return ok_status();
  }
  Status scale(const Tensor& x, double alpha, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("scale", x, y, nullptr, kDTypes));
    SLIDE_CUDA_CHECK(launch_scale(f32(x), alpha, f32(y), x.numel(), st_->stream));
    return ok_status();
  }
  Status layer_norm_forward(const Tensor& x, const Tensor& gamma, const Tensor& beta, double eps, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_layer_norm(x, gamma, beta, eps, y, kHalfDTypes));
    SLIDE_CUDA_CHECK(launch_layer_norm_forward(storage(x.dtype()), x.raw(), f32(gamma), f32(beta), eps,
                                               storage(y.dtype()), y.raw(), d.N, d.I, st_->stream));
    return ok_status();
  }
  // Multi-head attention (backend.h), per chunk of sequences and head h: two cuBLAS strided-batched
  // GEMMs over the chunk's sequences, whose operands are strided views straight into qkv (no
  // permutes), and between them one row softmax over every head's and sequence's scores.
  // Row-major X [r, c] with row stride L is, to column-major cuBLAS, X^T [c, r] with ld L:
  //   scores_h^T [T, T] = K_h Q_h^T: A = K_h^T (as stored, ld 3C) transposed, B = Q_h^T (as
  //   stored, ld 3C), m = n = T, k = Dh, alpha = scale, ld L (T rounded up to 8,
  //   kernels::attention_scores_ld); sequences T*3C apart in A and B, T*L in C;
  //   out_h^T [Dh, T] = V_h^T P_h^T: A = V_h^T (ld 3C), B = P_h^T (the row-major probabilities,
  //   ld L), m = Dh, n = T, k = T; C = out_h^T with ld C at column h*Dh (heads concatenated per
  //   token), sequences T*C apart.
  Status attention_forward(const Tensor& qkv, int64_t batch, int64_t heads, double scale, Tensor& out) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::AttentionDims d,
                           detail::validate_attention(qkv, batch, heads, scale, out, kHalfDTypes));
    const int64_t T = d.T, H = d.H, Dh = d.Dh, C = H * Dh;
    const int64_t ld = kernels::attention_scores_ld(T);  // score rows padded to 16-byte alignment
    constexpr int64_t kMax = 2147483647;
    if (3 * C > kMax || T * ld > kMax || H > kMax || d.B > kMax)
      return slide::core::unimplemented("cuda attention_forward: an extent over 2^31 - 1");
    // The scores of a chunk of sequences at once, head-major: scores[h][b] = [T, L] for the chunk's
    // b, so that each product is one strided-batched GEMM per head over the chunk (a sequence's
    // rows are T * 3C apart in qkv, T * C in out) and the softmax one launch: 2H + 1 calls per chunk
    // instead of 3B (one per sequence and product), which left the GPU waiting on launches at
    // B = 64. A chunk holds as many sequences as keep the scratch within
    // kernels::kAttentionScratchBytes (attention_sequences_per_chunk): every sequence of a ViT at
    // 224 px at batch 64, so that the scratch grows as T^2 but not with the batch.
    // Half-precision storage (backend.h): f16 / bf16 qkv and out, the same GEMMs with half operands
    // and f32 accumulation (CUBLAS_COMPUTE_32F); the scores still come out in f32 (a documented
    // cublasGemmEx combination: half A and B, f32 C), and the softmax writes the probabilities in
    // the half type into a buffer of their own, the second GEMM's operand (backend.h allows this
    // one rounding of the probabilities). In f32 the softmax runs in place on the scores.
    const bool half = detail::is_half(qkv.dtype());
    const cudaDataType_t type = cublas_type(qkv.dtype());
    const cublasComputeType_t compute = half ? CUBLAS_COMPUTE_32F : compute_type();
    const int64_t chunk = kernels::attention_sequences_per_chunk(
        d.B, H, T, ld, static_cast<int64_t>(sizeof(float) + (half ? dtype_size(qkv.dtype()) : 0)));
    // Rows of scores and probabilities are ld apart (kernels::attention_scores_ld: aligned operands
    // for cuBLAS's vectorised kernels); the padding columns are never written nor read.
    SLIDE_ASSIGN_OR_RETURN(Tensor scores,
                           Tensor::empty({H * chunk * T, ld}, DType::kF32, *st_->alloc, "attention scores"));
    Tensor probs = scores;
    if (half) {
      SLIDE_ASSIGN_OR_RETURN(probs,
                             Tensor::empty({H * chunk * T, ld}, qkv.dtype(), *st_->alloc, "attention probabilities"));
    }
    const float alpha = static_cast<float>(scale), one = 1.0f, zero = 0.0f;
    const int t = static_cast<int>(T), dh = static_cast<int>(Dh), ld_qkv = static_cast<int>(3 * C),
              ld_out = static_cast<int>(C), ld_scores = static_cast<int>(ld);
    const long long seq_qkv = T * 3 * C, seq_out = T * C, seq_scores = T * ld;
    // Element offsets into qkv, out and probs, in bytes of their dtypes.
    const size_t e = dtype_size(qkv.dtype()), pe = dtype_size(probs.dtype());
    for (int64_t b0 = 0; b0 < d.B; b0 += chunk) {
      const int64_t nb = std::min(chunk, d.B - b0);
      const int batch_count = static_cast<int>(nb);
      const char* base = static_cast<const char*>(qkv.raw()) + b0 * seq_qkv * e;  // the chunk's first sequence
      char* out_base = static_cast<char*>(out.raw()) + b0 * seq_out * e;
      for (int64_t h = 0; h < H; ++h) {
        const char* q = base + h * Dh * e;  // the chunk's first sequence's head h: q, then k at +C, v at +2C
        float* sc = f32(scores) + h * nb * T * ld;
        // Column-major: sc^T = (k^T)^T q^T per sequence, i.e. row-major sc = q k^T.
        SLIDE_CUBLAS_CHECK(st_->blas->cublasGemmStridedBatchedEx(
            st_->cublas, CUBLAS_OP_T, CUBLAS_OP_N, t, t, dh, &alpha, q + C * e, type, ld_qkv, seq_qkv, q, type, ld_qkv,
            seq_qkv, &zero, sc, CUDA_R_32F, ld_scores, seq_scores, batch_count, compute, CUBLAS_GEMM_DEFAULT));
      }
      SLIDE_CUDA_CHECK(launch_softmax_forward(f32(scores), storage(probs.dtype()), probs.raw(), H * nb * T, T, ld,
                                              st_->stream));
      for (int64_t h = 0; h < H; ++h) {
        const char* v = base + (2 * C + h * Dh) * e;
        const char* pr = static_cast<const char*>(probs.raw()) + h * nb * T * ld * pe;
        // Row-major out_h = probs v, written into head h's Dh columns of each token's row.
        SLIDE_CUBLAS_CHECK(st_->blas->cublasGemmStridedBatchedEx(
            st_->cublas, CUBLAS_OP_N, CUBLAS_OP_N, dh, t, t, &one, v, type, ld_qkv, seq_qkv, pr,
            cublas_type(probs.dtype()), ld_scores, seq_scores, &zero, out_base + h * Dh * e, type, ld_out, seq_out,
            batch_count, compute, CUBLAS_GEMM_DEFAULT));
      }
    }
    return ok_status();
  }

  Status permute(const Tensor& x, const std::vector<int>& perm, Tensor& y) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_permute(x, perm, y, kHalfDTypes));
    return permute_storage(x, x.shape(), perm, y);
  }

  // --- Pooling ---
  // Pooling on NCHW or channels-last tensors (the inference graph's and channels-last training's).
  Status max_pool2d_forward(const Tensor& x, Pool2dParams p, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::PoolDims d, detail::validate_max_pool("max_pool2d_forward", x, p, &y, nullptr,
                                                                               nullptr, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("max_pool2d_forward", {&x}));  // y takes x's layout
    SLIDE_CUDA_CHECK(launch_max_pool_forward(storage(x.dtype()), nhwc, x.raw(), y.raw(), d.N, d.C, d.H, d.W, d.P, d.Q,
                                             p.kernel, p.stride, p.pad, st_->stream));
    return y.set_layout(layout_of(nhwc));
  }
  Status max_pool2d_backward(const Tensor& x, const Tensor& dy, Pool2dParams p, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::PoolDims d, detail::validate_max_pool("max_pool2d_backward", x, p, nullptr,
                                                                               &dy, &dx, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("max_pool2d_backward", {&x, &dy}));
    SLIDE_CUDA_CHECK(launch_max_pool_backward(storage(x.dtype()), nhwc, x.raw(), dy.raw(), dx.raw(), d.N, d.C, d.H,
                                              d.W, d.P, d.Q, p.kernel, p.stride, p.pad, st_->stream));
    return dx.set_layout(layout_of(nhwc));
  }
  Status global_avg_pool_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_global_avg_pool("global_avg_pool_forward", x, y, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("global_avg_pool_forward", {&x}, {&y}));
    SLIDE_CUDA_CHECK(
        launch_global_avg_pool_forward(storage(x.dtype()), nhwc, x.raw(), y.raw(), d.N, d.C, d.HW, st_->stream));
    return ok_status();
  }
  // dx's label chooses its layout (its only image tensor; layers.h GlobalAvgPool labels it as its
  // input was).
  Status global_avg_pool_backward(const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::BnDims d,
                           detail::validate_global_avg_pool("global_avg_pool_backward", dx, dy, kHalfLayoutDTypes));
    SLIDE_ASSIGN_OR_RETURN(const bool nhwc, channels_last("global_avg_pool_backward", {&dx}, {&dy}));
    SLIDE_CUDA_CHECK(
        launch_global_avg_pool_backward(storage(dy.dtype()), nhwc, dy.raw(), dx.raw(), d.N, d.C, d.HW, st_->stream));
    return ok_status();
  }

  // --- Fully connected (cuBLAS is column-major: a row-major [r, c] matrix is its [c, r] transpose) ---
  Status linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear("linear_forward", x, w, &b, y, kHalfDTypes));
    if (detail::is_half(x.dtype())) {
      // Half-precision storage: y filled with the bias rows, then y = x w^T + y in one cuBLAS call
      // (f16 / bf16 operands, f32 accumulation and scalars), so bias and product are rounded once.
      if (b.defined()) SLIDE_CUDA_CHECK(launch_fill_rows(storage(y.dtype()), y.raw(), b.raw(), d.N, d.O, st_->stream));
      return gemm_ex(CUBLAS_OP_T, CUBLAS_OP_N, d.O, d.N, d.I, w.raw(), d.I, x.raw(), d.I, cublas_type(x.dtype()), 1.0f,
                     b.defined() ? 1.0f : 0.0f, y.raw(), cublas_type(y.dtype()), d.O, CUBLAS_COMPUTE_32F);
    }
    // y^T [O, N] = w [O, I] x^T [I, N]: A = w seen as [I, O] transposed, B = x seen as [I, N].
    SLIDE_RETURN_IF_ERROR(gemm(CUBLAS_OP_T, CUBLAS_OP_N, d.O, d.N, d.I, f32(w), d.I, f32(x), d.I, 0.0f, f32(y), d.O));
    if (b.defined()) SLIDE_CUDA_CHECK(launch_bias_add(f32(y), f32(b), d.N, d.O, 1, st_->stream));
    return ok_status();
  }
  Status linear_backward_data(const Tensor& dy, const Tensor& w, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear("linear_backward_data", dx, w, nullptr, dy, kHalfDTypes));
    // dx^T [I, N] = w^T [I, O] dy^T [O, N].
    return gemm_ex(CUBLAS_OP_N, CUBLAS_OP_N, d.I, d.N, d.O, w.raw(), d.I, dy.raw(), d.O, cublas_type(dy.dtype()), 1.0f,
                   0.0f, dx.raw(), cublas_type(dx.dtype()), d.I, compute_type(dy.dtype()));
  }
  Status linear_backward_weights(const Tensor& x, const Tensor& dy, Tensor& dw, Tensor& db) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d,
                           detail::validate_linear_backward_weights(x, dy, dw, db, kHalfDTypes));
    // dw^T [I, O] += x^T [I, N] dy [N, O]: B = dy seen as [O, N], transposed. Half-precision x and
    // dy: f16 / bf16 operands, f32 accumulation into f32 dw (a documented cublasGemmEx combination),
    // so this product is not rounded to the half type (the op list allows either).
    SLIDE_RETURN_IF_ERROR(gemm_ex(CUBLAS_OP_N, CUBLAS_OP_T, d.I, d.O, d.N, x.raw(), d.I, dy.raw(), d.O,
                                  cublas_type(x.dtype()), 1.0f, 1.0f, dw.raw(), CUDA_R_32F, d.I,
                                  compute_type(x.dtype())));
    if (db.defined())
      SLIDE_CUDA_CHECK(launch_bias_grad(storage(dy.dtype()), dy.raw(), f32(db), d.N, d.O, 1, st_->stream));
    return ok_status();
  }
  Status matmul(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::MatmulDims d, detail::validate_matmul(a, transpose_a, b, transpose_b, y, kDTypes));
    // y^T [N, M] = op(b)^T op(a)^T. Row-major b is [K, N] (or [N, K] when transposed): seen
    // column-major it is op(b)^T as stored (no transpose) or needs one.
    return gemm(transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, d.N, d.M, d.K,
                f32(b), transpose_b ? d.K : d.N, f32(a), transpose_a ? d.M : d.K, 0.0f, f32(y), d.N);
  }

  // --- Softmax ---
  Status softmax_forward(const Tensor& x, Tensor& y) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_forward", x, y, nullptr, kDTypes));
    SLIDE_CUDA_CHECK(launch_softmax_forward(f32(x), f32(y), d.N, d.I, st_->stream));
    return ok_status();
  }
  Status softmax_backward(const Tensor& y, const Tensor& dy, Tensor& dx) override {
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_rows("softmax_backward", y, dy, &dx, kDTypes));
    SLIDE_CUDA_CHECK(launch_softmax_backward(f32(y), f32(dy), f32(dx), d.N, d.I, st_->stream));
    return ok_status();
  }

  // --- Loss ---
  Status softmax_cross_entropy_forward(const Tensor& logits, const Tensor& labels, const Tensor& class_weights,
                                       double label_smoothing, Tensor& probs, double* loss) override {
    const char* op = "softmax_cross_entropy_forward";
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_cross_entropy(op, logits, labels, class_weights,
                                                                                      label_smoothing, probs, kDTypes));
    SLIDE_ASSIGN_OR_RETURN(Tensor sums, Tensor::empty({2 + 2 * d.N}, DType::kF64, *st_->alloc, "cross-entropy sums"));
    SLIDE_ASSIGN_OR_RETURN(Tensor bad, Tensor::empty({1}, DType::kI32, *st_->alloc, "label check"));
    SLIDE_CUDA_CHECK(cudaMemsetAsync(bad.raw(), 0x7f, sizeof(int), st_->stream));
    SLIDE_CUDA_CHECK(launch_cross_entropy_forward(f32(logits), labels.ptr<int32_t>(),
                                                  class_weights.defined() ? f32(class_weights) : nullptr,
                                                  label_smoothing, f32(probs), sums.ptr<double>(), bad.ptr<int>(),
                                                  d.N, d.I, st_->stream));
    double host_sums[2] = {0, 0};
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(host_sums, sums.raw(), sizeof host_sums, cudaMemcpyDeviceToHost, st_->stream));
    SLIDE_RETURN_IF_ERROR(check_labels(op, labels, bad, d.I));
    *loss = host_sums[1] > 0 ? host_sums[0] / host_sums[1] : 0.0;
    return ok_status();
  }
  Status softmax_cross_entropy_backward(const Tensor& probs, const Tensor& labels, const Tensor& class_weights,
                                        double label_smoothing, Tensor& dlogits) override {
    const char* op = "softmax_cross_entropy_backward";
    SLIDE_ASSIGN_OR_RETURN(const detail::LinearDims d, detail::validate_cross_entropy(op, probs, labels, class_weights,
                                                                                      label_smoothing, dlogits, kDTypes));
    // sum_n w[y_n] and sum_c w[c] (kernels.h).
    SLIDE_ASSIGN_OR_RETURN(Tensor wsum, Tensor::empty({2}, DType::kF64, *st_->alloc, "cross-entropy weight sums"));
    SLIDE_ASSIGN_OR_RETURN(Tensor bad, Tensor::empty({1}, DType::kI32, *st_->alloc, "label check"));
    SLIDE_CUDA_CHECK(cudaMemsetAsync(bad.raw(), 0x7f, sizeof(int), st_->stream));
    SLIDE_CUDA_CHECK(launch_cross_entropy_backward(f32(probs), labels.ptr<int32_t>(),
                                                   class_weights.defined() ? f32(class_weights) : nullptr,
                                                   label_smoothing, f32(dlogits), wsum.ptr<double>(), bad.ptr<int>(),
                                                   d.N, d.I, st_->stream));
    return check_labels(op, labels, bad, d.I);
  }

  // --- Optimizers ---
  Status sgd_update(Tensor& param, const Tensor& grad, Tensor& momentum_buf, double lr, double momentum,
                    double dampening, double weight_decay, bool nesterov, bool first_step) override {
    SLIDE_RETURN_IF_ERROR(
        detail::validate_same_shape("sgd_update", param, grad, momentum > 0 ? &momentum_buf : nullptr, kDTypes));
    SLIDE_CUDA_CHECK(launch_sgd_update(f32(param), f32(grad), momentum > 0 ? f32(momentum_buf) : nullptr,
                                       param.numel(), lr, momentum, dampening, weight_decay, nesterov, first_step,
                                       st_->stream));
    return ok_status();
  }
  Status adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1, double beta2,
                      double eps, double weight_decay, int64_t step) override {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("adamw_update", param, grad, &m, kDTypes));
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape("adamw_update", param, v, nullptr, kDTypes));
    if (step < 1) return slide::core::invalid_argument("adamw_update: step " + std::to_string(step) + " < 1");
    const formulas::AdamCorrections c = formulas::adam_corrections(beta1, beta2, step);
    SLIDE_CUDA_CHECK(launch_adamw_update(f32(param), f32(grad), f32(m), f32(v), param.numel(), lr, beta1, beta2, eps,
                                         weight_decay, c.c1, c.c2, st_->stream));
    return ok_status();
  }

 private:
  Status unary(const char* op, Unary f, const Tensor& x, Tensor& y, detail::DTypes dtypes = kDTypes) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, x, y, nullptr, dtypes));
    SLIDE_CUDA_CHECK(launch_unary(f, storage(x.dtype()), x.raw(), y.raw(), x.numel(), st_->stream));
    return ok_status();
  }
  Status unary_grad(const char* op, UnaryGrad f, const Tensor& y, const Tensor& dy, Tensor& dx,
                    detail::DTypes dtypes = kDTypes) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, y, dy, &dx, dtypes));
    SLIDE_CUDA_CHECK(launch_unary_grad(f, storage(y.dtype()), y.raw(), dy.raw(), dx.raw(), y.numel(), st_->stream));
    return ok_status();
  }
  // mul (kHalfDTypes: one dtype for the three).
  Status binary(const char* op, Binary b, const Tensor& x, const Tensor& z, Tensor& y) {
    SLIDE_RETURN_IF_ERROR(detail::validate_same_shape(op, x, z, &y, kHalfDTypes));
    SLIDE_CUDA_CHECK(launch_binary(b, storage(x.dtype()), x.raw(), storage(z.dtype()), z.raw(), y.raw(), x.numel(),
                                   st_->stream));
    return ok_status();
  }

  // C [m, n] (column-major, ldc) = alpha op(A) op(B) + beta C, alpha = 1, on f32 operands at this
  // backend's compute type (gemm_ex).
  Status gemm(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
    return gemm_ex(ta, tb, m, n, k, A, lda, B, ldb, CUDA_R_32F, 1.0f, beta, C, CUDA_R_32F, ldc, compute_type());
  }
  // C = alpha op(A) op(B) + beta C with A and B of ab_type, C of c_type and f32 scalars: f32
  // operands at compute_type(), or half-precision storage (A and B CUDA_R_16F / CUDA_R_16BF, C the
  // same or CUDA_R_32F, `compute` CUBLAS_COMPUTE_32F: among cublasGemmEx's documented type
  // combinations, run on tensor cores). k == 0 leaves C = beta C (zeros for beta 0: cuBLAS leaves C
  // untouched for k == 0 only when beta == 1; the op list overwrites with 0).
  Status gemm_ex(cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* A,
                 int64_t lda, const void* B, int64_t ldb, cudaDataType_t ab_type, float alpha, float beta, void* C,
                 cudaDataType_t c_type, int64_t ldc, cublasComputeType_t compute) {
    if (m == 0 || n == 0) return ok_status();
    constexpr int64_t kMax = 2147483647;
    if (m > kMax || n > kMax || k > kMax || lda > kMax || ldb > kMax || ldc > kMax)
      return slide::core::unimplemented("cuda gemm: an extent over 2^31 - 1");
    if (k == 0) {
      // All-zero bits are 0 in every type.
      const size_t elem = c_type == CUDA_R_32F ? sizeof(float) : sizeof(uint16_t);
      if (beta == 0.0f) SLIDE_CUDA_CHECK(cudaMemsetAsync(C, 0, static_cast<size_t>(m * n) * elem, st_->stream));
      return ok_status();
    }
    SLIDE_CUBLAS_CHECK(st_->blas->cublasGemmEx(st_->cublas, ta, tb, static_cast<int>(m), static_cast<int>(n),
                                               static_cast<int>(k), &alpha, A, ab_type, static_cast<int>(lda), B,
                                               ab_type, static_cast<int>(ldb), &beta, C, c_type,
                                               static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT));
    return ok_status();
  }

  // cuBLAS's compute type for this backend's math precision (conv_plan.h's gemm_compute), f32
  // operands and result: the "fast" types let cuBLAS round the inputs (to TF32, or bfloat16 or
  // TF32) and use tensor cores, accumulating in f32. alpha and beta stay f32.
  cublasComputeType_t compute_type() const {
    switch (gemm_compute(math_precision_)) {
      case GemmCompute::kF32FastTf32:
        return CUBLAS_COMPUTE_32F_FAST_TF32;
      case GemmCompute::kF32Fast16Bf:
        return CUBLAS_COMPUTE_32F_FAST_16BF;
      case GemmCompute::kF32Fast16F:
        return CUBLAS_COMPUTE_32F_FAST_16F;
      case GemmCompute::kF32:
        break;
    }
    return CUBLAS_COMPUTE_32F;
  }

  // ... for operands of `operands`' dtype: f16 / bf16 storage already holds the rounded operands,
  // so CUBLAS_COMPUTE_32F (tensor cores, f32 accumulation; gemm_ex's half combinations); f32 ones
  // at the math precision's type above.
  cublasComputeType_t compute_type(DType operands) const {
    return detail::is_half(operands) ? CUBLAS_COMPUTE_32F : compute_type();
  }

  // Waits for the stream and turns the kernel's label flag into the op list's error.
  Status check_labels(const char* op, const Tensor& labels, const Tensor& bad, int64_t classes) {
    int first_bad = kNoBadLabel;
    SLIDE_CUDA_CHECK(cudaMemcpyAsync(&first_bad, bad.raw(), sizeof(int), cudaMemcpyDeviceToHost, st_->stream));
    SLIDE_CUDA_CHECK(cudaStreamSynchronize(st_->stream));
    if (first_bad == kNoBadLabel) return ok_status();
    int32_t label = 0;
    SLIDE_CUDA_CHECK(cudaMemcpy(&label, labels.ptr<int32_t>() + first_bad, sizeof label, cudaMemcpyDeviceToHost));
    return slide::core::invalid_argument(std::string(op) + ": label " + std::to_string(label) + " of sample " +
                                         std::to_string(first_bad) + " is outside [0, " + std::to_string(classes) + ")");
  }

  // cuDNN's forward algorithms for `ds`, best first (the heuristics; for conv2d_forward and the
  // fused inference convolution alike), and an algorithm's workspace bytes.
  Result<std::vector<AlgoCandidate>> forward_candidates(const ConvDescs& ds) const {
    cudnnConvolutionFwdAlgoPerf_t perf[CUDNN_CONVOLUTION_FWD_ALGO_COUNT];
    int n = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(st_->cudnn, ds.x.d, ds.w.d, ds.conv.d, ds.y.d,
                                                             CUDNN_CONVOLUTION_FWD_ALGO_COUNT, &n, perf));
    return candidates_of(perf, n);
  }
  Result<size_t> forward_workspace(const ConvDescs& ds, int algo) const {
    size_t bytes = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionForwardWorkspaceSize(st_->cudnn, ds.x.d, ds.w.d, ds.conv.d, ds.y.d,
                                                              static_cast<cudnnConvolutionFwdAlgo_t>(algo), &bytes));
    return bytes;
  }
  // The same for backward data (dx from dy) and backward filter (dw from x and dy).
  Result<std::vector<AlgoCandidate>> backward_data_candidates(const ConvDescs& ds) const {
    cudnnConvolutionBwdDataAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT];
    int n = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(st_->cudnn, ds.w.d, ds.y.d, ds.conv.d, ds.x.d,
                                                                  CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, &n, perf));
    return candidates_of(perf, n);
  }
  Result<size_t> backward_data_workspace(const ConvDescs& ds, int algo) const {
    size_t bytes = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionBackwardDataWorkspaceSize(
        st_->cudnn, ds.w.d, ds.y.d, ds.conv.d, ds.x.d, static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), &bytes));
    return bytes;
  }
  Result<std::vector<AlgoCandidate>> backward_filter_candidates(const ConvDescs& ds) const {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT];
    int n = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        st_->cudnn, ds.x.d, ds.y.d, ds.conv.d, ds.w.d, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, &n, perf));
    return candidates_of(perf, n);
  }
  Result<size_t> backward_filter_workspace(const ConvDescs& ds, int algo) const {
    size_t bytes = 0;
    SLIDE_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterWorkspaceSize(
        st_->cudnn, ds.x.d, ds.y.d, ds.conv.d, ds.w.d, static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), &bytes));
    return bytes;
  }

  // The algorithm cache's key of a convolution pass at this backend's math precision (the ops and
  // conv_workspace_bytes alike, so that the planner asks about the algorithm the op will run).
  // `storage`: the tensors' dtype (f32, or f16 / bf16 for half-precision storage); nhwc: channels
  // last with a KRSC filter (the inference graph's layout).
  ConvKey conv_key(ConvDirection direction, const detail::ConvDims& d, Conv2dParams p, DType storage = DType::kF32,
                   bool nhwc = false) const {
    return ConvKey{direction, d.N, d.C, d.H, d.W, d.K, d.R, d.S, p.stride, p.pad, conv_math(math_precision_),
                   conv_storage(storage), nhwc};
  }

  // The candidates to try for `key` (conv_plan.h choose_candidates): non-deterministic ones only
  // where cuDNN has no deterministic one, with a warning naming the convolution (once per shape).
  // kUnimplemented when cuDNN can run nothing for it.
  Result<std::vector<AlgoCandidate>> candidate_order(const ConvKey& key, const std::vector<AlgoCandidate>& all) {
    bool deterministic = true;
    std::vector<AlgoCandidate> order = choose_candidates(all, &deterministic);
    if (order.empty())
      return slide::core::unimplemented("cuda conv2d: cuDNN offers no algorithm it can run for " + describe(key));
    if (!deterministic) {
      bool first = false;
      {
        std::lock_guard<std::mutex> lock(st_->mu);
        first = st_->nondeterministic.insert(key).second;
      }
      if (first)
        slide::core::log_warn("cuDNN has no deterministic algorithm for a convolution: it runs on a non-deterministic "
                              "one (its results may differ in the last bits from run to run and between ranks)",
                              {{"convolution", describe(key)}});
    }
    return order;
  }

  // The workspace run_conv would take for `key`: the cached algorithm's, else the first
  // candidate's in conv_plan.h's order (run_conv takes it when the budget grants it, and only a
  // smaller one otherwise), under the math type it is listed with. Remembered per key until an
  // algorithm is cached for it (the planner asks for the same shapes at every micro-batch it tries).
  template <typename Candidates, typename Workspace>
  Result<size_t> planned_workspace(const ConvKey& key, ConvDescs& ds, Candidates candidates, Workspace workspace) {
    std::optional<AlgoCandidate> cached;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      auto it = st_->algos.find(key);
      if (it != st_->algos.end()) cached = it->second;
      if (!cached) {
        auto planned = st_->planned_workspace.find(key);
        if (planned != st_->planned_workspace.end()) return planned->second;
      }
    }
    AlgoCandidate c;
    if (cached) {
      c = *cached;
    } else {
      SLIDE_ASSIGN_OR_RETURN(std::vector<AlgoCandidate> all, candidates());
      SLIDE_ASSIGN_OR_RETURN(const std::vector<AlgoCandidate> order, candidate_order(key, all));
      c = order.front();
    }
    if (key.math != ConvMath::kFma && c.math_type >= 0)
      SLIDE_CUDNN_CHECK(cudnnSetConvolutionMathType(ds.conv.d, static_cast<cudnnMathType_t>(c.math_type)));
    SLIDE_ASSIGN_OR_RETURN(const size_t bytes, workspace(c.algo));
    if (!cached) {
      std::lock_guard<std::mutex> lock(st_->mu);
      st_->planned_workspace[key] = bytes;
    }
    return bytes;
  }

  // Runs a convolution with the cached algorithm for `key`, or chooses one: cuDNN's candidates in
  // conv_plan.h's order, the first whose workspace the budget grants and that runs. A candidate
  // that cuDNN refuses when called (kUnimplemented: the heuristics are asked for the plain
  // convolution, and cudnnConvolutionBiasActivationForward or beta = 1 may not be supported by
  // every algorithm they list) or that runs out of device memory inside cuDNN
  // (kResourceExhausted) is passed over for the next, as PyTorch's cuDNN convolutions do
  // (ATen's Conv_v7.cpp, AlgoIterator::try_all); the last such error is returned when none runs.
  //
  // Under tensor-op math (tf32, bf16, fp16) each candidate runs with the math type cuDNN's heuristics
  // reported for it (perf.mathType, set on the descriptor before its workspace is asked for, as
  // PyTorch's cuDNN convolutions do): the same algorithm may be listed once per math type, and
  // its workspace and kernels differ by math type. Under FMA math (fp32) the descriptor stays
  // CUDNN_FMA_MATH.
  template <typename Candidates, typename Workspace, typename Run>
  Status run_conv(const ConvKey& key, ConvDescs& ds, Candidates candidates, Workspace workspace, Run run) {
    std::optional<AlgoCandidate> cached;
    {
      std::lock_guard<std::mutex> lock(st_->mu);
      auto it = st_->algos.find(key);
      if (it != st_->algos.end()) cached = it->second;
    }
    std::vector<AlgoCandidate> order;
    if (cached) {
      order.push_back(*cached);
    } else {
      SLIDE_ASSIGN_OR_RETURN(std::vector<AlgoCandidate> all, candidates());
      SLIDE_ASSIGN_OR_RETURN(order, candidate_order(key, all));
    }
    Status last = ok_status();
    for (const AlgoCandidate& c : order) {
      if (key.math != ConvMath::kFma && c.math_type >= 0)
        SLIDE_CUDNN_CHECK(cudnnSetConvolutionMathType(ds.conv.d, static_cast<cudnnMathType_t>(c.math_type)));
      // cuDNN may refuse the workspace query of a listed algorithm under the math type set above
      // (CUDNN_STATUS_NOT_SUPPORTED: kUnimplemented): passed over as a refused run is.
      Result<size_t> queried = workspace(c.algo);
      if (!queried.ok()) {
        if (queried.status().code() != StatusCode::kUnimplemented) return queried.status();
        last = queried.status();
        continue;
      }
      const size_t bytes = *queried;
      Tensor ws;
      if (bytes > 0) {
        auto t = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, *st_->alloc, "cuDNN workspace");
        if (!t.ok()) {
          if (t.status().code() != StatusCode::kResourceExhausted) return t.status();
          last = t.status();
          continue;  // the next candidate may need less
        }
        ws = std::move(*t);
      }
      if (Status s = run(c.algo, ws.raw(), bytes); !s.ok()) {
        if (s.code() != StatusCode::kUnimplemented && s.code() != StatusCode::kResourceExhausted) return s;
        last = std::move(s);
        continue;
      }
      if (!cached) {
        std::lock_guard<std::mutex> lock(st_->mu);
        st_->algos[key] = c;
      }
      return ok_status();
    }
    if (cached) {  // the cached algorithm's workspace no longer fits, or it no longer runs: choose again
      {
        std::lock_guard<std::mutex> lock(st_->mu);
        st_->algos.erase(key);
      }
      if (key.math != ConvMath::kFma)  // back to the math the heuristics are asked with
        SLIDE_CUDNN_CHECK(cudnnSetConvolutionMathType(ds.conv.d, ConvDesc::cudnn_math(key.math)));
      return run_conv(key, ds, candidates, workspace, run);
    }
    return last;
  }

  DeviceState* st_;
};

}  // namespace

Result<int> usable_device_count() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return slide::core::unavailable("cuda: no usable CUDA driver or device (cudaGetDeviceCount: " +
                                    std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e) + ")");
  }
  return count;
}

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  SLIDE_ASSIGN_OR_RETURN(DeviceState * st, device_state(device));
  // Kernels launch on the calling thread's current device: the thread that makes the backend is
  // the one that calls its ops (one process per GPU, as the data-parallel design has it).
  SLIDE_CUDA_CHECK(cudaSetDevice(device));
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(st));
}

Result<CachingDeviceAllocator*> device_allocator(int device) {
  SLIDE_ASSIGN_OR_RETURN(DeviceState * st, device_state(device));
  return st->alloc.get();
}

}  // namespace slide::train::cuda
