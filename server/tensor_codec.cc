#include "server/tensor_codec.h"

#include <bit>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace moe_ep::server {
namespace {

static_assert(std::endian::native == std::endian::little,
              "Tensor bytes are little-endian; this host decoder copies them as-is");

// Caps the element count so product(shape) * 4 never overflows int64 (2^40
// elements = 4 TiB of fp32, far beyond any message).
constexpr int64_t kMaxElements = int64_t{1} << 40;

std::string ShapeString(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
}

int64_t NumElements(const v1::Tensor& tensor) {
  int64_t n = 1;
  for (int64_t d : tensor.shape()) n *= d;
  return n;
}

absl::Status WrongDType(const v1::Tensor& tensor, absl::string_view field,
                        absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: expected ", expected, ", got ",
                                                 TensorDTypeName(tensor.dtype())));
}

template <typename T>
DecodedTensor<T> CopyOut(const v1::Tensor& tensor) {
  DecodedTensor<T> out;
  out.shape.assign(tensor.shape().begin(), tensor.shape().end());
  out.values.resize(static_cast<size_t>(NumElements(tensor)));
  if (!out.values.empty())
    std::memcpy(out.values.data(), tensor.data().data(), tensor.data().size());
  return out;
}

template <typename T>
v1::Tensor Encode(v1::DType dtype, absl::Span<const T> values, absl::Span<const int64_t> shape) {
  v1::Tensor tensor;
  tensor.set_dtype(dtype);
  for (int64_t d : shape) tensor.add_shape(d);
  tensor.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  return tensor;
}

}  // namespace

absl::string_view TensorDTypeName(int dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return "bf16";
    case v1::DTYPE_FP32:
      return "fp32";
    case v1::DTYPE_INT32:
      return "int32";
    case v1::DTYPE_UNSPECIFIED:
      return "unspecified";
    default:
      return "unknown";
  }
}

int64_t TensorDTypeBytes(int dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_FP32:
    case v1::DTYPE_INT32:
      return 4;
    default:
      return 0;
  }
}

absl::Status ValidateTensor(const v1::Tensor& tensor, absl::string_view field, int expected_rank) {
  const int64_t elem_bytes = TensorDTypeBytes(tensor.dtype());
  if (elem_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".dtype: expected DTYPE_BF16, DTYPE_FP32 or DTYPE_INT32, got ",
        tensor.dtype() == v1::DTYPE_UNSPECIFIED ? std::string("DTYPE_UNSPECIFIED")
                                                : absl::StrCat("unknown value ", tensor.dtype())));
  }
  if (tensor.shape_size() != expected_rank) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: expected ", expected_rank,
                                                   " dims, got ", tensor.shape_size(), " (",
                                                   ShapeString(tensor), ")"));
  }
  int64_t elements = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    const int64_t d = tensor.shape(i);
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".shape[", i, "]: expected >= 0, got ",
                                                     d, " (shape ", ShapeString(tensor), ")"));
    }
    if (d > 0 && elements > kMaxElements / d) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape: ", ShapeString(tensor), " has more than 2^40 elements"));
    }
    elements *= d;
  }
  const int64_t expected_bytes = elements * elem_bytes;
  if (static_cast<int64_t>(tensor.data().size()) != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data: expected ", expected_bytes, " bytes for shape ", ShapeString(tensor), " ",
        TensorDTypeName(tensor.dtype()), ", got ", tensor.data().size()));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::string_view> ValidateTensorOf(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank,
                                                   absl::Span<const v1::DType> dtypes,
                                                   absl::string_view expected) {
  RETURN_IF_ERROR(ValidateTensor(tensor, field, expected_rank));
  for (v1::DType dtype : dtypes) {
    if (tensor.dtype() == dtype) return absl::string_view(tensor.data());
  }
  return WrongDType(tensor, field, expected);
}

absl::StatusOr<DecodedTensor<core::bf16_t>> DecodeBf16(const v1::Tensor& tensor,
                                                       absl::string_view field, int expected_rank) {
  RETURN_IF_ERROR(ValidateTensor(tensor, field, expected_rank));
  if (tensor.dtype() == v1::DTYPE_BF16) return CopyOut<core::bf16_t>(tensor);
  if (tensor.dtype() != v1::DTYPE_FP32) return WrongDType(tensor, field, "bf16 or fp32");
  DecodedTensor<float> wide = CopyOut<float>(tensor);
  DecodedTensor<core::bf16_t> out;
  out.shape = std::move(wide.shape);
  out.values.resize(wide.values.size());
  for (size_t i = 0; i < wide.values.size(); ++i) out.values[i] = core::FloatToBf16(wide.values[i]);
  return out;
}

absl::StatusOr<DecodedTensor<float>> DecodeFloat32(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank) {
  RETURN_IF_ERROR(ValidateTensor(tensor, field, expected_rank));
  if (tensor.dtype() != v1::DTYPE_FP32) return WrongDType(tensor, field, "fp32");
  return CopyOut<float>(tensor);
}

absl::StatusOr<DecodedTensor<int32_t>> DecodeInt32(const v1::Tensor& tensor,
                                                   absl::string_view field, int expected_rank) {
  RETURN_IF_ERROR(ValidateTensor(tensor, field, expected_rank));
  if (tensor.dtype() != v1::DTYPE_INT32) return WrongDType(tensor, field, "int32");
  return CopyOut<int32_t>(tensor);
}

v1::Tensor EncodeBf16(absl::Span<const core::bf16_t> values, absl::Span<const int64_t> shape) {
  return Encode(v1::DTYPE_BF16, values, shape);
}

v1::Tensor EncodeFloat32(absl::Span<const float> values, absl::Span<const int64_t> shape) {
  return Encode(v1::DTYPE_FP32, values, shape);
}

v1::Tensor EncodeInt32(absl::Span<const int32_t> values, absl::Span<const int64_t> shape) {
  return Encode(v1::DTYPE_INT32, values, shape);
}

}  // namespace moe_ep::server
