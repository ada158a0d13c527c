#include "server/backend_selection.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device_info.h"
#include "tests/server/in_process_worker.h"

// Backend selection without a GPU (these run on every build): the table in
// server/backend_selection.h, the --device check, and Join through the
// Worker service on a machine (or build) without a GPU.

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using testing::InProcessWorker;

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(fragment));
}

TEST(ResolveBackend, GlooIsGlooWithOrWithoutGpus) {
  EXPECT_EQ(*ResolveBackend("gloo", "auto", 0), "gloo");
  EXPECT_EQ(*ResolveBackend("gloo", "nccl", 8), "gloo");
}

TEST(ResolveBackend, AutoWithoutGpuIsGloo) {
  EXPECT_EQ(*ResolveBackend("auto", "gloo", 0), "gloo");
}

TEST(ResolveBackend, AutoWithGpusIsNcclOnlyOnACudaBuild) {
  EXPECT_EQ(*ResolveBackend("auto", "gloo", 2), BuiltWithCuda() ? "nccl" : "gloo");
}

TEST(ResolveGpuDataPlane, KnownNamesAndTheDefault) {
  EXPECT_EQ(*ResolveGpuDataPlane("one-sided", "nccl"), "one-sided");
  EXPECT_EQ(*ResolveGpuDataPlane("nccl", "auto"), "nccl");
  EXPECT_EQ(*ResolveGpuDataPlane("auto", "nccl"), "auto");
  EXPECT_EQ(*ResolveGpuDataPlane("", "one-sided"), "one-sided");
  ExpectError(ResolveGpuDataPlane("onesided", "auto").status(), absl::StatusCode::kInvalidArgument,
              "gpu_data_plane: expected \"auto\", \"one-sided\" or \"nccl\", got \"onesided\"");
  ExpectError(ResolveGpuDataPlane("", "rdma").status(), absl::StatusCode::kInvalidArgument,
              "got \"rdma\"");
}

// Join's two names read as one request (issue 34 item 1): the GPU plane name
// counts only for "nccl", and an empty one is "nccl".
TEST(PlaneRequestOf, ReadsBackendAndGpuPlaneAsOneField) {
  EXPECT_EQ(*PlaneRequestOf("gloo", ""), PlaneRequest::kGloo);
  EXPECT_EQ(*PlaneRequestOf("gloo", "one-sided"), PlaneRequest::kGloo);
  EXPECT_EQ(*PlaneRequestOf("nccl", ""), PlaneRequest::kNccl);
  EXPECT_EQ(*PlaneRequestOf("nccl", "nccl"), PlaneRequest::kNccl);
  EXPECT_EQ(*PlaneRequestOf("nccl", "one-sided"), PlaneRequest::kOneSided);
  EXPECT_EQ(*PlaneRequestOf("nccl", "auto"), PlaneRequest::kGpuAuto);
  ExpectError(PlaneRequestOf("auto", "").status(), absl::StatusCode::kInvalidArgument,
              "backend: expected \"gloo\" or \"nccl\", got \"auto\"");
  ExpectError(PlaneRequestOf("nccl", "ib").status(), absl::StatusCode::kInvalidArgument,
              "gpu_data_plane: expected \"auto\", \"one-sided\" or \"nccl\", got \"ib\"");
  EXPECT_STREQ(PlaneRequestName(PlaneRequest::kGpuAuto), "auto");
  EXPECT_STREQ(PlaneRequestName(PlaneRequest::kOneSided), "one-sided");
}

TEST(ResolveBackend, EmptyRequestUsesTheDefault) {
  EXPECT_EQ(*ResolveBackend("", "gloo", 4), "gloo");
  EXPECT_EQ(*ResolveBackend("", "auto", 0), "gloo");
  ExpectError(ResolveBackend("", "mpi", 0).status(), absl::StatusCode::kInvalidArgument,
              "expected \"auto\", \"gloo\" or \"nccl\", got \"mpi\"");
}

TEST(ResolveBackend, NcclNeedsACudaBuildAndAVisibleDevice) {
  if (!BuiltWithCuda()) {
    ExpectError(ResolveBackend("nccl", "auto", 2).status(), absl::StatusCode::kFailedPrecondition,
                "NCCL backend needs a CUDA build");
    return;
  }
  EXPECT_EQ(*ResolveBackend("nccl", "auto", 1), "nccl");
  ExpectError(ResolveBackend("nccl", "auto", 0).status(), absl::StatusCode::kFailedPrecondition,
              "no CUDA device is visible");
}

