#include "kernels/staged_step_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/staged_control_collective.h"

namespace moe_ep::kernels {
namespace {

absl::StatusOr<StreamCollective*> StreamOf(core::ControlCollective& group, const char* which) {
  auto* staged = dynamic_cast<StagedControlCollective*>(&group);
  if (staged == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the device step executor needs NCCL groups: the ", which, " group's backend is \"",
        group.backend(), "\" (the host executor runs Gloo groups)"));
  }
  return &staged->stream_collective();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StagedStepExecutor>> StagedStepExecutor::Create(
    const core::ParallelGroups& groups, int64_t hidden, const DeviceStepOptions& options) {
  ASSIGN_OR_RETURN(StreamCollective * world, StreamOf(groups.world(), "world"));
  ASSIGN_OR_RETURN(StreamCollective * attn_tp, StreamOf(groups.attn_tp(), "attention-TP"));
  std::unique_ptr<StagedStepExecutor> e(new StagedStepExecutor());
  ASSIGN_OR_RETURN(e->executor_, DeviceStepExecutor::Create(world, attn_tp, hidden, options));
  e->rank_ = groups.rank();
  e->hidden_ = hidden;
  return e;
}

absl::StatusOr<const DeviceRmsNorm*> StagedStepExecutor::DeviceNorm(const core::RmsNorm& norm) {
  CachedNorm& cached = norms_[&norm];
  if (cached.device == nullptr || cached.eps != norm.eps() || cached.weight != norm.weight()) {
    ASSIGN_OR_RETURN(cached.device, DeviceRmsNorm::Upload(norm, executor_->device()));
    cached.weight = norm.weight();
    cached.eps = norm.eps();
  }
  return cached.device.get();
}

absl::Status StagedStepExecutor::Run(const core::StepProgram& program, const core::RmsNorm* norm,
                                     core::LayerActivations& act) {
  const int64_t h = hidden_;
  const int64_t hidden_floats = static_cast<int64_t>(act.hidden.size());
  const int64_t residual_floats =
      act.residual.has_value() ? static_cast<int64_t>(act.residual->size()) : 0;
  if (hidden_floats % h != 0 || residual_floats % h != 0) {
    return absl::InvalidArgumentError(absl::StrCat(program.label, ", rank ", rank_, ": tensors of ",
                                                   hidden_floats, " and ", residual_floats,
                                                   " floats are not rows of H ", h));
  }
  RETURN_IF_ERROR(core::CheckStepInputs(program, h, norm != nullptr ? norm->hidden() : -1,
                                        hidden_floats / h, act.residual.has_value(),
                                        residual_floats / h, rank_));
  const DeviceRmsNorm* device_norm = nullptr;
  if (norm != nullptr && program.UsesNorm()) {
    ASSIGN_OR_RETURN(device_norm, DeviceNorm(*norm));
  }
  const int64_t rows = program.MaxRows();
  if (act_ == nullptr || act_->capacity_rows() < rows) {
    act_.reset();  // free the old buffers first
    ASSIGN_OR_RETURN(act_, GpuLayerActivations::Create(executor_->device(), rows, h));
  }
  RETURN_IF_ERROR(act_->Upload(act));
  RETURN_IF_ERROR(executor_->Run(program, device_norm, *act_));
  RETURN_IF_ERROR(executor_->Synchronize());
  ASSIGN_OR_RETURN(act, act_->Download());
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels
