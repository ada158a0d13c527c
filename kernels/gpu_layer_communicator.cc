#include "kernels/gpu_layer_communicator.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

using core::AfterMlpOp;
using core::BeforeAttentionOp;
using core::BeforeMlpOp;
using core::DpGatherLayout;
using core::ModeRows;
using core::ScatterMode;

constexpr int64_t kFloatBytes = static_cast<int64_t>(sizeof(float));

absl::Status CheckDevice(int device) {
  int n = 0;
  RETURN_IF_ERROR(internal::CudaStatus(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
  if (device < 0 || device >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected in [0, ", n, "), got ", device));
  }
  return internal::CudaStatus(cudaSetDevice(device), "cudaSetDevice");
}

// Copies `rows` rows of H floats on `stream` (device to device).
absl::Status CopyRows(float* dst, const float* src, int64_t rows, int64_t hidden,
                      cudaStream_t stream) {
  if (rows == 0 || dst == src) return absl::OkStatus();
  return internal::CudaStatus(
      cudaMemcpyAsync(dst, src, rows * hidden * kFloatBytes, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpyAsync(rows)");
}

// Synchronous copy of `count` floats; nothing for zero.
absl::Status CopySync(float* dst, const float* src, size_t count, cudaMemcpyKind kind,
                      const char* what) {
  if (count == 0) return absl::OkStatus();
  return internal::CudaStatus(cudaMemcpy(dst, src, count * sizeof(float), kind), what);
}

}  // namespace

// ---------------------------------------------------------------------------
// DeviceRmsNorm

absl::StatusOr<std::unique_ptr<DeviceRmsNorm>> DeviceRmsNorm::Upload(const core::RmsNorm& norm,
                                                                     int device) {
  RETURN_IF_ERROR(CheckDevice(device));
  std::unique_ptr<DeviceRmsNorm> d(new DeviceRmsNorm());
  d->device_ = device;
  d->hidden_ = norm.hidden();
  d->eps_ = norm.eps();
  const int64_t bytes = d->hidden_ * kFloatBytes;
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&d->weight_, bytes), "cudaMalloc(norm weight)"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMemcpy(d->weight_, norm.weight().data(), bytes, cudaMemcpyHostToDevice),
      "cudaMemcpy(norm weight)"));
  // Land the copy before any non-blocking stream reads the weight.
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                                       "cudaStreamSynchronize(norm weight)"));
  return d;
}

DeviceRmsNorm::~DeviceRmsNorm() {
  if (weight_ != nullptr) {
    cudaSetDevice(device_);
    cudaFree(weight_);
  }
}

// ---------------------------------------------------------------------------
// GpuLayerActivations

absl::StatusOr<std::unique_ptr<GpuLayerActivations>> GpuLayerActivations::Create(
    int device, int64_t capacity_rows, int64_t hidden) {
  if (capacity_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_rows: expected >= 0, got ", capacity_rows));
  }
  if (hidden < 1)
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected >= 1, got ", hidden));
  RETURN_IF_ERROR(CheckDevice(device));
  std::unique_ptr<GpuLayerActivations> a(new GpuLayerActivations());
  a->device_ = device;
  a->capacity_rows_ = capacity_rows;
  a->hidden_size_ = hidden;
  // At least one row, so every buffer is a real device pointer even for a
  // rank with zero tokens (collectives tell device from host memory by it).
  const int64_t bytes = std::max<int64_t>(capacity_rows, 1) * hidden * kFloatBytes;
  for (float** p : {&a->hidden_, &a->residual_, &a->scratch_}) {
    RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(p, bytes),
                                         absl::StrCat("cudaMalloc(activations, ", bytes, " B)")));
  }
  return a;
}

GpuLayerActivations::~GpuLayerActivations() {
  cudaSetDevice(device_);
  cudaFree(hidden_);
  cudaFree(residual_);
  cudaFree(scratch_);
}

absl::Status GpuLayerActivations::SetRows(int64_t hidden_rows, int64_t residual_rows) {
  if (hidden_rows < 0 || hidden_rows > capacity_rows_ || residual_rows > capacity_rows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetRows: hidden_rows ", hidden_rows, " and residual_rows ", residual_rows,
                     " must be in [0, capacity_rows ", capacity_rows_, "] (residual < 0 = none)"));
  }
  hidden_rows_ = hidden_rows;
  has_residual_ = residual_rows >= 0;
  residual_rows_ = has_residual_ ? residual_rows : 0;
  return absl::OkStatus();
}

absl::Status GpuLayerActivations::Upload(const core::LayerActivations& host) {
  const int64_t h = hidden_size_;
  auto rows_of = [&](const std::vector<float>& v, const char* name) -> absl::StatusOr<int64_t> {
    const int64_t n = static_cast<int64_t>(v.size());
    if (n % h != 0 || n / h > capacity_rows_) {
      return absl::InvalidArgumentError(absl::StrCat("Upload: ", name, " has ", n,
                                                     " floats: expected a multiple of H ", h,
                                                     " and at most ", capacity_rows_, " rows"));
    }
    return n / h;
  };
  ASSIGN_OR_RETURN(const int64_t hidden_rows, rows_of(host.hidden, "hidden"));
  int64_t residual_rows = -1;
  if (host.residual.has_value()) {
    ASSIGN_OR_RETURN(residual_rows, rows_of(*host.residual, "residual"));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CopySync(hidden_, host.hidden.data(), host.hidden.size(), cudaMemcpyHostToDevice,
                           "cudaMemcpy(upload hidden)"));
  if (residual_rows >= 0) {
    RETURN_IF_ERROR(CopySync(residual_, host.residual->data(), host.residual->size(),
                             cudaMemcpyHostToDevice, "cudaMemcpy(upload residual)"));
  }
  // cudaMemcpy from pageable memory may return before its DMA lands, ordered
  // only on the legacy stream; the steps run on non-blocking streams.
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                                       "cudaStreamSynchronize(upload)"));
  return SetRows(hidden_rows, residual_rows);
}

absl::StatusOr<core::LayerActivations> GpuLayerActivations::Download() const {
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  core::LayerActivations out;
  out.hidden.resize(hidden_rows_ * hidden_size_);
  RETURN_IF_ERROR(CopySync(out.hidden.data(), hidden_, out.hidden.size(), cudaMemcpyDeviceToHost,
                           "cudaMemcpy(download hidden)"));
  if (has_residual_) {
    out.residual.emplace(residual_rows_ * hidden_size_);
    RETURN_IF_ERROR(CopySync(out.residual->data(), residual_, out.residual->size(),
                             cudaMemcpyDeviceToHost, "cudaMemcpy(download residual)"));
  }
  return out;
}

// ---------------------------------------------------------------------------
// GpuLayerCommunicator

absl::StatusOr<std::unique_ptr<GpuLayerCommunicator>> GpuLayerCommunicator::Create(
    const GpuParallelGroups* groups, const core::LayerPlan& plan, int64_t hidden,
    const GpuLayerCommunicatorOptions& options) {
  if (groups == nullptr) return absl::InvalidArgumentError("groups is null");
  if (hidden < 1)
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected >= 1, got ", hidden));
  if (options.all_reduce_norm != AllReduceNormImpl::kFused &&
      options.all_reduce_norm != AllReduceNormImpl::kUnfused) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.all_reduce_norm: expected fused or unfused, got ",
                     static_cast<int>(options.all_reduce_norm)));
  }
  StreamCollective* world = &groups->world();
  StreamCollective* attn_tp = &groups->attn_tp();
  std::unique_ptr<GpuLayerCommunicator> c(new GpuLayerCommunicator());
  c->groups_ = groups;
  c->world_ = world;
  c->attn_tp_ = attn_tp;
  c->plan_ = plan;
  c->hidden_ = hidden;
  c->options_ = options;
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventCreateWithFlags(&c->fork_, cudaEventDisableTiming),
                                       "cudaEventCreate(fork)"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventCreateWithFlags(&c->join_, cudaEventDisableTiming),
                                       "cudaEventCreate(join)"));
  return c;
}

