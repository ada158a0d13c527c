#include "core/routing_source.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <string_view>

#include "absl/random/discrete_distribution.h"
#include "absl/random/distributions.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/expert_load_file.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe_ep::core {
namespace {

using json = nlohmann::json;

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Seed of one stream: a hash of the source seed, a purpose tag and the
// coordinates (layer, step, ...).
uint64_t StreamSeed(uint64_t seed, uint64_t tag, std::initializer_list<int64_t> coords) {
  uint64_t h = SplitMix64(seed ^ SplitMix64(tag));
  for (int64_t c : coords) h = SplitMix64(h ^ static_cast<uint64_t>(c));
  return h;
}

constexpr uint64_t kTagSample = 1, kTagZipf = 2, kTagTracePerm = 3;

// A seeded permutation of [0, n).
std::vector<int> Permutation(uint64_t seed, int n) {
  std::vector<int> p(n);
  std::iota(p.begin(), p.end(), 0);
  std::mt19937_64 rng(seed);
  for (int i = n - 1; i > 0; --i) std::swap(p[i], p[absl::Uniform(rng, 0, i + 1)]);
  return p;
}

}  // namespace

absl::StatusOr<RoutingSource> RoutingSource::Create(const RoutingSourceOptions& options) {
  const int m = options.num_experts;
  const int k = options.top_k;
  if (m < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("num_experts: expected >= 1, got %d", m));
  }
  if (k < 1 || k > m) {
    return absl::InvalidArgumentError(
        absl::StrFormat("top_k: expected in [1, num_experts = %d], got %d", m, k));
  }
  RoutingSource src;
  src.options_ = options;
  src.exponent_ = options.zipf_exponent;
  const std::string& kind = options.kind;
  const std::string_view kv(kind);
  std::string file;
  if (kind == "uniform") {
    src.kind_ = Kind::kUniform;
  } else if (kind == "skewed" || kv.substr(0, 7) == "skewed:") {
    src.kind_ = Kind::kSkewed;
    if (kind.size() > 7 && !absl::SimpleAtod(kind.substr(7), &src.exponent_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("kind: expected skewed:<exponent>, got \"", kind, "\""));
    }
    if (!std::isfinite(src.exponent_) || src.exponent_ < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("zipf exponent: expected a finite value >= 0, got ", src.exponent_));
    }
  } else if (kv.substr(0, 5) == "load:" && kind.size() > 5) {
    src.kind_ = Kind::kLoad;
    file = kind.substr(5);
  } else if (kv.substr(0, 6) == "trace:" && kind.size() > 6) {
    src.kind_ = Kind::kTrace;
    file = kind.substr(6);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: expected uniform, skewed[:S], load:FILE or trace:FILE, got \"", kind, "\""));
  }

  if (src.kind_ == Kind::kLoad) {
    ASSIGN_OR_RETURN(const std::vector<std::vector<double>> rows, ReadExpertLoadFile(file));
    for (size_t l = 0; l < rows.size(); ++l) {
      const std::vector<double>& counts = rows[l];
      const size_t nf = counts.size();
      // Map the file's experts onto the model's M experts (see header).
      std::vector<double> w(m, 0.0);
      if (static_cast<size_t>(m) <= nf) {
        for (size_t e = 0; e < nf; ++e) w[e * m / nf] += counts[e];
      } else {
        std::vector<int> share(nf, 0);
        for (int i = 0; i < m; ++i) ++share[static_cast<size_t>(i) * nf / m];
        for (int i = 0; i < m; ++i) {
          const size_t e = static_cast<size_t>(i) * nf / m;
          w[i] = counts[e] / share[e];
        }
      }
      const double total = std::accumulate(w.begin(), w.end(), 0.0);
      if (total > 0) {
        const int nonzero =
            static_cast<int>(std::count_if(w.begin(), w.end(), [](double v) { return v > 0; }));
        if (nonzero < k) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "load file %s: layer %d has load on %d experts (mapped onto %d), fewer than "
              "top_k = %d",
              file, l, nonzero, m, k));
        }
        src.load_nonzero_layers_.push_back(static_cast<int>(l));
      }
      src.load_weights_.push_back(std::move(w));
    }
    if (src.load_nonzero_layers_.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("load file ", file, ": every layer has zero load"));
    }
  }

  if (src.kind_ == Kind::kTrace) {
    std::ifstream in(file);
    if (!in) return absl::NotFoundError(absl::StrCat("trace file ", file, ": cannot open"));
    std::string line;
    int64_t line_no = 0;
    int meta_experts = 0;
    int max_id = -1;
    while (std::getline(in, line)) {
      ++line_no;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = absl::StrFormat("trace file %s, line %d", file, line_no);
      json rec;
      try {
        rec = json::parse(line);
      } catch (const json::exception& e) {
        return absl::DataLossError(absl::StrCat(where, ": not JSON: ", e.what()));
      }
      if (!rec.is_object()) return absl::DataLossError(absl::StrCat(where, ": not an object"));
      const std::string type = rec.value("type", std::string("route"));
      if (type == "meta") {
        if (rec.contains("top_k") && rec["top_k"].is_number_integer()) {
          src.trace_top_k_ = rec["top_k"].get<int>();
        }
        if (rec.contains("num_experts") && rec["num_experts"].is_number_integer()) {
          meta_experts = rec["num_experts"].get<int>();
        }
        continue;
      }
      if (type != "route") continue;
      if (!rec.contains("topk_ids") || !rec["topk_ids"].is_array() ||
          !rec.contains("topk_weights") || !rec["topk_weights"].is_array() ||
          !rec.contains("token_idx") || !rec["token_idx"].is_number_integer()) {
        return absl::DataLossError(
            absl::StrCat(where, ": expected token_idx, topk_ids and topk_weights"));
      }
      const json& ids = rec["topk_ids"];
      const json& ws = rec["topk_weights"];
      if (src.trace_top_k_ == 0) src.trace_top_k_ = static_cast<int>(ids.size());
      if (static_cast<int>(ids.size()) != src.trace_top_k_ ||
          static_cast<int>(ws.size()) != src.trace_top_k_) {
        return absl::DataLossError(
            absl::StrFormat("%s: expected %d topk_ids and topk_weights, got %d and %d", where,
                            src.trace_top_k_, ids.size(), ws.size()));
      }
      const int64_t token_idx = rec["token_idx"].get<int64_t>();
      if (token_idx == 0) src.trace_steps_.emplace_back();
      if (src.trace_steps_.empty() || token_idx != src.trace_steps_.back().num_tokens) {
        return absl::DataLossError(absl::StrFormat(
            "%s: token_idx: expected %d, got %d", where,
            src.trace_steps_.empty() ? 0 : src.trace_steps_.back().num_tokens, token_idx));
      }
      TraceStep& step = src.trace_steps_.back();
      for (int j = 0; j < src.trace_top_k_; ++j) {
        if (!ids[j].is_number_integer() || ids[j].get<int64_t>() < 0 ||
            ids[j].get<int64_t>() > (1 << 30) || !ws[j].is_number()) {
          return absl::DataLossError(
              absl::StrCat(where, ": expected ids >= 0 and numeric weights"));
        }
        const int32_t id = ids[j].get<int32_t>();
        for (int i = 0; i < j; ++i) {
          if (step.ids[step.ids.size() - j + i] == id) {
            return absl::DataLossError(absl::StrFormat("%s: expert %d appears twice", where, id));
          }
        }
        step.ids.push_back(id);
        step.weights.push_back(ws[j].get<float>());
        max_id = std::max(max_id, static_cast<int>(id));
      }
      ++step.num_tokens;
    }
    if (src.trace_steps_.empty()) {
      return absl::DataLossError(absl::StrCat("trace file ", file, ": no route records"));
    }
    src.trace_num_experts_ = std::max(meta_experts, max_id + 1);
    if (src.trace_top_k_ < k) {
      return absl::InvalidArgumentError(
          absl::StrFormat("trace file %s: routes are top-%d, fewer than the model's top_k = %d",
                          file, src.trace_top_k_, k));
    }
    // Ids are distinct per record, so the trace has >= trace_top_k_ >= K experts.
  }
  return src;
}

