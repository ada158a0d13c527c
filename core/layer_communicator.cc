#include "core/layer_communicator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

constexpr int64_t kFloatBytes = static_cast<int64_t>(sizeof(float));

// All-gather of `local` ([c, H], the same c on every rank) in `group`:
// returns [size * c, H], rank-major.
absl::StatusOr<std::vector<float>> AllGatherRows(ControlCollective& group,
                                                 const std::vector<float>& local) {
  std::vector<float> out(local.size() * group.size());
  RETURN_IF_ERROR(
      group.AllGather(local.data(), static_cast<int64_t>(local.size()) * kFloatBytes, out.data()));
  return out;
}

// Reduce-scatter of `full` ([size * c, H] on every rank) in `group`: returns
// this rank's chunk [c, H] of the element-wise sum. Built from AllToAllV:
// chunk p goes to peer p; the received chunks are summed in ascending source
// rank order.
absl::StatusOr<std::vector<float>> ReduceScatterRows(ControlCollective& group,
                                                     const std::vector<float>& full,
                                                     int64_t hidden) {
  const int n = group.size();
  const int64_t rows = static_cast<int64_t>(full.size()) / hidden;
  if (rows % n != 0) {
    return absl::InternalError(
        absl::StrCat("reduce-scatter of ", rows, " rows over a group of ", n, " is not even"));
  }
  const int64_t chunk = rows / n * hidden;
  std::vector<int64_t> bytes(n, chunk * kFloatBytes);
  std::vector<float> recv(full.size());
  RETURN_IF_ERROR(group.AllToAllV(full.data(), bytes, recv.data(), bytes));
  std::vector<float> out(recv.begin(), recv.begin() + chunk);
  for (int s = 1; s < n; ++s) {
    const float* src = recv.data() + s * chunk;
    for (int64_t i = 0; i < chunk; ++i) out[i] += src[i];
  }
  return out;
}

// Rows [first, first + count) of `t` ([*, H]).
std::vector<float> SliceRows(const std::vector<float>& t, int64_t first, int64_t count,
                             int64_t hidden) {
  return std::vector<float>(t.begin() + first * hidden, t.begin() + (first + count) * hidden);
}

}  // namespace

int64_t ModeRows(const DpGatherLayout& dp, ScatterMode mode) {
  switch (mode) {
    case ScatterMode::kScattered:
      return DpScatteredRowsPerRank(dp);
    case ScatterMode::kTpAttnFull:
      return dp.local_rows;
    case ScatterMode::kFull:
      return dp.global_rows;
  }
  return 0;
}

absl::Status CheckDpLayoutFits(const DpGatherLayout& dp, const ParallelLayout& layout, int rank,
                               int layer) {
  const int attn_tp_size = layout.attn_tp_size();
  const int attn_dp_size = layout.attn_dp_size;
  const int dp_rank = rank / attn_tp_size;
  if (dp.attn_tp_size != attn_tp_size ||
      static_cast<int>(dp.padded_counts.size()) != attn_dp_size ||
      static_cast<int>(dp.offsets.size()) != attn_dp_size || dp.dp_rank != dp_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", layer, ": DP layout (attn_tp_size ", dp.attn_tp_size, ", ",
        dp.padded_counts.size(), " DP groups, dp_rank ", dp.dp_rank, ") does not fit rank ", rank,
        " (attn_tp_size ", attn_tp_size, ", ", attn_dp_size, " DP groups, dp_rank ", dp_rank, ")"));
  }
  return absl::OkStatus();
}

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
  const int64_t rows = ModeRows(dp, plan_.input);
  if (act.residual.has_value()) {
    RETURN_IF_ERROR(input_norm.ApplyWithResidual(absl::MakeSpan(act.hidden),
                                                 absl::MakeSpan(*act.residual), rows));
  } else {
    act.residual = act.hidden;
    RETURN_IF_ERROR(input_norm.Apply(absl::MakeSpan(act.hidden), rows));
  }
  if (plan_.before_attention == BeforeAttentionOp::kAttnTpAllGather) {
    ASSIGN_OR_RETURN(act.hidden, AllGatherRows(groups_->attn_tp(), act.hidden));
  }
  return absl::OkStatus();
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
  std::vector<float>& residual = *act.residual;
  ControlCollective& attn_tp = groups_->attn_tp();
  if (plan_.gather_residual) {
    ASSIGN_OR_RETURN(residual, AllGatherRows(attn_tp, residual));
  }
  auto add_and_norm = [&]() {
    return post_attention_norm.ApplyWithResidual(absl::MakeSpan(act.hidden),
                                                 absl::MakeSpan(residual),
                                                 static_cast<int64_t>(act.hidden.size()) / hidden_);
  };
  switch (plan_.before_mlp) {
    case BeforeMlpOp::kNormOnly:
      RETURN_IF_ERROR(add_and_norm());
      break;
    case BeforeMlpOp::kDpGatherAfterResidual: {
      // The attention output is a partial sum over the attention-TP group; the
      // residual is complete on every rank, so only rank 0 adds it.
      if (plan_.norm_before_gather) {
        // attn_tp_size 1: every rank is attention-TP rank 0.
        RETURN_IF_ERROR(add_and_norm());
      } else if (groups_->attn_tp_rank() == 0) {
        for (size_t i = 0; i < act.hidden.size(); ++i) act.hidden[i] += residual[i];
      }
      std::vector<float> global(dp.global_rows * hidden_, 0.0f);
      std::copy(act.hidden.begin(), act.hidden.end(),
                global.begin() + dp.offsets[dp.dp_rank] * hidden_);
      RETURN_IF_ERROR(
          groups_->world().AllReduceSum(global.data(), static_cast<int64_t>(global.size())));
      if (!plan_.norm_before_gather) {
        residual = SliceRows(global, dp.offsets[dp.dp_rank], dp.local_rows, hidden_);
        RETURN_IF_ERROR(post_attention_norm.Apply(absl::MakeSpan(global), dp.global_rows));
      }
      act.hidden = std::move(global);
      break;
    }
    case BeforeMlpOp::kAllReduceAddNorm:
      // The fallback of the fused kernel: never skip the all-reduce.
      RETURN_IF_ERROR(groups_->world().AllReduceSum(act.hidden.data(),
                                                    static_cast<int64_t>(act.hidden.size())));
      RETURN_IF_ERROR(add_and_norm());
      break;
    case BeforeMlpOp::kReduceScatterNorm: {
      ASSIGN_OR_RETURN(act.hidden, ReduceScatterRows(attn_tp, act.hidden, hidden_));
      if (plan_.split_residual) {
        const int64_t s = DpScatteredRowsPerRank(dp);
        residual = SliceRows(residual, groups_->attn_tp_rank() * s, s, hidden_);
      }
      RETURN_IF_ERROR(add_and_norm());
      break;
    }
    case BeforeMlpOp::kAttnTpAllReduceNorm:
      RETURN_IF_ERROR(
          attn_tp.AllReduceSum(act.hidden.data(), static_cast<int64_t>(act.hidden.size())));
      RETURN_IF_ERROR(add_and_norm());
      break;
  }
  RETURN_IF_ERROR(CheckRows(kStep, "hidden (out)", act.hidden, dp, plan_.mlp));
  return CheckRows(kStep, "residual (out)", residual, dp, plan_.residual);
}

