#include "kernels/device_step_executor.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/step_executor.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

using core::StepGroup;
using core::StepOp;
using core::StepPrimitive;
using core::StepTensor;

constexpr int64_t kFloatBytes = static_cast<int64_t>(sizeof(float));

// Copies `rows` rows of H floats on `stream` (device to device).
absl::Status CopyRows(float* dst, const float* src, int64_t rows, int64_t hidden,
                      cudaStream_t stream) {
  if (rows == 0 || dst == src) return absl::OkStatus();
  return internal::CudaStatus(
      cudaMemcpyAsync(dst, src, rows * hidden * kFloatBytes, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpyAsync(rows)");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceStepExecutor>> DeviceStepExecutor::Create(
    StreamCollective* world, StreamCollective* attn_tp, int64_t hidden,
    const DeviceStepOptions& options) {
  if (world == nullptr || attn_tp == nullptr) {
    return absl::InvalidArgumentError(
        "groups is null: the world and attention-TP groups are both required");
  }
  if (world->device() != attn_tp->device()) {
    return absl::InvalidArgumentError(absl::StrCat("the world group is on device ", world->device(),
                                                   ", the attention-TP group on device ",
                                                   attn_tp->device(), ": expected one device"));
  }
  if (hidden < 1)
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected >= 1, got ", hidden));
  if (options.all_reduce_norm != AllReduceNormImpl::kFused &&
      options.all_reduce_norm != AllReduceNormImpl::kUnfused) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.all_reduce_norm: expected fused or unfused, got ",
                     static_cast<int>(options.all_reduce_norm)));
  }
  std::unique_ptr<DeviceStepExecutor> e(new DeviceStepExecutor());
  e->world_ = world;
  e->attn_tp_ = attn_tp;
  e->hidden_ = hidden;
  e->options_ = options;
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventCreateWithFlags(&e->fork_, cudaEventDisableTiming),
                                       "cudaEventCreate(fork)"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventCreateWithFlags(&e->join_, cudaEventDisableTiming),
                                       "cudaEventCreate(join)"));
  return e;
}

DeviceStepExecutor::~DeviceStepExecutor() {
  if (world_ != nullptr) cudaSetDevice(world_->device());
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (join_ != nullptr) cudaEventDestroy(join_);
}

AllReduceNormImpl DeviceStepExecutor::AllReduceNormFor(int64_t rows) const {
  if (options_.all_reduce_norm == AllReduceNormImpl::kFused && options_.fused_max_rows >= 0 &&
      rows > options_.fused_max_rows) {
    return AllReduceNormImpl::kUnfused;
  }
  return options_.all_reduce_norm;
}

absl::Status DeviceStepExecutor::Synchronize() const {
  RETURN_IF_ERROR(attn_tp_->Synchronize());
  return world_->Synchronize();
}

StreamCollective& DeviceStepExecutor::Group(StepGroup group) const {
  return group == StepGroup::kWorld ? *world_ : *attn_tp_;
}

template <typename F>
absl::Status DeviceStepExecutor::OnGroupStream(StepGroup group, F&& enqueue) const {
  if (group == StepGroup::kWorld) return enqueue();
  const cudaStream_t main = world_->stream();
  const cudaStream_t side = attn_tp_->stream();
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventRecord(fork_, main), "cudaEventRecord(fork)"));
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaStreamWaitEvent(side, fork_, 0), "cudaStreamWaitEvent(fork)"));
  RETURN_IF_ERROR(enqueue());
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventRecord(join_, side), "cudaEventRecord(join)"));
  return internal::CudaStatus(cudaStreamWaitEvent(main, join_, 0), "cudaStreamWaitEvent(join)");
}

