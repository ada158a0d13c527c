#include "server/memory_limit.h"

#include "core/host_memory.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

// The cgroup and machine readers are core/host_memory.h's (tested there).
TEST(MemoryLimit, DefaultCapIsThreeQuartersOfWhatThisProcessMayUse) {
  const int64_t total =
      core::TotalMemoryBytes(core::kDefaultCgroupRoot, core::PhysicalMemoryBytes());
  ASSERT_GT(total, 0);
  EXPECT_EQ(DefaultMemoryCapBytes(), total / 4 * 3);
}

}  // namespace
}  // namespace moe_ep::server
