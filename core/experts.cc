#include "core/experts.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/expert_source.h"
#include "core/parallel_for.h"
#include "core/safetensors.h"
#include "core/seeded_stream.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

// --- Seeded weights -------------------------------------------------------
//
// The stream, its keys and the bf16 rounding live in core/seeded_stream.h so
// the device generator (kernels/seeded_weights.cuh) makes the same bits.

using Projection = SeededProjection;
constexpr Projection kGate = SeededProjection::kGate;
constexpr Projection kUp = SeededProjection::kUp;
constexpr Projection kDown = SeededProjection::kDown;

// Minimum work per thread of the parallel loops below (about a millisecond),
// so small sets (tests, tiny models) stay on the calling thread.
constexpr int64_t kMinPairsPerThread = int64_t{1} << 18;
constexpr int64_t kMinWidenPerThread = int64_t{1} << 20;

// Writes elements [2 * pair_begin, min(2 * pair_end, n)) of tensor `key` into
// `out` (n = out.size(); the last pair of an odd n has one element).
void FillPairs(uint64_t key, SeededUniform range, int64_t pair_begin, int64_t pair_end,
               std::vector<bf16_t>& out) {
  const int64_t n = static_cast<int64_t>(out.size());
  const int64_t full_end = std::min(pair_end, n / 2);
  for (int64_t c = pair_begin; c < full_end; ++c) {
    const SeededBf16Pair pair = SeededPair(key, c, range);
    out[2 * c] = pair.first;
    out[2 * c + 1] = pair.second;
  }
  if (n % 2 == 1 && pair_begin <= n / 2 && n / 2 < pair_end) {
    out[n - 1] = SeededElement(key, n - 1, range);
  }
}

void Widen(const std::vector<bf16_t>& in, float* out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = Bf16ToFloat(in[i]);
}

// out [3 * I * H] = fp32 of gate, up, down back to back, on all cores (the
// widening of a large expert costs as much as its GEMMs on one core).
void WidenAllCores(const SwiGluWeights& w, float* out) {
  const int64_t ih = static_cast<int64_t>(w.gate.size());
  ParallelFor(3 * ih, kMinWidenPerThread, [&](int64_t begin, int64_t end) {
    const std::vector<bf16_t>* parts[3] = {&w.gate, &w.up, &w.down};
    for (int p = 0; p < 3; ++p) {
      const int64_t lo = std::max(begin, p * ih), hi = std::min(end, (p + 1) * ih);
      const bf16_t* src = parts[p]->data() - p * ih;
      for (int64_t i = lo; i < hi; ++i) out[i] = Bf16ToFloat(src[i]);
    }
  });
}

float Silu(float v) { return v / (1.0f + std::exp(-v)); }

// y [rows, H] = down(silu(gate(x)) * up(x)) for x [rows, H], all fp32.
// `w_gate_up` is [2I, H] (gate rows then up rows), `w_down` [H, I];
// `scratch` holds rows * 2I floats.
void SwiGluForward(const float* x, int64_t rows, int64_t hidden, int64_t inter,
                   const float* w_gate_up, const float* w_down, float* scratch, float* y) {
  if (rows == 0) return;
  // scratch [rows, 2I] = x [rows, H] * w_gate_up^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, 2 * inter, hidden, 1.0f, x, hidden,
              w_gate_up, hidden, 0.0f, scratch, 2 * inter);
  // act [rows, I] written in place over the gate half: silu(g) * u.
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scratch + r * 2 * inter;
    for (int64_t j = 0; j < inter; ++j) row[j] = Silu(row[j]) * row[inter + j];
  }
  // y [rows, H] = act [rows, I] (leading dimension 2I) * w_down^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, hidden, inter, 1.0f, scratch,
              2 * inter, w_down, inter, 0.0f, y, hidden);
}

}  // namespace

absl::StatusOr<SafetensorsTensorView> FindBf16Matrix(SafetensorsCheckpoint& ckpt,
                                                     const std::string& name, int64_t rows,
                                                     int64_t cols) {
  ASSIGN_OR_RETURN(SafetensorsTensorView view, ckpt.Find(name));
  if (view.shape.size() != 2 || view.shape[0] != rows || view.shape[1] != cols) {
    std::string got;
    for (size_t i = 0; i < view.shape.size(); ++i) {
      absl::StrAppend(&got, i ? ", " : "", view.shape[i]);
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": shape: expected [%d, %d], got [%s]", name, rows, cols, got));
  }
  if (!SafetensorsIsFloat(view.dtype)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor \"%s\": dtype: expected BF16, F16 or F32 for bf16 experts, got %s (a quantized "
        "checkpoint: load it with the matching expert kind, e.g. fp8 block-scaled)",
        name, SafetensorsDTypeName(view.dtype)));
  }
  return view;
}

