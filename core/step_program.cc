#include "core/step_program.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

constexpr StepTensor kHid = StepTensor::kHidden;
constexpr StepTensor kRes = StepTensor::kResidual;

const char* TensorName(StepTensor t) { return t == kHid ? "hidden" : "residual"; }
const char* GroupName(StepGroup g) { return g == StepGroup::kWorld ? "world" : "attn_tp"; }

int GroupSize(const ParallelLayout& layout, StepGroup g) {
  return g == StepGroup::kWorld ? layout.tp_size : layout.attn_tp_size();
}

// Appends primitives while tracking the rows of both tensors, so every
// primitive's rows_in is what the tensor holds at that point.
class ProgramBuilder {
 public:
  ProgramBuilder(const ParallelLayout& layout, std::string label, int64_t hidden_rows,
                 int64_t residual_rows)
      : layout_(layout) {
    program_.label = std::move(label);
    program_.hidden_rows_in = hidden_rows;
    program_.residual_rows_in = residual_rows;
    rows_[0] = hidden_rows;
    rows_[1] = residual_rows;
  }

  int64_t rows(StepTensor t) const { return rows_[Index(t)]; }

  void AllGather(StepTensor t, StepGroup g) {
    Add(StepOp::kAllGather, t, t, g, rows(t) * GroupSize(layout_, g));
  }
  void ReduceScatter(StepTensor t, StepGroup g) {
    Add(StepOp::kReduceScatter, t, t, g, rows(t) / GroupSize(layout_, g));
  }
  void AllReduce(StepTensor t, StepGroup g) { Add(StepOp::kAllReduce, t, t, g, rows(t)); }
  void AddResidual(bool drop) {
    Add(StepOp::kAddResidual, kHid, kHid, StepGroup::kAttnTp, rows(kHid));
    program_.primitives.back().drop_residual = drop;
    if (drop) rows_[1] = -1;
  }
  void Slice(StepTensor t, StepTensor source, int64_t first, int64_t count) {
    StepPrimitive p = Make(StepOp::kSlice, t, source, StepGroup::kAttnTp, count);
    p.first = first;
    Push(p);
  }
  void Place(int64_t first, int64_t total) {
    StepPrimitive p = Make(StepOp::kPlace, kHid, kHid, StepGroup::kAttnTp, total);
    p.first = first;
    Push(p);
  }
  void AddAndNorm() { Add(StepOp::kAddAndNorm, kHid, kHid, StepGroup::kAttnTp, rows(kHid)); }
  void StoreAndNorm() {
    Add(StepOp::kStoreAndNorm, kHid, kHid, StepGroup::kAttnTp, rows(kHid));
    rows_[1] = rows_[0];
  }
  void Norm() { Add(StepOp::kNorm, kHid, kHid, StepGroup::kAttnTp, rows(kHid)); }

  // Sets the expected outputs and validates the whole list.
  absl::StatusOr<StepProgram> Finish(int64_t hidden_rows_out, int64_t residual_rows_out) {
    program_.hidden_rows_out = hidden_rows_out;
    program_.residual_rows_out = residual_rows_out;
    RETURN_IF_ERROR(ValidateStepProgram(program_, layout_));
    return std::move(program_);
  }

 private:
  static int Index(StepTensor t) { return t == kHid ? 0 : 1; }
  StepPrimitive Make(StepOp op, StepTensor t, StepTensor source, StepGroup g, int64_t out) const {
    StepPrimitive p;
    p.op = op;
    p.tensor = t;
    p.source = source;
    p.group = g;
    p.rows_in = rows(source);
    p.rows_out = out;
    return p;
  }
  void Add(StepOp op, StepTensor t, StepTensor source, StepGroup g, int64_t out) {
    Push(Make(op, t, source, g, out));
  }
  void Push(const StepPrimitive& p) {
    program_.primitives.push_back(p);
    rows_[Index(p.tensor)] = p.rows_out;
  }

  const ParallelLayout& layout_;
  StepProgram program_;
  int64_t rows_[2] = {0, -1};
};