AfterMlpOp LayerCommunicator::ResolveAfterMlp(const DpGatherLayout& dp,
                                              bool allow_reduce_scatter) const {
  return ResolveAfterMlpOp(plan_, dp.mode, allow_reduce_scatter);
}

absl::Status LayerCommunicator::PostMlp(const DpGatherLayout& dp, AfterMlpOp op,
                                        LayerActivations& act) const {
  constexpr const char* kStep = "after_mlp";
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, *groups_, plan_.layer));
  const bool allowed = op == plan_.after_mlp || (op == AfterMlpOp::kReduceScatter &&
                                                 plan_.after_mlp == AfterMlpOp::kDpScatter);
  if (!allowed) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", plan_.layer, ", step after_mlp: op ",
                                                   StepName(op), " is not allowed by the plan's ",
                                                   StepName(plan_.after_mlp)));
  }
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden, dp, plan_.mlp));
  if (act.residual.has_value()) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", *act.residual, dp, plan_.residual));
  }
  const std::string where = absl::StrCat("layer ", plan_.layer, ", step after_mlp (", StepName(op),
                                         "), rank ", groups_->rank(), ": ");
  if (op == AfterMlpOp::kReduceScatter && dp.mode != DpPaddingMode::kMaxLen) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "needs MAX_LEN padding, the step has ", DpPaddingModeName(dp.mode)));
  }
  if (op == AfterMlpOp::kAddResidualAllGather && !act.residual.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(where, "needs a residual, there is none"));
  }
  if (op == AfterMlpOp::kTakeSplit && act.residual.has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "requires no residual (add it into hidden first)"));
  }
  switch (op) {
    case AfterMlpOp::kNone:
      break;
    case AfterMlpOp::kDpScatter:
      act.hidden = SliceRows(act.hidden, dp.offsets[dp.dp_rank], dp.local_rows, hidden_);
      break;
    case AfterMlpOp::kReduceScatter: {
      ASSIGN_OR_RETURN(std::vector<float> chunk,
                       ReduceScatterRows(groups_->world(), act.hidden, hidden_));
      ASSIGN_OR_RETURN(act.hidden, AllGatherRows(groups_->attn_tp(), chunk));
      break;
    }
    case AfterMlpOp::kAddResidualAllGather: {
      const std::vector<float>& residual = *act.residual;
      for (size_t i = 0; i < act.hidden.size(); ++i) act.hidden[i] += residual[i];
      act.residual.reset();
      ASSIGN_OR_RETURN(act.hidden, AllGatherRows(groups_->attn_tp(), act.hidden));
      break;
    }
    case AfterMlpOp::kTakeSplit: {
      const int64_t s = DpScatteredRowsPerRank(dp);
      act.hidden = SliceRows(act.hidden, groups_->attn_tp_rank() * s, s, hidden_);
      break;
    }
  }
  RETURN_IF_ERROR(CheckRows(kStep, "hidden (out)", act.hidden, dp, plan_.output));
  if (act.residual.has_value()) {
    return CheckRows(kStep, "residual (out)", *act.residual, dp, plan_.output);
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