absl::StatusOr<std::vector<bf16_t>> ReadBf16Matrix(SafetensorsCheckpoint& ckpt,
                                                   const std::string& name, int64_t rows,
                                                   int64_t cols) {
  ASSIGN_OR_RETURN(SafetensorsTensorView view, FindBf16Matrix(ckpt, name, rows, cols));
  std::vector<bf16_t> out(rows * cols);
  RETURN_IF_ERROR(SafetensorsToBf16(view, 0, absl::MakeSpan(out)));
  return out;
}

absl::Status CheckSwiGluDims(int first_expert, int num_experts, int64_t hidden,
                             int64_t intermediate) {
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("hidden: expected >= 1, got %d", hidden));
  }
  if (intermediate < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("intermediate: expected >= 1, got %d", intermediate));
  }
  if (num_experts < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_experts: expected >= 0, got %d", num_experts));
  }
  if (first_expert < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("first_expert: expected >= 0, got %d", first_expert));
  }
  return absl::OkStatus();
}

absl::StatusOr<ExpertSet> ExpertSet::GenerateSwiGlu(uint64_t seed, int layer, int first_expert,
                                                    int num_experts, int64_t hidden,
                                                    int64_t intermediate, const StopCheck& stop) {
  RETURN_IF_ERROR(CheckSwiGluDims(first_expert, num_experts, hidden, intermediate));
  ExpertSet set;
  set.kind_ = ExpertKind::kSwiGlu;
  set.first_expert_ = first_expert;
  set.num_experts_ = num_experts;
  set.hidden_ = hidden;
  set.intermediate_ = intermediate;
  set.seed_origin_ = SeedOrigin{seed, layer};
  set.weights_.resize(num_experts);
  const SeededUniform in_range = SeededUniformFor(hidden);
  const SeededUniform down_range = SeededUniformFor(intermediate);
  // Tensors t = 3 * i + p (p: gate, up, down), each n elements in
  // ceil(n / 2) stream pairs. The stream is counter-based, so any split of
  // the (tensor, pair) space over threads makes the same bits.
  const int64_t n = intermediate * hidden;
  const int64_t num_tensors = int64_t{num_experts} * 3;
  const int64_t pairs_per_tensor = (n + 1) / 2;
  const auto tensor = [&](int64_t t) -> std::vector<bf16_t>& {
    SwiGluWeights& w = set.weights_[t / 3];
    return t % 3 == 0 ? w.gate : t % 3 == 1 ? w.up : w.down;
  };
  ParallelFor(num_tensors, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tensor(t).resize(n);
  });
  const auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin / pairs_per_tensor; t * pairs_per_tensor < end; ++t) {
      const int64_t tensor_begin = t * pairs_per_tensor;
      const int p = static_cast<int>(t % 3);
      const uint64_t key = SeededTensorKey(seed, layer, first_expert + static_cast<int>(t / 3),
                                           p == 0   ? kGate
                                           : p == 1 ? kUp
                                                    : kDown);
      FillPairs(key, p == 2 ? down_range : in_range, std::max(begin, tensor_begin) - tensor_begin,
                std::min(end, tensor_begin + pairs_per_tensor) - tensor_begin, tensor(t));
    }
  };
  // Without a StopCheck one chunk (the whole space); with one, a poll before
  // each kGenerateStopChunk weights.
  const int64_t total_pairs = num_tensors * pairs_per_tensor;
  const int64_t chunk_pairs = stop ? kGenerateStopChunk / 2 : std::max<int64_t>(total_pairs, 1);
  for (int64_t lo = 0; lo < total_pairs; lo += chunk_pairs) {
    if (ShouldStop(stop)) {
      return LocalStop(absl::StrCat("weight generation (layer ", layer, ", experts ", first_expert,
                                    "-", first_expert + num_experts - 1, "): after ", 2 * lo,
                                    " of ", 2 * total_pairs, " weights"));
    }
    const int64_t hi = std::min(total_pairs, lo + chunk_pairs);
    ParallelFor(hi - lo, kMinPairsPerThread,
                [&](int64_t begin, int64_t end) { fill(lo + begin, lo + end); });
  }
  return set;
}

