#include "core/layer_stack.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/bf16.h"
#include "core/ep_dispatcher.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/geometry.h"
#include "core/moe_reference.h"
#include "core/rms_norm.h"
#include "core/status_macros.h"
#include "core/step_executor.h"
#include "core/step_program.h"

namespace moe_ep::core {
namespace {

// Seed offsets that keep the stand-in weights of different kinds apart.
constexpr uint64_t kAttentionStream = 1;
constexpr uint64_t kInputNormStream = 2;
constexpr uint64_t kPostNormStream = 3;
constexpr uint64_t kRoutingStream = 4;
constexpr uint64_t kDenseSeedSalt = 0x9e3779b97f4a7c15ULL;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t Hash(uint64_t seed, uint64_t stream, uint64_t layer, uint64_t index) {
  return SplitMix64(SplitMix64(SplitMix64(SplitMix64(seed) ^ stream) ^ layer) ^ index);
}

// Uniform in [0, 1) from 24 random bits.
float Unit(uint64_t h) { return static_cast<float>(h >> 40) / static_cast<float>(1 << 24); }

// The stand-in weights of one layer that every rank holds whole.
struct LayerWeights {
  RmsNorm input_norm;
  RmsNorm post_norm;
  std::vector<float> attention;  // [H, H]: y = x W, W[i][o] at i * H + o
};

// `stop` (core/stop_check.h) is polled before each kGenerateStopChunk
// attention weights.
absl::StatusOr<LayerWeights> MakeLayerWeights(const LayerStackConfig& c, int layer,
                                              const StopCheck& stop = nullptr) {
  const int64_t h = c.hidden;
  std::vector<float> in_w(h), post_w(h), attn(h * h);
  for (int64_t i = 0; i < h; ++i) {
    in_w[i] = 1.0f + 0.2f * (Unit(Hash(c.seed, kInputNormStream, layer, i)) - 0.5f);
    post_w[i] = 1.0f + 0.2f * (Unit(Hash(c.seed, kPostNormStream, layer, i)) - 0.5f);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(h));
  for (int64_t i = 0; i < h * h; ++i) {
    if (i % kGenerateStopChunk == 0 && ShouldStop(stop)) {
      return LocalStop(absl::StrCat("attention weights (layer ", layer, "): after ", i, " of ",
                                    h * h, " weights"));
    }
    attn[i] = scale * (2.0f * Unit(Hash(c.seed, kAttentionStream, layer, i)) - 1.0f);
  }
  ASSIGN_OR_RETURN(RmsNorm input_norm, RmsNorm::Create(std::move(in_w), c.rms_eps));
  ASSIGN_OR_RETURN(RmsNorm post_norm, RmsNorm::Create(std::move(post_w), c.rms_eps));
  return LayerWeights{std::move(input_norm), std::move(post_norm), std::move(attn)};
}

// out[r, :] = sum over i in [lo, hi) of x[r, i] * W[i, :], ascending i (fp32).
std::vector<float> Attention(const std::vector<float>& x, const std::vector<float>& w,
                             int64_t hidden, int64_t lo, int64_t hi) {
  const int64_t rows = static_cast<int64_t>(x.size()) / hidden;
  std::vector<float> out(x.size(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out.data() + r * hidden;
    for (int64_t i = lo; i < hi; ++i) {
      const float xi = x[r * hidden + i];
      const float* wi = w.data() + i * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] += xi * wi[c];
    }
  }
  return out;
}

// [lo, hi) of part `j` of `n` contiguous parts of `total` (the first
// total % n parts one longer).
std::pair<int64_t, int64_t> Split(int64_t total, int n, int j) {
  const int64_t base = total / n, rem = total % n;
  const int64_t lo = j * base + std::min<int64_t>(j, rem);
  return {lo, lo + base + (j < rem ? 1 : 0)};
}

// The dense SwiGLU of `layer` sharded into `n` parts over I, part `j` (n = 1:
// the whole MLP).
absl::StatusOr<ExpertSet> DenseShard(const LayerStackConfig& c, int layer, int n, int j,
                                     const StopCheck& stop = nullptr) {
  ASSIGN_OR_RETURN(ExpertSet full, ExpertSet::GenerateSwiGlu(c.seed ^ kDenseSeedSalt, layer, 0, 1,
                                                             c.hidden, c.dense_intermediate, stop));
  if (n == 1) return full;
  const SwiGluWeights& w = full.swiglu_weights(0);
  const int64_t h = c.hidden, i_full = c.dense_intermediate, i_part = i_full / n;
  SwiGluWeights part;
  part.gate.assign(w.gate.begin() + j * i_part * h, w.gate.begin() + (j + 1) * i_part * h);
  part.up.assign(w.up.begin() + j * i_part * h, w.up.begin() + (j + 1) * i_part * h);
  part.down.reserve(h * i_part);
  for (int64_t r = 0; r < h; ++r) {
    part.down.insert(part.down.end(), w.down.begin() + r * i_full + j * i_part,
                     w.down.begin() + r * i_full + (j + 1) * i_part);
  }
  std::vector<SwiGluWeights> parts;
  parts.push_back(std::move(part));
  return ExpertSet::FromWeights(0, std::move(parts), h, i_part);
}

absl::StatusOr<ExpertSet> RankExperts(const LayerStackConfig& c, const ExpertPlacement& placement,
                                      int layer, int rank, const StopCheck& stop = nullptr) {
  return ExpertSet::GenerateSwiGlu(c.seed, layer, placement.FirstExpert(rank),
                                   placement.NumLocalExperts(rank), c.hidden, c.moe_intermediate,
                                   stop);
}

// ids [rows, K], weights [rows, K] for rows whose global token id is
// token_of(row) (-1: padding -> ids -1, weights 0).
template <typename TokenOf>
void RouteRows(const LayerStackConfig& c, int layer, int64_t rows, TokenOf token_of,
               std::vector<int32_t>& ids, std::vector<float>& weights) {
  ids.assign(rows * c.top_k, -1);
  weights.assign(rows * c.top_k, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = token_of(r);
    if (t < 0) continue;
    RouteToken(c.seed, layer, t, c.num_experts, c.top_k, ids.data() + r * c.top_k,
               weights.data() + r * c.top_k);
  }
}

}  // namespace

absl::Status ValidateLayerStackConfig(const LayerStackConfig& c) {
  RETURN_IF_ERROR(ValidateLayout(c.layout));
  auto bad = [](const char* field, const std::string& expected, auto got) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
  };
  if (c.sparse_layers.empty()) return bad("sparse_layers", "at least one layer", 0);
  if (c.hidden < 1) return bad("hidden", ">= 1", c.hidden);
  if (c.dense_intermediate < 1 || c.dense_intermediate % c.layout.tp_size != 0) {
    return bad("dense_intermediate",
               absl::StrCat("a positive multiple of tp_size ", c.layout.tp_size),
               c.dense_intermediate);
  }
  if (c.moe_intermediate < 1) return bad("moe_intermediate", ">= 1", c.moe_intermediate);
  if (c.num_experts < c.layout.tp_size) {
    return bad("num_experts", absl::StrCat(">= tp_size ", c.layout.tp_size), c.num_experts);
  }
  if (c.top_k < 1 || c.top_k > c.num_experts) {
    return bad("top_k", absl::StrCat("in [1, num_experts ", c.num_experts, "]"), c.top_k);
  }
  if (!(c.rms_eps > 0.0f)) return bad("rms_eps", "> 0", c.rms_eps);
  if (c.capacity_tokens < 1) return bad("capacity_tokens", ">= 1", c.capacity_tokens);
  return absl::OkStatus();
}

