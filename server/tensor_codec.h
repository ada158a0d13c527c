#pragma once

// Decoding and encoding of moe_ep.v1.Tensor messages (proto/moe_ep/v1/tensor.proto):
// dtype, row-major shape and little-endian bytes. Every check names the
// request field, so a caller sees e.g.
//   "hidden_states.data: expected 8192 bytes for shape [2, 2048] bf16, got 100".
// Source: DESIGN §8 ("the byte length must match the shape").

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "moe_ep/v1/tensor.pb.h"

namespace moe_ep::server {

// A decoded tensor: its shape and its elements in row-major order.
template <typename T>
struct DecodedTensor {
  std::vector<int64_t> shape;
  std::vector<T> values;  // product(shape) elements
};

// "bf16", "fp32", "int32"; "unspecified" or "unknown" otherwise.
absl::string_view TensorDTypeName(int dtype);

// Bytes per element of a known dtype (2 or 4); 0 for unspecified or unknown.
int64_t TensorDTypeBytes(int dtype);

// ValidateTensor()
//
// Checks `tensor` (named `field` in messages) by itself: a known dtype, rank
// == `expected_rank` dims, every dim >= 0, at most 2^40 elements, and a data
// length of exactly product(shape) * sizeof(dtype) bytes.
// Errors: kInvalidArgument naming "<field>.dtype", "<field>.shape" or
// "<field>.data" with expected and actual values. Pure and thread-safe.
absl::Status ValidateTensor(const v1::Tensor& tensor, absl::string_view field, int expected_rank);

// ValidateTensorOf()
//
// ValidateTensor, then the dtype must be one of `dtypes` (`expected` names
// them in the message, e.g. "bf16 or fp32"). Returns a view of the tensor's
// bytes in the message (no copy; valid while `tensor` lives and is not
// modified), so a data plane can copy them once, straight to where they go
// (issue 11 item 2).
// Errors: ValidateTensor's, and kInvalidArgument
// "<field>.dtype: expected <expected>, got <dtype>". Pure and thread-safe.
absl::StatusOr<absl::string_view> ValidateTensorOf(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank,
                                                   absl::Span<const v1::DType> dtypes,
                                                   absl::string_view expected);

// DecodeBf16()
//
// Returns the elements as bf16 bit patterns. Accepts DTYPE_BF16 (copied) and
// DTYPE_FP32 (each value rounded to nearest-even bf16, core/bf16.h).
// Errors: ValidateTensor's, and kInvalidArgument "<field>.dtype" for int32.
absl::StatusOr<DecodedTensor<core::bf16_t>> DecodeBf16(const v1::Tensor& tensor,
                                                       absl::string_view field, int expected_rank);

// DecodeFloat32()
//
// Returns fp32 elements. Requires DTYPE_FP32.
// Errors: ValidateTensor's, and kInvalidArgument "<field>.dtype" otherwise.
absl::StatusOr<DecodedTensor<float>> DecodeFloat32(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank);

// DecodeInt32()
//
// Returns int32 elements. Requires DTYPE_INT32.
// Errors: ValidateTensor's, and kInvalidArgument "<field>.dtype" otherwise.
absl::StatusOr<DecodedTensor<int32_t>> DecodeInt32(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank);

// Encoders: `values` holds product(shape) elements, row-major.
// REQUIRES: values.size() == product(shape). Pure and thread-safe.
v1::Tensor EncodeBf16(absl::Span<const core::bf16_t> values, absl::Span<const int64_t> shape);
v1::Tensor EncodeFloat32(absl::Span<const float> values, absl::Span<const int64_t> shape);
v1::Tensor EncodeInt32(absl::Span<const int32_t> values, absl::Span<const int64_t> shape);

}  // namespace moe_ep::server
