#include "core/moe_reference.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct RankData {
  std::vector<bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int64_t num_tokens = 0;
  EpRankInput Input() const { return {hidden, ids, weights, num_tokens}; }
};

// Random routing with distinct ids per token, some slots invalid (-1 or
// num_experts), softmax-like weights; hidden ~ N(0, 1) in bf16.
RankData RandomRank(std::mt19937& rng, int64_t tokens, int64_t h, int k, int num_experts) {
  RankData d;
  d.num_tokens = tokens;
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (int64_t i = 0; i < tokens * h; ++i) d.hidden.push_back(FloatToBf16(n(rng)));
  std::vector<int32_t> perm(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k; ++j) {
      int32_t id = perm[j];
      if (t % 5 == 3 && j == 1) id = -1;           // padding slot of the caller
      if (t % 7 == 2 && j == 0) id = num_experts;  // the other invalid convention
      if (t % 11 == 6) id = -1;                    // a token sent nowhere
      d.ids.push_back(id);
      d.weights.push_back(u(rng));
    }
  }
  return d;
}

std::vector<const ExpertSet*> Ptrs(const std::vector<ExpertSet>& sets) {
  std::vector<const ExpertSet*> out;
  out.reserve(sets.size());
  for (const ExpertSet& s : sets) out.push_back(&s);
  return out;
}

std::vector<ExpertSet> RankSets(const ExpertPlacement& p, uint64_t seed, int layer, int64_t h,
                                int64_t i) {
  std::vector<ExpertSet> sets;
  for (int d = 0; d < p.ep_size(); ++d) {
    auto s = ExpertSet::GenerateSwiGlu(seed, layer, p.FirstExpert(d), p.NumLocalExperts(d), h, i);
    EXPECT_TRUE(s.ok());
    sets.push_back(std::move(*s));
  }
  return sets;
}

TEST(DenseMoeReference, IdentityGivesWeightSumTimesX) {
  ExpertSet all = ExpertSet::Identity(0, 8, 2);
  const std::vector<bf16_t> x = {FloatToBf16(1.0f), FloatToBf16(-2.0f), FloatToBf16(3.0f),
                                 FloatToBf16(0.5f)};
  const std::vector<int32_t> ids = {0, 7, -1, 8, -1, 8};  // token 1: all invalid
  const std::vector<float> w = {0.25f, 0.5f, 0.125f, 2.0f, 0.75f, 99.0f};
  std::vector<float> out(4, 7.0f);
  ASSERT_TRUE(DenseMoeReference({&all}, 8, x, ids, w, 2, 3, absl::MakeSpan(out)).ok());
  // Token 0: (0.25 + 0.5) * [1, -2]; token 1 contributes nothing.
  EXPECT_THAT(out, ElementsAre(0.75f, -1.5f, 0.0f, 0.0f));
}

TEST(DenseMoeReference, MatchesPerTokenApply) {
  constexpr int64_t kH = 16, kI = 8, kT = 6;
  constexpr int kK = 3, kE = 12;
  std::mt19937 rng(5);
  RankData d = RandomRank(rng, kT, kH, kK, kE);
  auto all = ExpertSet::GenerateSwiGlu(1, 0, 0, kE, kH, kI);
  ASSERT_TRUE(all.ok());
  std::vector<float> out(kT * kH);
  ASSERT_TRUE(
      DenseMoeReference({&*all}, kE, d.hidden, d.ids, d.weights, kT, kK, absl::MakeSpan(out)).ok());
  for (int64_t t = 0; t < kT; ++t) {
    std::vector<float> x(kH), y(kH);
    for (int64_t c = 0; c < kH; ++c) x[c] = Bf16ToFloat(d.hidden[t * kH + c]);
    std::vector<double> ref(kH, 0.0);
    for (int k = 0; k < kK; ++k) {
      const int32_t id = d.ids[t * kK + k];
      if (id < 0 || id >= kE) continue;
      ASSERT_TRUE(all->Apply(id, x, 1, absl::MakeSpan(y)).ok());
      for (int64_t c = 0; c < kH; ++c) ref[c] += double{d.weights[t * kK + k]} * y[c];
    }
    for (int64_t c = 0; c < kH; ++c) {
      EXPECT_NEAR(out[t * kH + c], ref[c], 1e-5 * (1 + std::abs(ref[c])));
    }
  }
}

TEST(DenseMoeReference, Errors) {
  ExpertSet a = ExpertSet::Identity(0, 4, 2);
  ExpertSet b = ExpertSet::Identity(2, 4, 2);
  ExpertSet c = ExpertSet::Identity(4, 2, 3);
  const std::vector<bf16_t> x(2);
  std::vector<float> out(2);
  const std::vector<int32_t> ids = {5};
  const std::vector<float> w = {1.0f};
  auto none = DenseMoeReference({}, 8, x, ids, w, 1, 1, absl::MakeSpan(out));
  EXPECT_EQ(none.code(), absl::StatusCode::kInvalidArgument);
  auto overlap = DenseMoeReference({&a, &b}, 8, x, ids, w, 1, 1, absl::MakeSpan(out));
  EXPECT_EQ(overlap.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overlap.message(), HasSubstr("expert 2 is also held"));
  auto hidden = DenseMoeReference({&a, &c}, 8, x, ids, w, 1, 1, absl::MakeSpan(out));
  EXPECT_EQ(hidden.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(hidden.message(), HasSubstr("hidden"));
  auto outside = DenseMoeReference({&b}, 4, x, ids, w, 1, 1, absl::MakeSpan(out));
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(outside.message(), HasSubstr("outside"));
  auto unowned = DenseMoeReference({&a}, 8, x, ids, w, 1, 1, absl::MakeSpan(out));
  EXPECT_EQ(unowned.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(unowned.message(), HasSubstr("= 5: no ExpertSet"));
  auto shape = DenseMoeReference({&a}, 8, x, ids, w, 2, 1, absl::MakeSpan(out));
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.message(), HasSubstr("hidden: expected T * H = 2 * 2"));
}

// Checks the receive buffers of every destination against the inputs.
void CheckReceived(const EpReferenceResult& r, const std::vector<RankData>& data,
                   const ExpertPlacement& p, int64_t h, int k, int32_t invalid) {
  const int ep = p.ep_size();
  const int64_t rmax = r.runtime_max_tokens_per_rank;
  for (int d = 0; d < ep; ++d) {
    const EpRankReceive& rx = r.received[d];
    for (int s = 0; s < ep; ++s) {
      EXPECT_EQ(rx.counts[s], r.routes[s].send_counts[d]);
      int64_t prev = -1;
      for (int64_t slot = 0; slot < rmax; ++slot) {
        const int64_t row = s * rmax + slot;
        const int64_t t = rx.source_token[row];
        if (slot >= rx.counts[s]) {
          EXPECT_EQ(t, -1);
          for (int j = 0; j < k; ++j) {
            EXPECT_EQ(rx.ids[row * k + j], invalid);
            EXPECT_EQ(rx.weights[row * k + j], 0.0f);
          }
          for (int64_t c = 0; c < h; ++c) {
            EXPECT_EQ(rx.hidden[row * h + c], 0);
            EXPECT_EQ(rx.expert_out[row * h + c], 0);
          }
          continue;
        }
        EXPECT_GT(t, prev) << "slots fill in increasing source-token order";
        prev = t;
        bool has_local = false;
        for (int j = 0; j < k; ++j) {
          const int32_t id = data[s].ids[t * k + j];
          EXPECT_EQ(rx.ids[row * k + j], id);
          EXPECT_EQ(rx.weights[row * k + j], data[s].weights[t * k + j]);
          has_local |= p.IsValid(id) && p.RankOf(id) == d;
        }
        EXPECT_TRUE(has_local) << "token " << t << " of rank " << s << " sent to " << d;
        for (int64_t c = 0; c < h; ++c)
          EXPECT_EQ(rx.hidden[row * h + c], data[s].hidden[t * h + c]);
      }
    }
  }
}

TEST(ReferenceEpForward, MatchesDenseReferenceWithinBf16Rounding) {
  constexpr int64_t kH = 32, kI = 16;
  constexpr int kK = 4, kE = 10;  // 10 experts: uneven placement on 4 ranks
  for (int ep : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "ep_size " << ep);
    auto p = ExpertPlacement::Contiguous(kE, ep);
    ASSERT_TRUE(p.ok());
    std::vector<ExpertSet> sets = RankSets(*p, 99, 3, kH, kI);
    auto all = ExpertSet::GenerateSwiGlu(99, 3, 0, kE, kH, kI);
    ASSERT_TRUE(all.ok());
    std::mt19937 rng(1000 + ep);
    const std::vector<int64_t> counts = {13, 0, 7, 22};  // uneven, one rank empty
    std::vector<RankData> data;
    data.reserve(ep);
    std::vector<EpRankInput> inputs;
    inputs.reserve(ep);
    for (int s = 0; s < ep; ++s) data.push_back(RandomRank(rng, counts[s], kH, kK, kE));
    for (int s = 0; s < ep; ++s) inputs.push_back(data[s].Input());
    for (int32_t invalid : {-1, kE}) {
      auto r = ReferenceEpForward(*p, Ptrs(sets), inputs, kK, {invalid, -1});
      ASSERT_TRUE(r.ok()) << r.status();
      int64_t expect_r = 0;
      for (int s = 0; s < ep; ++s) expect_r = std::max(expect_r, counts[s]);
      EXPECT_EQ(r->runtime_max_tokens_per_rank, expect_r);
      CheckReceived(*r, data, *p, kH, kK, invalid);
      for (int s = 0; s < ep; ++s) {
        ASSERT_EQ(r->output[s].size(), static_cast<size_t>(counts[s] * kH));
        std::vector<float> dense(counts[s] * kH);
        ASSERT_TRUE(DenseMoeReference({&*all}, kE, data[s].hidden, data[s].ids, data[s].weights,
                                      counts[s], kK, absl::MakeSpan(dense))
                        .ok());
        const DispatchRoute& route = r->routes[s];
        for (int64_t t = 0; t < counts[s]; ++t) {
          for (int64_t c = 0; c < kH; ++c) {
            // Each destination's term is rounded to bf16 (2^-9 relative), the
            // fp32 sum is rounded again: bound 2^-8 (sum |terms| + |dense|).
            double terms = 0;
            for (int64_t j = route.token_offsets[t]; j < route.token_offsets[t + 1]; ++j) {
              const int64_t row = s * r->runtime_max_tokens_per_rank + route.dest_slot[j];
              terms +=
                  std::abs(Bf16ToFloat(r->received[route.dest_rank[j]].expert_out[row * kH + c]));
            }
            const float got = Bf16ToFloat(r->output[s][t * kH + c]);
            const float want = dense[t * kH + c];
            EXPECT_NEAR(got, want, std::ldexp(terms + std::abs(want), -8) + 1e-6)
                << "rank " << s << " token " << t << " col " << c;
            if (route.token_offsets[t] == route.token_offsets[t + 1]) {
              EXPECT_EQ(got, 0.0f);  // sent nowhere: zero output
            }
          }
        }
      }
    }
  }
}