void RouteToken(uint64_t seed, int layer, int64_t token, int num_experts, int top_k, int32_t* ids,
                float* weights) {
  const uint64_t base = Hash(seed, kRoutingStream, layer, static_cast<uint64_t>(token));
  float sum = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    for (uint64_t attempt = 0;; ++attempt) {
      const int32_t e =
          static_cast<int32_t>(SplitMix64(base ^ (static_cast<uint64_t>(k) << 32) ^ attempt) %
                               static_cast<uint64_t>(num_experts));
      if (std::find(ids, ids + k, e) == ids + k) {
        ids[k] = e;
        break;
      }
    }
    weights[k] = 0.25f + Unit(SplitMix64(base + 0x1000 + k));
    sum += weights[k];
  }
  for (int k = 0; k < top_k; ++k) weights[k] /= sum;
}

absl::StatusOr<std::vector<float>> ReferenceLayerStack(
    const LayerStackConfig& c, const std::vector<std::vector<float>>& dp_tokens,
    const std::function<void(int layer)>& on_layer) {
  RETURN_IF_ERROR(ValidateLayerStackConfig(c));
  if (static_cast<int>(dp_tokens.size()) != c.layout.attn_dp_size) {
    return absl::InvalidArgumentError(absl::StrCat("dp_tokens: expected attn_dp_size ",
                                                   c.layout.attn_dp_size, " entries, got ",
                                                   dp_tokens.size()));
  }
  const int64_t h = c.hidden;
  std::vector<float> hidden;
  for (size_t g = 0; g < dp_tokens.size(); ++g) {
    if (dp_tokens[g].size() % h != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dp_tokens[", g, "]: size ", dp_tokens[g].size(), " is not a multiple of H ", h));
    }
    hidden.insert(hidden.end(), dp_tokens[g].begin(), dp_tokens[g].end());
  }
  const int64_t n = static_cast<int64_t>(hidden.size()) / h;
  const int tp = c.layout.tp_size;
  ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::Contiguous(c.num_experts, tp));
  std::vector<float> residual;
  bool has_residual = false;
  for (int l = 0; l < static_cast<int>(c.sparse_layers.size()); ++l) {
    ASSIGN_OR_RETURN(LayerWeights w, MakeLayerWeights(c, l));
    if (has_residual) {
      RETURN_IF_ERROR(
          w.input_norm.ApplyWithResidual(absl::MakeSpan(hidden), absl::MakeSpan(residual), n));
    } else {
      residual = hidden;
      has_residual = true;
      RETURN_IF_ERROR(w.input_norm.Apply(absl::MakeSpan(hidden), n));
    }
    hidden = Attention(hidden, w.attention, h, 0, h);
    RETURN_IF_ERROR(
        w.post_norm.ApplyWithResidual(absl::MakeSpan(hidden), absl::MakeSpan(residual), n));
    std::vector<float> out(hidden.size(), 0.0f);
    if (!c.sparse_layers[l]) {
      ASSIGN_OR_RETURN(ExpertSet dense, DenseShard(c, l, 1, 0));
      RETURN_IF_ERROR(dense.Apply(0, hidden, n, absl::MakeSpan(out)));
    } else {
      std::vector<int32_t> ids;
      std::vector<float> weights;
      RouteRows(
          c, l, n, [](int64_t r) { return r; }, ids, weights);
      std::vector<ExpertSet> sets;
      for (int r = 0; r < tp; ++r) {
        ASSIGN_OR_RETURN(ExpertSet set, RankExperts(c, placement, l, r));
        sets.push_back(std::move(set));
      }
      if (c.a2a_enabled) {
        // The EP path: bf16 in, one bf16 partial per destination rank, summed
        // in fp32 and rounded (ReferenceEpForward with every token on rank 0).
        std::vector<bf16_t> x16(hidden.size());
        for (size_t i = 0; i < hidden.size(); ++i) x16[i] = FloatToBf16(hidden[i]);
        std::vector<const ExpertSet*> set_ptrs;
        set_ptrs.reserve(sets.size());
        for (const ExpertSet& s : sets) set_ptrs.push_back(&s);
        std::vector<EpRankInput> inputs(tp);
        inputs[0] = EpRankInput{x16, ids, weights, n};
        ASSIGN_OR_RETURN(EpReferenceResult ep,
                         ReferenceEpForward(placement, set_ptrs, inputs, c.top_k));
        for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToFloat(ep.output[0][i]);
      } else {
        // The FULL path: every rank's experts on every row in fp32, summed
        // over ranks.
        std::vector<float> part(hidden.size());
        for (const ExpertSet& s : sets) {
          RETURN_IF_ERROR(
              s.ComputeWeightedSum(hidden, ids, weights, n, c.top_k, absl::MakeSpan(part)));
          for (size_t i = 0; i < out.size(); ++i) out[i] += part[i];
        }
      }
    }
    hidden = std::move(out);
    if (on_layer) on_layer(l);
  }
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] += residual[i];
  return hidden;
}

struct DistributedLayerStack::Impl {
  const ParallelGroups* groups = nullptr;
  LayerStackConfig config;
  std::vector<LayerPlan> plans;
  std::unique_ptr<StepExecutor> executor;  // the communication steps
  std::vector<LayerWeights> weights;
  std::vector<ExpertSet> mlp;  // per layer: this rank's dense shard or its experts
  std::unique_ptr<EpDispatcher> dispatcher;
  int64_t epoch = 0;
  DpGatherLayout last_layout;
  std::vector<AfterMlpOp> last_ops;

  absl::Status Mlp(int layer, const DpGatherLayout& dp, const std::vector<int64_t>& dp_counts,
                   bool skip_all_reduce, std::vector<float>& hidden);
};

absl::Status DistributedLayerStack::Impl::Mlp(int l, const DpGatherLayout& dp,
                                              const std::vector<int64_t>& dp_counts,
                                              bool skip_all_reduce, std::vector<float>& hidden) {
  const LayerStackConfig& c = config;
  const LayerPlan& plan = plans[l];
  const int64_t h = c.hidden;
  const int64_t rows = static_cast<int64_t>(hidden.size()) / h;
  std::vector<int64_t> prefix(dp_counts.size() + 1, 0);
  for (size_t g = 0; g < dp_counts.size(); ++g) prefix[g + 1] = prefix[g] + dp_counts[g];
  const int g = groups->dp_rank();
  std::vector<float> out(hidden.size(), 0.0f);
  if (!plan.sparse) {
    RETURN_IF_ERROR(mlp[l].Apply(0, hidden, rows, absl::MakeSpan(out)));
    if (plan.mlp == ScatterMode::kFull && !skip_all_reduce) {
      RETURN_IF_ERROR(groups->world().AllReduceSum(out.data(), static_cast<int64_t>(out.size())));
    } else if (plan.mlp == ScatterMode::kTpAttnFull) {
      RETURN_IF_ERROR(groups->attn_tp().AllReduceSum(out.data(), static_cast<int64_t>(out.size())));
    }
    hidden = std::move(out);
    return absl::OkStatus();
  }
  std::vector<int32_t> ids;
  std::vector<float> weights;
  if (plan.mlp == ScatterMode::kScattered) {
    // Row k of this rank is TP_ATTN_FULL row j * s + k of DP group g.
    const int64_t s = DpScatteredRowsPerRank(dp);
    const int64_t first = groups->attn_tp_rank() * s;
    RouteRows(
        c, l, rows,
        [&](int64_t k) { return first + k < dp_counts[g] ? prefix[g] + first + k : -1; }, ids,
        weights);
    std::vector<bf16_t> x16(hidden.size()), out16(hidden.size());
    for (size_t i = 0; i < hidden.size(); ++i) x16[i] = FloatToBf16(hidden[i]);
    ASSIGN_OR_RETURN(std::vector<int64_t> counts, dispatcher->SyncTokenCounts(rows));
    ASSIGN_OR_RETURN(int64_t r_max, ChooseRuntimeMaxTokens(counts, {}, c.capacity_tokens));
    RETURN_IF_ERROR(dispatcher->CommitGeometry(++epoch, r_max, rows));
    RETURN_IF_ERROR(dispatcher->Forward(x16, ids, weights, rows, mlp[l], absl::MakeSpan(out16)));
    for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToFloat(out16[i]);
  } else if (plan.mlp == ScatterMode::kFull) {
    // FULL row r belongs to the DP group whose [offset, offset + count) holds it.
    RouteRows(
        c, l, rows,
        [&](int64_t r) -> int64_t {
          for (size_t gg = 0; gg < dp_counts.size(); ++gg) {
            const int64_t i = r - dp.offsets[gg];
            if (i >= 0 && i < dp.padded_counts[gg]) return i < dp_counts[gg] ? prefix[gg] + i : -1;
          }
          return -1;
        },
        ids, weights);
    RETURN_IF_ERROR(
        mlp[l].ComputeWeightedSum(hidden, ids, weights, rows, c.top_k, absl::MakeSpan(out)));
    if (!skip_all_reduce) {
      RETURN_IF_ERROR(groups->world().AllReduceSum(out.data(), static_cast<int64_t>(out.size())));
    }
  } else {
    return absl::InternalError(absl::StrCat("layer ", l, ": a sparse MLP in ",
                                            ScatterModeName(plan.mlp), " has no implementation"));
  }
  hidden = std::move(out);
  return absl::OkStatus();
}

DistributedLayerStack::DistributedLayerStack(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistributedLayerStack::~DistributedLayerStack() = default;

absl::StatusOr<std::unique_ptr<DistributedLayerStack>> DistributedLayerStack::Create(
    const ParallelGroups* groups, const LayerStackConfig& config,
    std::unique_ptr<StepExecutor> executor,
    const std::function<absl::Status(int layer)>& before_layer, const StopCheck& stop) {
  if (groups == nullptr) return absl::InvalidArgumentError("groups is null");
  RETURN_IF_ERROR(ValidateLayerStackConfig(config));
  const ParallelLayout& gl = groups->layout();
  if (gl.tp_size != config.layout.tp_size || gl.attn_dp_size != config.layout.attn_dp_size ||
      gl.effective_moe_dense_tp_size() != config.layout.effective_moe_dense_tp_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.layout (tp ", config.layout.tp_size, ", attn_dp ", config.layout.attn_dp_size,
        ", moe_dense_tp ", config.layout.effective_moe_dense_tp_size(),
        ") differs from the groups' (tp ", gl.tp_size, ", attn_dp ", gl.attn_dp_size,
        ", moe_dense_tp ", gl.effective_moe_dense_tp_size(), ")"));
  }
  auto impl = std::make_unique<Impl>();
  impl->groups = groups;
  impl->config = config;
  ASSIGN_OR_RETURN(impl->plans,
                   PlanLayers(config.layout, config.sparse_layers, config.a2a_enabled));
  ASSIGN_OR_RETURN(ExpertPlacement placement,
                   ExpertPlacement::Contiguous(config.num_experts, config.layout.tp_size));
  impl->executor = executor != nullptr ? std::move(executor)
                                       : std::make_unique<HostStepExecutor>(groups, config.hidden);
  bool needs_dispatcher = false;
  const auto build_layer = [&](const LayerPlan& plan) -> absl::Status {
    ASSIGN_OR_RETURN(LayerWeights w, MakeLayerWeights(config, plan.layer, stop));
    impl->weights.push_back(std::move(w));
    if (plan.sparse) {
      ASSIGN_OR_RETURN(ExpertSet set,
                       RankExperts(config, placement, plan.layer, groups->rank(), stop));
      impl->mlp.push_back(std::move(set));
      needs_dispatcher |= plan.mlp == ScatterMode::kScattered;
    } else {
      int parts = 1, part = 0;
      if (plan.mlp == ScatterMode::kFull) {
        parts = groups->tp_size();
        part = groups->rank();
      } else if (plan.mlp == ScatterMode::kTpAttnFull) {
        parts = groups->attn_tp_size();
        part = groups->attn_tp_rank();
      }
      ASSIGN_OR_RETURN(ExpertSet set, DenseShard(config, plan.layer, parts, part, stop));
      impl->mlp.push_back(std::move(set));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < impl->plans.size(); ++i) {
    const LayerPlan& plan = impl->plans[i];
    if (plan.layer > 0 && before_layer) RETURN_IF_ERROR(before_layer(plan.layer));
    const absl::Status built = build_layer(plan);
    // Stopped early: the peers build on to the next gate, so this rank
    // meets them there (its answer, a stop on every rank, replaces the
    // local one); after the last layer the caller's next gate does it.
    if (IsLocalStop(built) && before_layer && i + 1 < impl->plans.size()) {
      RETURN_IF_ERROR(before_layer(impl->plans[i + 1].layer));
    }
    RETURN_IF_ERROR(built);
  }
  if (needs_dispatcher) {
    EpDispatcherOptions options;
    options.workspace.ep_size = config.layout.tp_size;
    options.workspace.capacity_tokens = config.capacity_tokens;
    options.workspace.hidden = config.hidden;
    options.workspace.top_k = config.top_k;
    options.workspace.dtype = DispatchDType::kBF16;
    options.num_experts = config.num_experts;
    options.invalid_expert_id = -1;
    ASSIGN_OR_RETURN(impl->dispatcher, EpDispatcher::Create(&groups->world(), options, 0));
  }
  return std::unique_ptr<DistributedLayerStack>(new DistributedLayerStack(std::move(impl)));
}

absl::StatusOr<std::vector<float>> DistributedLayerStack::Forward(
    absl::Span<const float> tokens, int64_t num_tokens,
    const std::function<absl::Status(int layer)>& before_layer) {
  Impl& s = *impl_;
  const int64_t h = s.config.hidden;
  const ParallelGroups& groups = *s.groups;
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens: expected >= 0, got ", num_tokens));
  }
  if (static_cast<int64_t>(tokens.size()) != num_tokens * h) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: expected num_tokens * H = ", num_tokens,
                                                   " * ", h, " elements, got ", tokens.size()));
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> rank_counts, AllGatherInt64(groups.world(), num_tokens));
  const int attn_tp = groups.attn_tp_size();
  std::vector<int64_t> dp_counts(groups.attn_dp_size());
  for (int g = 0; g < groups.attn_dp_size(); ++g) {
    dp_counts[g] = rank_counts[g * attn_tp];
    for (int j = 1; j < attn_tp; ++j) {
      if (rank_counts[g * attn_tp + j] != dp_counts[g]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "DP group ", g, ": ranks ", g * attn_tp, " and ", g * attn_tp + j,
            " pass different token counts (", dp_counts[g], " vs ", rank_counts[g * attn_tp + j],
            "); every attention-TP rank of a DP group must pass the group's tokens"));
      }
    }
  }
  ASSIGN_OR_RETURN(DpGatherLayout dp,
                   ComputeDpGatherLayout(dp_counts, attn_tp, false, groups.dp_rank()));
  s.last_layout = dp;
  s.last_ops.clear();

  // The communication steps of every layer for this DP layout, built once.
  ASSIGN_OR_RETURN(const std::vector<LayerStepPrograms> programs,
                   BuildStackPrograms(s.plans, groups.layout(), groups.rank(), dp,
                                      s.config.allow_reduce_scatter));

  // Attention's slice of the input dimension on this attention-TP rank.
  const auto [lo, hi] = Split(h, attn_tp, groups.attn_tp_rank());
  LayerActivations act;
  act.hidden.assign(dp.local_rows * h, 0.0f);
  std::copy(tokens.begin(), tokens.end(), act.hidden.begin());
  for (size_t l = 0; l < s.plans.size(); ++l) {
    if (l > 0 && before_layer) RETURN_IF_ERROR(before_layer(static_cast<int>(l)));
    const LayerStepPrograms& p = programs[l];
    RETURN_IF_ERROR(s.executor->Run(p.before_attention, &s.weights[l].input_norm, act));
    act.hidden = Attention(act.hidden, s.weights[l].attention, h, lo, hi);
    RETURN_IF_ERROR(s.executor->Run(p.before_mlp, &s.weights[l].post_norm, act));
    s.last_ops.push_back(p.after_mlp_op);
    RETURN_IF_ERROR(s.Mlp(static_cast<int>(l), dp, dp_counts,
                          p.after_mlp_op == AfterMlpOp::kReduceScatter, act.hidden));
    RETURN_IF_ERROR(s.executor->Run(p.after_mlp, nullptr, act));
  }
  std::vector<float> out(act.hidden.begin(), act.hidden.begin() + num_tokens * h);
  if (act.residual.has_value()) {
    for (int64_t i = 0; i < num_tokens * h; ++i) out[i] += (*act.residual)[i];
  }
  return out;
}

const std::vector<LayerPlan>& DistributedLayerStack::plans() const { return impl_->plans; }
const StepExecutor& DistributedLayerStack::executor() const { return *impl_->executor; }
const DpGatherLayout& DistributedLayerStack::last_layout() const { return impl_->last_layout; }
const std::vector<AfterMlpOp>& DistributedLayerStack::last_after_mlp_ops() const {
  return impl_->last_ops;
}

}  // namespace moe_ep::core
