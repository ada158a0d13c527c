#include "core/ep_dispatcher.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/moe_reference.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/ep_dispatcher_harness.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::DispatcherOptions;
using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RandomInput;
using ::moe_ep::core::testing::RunEp;
using ::moe_ep::core::testing::StepInput;
using ::testing::HasSubstr;

// bf16 has 8 significant bits: unit roundoff u = 2^-8. The dispatched path
// rounds each destination rank's partial sum to bf16 (expert output), adds
// the partials in fp32 and rounds once more, so per element
//   |out - exact| <= u * sum_k |w_k * e_k(x)| + u * |exact| (1 + u)
//                 <= 2^-7 * sum_k |w_k * e_k(x)|.
// kTol adds a small absolute slack for fp32 accumulation order.
constexpr double kBf16RelTol = 1.0 / 128.0;
constexpr double kAbsSlack = 1e-5;

EpDispatcherOptions DispatcherTestOptions(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                                          int num_experts, int32_t invalid_id = -1) {
  EpDispatcherOptions o = DispatcherOptions(ep_size, capacity, hidden, top_k, num_experts);
  o.invalid_expert_id = invalid_id;
  return o;
}

int64_t MaxTokens(const std::vector<int64_t>& counts) {
  return *std::max_element(counts.begin(), counts.end());
}

// --- identity experts ---------------------------------------------------

class EpDispatcherRanksTest : public ::testing::TestWithParam<int> {};

TEST_P(EpDispatcherRanksTest, IdentityExpertsGiveSumOfWeightsTimesInput) {
  const int ep = GetParam();
  const int64_t h = 8;
  const int k = 2;
  const int num_experts = 8;
  RunEp(ep, DispatcherTestOptions(ep, 16, h, k, num_experts), [&](int rank, EpDispatcher& d) {
    const int64_t tokens = 3 + 2 * rank;
    StepInput in = RandomInput(100 + rank, tokens, h, k, num_experts);
    auto counts = d.SyncTokenCounts(tokens);
    ASSERT_TRUE(counts.ok()) << counts.status();
    for (int r = 0; r < ep; ++r) EXPECT_EQ((*counts)[r], 3 + 2 * r);
    ASSERT_TRUE(d.CommitGeometry(1, MaxTokens(*counts), tokens).ok());
    auto placement = ExpertPlacement::Contiguous(num_experts, ep).value();
    ExpertSet experts =
        ExpertSet::Identity(placement.FirstExpert(rank), placement.NumLocalExperts(rank), h);
    std::vector<bf16_t> out(tokens * h);
    ASSERT_TRUE(
        d.Forward(in.hidden, in.ids, in.weights, tokens, experts, absl::MakeSpan(out)).ok());
    for (int64_t t = 0; t < tokens; ++t) {
      double wsum = 0;
      for (int j = 0; j < k; ++j) wsum += in.weights[t * k + j];
      for (int64_t i = 0; i < h; ++i) {
        const double x = Bf16ToFloat(in.hidden[t * h + i]);
        const double exact = wsum * x;
        EXPECT_NEAR(Bf16ToFloat(out[t * h + i]), exact, kBf16RelTol * std::abs(exact) + kAbsSlack)
            << "rank " << rank << " token " << t << " elem " << i;
      }
    }
    const StepStats& s = d.last_step();
    EXPECT_EQ(s.runtime_max_tokens_per_rank, 3 + 2 * (ep - 1));
    EXPECT_GE(s.tokens_sent, tokens);  // every token has >= 1 valid expert
    EXPECT_LE(s.tokens_sent, tokens * k);
  });
}

// --- SwiGLU experts vs a dense single-process reference --------------------

struct SwiGluCase {
  int ep_size;
  int num_experts;
};

class EpDispatcherSwiGluTest : public ::testing::TestWithParam<SwiGluCase> {};

