#include "kernels/nccl_collective.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "kernels/staged_control_collective.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;

TEST(NcclCollective, RejectsBadUniqueIdAndRank) {
  // Argument checks come before any CUDA call: runs without a GPU too.
  EXPECT_EQ(NcclCollective::Create("short", 0, 1, 0, std::chrono::seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string id(NCCL_UNIQUE_ID_BYTES, '\0');
  auto s = NcclCollective::Create(id, 2, 2, 0, std::chrono::seconds(1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("rank"), std::string::npos) << s;
}

TEST(NcclCollective, MissingPeerTimesOutInsteadOfHanging) {
  MOE_EP_REQUIRE_GPUS(1);
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const auto start = std::chrono::steady_clock::now();
  auto c = NcclCollective::Create(*id, 0, 2, 0, std::chrono::milliseconds(3000));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_LT(took, std::chrono::seconds(30));
}

// Runs `body(rank, collective)` on two threads, one GPU each.
void RunTwoRanks(std::chrono::milliseconds timeout,
                 const std::function<void(int, NcclCollective&)>& body) {
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<std::thread> threads;
  threads.reserve(2);
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
      auto c = NcclCollective::Create(*id, rank, 2, rank, timeout);
      ASSERT_TRUE(c.ok()) << c.status();
      body(rank, **c);
    });
  }
  for (auto& t : threads) t.join();
}

// Host- and device-memory all-gather, all-to-all-v with uneven counts,
// all-reduce, barrier.
TEST(NcclCollective, TwoRanksHostAndDeviceCollectives) {
  MOE_EP_REQUIRE_GPUS(2);
  RunTwoRanks(std::chrono::seconds(30), [](int rank, NcclCollective& coll) {
    StagedControlCollective ctrl(&coll);  // the host-memory view
    EXPECT_EQ(ctrl.backend(), "nccl");
    auto counts = core::AllGatherInt64(ctrl, 10 + rank);
    ASSERT_TRUE(counts.ok()) << counts.status();
    EXPECT_EQ(*counts, (std::vector<int64_t>{10, 11}));
    // Rank r sends (p + 1) * (r + 1) bytes of value 16r + p to peer p.
    std::vector<int64_t> send_bytes = {1 * (rank + 1), 2 * (rank + 1)};
    // Peer p sends (rank + 1) * (p + 1) bytes to this rank.
    std::vector<int64_t> recv_bytes = {rank + 1, 2 * (rank + 1)};
    std::vector<uint8_t> send;
    for (int p = 0; p < 2; ++p) send.insert(send.end(), send_bytes[p], 16 * rank + p);
    std::vector<uint8_t> recv(recv_bytes[0] + recv_bytes[1]);
    ASSERT_TRUE(ctrl.AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes).ok());
    std::vector<uint8_t> want;
    for (int p = 0; p < 2; ++p) want.insert(want.end(), recv_bytes[p], 16 * p + rank);
    EXPECT_EQ(recv, want);
    DeviceBuffer<uint8_t> dsend(send);
    DeviceBuffer<uint8_t> drecv(recv.size());
    ASSERT_TRUE(coll.AllToAllV(dsend.get(), send_bytes, drecv.get(), recv_bytes).ok());
    ASSERT_TRUE(coll.Synchronize().ok());
    EXPECT_EQ(drecv.Download(recv.size()), want);
    std::vector<float> v = {1.0f + rank, 2.0f};
    ASSERT_TRUE(ctrl.AllReduceSum(v.data(), 2).ok());
    EXPECT_EQ(v, (std::vector<float>{3.0f, 4.0f}));
    DeviceBuffer<float> dv(std::vector<float>{0.5f, -1.0f * rank});
    ASSERT_TRUE(coll.AllReduceSum(dv.get(), 2).ok());
    ASSERT_TRUE(coll.Synchronize().ok());
    EXPECT_EQ(dv.Download(2), (std::vector<float>{1.0f, -1.0f}));
    EXPECT_EQ(coll.AllToAllV(send.data(), {1}, recv.data(), recv_bytes).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ctrl.AllGather(send.data(), -1, recv.data()).code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(ctrl.Barrier().ok());
  });
}

TEST(NcclCollective, SplitIntoSingletons) {
  MOE_EP_REQUIRE_GPUS(2);
  RunTwoRanks(std::chrono::seconds(30), [](int rank, NcclCollective& coll) {
    const int mine[1] = {rank};
    const int other[1] = {1 - rank};
    EXPECT_EQ(coll.Split(other, "bad").status().code(), absl::StatusCode::kInvalidArgument);
    auto sub = coll.Split(mine, "solo." + std::to_string(rank));
    ASSERT_TRUE(sub.ok()) << sub.status();
    EXPECT_EQ((*sub)->size(), 1);
    EXPECT_EQ((*sub)->rank(), 0);
    StagedControlCollective sub_ctrl(sub->get());
    auto solo = core::AllGatherInt64(sub_ctrl, 42);
    ASSERT_TRUE(solo.ok()) << solo.status();
    EXPECT_EQ(*solo, std::vector<int64_t>{42});
  });
}

// Rank 1 never joins rank 0's all-reduce: rank 0 gets an error within the
// timeout (never a hang), then kFailedPrecondition from the broken group.
TEST(NcclCollective, DeadPeerFailsWithinDeadline) {
  MOE_EP_REQUIRE_GPUS(2);
  RunTwoRanks(std::chrono::seconds(3), [](int rank, NcclCollective& coll) {
    StagedControlCollective ctrl(&coll);
    ASSERT_TRUE(ctrl.Barrier().ok());
    if (rank == 0) {
      float x = 1.0f;
      const auto start = std::chrono::steady_clock::now();
      const absl::Status s = ctrl.AllReduceSum(&x, 1);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
      EXPECT_TRUE(s.code() == absl::StatusCode::kDeadlineExceeded ||
                  s.code() == absl::StatusCode::kUnavailable)
          << s;
      EXPECT_EQ(ctrl.Barrier().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_FALSE(coll.healthy());
    }
  });
}

}  // namespace
}  // namespace moe_ep::kernels