std::vector<double> RoutingSource::LayerWeights(int layer) const {
  const int m = options_.num_experts;
  std::vector<double> w(m, 1.0);
  if (kind_ == Kind::kSkewed) {
    const std::vector<int> order = Permutation(StreamSeed(options_.seed, kTagZipf, {layer}), m);
    for (int p = 0; p < m; ++p) w[order[p]] = std::pow(1.0 + p, -exponent_);
  } else if (kind_ == Kind::kLoad) {
    const int nl = static_cast<int>(load_weights_.size());
    int file_layer;
    if (layer < nl && std::find(load_nonzero_layers_.begin(), load_nonzero_layers_.end(), layer) !=
                          load_nonzero_layers_.end()) {
      file_layer = layer;
    } else {
      file_layer = load_nonzero_layers_[layer % load_nonzero_layers_.size()];
    }
    w = load_weights_[file_layer];
  }
  return w;
}

std::vector<int64_t> RoutingSource::TokensPerRank(int64_t step, int world) const {
  if (trace_steps_.empty() || world < 1 || step < 0) return {};
  const int64_t n = trace_steps_[step % num_steps()].num_tokens;
  std::vector<int64_t> counts(world, n / world);
  for (int r = 0; r < n % world; ++r) ++counts[r];
  return counts;
}

void RoutingSource::GenerateTrace(int layer, int64_t step, int rank, int world, int64_t num_tokens,
                                  absl::Span<int32_t> ids, absl::Span<float> weights) const {
  const int m = options_.num_experts;
  const int k = options_.top_k;
  const int kt = trace_top_k_;
  const int nt = trace_num_experts_;
  const TraceStep& s = trace_steps_[step % num_steps()];
  const std::vector<int64_t> counts = TokensPerRank(step, world);
  int64_t offset = 0;
  for (int r = 0; r < rank; ++r) offset += counts[r];
  std::vector<int> perm;
  if (layer > 0) perm = Permutation(StreamSeed(options_.seed, kTagTracePerm, {layer}), m);
  for (int64_t j = 0; j < num_tokens; ++j) {
    const int64_t t = (offset + j) % s.num_tokens;
    int32_t* out_ids = ids.data() + j * k;
    float* out_w = weights.data() + j * k;
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) {
      const int64_t e = s.ids[t * kt + i];
      int32_t mapped;
      if (m >= nt) {
        mapped = static_cast<int32_t>(e * m / nt);
      } else {
        mapped = static_cast<int32_t>(e % m);
        // Resolve a collision with an earlier id of this token (m >= k, so a
        // free id exists).
        while (std::find(out_ids, out_ids + i, mapped) != out_ids + i) mapped = (mapped + 1) % m;
      }
      out_ids[i] = mapped;
      out_w[i] = s.weights[t * kt + i];
      sum += out_w[i];
    }
    for (int i = 0; i < k; ++i) out_w[i] = sum > 0 ? out_w[i] / sum : 1.0f / k;
    if (!perm.empty()) {
      for (int i = 0; i < k; ++i) out_ids[i] = perm[out_ids[i]];
    }
  }
}

absl::Status RoutingSource::Generate(int layer, int64_t step, int rank, int world,
                                     int64_t num_tokens, absl::Span<int32_t> topk_ids,
                                     absl::Span<float> topk_weights) const {
  const int k = options_.top_k;
  if (layer < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("layer: expected >= 0, got %d", layer));
  }
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("step: expected >= 0, got %d", step));
  }
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank: expected in [0, world = %d), got %d", world, rank));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_tokens: expected >= 0, got %d", num_tokens));
  }
  if (static_cast<int64_t>(topk_ids.size()) != num_tokens * k ||
      static_cast<int64_t>(topk_weights.size()) != num_tokens * k) {
    return absl::InvalidArgumentError(
        absl::StrFormat("topk_ids/topk_weights: expected T * K = %d * %d elements, got %d and %d",
                        num_tokens, k, topk_ids.size(), topk_weights.size()));
  }
  if (kind_ == Kind::kTrace) {
    GenerateTrace(layer, step, rank, world, num_tokens, topk_ids, topk_weights);
    return absl::OkStatus();
  }

  const int m = options_.num_experts;
  const std::vector<double> w = LayerWeights(layer);
  absl::discrete_distribution<int> pick(w.begin(), w.end());
  std::mt19937_64 rng(StreamSeed(options_.seed, kTagSample, {layer, step, rank, world}));
  std::vector<double> logits(k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    int32_t* ids = topk_ids.data() + t * k;
    for (int i = 0; i < k; ++i) {
      auto taken = [&](int e) { return std::find(ids, ids + i, e) != ids + i; };
      int chosen = -1;
      // Rejection of already drawn experts keeps each draw proportional to
      // the remaining weights; a heavily skewed tail falls back to a scan.
      for (int attempt = 0; attempt < 32 && chosen < 0; ++attempt) {
        const int e = pick(rng);
        if (!taken(e)) chosen = e;
      }
      if (chosen < 0) {
        double rest = 0;
        for (int e = 0; e < m; ++e) rest += taken(e) ? 0.0 : w[e];
        double u = absl::Uniform(rng, 0.0, rest);
        for (int e = 0; e < m; ++e) {
          if (taken(e) || w[e] <= 0) continue;
          chosen = e;  // the last eligible expert absorbs rounding
          u -= w[e];
          if (u < 0) break;
        }
      }
      ids[i] = chosen;
    }
    for (int i = 0; i < k; ++i) {
      logits[i] = -std::log(-std::log(absl::Uniform(absl::IntervalOpenOpen, rng, 0.0, 1.0)));
    }
    std::sort(logits.begin(), logits.end(), std::greater<double>());
    double sum = 0;
    for (int i = 0; i < k; ++i) sum += std::exp(logits[i] - logits[0]);
    for (int i = 0; i < k; ++i) {
      topk_weights[t * k + i] = static_cast<float>(std::exp(logits[i] - logits[0]) / sum);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Routing> RoutingSource::Generate(int layer, int64_t step, int rank, int world,
                                                int64_t num_tokens) const {
  Routing r;
  r.num_tokens = std::max<int64_t>(num_tokens, 0);
  r.top_k = options_.top_k;
  r.topk_ids.resize(r.num_tokens * r.top_k);
  r.topk_weights.resize(r.num_tokens * r.top_k);
  RETURN_IF_ERROR(Generate(layer, step, rank, world, num_tokens, absl::MakeSpan(r.topk_ids),
                           absl::MakeSpan(r.topk_weights)));
  return r;
}

}  // namespace moe_ep::core
