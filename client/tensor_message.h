#pragma once

// Building and reading moe_ep.v1.Tensor messages on the coordinator side
// (proto/moe_ep/v1/tensor.proto: dtype, row-major shape, little-endian bytes).
// The host is little-endian (x86-64, aarch64), so element bytes are copied.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "moe_ep/v1/tensor.pb.h"

namespace moe_ep::client {

// [rows, cols] tensors. REQUIRES: values.size() == rows * cols.
moe_ep::v1::Tensor MakeBf16Tensor(absl::Span<const core::bf16_t> values, int64_t rows,
                                  int64_t cols);
moe_ep::v1::Tensor MakeInt32Tensor(absl::Span<const int32_t> values, int64_t rows, int64_t cols);
moe_ep::v1::Tensor MakeFp32Tensor(absl::Span<const float> values, int64_t rows, int64_t cols);

// Reads a bf16 tensor of shape [rows, cols].
// Errors: kInvalidArgument naming `field` when the dtype is not bf16, the
// shape differs, or the byte length is not rows * cols * 2.
absl::StatusOr<std::vector<core::bf16_t>> ReadBf16Tensor(const moe_ep::v1::Tensor& tensor,
                                                         absl::string_view field, int64_t rows,
                                                         int64_t cols);

}  // namespace moe_ep::client
