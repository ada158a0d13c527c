#include "server/shared_expert_request.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::server {
namespace {

// Bound on I: a shared SwiGLU of more than 2^24 columns is not a model.
constexpr int64_t kMaxSharedIntermediate = int64_t{1} << 24;

}  // namespace

absl::StatusOr<std::optional<core::SharedExpert>> MakeSharedExpert(
    const v1::LoadExpertsRequest& request, const std::string& checkpoint_path, int64_t hidden,
    int64_t held_bytes, int64_t memory_cap_bytes) {
  if (!request.has_shared_expert()) return std::optional<core::SharedExpert>();
  const v1::SharedExpert& spec = request.shared_expert();
  // Every SwiGLU kind's shared expert is a bf16 SwiGLU (fp8 / mxfp4 apply to
  // the routed experts; issue 35).
  const bool swiglu = request.kind() != v1::EXPERT_KIND_IDENTITY;
  const int64_t inter = spec.intermediate_size();
  if (swiglu && (inter < 1 || inter > kMaxSharedIntermediate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared_expert.intermediate_size: expected in [1, ", kMaxSharedIntermediate,
                     "] for EXPERT_KIND_SWIGLU, got ", inter));
  }
  const bool from_checkpoint = !request.safetensors_path().empty();
  if (from_checkpoint && spec.name_pattern().empty()) {
    return absl::InvalidArgumentError(
        "shared_expert.name_pattern: required with safetensors_path, e.g. "
        "\"model.layers.{layer}.mlp.shared_experts.{proj}.weight\"");
  }
  if (from_checkpoint && spec.sigmoid_gate() && spec.gate_name().empty()) {
    return absl::InvalidArgumentError(
        "shared_expert.gate_name: required with safetensors_path and sigmoid_gate, e.g. "
        "\"model.layers.{layer}.mlp.shared_expert_gate.weight\"");
  }
  const int64_t bytes =
      (swiglu ? 3 * inter * hidden * 2 : 0) + (spec.sigmoid_gate() ? hidden * 2 : 0);
  if (memory_cap_bytes > 0 && held_bytes + bytes > memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoadExperts: layer ", request.layer(), "'s shared expert needs ", bytes,
        " bytes; with the ", held_bytes, " bytes held that is ", held_bytes + bytes,
        ", more than the memory cap of ", memory_cap_bytes, " bytes (--memory-cap-bytes)"));
  }
  absl::StatusOr<core::SharedExpert> shared;
  if (!swiglu) {
    shared =
        core::SharedExpert::Identity(request.seed(), request.layer(), hidden, spec.sigmoid_gate());
  } else if (from_checkpoint) {
    shared = core::SharedExpert::LoadSafetensors(
        checkpoint_path, spec.name_pattern(),
        spec.sigmoid_gate() ? spec.gate_name() : std::string(), request.layer(), hidden, inter);
  } else {
    shared = core::SharedExpert::Generate(request.seed(), request.layer(), hidden, inter,
                                          spec.sigmoid_gate());
  }
  if (!shared.ok()) return shared.status();
  return std::optional<core::SharedExpert>(std::move(*shared));
}

}  // namespace moe_ep::server
