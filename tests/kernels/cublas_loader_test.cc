// Tests of kernels/internal/cublas_loader.h: cuBLAS opens on first use and
// its entry points answer without a GPU (cublasGetStatusString is host
// code), so these run on every CUDA build. A binary linked with
// moe_ep_kernels no longer maps cuBLAS before that first use: checked in a
// child process that never calls it.

#include "kernels/internal/cublas_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace moe_ep::kernels::internal {
namespace {

using ::testing::HasSubstr;

std::string SelfMaps() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return text.str();
}

TEST(LoadCublas, OpensOnceWithEveryEntryPoint) {
  absl::StatusOr<const CublasApi*> api = LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  const CublasApi& cublas = **api;
  EXPECT_NE(cublas.create, nullptr);
  EXPECT_NE(cublas.destroy, nullptr);
  EXPECT_NE(cublas.set_stream, nullptr);
  EXPECT_NE(cublas.set_workspace, nullptr);
  EXPECT_NE(cublas.gemm_ex, nullptr);
  EXPECT_NE(cublas.status_string, nullptr);
  // The same table on every call; the library is now mapped.
  EXPECT_EQ(*LoadCublas(), *api);
  EXPECT_THAT(SelfMaps(), HasSubstr("libcublas.so."));
}

TEST(CublasStatus, SuccessIsOkAndAFailureCarriesCublasText) {
  absl::StatusOr<const CublasApi*> api = LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  EXPECT_TRUE(CublasStatus(**api, CUBLAS_STATUS_SUCCESS, "cublasCreate").ok());
  const absl::Status failed = CublasStatus(**api, CUBLAS_STATUS_NOT_INITIALIZED, "cublasCreate");
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(failed.message()),
              HasSubstr("cublasCreate: the library was not initialized"));
}

// A process that links moe_ep_kernels maps no cuBLAS until LoadCublas: the
// child below checks its own maps before any call (fork keeps the parent's
// maps, so it execs a fresh copy of this binary with a filter that runs
// only the check).
TEST(LoadCublas, NothingMapsCublasBeforeTheFirstCall) {
  if (std::getenv("MOE_EP_CUBLAS_MAPS_CHILD") != nullptr) {
    EXPECT_THAT(SelfMaps(), ::testing::Not(HasSubstr("libcublas")));
    return;
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string command =
      "MOE_EP_CUBLAS_MAPS_CHILD=1 '" + self +
      "' --gtest_filter=LoadCublas.NothingMapsCublasBeforeTheFirstCall > /dev/null 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;  // NOLINT(cert-env33-c)
}

}  // namespace
}  // namespace moe_ep::kernels::internal
