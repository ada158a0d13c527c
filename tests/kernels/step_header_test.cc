#include "kernels/step_header.cuh"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tests/kernels/gpu_test_util.h"

// The step header kernels on one GPU with hand-made exchanges (what the
// header all-to-all would have gathered): a refused step's header (issue 30
// item 1) and what each rank's check records of it, beside the (epoch, R)
// disagreement it ranks after. The exchange itself is GpuEpDispatcher's
// (tests/kernels/gpu_ep_dispatcher_test.cc).

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;

StepHeaderError ReadError(const DeviceBuffer<StepHeaderError>& error) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return error.Download(1)[0];
}

// A refused header keeps this rank's T (0) and sends kRefusedStepTokens.
TEST(LaunchWriteStepHeader, RefusedHeaderSendsTheRefusalAndKeepsZeroTokensHere) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> header(std::vector<int64_t>(3, 99));
  DeviceBuffer<int64_t> replicas(std::vector<int64_t>(3 * 3, 99));
  ASSERT_TRUE(LaunchWriteStepHeader(header.get(), replicas.get(), 3, 7, 16, 0, HeaderRefusal::kStep,
                                    nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(header.Download(3), (std::vector<int64_t>{7, 16, 0}));
  EXPECT_EQ(replicas.Download(9),
            (std::vector<int64_t>{7, 16, kRefusedStepTokens, 7, 16, kRefusedStepTokens, 7, 16,
                                  kRefusedStepTokens}));
  ASSERT_TRUE(LaunchWriteStepHeader(header.get(), replicas.get(), 3, 8, 16, 5, HeaderRefusal::kNone,
                                    nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(header.Download(3), (std::vector<int64_t>{8, 16, 5}));
  EXPECT_EQ(replicas.Download(9), (std::vector<int64_t>{8, 16, 5, 8, 16, 5, 8, 16, 5}));
  // A refused combine (GpuEpDispatcher::RefuseCombine) sends
  // kRefusedCombineTokens, keeping this rank's T as given.
  ASSERT_TRUE(LaunchWriteStepHeader(header.get(), replicas.get(), 2, 9, 16, 0,
                                    HeaderRefusal::kCombine, nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(header.Download(3), (std::vector<int64_t>{9, 16, 0}));
  EXPECT_EQ(replicas.Download(9), (std::vector<int64_t>{9, 16, kRefusedCombineTokens, 9, 16,
                                                        kRefusedCombineTokens, 8, 16, 5}));
}

// Rank 1 of 3 refused (epoch 7, R 16): ranks 0 and 2 record it with
// refused = 1 and drop their T to 0; rank 1 records nothing and its T is 0.
TEST(LaunchCheckStepHeaders, PeersRecordTheRefusingRankAndItRecordsNothing) {
  MOE_EP_REQUIRE_GPUS(1);
  const std::vector<int64_t> gathered = {7, 16, 4, 7, 16, kRefusedStepTokens, 7, 16, 9};
  DeviceBuffer<int64_t> exchanged(gathered);
  for (int rank = 0; rank < 3; ++rank) {
    // This rank's own header: its T, 0 on the refusing rank.
    const int64_t own_tokens = rank == 1 ? 0 : gathered[3 * rank + 2];
    DeviceBuffer<int64_t> header(std::vector<int64_t>{7, 16, own_tokens});
    DeviceBuffer<StepHeaderError> error(std::vector<StepHeaderError>(1));
    ASSERT_TRUE(
        LaunchCheckStepHeaders(exchanged.get(), 3, rank, header.get(), error.get(), nullptr).ok());
    const StepHeaderError e = ReadError(error);
    EXPECT_EQ(header.Download(3)[2], 0) << "rank " << rank;
    if (rank == 1) {
      EXPECT_EQ(e.rank_plus_1, 0);
      EXPECT_EQ(e.refused, 0);
      continue;
    }
    EXPECT_EQ(e.rank_plus_1, 2) << "rank " << rank;
    EXPECT_EQ(e.refused, 1) << "rank " << rank;
    EXPECT_EQ(e.r_differs, 0) << "rank " << rank;
    EXPECT_EQ(e.their_epoch, 7);
    EXPECT_EQ(e.their_r, 16);
    EXPECT_EQ(e.my_epoch, 7);
    EXPECT_EQ(e.my_r, 16);
  }
}

// A geometry disagreement is recorded before a refusal (it may have sized
// the transfers differently); a record already there stays.
TEST(LaunchCheckStepHeaders, MismatchRanksBeforeARefusalAndTheFirstRecordSticks) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> exchanged(
      std::vector<int64_t>{7, 16, 3, 7, 16, kRefusedStepTokens, 8, 16, 2});
  DeviceBuffer<int64_t> header(std::vector<int64_t>{7, 16, 3});
  DeviceBuffer<StepHeaderError> error(std::vector<StepHeaderError>(1));
  ASSERT_TRUE(
      LaunchCheckStepHeaders(exchanged.get(), 3, 0, header.get(), error.get(), nullptr).ok());
  StepHeaderError e = ReadError(error);
  EXPECT_EQ(e.rank_plus_1, 3);
  EXPECT_EQ(e.refused, 0);
  EXPECT_EQ(e.their_epoch, 8);
  EXPECT_EQ(header.Download(3)[2], 0);

  DeviceBuffer<int64_t> refusal(std::vector<int64_t>{7, 16, 3, 7, 16, kRefusedStepTokens});
  header.Upload({7, 16, 3});
  ASSERT_TRUE(LaunchCheckStepHeaders(refusal.get(), 2, 0, header.get(), error.get(), nullptr).ok());
  e = ReadError(error);
  EXPECT_EQ(e.rank_plus_1, 3) << "the first record stays until the owner resets it";
  EXPECT_EQ(e.refused, 0);
  EXPECT_EQ(header.Download(3)[2], 0);
}

TEST(LaunchCheckStepHeaders, RankOutsideTheGroupIsInvalidArgument) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int64_t> exchanged(std::vector<int64_t>(6, 0));
  DeviceBuffer<int64_t> header(std::vector<int64_t>(3, 0));
  DeviceBuffer<StepHeaderError> error(std::vector<StepHeaderError>(1));
  const absl::Status s =
      LaunchCheckStepHeaders(exchanged.get(), 2, 2, header.get(), error.get(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("rank expected in [0, 2) (ep_size), got 2"), std::string::npos) << s;
}

}  // namespace
}  // namespace moe_ep::kernels