ExpertSet ExpertSet::Identity(int first_expert, int num_experts, int64_t hidden) {
  ExpertSet set;
  set.kind_ = ExpertKind::kIdentity;
  set.first_expert_ = first_expert;
  set.num_experts_ = num_experts;
  set.hidden_ = hidden;
  return set;
}

absl::StatusOr<ExpertSet> ExpertSet::FromWeights(int first_expert,
                                                 std::vector<SwiGluWeights> weights, int64_t hidden,
                                                 int64_t intermediate) {
  RETURN_IF_ERROR(
      CheckSwiGluDims(first_expert, static_cast<int>(weights.size()), hidden, intermediate));
  for (size_t i = 0; i < weights.size(); ++i) {
    const SwiGluWeights& w = weights[i];
    const size_t n = static_cast<size_t>(hidden * intermediate);
    if (w.gate.size() != n || w.up.size() != n || w.down.size() != n) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "weights[%d]: expected gate, up and down of %d elements (I=%d, H=%d), got %d, %d, %d", i,
          n, intermediate, hidden, w.gate.size(), w.up.size(), w.down.size()));
    }
  }
  ExpertSet set;
  set.kind_ = ExpertKind::kSwiGlu;
  set.first_expert_ = first_expert;
  set.num_experts_ = static_cast<int>(weights.size());
  set.hidden_ = hidden;
  set.intermediate_ = intermediate;
  set.weights_ = std::move(weights);
  return set;
}

const char* ExpertKindName(ExpertKind kind) {
  switch (kind) {
    case ExpertKind::kSwiGlu:
      return "swiglu";
    case ExpertKind::kIdentity:
      return "identity";
    case ExpertKind::kFp8SwiGlu:
      return "fp8-swiglu";
    case ExpertKind::kGptOssMxfp4:
      return "gpt-oss-mxfp4";
  }
  return "?";
}

absl::StatusOr<ExpertSet> ExpertSet::FromFp8Weights(int first_expert,
                                                    std::vector<quant::Fp8SwiGluWeights> weights,
                                                    int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(
      CheckSwiGluDims(first_expert, static_cast<int>(weights.size()), hidden, intermediate));
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string e = absl::StrCat("expert ", first_expert + static_cast<int64_t>(i));
    RETURN_IF_ERROR(
        quant::CheckFp8BlockMatrix(weights[i].gate, intermediate, hidden, e + " gate_proj"));
    RETURN_IF_ERROR(
        quant::CheckFp8BlockMatrix(weights[i].up, intermediate, hidden, e + " up_proj"));
    RETURN_IF_ERROR(
        quant::CheckFp8BlockMatrix(weights[i].down, hidden, intermediate, e + " down_proj"));
  }
  ExpertSet set;
  set.kind_ = ExpertKind::kFp8SwiGlu;
  set.first_expert_ = first_expert;
  set.num_experts_ = static_cast<int>(weights.size());
  set.hidden_ = hidden;
  set.intermediate_ = intermediate;
  set.fp8_weights_ = std::move(weights);
  return set;
}

absl::StatusOr<ExpertSet> ExpertSet::FromGptOssWeights(
    int first_expert, std::vector<quant::GptOssExpertWeights> weights, int64_t hidden,
    int64_t intermediate, const quant::GptOssActivation& activation) {
  RETURN_IF_ERROR(
      CheckSwiGluDims(first_expert, static_cast<int>(weights.size()), hidden, intermediate));
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string e = absl::StrCat("expert ", first_expert + static_cast<int64_t>(i));
    const quant::GptOssExpertWeights& w = weights[i];
    RETURN_IF_ERROR(
        quant::CheckMxfp4Matrix(w.gate_up, 2 * intermediate, hidden, e + " gate_up_proj"));
    RETURN_IF_ERROR(quant::CheckMxfp4Matrix(w.down, hidden, intermediate, e + " down_proj"));
    if (static_cast<int64_t>(w.gate_up_bias.size()) != 2 * intermediate ||
        static_cast<int64_t>(w.down_bias.size()) != hidden) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: biases: expected gate_up_proj_bias [%d] and down_proj_bias [%d], got [%d] and [%d]",
          e, 2 * intermediate, hidden, w.gate_up_bias.size(), w.down_bias.size()));
    }
  }
  ExpertSet set;
  set.kind_ = ExpertKind::kGptOssMxfp4;
  set.first_expert_ = first_expert;
  set.num_experts_ = static_cast<int>(weights.size());
  set.hidden_ = hidden;
  set.intermediate_ = intermediate;
  set.gpt_oss_weights_ = std::move(weights);
  set.gpt_oss_activation_ = activation;
  return set;
}

