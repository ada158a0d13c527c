#include "client/tolerance.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe_ep::client {

absl::StatusOr<Comparison> CompareToReference(absl::Span<const core::bf16_t> got,
                                              absl::Span<const float> ref,
                                              const Tolerance& tolerance) {
  if (got.size() != ref.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("output has ", got.size(), " elements, reference has ", ref.size()));
  }
  Comparison c;
  c.num_elements = static_cast<int64_t>(got.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = core::Bf16ToFloat(got[i]);
    const double r = ref[i];
    c.max_abs_ref = std::max(c.max_abs_ref, std::fabs(r));
    const double err =
        std::isfinite(g) ? std::fabs(g - r) : std::numeric_limits<double>::infinity();
    if (c.worst_index < 0 || err > c.max_abs_err) {
      c.max_abs_err = err;
      c.worst_index = static_cast<int64_t>(i);
    }
  }
  c.bound = tolerance.rel * c.max_abs_ref + tolerance.atol;
  c.pass = c.max_abs_err <= c.bound;
  return c;
}

void MergeComparison(const Comparison& next, const Tolerance& tolerance, Comparison* acc) {
  if (next.num_elements > 0 && (acc->worst_index < 0 || next.max_abs_err > acc->max_abs_err)) {
    acc->max_abs_err = next.max_abs_err;
    acc->worst_index = next.worst_index;
  }
  acc->max_abs_ref = std::max(acc->max_abs_ref, next.max_abs_ref);
  acc->num_elements += next.num_elements;
  acc->bound = tolerance.rel * acc->max_abs_ref + tolerance.atol;
  acc->pass = acc->pass && next.pass && acc->max_abs_err <= acc->bound;
}

}  // namespace moe_ep::client
