#include "core/rms_norm.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe_ep::core {

absl::StatusOr<RmsNorm> RmsNorm::Create(std::vector<float> weight, float eps) {
  if (weight.empty()) return absl::InvalidArgumentError("weight: expected [H] with H >= 1, got 0");
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(absl::StrCat("eps: expected finite and > 0, got ", eps));
  }
  return RmsNorm(std::move(weight), eps);
}

void RmsNorm::NormRow(const float* in, float* out) const {
  const int64_t h = hidden();
  float sum_sq = 0.0f;
  for (int64_t c = 0; c < h; ++c) sum_sq += in[c] * in[c];
  const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(h) + eps_);
  for (int64_t c = 0; c < h; ++c) out[c] = in[c] * inv * weight_[c];
}

absl::Status RmsNorm::Apply(absl::Span<float> x, int64_t rows) const {
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows: expected >= 0, got ", rows));
  if (static_cast<int64_t>(x.size()) != rows * hidden()) {
    return absl::InvalidArgumentError(absl::StrCat("x: expected rows * H = ", rows, " * ", hidden(),
                                                   " elements, got ", x.size()));
  }
  for (int64_t r = 0; r < rows; ++r) NormRow(x.data() + r * hidden(), x.data() + r * hidden());
  return absl::OkStatus();
}

absl::Status RmsNorm::ApplyWithResidual(absl::Span<float> x, absl::Span<float> residual,
                                        int64_t rows) const {
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows: expected >= 0, got ", rows));
  const int64_t n = rows * hidden();
  if (static_cast<int64_t>(x.size()) != n || static_cast<int64_t>(residual.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("x/residual: expected rows * H = ", rows, " * ",
                                                   hidden(), " elements each, got ", x.size(),
                                                   " and ", residual.size()));
  }
  for (int64_t i = 0; i < n; ++i) residual[i] += x[i];
  for (int64_t r = 0; r < rows; ++r) {
    NormRow(residual.data() + r * hidden(), x.data() + r * hidden());
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
