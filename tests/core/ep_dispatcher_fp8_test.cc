// fp8 e4m3 dispatch on the CPU data plane (issue 15 item 4): the pack
// quantizes (core/fp8_e4m3.h), the e4m3 rows and fp32 scales travel in the
// workspace, the dequantizing pass gives the experts bf16 rows, combine stays
// bf16. Checked against core::ReferenceEpForward applying the same rounding
// (bit for bit), and against the unquantized dense result within the error
// that e4m3's 3 mantissa bits allow.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "core/dispatch_rounding.h"
#include "core/ep_dispatcher.h"
#include "core/fp8_e4m3.h"
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
using ::moe_ep::core::testing::RandomInputWith;
using ::moe_ep::core::testing::RunEp;
using ::moe_ep::core::testing::StepInput;
using ::testing::HasSubstr;

EpDispatcherOptions Fp8Options(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                               int num_experts) {
  return DispatcherOptions(ep_size, capacity, hidden, top_k, num_experts, DispatchDType::kFP8E4M3);
}

// Values over several binades (so that blocks mix normals and e4m3
// subnormals) and distinct valid experts.
StepInput Fp8RandomInput(uint32_t seed, int64_t tokens, int64_t hidden, int top_k,
                         int num_experts) {
  std::normal_distribution<float> val(0.0f, 1.0f);
  std::uniform_int_distribution<int> binade(-12, 3);
  return RandomInputWith(seed, tokens, hidden, top_k, num_experts, [&](std::mt19937& gen) {
    const float v = val(gen);
    return std::ldexp(v, binade(gen));
  });
}

TEST(EpDispatcherFp8, CreateRefusesHiddenOffTheScaleBlock) {
  auto store = NewHashStore();
  auto group = JoinLoopback(store, 0, 1, absl::Seconds(20));
  ASSERT_TRUE(group.ok()) << group.status();
  auto bad = EpDispatcher::Create(group->get(), Fp8Options(1, 4, 64, 2, 4), 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("multiple of 128"));
  // The other sized dtypes are refused, naming what the CPU plane moves.
  EpDispatcherOptions fp4 = Fp8Options(1, 4, 128, 2, 4);
  fp4.workspace.dtype = DispatchDType::kNVFP4;
  auto refused = EpDispatcher::Create(group->get(), fp4, 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("workspace.dtype (dispatch_dtype): the CPU data plane moves bf16 or "
                        "fp8_e4m3, got nvfp4"));
  fp4.workspace.dtype = DispatchDType::kMXFP8;
  EXPECT_THAT(std::string(EpDispatcher::Create(group->get(), fp4, 0).status().message()),
              HasSubstr("got mxfp8"));
  // fp8 allocates DESIGN §5's dispatch bytes (H + H/32 + 8K a token) plus
  // the dequantized rows [E, N, H] bf16.
  auto ok = EpDispatcher::Create(group->get(), Fp8Options(1, 4, 128, 2, 4), 0);
  ASSERT_TRUE(ok.ok()) << ok.status();
  const CpuWorkspaceLayout& layout = (*ok)->layout();
  EXPECT_EQ(layout.dispatch_send.size_bytes, 4 * (128 + 4 + 16));
  EXPECT_EQ(layout.dispatch_dequant.size_bytes, 4 * 128 * 2);
  EXPECT_EQ(layout.Regions()[4].name, "dispatch_dequant");
}

struct Fp8Case {
  int ep_size;
  bool swiglu;
};

class EpDispatcherFp8Test : public ::testing::TestWithParam<Fp8Case> {};