std::string Label(const LayerPlan& plan, const char* step, const std::string& op) {
  return absl::StrCat("layer ", plan.layer, " ", step, " (", op, ")");
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
  const int dp_rank = attn_tp_size > 0 ? rank / attn_tp_size : 0;
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

bool StepProgram::UsesNorm() const {
  return std::any_of(primitives.begin(), primitives.end(), [](const StepPrimitive& p) {
    return p.op == StepOp::kAddAndNorm || p.op == StepOp::kStoreAndNorm || p.op == StepOp::kNorm;
  });
}

int64_t StepProgram::MaxRows() const {
  int64_t m =
      std::max<int64_t>({hidden_rows_in, residual_rows_in, hidden_rows_out, residual_rows_out, 0});
  for (const StepPrimitive& p : primitives) m = std::max({m, p.rows_in, p.rows_out});
  return m;
}

std::string DescribeStepPrimitive(const StepPrimitive& p) {
  const char* t = TensorName(p.tensor);
  switch (p.op) {
    case StepOp::kAllGather:
      return absl::StrCat("all_gather(", t, ", ", GroupName(p.group), ", ", p.rows_in, " -> ",
                          p.rows_out, ")");
    case StepOp::kReduceScatter:
      return absl::StrCat("reduce_scatter(", t, ", ", GroupName(p.group), ", ", p.rows_in, " -> ",
                          p.rows_out, ")");
    case StepOp::kAllReduce:
      return absl::StrCat("all_reduce(", t, ", ", GroupName(p.group), ", ", p.rows_in, ")");
    case StepOp::kAddResidual:
      return absl::StrCat(p.drop_residual ? "add_residual_drop(" : "add_residual(", p.rows_in, ")");
    case StepOp::kSlice:
      return absl::StrCat("slice(", t, " := ", TensorName(p.source), "[", p.first, ", ",
                          p.first + p.rows_out, "))");
    case StepOp::kPlace:
      return absl::StrCat("place(", t, ", ", p.rows_in, " -> ", p.rows_out, " at ", p.first, ")");
    case StepOp::kAddAndNorm:
      return absl::StrCat("add_and_norm(", p.rows_in, ")");
    case StepOp::kStoreAndNorm:
      return absl::StrCat("store_and_norm(", p.rows_in, ")");
    case StepOp::kNorm:
      return absl::StrCat("norm(", p.rows_in, ")");
  }
  return "unknown";
}

std::string DescribeStepProgram(const StepProgram& program) {
  std::vector<std::string> parts;
  parts.reserve(program.primitives.size());
  for (const StepPrimitive& p : program.primitives) parts.push_back(DescribeStepPrimitive(p));
  return absl::StrJoin(parts, "; ");
}

absl::Status ValidateStepProgram(const StepProgram& program, const ParallelLayout& layout) {
  int64_t rows[2] = {program.hidden_rows_in,
                     program.residual_rows_in < 0 ? -1 : program.residual_rows_in};
  auto at = [&](size_t i, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(program.label, ": primitive ", i, " ",
                                                   DescribeStepPrimitive(program.primitives[i]),
                                                   ": ", what));
  };
  if (program.hidden_rows_in < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(program.label, ": hidden_rows_in must be >= 0, got ", program.hidden_rows_in));
  }
  for (size_t i = 0; i < program.primitives.size(); ++i) {
    const StepPrimitive& p = program.primitives[i];
    const int read = p.source == kHid ? 0 : 1;
    const int write = p.tensor == kHid ? 0 : 1;
    if (p.op != StepOp::kSlice && p.source != p.tensor) {
      return at(i, "only a slice reads another tensor than it writes");
    }
    if (rows[read] < 0)
      return at(i, absl::StrCat("reads the ", TensorName(p.source), ", there is none"));
    if (p.rows_in != rows[read]) {
      return at(i, absl::StrCat("rows_in must be the ", rows[read], " rows ", TensorName(p.source),
                                " holds, got ", p.rows_in));
    }
    if (p.rows_out < 0) return at(i, absl::StrCat("rows_out must be >= 0, got ", p.rows_out));
    const int size = GroupSize(layout, p.group);
    const bool hidden_only = p.op == StepOp::kAddResidual || p.op == StepOp::kPlace ||
                             p.op == StepOp::kAddAndNorm || p.op == StepOp::kStoreAndNorm ||
                             p.op == StepOp::kNorm;
    if (hidden_only && p.tensor != kHid) return at(i, "writes only hidden");
    int64_t expected_out = p.rows_in;
    switch (p.op) {
      case StepOp::kAllGather:
        expected_out = p.rows_in * size;
        break;
      case StepOp::kReduceScatter:
        if (size < 1 || p.rows_in % size != 0) {
          return at(i, absl::StrCat("rows_in ", p.rows_in, " is not a multiple of the ",
                                    GroupName(p.group), " group size ", size));
        }
        expected_out = p.rows_in / size;
        break;
      case StepOp::kAddResidual:
      case StepOp::kAddAndNorm:
        if (rows[1] != rows[0]) {
          return at(i, absl::StrCat("needs a residual of hidden's ", rows[0], " rows, got ",
                                    rows[1] < 0 ? std::string("none") : absl::StrCat(rows[1])));
        }
        break;
      case StepOp::kStoreAndNorm:
        if (rows[1] >= 0) return at(i, "needs no residual (it stores one)");
        break;
      case StepOp::kSlice:
        if (p.first < 0 || p.first + p.rows_out > p.rows_in) {
          return at(i, absl::StrCat("rows [", p.first, ", ", p.first + p.rows_out,
                                    ") are outside the ", p.rows_in, " rows read"));
        }
        expected_out = p.rows_out;
        break;
      case StepOp::kPlace:
        if (p.first < 0 || p.first + p.rows_in > p.rows_out) {
          return at(i, absl::StrCat("rows [", p.first, ", ", p.first + p.rows_in,
                                    ") are outside the ", p.rows_out, " rows written"));
        }
        expected_out = p.rows_out;
        break;
      case StepOp::kAllReduce:
      case StepOp::kNorm:
        break;
    }
    if (p.rows_out != expected_out) {
      return at(i, absl::StrCat("rows_out must be ", expected_out, ", got ", p.rows_out));
    }
    rows[write] = p.rows_out;
    if (p.op == StepOp::kStoreAndNorm) rows[1] = rows[0];
    if (p.op == StepOp::kAddResidual && p.drop_residual) rows[1] = -1;
  }
  const int64_t residual_out = program.residual_rows_out < 0 ? -1 : program.residual_rows_out;
  if (rows[0] != program.hidden_rows_out || rows[1] != residual_out) {
    return absl::InvalidArgumentError(absl::StrCat(
        program.label, ": ends with hidden ", rows[0], " rows and residual ", rows[1],
        " rows (-1 = none), expected ", program.hidden_rows_out, " and ", residual_out));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepProgram> BuildBeforeAttentionProgram(const LayerPlan& plan,
                                                        const ParallelLayout& layout, int rank,
                                                        const DpGatherLayout& dp,
                                                        bool has_residual) {
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, layout, rank, plan.layer));
  const int64_t in = ModeRows(dp, plan.input);
  ProgramBuilder b(layout, Label(plan, "before_attention", StepName(plan.before_attention)), in,
                   has_residual ? in : -1);
  if (has_residual) {
    b.AddAndNorm();
  } else {
    b.StoreAndNorm();
  }
  if (plan.before_attention == BeforeAttentionOp::kAttnTpAllGather) {
    b.AllGather(kHid, StepGroup::kAttnTp);
  }
  return b.Finish(ModeRows(dp, plan.attention), in);
}

