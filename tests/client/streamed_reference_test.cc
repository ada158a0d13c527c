#include "client/streamed_reference.h"

#include <cblas.h>

#include <random>
#include <vector>

#include "core/moe_reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

constexpr int kExperts = 10;
constexpr int64_t kHidden = 32;
constexpr int64_t kInter = 16;
constexpr int kTopK = 3;
constexpr uint64_t kSeed = 11;
constexpr int kLayer = 2;

struct Inputs {
  int64_t num_tokens = 0;
  std::vector<core::bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Seeded tokens whose ids are drawn from `allowed` (distinct per token), with
// one slot per token set to -1 every third token (no expert).
Inputs MakeInputs(int64_t num_tokens, const std::vector<int32_t>& allowed) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.1f, 1.0f);
  Inputs in;
  in.num_tokens = num_tokens;
  for (int64_t i = 0; i < num_tokens * kHidden; ++i)
    in.hidden.push_back(core::FloatToBf16(normal(rng)));
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<int32_t> pool = allowed;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int k = 0; k < kTopK; ++k) {
      in.ids.push_back(k == 0 && t % 3 == 0 ? -1 : pool[k]);
      in.weights.push_back(unit(rng));
    }
  }
  return in;
}

ExpertChunkFactory SwiGluFactory(std::vector<std::pair<int, int>>* made = nullptr) {
  return [made](int first, int count) -> absl::StatusOr<core::ExpertSet> {
    if (made != nullptr) made->emplace_back(first, count);
    return core::ExpertSet::GenerateSwiGlu(kSeed, kLayer, first, count, kHidden, kInter);
  };
}

std::vector<float> AllAtOnce(const Inputs& in) {
  auto all = core::ExpertSet::GenerateSwiGlu(kSeed, kLayer, 0, kExperts, kHidden, kInter);
  EXPECT_TRUE(all.ok());
  std::vector<float> ref(in.num_tokens * kHidden);
  EXPECT_TRUE(core::DenseMoeReference({&*all}, kExperts, in.hidden, in.ids, in.weights,
                                      in.num_tokens, kTopK, absl::MakeSpan(ref))
                  .ok());
  return ref;
}

TEST(StreamedMoeReference, BitIdenticalToAllExpertsAtOnceForEveryChunkSize) {
  const Inputs in = MakeInputs(40, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
  const std::vector<float> ref = AllAtOnce(in);
  for (int chunk : {1, 3, 4, 10, 16}) {
    std::vector<float> out(ref.size(), -7.0f);  // overwritten
    auto stats = StreamedMoeReference(SwiGluFactory(), kExperts, chunk, kHidden, in.hidden, in.ids,
                                      in.weights, in.num_tokens, kTopK, absl::MakeSpan(out));
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(out, ref) << "chunk " << chunk;
    EXPECT_EQ(stats->chunks_made, (kExperts + chunk - 1) / chunk);
    EXPECT_EQ(stats->chunks_skipped, 0);
    // One chunk of min(chunk, 10) experts x 3 x 16 x 32 x 2 bytes.
    EXPECT_EQ(stats->max_chunk_bytes, std::min(chunk, kExperts) * 3 * 16 * 32 * 2);
  }
}

// Experts large enough that generation and widening run on several threads
// (core/parallel_for.h) and the Apply scratch is reused across experts and
// chunks: still the same bits as DenseMoeReference with all experts held.
TEST(StreamedMoeReference, BitIdenticalWithLargeExpertsOnAllCores) {
  constexpr int kBigExperts = 6;
  constexpr int64_t kBigHidden = 512, kBigInter = 768;  // 3 * I * H = 1.18 M per expert
  constexpr int kBigTopK = 2;
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> expert(0, kBigExperts - 1);
  const int64_t tokens = 24;
  std::vector<core::bf16_t> hidden(tokens * kBigHidden);
  for (auto& h : hidden) h = core::FloatToBf16(normal(rng));
  std::vector<int32_t> ids(tokens * kBigTopK);
  std::vector<float> weights(tokens * kBigTopK);
  for (int64_t t = 0; t < tokens; ++t) {
    ids[t * 2] = expert(rng);
    ids[t * 2 + 1] = (ids[t * 2] + 1 + t % (kBigExperts - 1)) % kBigExperts;  // distinct
    weights[t * 2] = 0.75f;
    weights[t * 2 + 1] = 0.25f;
  }
  auto all = core::ExpertSet::GenerateSwiGlu(kSeed, kLayer, 0, kBigExperts, kBigHidden, kBigInter);
  ASSERT_TRUE(all.ok());
  std::vector<float> ref(tokens * kBigHidden);
  ASSERT_TRUE(core::DenseMoeReference({&*all}, kBigExperts, hidden, ids, weights, tokens, kBigTopK,
                                      absl::MakeSpan(ref))
                  .ok());
  const ExpertChunkFactory factory = [](int first, int count) -> absl::StatusOr<core::ExpertSet> {
    return core::ExpertSet::GenerateSwiGlu(kSeed, kLayer, first, count, kBigHidden, kBigInter);
  };
  std::vector<float> out(ref.size());
  auto stats = StreamedMoeReference(factory, kBigExperts, 4, kBigHidden, hidden, ids, weights,
                                    tokens, kBigTopK, absl::MakeSpan(out));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(out, ref);
  EXPECT_EQ(stats->chunks_made, 2);
  EXPECT_EQ(stats->blas_threads, openblas_get_num_threads());
  EXPECT_GE(stats->blas_threads, 1);
}

TEST(StreamedMoeReference, SkipsChunksNoTokenSelects) {
  // Ids only in {1, 2, 9}: with chunks of 4, [4, 8) is never made.
  const Inputs in = MakeInputs(12, {1, 2, 9});
  std::vector<std::pair<int, int>> made;
  std::vector<float> out(in.num_tokens * kHidden);
  auto stats = StreamedMoeReference(SwiGluFactory(&made), kExperts, 4, kHidden, in.hidden, in.ids,
                                    in.weights, in.num_tokens, kTopK, absl::MakeSpan(out));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(made, (std::vector<std::pair<int, int>>{{0, 4}, {8, 2}}));
  EXPECT_EQ(stats->chunks_made, 2);
  EXPECT_EQ(stats->chunks_skipped, 1);
  EXPECT_EQ(stats->max_chunk_bytes, 4 * 3 * 16 * 32 * 2);
  EXPECT_EQ(out, AllAtOnce(in));
}

TEST(StreamedMoeReference, IdentityExpertsSumWeightsTimesInput) {
  // Token 0: ids {2, -1}, weights {0.25, 0.5}: out = 0.25 x. Token 1: ids
  // {0, 7}, weights {0.5, 0.25}: out = 0.75 x.
  const std::vector<core::bf16_t> x = {core::FloatToBf16(1.0f), core::FloatToBf16(-2.0f),
                                       core::FloatToBf16(4.0f), core::FloatToBf16(8.0f)};
  const std::vector<int32_t> ids = {2, -1, 0, 7};
  const std::vector<float> w = {0.25f, 0.5f, 0.5f, 0.25f};
  std::vector<float> out(4);
  auto identity = [](int first, int count) -> absl::StatusOr<core::ExpertSet> {
    return core::ExpertSet::Identity(first, count, 2);
  };
  auto stats = StreamedMoeReference(identity, 8, 3, 2, x, ids, w, 2, 2, absl::MakeSpan(out));
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(out, (std::vector<float>{0.25f, -0.5f, 3.0f, 6.0f}));
  EXPECT_EQ(stats->chunks_made, 2);  // [0, 3) and [6, 8); [3, 6) skipped
  EXPECT_EQ(stats->chunks_skipped, 1);
  EXPECT_EQ(stats->max_chunk_bytes, 0);
}

TEST(StreamedMoeReference, ZeroTokensGiveNoChunks) {
  std::vector<float> out;
  auto stats = StreamedMoeReference(SwiGluFactory(), kExperts, 4, kHidden, {}, {}, {}, 0, kTopK,
                                    absl::MakeSpan(out));
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->chunks_made, 0);
  EXPECT_EQ(stats->chunks_skipped, 3);
}

