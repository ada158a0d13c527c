#pragma once

// The acceptance test of `moe-ep run`: a layer's distributed output (bf16)
// against the single-process reference (fp32).
//
// The tolerance: element i passes when
//     |got_i - ref_i| <= rel * max_j |ref_j| + atol
// with rel = 2^-6 and atol = 1e-6 by default. Why: the worker computes the
// same fp32 expert math as the reference; what differs is rounding. Each
// destination rank d returns its partial sum p_d (the row's local experts) as
// bf16 (the combine payload, DESIGN §5/§7), the source adds the partials in
// fp32 and casts the result to bf16. Each cast errs by at most half a bf16 ulp,
// 2^-9 of the value (8 significand bits), so
//     |got_i - ref_i| <= 2^-9 * (sum_d |p_d,i| + |ref_i|) + fp32 noise,
// and the partials can exceed the sum when they cancel. 2^-6 * max|ref|
// leaves room for partials up to ~7x max|ref| (measured on the default run:
// errors about 2^-8 * max|ref|), while a misrouted token, a wrong slot, a
// missing or duplicated expert term or a wrong weight gives an error of the
// order of that term (w_k * |expert_k(x)|, w_k ~ 1/K and more under skew).
// A NaN or Inf in `got` always fails.
// Source: DESIGN §7 ("equals the dense reference up to bf16 rounding").

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"

namespace moe_ep::client {

struct Tolerance {
  double rel = 1.0 / 64.0;  // 2^-6, relative to max |ref|
  double atol = 1e-6;       // absolute slack for an all-zero reference
};

struct Comparison {
  double max_abs_err = 0.0;  // max_i |got_i - ref_i| (Inf if got has a non-finite value)
  double max_abs_ref = 0.0;  // max_i |ref_i|
  double bound = 0.0;        // rel * max_abs_ref + atol
  int64_t worst_index = -1;  // argmax of the error; -1 when empty
  int64_t num_elements = 0;
  bool pass = true;  // max_abs_err <= bound
};

// Compares `got` (bf16 bit patterns) with `ref` element by element.
// Errors: kInvalidArgument when the sizes differ (both sizes in the message).
absl::StatusOr<Comparison> CompareToReference(absl::Span<const core::bf16_t> got,
                                              absl::Span<const float> ref,
                                              const Tolerance& tolerance = {});

// Folds `next` into `acc` (max of errors and references; the bound is
// recomputed from the combined max |ref|; pass when every part passed against
// the combined bound).
void MergeComparison(const Comparison& next, const Tolerance& tolerance, Comparison* acc);

}  // namespace moe_ep::client