GpuLayerCommunicator::~GpuLayerCommunicator() {
  if (world_ != nullptr) cudaSetDevice(world_->device());
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (join_ != nullptr) cudaEventDestroy(join_);
}

AllReduceNormImpl GpuLayerCommunicator::AllReduceNormFor(int64_t rows) const {
  if (options_.all_reduce_norm == AllReduceNormImpl::kFused && options_.fused_max_rows >= 0 &&
      rows > options_.fused_max_rows) {
    return AllReduceNormImpl::kUnfused;
  }
  return options_.all_reduce_norm;
}

absl::Status GpuLayerCommunicator::Synchronize() const {
  RETURN_IF_ERROR(attn_tp_->Synchronize());
  return world_->Synchronize();
}

absl::Status GpuLayerCommunicator::CheckRows(const char* step, const char* tensor, int64_t rows,
                                             const DpGatherLayout& dp, ScatterMode mode) const {
  if (rows != ModeRows(dp, mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(), ": ", tensor, " in ",
        core::ScatterModeName(mode), " must have ", ModeRows(dp, mode), " rows, got ", rows));
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::CheckActivations(const char* step, const DpGatherLayout& dp,
                                                    const GpuLayerActivations& act) const {
  if (act.device() != world_->device() || act.hidden_size() != hidden_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(),
                     ": activations on device ", act.device(), " with H ", act.hidden_size(),
                     ", expected device ", world_->device(), " with H ", hidden_));
  }
  int64_t needed = 0;
  for (ScatterMode m : {plan_.input, plan_.attention, plan_.residual, plan_.mlp, plan_.output}) {
    needed = std::max(needed, ModeRows(dp, m));
  }
  if (act.capacity_rows() < needed) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer ", plan_.layer, ", step ", step, ", rank ", groups_->rank(), ": activations hold ",
        act.capacity_rows(), " rows, the plan needs ", needed, " for this step's DP layout"));
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::CheckNorm(const char* which, const DeviceRmsNorm& norm) const {
  if (norm.hidden() != hidden_ || norm.device() != world_->device()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer ", plan_.layer, ": ", which, " norm has hidden ", norm.hidden(), " on device ",
        norm.device(), ", expected ", hidden_, " on device ", world_->device()));
  }
  return absl::OkStatus();
}

template <typename F>
absl::Status GpuLayerCommunicator::OnAttnTpStream(F&& enqueue) const {
  const cudaStream_t main = world_->stream();
  const cudaStream_t side = attn_tp_->stream();
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventRecord(fork_, main), "cudaEventRecord(fork)"));
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaStreamWaitEvent(side, fork_, 0), "cudaStreamWaitEvent(fork)"));
  RETURN_IF_ERROR(enqueue());
  RETURN_IF_ERROR(internal::CudaStatus(cudaEventRecord(join_, side), "cudaEventRecord(join)"));
  return internal::CudaStatus(cudaStreamWaitEvent(main, join_, 0), "cudaStreamWaitEvent(join)");
}

absl::Status GpuLayerCommunicator::AttnTpAllGather(const float* src, int64_t rows,
                                                   float* dst) const {
  const int64_t bytes = rows * hidden_ * kFloatBytes;
  if (bytes == 0) return absl::OkStatus();
  return OnAttnTpStream([&] { return attn_tp_->AllGather(src, bytes, dst); });
}

absl::Status GpuLayerCommunicator::ReduceScatter(StreamCollective& group, bool on_attn_tp,
                                                 const float* full, int64_t full_rows, float* recv,
                                                 float* out) const {
  const int n = group.size();
  if (full_rows % n != 0) {
    return absl::InternalError(
        absl::StrCat("reduce-scatter of ", full_rows, " rows over a group of ", n, " is not even"));
  }
  const int64_t chunk = full_rows / n * hidden_;
  if (chunk == 0) return absl::OkStatus();
  const std::vector<int64_t> bytes(n, chunk * kFloatBytes);
  auto exchange = [&] { return group.AllToAllV(full, bytes, recv, bytes); };
  if (on_attn_tp) {
    RETURN_IF_ERROR(OnAttnTpStream(exchange));
  } else {
    RETURN_IF_ERROR(exchange());
  }
  return LaunchSumChunks(recv, n, chunk, out, world_->stream());
}