absl::Status DeviceStepExecutor::Run(const core::StepProgram& program, const DeviceRmsNorm* norm,
                                     GpuLayerActivations& act) const {
  const int64_t h = hidden_;
  const int rank = world_->rank();
  if (act.device() != world_->device() || act.hidden_size() != h) {
    return absl::InvalidArgumentError(absl::StrCat(
        program.label, ", rank ", rank, ": activations on device ", act.device(), " with H ",
        act.hidden_size(), ", expected device ", world_->device(), " with H ", h));
  }
  if (norm != nullptr && norm->device() != world_->device()) {
    return absl::InvalidArgumentError(absl::StrCat(program.label, ", rank ", rank,
                                                   ": norm on device ", norm->device(),
                                                   ", expected device ", world_->device()));
  }
  RETURN_IF_ERROR(core::CheckStepInputs(program, h, norm != nullptr ? norm->hidden() : -1,
                                        act.hidden_rows_, act.has_residual_, act.residual_rows_,
                                        rank));
  if (act.capacity_rows() < program.MaxRows()) {
    return absl::ResourceExhaustedError(absl::StrCat(program.label, ", rank ", rank,
                                                     ": activations hold ", act.capacity_rows(),
                                                     " rows, the step needs ", program.MaxRows()));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world_->device()), "cudaSetDevice"));
  const cudaStream_t stream = world_->stream();
  auto buf = [&](StepTensor t) -> float*& {
    return t == StepTensor::kHidden ? act.hidden_ : act.residual_;
  };
  auto set_rows = [&](StepTensor t, int64_t rows) {
    if (t == StepTensor::kHidden) {
      act.hidden_rows_ = rows;
    } else {
      act.residual_rows_ = rows;
      act.has_residual_ = true;
    }
  };
  const std::vector<StepPrimitive>& prims = program.primitives;
  for (size_t i = 0; i < prims.size(); ++i) {
    const StepPrimitive& p = prims[i];
    float*& t = buf(p.tensor);
    switch (p.op) {
      case StepOp::kAllGather: {
        const int64_t bytes = p.rows_in * h * kFloatBytes;
        if (bytes > 0) {
          StreamCollective& g = Group(p.group);
          const float* src = t;
          float* dst = act.scratch_;
          RETURN_IF_ERROR(OnGroupStream(p.group, [&] { return g.AllGather(src, bytes, dst); }));
        }
        std::swap(t, act.scratch_);
        break;
      }
      case StepOp::kReduceScatter: {
        StreamCollective& g = Group(p.group);
        const int64_t chunk = p.rows_out * h;
        if (chunk > 0) {
          const std::vector<int64_t> bytes(g.size(), chunk * kFloatBytes);
          const float* full = t;
          float* recv = act.scratch_;
          RETURN_IF_ERROR(
              OnGroupStream(p.group, [&] { return g.AllToAllV(full, bytes, recv, bytes); }));
          // The sum is ordered after the exchange that read `t` (world stream).
          RETURN_IF_ERROR(LaunchSumChunks(recv, g.size(), chunk, t, stream));
        }
        break;
      }
      case StepOp::kAllReduce: {
        StreamCollective& g = Group(p.group);
        const bool fuse = p.tensor == StepTensor::kHidden && i + 1 < prims.size() &&
                          prims[i + 1].op == StepOp::kAddAndNorm;
        if (fuse) {
          // Fused or not, AllReduceAddRmsNorm always all-reduces.
          const AllReduceNormImpl impl = AllReduceNormFor(p.rows_in);
          RETURN_IF_ERROR(OnGroupStream(p.group, [&] {
            return AllReduceAddRmsNorm(g, impl, act.hidden_, act.residual_, norm->weight(),
                                       p.rows_in, h, norm->eps());
          }));
          ++i;  // the add_and_norm ran with it
        } else if (p.rows_in > 0) {
          float* data = t;
          RETURN_IF_ERROR(
              OnGroupStream(p.group, [&] { return g.AllReduceSum(data, p.rows_in * h); }));
        }
        break;
      }
      case StepOp::kAddResidual:
        RETURN_IF_ERROR(LaunchAddInPlace(act.hidden_, act.residual_, p.rows_in * h, stream));
        if (p.drop_residual) {
          act.has_residual_ = false;
          act.residual_rows_ = 0;
        }
        break;
      case StepOp::kSlice: {
        float* src = buf(p.source);
        const float* from = src + p.first * h;
        if (p.tensor != p.source) {
          RETURN_IF_ERROR(CopyRows(t, from, p.rows_out, h, stream));
        } else if (p.first >= p.rows_out) {
          // [first, first + n) and [0, n) are disjoint: copy to the front.
          RETURN_IF_ERROR(CopyRows(t, from, p.rows_out, h, stream));
        } else if (p.first > 0) {
          RETURN_IF_ERROR(CopyRows(act.scratch_, from, p.rows_out, h, stream));
          std::swap(t, act.scratch_);
        }
        break;
      }
      case StepOp::kPlace:
        if (p.rows_out > 0) {
          RETURN_IF_ERROR(internal::CudaStatus(
              cudaMemsetAsync(act.scratch_, 0, p.rows_out * h * kFloatBytes, stream),
              "cudaMemsetAsync(place)"));
          RETURN_IF_ERROR(CopyRows(act.scratch_ + p.first * h, act.hidden_, p.rows_in, h, stream));
        }
        std::swap(act.hidden_, act.scratch_);
        break;
      case StepOp::kAddAndNorm:
        RETURN_IF_ERROR(LaunchAddResidualRmsNorm(act.hidden_, act.residual_, norm->weight(),
                                                 p.rows_in, h, norm->eps(), stream));
        break;
      case StepOp::kStoreAndNorm:
        RETURN_IF_ERROR(LaunchStoreResidualRmsNorm(act.hidden_, act.residual_, norm->weight(),
                                                   p.rows_in, h, norm->eps(), stream));
        set_rows(StepTensor::kResidual, p.rows_in);
        break;
      case StepOp::kNorm:
        RETURN_IF_ERROR(LaunchRmsNorm(act.hidden_, act.hidden_, norm->weight(), p.rows_in, h,
                                      norm->eps(), stream));
        break;
    }
    set_rows(p.tensor, p.rows_out);
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels
