#pragma once

// RMSNorm over the hidden dimension, with the optional fused residual add of
// a decoder layer's input and post-attention norms (DESIGN §3):
//   x = x / sqrt(mean(x^2) + eps) * weight                (no residual)
//   residual += x; x = residual / sqrt(mean(residual^2) + eps) * weight
// All math in fp32 (sum of squares accumulated in fp32, ascending column
// order), one row at a time, so results do not depend on how rows are split
// across ranks. Zero rows are a no-op (a rank with zero tokens skips the norm).

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

class RmsNorm {
 public:
  // `weight` [H] (H >= 1), `eps` > 0 and finite.
  // Errors: kInvalidArgument naming the field (empty weight, bad eps).
  static absl::StatusOr<RmsNorm> Create(std::vector<float> weight, float eps);

  int64_t hidden() const { return static_cast<int64_t>(weight_.size()); }
  float eps() const { return eps_; }
  const std::vector<float>& weight() const { return weight_; }

  // In place on x [rows, H] fp32. rows may be 0.
  // Errors: kInvalidArgument when rows < 0 or x.size() != rows * H.
  absl::Status Apply(absl::Span<float> x, int64_t rows) const;

  // Fused add: residual += x, then x = norm(residual) (the new residual is the
  // pre-norm sum). x and residual [rows, H] fp32. rows may be 0.
  // Errors: kInvalidArgument when rows < 0 or a span's size != rows * H.
  absl::Status ApplyWithResidual(absl::Span<float> x, absl::Span<float> residual,
                                 int64_t rows) const;

 private:
  RmsNorm(std::vector<float> weight, float eps) : weight_(std::move(weight)), eps_(eps) {}
  void NormRow(const float* in, float* out) const;

  std::vector<float> weight_;
  float eps_;
};

}  // namespace moe_ep::core