TEST(ResolveBackend, UnknownNameIsInvalidArgument) {
  ExpectError(ResolveBackend("NCCL", "auto", 1).status(), absl::StatusCode::kInvalidArgument,
              "got \"NCCL\"");
}

TEST(CheckDevice, NegativeOrdinalIsInvalidArgument) {
  ExpectError(CheckDevice(-1, 2, "nccl"), absl::StatusCode::kInvalidArgument,
              "expected a CUDA device ordinal >= 0, got -1");
  ExpectError(CheckDevice(-1, 0, "gloo"), absl::StatusCode::kInvalidArgument, "got -1");
}

TEST(CheckDevice, NcclDeviceMustBeVisible) {
  EXPECT_TRUE(CheckDevice(1, 2, "nccl").ok());
  ExpectError(CheckDevice(2, 2, "nccl"), absl::StatusCode::kFailedPrecondition,
              "CUDA device 2 is not visible to this worker (2 visible); start the worker with "
              "--device in [0, 2)");
}

TEST(CheckDevice, GlooIgnoresTheDevice) { EXPECT_TRUE(CheckDevice(5, 0, "gloo").ok()); }

TEST(DeviceInfo, HostIsCpuWithItsMemory) {
  const DeviceInfo host = DescribeHost();
  EXPECT_EQ(host.name, "cpu");
  EXPECT_GT(host.memory_bytes, 0);
}

TEST(DeviceInfo, GpuOutsideTheVisibleRangeIsAnError) {
  if (!BuiltWithCuda()) {
    EXPECT_EQ(VisibleGpuCount(), 0);
    ExpectError(DescribeGpu(0).status(), absl::StatusCode::kFailedPrecondition,
                "built without CUDA");
    return;
  }
  ExpectError(DescribeGpu(-1).status(), absl::StatusCode::kInvalidArgument, "got -1");
  ExpectError(DescribeGpu(VisibleGpuCount()).status(), absl::StatusCode::kInvalidArgument,
              "visible CUDA devices");
}

// Join through the service on a machine without a GPU.
class JoinWithoutGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (VisibleGpuCount() > 0) {
      GTEST_SKIP() << "a CUDA device is visible; the GPU cases are in "
                      "tests/server/gpu_worker_service_test.cc";
    }
  }
};

TEST_F(JoinWithoutGpu, AutoFormsAGlooGroupAndReportsTheCpu) {
  InProcessWorker worker;
  EXPECT_EQ(worker.Status().device_name(), "cpu");
  v1::JoinResponse response;
  grpc::Status status = worker.Join(1, 0, 1, "", "auto", 5000, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.backend(), "gloo");
  EXPECT_EQ(worker.Status().backend(), "gloo");
  EXPECT_EQ(worker.Status().device_name(), "cpu");
  EXPECT_GT(worker.Status().device_memory_bytes(), 0);
}

TEST_F(JoinWithoutGpu, NcclIsFailedPreconditionAndChangesNothing) {
  InProcessWorker worker;
  const std::string before = worker.Status().SerializeAsString();
  grpc::Status status = worker.Join(1, 0, 1, "", "nccl", 5000);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(
      status.error_message(),
      HasSubstr(BuiltWithCuda() ? "no CUDA device is visible" : "NCCL backend needs a CUDA build"));
  v1::GetStatusResponse after = worker.Status();
  after.mutable_counters()->set_errors(0);
  EXPECT_EQ(after.SerializeAsString(), before);
  // The worker still joins with Gloo afterwards.
  EXPECT_TRUE(worker.Join(1, 0, 1, "", "gloo", 5000).ok());
}

TEST_F(JoinWithoutGpu, DefaultBackendNcclIsUsedWhenJoinNamesNone) {
  WorkerOptions options;
  options.default_backend = "nccl";
  InProcessWorker worker(options);
  EXPECT_EQ(worker.Status().device_name(), "cpu");  // no device to describe
  grpc::Status status = worker.Join(1, 0, 1, "", "", 5000);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("backend \"nccl\""));
}

TEST(WorkerDevice, NegativeDeviceOptionIsInvalidArgumentOnJoin) {
  WorkerOptions options;
  options.device = -1;
  InProcessWorker worker(options);
  grpc::Status status = worker.Join(1, 0, 1, "", "gloo", 5000);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("device: expected a CUDA device ordinal >= 0"));
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_STARTED);
}

}  // namespace
}  // namespace moe_ep::server
