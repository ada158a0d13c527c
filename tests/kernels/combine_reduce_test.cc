#include "kernels/combine_reduce.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/kernels/gpu_test_util.h"

// The combine reduction on one GPU with a hand-made receive region: the
// sums it writes, and its check of the combine's step headers (a peer's
// refused combine, issue 30 item 1): no row written, the refusal recorded
// on the peers only, an earlier record kept.

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;

uint16_t Bf16(float f) {
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof(bits));
  return static_cast<uint16_t>(bits >> 16);  // exact for the small integers used here
}

// E = 2, R = 2, H = 4, T = 2. Token 0 went to both ranks (slots 0 and 1),
// token 1 only to rank 1 (slot 0). Rank d's row in slot s holds the value
// 10 * d + s + 1 in every element: token 0 sums 1 + 12 = 13, token 1 is 11.
struct Case {
  static constexpr int kRanks = 2;
  static constexpr int64_t kR = 2;
  static constexpr int64_t kH = 4;
  DeviceBuffer<uint16_t> recv{Rows()};
  DeviceBuffer<int32_t> token_slot{std::vector<int32_t>{0, 1, -1, 0}};
  DeviceBuffer<int64_t> num_tokens{std::vector<int64_t>{2}};
  DeviceBuffer<uint16_t> output{std::vector<uint16_t>(kR * kH, 0xffff)};
  DeviceBuffer<StepHeaderError> error{std::vector<StepHeaderError>(1)};

  static std::vector<uint16_t> Rows() {
    std::vector<uint16_t> rows(kRanks * kR * kH);
    for (int d = 0; d < kRanks; ++d) {
      for (int64_t s = 0; s < kR; ++s) {
        for (int64_t h = 0; h < kH; ++h) {
          rows[(d * kR + s) * kH + h] = Bf16(static_cast<float>(10 * d + s + 1));
        }
      }
    }
    return rows;
  }
  CombineReduceParams Params(const int64_t* headers, int rank) {
    CombineReduceParams p;
    p.recv = recv.get();
    p.token_slot = token_slot.get();
    p.num_tokens = num_tokens.get();
    p.max_tokens = kR;
    p.hidden_size = kH;
    p.ep_size = kRanks;
    p.output = output.get();
    p.headers = headers;
    p.rank = rank;
    p.error = error.get();
    return p;
  }
  std::vector<uint16_t> Output() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return output.Download(kR * kH);
  }
  StepHeaderError Error() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return error.Download(1)[0];
  }
};

const std::vector<uint16_t> kSums = {Bf16(13), Bf16(13), Bf16(13), Bf16(13),
                                     Bf16(11), Bf16(11), Bf16(11), Bf16(11)};
const std::vector<uint16_t> kUntouched(Case::kR* Case::kH, 0xffff);

TEST(LaunchCombineReduce, SumsEachTokensRowsWithAndWithoutAgreeingHeaders) {
  MOE_EP_REQUIRE_GPUS(1);
  Case c;
  ASSERT_TRUE(LaunchCombineReduce(c.Params(nullptr, 0), nullptr).ok());
  EXPECT_EQ(c.Output(), kSums);
  Case checked;
  DeviceBuffer<int64_t> headers(std::vector<int64_t>{5, 2, 2, 5, 2, 1});
  ASSERT_TRUE(LaunchCombineReduce(checked.Params(headers.get(), 1), nullptr).ok());
  EXPECT_EQ(checked.Output(), kSums);
  EXPECT_EQ(checked.Error().rank_plus_1, 0);
}

// Rank 1 of 2 refused its combine at epoch 5: rank 0 writes no row and
// records rank 1 (refused, combine); rank 1 writes none and records nothing.
TEST(LaunchCombineReduce, APeersRefusedCombineWritesNoRowAndIsRecorded) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> headers(std::vector<int64_t>{5, 2, 2, 5, 2, kRefusedCombineTokens});
  Case peer;
  ASSERT_TRUE(LaunchCombineReduce(peer.Params(headers.get(), 0), nullptr).ok());
  EXPECT_EQ(peer.Output(), kUntouched);
  const StepHeaderError e = peer.Error();
  EXPECT_EQ(e.rank_plus_1, 2);
  EXPECT_EQ(e.refused, 1);
  EXPECT_EQ(e.combine, 1);
  EXPECT_EQ(e.their_epoch, 5);
  EXPECT_EQ(e.their_r, 2);
  EXPECT_EQ(e.r_differs, 0);
  Case own;
  ASSERT_TRUE(LaunchCombineReduce(own.Params(headers.get(), 1), nullptr).ok());
  EXPECT_EQ(own.Output(), kUntouched);
  EXPECT_EQ(own.Error().rank_plus_1, 0);
}

// A refused step's header (kRefusedStepTokens) is the dispatch check's to
// record; the reduction leaves it alone and sums as usual (the dispatch
// check already set T to 0 on the ranks that saw it).
TEST(LaunchCombineReduce, ARefusedStepsHeaderIsNotACombineRefusal) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> headers(std::vector<int64_t>{5, 2, kRefusedStepTokens, 5, 2, 1});
  Case c;
  ASSERT_TRUE(LaunchCombineReduce(c.Params(headers.get(), 1), nullptr).ok());
  EXPECT_EQ(c.Output(), kSums);
  EXPECT_EQ(c.Error().rank_plus_1, 0);
}

// An earlier record sticks; at R = 0 (no row to write) block 0 still checks.
TEST(LaunchCombineReduce, AnEarlierRecordSticksAndRZeroStillChecks) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> headers(std::vector<int64_t>{6, 0, kRefusedCombineTokens, 6, 0, 0});
  Case fresh;
  CombineReduceParams p = fresh.Params(headers.get(), 1);
  p.max_tokens = 0;
  p.output = nullptr;
  ASSERT_TRUE(LaunchCombineReduce(p, nullptr).ok());
  EXPECT_EQ(fresh.Error().rank_plus_1, 1);
  EXPECT_EQ(fresh.Error().combine, 1);
  StepHeaderError earlier;
  earlier.rank_plus_1 = 2;  // a disagreement recorded at the dispatch
  earlier.their_epoch = 3;
  Case kept;
  kept.error.Upload(std::vector<StepHeaderError>{earlier});
  ASSERT_TRUE(LaunchCombineReduce(kept.Params(headers.get(), 1), nullptr).ok());
  const StepHeaderError e = kept.Error();
  EXPECT_EQ(e.rank_plus_1, 2);
  EXPECT_EQ(e.their_epoch, 3);
  EXPECT_EQ(e.combine, 0);
  EXPECT_EQ(kept.Output(), kUntouched);
}

// Host checks only (no launch happens, so no GPU is needed).
TEST(LaunchCombineReduce, HeadersNeedAnErrorRecordAndARankInRange) {
  int64_t scalar = 0;
  StepHeaderError record;
  CombineReduceParams p;
  p.num_tokens = &scalar;
  p.hidden_size = 4;
  p.ep_size = 2;
  p.max_tokens = 0;
  p.headers = &scalar;
  p.error = &record;
  p.rank = 2;  // outside [0, E)
  EXPECT_EQ(LaunchCombineReduce(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.rank = 0;
  p.error = nullptr;
  EXPECT_EQ(LaunchCombineReduce(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::kernels