absl::StatusOr<StepProgram> BuildBeforeMlpProgram(const LayerPlan& plan,
                                                  const ParallelLayout& layout, int rank,
                                                  const DpGatherLayout& dp) {
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, layout, rank, plan.layer));
  const int attn_tp_rank = rank % layout.attn_tp_size();
  const int64_t offset = dp.offsets[dp.dp_rank];
  ProgramBuilder b(layout, Label(plan, "before_mlp", DescribeBeforeMlp(plan)),
                   ModeRows(dp, plan.attention), ModeRows(dp, plan.input));
  if (plan.gather_residual) b.AllGather(kRes, StepGroup::kAttnTp);
  switch (plan.before_mlp) {
    case BeforeMlpOp::kNormOnly:
      b.AddAndNorm();
      break;
    case BeforeMlpOp::kDpGatherAfterResidual:
      if (plan.norm_before_gather) {
        b.AddAndNorm();  // attn_tp_size 1: every rank is attention-TP rank 0
      } else if (attn_tp_rank == 0) {
        b.AddResidual(/*drop=*/false);
      }
      b.Place(offset, dp.global_rows);
      b.AllReduce(kHid, StepGroup::kWorld);
      if (!plan.norm_before_gather) {
        b.Slice(kRes, kHid, offset, dp.local_rows);
        b.Norm();
      }
      break;
    case BeforeMlpOp::kAllReduceAddNorm:
      // The fallback of the fused kernel: never skip the all-reduce.
      b.AllReduce(kHid, StepGroup::kWorld);
      b.AddAndNorm();
      break;
    case BeforeMlpOp::kReduceScatterNorm: {
      b.ReduceScatter(kHid, StepGroup::kAttnTp);
      if (plan.split_residual) {
        const int64_t s = DpScatteredRowsPerRank(dp);
        b.Slice(kRes, kRes, attn_tp_rank * s, s);
      }
      b.AddAndNorm();
      break;
    }
    case BeforeMlpOp::kAttnTpAllReduceNorm:
      b.AllReduce(kHid, StepGroup::kAttnTp);
      b.AddAndNorm();
      break;
  }
  return b.Finish(ModeRows(dp, plan.mlp), ModeRows(dp, plan.residual));
}

