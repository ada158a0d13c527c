#include "server/memory_limit.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

namespace fs = std::filesystem;

// A fresh fake cgroup root under the test's temp dir.
std::string FakeRoot(const std::string& name) {
  const fs::path root = fs::path(::testing::TempDir()) / ("cgroup_" + name);
  fs::remove_all(root);
  fs::create_directories(root / "memory");
  return root.string();
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(MemoryLimit, CgroupV2LimitBelowTheMachineWins) {
  const std::string root = FakeRoot("v2");
  Write(root + "/memory.max", "1073741824\n");
  EXPECT_EQ(AvailableMemoryBytes(root, int64_t{8} << 30), int64_t{1} << 30);
  // Above the machine: the machine.
  EXPECT_EQ(AvailableMemoryBytes(root, int64_t{512} << 20), int64_t{512} << 20);
}

TEST(MemoryLimit, CgroupV2MaxMeansNoLimit) {
  const std::string root = FakeRoot("v2max");
  Write(root + "/memory.max", "max\n");
  EXPECT_EQ(AvailableMemoryBytes(root, 12345), 12345);
}

TEST(MemoryLimit, CgroupV1LimitAndItsUnlimitedValue) {
  const std::string root = FakeRoot("v1");
  Write(root + "/memory/memory.limit_in_bytes", "268435456\n");
  EXPECT_EQ(AvailableMemoryBytes(root, int64_t{8} << 30), int64_t{256} << 20);
  Write(root + "/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(AvailableMemoryBytes(root, int64_t{8} << 30), int64_t{8} << 30);
}

TEST(MemoryLimit, NoCgroupFilesMeansTheMachine) {
  const std::string root = FakeRoot("none");
  EXPECT_EQ(AvailableMemoryBytes(root, 4096), 4096);
  EXPECT_EQ(AvailableMemoryBytes(root, 0), 0);
}

TEST(MemoryLimit, DefaultCapIsThreeQuartersOfWhatThisProcessMayUse) {
  const int64_t available = AvailableMemoryBytes("/sys/fs/cgroup", PhysicalMemoryBytes());
  ASSERT_GT(available, 0);
  EXPECT_EQ(DefaultMemoryCapBytes(), available / 4 * 3);
}

}  // namespace
}  // namespace moe_ep::server
