#include "core/routing_source.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe_ep::core {
namespace routing_source_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string DataDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  return env != nullptr ? env : MOE_EP_DATA_DIR;
}
std::string TracePath() { return DataDir() + "/traces/qwen15moe_vllm_topk_routes.jsonl"; }
std::string LoadPath() {
  return DataDir() + "/traces/sglang_ep_statistics_deepseek/prefill_in4096.json";
}

#define SKIP_IF_MISSING(path) \
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "data file missing: " << (path)

RoutingSource Make(const std::string& kind, int m, int k, uint64_t seed = 1) {
  auto s = RoutingSource::Create({kind, m, k, seed, 1.0});
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

// Every row: K distinct ids in [0, M), weights > 0, descending, summing to 1.
void CheckWellFormed(const Routing& r, int m) {
  for (int64_t t = 0; t < r.num_tokens; ++t) {
    std::set<int32_t> seen;
    double sum = 0;
    for (int k = 0; k < r.top_k; ++k) {
      const int32_t id = r.topk_ids[t * r.top_k + k];
      const float w = r.topk_weights[t * r.top_k + k];
      EXPECT_GE(id, 0);
      EXPECT_LT(id, m);
      EXPECT_TRUE(seen.insert(id).second) << "duplicate id " << id << " in token " << t;
      EXPECT_GT(w, 0.0f);
      if (k > 0) {
        EXPECT_LE(w, r.topk_weights[t * r.top_k + k - 1]);
      }
      sum += w;
    }
    EXPECT_NEAR(sum, 1.0, 1e-5);
  }
}

TEST(RoutingSource, UniformIsWellFormedDeterministicAndFlat) {
  RoutingSource src = Make("uniform", 64, 6, 42);
  auto a = src.Generate(3, 10, 1, 4, 2000);
  ASSERT_TRUE(a.ok()) << a.status();
  CheckWellFormed(*a, 64);
  auto again = src.Generate(3, 10, 1, 4, 2000);
  EXPECT_EQ(a->topk_ids, again->topk_ids);
  EXPECT_EQ(a->topk_weights, again->topk_weights);
  // A second source with the same options agrees (another process would too).
  EXPECT_EQ(Make("uniform", 64, 6, 42).Generate(3, 10, 1, 4, 2000)->topk_ids, a->topk_ids);
  EXPECT_NE(src.Generate(3, 10, 2, 4, 2000)->topk_ids, a->topk_ids);  // rank
  EXPECT_NE(src.Generate(3, 11, 1, 4, 2000)->topk_ids, a->topk_ids);  // step
  EXPECT_NE(src.Generate(4, 10, 1, 4, 2000)->topk_ids, a->topk_ids);  // layer
  EXPECT_NE(Make("uniform", 64, 6, 43).Generate(3, 10, 1, 4, 2000)->topk_ids, a->topk_ids);
  // 12000 draws over 64 experts: mean 187.5, sd ~13; allow 5 sd.
  std::vector<int> freq(64, 0);
  for (int32_t id : a->topk_ids) ++freq[id];
  for (int e = 0; e < 64; ++e) EXPECT_NEAR(freq[e], 187.5, 66) << "expert " << e;
  EXPECT_FALSE(src.prescribes_token_counts());
  EXPECT_TRUE(src.TokensPerRank(0, 4).empty());
  EXPECT_EQ(src.num_steps(), 0);
}

TEST(RoutingSource, AllExpertsSelectedWhenKEqualsM) {
  RoutingSource src = Make("skewed:3", 8, 8);  // heavy tail exercises the scan fallback
  auto r = src.Generate(0, 0, 0, 1, 50);
  ASSERT_TRUE(r.ok());
  CheckWellFormed(*r, 8);
}

TEST(RoutingSource, SkewedFollowsZipfWithPerLayerPermutation) {
  // K = 1: the single draw is exactly proportional to 1 / (p + 1)^s.
  const double s = 1.2;
  constexpr int kM = 16, kT = 40000;
  RoutingSource src = Make("skewed:1.2", kM, 1, 5);
  std::vector<std::vector<int>> freq(2, std::vector<int>(kM, 0));
  for (int layer = 0; layer < 2; ++layer) {
    auto r = src.Generate(layer, 0, 0, 1, kT);
    ASSERT_TRUE(r.ok());
    for (int32_t id : r->topk_ids) ++freq[layer][id];
  }
  double norm = 0;
  for (int p = 0; p < kM; ++p) norm += std::pow(p + 1.0, -s);
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<int> sorted = freq[layer];
    std::sort(sorted.rbegin(), sorted.rend());
    for (int p = 0; p < 4; ++p) {
      const double expect = std::pow(p + 1.0, -s) / norm;
      EXPECT_NEAR(sorted[p] / double{kT}, expect, 0.01) << "layer " << layer << " position " << p;
    }
  }
  const int hot0 = std::max_element(freq[0].begin(), freq[0].end()) - freq[0].begin();
  const int hot1 = std::max_element(freq[1].begin(), freq[1].end()) - freq[1].begin();
  EXPECT_NE(hot0, hot1) << "layers permute expert popularity";
  auto bad = RoutingSource::Create({"skewed:-1", 8, 2, 0, 1.0});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  auto junk = RoutingSource::Create({"skewed:abc", 8, 2, 0, 1.0});
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RoutingSource, TraceReplaysTheLoggedSteps) {
  SKIP_IF_MISSING(TracePath());
  RoutingSource src = Make("trace:" + TracePath(), 60, 4);
  EXPECT_TRUE(src.prescribes_token_counts());
  EXPECT_EQ(src.num_steps(), 105);
  // Step 0 is the 65-token prefill, then 25-token decode steps.
  EXPECT_THAT(src.TokensPerRank(0, 1), ElementsAre(65));
  EXPECT_THAT(src.TokensPerRank(0, 4), ElementsAre(17, 16, 16, 16));
  EXPECT_THAT(src.TokensPerRank(1, 4), ElementsAre(7, 6, 6, 6));
  EXPECT_THAT(src.TokensPerRank(105, 4), ElementsAre(17, 16, 16, 16));  // wraps

  // First token of the file: ids [39, 40, 46, 30], weights
  // [0.0504, 0.0381, 0.0369, 0.0358] renormalised by their sum 0.1612.
  auto r = src.Generate(0, 0, 0, 1, 65);
  ASSERT_TRUE(r.ok()) << r.status();
  CheckWellFormed(*r, 60);
  EXPECT_THAT(std::vector<int32_t>(r->topk_ids.begin(), r->topk_ids.begin() + 4),
              ElementsAre(39, 40, 46, 30));
  EXPECT_NEAR(r->topk_weights[0], 0.0504 / 0.1612, 1e-5);
  EXPECT_NEAR(r->topk_weights[3], 0.0358 / 0.1612, 1e-5);

  // Rank 1 of 4 at step 1 starts at logged token 7 of that step: read it from
  // the file independently.
  std::ifstream in(TracePath());
  std::string line;
  int steps_seen = 0;
  std::vector<int32_t> want;
  while (std::getline(in, line)) {
    const auto rec = nlohmann::json::parse(line);
    if (rec["type"] != "route") continue;
    if (rec["token_idx"] == 0) ++steps_seen;
    if (steps_seen == 2 && rec["token_idx"] == 7) {
      want = rec["topk_ids"].get<std::vector<int32_t>>();
      break;
    }
  }
  ASSERT_EQ(want.size(), 4u);
  auto r1 = src.Generate(0, 1, 1, 4, 6);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(std::vector<int32_t>(r1->topk_ids.begin(), r1->topk_ids.begin() + 4), want);

  // Layer 1 renames experts through a permutation: same multiset sizes,
  // different ids somewhere.
  auto l1 = src.Generate(1, 0, 0, 1, 65);
  ASSERT_TRUE(l1.ok());
  CheckWellFormed(*l1, 60);
  EXPECT_NE(l1->topk_ids, r->topk_ids);
  EXPECT_EQ(l1->topk_weights, r->topk_weights);
}

