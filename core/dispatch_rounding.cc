#include "core/dispatch_rounding.h"

#include "absl/strings/str_cat.h"
#include "core/fp8_e4m3.h"

namespace moe_ep::core {

absl::StatusOr<std::vector<bf16_t>> DispatchedHidden(DispatchDType dtype,
                                                     absl::Span<const bf16_t> hidden,
                                                     int64_t num_tokens, int64_t hidden_size) {
  if (num_tokens < 0 || hidden_size < 1 ||
      static_cast<int64_t>(hidden.size()) != num_tokens * hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected [", num_tokens, ", ",
                                                   hidden_size, "] elements, got ", hidden.size()));
  }
  std::vector<bf16_t> out(hidden.begin(), hidden.end());
  switch (dtype) {
    case DispatchDType::kBF16:
      return out;
    case DispatchDType::kFP8E4M3: {
      if (hidden_size % fp8::kBlockSize != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("hidden: fp8_e4m3 dispatch needs a multiple of ", fp8::kBlockSize,
                         ", got ", hidden_size));
      }
      std::vector<uint8_t> codes(hidden_size);
      std::vector<float> scales(hidden_size / fp8::kBlockSize);
      for (int64_t t = 0; t < num_tokens; ++t) {
        fp8::QuantizeRow(hidden.data() + t * hidden_size, hidden_size, codes.data(), scales.data());
        fp8::DequantizeRow(codes.data(), scales.data(), hidden_size, out.data() + t * hidden_size);
      }
      return out;
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dispatch dtype ", DispatchDTypeName(dtype), ": no data plane moves it"));
  }
}

}  // namespace moe_ep::core
