#include "kernels/route.cuh"

#include <gtest/gtest.h>

#include "core/routing.h"
#include "kernels/combine_reduce.cuh"
#include "kernels/dispatch_pack.cuh"
#include "kernels/expert_id_error.h"
#include "kernels/expert_kernels.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using testing::DeviceBuffer;

// GPU routing equals core::ComputeDispatchRoute exactly (slots and counts).
void CheckRoute(int64_t num_tokens, int top_k, int num_experts, int ep_size, uint64_t seed) {
  auto in = testing::MakeInputs(seed, num_tokens, 4, top_k, num_experts, 0.1);
  auto placement = core::ExpertPlacement::Contiguous(num_experts, ep_size);
  ASSERT_TRUE(placement.ok());
  auto route = core::ComputeDispatchRoute(in.ids, num_tokens, top_k, *placement);
  ASSERT_TRUE(route.ok());
  const int64_t rows = std::max<int64_t>(num_tokens, 1);
  DeviceBuffer<int32_t> ids(rows * top_k);
  ids.Upload(in.ids);
  DeviceBuffer<int64_t> t(std::vector<int64_t>{num_tokens});
  DeviceBuffer<int32_t> slots(rows * ep_size);
  DeviceBuffer<int32_t> counts(ep_size);
  ASSERT_TRUE(LaunchRoute({ids.get(),
                           t.get(),
                           rows,
                           top_k,
                           num_experts,
                           ep_size,
                           slots.get(),
                           counts.get(),
                           {},
                           nullptr},
                          nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_counts = counts.Download(ep_size);
  for (int d = 0; d < ep_size; ++d) EXPECT_EQ(got_counts[d], route->send_counts[d]) << d;
  const auto got = slots.Download(num_tokens * ep_size);
  std::vector<int32_t> want(num_tokens * ep_size, -1);
  for (int64_t tok = 0; tok < num_tokens; ++tok) {
    for (int64_t i = route->token_offsets[tok]; i < route->token_offsets[tok + 1]; ++i) {
      want[tok * ep_size + route->dest_rank[i]] = static_cast<int32_t>(route->dest_slot[i]);
    }
  }
  EXPECT_EQ(got, want);
}

TEST(LaunchRoute, MatchesCpuRouting) {
  MOE_EP_REQUIRE_GPUS(1);
  CheckRoute(4096, 8, 256, 8, 1);
  CheckRoute(127, 2, 60, 2, 2);
  CheckRoute(1, 1, 8, 1, 3);
  CheckRoute(0, 8, 128, 4, 4);
  CheckRoute(1000, 8, 10, 4, 5);  // uneven placement: 3, 3, 2, 2 experts
}

TEST(LaunchRoute, WorkedExample) {
  MOE_EP_REQUIRE_GPUS(1);
  // E=2, 4 experts, K=2, ids [[0,3],[1,1],[-1,9]] -> slots [[0,0],[1,-1],[-1,-1]], counts [2,1].
  DeviceBuffer<int32_t> ids(std::vector<int32_t>{0, 3, 1, 1, -1, 9});
  DeviceBuffer<int64_t> t(std::vector<int64_t>{3});
  DeviceBuffer<int32_t> slots(6);
  DeviceBuffer<int32_t> counts(2);
  ASSERT_TRUE(
      LaunchRoute({ids.get(), t.get(), 3, 2, 4, 2, slots.get(), counts.get(), {}, nullptr}, nullptr)
          .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(slots.Download(6), (std::vector<int32_t>{0, 0, 1, -1, -1, -1}));
  EXPECT_EQ(counts.Download(2), (std::vector<int32_t>{2, 1}));
}

// DESIGN §7: only the configured invalid id masks. Same ids: with invalid id
// -1 the 9 (flat index 5) is recorded; with invalid id 4 (= num_experts) the
// -1 (index 4) is the first of two. Routing is unchanged either way.
TEST(LaunchRoute, RecordsIdsOutOfRange) {
  MOE_EP_REQUIRE_GPUS(1);
  DeviceBuffer<int32_t> ids(std::vector<int32_t>{0, 3, 1, 1, -1, 9});
  DeviceBuffer<int64_t> t(std::vector<int64_t>{3});
  DeviceBuffer<int32_t> slots(6);
  DeviceBuffer<int32_t> counts(2);
  for (const int32_t invalid : {-1, 4}) {
    DeviceBuffer<ExpertIdError> error(std::vector<ExpertIdError>{ExpertIdError{}});
    RouteParams p{ids.get(), t.get(), 3, 2, 4, 2, slots.get(), counts.get(), {}, nullptr};
    p.invalid_expert_id = invalid;
    p.id_error = error.get();
    ASSERT_TRUE(LaunchRoute(p, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(slots.Download(6), (std::vector<int32_t>{0, 0, 1, -1, -1, -1}));
    const ExpertIdError got = error.Download(1)[0];
    const absl::Status s = ExpertIdErrorStatus(got, 2, 4, invalid, 0);
    if (invalid == -1) {
      EXPECT_EQ(got.count, 1u);
      EXPECT_NE(s.message().find("topk_ids[row 2, choice 1] = 9: outside [0, 4)"),
                std::string::npos)
          << s;
    } else {
      EXPECT_EQ(got.count, 2u);
      EXPECT_NE(s.message().find("topk_ids[row 2, choice 0] = -1: outside [0, 4) and not the "
                                 "invalid expert id 4 (2 ids out of range"),
                std::string::npos)
          << s;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  }
}

// The record's decoding, on the host: the lowest flat index wins and a
// negative id survives the packing.
TEST(ExpertIdErrorStatus, NamesRowChoiceAndCount) {
  EXPECT_TRUE(ExpertIdErrorStatus(ExpertIdError{}, 8, 256, -1, 0).ok());
  const auto packed = [](uint64_t index, int32_t id) {
    return ~((index << 32) | static_cast<uint32_t>(id));
  };
  const absl::Status s = ExpertIdErrorStatus({packed(7 * 8 + 3, -5), 3}, 8, 256, 256, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "topk_ids[row 7, choice 3] = -5: outside [0, 256) and not the invalid expert id 256 "
            "(3 ids out of range; found on the device by rank 2's step: those choices selected "
            "no expert, only the configured invalid id marks padding)");
}

// Host-side argument checks return kInvalidArgument before touching the GPU,
// so these run on machines without one.
TEST(KernelLaunchers, RejectInvalidArguments) {
  int64_t dummy = 0;
  int32_t slots = 0;
  RouteParams route{&slots, &dummy, 1, 2, 8, 2, &slots, &slots, {}, nullptr};
  route.ep_size = 0;
  EXPECT_EQ(LaunchRoute(route, nullptr).code(), absl::StatusCode::kInvalidArgument);
  route.ep_size = 2;
  route.top_k = 0;
  EXPECT_EQ(LaunchRoute(route, nullptr).code(), absl::StatusCode::kInvalidArgument);
  route.top_k = 2;
  route.num_experts = 1;
  EXPECT_EQ(LaunchRoute(route, nullptr).code(), absl::StatusCode::kInvalidArgument);
  route.num_experts = 8;
  route.token_slot = nullptr;
  EXPECT_EQ(LaunchRoute(route, nullptr).code(), absl::StatusCode::kInvalidArgument);

  PackDispatchParams pack;
  pack.num_tokens = &dummy;
  pack.send_counts = &slots;
  pack.max_tokens = 0;
  pack.hidden_size = 6;
  pack.top_k = 2;
  pack.ep_size = 1;
  EXPECT_EQ(LaunchPackDispatch(pack, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pack.hidden_size = 8;
  pack.ep_size = kMaxEpSize + 1;
  EXPECT_EQ(LaunchPackDispatch(pack, nullptr).code(), absl::StatusCode::kInvalidArgument);
  pack.ep_size = 1;
  pack.num_experts = 0;  // fewer experts than ranks
  EXPECT_EQ(LaunchPackDispatch(pack, nullptr).code(), absl::StatusCode::kInvalidArgument);

  CombineReduceParams combine;
  combine.num_tokens = &dummy;
  combine.hidden_size = 8;
  combine.ep_size = 1;
  combine.max_tokens = -1;
  EXPECT_EQ(LaunchCombineReduce(combine, nullptr).code(), absl::StatusCode::kInvalidArgument);

  ExpertEntryBuffers buffers;
  EXPECT_EQ(LaunchGroupEntriesByExpert(nullptr, 4, 8, 2, nullptr, 0, buffers, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchSiluMul(nullptr, nullptr, 4, 0, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchWeightedExpertSum(nullptr, 4, 8, kMaxTopK + 1, nullptr, nullptr, nullptr, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::kernels
