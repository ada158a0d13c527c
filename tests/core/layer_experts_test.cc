#include "core/layer_experts.h"

#include <memory>
#include <utility>
#include <vector>

#include "core/experts.h"
#include "core/placement_table.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

// A stand-in for a transport's expert holder (a kernels::DeviceExpertSet on
// a GPU): ids and bytes, and whether it was freed.
struct Holder {
  Holder(std::vector<int> ids_in, int64_t bytes_in, bool* freed_in)
      : ids(std::move(ids_in)), bytes(bytes_in), freed(freed_in) {}
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;
  std::vector<int> ids;
  int64_t bytes = 0;
  bool* freed = nullptr;
  ~Holder() {
    if (freed != nullptr) *freed = true;
  }
  const std::vector<int>& expert_ids() const { return ids; }
  int64_t weight_bytes() const { return bytes; }
};

TEST(LayerExperts, BytesAreRecordedPerLayerAndInTotal) {
  LayerExperts experts;
  EXPECT_FALSE(experts.Has(3));
  EXPECT_EQ(experts.Bytes(3), 0);
  EXPECT_EQ(experts.Find<ExpertSet>(3), nullptr);
  // 2 SwiGLU experts of H 8, I 4: 3 * 8 * 4 bf16 weights each = 192 bytes.
  absl::StatusOr<ExpertSet> set = ExpertSet::GenerateSwiGlu(1, 3, 2, 2, 8, 4);
  ASSERT_TRUE(set.ok()) << set.status();
  experts.Put(3, std::make_unique<ExpertSet>(*std::move(set)));
  experts.Put(5, std::make_unique<ExpertSet>(ExpertSet::Identity(0, 4, 8)));
  EXPECT_TRUE(experts.Has(3));
  EXPECT_EQ(experts.Bytes(3), 2 * 3 * 8 * 4 * 2);
  EXPECT_EQ(experts.Bytes(5), 0);
  EXPECT_EQ(experts.TotalBytes(), 384);
  ASSERT_NE(experts.Find<ExpertSet>(3), nullptr);
  EXPECT_EQ(experts.Find<ExpertSet>(3)->expert_ids(), (std::vector<int>{2, 3}));
  experts.Clear();
  EXPECT_FALSE(experts.Has(3));
  EXPECT_EQ(experts.TotalBytes(), 0);
}

TEST(LayerExperts, PutReplacesAndFreesTheLayersPreviousExperts) {
  LayerExperts experts;
  bool first_freed = false;
  experts.Put(0, std::make_unique<Holder>(std::vector<int>{0, 1}, 100, &first_freed));
  experts.Put(0, std::make_unique<Holder>(std::vector<int>{0, 1}, 40, nullptr));
  EXPECT_TRUE(first_freed);
  EXPECT_EQ(experts.Bytes(0), 40);
  EXPECT_EQ(experts.TotalBytes(), 40);
}

// The one drop rule (DESIGN §15, §17): rank 1 of 2 holds {2, 3} under the
// contiguous table of 4 experts. A table whose rank-1 slots are {3, 2, 3}
// keeps them (distinct {2, 3}); one whose rank-1 slots are {2, 5, 4}
// drops them.
TEST(LayerExperts, KeepIfSlotsOfKeepsOnlyTheRanksDistinctSlotExperts) {
  LayerExperts experts;
  bool freed = false;
  experts.Put(7, std::make_unique<Holder>(std::vector<int>{2, 3}, 64, &freed));
  absl::StatusOr<PlacementTable> same = PlacementTable::FromSlotExperts(4, {{0, 1, 0}, {3, 2, 3}});
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(experts.KeepIfSlotsOf(7, *same, 1));
  EXPECT_FALSE(freed);
  EXPECT_EQ(experts.Bytes(7), 64);
  absl::StatusOr<PlacementTable> moved = PlacementTable::FromSlotExperts(6, {{0, 1, 3}, {2, 5, 4}});
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_FALSE(experts.KeepIfSlotsOf(7, *moved, 1));
  EXPECT_TRUE(freed);
  EXPECT_FALSE(experts.Has(7));
  EXPECT_EQ(experts.TotalBytes(), 0);
  // A layer without experts stays without.
  EXPECT_FALSE(experts.KeepIfSlotsOf(8, *same, 0));
}

// The error of a layer without experts names the layers that have some, so
// a layer outside the plan reads differently from one still loading.
TEST(LayerExperts, NotLoadedNamesTheLayersThatHaveExperts) {
  LayerExperts experts;
  const absl::Status none = experts.NotLoaded("moe_ep_forward", 99, 1);
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(none.message(),
            "moe_ep_forward: layer 99 has no loaded experts on rank 1 (layers with experts here: "
            "none); call LoadExperts first");
  experts.Put(4, std::make_unique<Holder>(std::vector<int>{0}, 8, nullptr));
  experts.Put(0, std::make_unique<Holder>(std::vector<int>{1}, 8, nullptr));
  EXPECT_EQ(experts.NotLoaded("Forward", 2, 0).message(),
            "Forward: layer 2 has no loaded experts on rank 0 (layers with experts here: [0,4]); "
            "call LoadExperts first");
}

}  // namespace
}  // namespace moe_ep::core