absl::StatusOr<ExpertSet> ExpertSet::GenerateFp8SwiGlu(uint64_t seed, int layer, int first_expert,
                                                       int num_experts, int64_t hidden,
                                                       int64_t intermediate,
                                                       const StopCheck& stop) {
  RETURN_IF_ERROR(CheckSwiGluDims(first_expert, num_experts, hidden, intermediate));
  std::vector<quant::Fp8SwiGluWeights> weights;
  weights.reserve(num_experts);
  for (int i = 0; i < num_experts; ++i) {
    if (ShouldStop(stop)) {
      return LocalStop(absl::StrCat("fp8 weight generation (layer ", layer, "): after ", i, " of ",
                                    num_experts, " experts"));
    }
    ASSIGN_OR_RETURN(quant::Fp8SwiGluWeights w,
                     quant::GenerateFp8SwiGlu(seed, layer, first_expert + i, hidden, intermediate));
    weights.push_back(std::move(w));
  }
  ASSIGN_OR_RETURN(ExpertSet set,
                   FromFp8Weights(first_expert, std::move(weights), hidden, intermediate));
  set.seed_origin_ = SeedOrigin{seed, layer};
  return set;
}

absl::StatusOr<ExpertSet> ExpertSet::GenerateGptOss(uint64_t seed, int layer, int first_expert,
                                                    int num_experts, int64_t hidden,
                                                    int64_t intermediate,
                                                    const quant::GptOssActivation& activation,
                                                    const StopCheck& stop) {
  RETURN_IF_ERROR(CheckSwiGluDims(first_expert, num_experts, hidden, intermediate));
  std::vector<quant::GptOssExpertWeights> weights;
  weights.reserve(num_experts);
  for (int i = 0; i < num_experts; ++i) {
    if (ShouldStop(stop)) {
      return LocalStop(absl::StrCat("mxfp4 weight generation (layer ", layer, "): after ", i,
                                    " of ", num_experts, " experts"));
    }
    ASSIGN_OR_RETURN(
        quant::GptOssExpertWeights w,
        quant::GenerateGptOssExpert(seed, layer, first_expert + i, hidden, intermediate));
    weights.push_back(std::move(w));
  }
  ASSIGN_OR_RETURN(ExpertSet set, FromGptOssWeights(first_expert, std::move(weights), hidden,
                                                    intermediate, activation));
  set.seed_origin_ = SeedOrigin{seed, layer};
  return set;
}

absl::StatusOr<ExpertSet> ExpertSet::LoadSafetensors(const std::string& path,
                                                     const std::string& name_pattern, int layer,
                                                     int first_expert, int num_experts,
                                                     int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(CheckSwiGluDims(first_expert, num_experts, hidden, intermediate));
  const std::string_view pattern(name_pattern);
  if (pattern.find("{expert}") == std::string_view::npos ||
      (pattern.find("{proj}") == std::string_view::npos &&
       pattern.find("{w}") == std::string_view::npos)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "name_pattern: expected {expert} and one of {proj} or {w}, got \"", name_pattern, "\""));
  }
  ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt, SafetensorsCheckpoint::Open(path));
  std::vector<SwiGluWeights> weights(num_experts);
  for (int i = 0; i < num_experts; ++i) {
    const int e = first_expert + i;
    ASSIGN_OR_RETURN(weights[i].gate,
                     ReadBf16Matrix(ckpt, ExpertTensorName(name_pattern, layer, e, kGate),
                                    intermediate, hidden));
    ASSIGN_OR_RETURN(
        weights[i].up,
        ReadBf16Matrix(ckpt, ExpertTensorName(name_pattern, layer, e, kUp), intermediate, hidden));
    ASSIGN_OR_RETURN(weights[i].down,
                     ReadBf16Matrix(ckpt, ExpertTensorName(name_pattern, layer, e, kDown), hidden,
                                    intermediate));
  }
  return FromWeights(first_expert, std::move(weights), hidden, intermediate);
}