TEST(ReferenceEpForward, IdentityExpertsGiveWeightSumTimesX) {
  // Values chosen so every product and sum is exact in bf16.
  auto p = ExpertPlacement::Contiguous(8, 2);
  ASSERT_TRUE(p.ok());
  std::vector<ExpertSet> sets = {ExpertSet::Identity(0, 4, 2), ExpertSet::Identity(4, 4, 2)};
  RankData r0{{FloatToBf16(1), FloatToBf16(2), FloatToBf16(-4), FloatToBf16(0.5f)},
              {0, 5, 1, 7, -1, 8},
              {0.25f, 0.5f, 0.125f, 0.5f, 0.25f, 0.25f},
              2};
  RankData r1{{FloatToBf16(3), FloatToBf16(-1)}, {6, 2, -1}, {0.75f, 0.125f, 1.0f}, 1};
  auto r = ReferenceEpForward(*p, Ptrs(sets), {r0.Input(), r1.Input()}, 3);
  ASSERT_TRUE(r.ok()) << r.status();
  // Rank 0: token 0 weights 0.25 + 0.5 + 0.125 = 0.875; token 1 only id 7: 0.5.
  auto f = [](const std::vector<bf16_t>& v) {
    std::vector<float> out;
    out.reserve(v.size());
    for (bf16_t b : v) out.push_back(Bf16ToFloat(b));
    return out;
  };
  EXPECT_THAT(f(r->output[0]), ElementsAre(0.875f, 1.75f, -2.0f, 0.25f));
  // Rank 1: 0.75 + 0.125 = 0.875 -> [2.625, -0.875].
  EXPECT_THAT(f(r->output[1]), ElementsAre(2.625f, -0.875f));
  // Rank 1 (experts 4..7) received token 0 and token 1 of rank 0, and its own.
  EXPECT_THAT(r->received[1].counts, ElementsAre(2, 1));
  EXPECT_THAT(r->received[0].counts, ElementsAre(1, 1));
  // Its term for rank 0's token 0 is 0.5 * x (expert 5 only).
  EXPECT_THAT(f(std::vector<bf16_t>(r->received[1].expert_out.begin(),
                                    r->received[1].expert_out.begin() + 2)),
              ElementsAre(0.5f, 1.0f));
}

