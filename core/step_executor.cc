#include "core/step_executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

constexpr int64_t kFloatBytes = static_cast<int64_t>(sizeof(float));

// All-gather of `local` ([c, H], the same c on every rank) in `group`:
// [size * c, H], rank-major.
absl::StatusOr<std::vector<float>> AllGatherRows(ControlCollective& group,
                                                 const std::vector<float>& local) {
  std::vector<float> out(local.size() * group.size());
  RETURN_IF_ERROR(
      group.AllGather(local.data(), static_cast<int64_t>(local.size()) * kFloatBytes, out.data()));
  return out;
}

// Reduce-scatter of `full` ([size * c, H]) in `group`: this rank's chunk
// [c, H] of the sum; chunk p goes to peer p through AllToAllV and the
// received chunks are summed in ascending source-rank order.
absl::StatusOr<std::vector<float>> ReduceScatterRows(ControlCollective& group,
                                                     const std::vector<float>& full) {
  const int n = group.size();
  const int64_t chunk = static_cast<int64_t>(full.size()) / n;
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

}  // namespace

absl::Status CheckStepInputs(const StepProgram& program, int64_t hidden, int64_t norm_hidden,
                             int64_t hidden_rows, bool has_residual, int64_t residual_rows,
                             int rank) {
  auto mismatch = [&](const char* tensor, int64_t expected, const std::string& got) {
    return absl::InvalidArgumentError(absl::StrCat(program.label, ", rank ", rank, ": ", tensor,
                                                   " must have ", expected, " rows * H ", hidden,
                                                   ", got ", got));
  };
  if (hidden_rows != program.hidden_rows_in) {
    return mismatch("hidden", program.hidden_rows_in, absl::StrCat(hidden_rows, " rows"));
  }
  if (program.residual_rows_in >= 0 &&
      (!has_residual || residual_rows != program.residual_rows_in)) {
    return mismatch("residual", program.residual_rows_in,
                    has_residual ? absl::StrCat(residual_rows, " rows") : std::string("none"));
  }
  if (program.residual_rows_in < 0 && has_residual) {
    return absl::InvalidArgumentError(absl::StrCat(program.label, ", rank ", rank,
                                                   ": the step takes no residual, got ",
                                                   residual_rows, " rows"));
  }
  if (program.UsesNorm() && norm_hidden != hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        program.label, ", rank ", rank, ": the step needs an RMSNorm of width H ", hidden, ", got ",
        norm_hidden < 0 ? std::string("none") : absl::StrCat("width ", norm_hidden)));
  }
  return absl::OkStatus();
}

ControlCollective& HostStepExecutor::Group(StepGroup group) const {
  return group == StepGroup::kWorld ? groups_->world() : groups_->attn_tp();
}

absl::Status HostStepExecutor::Run(const StepProgram& program, const RmsNorm* norm,
                                   LayerActivations& act) {
  const int64_t h = hidden_;
  const int64_t hidden_floats = static_cast<int64_t>(act.hidden.size());
  const int64_t residual_floats =
      act.residual.has_value() ? static_cast<int64_t>(act.residual->size()) : 0;
  if (hidden_floats % h != 0 || residual_floats % h != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(program.label, ", rank ", groups_->rank(), ": tensors of ", hidden_floats,
                     " and ", residual_floats, " floats are not rows of H ", h));
  }
  RETURN_IF_ERROR(CheckStepInputs(program, h, norm != nullptr ? norm->hidden() : -1,
                                  hidden_floats / h, act.residual.has_value(), residual_floats / h,
                                  groups_->rank()));
  auto tensor = [&](StepTensor t) -> std::vector<float>& {
    if (t == StepTensor::kHidden) return act.hidden;
    if (!act.residual.has_value()) act.residual.emplace();
    return *act.residual;
  };
  for (const StepPrimitive& p : program.primitives) {
    switch (p.op) {
      case StepOp::kAllGather: {
        std::vector<float>& t = tensor(p.tensor);
        ASSIGN_OR_RETURN(t, AllGatherRows(Group(p.group), t));
        break;
      }
      case StepOp::kReduceScatter: {
        std::vector<float>& t = tensor(p.tensor);
        ASSIGN_OR_RETURN(t, ReduceScatterRows(Group(p.group), t));
        break;
      }
      case StepOp::kAllReduce: {
        std::vector<float>& t = tensor(p.tensor);
        RETURN_IF_ERROR(Group(p.group).AllReduceSum(t.data(), static_cast<int64_t>(t.size())));
        break;
      }
      case StepOp::kAddResidual: {
        const std::vector<float>& r = *act.residual;
        for (size_t i = 0; i < act.hidden.size(); ++i) act.hidden[i] += r[i];
        if (p.drop_residual) act.residual.reset();
        break;
      }
      case StepOp::kSlice: {
        const std::vector<float>& src = tensor(p.source);
        std::vector<float> part(src.begin() + p.first * h,
                                src.begin() + (p.first + p.rows_out) * h);
        tensor(p.tensor) = std::move(part);
        break;
      }
      case StepOp::kPlace: {
        std::vector<float> global(p.rows_out * h, 0.0f);
        std::copy(act.hidden.begin(), act.hidden.end(), global.begin() + p.first * h);
        act.hidden = std::move(global);
        break;
      }
      case StepOp::kAddAndNorm:
        RETURN_IF_ERROR(norm->ApplyWithResidual(absl::MakeSpan(act.hidden),
                                                absl::MakeSpan(*act.residual), p.rows_in));
        break;
      case StepOp::kStoreAndNorm:
        act.residual = act.hidden;
        RETURN_IF_ERROR(norm->Apply(absl::MakeSpan(act.hidden), p.rows_in));
        break;
      case StepOp::kNorm:
        RETURN_IF_ERROR(norm->Apply(absl::MakeSpan(act.hidden), p.rows_in));
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