absl::StatusOr<ExpertSet> ExpertSet::Union(std::vector<ExpertSet> parts) {
  if (parts.empty()) return absl::InvalidArgumentError("Union: expected >= 1 part, got none");
  const ExpertSet& first = parts.front();
  std::vector<std::pair<int, std::pair<int, int>>> order;  // (expert, (part, local index))
  for (int p = 0; p < static_cast<int>(parts.size()); ++p) {
    const ExpertSet& part = parts[p];
    if (part.kind_ != first.kind_ || part.hidden_ != first.hidden_ ||
        (part.kind_ != ExpertKind::kIdentity && part.intermediate_ != first.intermediate_)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Union: part %d has (kind %s, H %d, I %d), part 0 has (kind %s, H %d, I %d)", p,
          ExpertKindName(part.kind_), part.hidden_, part.intermediate_, ExpertKindName(first.kind_),
          first.hidden_, first.intermediate_));
    }
    if (part.router_weight_use_ != first.router_weight_use_ ||
        part.gpt_oss_activation_.alpha != first.gpt_oss_activation_.alpha ||
        part.gpt_oss_activation_.limit != first.gpt_oss_activation_.limit) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Union: part %d differs from part 0 in its router-weight use or gpt-oss activation", p));
    }
    const std::vector<int> ids = part.expert_ids();
    for (int i = 0; i < static_cast<int>(ids.size()); ++i) order.push_back({ids[i], {p, i}});
  }
  std::sort(order.begin(), order.end());
  for (size_t i = 1; i < order.size(); ++i) {
    if (order[i].first == order[i - 1].first) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Union: expert %d is held by parts %d and %d; parts must be disjoint",
                          order[i].first, order[i - 1].second.first, order[i].second.first));
    }
  }
  ExpertSet set;
  set.kind_ = first.kind_;
  set.hidden_ = first.hidden_;
  set.intermediate_ = first.intermediate_;
  set.router_weight_use_ = first.router_weight_use_;
  set.gpt_oss_activation_ = first.gpt_oss_activation_;
  set.num_experts_ = static_cast<int>(order.size());
  set.first_expert_ = order.empty() ? 0 : order.front().first;
  if (first.seed_origin_.has_value()) {
    bool same = true;
    for (const ExpertSet& part : parts) {
      same = same && part.seed_origin_.has_value() &&
             part.seed_origin_->seed == first.seed_origin_->seed &&
             part.seed_origin_->layer == first.seed_origin_->layer;
    }
    if (same) set.seed_origin_ = first.seed_origin_;
  }
  const bool is_range =
      order.empty() || order.back().first - order.front().first + 1 == set.num_experts_;
  if (!is_range) {
    set.local_of_.assign(order.back().first + 1, -1);
    for (int i = 0; i < set.num_experts_; ++i) set.local_of_[order[i].first] = i;
  }
  for (const auto& [expert, where] : order) {
    ExpertSet& part = parts[where.first];
    switch (set.kind_) {
      case ExpertKind::kSwiGlu:
        set.weights_.push_back(std::move(part.weights_[where.second]));
        break;
      case ExpertKind::kFp8SwiGlu:
        set.fp8_weights_.push_back(std::move(part.fp8_weights_[where.second]));
        break;
      case ExpertKind::kGptOssMxfp4:
        set.gpt_oss_weights_.push_back(std::move(part.gpt_oss_weights_[where.second]));
        break;
      case ExpertKind::kIdentity:
        break;
    }
  }
  return set;
}

std::vector<int> ExpertSet::expert_ids() const {
  std::vector<int> ids;
  ids.reserve(num_experts_);
  if (local_of_.empty()) {
    for (int i = 0; i < num_experts_; ++i) ids.push_back(first_expert_ + i);
  } else {
    for (int e = 0; e < static_cast<int>(local_of_.size()); ++e) {
      if (local_of_[e] >= 0) ids.push_back(e);
    }
  }
  return ids;
}