TEST(ReferenceEpForward, DesignWorkedCase) {
  // DESIGN §7: E=4, 32 experts, K=4, ids [3, 9, 5, 30] -> ranks {0, 1, 3};
  // rank 0 computes w0*e3(x) + w2*e5(x).
  constexpr int64_t kH = 8, kI = 4;
  auto p = ExpertPlacement::Contiguous(32, 4);
  ASSERT_TRUE(p.ok());
  std::vector<ExpertSet> sets = RankSets(*p, 7, 0, kH, kI);
  auto all = ExpertSet::GenerateSwiGlu(7, 0, 0, 32, kH, kI);
  ASSERT_TRUE(all.ok());
  RankData src;
  src.num_tokens = 1;
  for (int c = 0; c < kH; ++c) src.hidden.push_back(FloatToBf16(0.25f * (c - 3)));
  src.ids = {3, 9, 5, 30};
  src.weights = {0.4f, 0.3f, 0.2f, 0.1f};
  RankData empty;
  auto r = ReferenceEpForward(*p, Ptrs(sets),
                              {src.Input(), empty.Input(), empty.Input(), empty.Input()}, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->routes[0].send_counts, ElementsAre(1, 1, 0, 1));
  EXPECT_EQ(r->runtime_max_tokens_per_rank, 1);
  EXPECT_THAT(r->received[2].counts, ElementsAre(0, 0, 0, 0));

  std::vector<float> x(kH), e3(kH), e5(kH), e9(kH), e30(kH);
  for (int c = 0; c < kH; ++c) x[c] = Bf16ToFloat(src.hidden[c]);
  ASSERT_TRUE(all->Apply(3, x, 1, absl::MakeSpan(e3)).ok());
  ASSERT_TRUE(all->Apply(5, x, 1, absl::MakeSpan(e5)).ok());
  ASSERT_TRUE(all->Apply(9, x, 1, absl::MakeSpan(e9)).ok());
  ASSERT_TRUE(all->Apply(30, x, 1, absl::MakeSpan(e30)).ok());
  for (int c = 0; c < kH; ++c) {
    const float rank0 = 0.4f * e3[c] + 0.2f * e5[c];
    EXPECT_NEAR(Bf16ToFloat(r->received[0].expert_out[c]), rank0,
                std::ldexp(std::abs(rank0), -8) + 1e-6);
    EXPECT_NEAR(Bf16ToFloat(r->received[1].expert_out[c]), 0.3f * e9[c],
                std::ldexp(std::abs(0.3f * e9[c]), -8) + 1e-6);
    EXPECT_NEAR(Bf16ToFloat(r->received[3].expert_out[c]), 0.1f * e30[c],
                std::ldexp(std::abs(0.1f * e30[c]), -8) + 1e-6);
  }
  EXPECT_THAT(r->received[0].ids,
              ElementsAre(3, 9, 5, 30, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
}

TEST(ReferenceEpForward, ExplicitRIsHonouredAndPadded) {
  auto p = ExpertPlacement::Contiguous(4, 2);
  ASSERT_TRUE(p.ok());
  std::vector<ExpertSet> sets = {ExpertSet::Identity(0, 2, 1), ExpertSet::Identity(2, 2, 1)};
  RankData a{{FloatToBf16(1)}, {3}, {1.0f}, 1};
  RankData b;
  auto r = ReferenceEpForward(*p, Ptrs(sets), {a.Input(), b.Input()}, 1, {4, 3});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->runtime_max_tokens_per_rank, 3);
  // Destination 1: [E=2, R=3, K=1]; slot (0, 0) holds the token, the rest pad with 4.
  EXPECT_THAT(r->received[1].ids, ElementsAre(3, 4, 4, 4, 4, 4));
  EXPECT_THAT(r->received[1].source_token, ElementsAre(0, -1, -1, -1, -1, -1));
  EXPECT_EQ(Bf16ToFloat(r->output[0][0]), 1.0f);
}

TEST(ReferenceEpForward, Errors) {
  auto p = ExpertPlacement::Contiguous(4, 2);
  ASSERT_TRUE(p.ok());
  ExpertSet s0 = ExpertSet::Identity(0, 2, 1), s1 = ExpertSet::Identity(2, 2, 1);
  ExpertSet wrong = ExpertSet::Identity(1, 2, 1);
  RankData a{{FloatToBf16(1), FloatToBf16(2)}, {3, 0}, {1.0f, 1.0f}, 2};
  RankData b;
  auto count = ReferenceEpForward(*p, {&s0}, {a.Input(), b.Input()}, 1);
  EXPECT_EQ(count.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(count.status().message(), HasSubstr("rank_experts"));
  auto placement = ReferenceEpForward(*p, {&s0, &wrong}, {a.Input(), b.Input()}, 1);
  EXPECT_EQ(placement.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(placement.status().message(), HasSubstr("expected experts [2, 4)"));
  auto invalid = ReferenceEpForward(*p, {&s0, &s1}, {a.Input(), b.Input()}, 1, {7, -1});
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(invalid.status().message(), HasSubstr("invalid_expert_id"));
  auto small_r = ReferenceEpForward(*p, {&s0, &s1}, {a.Input(), b.Input()}, 1, {-1, 1});
  EXPECT_EQ(small_r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(small_r.status().message(), HasSubstr("rank 0's num_tokens 2, got 1"));
  RankData bad{{FloatToBf16(1)}, {3, 0}, {1.0f, 1.0f}, 2};
  auto shape = ReferenceEpForward(*p, {&s0, &s1}, {bad.Input(), b.Input()}, 1);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shape.status().message(), HasSubstr("inputs[0]: hidden"));
}

TEST(DenseMoeReference, InputScalingIsExpertOfScaledInput) {
  // Llama-4 (issue 35 item 5): each term is e(w * x).
  ExpertSet set = *ExpertSet::GenerateSwiGlu(4, 0, 0, 4, 32, 16);
  set.set_router_weight_use(RouterWeightUse::kScalesInput);
  std::vector<bf16_t> hidden(2 * 32);
  for (int i = 0; i < 64; ++i) hidden[i] = FloatToBf16(0.05f * static_cast<float>(i % 9 - 4));
  const std::vector<int32_t> ids = {1, 3, 2, -1};
  const std::vector<float> weights = {0.25f, 0.75f, 0.5f, 0.0f};
  std::vector<float> out(64);
  ASSERT_TRUE(DenseMoeReference({&set}, 4, hidden, ids, weights, 2, 2, absl::MakeSpan(out)).ok());
  std::vector<float> want(64, 0.0f), xr(32), yr(32);
  for (int t = 0; t < 2; ++t) {
    for (int k = 0; k < 2; ++k) {
      const int id = ids[t * 2 + k];
      if (id < 0) continue;
      for (int c = 0; c < 32; ++c) xr[c] = weights[t * 2 + k] * Bf16ToFloat(hidden[t * 32 + c]);
      ASSERT_TRUE(set.Apply(id, xr, 1, absl::MakeSpan(yr)).ok());
      for (int c = 0; c < 32; ++c) want[t * 32 + c] += yr[c];
    }
  }
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(out[i], want[i], 1e-6f * (std::abs(want[i]) + 1e-3f));
  // Not w * e(x): SwiGLU is not linear.
  set.set_router_weight_use(RouterWeightUse::kScalesOutput);
  std::vector<float> scaled_out(64);
  ASSERT_TRUE(
      DenseMoeReference({&set}, 4, hidden, ids, weights, 2, 2, absl::MakeSpan(scaled_out)).ok());
  double differ = 0.0;
  for (int i = 0; i < 64; ++i) differ = std::max<double>(differ, std::abs(out[i] - scaled_out[i]));
  EXPECT_GT(differ, 1e-4);
}

}  // namespace
}  // namespace moe_ep::core
