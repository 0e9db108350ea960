// Backend::attention_forward's default: multi-head attention composed from the op list's
// permute, matmul, scale and softmax_forward, one sequence and head at a time (backend.h); and
// linear_gelu_forward's, linear_forward then gelu_forward. Their own file, beside the vtable's
// users that link only part of libtrain (tests/fuzz).
#include "slide/train/backend.h"

#include <cmath>
#include <string>

#include "op_checks.h"

namespace slide::train {

namespace detail {

Result<AttentionDims> validate_attention(const Tensor& qkv, int64_t batch, int64_t heads, double scale,
                                         const Tensor& out, DTypes dtypes) {
  const std::string op = "attention_forward: ";
  if (!qkv.defined() || !out.defined() || qkv.rank() != 2 || out.rank() != 2)
    return slide::core::invalid_argument(op + "qkv " + shape_string(qkv.shape()) + " and out " +
                                         shape_string(out.shape()) + " must be matrices");
  const int64_t rows = qkv.dim(0), C = qkv.dim(1) / 3;
  if (batch < 1 || heads < 1 || rows < batch || rows % batch != 0 || qkv.dim(1) % 3 != 0 || C < 1 || C % heads != 0)
    return slide::core::invalid_argument(op + "qkv " + shape_string(qkv.shape()) + " is not [batch x tokens, 3 x " +
                                         std::to_string(heads) + " heads x head width] for batch " +
                                         std::to_string(batch));
  if (out.shape() != Shape{rows, C})
    return slide::core::invalid_argument(op + "out is " + shape_string(out.shape()) + ", expected " +
                                         shape_string({rows, C}));
  if (!std::isfinite(scale)) return slide::core::invalid_argument(op + "scale " + std::to_string(scale) + " is not finite");
  if (qkv.shares_storage(out)) return slide::core::invalid_argument(op + "out must not share qkv's storage");
  if (qkv.dtype() != out.dtype() || qkv.device() != dtypes.device || out.device() != dtypes.device ||
      qkv.layout() != Layout::kPlain || out.layout() != Layout::kPlain)
    return slide::core::invalid_argument(op + "qkv and out must be plain, of one dtype, on " +
                                         device_name(dtypes.device));
  if (!((qkv.dtype() == DType::kF32 && dtypes.f32) || (qkv.dtype() == DType::kF64 && dtypes.f64) ||
        (is_half(qkv.dtype()) && dtypes.half)))
    return slide::core::unimplemented(op + "dtype " + dtype_name(qkv.dtype()) + " is not implemented here");
  return AttentionDims{batch, rows / batch, heads, C / heads};
}

}  // namespace detail

Status Backend::linear_gelu_forward(const Tensor& x, const Tensor& w, const Tensor& b, Tensor& y) {
  SLIDE_RETURN_IF_ERROR(linear_forward(x, w, b, y));
  return gelu_forward(y, y);
}

Status Backend::attention_forward(const Tensor& qkv, int64_t batch, int64_t heads, double scale, Tensor& out) {
  SLIDE_ASSIGN_OR_RETURN(const detail::AttentionDims d,
                         detail::validate_attention(qkv, batch, heads, scale, out,
                                                    detail::DTypes{true, true, false, out.device()}));
  const int64_t B = d.B, T = d.T, H = d.H, Dh = d.Dh;
  Allocator& alloc = allocator();
  // [B, T, 3, H, Dh] -> [3, B, H, T, Dh]: each head's q, k and v contiguous [T, Dh].
  SLIDE_ASSIGN_OR_RETURN(Tensor split, Tensor::empty({3, B, H, T, Dh}, qkv.dtype(), alloc, "attention heads"));
  SLIDE_ASSIGN_OR_RETURN(Tensor packed, qkv.reshape({B, T, 3, H, Dh}));
  SLIDE_RETURN_IF_ERROR(permute(packed, {2, 0, 3, 1, 4}, split));
  SLIDE_ASSIGN_OR_RETURN(Tensor scores, Tensor::empty({T, T}, qkv.dtype(), alloc, "attention scores"));
  SLIDE_ASSIGN_OR_RETURN(Tensor ctx, Tensor::empty({B, H, T, Dh}, qkv.dtype(), alloc, "attention output"));
  const int64_t head = T * Dh, part = B * H * head;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t at = (b * H + h) * head;
      SLIDE_ASSIGN_OR_RETURN(Tensor q, split.view(at, {T, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor k, split.view(part + at, {T, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor v, split.view(2 * part + at, {T, Dh}));
      SLIDE_ASSIGN_OR_RETURN(Tensor o, ctx.view(at, {T, Dh}));
      SLIDE_RETURN_IF_ERROR(matmul(q, false, k, true, scores));
      SLIDE_RETURN_IF_ERROR(this->scale(scores, scale, scores));
      SLIDE_RETURN_IF_ERROR(softmax_forward(scores, scores));
      SLIDE_RETURN_IF_ERROR(matmul(scores, false, v, false, o));
    }
  // [B, H, T, Dh] -> [B, T, H, Dh] = [B*T, C]: the heads concatenated per token.
  SLIDE_ASSIGN_OR_RETURN(Tensor merged, out.reshape({B, T, H, Dh}));
  return permute(ctx, {0, 2, 1, 3}, merged);
}

}  // namespace slide::train