// Received rows, expert outputs and the combined output equal the reference
// that applies the same fp8 rounding, bit for bit; the last rank has no
// tokens.
TEST_P(EpDispatcherFp8Test, MatchesTheReferenceWithTheSameRounding) {
  const int ep = GetParam().ep_size;
  const int64_t h = 256;  // two scale blocks
  const int64_t inter = 32;
  const int k = 3;
  const int num_experts = 8;
  auto tokens_of = [&](int rank) -> int64_t {
    return (ep > 1 && rank == ep - 1) ? 0 : 3 + 2 * rank;
  };
  std::vector<StepInput> inputs;
  inputs.reserve(ep);
  for (int r = 0; r < ep; ++r)
    inputs.push_back(Fp8RandomInput(40 + r, tokens_of(r), h, k, num_experts));
  auto placement = ExpertPlacement::Contiguous(num_experts, ep).value();
  std::vector<ExpertSet> sets;
  sets.reserve(ep);
  for (int r = 0; r < ep; ++r) {
    sets.push_back(
        GetParam().swiglu
            ? ExpertSet::GenerateSwiGlu(7, 0, placement.FirstExpert(r),
                                        placement.NumLocalExperts(r), h, inter)
                  .value()
            : ExpertSet::Identity(placement.FirstExpert(r), placement.NumLocalExperts(r), h));
  }
  std::vector<const ExpertSet*> set_ptrs;
  std::vector<EpRankInput> ref_inputs;
  for (int r = 0; r < ep; ++r) {
    set_ptrs.push_back(&sets[r]);
    ref_inputs.push_back(
        EpRankInput{inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].tokens});
  }
  EpReferenceOptions ref_options;
  ref_options.dispatch_dtype = DispatchDType::kFP8E4M3;
  auto ref = ReferenceEpForward(placement, set_ptrs, ref_inputs, k, ref_options);
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto bf16_ref = ReferenceEpForward(placement, set_ptrs, ref_inputs, k);
  ASSERT_TRUE(bf16_ref.ok()) << bf16_ref.status();
  const int64_t r_max = ref->runtime_max_tokens_per_rank;

  RunEp(ep, Fp8Options(ep, 8, h, k, num_experts), [&](int rank, EpDispatcher& d) {
    const StepInput& in = inputs[rank];
    ASSERT_TRUE(d.CommitGeometry(3, r_max, in.tokens).ok());
    ASSERT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, in.tokens).ok());
    const EpRankReceive& rx = ref->received[rank];
    EXPECT_EQ(d.received_counts(), rx.counts);
    for (int s = 0; s < ep; ++s) {
      auto rh = d.ReceivedHidden(s);
      ASSERT_EQ(static_cast<int64_t>(rh.size()), r_max * h);
      EXPECT_TRUE(std::equal(rh.begin(), rh.end(), rx.hidden.begin() + s * r_max * h))
          << "dequantized hidden from source " << s;
      auto ri = d.ReceivedIds(s);
      EXPECT_TRUE(std::equal(ri.begin(), ri.end(), rx.ids.begin() + s * r_max * k));
      auto rw = d.ReceivedWeights(s);
      EXPECT_TRUE(std::equal(rw.begin(), rw.end(), rx.weights.begin() + s * r_max * k));
    }
    // The fp8 rounding did change the rows (the check above is not the bf16 one).
    bool differs = false;
    for (int s = 0; s < ep; ++s) {
      auto rh = d.ReceivedHidden(s);
      differs |= !std::equal(rh.begin(), rh.end(),
                             bf16_ref->received[rank].hidden.begin() + s * r_max * h);
    }
    if (std::any_of(rx.counts.begin(), rx.counts.end(), [](int64_t c) { return c > 0; })) {
      EXPECT_TRUE(differs) << "rank " << rank;
    }
    ASSERT_TRUE(d.ComputeExperts(sets[rank]).ok());
    std::vector<bf16_t> out(in.tokens * h);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, ref->output[rank]) << "rank " << rank;
    // Wire bytes: DESIGN §5's fp8 row, H + H/32 + 8K = 256 + 8 + 24 a token.
    int64_t remote_rows = 0;
    for (int p = 0; p < ep; ++p) {
      if (p != rank)
        remote_rows += static_cast<int64_t>(ref->routes[rank].tokens_for_rank[p].size());
    }
    int64_t combine_remote = 0;
    for (int p = 0; p < ep; ++p) {
      if (p != rank) combine_remote += rx.counts[p] * 2 * h;
    }
    EXPECT_EQ(d.last_step().bytes_sent_remote, remote_rows * (256 + 8 + 24) + combine_remote);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpDispatcherFp8Test,
                         ::testing::Values(Fp8Case{1, false}, Fp8Case{2, false}, Fp8Case{2, true},
                                           Fp8Case{4, true}),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) {
                           return "E" + std::to_string(info.param.ep_size) +
                                  (info.param.swiglu ? "_swiglu" : "_identity");
                         });

// Against the unquantized input: with identity experts out = sum_k w_k x~,
// and each x~ is within 2^-4 |x| + 2^-10 * scale of x (core/fp8_e4m3.h), so
//   |out - sum_k w_k x| <= sum_k w_k (2^-4 |x| + 2^-10 scale) + bf16 terms,
// the bf16 terms being the dispatched row's, the partial sums' and the
// output's rounding (2^-8 relative each, as the bf16 tests bound them).
TEST(EpDispatcherFp8, IdentityWithinTheE4m3Bound) {
  const int ep = 2;
  const int64_t h = 128;
  const int k = 2;
  const int num_experts = 4;
  RunEp(ep, Fp8Options(ep, 16, h, k, num_experts), [&](int rank, EpDispatcher& d) {
    const StepInput in = Fp8RandomInput(90 + rank, 9, h, k, num_experts);
    ASSERT_TRUE(d.CommitGeometry(1, 9, 9).ok());
    auto placement = ExpertPlacement::Contiguous(num_experts, ep).value();
    ExpertSet experts =
        ExpertSet::Identity(placement.FirstExpert(rank), placement.NumLocalExperts(rank), h);
    std::vector<bf16_t> out(9 * h);
    ASSERT_TRUE(d.Forward(in.hidden, in.ids, in.weights, 9, experts, absl::MakeSpan(out)).ok());
    double worst = 0.0;
    for (int64_t t = 0; t < 9; ++t) {
      float amax = 0.0f;
      for (int64_t i = 0; i < h; ++i)
        amax = std::max(amax, std::abs(Bf16ToFloat(in.hidden[t * h + i])));
      const double scale = fp8::BlockScale(amax);
      double wsum = 0;
      for (int j = 0; j < k; ++j) wsum += in.weights[t * k + j];
      for (int64_t i = 0; i < h; ++i) {
        const double x = Bf16ToFloat(in.hidden[t * h + i]);
        const double exact = wsum * x;
        const double fp8_bound =
            wsum * (kFp8E4m3RelativeError * std::abs(x) + std::ldexp(scale, -10));
        const double bf16_bound = 3.0 / 256.0 * wsum * std::abs(x) * (1 + kFp8E4m3RelativeError);
        const double err = std::abs(Bf16ToFloat(out[t * h + i]) - exact);
        EXPECT_LE(err, fp8_bound + bf16_bound) << "token " << t << " elem " << i;
        worst = std::max(worst, err / (fp8_bound + bf16_bound));
      }
    }
    EXPECT_GT(worst, 0.25);  // fp8 rounding is visible: the bound is not slack
  });
}

}  // namespace
}  // namespace moe_ep::core
