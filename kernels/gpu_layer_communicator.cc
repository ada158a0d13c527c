#include "kernels/gpu_layer_communicator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/step_program.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

using core::AfterMlpOp;
using core::DpGatherLayout;
using core::ModeRows;
using core::ScatterMode;

}  // namespace

absl::StatusOr<std::unique_ptr<GpuLayerCommunicator>> GpuLayerCommunicator::Create(
    const GpuParallelGroups* groups, const core::LayerPlan& plan, int64_t hidden,
    const GpuLayerCommunicatorOptions& options) {
  if (groups == nullptr) return absl::InvalidArgumentError("groups is null");
  std::unique_ptr<GpuLayerCommunicator> c(new GpuLayerCommunicator());
  ASSIGN_OR_RETURN(c->executor_, DeviceStepExecutor::Create(&groups->world(), &groups->attn_tp(),
                                                            hidden, options));
  c->groups_ = groups;
  c->plan_ = plan;
  c->hidden_ = hidden;
  return c;
}

AllReduceNormImpl GpuLayerCommunicator::AllReduceNormFor(int64_t rows) const {
  return executor_->AllReduceNormFor(rows);
}

absl::Status GpuLayerCommunicator::Synchronize() const { return executor_->Synchronize(); }

absl::Status GpuLayerCommunicator::CheckRows(const char* step, const char* tensor, int64_t rows,
                                             const DpGatherLayout& dp, ScatterMode mode) const {
  if (rows != ModeRows(dp, mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(), ": ", tensor, " in ",
        core::ScatterModeName(mode), " must have ", ModeRows(dp, mode), " rows, got ", rows));
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::CheckActivations(const char* step, const DpGatherLayout& dp,
                                                    const GpuLayerActivations& act) const {
  if (act.device() != executor_->device() || act.hidden_size() != hidden_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(),
                     ": activations on device ", act.device(), " with H ", act.hidden_size(),
                     ", expected device ", executor_->device(), " with H ", hidden_));
  }
  int64_t needed = 0;
  for (ScatterMode m : {plan_.input, plan_.attention, plan_.residual, plan_.mlp, plan_.output}) {
    needed = std::max(needed, ModeRows(dp, m));
  }
  if (act.capacity_rows() < needed) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(), ": activations hold ",
        act.capacity_rows(), " rows, the plan needs ", needed, " for this step's DP layout"));
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::CheckNorm(const char* which, const DeviceRmsNorm& norm) const {
  if (norm.hidden() != hidden_ || norm.device() != executor_->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", plan_.layer, ": ", which, " norm has hidden ", norm.hidden(), " on device ",
        norm.device(), ", expected ", hidden_, " on device ", executor_->device()));
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::PrepareAttention(const DpGatherLayout& dp,
                                                    const DeviceRmsNorm& input_norm,
                                                    GpuLayerActivations& act) const {
  constexpr const char* kStep = "before_attention";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows(), dp, plan_.input));
  if (act.has_residual()) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows(), dp, plan_.input));
  }
  RETURN_IF_ERROR(CheckNorm("input", input_norm));
  ASSIGN_OR_RETURN(const core::StepProgram program,
                   core::BuildBeforeAttentionProgram(plan_, groups_->layout(), groups_->rank(), dp,
                                                     act.has_residual()));
  return executor_->Run(program, &input_norm, act);
}

absl::Status GpuLayerCommunicator::PrepareMlp(const DpGatherLayout& dp,
                                              const DeviceRmsNorm& post_attention_norm,
                                              GpuLayerActivations& act) const {
  constexpr const char* kStep = "before_mlp";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows(), dp, plan_.attention));
  if (!act.has_residual()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", plan_.layer, ", step before_mlp, rank ", groups_->rank(),
                     ": no residual (the input norm of step before_attention creates it)"));
  }
  RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows(), dp, plan_.input));
  RETURN_IF_ERROR(CheckNorm("post-attention", post_attention_norm));
  ASSIGN_OR_RETURN(const core::StepProgram program,
                   core::BuildBeforeMlpProgram(plan_, groups_->layout(), groups_->rank(), dp));
  return executor_->Run(program, &post_attention_norm, act);
}

AfterMlpOp GpuLayerCommunicator::ResolveAfterMlp(const DpGatherLayout& dp,
                                                 bool allow_reduce_scatter) const {
  return core::ResolveAfterMlpOp(plan_, dp.mode, allow_reduce_scatter);
}

absl::Status GpuLayerCommunicator::PostMlp(const DpGatherLayout& dp, AfterMlpOp op,
                                           GpuLayerActivations& act) const {
  constexpr const char* kStep = "after_mlp";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(core::CheckAfterMlpOpAllowed(plan_, op));
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows(), dp, plan_.mlp));
  if (act.has_residual()) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows(), dp, plan_.residual));
  }
  ASSIGN_OR_RETURN(const core::StepProgram program,
                   core::BuildAfterMlpProgram(plan_, groups_->layout(), groups_->rank(), dp, op,
                                              act.has_residual()));
  return executor_->Run(program, nullptr, act);
}

}  // namespace moe_ep::kernels