absl::Status GpuLayerCommunicator::AddAndNorm(const DeviceRmsNorm& norm,
                                              GpuLayerActivations& act) const {
  return LaunchAddResidualRmsNorm(act.hidden_, act.residual_, norm.weight(), act.hidden_rows_,
                                  hidden_, norm.eps(), world_->stream());
}

absl::Status GpuLayerCommunicator::PrepareAttention(const DpGatherLayout& dp,
                                                    const DeviceRmsNorm& input_norm,
                                                    GpuLayerActivations& act) const {
  constexpr const char* kStep = "before_attention";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows_, dp, plan_.input));
  if (act.has_residual_) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows_, dp, plan_.input));
  }
  RETURN_IF_ERROR(CheckNorm("input", input_norm));
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world_->device()), "cudaSetDevice"));
  const cudaStream_t stream = world_->stream();
  const int64_t rows = act.hidden_rows_;
  if (act.has_residual_) {
    RETURN_IF_ERROR(AddAndNorm(input_norm, act));
  } else {
    RETURN_IF_ERROR(LaunchStoreResidualRmsNorm(act.hidden_, act.residual_, input_norm.weight(),
                                               rows, hidden_, input_norm.eps(), stream));
    act.has_residual_ = true;
    act.residual_rows_ = rows;
  }
  if (plan_.before_attention == BeforeAttentionOp::kAttnTpAllGather) {
    RETURN_IF_ERROR(AttnTpAllGather(act.hidden_, rows, act.scratch_));
    std::swap(act.hidden_, act.scratch_);
    act.hidden_rows_ = rows * groups_->attn_tp_size();
  }
  return absl::OkStatus();
}