int64_t ExpertSet::weight_bytes() const {
  int64_t bytes = 0;
  switch (kind_) {
    case ExpertKind::kIdentity:
      return 0;
    case ExpertKind::kSwiGlu:
      return static_cast<int64_t>(num_experts_) * 3 * hidden_ * intermediate_ *
             static_cast<int64_t>(sizeof(bf16_t));
    case ExpertKind::kFp8SwiGlu:
      for (const quant::Fp8SwiGluWeights& w : fp8_weights_) {
        bytes += w.gate.bytes() + w.up.bytes() + w.down.bytes();
      }
      return bytes;
    case ExpertKind::kGptOssMxfp4:
      for (const quant::GptOssExpertWeights& w : gpt_oss_weights_) {
        bytes += w.gate_up.bytes() + w.down.bytes() +
                 2 * static_cast<int64_t>(w.gate_up_bias.size() + w.down_bias.size());
      }
      return bytes;
  }
  return bytes;
}

absl::Status ExpertSet::Apply(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                              absl::Span<float> out) const {
  return ApplyWithScratch(expert_id, x, rows, out, nullptr);
}

absl::Status ExpertSet::Apply(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                              absl::Span<float> out, std::vector<float>& scratch) const {
  return ApplyWithScratch(expert_id, x, rows, out, &scratch);
}

absl::Status ExpertSet::ApplyWithScratch(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                                         absl::Span<float> out, std::vector<float>* scratch) const {
  if (!Owns(expert_id)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("expert_id: expected one of this set's experts [%s], got %d",
                        absl::StrJoin(expert_ids(), ", "), expert_id));
  }
  if (rows < 0)
    return absl::InvalidArgumentError(absl::StrFormat("rows: expected >= 0, got %d", rows));
  const int64_t n = rows * hidden_;
  if (static_cast<int64_t>(x.size()) < n || static_cast<int64_t>(out.size()) < n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("x/out: expected at least rows * H = %d * %d elements, got %d and %d", rows,
                        hidden_, x.size(), out.size()));
  }
  if (kind_ == ExpertKind::kIdentity) {
    std::copy(x.begin(), x.begin() + n, out.begin());
    return absl::OkStatus();
  }
  if (kind_ == ExpertKind::kFp8SwiGlu) {
    return quant::Fp8SwiGluForward(fp8_weights_[LocalIndex(expert_id)], x.first(n), rows, out);
  }
  if (kind_ == ExpertKind::kGptOssMxfp4) {
    return quant::GptOssExpertForward(gpt_oss_weights_[LocalIndex(expert_id)], x.first(n), rows,
                                      gpt_oss_activation_, out);
  }
  const SwiGluWeights& w = weights_[LocalIndex(expert_id)];
  const int64_t ih = intermediate_ * hidden_;
  // Without caller scratch, a buffer that is not value-initialized: the
  // weights are widened into it and sgemm with beta = 0 writes the rest
  // without reading it.
  const int64_t need = 3 * ih + rows * 2 * intermediate_;
  std::unique_ptr<float[]> owned;
  float* buf;
  if (scratch != nullptr) {
    if (static_cast<int64_t>(scratch->size()) < need) scratch->resize(need);
    buf = scratch->data();
  } else {
    owned.reset(new float[need]);
    buf = owned.get();
  }
  float* gate_up = buf;
  float* down = gate_up + 2 * ih;
  WidenAllCores(w, gate_up);
  SwiGluForward(x.data(), rows, hidden_, intermediate_, gate_up, down, down + ih, out.data());
  return absl::OkStatus();
}

