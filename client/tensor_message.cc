#include "client/tensor_message.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::client {
namespace {

template <typename T>
moe_ep::v1::Tensor MakeTensor(moe_ep::v1::DType dtype, absl::Span<const T> values, int64_t rows,
                              int64_t cols) {
  moe_ep::v1::Tensor t;
  t.set_dtype(dtype);
  t.add_shape(rows);
  t.add_shape(cols);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  return t;
}

}  // namespace

moe_ep::v1::Tensor MakeBf16Tensor(absl::Span<const core::bf16_t> values, int64_t rows,
                                  int64_t cols) {
  return MakeTensor(moe_ep::v1::DTYPE_BF16, values, rows, cols);
}
moe_ep::v1::Tensor MakeInt32Tensor(absl::Span<const int32_t> values, int64_t rows, int64_t cols) {
  return MakeTensor(moe_ep::v1::DTYPE_INT32, values, rows, cols);
}
moe_ep::v1::Tensor MakeFp32Tensor(absl::Span<const float> values, int64_t rows, int64_t cols) {
  return MakeTensor(moe_ep::v1::DTYPE_FP32, values, rows, cols);
}

absl::StatusOr<std::vector<core::bf16_t>> ReadBf16Tensor(const moe_ep::v1::Tensor& tensor,
                                                         absl::string_view field, int64_t rows,
                                                         int64_t cols) {
  if (tensor.dtype() != moe_ep::v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected DTYPE_BF16, got ",
                                                   moe_ep::v1::DType_Name(tensor.dtype())));
  }
  if (tensor.shape_size() != 2 || tensor.shape(0) != rows || tensor.shape(1) != cols) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected [", rows, ", ", cols,
                                                   "], got [", absl::StrJoin(tensor.shape(), ", "),
                                                   "]"));
  }
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(core::bf16_t);
  if (tensor.data().size() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data: expected ", bytes, " bytes, got ", tensor.data().size()));
  }
  std::vector<core::bf16_t> out(static_cast<size_t>(rows * cols));
  std::memcpy(out.data(), tensor.data().data(), bytes);
  return out;
}

}  // namespace moe_ep::client