absl::Status GpuLayerCommunicator::PrepareMlp(const DpGatherLayout& dp,
                                              const DeviceRmsNorm& post_attention_norm,
                                              GpuLayerActivations& act) const {
  constexpr const char* kStep = "before_mlp";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows_, dp, plan_.attention));
  if (!act.has_residual_) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer ", plan_.layer, ", step before_mlp, rank ", groups_->rank(),
                     ": no residual (the input norm of step before_attention creates it)"));
  }
  RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows_, dp, plan_.input));
  RETURN_IF_ERROR(CheckNorm("post-attention", post_attention_norm));
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world_->device()), "cudaSetDevice"));
  const cudaStream_t stream = world_->stream();
  const int attn_tp_size = groups_->attn_tp_size();
  if (plan_.gather_residual) {
    RETURN_IF_ERROR(AttnTpAllGather(act.residual_, act.residual_rows_, act.scratch_));
    std::swap(act.residual_, act.scratch_);
    act.residual_rows_ *= attn_tp_size;
  }
  switch (plan_.before_mlp) {
    case BeforeMlpOp::kNormOnly:
      RETURN_IF_ERROR(AddAndNorm(post_attention_norm, act));
      break;
    case BeforeMlpOp::kDpGatherAfterResidual: {
      // The attention output is a partial sum over the attention-TP group; the
      // residual is complete on every rank, so only rank 0 adds it.
      if (plan_.norm_before_gather) {
        RETURN_IF_ERROR(AddAndNorm(post_attention_norm, act));
      } else if (groups_->attn_tp_rank() == 0) {
        RETURN_IF_ERROR(
            LaunchAddInPlace(act.hidden_, act.residual_, act.hidden_rows_ * hidden_, stream));
      }
      // Summing DP gather (DESIGN §4): zeroed [global_rows, H], this group's
      // rows at its offset, all-reduce over the world.
      const int64_t global_elems = dp.global_rows * hidden_;
      float* global = act.scratch_;
      if (global_elems > 0) {
        RETURN_IF_ERROR(internal::CudaStatus(
            cudaMemsetAsync(global, 0, global_elems * kFloatBytes, stream), "cudaMemsetAsync"));
        RETURN_IF_ERROR(CopyRows(global + dp.offsets[dp.dp_rank] * hidden_, act.hidden_,
                                 act.hidden_rows_, hidden_, stream));
        RETURN_IF_ERROR(world_->AllReduceSum(global, global_elems));
      }
      if (!plan_.norm_before_gather) {
        RETURN_IF_ERROR(CopyRows(act.residual_, global + dp.offsets[dp.dp_rank] * hidden_,
                                 dp.local_rows, hidden_, stream));
        act.residual_rows_ = dp.local_rows;
        RETURN_IF_ERROR(LaunchRmsNorm(global, global, post_attention_norm.weight(), dp.global_rows,
                                      hidden_, post_attention_norm.eps(), stream));
      }
      std::swap(act.hidden_, act.scratch_);
      act.hidden_rows_ = dp.global_rows;
      break;
    }
    case BeforeMlpOp::kAllReduceAddNorm:
      // Fused or not, the all-reduce always runs (AllReduceAddRmsNorm).
      RETURN_IF_ERROR(AllReduceAddRmsNorm(*world_, AllReduceNormFor(act.hidden_rows_), act.hidden_,
                                          act.residual_, post_attention_norm.weight(),
                                          act.hidden_rows_, hidden_, post_attention_norm.eps()));
      break;
    case BeforeMlpOp::kReduceScatterNorm: {
      const int64_t full_rows = act.hidden_rows_;
      RETURN_IF_ERROR(ReduceScatter(*attn_tp_, /*on_attn_tp=*/true, act.hidden_, full_rows,
                                    act.scratch_, act.hidden_));
      act.hidden_rows_ = full_rows / attn_tp_size;
      if (plan_.split_residual) {
        const int64_t s = core::DpScatteredRowsPerRank(dp);
        // Rows [j*s, (j+1)*s) to the front; disjoint from [0, s) for j >= 1.
        RETURN_IF_ERROR(CopyRows(act.residual_,
                                 act.residual_ + groups_->attn_tp_rank() * s * hidden_, s, hidden_,
                                 stream));
        act.residual_rows_ = s;
      }
      RETURN_IF_ERROR(AddAndNorm(post_attention_norm, act));
      break;
    }
    case BeforeMlpOp::kAttnTpAllReduceNorm: {
      const AllReduceNormImpl impl = AllReduceNormFor(act.hidden_rows_);
      RETURN_IF_ERROR(OnAttnTpStream([&] {
        return AllReduceAddRmsNorm(*attn_tp_, impl, act.hidden_, act.residual_,
                                   post_attention_norm.weight(), act.hidden_rows_, hidden_,
                                   post_attention_norm.eps());
      }));
      break;
    }
  }
  RETURN_IF_ERROR(CheckRows(kStep, "hidden (out)", act.hidden_rows_, dp, plan_.mlp));
  return CheckRows(kStep, "residual (out)", act.residual_rows_, dp, plan_.residual);
}

AfterMlpOp GpuLayerCommunicator::ResolveAfterMlp(const DpGatherLayout& dp,
                                                 bool allow_reduce_scatter) const {
  return core::ResolveAfterMlpOp(plan_, dp.mode, allow_reduce_scatter);
}

