#pragma once

// What a dispatch dtype does to the hidden rows it carries, on the host: the
// rows the expert compute of any data plane reads (DESIGN §13 "Low
// precision"; issue 15 item 4). The CPU reference (core/moe_reference.h) and
// `moe-ep run` apply it to their input so that a data plane's output is
// checked against the same rounding; the data planes apply the same
// functions (core/fp8_e4m3.h) in their pack and dequantizing passes.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/workspace.h"

namespace moe_ep::core {

// DispatchedHidden()
//
// hidden [T, H] bf16 as the experts receive it under `dtype`: bf16 -> the
// rows unchanged; fp8_e4m3 -> core::fp8::QuantizeRow then DequantizeRow of
// each row. Errors: kInvalidArgument when hidden.size() != T * H, T < 0,
// H < 1, H not a multiple of 128 for fp8_e4m3, or a dtype no data plane
// moves (nvfp4, mxfp8). Pure and thread-safe.
absl::StatusOr<std::vector<bf16_t>> DispatchedHidden(DispatchDType dtype,
                                                     absl::Span<const bf16_t> hidden,
                                                     int64_t num_tokens, int64_t hidden_size);

// The relative part of the error fp8_e4m3 dispatch adds to one value x,
// before the bf16 rounding of the dispatched row: half an e4m3 ulp, 2^-4 of
// |x| (3 mantissa bits); the absolute part is 2^-10 * its block's scale
// (the subnormal range), so |dispatched - x| <= 2^-4 |x| + 2^-10 * scale
// (core/fp8_e4m3.h). Tests that compare fp8 results with the unrounded
// input derive their tolerance from it.
inline constexpr double kFp8E4m3RelativeError = 1.0 / 16.0;

}  // namespace moe_ep::core