TEST(StreamedMoeReference, RejectsBadSizes) {
  const Inputs in = MakeInputs(4, {0, 1, 2, 3});
  std::vector<float> out(in.num_tokens * kHidden);
  auto bad_chunk = StreamedMoeReference(SwiGluFactory(), kExperts, 0, kHidden, in.hidden, in.ids,
                                        in.weights, in.num_tokens, kTopK, absl::MakeSpan(out));
  EXPECT_EQ(bad_chunk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_chunk.status().message(), HasSubstr("chunk_experts"));
  auto bad_tokens = StreamedMoeReference(SwiGluFactory(), kExperts, 4, kHidden, in.hidden, in.ids,
                                         in.weights, -1, kTopK, absl::MakeSpan(out));
  EXPECT_EQ(bad_tokens.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_tokens.status().message(), HasSubstr("num_tokens"));
  std::vector<float> short_out(out.size() - 1);
  auto bad_out = StreamedMoeReference(SwiGluFactory(), kExperts, 4, kHidden, in.hidden, in.ids,
                                      in.weights, in.num_tokens, kTopK, absl::MakeSpan(short_out));
  EXPECT_EQ(bad_out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_out.status().message(),
              HasSubstr("out: expected 4 x 32 = 128 elements, got 127"));
  auto bad_ids = StreamedMoeReference(SwiGluFactory(), kExperts, 4, kHidden, in.hidden,
                                      absl::MakeConstSpan(in.ids).subspan(1), in.weights,
                                      in.num_tokens, kTopK, absl::MakeSpan(out));
  EXPECT_EQ(bad_ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_ids.status().message(), HasSubstr("topk_ids"));
}

TEST(StreamedMoeReference, WrongChunkFromFactoryIsInternal) {
  const Inputs in = MakeInputs(4, {0, 1, 2, 3});
  std::vector<float> out(in.num_tokens * kHidden);
  auto shifted = [](int first, int count) -> absl::StatusOr<core::ExpertSet> {
    return core::ExpertSet::Identity(first + 1, count, kHidden);
  };
  auto r = StreamedMoeReference(shifted, kExperts, 4, kHidden, in.hidden, in.ids, in.weights,
                                in.num_tokens, kTopK, absl::MakeSpan(out));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(r.status().message(), HasSubstr("asked for experts [0, 4) with H = 32, got [1, 5)"));
}

TEST(StreamedMoeReference, FactoryErrorsPassThrough) {
  const Inputs in = MakeInputs(4, {0, 1, 2, 3});
  std::vector<float> out(in.num_tokens * kHidden);
  auto failing = [](int, int) -> absl::StatusOr<core::ExpertSet> {
    return absl::ResourceExhaustedError("no memory for the chunk");
  };
  auto r = StreamedMoeReference(failing, kExperts, 4, kHidden, in.hidden, in.ids, in.weights,
                                in.num_tokens, kTopK, absl::MakeSpan(out));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("no memory for the chunk"));
}

}  // namespace
}  // namespace moe_ep::client