absl::Status GpuLayerCommunicator::PostMlp(const DpGatherLayout& dp, AfterMlpOp op,
                                           GpuLayerActivations& act) const {
  constexpr const char* kStep = "after_mlp";
  RETURN_IF_ERROR(core::CheckDpLayoutFits(dp, *groups_, plan_.layer));
  const bool allowed = op == plan_.after_mlp || (op == AfterMlpOp::kReduceScatter &&
                                                 plan_.after_mlp == AfterMlpOp::kDpScatter);
  if (!allowed) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", plan_.layer, ", step after_mlp: op ", core::StepName(op),
                     " is not allowed by the plan's ", core::StepName(plan_.after_mlp)));
  }
  RETURN_IF_ERROR(CheckActivations(kStep, dp, act));
  RETURN_IF_ERROR(CheckRows(kStep, "hidden", act.hidden_rows_, dp, plan_.mlp));
  if (act.has_residual_) {
    RETURN_IF_ERROR(CheckRows(kStep, "residual", act.residual_rows_, dp, plan_.residual));
  }
  const std::string where = absl::StrCat("layer ", plan_.layer, ", step after_mlp (",
                                         core::StepName(op), "), rank ", groups_->rank(), ": ");
  if (op == AfterMlpOp::kReduceScatter && dp.mode != core::DpPaddingMode::kMaxLen) {
    return absl::FailedPreconditionError(absl::StrCat(where, "needs MAX_LEN padding, the step has ",
                                                      core::DpPaddingModeName(dp.mode)));
  }
  if (op == AfterMlpOp::kAddResidualAllGather && !act.has_residual_) {
    return absl::FailedPreconditionError(absl::StrCat(where, "needs a residual, there is none"));
  }
  if (op == AfterMlpOp::kTakeSplit && act.has_residual_) {
    return absl::FailedPreconditionError(
        absl::StrCat(where, "requires no residual (add it into hidden first)"));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(world_->device()), "cudaSetDevice"));
  const cudaStream_t stream = world_->stream();
  switch (op) {
    case AfterMlpOp::kNone:
      break;
    case AfterMlpOp::kDpScatter:
      RETURN_IF_ERROR(CopyRows(act.scratch_, act.hidden_ + dp.offsets[dp.dp_rank] * hidden_,
                               dp.local_rows, hidden_, stream));
      std::swap(act.hidden_, act.scratch_);
      act.hidden_rows_ = dp.local_rows;
      break;
    case AfterMlpOp::kReduceScatter: {
      // World reduce-scatter into this rank's chunk (inside its DP group's
      // slice under MAX_LEN): the chunks arrive in scratch and are summed into
      // hidden's front (the all-to-all that read hidden is stream-ordered
      // before the sum); then the attention-TP all-gather back to
      // TP_ATTN_FULL, into scratch.
      const int64_t full_rows = act.hidden_rows_;
      const int64_t chunk_rows = full_rows / groups_->tp_size();
      RETURN_IF_ERROR(ReduceScatter(*world_, /*on_attn_tp=*/false, act.hidden_, full_rows,
                                    act.scratch_, act.hidden_));
      RETURN_IF_ERROR(AttnTpAllGather(act.hidden_, chunk_rows, act.scratch_));
      std::swap(act.hidden_, act.scratch_);
      act.hidden_rows_ = chunk_rows * groups_->attn_tp_size();
      break;
    }
    case AfterMlpOp::kAddResidualAllGather: {
      RETURN_IF_ERROR(
          LaunchAddInPlace(act.hidden_, act.residual_, act.hidden_rows_ * hidden_, stream));
      act.has_residual_ = false;
      act.residual_rows_ = 0;
      const int64_t rows = act.hidden_rows_;
      RETURN_IF_ERROR(AttnTpAllGather(act.hidden_, rows, act.scratch_));
      std::swap(act.hidden_, act.scratch_);
      act.hidden_rows_ = rows * groups_->attn_tp_size();
      break;
    }
    case AfterMlpOp::kTakeSplit: {
      const int64_t s = core::DpScatteredRowsPerRank(dp);
      RETURN_IF_ERROR(CopyRows(act.hidden_, act.hidden_ + groups_->attn_tp_rank() * s * hidden_, s,
                               hidden_, stream));
      act.hidden_rows_ = s;
      break;
    }
  }
  RETURN_IF_ERROR(CheckRows(kStep, "hidden (out)", act.hidden_rows_, dp, plan_.output));
  if (act.has_residual_) {
    return CheckRows(kStep, "residual (out)", act.residual_rows_, dp, plan_.output);
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels
