#include "server/path_policy.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

class PathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One folder per test: ctest runs the tests of this fixture in parallel.
    root_ = fs::path(::testing::TempDir()) /
            (std::string("path_policy_") +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "ckpt");
    std::ofstream(root_ / "ckpt" / "model.safetensors") << "12345678{}";
    std::ofstream(root_ / "secret") << "root:*:2";
    dirs_ = {(root_ / "ckpt").string()};
  }
  fs::path root_;
  std::vector<std::string> dirs_;
};

TEST_F(PathPolicyTest, AFileUnderTheDirectoryResolves) {
  auto resolved =
      ResolveCheckpointPath(dirs_, (root_ / "ckpt" / "model.safetensors").string(), 100);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(*resolved, fs::canonical(root_ / "ckpt" / "model.safetensors").string());
  EXPECT_TRUE(ResolveCheckpointPath(dirs_, (root_ / "ckpt").string(), 100).ok());
}

TEST_F(PathPolicyTest, PathsOutsideAreRefusedThroughDotsAndLinks) {
  const std::string dotted = (root_ / "ckpt" / ".." / "secret").string();
  auto dots = ResolveCheckpointPath(dirs_, dotted, 100);
  EXPECT_EQ(dots.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(dots.status().message(), Not(HasSubstr("root:")));
  fs::create_symlink(root_ / "secret", root_ / "ckpt" / "link.safetensors");
  auto link = ResolveCheckpointPath(dirs_, (root_ / "ckpt" / "link.safetensors").string(), 100);
  EXPECT_EQ(link.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(ResolveCheckpointPath(dirs_, "/etc/passwd", 100).status().code(),
            absl::StatusCode::kPermissionDenied);
  // A sibling whose name starts with the directory's is outside too.
  fs::create_directories(root_ / "ckpt2");
  std::ofstream(root_ / "ckpt2" / "x") << "x";
  EXPECT_EQ(ResolveCheckpointPath(dirs_, (root_ / "ckpt2" / "x").string(), 100).status().code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(PathPolicyTest, NoDirectoryConfiguredRefusesEverything) {
  auto none = ResolveCheckpointPath({}, (root_ / "ckpt" / "model.safetensors").string(), 100);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(none.status().message(), HasSubstr("--checkpoint-dir"));
}

TEST_F(PathPolicyTest, PipesMissingFilesRelativePathsAndLargeFiles) {
  const fs::path fifo = root_ / "ckpt" / "pipe.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Returns at once (no open): a pipe without a writer would block a read.
  EXPECT_EQ(ResolveCheckpointPath(dirs_, fifo.string(), 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveCheckpointPath(dirs_, (root_ / "ckpt" / "nope").string(), 100).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ResolveCheckpointPath(dirs_, "ckpt/model.safetensors", 100).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveCheckpointPath(dirs_, (root_ / "ckpt" / "model.safetensors").string(), 9)
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace moe_ep::server
