#include "core/host_memory.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// A fresh fake cgroup root (or meminfo file) under the test's temp dir.
std::string FakeRoot(const std::string& name) {
  const fs::path root =
      fs::path(::testing::TempDir()) / ("host_memory_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "memory");
  return root.string();
}

void Write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(TotalMemoryBytes, CgroupV2LimitBelowTheMachineWins) {
  const std::string root = FakeRoot("v2");
  Write(root + "/memory.max", "1073741824\n");
  EXPECT_EQ(TotalMemoryBytes(root, int64_t{8} << 30), int64_t{1} << 30);
  // Above the machine: the machine.
  EXPECT_EQ(TotalMemoryBytes(root, int64_t{512} << 20), int64_t{512} << 20);
}

TEST(TotalMemoryBytes, CgroupV2MaxMeansNoLimit) {
  const std::string root = FakeRoot("v2max");
  Write(root + "/memory.max", "max\n");
  EXPECT_EQ(TotalMemoryBytes(root, 12345), 12345);
  EXPECT_EQ(CgroupMemoryLimitBytes(root), std::nullopt);
}

TEST(TotalMemoryBytes, CgroupV1LimitAndItsUnlimitedValue) {
  const std::string root = FakeRoot("v1");
  Write(root + "/memory/memory.limit_in_bytes", "268435456\n");
  EXPECT_EQ(TotalMemoryBytes(root, int64_t{8} << 30), int64_t{256} << 20);
  Write(root + "/memory/memory.limit_in_bytes", "9223372036854771712\n");
  EXPECT_EQ(TotalMemoryBytes(root, int64_t{8} << 30), int64_t{8} << 30);
}

TEST(TotalMemoryBytes, NoCgroupFilesMeansTheMachine) {
  const std::string root = FakeRoot("none");
  EXPECT_EQ(TotalMemoryBytes(root, 4096), 4096);
  EXPECT_EQ(TotalMemoryBytes(root, 0), 0);
  EXPECT_EQ(CgroupMemoryUsageBytes(root), std::nullopt);
}

TEST(ParseMemAvailableBytes, ReadsKibibytes) {
  const std::string meminfo =
      "MemTotal:       24684100 kB\n"
      "MemFree:        18345196 kB\n"
      "MemAvailable:   22671424 kB\n"
      "Buffers:          123456 kB\n";
  auto b = ParseMemAvailableBytes(meminfo);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, int64_t{22671424} * 1024);
}

TEST(ParseMemAvailableBytes, MissingLineIsNotFoundAndBadValueInvalid) {
  EXPECT_EQ(ParseMemAvailableBytes("MemTotal: 1 kB\n").status().code(),
            absl::StatusCode::kNotFound);
  auto bad = ParseMemAvailableBytes("MemAvailable: lots kB\n");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("MemAvailable"));
  EXPECT_EQ(ParseMemAvailableBytes("MemAvailable: 12 MB\n").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A pod on a 24 GiB host with a 2 GiB limit of which 1.5 GiB is used:
// /proc/meminfo says 22 GiB, the pod may take 0.5 GiB (issue 12 item 8).
TEST(AvailableMemoryBytes, APodSeesItsCgroupHeadroomNotTheHost) {
  const std::string root = FakeRoot("pod");
  const std::string meminfo = root + "/meminfo";
  Write(meminfo, "MemTotal: 25165824 kB\nMemAvailable: 23068672 kB\n");
  EXPECT_EQ(*AvailableMemoryBytes(meminfo, root), int64_t{23068672} * 1024);  // no cgroup files
  Write(root + "/memory.max", "2147483648\n");
  Write(root + "/memory.current", "1610612736\n");
  EXPECT_EQ(*AvailableMemoryBytes(meminfo, root), int64_t{512} << 20);
  // Over its limit (reclaim pending): nothing, never negative.
  Write(root + "/memory.current", "3221225472\n");
  EXPECT_EQ(*AvailableMemoryBytes(meminfo, root), 0);
  // A limit above the host's MemAvailable: MemAvailable.
  Write(root + "/memory.max", "107374182400\n");
  Write(root + "/memory.current", "0\n");
  EXPECT_EQ(*AvailableMemoryBytes(meminfo, root), int64_t{23068672} * 1024);
}

TEST(AvailableMemoryBytes, CgroupV1UsageCounts) {
  const std::string root = FakeRoot("v1pod");
  const std::string meminfo = root + "/meminfo";
  Write(meminfo, "MemAvailable: 8388608 kB\n");  // 8 GiB
  Write(root + "/memory/memory.limit_in_bytes", "4294967296\n");
  Write(root + "/memory/memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(*AvailableMemoryBytes(meminfo, root), int64_t{3} << 30);
}

TEST(AvailableMemoryBytes, NamesAMissingOrBadFile) {
  auto missing = AvailableMemoryBytes("/nonexistent/meminfo", FakeRoot("x"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/meminfo"));
  const std::string root = FakeRoot("bad");
  Write(root + "/meminfo", "MemTotal: 8 kB\n");
  auto none = AvailableMemoryBytes(root + "/meminfo", root);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr(root + "/meminfo"));
  // This machine (Linux) has one.
  auto here = AvailableMemoryBytes();
  ASSERT_TRUE(here.ok()) << here.status();
  EXPECT_GT(*here, 0);
}

}  // namespace
}  // namespace moe_ep::core
