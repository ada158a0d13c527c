#include "core/gloo_collective.h"

#include <signal.h>

#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::HasSubstr;

// Bytes rank `src` sends to rank `dst` in the uneven all-to-all: some pairs
// (including self pairs) send nothing.
int64_t PairBytes(int src, int dst) { return (src * 3 + dst * 5 + 1) % 4 * 3; }
uint8_t PairByte(int src, int dst, int64_t i) {
  return static_cast<uint8_t>(src * 31 + dst * 7 + i * 13 + 1);
}

class GlooCollectiveGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooCollectiveGroupTest, AllToAllVUnevenAndZeroCountsDeliverExactBytes) {
  const int n = GetParam();
  auto store = NewHashStore();
  RunOnRanks(n, [&](int rank) {
    auto group = JoinLoopback(store, rank, n);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ((*group)->rank(), rank);
    EXPECT_EQ((*group)->size(), n);
    EXPECT_EQ((*group)->backend(), "gloo");
    std::vector<int64_t> send_bytes(n), recv_bytes(n);
    std::vector<uint8_t> send;
    for (int p = 0; p < n; ++p) {
      send_bytes[p] = PairBytes(rank, p);
      recv_bytes[p] = PairBytes(p, rank);
      for (int64_t i = 0; i < send_bytes[p]; ++i) send.push_back(PairByte(rank, p, i));
    }
    std::vector<uint8_t> recv(std::accumulate(recv_bytes.begin(), recv_bytes.end(), int64_t{0}),
                              0xEE);
    ASSERT_TRUE((*group)->AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes).ok());
    size_t off = 0;
    for (int s = 0; s < n; ++s) {
      for (int64_t i = 0; i < recv_bytes[s]; ++i) {
        EXPECT_EQ(recv[off++], PairByte(s, rank, i)) << "rank " << rank << " from " << s;
      }
    }
    // Second call on the same group: all counts zero, null buffers.
    std::vector<int64_t> zeros(n, 0);
    EXPECT_TRUE((*group)->AllToAllV(nullptr, zeros, nullptr, zeros).ok());
  });
}

TEST_P(GlooCollectiveGroupTest, AllGatherIsRankMajor) {
  const int n = GetParam();
  auto store = NewHashStore();
  RunOnRanks(n, [&](int rank) {
    auto group = JoinLoopback(store, rank, n);
    ASSERT_TRUE(group.ok()) << group.status();
    int32_t mine[3] = {rank * 10, rank * 10 + 1, -rank};
    std::vector<int32_t> all(3 * n, 0);
    ASSERT_TRUE((*group)->AllGather(mine, sizeof(mine), all.data()).ok());
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(all[3 * r], r * 10);
      EXPECT_EQ(all[3 * r + 1], r * 10 + 1);
      EXPECT_EQ(all[3 * r + 2], -r);
    }
    auto counts = AllGatherInt64(**group, int64_t{1} << 40 | rank);
    ASSERT_TRUE(counts.ok()) << counts.status();
    ASSERT_EQ(counts->size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) EXPECT_EQ((*counts)[r], int64_t{1} << 40 | r);
    EXPECT_TRUE((*group)->AllGather(nullptr, 0, nullptr).ok());
  });
}

TEST_P(GlooCollectiveGroupTest, AllReduceSumAndBarrier) {
  const int n = GetParam();
  auto store = NewHashStore();
  RunOnRanks(n, [&](int rank) {
    auto group = JoinLoopback(store, rank, n);
    ASSERT_TRUE(group.ok()) << group.status();
    std::vector<float> data(5);
    for (int i = 0; i < 5; ++i) data[i] = static_cast<float>(rank) + 0.5f * i;
    ASSERT_TRUE((*group)->AllReduceSum(data.data(), 5).ok());
    const float rank_sum = n * (n - 1) / 2.0f;
    for (int i = 0; i < 5; ++i) EXPECT_FLOAT_EQ(data[i], rank_sum + n * 0.5f * i);
    EXPECT_TRUE((*group)->AllReduceSum(nullptr, 0).ok());
    EXPECT_TRUE((*group)->Barrier().ok());
  });
}