TEST_P(EpDispatcherSwiGluTest, MatchesDenseReference) {
  const int ep = GetParam().ep_size;
  const int num_experts = GetParam().num_experts;
  const int64_t h = 16;
  const int64_t inter = 24;
  const int k = 3;
  const uint64_t seed = 7;
  const int layer = 2;
  auto all = ExpertSet::GenerateSwiGlu(seed, layer, 0, num_experts, h, inter);
  ASSERT_TRUE(all.ok()) << all.status();
  // Uneven token counts; the last rank of a multi-rank group has none.
  auto tokens_of = [&](int rank) -> int64_t {
    return (ep > 1 && rank == ep - 1) ? 0 : 2 + 3 * rank;
  };
  std::vector<StepInput> inputs;
  inputs.reserve(ep);
  for (int r = 0; r < ep; ++r)
    inputs.push_back(RandomInput(200 + r, tokens_of(r), h, k, num_experts));

  // The in-process EP reference (core/moe_reference.h) gives what every rank
  // must receive, exactly.
  auto placement_all = ExpertPlacement::Contiguous(num_experts, ep).value();
  std::vector<ExpertSet> rank_sets;
  rank_sets.reserve(ep);
  for (int r = 0; r < ep; ++r) {
    rank_sets.push_back(ExpertSet::GenerateSwiGlu(seed, layer, placement_all.FirstExpert(r),
                                                  placement_all.NumLocalExperts(r), h, inter)
                            .value());
  }
  std::vector<const ExpertSet*> set_ptrs;
  std::vector<EpRankInput> ref_inputs;
  for (int r = 0; r < ep; ++r) {
    set_ptrs.push_back(&rank_sets[r]);
    ref_inputs.push_back(
        EpRankInput{inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].tokens});
  }
  auto ref = ReferenceEpForward(placement_all, set_ptrs, ref_inputs, k);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const int64_t r_max = ref->runtime_max_tokens_per_rank;

  RunEp(ep, DispatcherTestOptions(ep, 8, h, k, num_experts), [&](int rank, EpDispatcher& d) {
    const int64_t tokens = tokens_of(rank);
    const StepInput& in = inputs[rank];
    auto counts = d.SyncTokenCounts(tokens);
    ASSERT_TRUE(counts.ok()) << counts.status();
    ASSERT_TRUE(d.CommitGeometry(5, MaxTokens(*counts), tokens).ok());
    auto placement = ExpertPlacement::Contiguous(num_experts, ep).value();
    auto mine = ExpertSet::GenerateSwiGlu(seed, layer, placement.FirstExpert(rank),
                                          placement.NumLocalExperts(rank), h, inter);
    ASSERT_TRUE(mine.ok()) << mine.status();
    std::vector<bf16_t> out(tokens * h);
    // Phase by phase, so the received rows can be compared with the reference.
    ASSERT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, tokens).ok());
    const EpRankReceive& rx = ref->received[rank];
    EXPECT_EQ(d.received_counts(), rx.counts);
    for (int s = 0; s < ep; ++s) {
      auto rh = d.ReceivedHidden(s);
      auto ri = d.ReceivedIds(s);
      auto rw = d.ReceivedWeights(s);
      ASSERT_EQ(static_cast<int64_t>(rh.size()), r_max * h);
      EXPECT_TRUE(std::equal(rh.begin(), rh.end(), rx.hidden.begin() + s * r_max * h))
          << "hidden from source " << s;
      EXPECT_TRUE(std::equal(ri.begin(), ri.end(), rx.ids.begin() + s * r_max * k))
          << "ids from source " << s;
      EXPECT_TRUE(std::equal(rw.begin(), rw.end(), rx.weights.begin() + s * r_max * k))
          << "weights from source " << s;
    }
    ASSERT_TRUE(d.ComputeExperts(*mine).ok());
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    // Dense reference: sum_k w_k * expert_k(x), all experts in this process.
    std::vector<float> x(h), y(h);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < h; ++i) x[i] = Bf16ToFloat(in.hidden[t * h + i]);
      std::vector<double> exact(h, 0.0), magnitude(h, 0.0);
      for (int j = 0; j < k; ++j) {
        ASSERT_TRUE(all->Apply(in.ids[t * k + j], x, 1, absl::MakeSpan(y)).ok());
        for (int64_t i = 0; i < h; ++i) {
          exact[i] += in.weights[t * k + j] * y[i];
          magnitude[i] += std::abs(in.weights[t * k + j] * y[i]);
        }
      }
      for (int64_t i = 0; i < h; ++i) {
        EXPECT_NEAR(Bf16ToFloat(out[t * h + i]), exact[i], kBf16RelTol * magnitude[i] + kAbsSlack)
            << "rank " << rank << " token " << t << " elem " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Placements, EpDispatcherSwiGluTest,
                         ::testing::Values(SwiGluCase{1, 8}, SwiGluCase{2, 8}, SwiGluCase{4, 8},
                                           // num_experts % ep_size != 0: uneven placement.
                                           SwiGluCase{2, 5}, SwiGluCase{4, 7}),
                         [](const ::testing::TestParamInfo<SwiGluCase>& info) {
                           return "E" + std::to_string(info.param.ep_size) + "_experts" +
                                  std::to_string(info.param.num_experts);
                         });

// --- zero-token rank ----------------------------------------------------

