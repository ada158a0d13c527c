#include "kernels/kernel_preload.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device_calls.h"
#include "kernels/internal/kernel_modules.h"

namespace moe_ep::kernels {
namespace {

using ::testing::HasSubstr;

// Without a device the preload is an error naming the call, not a crash.
TEST(KernelPreload, WithoutADeviceTheErrorNamesTheCall) {
  if (VisibleDeviceCount() > 0) GTEST_SKIP() << "has a CUDA device (the GPU test covers it)";
  const absl::Status s = PreloadStepKernels();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("cudaGetDevice")) << s;
}

// On a GPU: after the preload no kernel of any step-path module is left
// unloaded, and the modules hold more kernels than their anchors (the
// enumeration reached the template instantiations, e.g. the one-sided unit's
// ten dispatch, combine and identity variants).
TEST(KernelPreload, EveryStepKernelIsLoaded) {
  if (VisibleDeviceCount() < 1) GTEST_SKIP() << "needs a CUDA device";
  ASSERT_TRUE(SetDevice(0).ok());
  // ctest runs each test in a process of its own: under lazy loading
  // (the default) most kernels are not loaded yet, so the preload has work.
  const absl::StatusOr<bool> lazy = LazyModuleLoading();
  ASSERT_TRUE(lazy.ok()) << lazy.status();
  const absl::StatusOr<int> before = UnloadedKernelsOf(StepKernelModules());
  ASSERT_TRUE(before.ok()) << before.status();
  std::printf("lazy loading %d, step-path kernels not loaded before the preload: %d\n",
              *lazy ? 1 : 0, *before);
  if (*lazy) {
    EXPECT_GT(*before, 0);
  } else {
    EXPECT_EQ(*before, 0);  // CUDA_MODULE_LOADING=EAGER loaded them at start
  }
  const absl::Status s = PreloadStepKernels();
  ASSERT_TRUE(s.ok()) << s;
  const absl::StatusOr<int> unloaded = UnloadedKernelsOf(StepKernelModules());
  ASSERT_TRUE(unloaded.ok()) << unloaded.status();
  EXPECT_EQ(*unloaded, 0);
  const void* onesided[] = {internal::OneSidedKernelsModule()};
  const absl::StatusOr<int> os = PreloadModulesOf(onesided);
  ASSERT_TRUE(os.ok()) << os.status();
  EXPECT_GE(*os, 10);
  const absl::StatusOr<int> all = PreloadModulesOf(StepKernelModules());
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_GT(*all, static_cast<int>(StepKernelModules().size()) + *os);
  // A second call on the same device returns at once and stays OK.
  EXPECT_TRUE(PreloadStepKernels().ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace moe_ep::kernels