TEST_P(GlooCollectiveGroupTest, SplitFormsIndependentSubGroups) {
  const int n = GetParam();
  auto store = NewHashStore();
  // Two halves (n = 1: one group of one).
  const int half = n > 1 ? n / 2 : 1;
  RunOnRanks(n, [&](int rank) {
    auto group = JoinLoopback(store, rank, n);
    ASSERT_TRUE(group.ok()) << group.status();
    const int first = rank < half ? 0 : half;
    const int last = rank < half ? half : n;
    std::vector<int> members;
    for (int r = first; r < last; ++r) members.push_back(r);
    auto sub = (*group)->Split(members, rank < half ? "attn_tp.0" : "attn_tp.1");
    ASSERT_TRUE(sub.ok()) << sub.status();
    EXPECT_EQ((*sub)->size(), last - first);
    EXPECT_EQ((*sub)->rank(), rank - first);
    float v = static_cast<float>(rank + 1);
    ASSERT_TRUE((*sub)->AllReduceSum(&v, 1).ok());
    float expected = 0;
    for (int r = first; r < last; ++r) expected += static_cast<float>(r + 1);
    EXPECT_FLOAT_EQ(v, expected);
    // The parent group still works after the split.
    float w = 1.0f;
    ASSERT_TRUE((*group)->AllReduceSum(&w, 1).ok());
    EXPECT_FLOAT_EQ(w, static_cast<float>(n));
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooCollectiveGroupTest, ::testing::Values(1, 2, 4));

TEST(GlooCollective, CreateIgnoresSigpipeSoAClosedPeerIsAnError) {
  signal(SIGPIPE, SIG_DFL);
  auto group =
      GlooCollective::Create(NewHashStore(), "sigpipe", 0, 1, "127.0.0.1", absl::Seconds(5));
  ASSERT_TRUE(group.ok()) << group.status();
  struct sigaction current {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &current), 0);
  EXPECT_EQ(current.sa_handler, SIG_IGN);
}

TEST(GlooCollective, MissingPeerTimesOutThenGroupIsBroken) {
  auto store = NewHashStore();
  absl::Notification rank0_done;
  absl::Status rank1_after;
  RunOnRanks(2, [&](int rank) {
    auto group = JoinLoopback(store, rank, 2, absl::Seconds(1));
    ASSERT_TRUE(group.ok()) << group.status();
    if (rank == 1) {
      // Never calls the collective; stays alive until rank 0 has timed out.
      rank0_done.WaitForNotification();
      rank1_after = (*group)->Barrier();
      return;
    }
    float v = 1.0f;
    const absl::Time start = absl::Now();
    absl::Status s = (*group)->AllReduceSum(&v, 1);
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_GE(took, absl::Milliseconds(900));
    EXPECT_LT(took, absl::Seconds(5));
    absl::Status later = (*group)->Barrier();
    EXPECT_EQ(later.code(), absl::StatusCode::kFailedPrecondition) << later;
    EXPECT_THAT(later.message(), HasSubstr("group broken by earlier error"));
    EXPECT_THAT(later.message(), HasSubstr("re-join"));
    std::vector<int64_t> zeros(2, 0);
    EXPECT_EQ((*group)->AllToAllV(nullptr, zeros, nullptr, zeros).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*group)->Split(std::vector<int>{0}, "x").status().code(),
              absl::StatusCode::kFailedPrecondition);
    rank0_done.Notify();
  });
  // Rank 0 tore its side down: rank 1 sees an error, not a hang.
  EXPECT_FALSE(rank1_after.ok());
  EXPECT_TRUE(rank1_after.code() == absl::StatusCode::kUnavailable ||
              rank1_after.code() == absl::StatusCode::kDeadlineExceeded)
      << rank1_after;
}

