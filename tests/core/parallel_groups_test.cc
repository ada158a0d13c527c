#include "core/parallel_groups.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ParallelGroups, Tp4AttnDp2FormsAttentionTpPairs) {
  auto store = NewHashStore();
  ParallelLayout layout{4, 2, 0};
  RunOnRanks(4, [&](int rank) {
    auto world = JoinLoopback(store, rank, 4);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), layout);
    ASSERT_TRUE(groups.ok()) << groups.status();
    ParallelGroups& g = **groups;
    EXPECT_EQ(g.rank(), rank);
    EXPECT_EQ(g.tp_size(), 4);
    EXPECT_EQ(g.attn_tp_size(), 2);
    EXPECT_EQ(g.attn_dp_size(), 2);
    EXPECT_EQ(g.dp_rank(), rank / 2);
    EXPECT_EQ(g.attn_tp_rank(), rank % 2);
    EXPECT_EQ(g.attn_tp().size(), 2);
    EXPECT_EQ(g.attn_tp().rank(), rank % 2);
    EXPECT_EQ(&g.world(), world->get());
    // The sub-group sums only within the DP group: {0,1} -> 1, {2,3} -> 5.
    float v = static_cast<float>(rank);
    ASSERT_TRUE(g.attn_tp().AllReduceSum(&v, 1).ok());
    EXPECT_FLOAT_EQ(v, rank < 2 ? 1.0f : 5.0f);
    float w = static_cast<float>(rank);
    ASSERT_TRUE(g.world().AllReduceSum(&w, 1).ok());
    EXPECT_FLOAT_EQ(w, 6.0f);
    EXPECT_THAT(g.AttnTpRanks(1), ElementsAre(2, 3));
  });
}

TEST(ParallelGroups, NoDpAttentionGroupIsTheWorldAndFullDpIsSingletons) {
  for (int attn_dp : {1, 2}) {
    auto store = NewHashStore();
    ParallelLayout layout{2, attn_dp, 0};
    RunOnRanks(2, [&](int rank) {
      auto world = JoinLoopback(store, rank, 2);
      ASSERT_TRUE(world.ok()) << world.status();
      auto groups = ParallelGroups::Create(world->get(), layout);
      ASSERT_TRUE(groups.ok()) << groups.status();
      EXPECT_EQ((*groups)->attn_tp().size(), 2 / attn_dp);
      EXPECT_EQ((*groups)->dp_rank(), attn_dp == 1 ? 0 : rank);
      EXPECT_EQ((*groups)->attn_tp_rank(), attn_dp == 1 ? rank : 0);
    });
  }
}

TEST(ParallelGroups, RejectsNullWorldBadLayoutAndSizeMismatch) {
  EXPECT_EQ(ParallelGroups::Create(nullptr, ParallelLayout{2, 1, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto store = NewHashStore();
  RunOnRanks(2, [&](int rank) {
    auto world = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(world.ok()) << world.status();
    auto mismatch = ParallelGroups::Create(world->get(), ParallelLayout{4, 2, 0});
    EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("tp_size 4"));
    auto bad_dp = ParallelGroups::Create(world->get(), ParallelLayout{2, 3, 0});
    EXPECT_EQ(bad_dp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(bad_dp.status().message()), HasSubstr("attn_dp_size"));
    auto no_tag = ParallelGroups::Create(world->get(), ParallelLayout{2, 1, 0}, "");
    EXPECT_EQ(no_tag.status().code(), absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace moe_ep::core