TEST_P(EpDispatcherRanksTest, ZeroTokenRankStillTakesPartAndGetsEmptyOutput) {
  const int ep = GetParam();
  const int64_t h = 4;
  const int k = 2;
  const int num_experts = 4;
  std::vector<int64_t> sent(ep), received(ep);
  RunEp(ep, DispatcherTestOptions(ep, 8, h, k, num_experts), [&](int rank, EpDispatcher& d) {
    // Rank 0 has no tokens; rank r > 0 has r + 2.
    const int64_t tokens = rank == 0 ? 0 : rank + 2;
    StepInput in = RandomInput(300 + rank, tokens, h, k, num_experts);
    auto counts = d.SyncTokenCounts(tokens);
    ASSERT_TRUE(counts.ok()) << counts.status();
    ASSERT_TRUE(d.CommitGeometry(3, MaxTokens(*counts), tokens).ok());
    auto placement = ExpertPlacement::Contiguous(num_experts, ep).value();
    ExpertSet experts =
        ExpertSet::Identity(placement.FirstExpert(rank), placement.NumLocalExperts(rank), h);
    std::vector<bf16_t> out(tokens * h);
    ASSERT_TRUE(
        d.Forward(in.hidden, in.ids, in.weights, tokens, experts, absl::MakeSpan(out)).ok());
    if (tokens == 0) {
      EXPECT_TRUE(out.empty());
    }
    for (int64_t t = 0; t < tokens; ++t) {
      const double wsum = in.weights[t * k] + in.weights[t * k + 1];
      for (int64_t i = 0; i < h; ++i) {
        const double exact = wsum * Bf16ToFloat(in.hidden[t * h + i]);
        EXPECT_NEAR(Bf16ToFloat(out[t * h + i]), exact, kBf16RelTol * std::abs(exact) + kAbsSlack);
      }
    }
    sent[rank] = d.last_step().tokens_sent;
    received[rank] = d.last_step().tokens_received;
    if (rank == 0) {
      EXPECT_EQ(d.last_step().tokens_sent, 0);
    }
  });
  // Every token copy sent is received somewhere.
  EXPECT_EQ(std::accumulate(sent.begin(), sent.end(), int64_t{0}),
            std::accumulate(received.begin(), received.end(), int64_t{0}));
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpDispatcherRanksTest, ::testing::Values(1, 2, 4));

// --- hand-worked case -------------------------------------------------------

// E=2, 4 experts (rank 0 owns {0,1}, rank 1 owns {2,3}), K=2, H=2.
// Rank 0 tokens: t0 ids [0,2] -> ranks {0,1}; t1 [3,2] -> {1}; t2 [1,0] -> {0}.
// Rank 1 tokens: t0 [2,3] -> {1}; t1 [1,3] -> {0,1}.
// R = 3. Rank 0 receives from 0: slots t0, t2; from 1: t1. Rank 1 receives
// from 0: t0, t1; from 1: t0, t1.
struct HandCase {
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<bf16_t> hidden;
  int64_t tokens;
};

HandCase HandInput(int rank) {
  HandCase c;
  if (rank == 0) {
    c.ids = {0, 2, 3, 2, 1, 0};
    c.weights = {0.5f, 0.25f, 0.125f, 1.0f, 2.0f, 0.75f};
    c.tokens = 3;
  } else {
    c.ids = {2, 3, 1, 3};
    c.weights = {1.5f, 0.5f, 0.25f, 4.0f};
    c.tokens = 2;
  }
  // x[t] = (10 * rank + t + 1, -(10 * rank + t + 1) / 2): exact in bf16.
  for (int64_t t = 0; t < c.tokens; ++t) {
    const float v = static_cast<float>(10 * rank + t + 1);
    c.hidden.push_back(FloatToBf16(v));
    c.hidden.push_back(FloatToBf16(-v / 2));
  }
  return c;
}

class EpDispatcherHandTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(EpDispatcherHandTest, ReceivedRowsSlotsAndPaddingAreExact) {
  const int32_t invalid = GetParam();  // -1 or num_experts (4)
  RunEp(2, DispatcherTestOptions(2, 4, 2, 2, 4, invalid), [&](int rank, EpDispatcher& d) {
    HandCase in = HandInput(rank);
    ASSERT_TRUE(d.CommitGeometry(9, 3, in.tokens).ok());
    ASSERT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, in.tokens).ok());
    auto row = [](int src, int t) {
      const float v = static_cast<float>(10 * src + t + 1);
      return std::vector<float>{v, -v / 2};
    };
    struct Expect {
      int src_rank;
      std::vector<int> tokens;  // source token per slot
    };
    // Source token -> (ids, weights) of that token.
    auto src_in = [](int src) { return HandInput(src); };
    std::vector<Expect> expects = rank == 0 ? std::vector<Expect>{{0, {0, 2}}, {1, {1}}}
                                            : std::vector<Expect>{{0, {0, 1}}, {1, {0, 1}}};
    ASSERT_EQ(d.received_counts().size(), 2u);
    for (const Expect& e : expects) {
      const int64_t count = static_cast<int64_t>(e.tokens.size());
      EXPECT_EQ(d.received_counts()[e.src_rank], count);
      auto hidden = d.ReceivedHidden(e.src_rank);
      auto ids = d.ReceivedIds(e.src_rank);
      auto weights = d.ReceivedWeights(e.src_rank);
      ASSERT_EQ(hidden.size(), 3u * 2);
      ASSERT_EQ(ids.size(), 3u * 2);
      ASSERT_EQ(weights.size(), 3u * 2);
      HandCase src = src_in(e.src_rank);
      for (int64_t slot = 0; slot < 3; ++slot) {
        for (int j = 0; j < 2; ++j) {
          if (slot < count) {
            const int t = e.tokens[slot];
            EXPECT_EQ(Bf16ToFloat(hidden[slot * 2 + j]), row(e.src_rank, t)[j]);
            EXPECT_EQ(ids[slot * 2 + j], src.ids[t * 2 + j]);
            EXPECT_EQ(weights[slot * 2 + j], src.weights[t * 2 + j]);
          } else {
            EXPECT_EQ(hidden[slot * 2 + j], 0) << "padding hidden, slot " << slot;
            EXPECT_EQ(ids[slot * 2 + j], invalid) << "padding id, slot " << slot;
            EXPECT_EQ(weights[slot * 2 + j], 0.0f) << "padding weight, slot " << slot;
          }
        }
      }
    }
    // Dispatch bytes = 2H + 8K = 20. Rank 0 sends t0, t1 to rank 1 (2 * 20);
    // rank 1 sends t1 to rank 0 (20).
    const StepStats& s = d.last_step();
    EXPECT_EQ(s.runtime_max_tokens_per_rank, 3);
    EXPECT_EQ(s.tokens_sent, rank == 0 ? 4 : 3);
    EXPECT_EQ(s.tokens_received, rank == 0 ? 3 : 4);
    EXPECT_EQ(s.bytes_sent_remote, rank == 0 ? 40 : 20);