TEST(RoutingSource, TraceMapsOntoOtherModels) {
  SKIP_IF_MISSING(TracePath());
  // Top-2 of the same file: first two ids, weights renormalised.
  auto top2 = Make("trace:" + TracePath(), 60, 2).Generate(0, 0, 0, 1, 1);
  ASSERT_TRUE(top2.ok());
  EXPECT_THAT(top2->topk_ids, ElementsAre(39, 40));
  EXPECT_NEAR(top2->topk_weights[0], 0.0504 / (0.0504 + 0.0381), 1e-5);
  // 120 experts: e -> 2e.
  auto wide = Make("trace:" + TracePath(), 120, 4).Generate(0, 0, 0, 1, 1);
  ASSERT_TRUE(wide.ok());
  EXPECT_THAT(wide->topk_ids, ElementsAre(78, 80, 92, 60));
  // 8 experts: e mod 8 with collisions moved on: 39->7, 40->0, 46->6, 30->6 taken -> 7 taken -> 0
  // taken -> 1.
  auto narrow = Make("trace:" + TracePath(), 8, 4).Generate(0, 0, 0, 1, 65);
  ASSERT_TRUE(narrow.ok());
  EXPECT_THAT(std::vector<int32_t>(narrow->topk_ids.begin(), narrow->topk_ids.begin() + 4),
              ElementsAre(7, 0, 6, 1));
  CheckWellFormed(*narrow, 8);
  // The model wants top-8 but the log has top-4.
  auto too_many = RoutingSource::Create({"trace:" + TracePath(), 256, 8, 0, 1.0});
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_many.status().message(), HasSubstr("top-4, fewer than the model's top_k = 8"));
}

TEST(RoutingSource, LoadFollowsTheLayerCounts) {
  SKIP_IF_MISSING(LoadPath());
  std::ifstream in(LoadPath());
  const auto doc = nlohmann::json::parse(in);
  const std::vector<double> counts = doc["logical_count"][3].get<std::vector<double>>();
  ASSERT_EQ(counts.size(), 256u);
  double total = 0;
  for (double c : counts) total += c;

  // K = 1: sampled frequencies follow counts / total (total variation < 0.02
  // for 100k draws; the hottest expert matches).
  constexpr int kT = 100000;
  auto r = Make("load:" + LoadPath(), 256, 1, 9).Generate(3, 0, 0, 1, kT);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<double> freq(256, 0);
  for (int32_t id : r->topk_ids) freq[id] += 1.0 / kT;
  double tv = 0;
  for (int e = 0; e < 256; ++e) tv += 0.5 * std::abs(freq[e] - counts[e] / total);
  EXPECT_LT(tv, 0.02);
  const int hot_file = std::max_element(counts.begin(), counts.end()) - counts.begin();
  const int hot_drawn = std::max_element(freq.begin(), freq.end()) - freq.begin();
  EXPECT_EQ(hot_drawn, hot_file);
  EXPECT_NEAR(freq[hot_file], counts[hot_file] / total, 0.003);

  // K = 8, DeepSeek-V3 shape: well formed, zero-count experts never drawn.
  auto r8 = Make("load:" + LoadPath(), 256, 8, 9).Generate(3, 0, 0, 1, 4000);
  ASSERT_TRUE(r8.ok());
  CheckWellFormed(*r8, 256);
  for (int32_t id : r8->topk_ids) EXPECT_GT(counts[id], 0.0) << "expert " << id;

  // 64 model experts: file experts 4m..4m+3 fold into m.
  auto r64 = Make("load:" + LoadPath(), 64, 1, 9).Generate(3, 0, 0, 1, kT);
  ASSERT_TRUE(r64.ok());
  std::vector<double> f64(64, 0);
  for (int32_t id : r64->topk_ids) f64[id] += 1.0 / kT;
  double tv64 = 0;
  for (int m = 0; m < 64; ++m) {
    const double p =
        (counts[4 * m] + counts[4 * m + 1] + counts[4 * m + 2] + counts[4 * m + 3]) / total;
    tv64 += 0.5 * std::abs(f64[m] - p);
  }
  EXPECT_LT(tv64, 0.02);
}

TEST(RoutingSource, LoadMapsDenseLayersToMoeLayers) {
  SKIP_IF_MISSING(LoadPath());
  RoutingSource src = Make("load:" + LoadPath(), 256, 8, 2);
  // File layers 0..2 are dense (zero load): model layer 0 maps to the first
  // nonzero layer (3) by modulo over the 58 MoE layers; layer 61 -> 61 % 58 = 3
  // -> the fourth MoE layer (file layer 6). Layers 3..60 map to themselves.
  auto l0 = src.Generate(0, 0, 0, 1, 100);
  ASSERT_TRUE(l0.ok());
  CheckWellFormed(*l0, 256);
  // The layer is also part of the sampling seed, so compare the mapping
  // through the hottest expert of K = 1 draws.
  RoutingSource one = Make("load:" + LoadPath(), 256, 1, 2);
  auto hot = [&](int layer) {
    auto r = one.Generate(layer, 0, 0, 1, 20000);
    std::vector<int> f(256, 0);
    for (int32_t id : r->topk_ids) ++f[id];
    return static_cast<int>(std::max_element(f.begin(), f.end()) - f.begin());
  };
  std::ifstream in(LoadPath());
  const auto doc = nlohmann::json::parse(in);
  auto file_hot = [&](int file_layer) {
    const auto c = doc["logical_count"][file_layer].get<std::vector<double>>();
    return static_cast<int>(std::max_element(c.begin(), c.end()) - c.begin());
  };
  EXPECT_EQ(hot(0), file_hot(3));
  EXPECT_EQ(hot(61), file_hot(6));
  EXPECT_EQ(hot(40), file_hot(40));
}

TEST(RoutingSource, CreateErrors) {
  auto kind = RoutingSource::Create({"zipfian", 8, 2, 0, 1.0});
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(kind.status().message(), HasSubstr("zipfian"));
  auto m = RoutingSource::Create({"uniform", 0, 2, 0, 1.0});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("num_experts"));
  auto k = RoutingSource::Create({"uniform", 4, 5, 0, 1.0});
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(k.status().message(), HasSubstr("top_k"));
  auto missing = RoutingSource::Create({"trace:/nonexistent/trace.jsonl", 8, 2, 0, 1.0});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  auto missing_load = RoutingSource::Create({"load:/nonexistent/load.json", 8, 2, 0, 1.0});
  EXPECT_EQ(missing_load.status().code(), absl::StatusCode::kNotFound);

  const auto dir = std::filesystem::path(::testing::TempDir());
  std::ofstream(dir / "bad_load.json") << R"({"logical_count": [[1, 2], [3]]})";
  auto bad_load = RoutingSource::Create({"load:" + (dir / "bad_load.json").string(), 2, 1, 0, 1});
  EXPECT_EQ(bad_load.status().code(), absl::StatusCode::kDataLoss);
  std::ofstream(dir / "thin_load.json") << R"({"logical_count": [[0, 5, 0, 0]]})";
  auto thin = RoutingSource::Create({"load:" + (dir / "thin_load.json").string(), 4, 2, 0, 1});
  EXPECT_EQ(thin.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(thin.status().message(), HasSubstr("load on 1 experts"));
  std::ofstream(dir / "bad_trace.jsonl")
      << R"({"type":"route","token_idx":0,"topk_ids":[1,2],"topk_weights":[0.5,0.5]})"
      << "\n"
      << R"({"type":"route","token_idx":2,"topk_ids":[1,2],"topk_weights":[0.5,0.5]})"
      << "\n";
  auto seq = RoutingSource::Create({"trace:" + (dir / "bad_trace.jsonl").string(), 4, 2, 0, 1});
  EXPECT_EQ(seq.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(seq.status().message(), HasSubstr("line 2: token_idx: expected 1, got 2"));
  std::ofstream(dir / "dup_trace.jsonl")
      << R"({"type":"route","token_idx":0,"topk_ids":[3,3],"topk_weights":[0.5,0.5]})"
      << "\n";
  auto dup = RoutingSource::Create({"trace:" + (dir / "dup_trace.jsonl").string(), 4, 2, 0, 1});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(dup.status().message(), HasSubstr("expert 3 appears twice"));
  std::ofstream(dir / "not_json.jsonl") << "{oops\n";
  auto nj = RoutingSource::Create({"trace:" + (dir / "not_json.jsonl").string(), 4, 2, 0, 1});
  EXPECT_EQ(nj.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(nj.status().message(), HasSubstr("line 1: not JSON"));
}

TEST(RoutingSource, GenerateErrors) {
  RoutingSource src = Make("uniform", 8, 2);
  std::vector<int32_t> ids(4);
  std::vector<float> w(4);
  EXPECT_EQ(src.Generate(-1, 0, 0, 1, 2, absl::MakeSpan(ids), absl::MakeSpan(w)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(src.Generate(0, -1, 0, 1, 2, absl::MakeSpan(ids), absl::MakeSpan(w)).code(),
            absl::StatusCode::kInvalidArgument);
  auto rank = src.Generate(0, 0, 2, 2, 2, absl::MakeSpan(ids), absl::MakeSpan(w));
  EXPECT_EQ(rank.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rank.message(), HasSubstr("world = 2"));
  auto size = src.Generate(0, 0, 0, 1, 3, absl::MakeSpan(ids), absl::MakeSpan(w));
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(size.message(), HasSubstr("T * K = 3 * 2"));
  EXPECT_EQ(src.Generate(0, 0, 0, 1, -1).status().code(), absl::StatusCode::kInvalidArgument);
  auto zero = src.Generate(0, 0, 0, 1, 0);
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero->topk_ids.empty());
}

}  // namespace
}  // namespace routing_source_test
}  // namespace moe_ep::core
