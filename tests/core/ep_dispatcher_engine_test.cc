// core::EpDispatcher's calls for engines that run their own experts
// (issue 16): Dispatch with a local error, SetExpertOutputs, Combine.

#include <cstdint>
#include <functional>
#include <vector>

#include "core/ep_dispatcher.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/ep_dispatcher_harness.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::DispatcherOptions;
using ::moe_ep::core::testing::RunEp;
using ::testing::HasSubstr;

EpDispatcherOptions Options(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                            int num_experts) {
  return DispatcherOptions(ep_size, capacity, hidden, top_k, num_experts);
}

// 2 ranks, 4 experts (rank 0: 0-1, rank 1: 2-3), H 2, K 2. Expert e
// multiplies by (e + 1); values are small dyadic numbers, so every bf16 and
// fp32 step is exact and the outputs compare with ==.
TEST(EpDispatcherEngine, CallerExpertOutputsCombineToTheDenseResult) {
  RunEp(2, Options(2, 4, 2, 2, 4), [&](int rank, EpDispatcher& d) {
    // Rank r's tokens: t -> hidden (t + 1 + r, -(t + 1)), ids {t % 4, (t + 2 + r) % 4}.
    const int64_t tokens = rank == 0 ? 3 : 2;
    std::vector<bf16_t> hidden;
    std::vector<int32_t> ids;
    std::vector<float> weights;
    for (int64_t t = 0; t < tokens; ++t) {
      hidden.push_back(FloatToBf16(static_cast<float>(t + 1 + rank)));
      hidden.push_back(FloatToBf16(-static_cast<float>(t + 1)));
      ids.push_back(static_cast<int32_t>(t % 4));
      ids.push_back(static_cast<int32_t>((t + 2 + rank) % 4));
      weights.push_back(0.5f);
      weights.push_back(0.25f);
    }
    ASSERT_TRUE(d.CommitGeometry(7, 3, tokens).ok());
    ASSERT_TRUE(d.Dispatch(hidden, ids, weights, tokens).ok());
    // This rank's experts on the received rows, [E, rows = 4, H], as an engine would.
    const int64_t rows = 4;
    std::vector<bf16_t> expert_out(2 * rows * 2, FloatToBf16(99.0f));  // padding: never read
    const int first = rank * 2;
    for (int s = 0; s < 2; ++s) {
      for (int64_t j = 0; j < d.received_counts()[s]; ++j) {
        for (int h = 0; h < 2; ++h) {
          float acc = 0.0f;
          for (int k = 0; k < 2; ++k) {
            const int32_t e = d.ReceivedIds(s)[j * 2 + k];
            if (e < first || e >= first + 2) continue;
            acc += d.ReceivedWeights(s)[j * 2 + k] * static_cast<float>(e + 1) *
                   Bf16ToFloat(d.ReceivedHidden(s)[j * 2 + h]);
          }
          expert_out[(s * rows + j) * 2 + h] = FloatToBf16(acc);
        }
      }
    }
    ASSERT_TRUE(d.SetExpertOutputs(expert_out, rows).ok());
    std::vector<bf16_t> out(tokens * 2);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    for (int64_t t = 0; t < tokens; ++t) {
      const float scale = 0.5f * static_cast<float>(ids[t * 2] + 1) +
                          0.25f * static_cast<float>(ids[t * 2 + 1] + 1);
      EXPECT_EQ(Bf16ToFloat(out[t * 2]), scale * static_cast<float>(t + 1 + rank))
          << "rank " << rank << " token " << t;
      EXPECT_EQ(Bf16ToFloat(out[t * 2 + 1]), -scale * static_cast<float>(t + 1));
    }
  });
}

TEST(EpDispatcherEngine, SetExpertOutputsChecksSequenceRowsAndSize) {
  RunEp(1, Options(1, 4, 2, 1, 2), [&](int, EpDispatcher& d) {
    std::vector<bf16_t> hidden = {FloatToBf16(1.0f), FloatToBf16(2.0f)};
    std::vector<int32_t> ids = {1};
    std::vector<float> weights = {1.0f};
    std::vector<bf16_t> rows3(3 * 2);
    EXPECT_EQ(d.SetExpertOutputs(rows3, 3).code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(d.CommitGeometry(1, 3, 1).ok());
    ASSERT_TRUE(d.Dispatch(hidden, ids, weights, 1).ok());
    absl::Status few = d.SetExpertOutputs(std::vector<bf16_t>(2 * 2), 2);
    EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(few.message(), HasSubstr("rows per source 2 is below the step's R = 3"));
    absl::Status size = d.SetExpertOutputs(std::vector<bf16_t>(5), 3);
    EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(size.message(), HasSubstr("expected [1, 3, 2] = 6 elements, got 5"));
    std::vector<bf16_t> out(2);
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition)
        << "the failed calls left the step dispatched, not computed";
    rows3[0] = FloatToBf16(4.0f);
    rows3[1] = FloatToBf16(-8.0f);
    ASSERT_TRUE(d.SetExpertOutputs(rows3, 3).ok());
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    EXPECT_EQ(Bf16ToFloat(out[0]), 4.0f);
    EXPECT_EQ(Bf16ToFloat(out[1]), -8.0f);
  });
}

TEST(EpDispatcherEngine, LocalErrorAtDispatchAbortsPeersBeforePayload) {
  RunEp(2, Options(2, 4, 2, 1, 2), [&](int rank, EpDispatcher& d) {
    std::vector<bf16_t> hidden = {FloatToBf16(1.0f), FloatToBf16(2.0f)};
    std::vector<int32_t> ids = {0};
    std::vector<float> weights = {1.0f};
    ASSERT_TRUE(d.CommitGeometry(1, 1, 1).ok());
    absl::Status local =
        rank == 1 ? absl::InvalidArgumentError("received rows: too few") : absl::OkStatus();
    absl::Status got = d.Dispatch(hidden, ids, weights, 1, local);
    if (rank == 1) {
      EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(got.message(), HasSubstr("received rows: too few"));
    } else {
      EXPECT_EQ(got.code(), absl::StatusCode::kAborted);
      EXPECT_THAT(got.message(), HasSubstr("rank 1 rejected its input"));
    }
    // Nothing is in flight: the next step works on both ranks.
    EXPECT_TRUE(d.Dispatch(hidden, ids, weights, 1).ok());
  });
}

}  // namespace
}  // namespace moe_ep::core