    ExpertSet experts = ExpertSet::Identity(rank * 2, 2, 2);
    ASSERT_TRUE(d.ComputeExperts(experts).ok());
    std::vector<bf16_t> out(in.tokens * 2);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    // Combine sends back 2H = 4 bytes per received row from the other rank:
    // rank 0 returns 1 row to rank 1, rank 1 returns 2 rows to rank 0.
    EXPECT_EQ(d.last_step().bytes_sent_remote, rank == 0 ? 40 + 4 : 20 + 8);
    for (int64_t t = 0; t < in.tokens; ++t) {
      const float wsum = in.weights[t * 2] + in.weights[t * 2 + 1];
      for (int j = 0; j < 2; ++j) {
        // All values and partial products are exact in bf16 here.
        EXPECT_EQ(Bf16ToFloat(out[t * 2 + j]), wsum * row(rank, t)[j]) << "token " << t;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(InvalidIdConventions, EpDispatcherHandTest, ::testing::Values(-1, 4));

// --- invalid ids in the input -------------------------------------------------

TEST(EpDispatcher, InvalidInputIdsContributeNothingAndNeverGoToRankZero) {
  const int num_experts = 4;  // rank 0 owns {0,1}, rank 1 owns {2,3}
  RunEp(2, DispatcherTestOptions(2, 4, 2, 2, num_experts), [&](int rank, EpDispatcher& d) {
    // Only rank 1 has tokens: t0 [-1, 3], t1 [-1, -1] (no expert), t2 [2, -1].
    const int64_t tokens = rank == 1 ? 3 : 0;
    std::vector<int32_t> ids =
        rank == 1 ? std::vector<int32_t>{-1, 3, -1, -1, 2, -1} : std::vector<int32_t>{};
    std::vector<float> weights =
        rank == 1 ? std::vector<float>{0.5f, 0.25f, 1.0f, 1.0f, 2.0f, 8.0f} : std::vector<float>{};
    std::vector<bf16_t> hidden;
    for (int64_t t = 0; t < tokens; ++t) {
      hidden.push_back(FloatToBf16(static_cast<float>(t + 1)));
      hidden.push_back(FloatToBf16(static_cast<float>(-(t + 1))));
    }
    ASSERT_TRUE(d.CommitGeometry(1, 3, tokens).ok());
    ASSERT_TRUE(d.Dispatch(hidden, ids, weights, tokens).ok());
    if (rank == 0) {
      EXPECT_EQ(d.received_counts()[0], 0);
      EXPECT_EQ(d.received_counts()[1], 0) << "invalid ids must never select rank 0";
    } else {
      // t0 and t2 come to rank 1; t1 is sent nowhere.
      EXPECT_EQ(d.received_counts()[1], 2);
      auto rid = d.ReceivedIds(1);
      auto rw = d.ReceivedWeights(1);
      // A token travels with its full K ids and weights, invalid ones as given;
      // they select no expert on the receiver.
      EXPECT_EQ(rid[0], -1);
      EXPECT_EQ(rw[0], 0.5f);
      EXPECT_EQ(rid[1], 3);
      EXPECT_EQ(rw[1], 0.25f);
      EXPECT_EQ(rid[2], 2);
      EXPECT_EQ(rw[2], 2.0f);
      EXPECT_EQ(rid[3], -1);
      EXPECT_EQ(rw[3], 8.0f);
      EXPECT_EQ(d.last_step().tokens_sent, 2);
    }
    ExpertSet experts = ExpertSet::Identity(rank * 2, 2, 2);
    ASSERT_TRUE(d.ComputeExperts(experts).ok());
    std::vector<bf16_t> out(tokens * 2, FloatToBf16(99.0f));
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    if (rank == 1) {
      EXPECT_EQ(Bf16ToFloat(out[0]), 0.25f * 1);
      EXPECT_EQ(Bf16ToFloat(out[1]), 0.25f * -1);
      EXPECT_EQ(Bf16ToFloat(out[2]), 0.0f) << "a token with no valid expert outputs zeros";
      EXPECT_EQ(Bf16ToFloat(out[3]), 0.0f);
      EXPECT_EQ(Bf16ToFloat(out[4]), 2.0f * 3);
      EXPECT_EQ(Bf16ToFloat(out[5]), 2.0f * -3);
    }
  });
}

// DESIGN §7 (issue 30 item 1): an id outside [0, num_experts) that is not
// the configured invalid id is a routing bug: INVALID_ARGUMENT naming the
// row and the id on that rank, ABORTED on its peers, nothing moved, and the
// next step runs as if nothing happened.
class EpDispatcherOutOfRangeTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(EpDispatcherOutOfRangeTest, OutOfRangeIdFailsTheStepOnEveryRank) {
  const int32_t invalid = GetParam();  // -1 or num_experts (4)
  const int32_t bad_id = invalid == -1 ? 4 : -1;
  RunEp(2, DispatcherTestOptions(2, 4, 2, 2, 4, invalid), [&](int rank, EpDispatcher& d) {
    HandCase in = HandInput(rank);
    ASSERT_TRUE(d.CommitGeometry(1, 3, in.tokens).ok());
    std::vector<int32_t> ids = in.ids;
    if (rank == 1) ids[3] = bad_id;  // row 1, choice 1
    absl::Status s = d.Dispatch(in.hidden, ids, in.weights, in.tokens);
    if (rank == 1) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("topk_ids[row 1, choice 1] = ", bad_id,
                                                      ": outside [0, 4) and not the invalid "
                                                      "expert id ",
                                                      invalid)));
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_THAT(s.message(), HasSubstr("rank 1 rejected its input"));
    }
    EXPECT_FALSE(d.step_in_flight());
    // Padding with the configured invalid id is fine, and the step runs.
    if (rank == 1) ids[3] = invalid;
    ASSERT_TRUE(d.Dispatch(in.hidden, ids, in.weights, in.tokens).ok());
    EXPECT_TRUE(d.step_in_flight());
    ASSERT_TRUE(d.ComputeExperts(ExpertSet::Identity(rank * 2, 2, 2)).ok());
    std::vector<bf16_t> out(in.tokens * 2);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    EXPECT_FALSE(d.step_in_flight());
    // Rank 1's t1 keeps only its first choice (weight 0.25): 0.25 * x.
    if (rank == 1) {
      EXPECT_EQ(Bf16ToFloat(out[2]), 0.25f * 12);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(InvalidIdConventions, EpDispatcherOutOfRangeTest,
                         ::testing::Values(-1, 4));

// A step released after its dispatch (an exchange: the received rows are
// the result) needs no combine: the next dispatch runs and sees its own rows.
TEST(EpDispatcher, ReleaseStepEndsADispatchWithoutCombine) {
  RunEp(2, DispatcherTestOptions(2, 4, 2, 2, 4), [&](int rank, EpDispatcher& d) {
    HandCase in = HandInput(rank);
    EXPECT_EQ(d.ReleaseStep().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(d.CommitGeometry(1, 3, in.tokens).ok());
    ASSERT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, in.tokens).ok());
    ASSERT_TRUE(d.ReleaseStep().ok());
    EXPECT_FALSE(d.step_in_flight());
    std::vector<bf16_t> out(in.tokens * 2);
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition);
    // The second exchange: every token to rank 1 only (expert 2).
    std::vector<int32_t> ids(in.tokens * 2, -1);
    for (int64_t t = 0; t < in.tokens; ++t) ids[t * 2] = 2;
    ASSERT_TRUE(d.Dispatch(in.hidden, ids, in.weights, in.tokens).ok());
    EXPECT_EQ(d.received_counts()[0], rank == 1 ? 3 : 0);
    EXPECT_EQ(d.received_counts()[1], rank == 1 ? 2 : 0);
    if (rank == 1) {
      EXPECT_EQ(Bf16ToFloat(d.ReceivedHidden(0)[4]), 3.0f);  // rank 0's t2
    }
    ASSERT_TRUE(d.ReleaseStep().ok());
  });
}

// --- geometry -------------------------------------------------------------------

TEST(EpDispatcher, CommitGeometryChecksBoundsAndKeepsPreviousOnError) {
  RunEp(1, DispatcherTestOptions(1, 8, 4, 2, 4), [&](int, EpDispatcher& d) {
    ASSERT_TRUE(d.CommitGeometry(3, 6, 5).ok());
    absl::Status over = d.CommitGeometry(4, 9, 5);
    EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(over.message(), HasSubstr("9"));
    EXPECT_THAT(over.message(), HasSubstr("capacity_tokens 8"));
    absl::Status under = d.CommitGeometry(4, 4, 5);
    EXPECT_EQ(under.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(under.message(), HasSubstr("local_tokens 5"));
    EXPECT_EQ(d.CommitGeometry(4, -1, 0).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(d.CommitGeometry(4, 2, -1).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(d.epoch(), 3);
    EXPECT_EQ(d.runtime_max_tokens_per_rank(), 6);
    ASSERT_TRUE(d.CommitGeometry(4, 8, 8).ok());
    EXPECT_EQ(d.runtime_max_tokens_per_rank(), 8);
  });
}

TEST(EpDispatcher, SyncTokenCountsGathersAllRanksAndRejectsNegative) {
  RunEp(2, DispatcherTestOptions(2, 8, 4, 2, 4), [&](int rank, EpDispatcher& d) {
    auto counts = d.SyncTokenCounts(rank == 0 ? 5 : 0);
    ASSERT_TRUE(counts.ok()) << counts.status();
    EXPECT_EQ(*counts, (std::vector<int64_t>{5, 0}));
    auto bad = d.SyncTokenCounts(rank == 0 ? -2 : 1);
    EXPECT_EQ(bad.status().code(),
              rank == 0 ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kAborted)
        << bad.status();
  });
}

TEST(EpDispatcher, RanksWithDifferentGeometryAbortOnEveryRank) {
  RunEp(2, DispatcherTestOptions(2, 16, 4, 2, 4), [&](int rank, EpDispatcher& d) {
    ASSERT_TRUE(d.CommitGeometry(7, rank == 0 ? 16 : 12, 2).ok());
    StepInput in = RandomInput(400 + rank, 2, 4, 2, 4);
    absl::Status s = d.Dispatch(in.hidden, in.ids, in.weights, 2);
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    if (rank == 0) {
      EXPECT_THAT(s.message(), HasSubstr("rank 1 has (epoch 7, R 12), this rank (rank 0) has "
                                         "(epoch 7, R 16)"));
    } else {
      EXPECT_THAT(s.message(), HasSubstr("rank 0 has (epoch 7, R 16), this rank (rank 1) has "
                                         "(epoch 7, R 12)"));
    }
    // Nothing was dispatched: Combine is still a precondition error, and the
    // group recovers with an agreed geometry.
    std::vector<bf16_t> out(2 * 4);
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(d.CommitGeometry(8, 12, 2).ok());
    EXPECT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, 2).ok());
    ASSERT_TRUE(d.ComputeExperts(ExpertSet::Identity(rank * 2, 2, 4)).ok());
    EXPECT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
  });
}

TEST(EpDispatcher, DifferentEpochAborts) {
  RunEp(2, DispatcherTestOptions(2, 16, 4, 2, 4), [&](int rank, EpDispatcher& d) {
    ASSERT_TRUE(d.CommitGeometry(rank == 0 ? 7 : 6, 4, 0).ok());
    absl::Status s = d.Dispatch({}, {}, {}, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(s.message(),
                HasSubstr(rank == 0 ? "rank 1 has (epoch 6, R 4)" : "rank 0 has (epoch 7, R 4)"));
  });
}

TEST(EpDispatcher, TooManyTokensIsInvalidHereAndAbortedOnPeers) {
  RunEp(2, DispatcherTestOptions(2, 16, 4, 2, 4), [&](int rank, EpDispatcher& d) {
    ASSERT_TRUE(d.CommitGeometry(1, 2, 0).ok());
    const int64_t tokens = rank == 1 ? 3 : 1;  // rank 1 exceeds R = 2
    StepInput in = RandomInput(500 + rank, tokens, 4, 2, 4);
    absl::Status s = d.Dispatch(in.hidden, in.ids, in.weights, tokens);
    if (rank == 1) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_THAT(s.message(), HasSubstr("num_tokens 3 exceeds runtime_max_tokens_per_rank 2"));
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_THAT(s.message(), HasSubstr("rank 1 rejected its input"));
    }
  });
}

// --- sequence and argument checks --------------------------------------------------

TEST(EpDispatcher, SequenceErrorsAreFailedPrecondition) {
  RunEp(1, DispatcherTestOptions(1, 4, 2, 1, 2), [&](int, EpDispatcher& d) {
    std::vector<bf16_t> hidden = {FloatToBf16(1.0f), FloatToBf16(2.0f)};
    std::vector<int32_t> ids = {1};
    std::vector<float> weights = {0.5f};
    std::vector<bf16_t> out(2);
    ExpertSet experts = ExpertSet::Identity(0, 2, 2);
    // No geometry yet.
    absl::Status no_geo = d.Dispatch(hidden, ids, weights, 1);
    EXPECT_EQ(no_geo.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(no_geo.message(), HasSubstr("CommitGeometry"));
    ASSERT_TRUE(d.CommitGeometry(1, 1, 1).ok());
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(d.ComputeExperts(experts).code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(d.Dispatch(hidden, ids, weights, 1).ok());
    EXPECT_EQ(d.Dispatch(hidden, ids, weights, 1).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(d.CommitGeometry(2, 1, 1).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(d.Forward(hidden, ids, weights, 1, experts, absl::MakeSpan(out)).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition)
        << "combine before ComputeExperts";
    ASSERT_TRUE(d.ComputeExperts(experts).ok());
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    EXPECT_EQ(Bf16ToFloat(out[0]), 0.5f);
    EXPECT_EQ(Bf16ToFloat(out[1]), 1.0f);
    EXPECT_EQ(d.Combine(absl::MakeSpan(out)).code(), absl::StatusCode::kFailedPrecondition)
        << "second combine";
  });
}

// Issue 13 item 6: a `stop` that fires inside the expert compute ends it
// there, `before_combine` (the server's gate, which the peers wait in)
// still runs and its error is returned; nothing is combined, and the next
// step is exact. With a before_combine that lets it on, the LocalStop is
// returned and still nothing is combined.
TEST(EpDispatcher, ForwardStoppedInsideExpertComputeStillRunsBeforeCombine) {
  constexpr int64_t kH = 8;
  RunEp(1, DispatcherTestOptions(1, 4, kH, 2, 4), [&](int, EpDispatcher& d) {
    auto experts = ExpertSet::GenerateSwiGlu(3, 0, 0, 4, kH, 16);
    ASSERT_TRUE(experts.ok());
    std::vector<bf16_t> hidden;
    for (int64_t i = 0; i < 3 * kH; ++i) hidden.push_back(FloatToBf16(0.1f * (i % 7) - 0.3f));
    const std::vector<int32_t> ids = {0, 1, 2, 3, 1, 2};
    const std::vector<float> weights = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
    ASSERT_TRUE(d.CommitGeometry(1, 3, 3).ok());
    std::vector<bf16_t> want(3 * kH);
    ASSERT_TRUE(d.Forward(hidden, ids, weights, 3, *experts, absl::MakeSpan(want)).ok());

    const bf16_t sentinel = FloatToBf16(-7.0f);
    std::vector<bf16_t> out(3 * kH, sentinel);
    int polls = 0, gates = 0;
    // Polls: 1 before the one chunk of rows, then one per expert with rows
    // (4): the 3rd answers true, inside the expert loop.
    const StopCheck stop = [&] { return ++polls >= 3; };
    absl::Status s = d.Forward(
        hidden, ids, weights, 3, *experts, absl::MakeSpan(out), {},
        [&] {
          ++gates;
          return absl::DeadlineExceededError("gate: stopped on every rank");
        },
        stop);
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_EQ(s.message(), "gate: stopped on every rank");
    EXPECT_EQ(polls, 3);
    EXPECT_EQ(gates, 1);
    EXPECT_THAT(out, ::testing::Each(sentinel));

    polls = 0;
    s = d.Forward(
        hidden, ids, weights, 3, *experts, absl::MakeSpan(out), {},
        [&] {
          ++gates;
          return absl::OkStatus();
        },
        stop);
    EXPECT_TRUE(IsLocalStop(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("expert compute: after 1 of 4 experts"));
    EXPECT_EQ(gates, 2);
    EXPECT_THAT(out, ::testing::Each(sentinel));

    // The next step (no stop) is exact, bit for bit.
    ASSERT_TRUE(d.Forward(
                     hidden, ids, weights, 3, *experts, absl::MakeSpan(out), {},
                     [] { return absl::OkStatus(); }, [] { return false; })
                    .ok());
    EXPECT_EQ(out, want);
  });
}

TEST(EpDispatcher, BadSpansAreInvalidArgumentAndLeaveStateUnchanged) {
  RunEp(1, DispatcherTestOptions(1, 4, 2, 2, 2), [&](int, EpDispatcher& d) {
    ASSERT_TRUE(d.CommitGeometry(1, 2, 1).ok());
    std::vector<bf16_t> hidden = {FloatToBf16(1.0f), FloatToBf16(3.0f)};
    std::vector<int32_t> ids = {0, 1};
    std::vector<float> weights = {0.5f, 0.25f};
    std::vector<bf16_t> out(2);
    ExpertSet experts = ExpertSet::Identity(0, 2, 2);
    auto short_hidden = d.Dispatch(absl::MakeConstSpan(hidden).subspan(0, 1), ids, weights, 1);
    EXPECT_EQ(short_hidden.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(short_hidden.message(), HasSubstr("hidden"));
    EXPECT_EQ(d.Dispatch(hidden, absl::MakeConstSpan(ids).subspan(0, 1), weights, 1).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(d.Dispatch(hidden, ids, absl::MakeConstSpan(weights).subspan(0, 1), 1).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(d.Dispatch(hidden, ids, weights, -1).code(), absl::StatusCode::kInvalidArgument);
    std::vector<bf16_t> small_out(1);
    EXPECT_EQ(d.Forward(hidden, ids, weights, 1, experts, absl::MakeSpan(small_out)).code(),
              absl::StatusCode::kInvalidArgument);
    // Experts that are not this rank's placement.
    auto wrong =
        d.Forward(hidden, ids, weights, 1, ExpertSet::Identity(1, 1, 2), absl::MakeSpan(out));
    EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(wrong.message(), HasSubstr("owns experts [0, 2)"));
    EXPECT_EQ(d.Forward(hidden, ids, weights, 1, ExpertSet::Identity(0, 2, 4), absl::MakeSpan(out))
                  .code(),
              absl::StatusCode::kInvalidArgument);
    // Still idle and usable.
    ASSERT_TRUE(d.Forward(hidden, ids, weights, 1, experts, absl::MakeSpan(out)).ok());
    EXPECT_EQ(Bf16ToFloat(out[0]), 0.75f);
    EXPECT_EQ(Bf16ToFloat(out[1]), 2.25f);
  });
}

TEST(EpDispatcher, CreateValidatesOptions) {
  auto store = NewHashStore();
  auto group = JoinLoopback(store, 0, 1);
  ASSERT_TRUE(group.ok()) << group.status();
  ControlCollective* c = group->get();
  auto wrong_size = EpDispatcher::Create(c, DispatcherTestOptions(2, 4, 4, 2, 4), 0);
  EXPECT_EQ(wrong_size.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_size.status().message(), HasSubstr("ep_size"));
  EXPECT_EQ(EpDispatcher::Create(nullptr, DispatcherTestOptions(1, 4, 4, 2, 4), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpDispatcher::Create(c, DispatcherTestOptions(1, 4, 4, 2, 4, 7), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpDispatcher::Create(c, DispatcherTestOptions(1, 4, 4, 2, 0), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpDispatcher::Create(c, DispatcherTestOptions(1, 0, 4, 2, 4), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EpDispatcher::Create(c, DispatcherTestOptions(1, 4, 3, 2, 4), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EpDispatcherOptions fp4 = DispatcherTestOptions(1, 4, 32, 2, 4);
  fp4.workspace.dtype = DispatchDType::kNVFP4;
  EXPECT_EQ(EpDispatcher::Create(c, fp4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EpDispatcherOptions buckets = DispatcherTestOptions(1, 4, 4, 2, 4);
  buckets.cuda_graph_buckets = {2, 2};
  EXPECT_EQ(EpDispatcher::Create(c, buckets, 0).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto ok = EpDispatcher::Create(c, DispatcherTestOptions(1, 4, 4, 2, 4), 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto layout = ComputeAllocatedWorkspace(DispatcherTestOptions(1, 4, 4, 2, 4).workspace);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ((*ok)->allocated_bytes(), layout->total_bytes);
  auto capped =
      EpDispatcher::Create(c, DispatcherTestOptions(1, 4, 4, 2, 4), layout->total_bytes - 1);
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(capped.status().message(), HasSubstr(std::to_string(layout->total_bytes)));
}

TEST(EpDispatcher, RepeatedStepsWithShrinkingGeometryStaySanitized) {
  RunEp(2, DispatcherTestOptions(2, 8, 2, 1, 2), [&](int rank, EpDispatcher& d) {
    ExpertSet experts = ExpertSet::Identity(rank, 1, 2);
    for (int64_t step = 0; step < 3; ++step) {
      const int64_t r = 6 - 2 * step;  // 6, 4, 2
      const int64_t tokens = rank == 0 ? r : 1;
      std::vector<bf16_t> hidden(tokens * 2, FloatToBf16(1.0f));
      std::vector<int32_t> ids(tokens, 1 - rank);  // all go to the other rank
      std::vector<float> weights(tokens, 1.0f);
      ASSERT_TRUE(d.CommitGeometry(step, r, tokens).ok());
      ASSERT_TRUE(d.Dispatch(hidden, ids, weights, tokens).ok());
      const int other = 1 - rank;
      const int64_t got = d.received_counts()[other];
      EXPECT_EQ(got, other == 0 ? r : 1);
      auto rid = d.ReceivedIds(other);
      for (int64_t slot = got; slot < r; ++slot) EXPECT_EQ(rid[slot], -1) << "step " << step;
      ASSERT_TRUE(d.ComputeExperts(experts).ok());
      std::vector<bf16_t> out(tokens * 2);
      ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
      for (bf16_t v : out) EXPECT_EQ(Bf16ToFloat(v), 1.0f);
    }
  });
}

}  // namespace
}  // namespace moe_ep::core
