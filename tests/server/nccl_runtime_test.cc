#include "server/nccl_runtime.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(NcclRuntime, SameMajorMinorIsAcceptedWhateverThePatch) {
  EXPECT_TRUE(CompareNcclVersions(22105, 22105).ok());
  EXPECT_TRUE(CompareNcclVersions(22105, 22103).ok());
}

TEST(NcclRuntime, OtherMinorOrMajorIsRefusedNamingBoth) {
  absl::Status minor = CompareNcclVersions(22105, 21903);
  EXPECT_EQ(minor.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(minor.message(), HasSubstr("NCCL runtime 2.19.3 differs from the NCCL 2.21.5"));
  absl::Status major = CompareNcclVersions(22105, 32105);
  EXPECT_EQ(major.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(major.message(), HasSubstr("runtime 3.21.5"));
}

TEST(NcclRuntime, ThisProcessPassesItsOwnCheck) {
  // Built and run here against the same NCCL (or without CUDA: no NCCL).
  EXPECT_TRUE(CheckNcclRuntime().ok()) << CheckNcclRuntime();
}

}  // namespace
}  // namespace moe_ep::server
