#pragma once

// The device executor behind core::StepExecutor (host tensors): each Run
// copies the activations to the device, enqueues the program on a
// kernels::DeviceStepExecutor, waits (with the groups' deadline) and copies
// the result back. This is how core::DistributedLayerStack, whose compute
// runs on the host, runs its communication steps on NCCL groups — the
// ForwardLayers RPC on NCCL workers (issue 11 item 1). Two host copies per
// step each way (hidden and residual); the device buffers grow on demand to
// the largest step and are reused.
//
// Not thread-safe. Source: DESIGN §3, §4; issue 11.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/parallel_groups.h"
#include "core/rms_norm.h"
#include "core/step_executor.h"
#include "kernels/device_step_executor.h"
#include "kernels/gpu_activations.h"

namespace moe_ep::kernels {

class StagedStepExecutor final : public core::StepExecutor {
 public:
  // Create()
  //
  // An executor over `groups`, a rank's host-view groups whose world and
  // attention-TP collectives are kernels::StagedControlCollective (groups
  // formed over the GPU data plane's collective(): ParallelGroups::Create
  // splits a staged collective into a staged one). `groups` must outlive
  // the executor. `hidden` is H.
  // Errors: kInvalidArgument when a group is not a staged NCCL collective
  // (naming its backend) or hidden < 1; DeviceStepExecutor::Create's.
  static absl::StatusOr<std::unique_ptr<StagedStepExecutor>> Create(
      const core::ParallelGroups& groups, int64_t hidden, const DeviceStepOptions& options = {});

  std::string name() const override { return "device"; }

  // As core::StepExecutor::Run. Errors also: kResourceExhausted when the
  // device buffers cannot grow; kInternal from CUDA copies.
  absl::Status Run(const core::StepProgram& program, const core::RmsNorm* norm,
                   core::LayerActivations& act) override;

 private:
  StagedStepExecutor() = default;
  // The device copy of `norm`, uploaded on first use and again whenever its
  // weight or eps changed.
  absl::StatusOr<const DeviceRmsNorm*> DeviceNorm(const core::RmsNorm& norm);

  struct CachedNorm {
    std::vector<float> weight;
    float eps = 0.0f;
    std::unique_ptr<DeviceRmsNorm> device;
  };

  int rank_ = 0;
  int64_t hidden_ = 0;
  std::unique_ptr<DeviceStepExecutor> executor_;
  std::unique_ptr<GpuLayerActivations> act_;
  std::map<const core::RmsNorm*, CachedNorm> norms_;
};

}  // namespace moe_ep::kernels