absl::Status CheckAfterMlpOpAllowed(const LayerPlan& plan, AfterMlpOp op) {
  const bool allowed = op == plan.after_mlp || (op == AfterMlpOp::kReduceScatter &&
                                                plan.after_mlp == AfterMlpOp::kDpScatter);
  if (!allowed) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", plan.layer, ", step after_mlp: op ",
                                                   StepName(op), " is not allowed by the plan's ",
                                                   StepName(plan.after_mlp)));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepProgram> BuildAfterMlpProgram(const LayerPlan& plan,
                                                 const ParallelLayout& layout, int rank,
                                                 const DpGatherLayout& dp, AfterMlpOp op,
                                                 bool has_residual) {
  RETURN_IF_ERROR(CheckAfterMlpOpAllowed(plan, op));
  RETURN_IF_ERROR(CheckDpLayoutFits(dp, layout, rank, plan.layer));
  const std::string where = absl::StrCat("layer ", plan.layer, ", step after_mlp (", StepName(op),
                                         "), rank ", rank, ": ");
  if (op == AfterMlpOp::kReduceScatter && dp.mode != DpPaddingMode::kMaxLen) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "needs MAX_LEN padding, the step has ", DpPaddingModeName(dp.mode)));
  }
  if (op == AfterMlpOp::kAddResidualAllGather && !has_residual) {
    return absl::FailedPreconditionError(absl::StrCat(where, "needs a residual, there is none"));
  }
  if (op == AfterMlpOp::kTakeSplit && has_residual) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "requires no residual (add it into hidden first)"));
  }
  const int attn_tp_rank = rank % layout.attn_tp_size();
  ProgramBuilder b(layout, Label(plan, "after_mlp", StepName(op)), ModeRows(dp, plan.mlp),
                   has_residual ? ModeRows(dp, plan.residual) : -1);
  bool residual_out = has_residual;
  switch (op) {
    case AfterMlpOp::kNone:
      break;
    case AfterMlpOp::kDpScatter:
      b.Slice(kHid, kHid, dp.offsets[dp.dp_rank], dp.local_rows);
      break;
    case AfterMlpOp::kReduceScatter:
      b.ReduceScatter(kHid, StepGroup::kWorld);
      b.AllGather(kHid, StepGroup::kAttnTp);
      break;
    case AfterMlpOp::kAddResidualAllGather:
      b.AddResidual(/*drop=*/true);
      b.AllGather(kHid, StepGroup::kAttnTp);
      residual_out = false;
      break;
    case AfterMlpOp::kTakeSplit: {
      const int64_t s = DpScatteredRowsPerRank(dp);
      b.Slice(kHid, kHid, attn_tp_rank * s, s);
      break;
    }
  }
  const int64_t out = ModeRows(dp, plan.output);
  return b.Finish(out, residual_out ? out : -1);
}

absl::StatusOr<std::vector<LayerStepPrograms>> BuildStackPrograms(
    const std::vector<LayerPlan>& plans, const ParallelLayout& layout, int rank,
    const DpGatherLayout& dp, bool allow_reduce_scatter) {
  std::vector<LayerStepPrograms> out;
  out.reserve(plans.size());
  bool has_residual = false;
  for (const LayerPlan& plan : plans) {
    LayerStepPrograms l;
    ASSIGN_OR_RETURN(l.before_attention,
                     BuildBeforeAttentionProgram(plan, layout, rank, dp, has_residual));
    ASSIGN_OR_RETURN(l.before_mlp, BuildBeforeMlpProgram(plan, layout, rank, dp));
    l.after_mlp_op = ResolveAfterMlpOp(plan, dp.mode, allow_reduce_scatter);
    ASSIGN_OR_RETURN(l.after_mlp, BuildAfterMlpProgram(plan, layout, rank, dp, l.after_mlp_op,
                                                       /*has_residual=*/true));
    has_residual = l.after_mlp.residual_rows_out >= 0;
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace moe_ep::core