absl::Status ExpertSet::ComputeWeightedSum(absl::Span<const float> x, absl::Span<const int32_t> ids,
                                           absl::Span<const float> weights, int64_t rows, int top_k,
                                           absl::Span<float> out, const StopCheck& stop) const {
  if (rows < 0)
    return absl::InvalidArgumentError(absl::StrFormat("rows: expected >= 0, got %d", rows));
  if (top_k < 1)
    return absl::InvalidArgumentError(absl::StrFormat("top_k: expected >= 1, got %d", top_k));
  const int64_t n = rows * hidden_;
  if (static_cast<int64_t>(x.size()) < n || static_cast<int64_t>(out.size()) < n) {
    return absl::InvalidArgumentError(
        absl::StrFormat("x/out: expected at least rows * H = %d * %d elements, got %d and %d", rows,
                        hidden_, x.size(), out.size()));
  }
  if (static_cast<int64_t>(ids.size()) < rows * top_k ||
      static_cast<int64_t>(weights.size()) < rows * top_k) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ids/weights: expected at least rows * top_k = %d * %d elements, got %d and %d", rows,
        top_k, ids.size(), weights.size()));
  }
  std::fill(out.begin(), out.begin() + n, 0.0f);

  if (kind_ == ExpertKind::kIdentity) {
    for (int64_t r = 0; r < rows; ++r) {
      float w = 0.0f;
      for (int k = 0; k < top_k; ++k) {
        if (Owns(ids[r * top_k + k])) w += weights[r * top_k + k];
      }
      if (w == 0.0f) continue;
      for (int64_t h = 0; h < hidden_; ++h) out[r * hidden_ + h] = w * x[r * hidden_ + h];
    }
    return absl::OkStatus();
  }

  // Group (row, k) entries by local expert: counting sort keeps rows in
  // ascending order inside each expert.
  std::vector<int64_t> start(num_experts_ + 1, 0);
  for (int64_t i = 0; i < rows * top_k; ++i) {
    if (Owns(ids[i])) ++start[LocalIndex(ids[i]) + 1];
  }
  for (int e = 0; e < num_experts_; ++e) start[e + 1] += start[e];
  std::vector<int64_t> entries(start[num_experts_]);  // flat index r * K + k
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < rows * top_k; ++i) {
      if (Owns(ids[i])) entries[fill[LocalIndex(ids[i])]++] = i;
    }
  }
  int64_t max_rows = 0;
  for (int e = 0; e < num_experts_; ++e) max_rows = std::max(max_rows, start[e + 1] - start[e]);
  if (max_rows == 0) return absl::OkStatus();

  // Scratch: widened weights of one expert (bf16 SwiGLU), gathered rows,
  // intermediate, result.
  const int64_t ih = intermediate_ * hidden_;
  const bool bf16 = kind_ == ExpertKind::kSwiGlu;
  const bool scale_input = router_weight_use_ == RouterWeightUse::kScalesInput;
  std::vector<float> w_gate_up(bf16 ? 2 * ih : 0), w_down(bf16 ? ih : 0);
  std::vector<float> xs(max_rows * hidden_), ys(max_rows * hidden_);
  std::vector<float> mid(bf16 ? max_rows * 2 * intermediate_ : 0);
  int64_t with_rows = 0;
  for (int e = 0; e < num_experts_; ++e) with_rows += start[e + 1] > start[e] ? 1 : 0;
  int64_t done = 0;
  for (int e = 0; e < num_experts_; ++e) {
    const int64_t m = start[e + 1] - start[e];
    if (m == 0) continue;
    if (ShouldStop(stop)) {
      return LocalStop(
          absl::StrCat("expert compute: after ", done, " of ", with_rows, " experts with rows"));
    }
    ++done;
    const int64_t* ent = entries.data() + start[e];
    for (int64_t j = 0; j < m; ++j) {
      const int64_t r = ent[j] / top_k;
      if (scale_input) {
        // Llama-4: e(w * x), the product in fp32.
        const float wt = weights[ent[j]];
        for (int64_t h = 0; h < hidden_; ++h) xs[j * hidden_ + h] = wt * x[r * hidden_ + h];
      } else {
        std::copy(x.begin() + r * hidden_, x.begin() + (r + 1) * hidden_, xs.begin() + j * hidden_);
      }
    }
    if (bf16) {
      const SwiGluWeights& w = weights_[e];
      Widen(w.gate, w_gate_up.data());
      Widen(w.up, w_gate_up.data() + ih);
      Widen(w.down, w_down.data());
      SwiGluForward(xs.data(), m, hidden_, intermediate_, w_gate_up.data(), w_down.data(),
                    mid.data(), ys.data());
    } else if (kind_ == ExpertKind::kFp8SwiGlu) {
      RETURN_IF_ERROR(quant::Fp8SwiGluForward(
          fp8_weights_[e], absl::MakeConstSpan(xs.data(), m * hidden_), m, absl::MakeSpan(ys)));
    } else {
      RETURN_IF_ERROR(quant::GptOssExpertForward(gpt_oss_weights_[e],
                                                 absl::MakeConstSpan(xs.data(), m * hidden_), m,
                                                 gpt_oss_activation_, absl::MakeSpan(ys)));
    }
    for (int64_t j = 0; j < m; ++j) {
      const int64_t r = ent[j] / top_k;
      const float wt = scale_input ? 1.0f : weights[ent[j]];
      float* dst = out.data() + r * hidden_;
      const float* src = ys.data() + j * hidden_;
      for (int64_t h = 0; h < hidden_; ++h) dst[h] += wt * src[h];
    }
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