TEST(GlooCollective, CreateTimesOutWhenAPeerNeverJoins) {
  auto store = NewHashStore();
  auto group = JoinLoopback(store, 0, 2, absl::Milliseconds(300));
  EXPECT_EQ(group.status().code(), absl::StatusCode::kDeadlineExceeded) << group.status();
}

TEST(GlooCollective, CreateRejectsBadArguments) {
  auto store = NewHashStore();
  const absl::Duration t = absl::Seconds(1);
  EXPECT_EQ(GlooCollective::Create(nullptr, "g", 0, 1, "127.0.0.1", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCollective::Create(store, "", 0, 1, "127.0.0.1", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto bad_rank = GlooCollective::Create(store, "g", 2, 2, "127.0.0.1", t);
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_rank.status().message(), HasSubstr("rank"));
  EXPECT_EQ(GlooCollective::Create(store, "g", 0, 0, "127.0.0.1", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      GlooCollective::Create(store, "g", 0, 1, "127.0.0.1", absl::ZeroDuration()).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GlooCollective::Create(store, "g", 0, 1, "", t).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Resolves, but is not an address of this machine: bind(2) fails.
  auto foreign = GlooCollective::Create(store, "g2", 0, 1, "192.0.2.1", t);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kInvalidArgument) << foreign.status();
  auto bad_host = GlooCollective::Create(store, "g", 0, 1, "no-such-host.invalid", t);
  EXPECT_EQ(bad_host.status().code(), absl::StatusCode::kInvalidArgument) << bad_host.status();
  EXPECT_THAT(bad_host.status().message(), HasSubstr("no-such-host.invalid"));
}

TEST(GlooCollective, CallsRejectBadArgumentsWithoutBreakingTheGroup) {
  auto store = NewHashStore();
  auto group = JoinLoopback(store, 0, 1);
  ASSERT_TRUE(group.ok()) << group.status();
  GlooCollective& g = **group;
  char buf[4] = {};
  EXPECT_EQ(g.AllToAllV(buf, std::vector<int64_t>{1, 1}, buf, std::vector<int64_t>{1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.AllToAllV(buf, std::vector<int64_t>{-1}, buf, std::vector<int64_t>{-1}).code(),
            absl::StatusCode::kInvalidArgument);
  auto self = g.AllToAllV(buf, std::vector<int64_t>{2}, buf + 2, std::vector<int64_t>{1});
  EXPECT_EQ(self.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(self.message(), HasSubstr("sends itself 2 bytes"));
  EXPECT_EQ(g.AllToAllV(nullptr, std::vector<int64_t>{1}, buf, std::vector<int64_t>{1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.AllGather(buf, -1, buf).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.AllReduceSum(nullptr, -3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.Split(std::vector<int>{}, "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.Split(std::vector<int>{1}, "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.Split(std::vector<int>{0, 0}, "t").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.Split(std::vector<int>{0}, "").status().code(), absl::StatusCode::kInvalidArgument);
  // Still usable: a one-rank all-to-all copies its own bytes.
  char src[2] = {7, 9};
  char dst[2] = {};
  ASSERT_TRUE(g.AllToAllV(src, std::vector<int64_t>{2}, dst, std::vector<int64_t>{2}).ok());
  EXPECT_EQ(dst[0], 7);
  EXPECT_EQ(dst[1], 9);
}

TEST(GlooCollective, SplitRejectsRanksMissingThisRank) {
  auto store = NewHashStore();
  RunOnRanks(2, [&](int rank) {
    auto group = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(group.ok()) << group.status();
    auto sub = (*group)->Split(std::vector<int>{1 - rank}, "other");
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(sub.status().message(), HasSubstr("do not contain this rank"));
  });
}

}  // namespace
}  // namespace moe_ep::core
