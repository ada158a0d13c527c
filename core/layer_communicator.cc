#include "core/layer_communicator.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::core {

absl::StatusOr<LayerCommunicator> LayerCommunicator::Create(const ParallelGroups* groups,
                                                            const LayerPlan& plan, int64_t hidden) {
  if (groups == nullptr) return absl::InvalidArgumentError("groups is null");
  if (hidden < 1)
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected >= 1, got ", hidden));
  return LayerCommunicator(groups, plan, hidden);
}

absl::Status LayerCommunicator::CheckRows(const char* step, const char* tensor,
                                          const std::vector<float>& t, const DpGatherLayout& dp,
                                          ScatterMode mode) const {
  const int64_t expected = ModeRows(dp, mode) * hidden_;
  if (static_cast<int64_t>(t.size()) != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(), ": ",
                     tensor, " in ", ScatterModeName(mode), " must have ", ModeRows(dp, mode),
                     " rows * H ", hidden_, " = ", expected, " elements, got ", t.size()));
  }
  return absl::OkStatus();
}

absl::Status LayerCommunicator::PrepareAttention(const DpGatherLayout& dp,
                                                 const RmsNorm& input_norm,
                                                 LayerActivations& act) const {
  constexpr const char* kStep = "before_attention";
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden, dp, plan_.input));
  if (act.residual.has_value()) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", *act.residual, dp, plan_.input));
  }
  if (input_norm.hidden() != hidden_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", plan_.layer, ": input norm hidden ",
                                                   input_norm.hidden(), " != ", hidden_));
  }
  ASSIGN_OR_RETURN(const StepProgram program,
                   BuildBeforeAttentionProgram(plan_, groups_->layout(), groups_->rank(), dp,
                                               act.residual.has_value()));
  return HostStepExecutor(groups_, hidden_).Run(program, &input_norm, act);
}

absl::Status LayerCommunicator::PrepareMlp(const DpGatherLayout& dp,
                                           const RmsNorm& post_attention_norm,
                                           LayerActivations& act) const {
  constexpr const char* kStep = "before_mlp";
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden, dp, plan_.attention));
  if (!act.residual.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", plan_.layer, ", step before_mlp, rank ", groups_->rank(),
                     ": no residual (the input norm of step before_attention creates it)"));
  }
  RETURN_IF_ERROR(CheckRows(kStep, "residual", *act.residual, dp, plan_.input));
  if (post_attention_norm.hidden() != hidden_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", plan_.layer,
                                                   ": post-attention norm hidden ",
                                                   post_attention_norm.hidden(), " != ", hidden_));
  }
  ASSIGN_OR_RETURN(const StepProgram program,
                   BuildBeforeMlpProgram(plan_, groups_->layout(), groups_->rank(), dp));
  return HostStepExecutor(groups_, hidden_).Run(program, &post_attention_norm, act);
}

AfterMlpOp LayerCommunicator::ResolveAfterMlp(const DpGatherLayout& dp,
                                              bool allow_reduce_scatter) const {
  return ResolveAfterMlpOp(plan_, dp.mode, allow_reduce_scatter);
}

absl::Status LayerCommunicator::PostMlp(const DpGatherLayout& dp, AfterMlpOp op,
                                        LayerActivations& act) const {
  constexpr const char* kStep = "after_mlp";
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckAfterMlpOpAllowed(plan_, op));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden, dp, plan_.mlp));
  if (act.residual.has_value()) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", *act.residual, dp, plan_.residual));
  }
  ASSIGN_OR_RETURN(const StepProgram program,
                   BuildAfterMlpProgram(plan_, groups_->layout(), groups_->rank(), dp, op,
                                        act.residual.has_value()));
  return HostStepExecutor(groups_, hidden_).Run(program, nullptr, act);
}

}  // namespace moe_ep::core
