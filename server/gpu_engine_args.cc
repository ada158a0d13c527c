#include "server/gpu_engine_args.h"

#ifdef MOE_EP_HAVE_CUDA

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/engine_call_checks.h"

namespace moe_ep::server {

absl::Status CheckEngineDevicePointers(
    const char* call, absl::string_view plane, int device, kernels::DevicePointerCache& known,
    std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& [name, ptr] : ptrs) {
    if (ptr != nullptr && !known.IsDevicePointer(ptr, device)) {
      return absl::InvalidArgumentError(absl::StrCat(
          call, ": ", name, " is not device memory of CUDA device ", device, "; the ", plane,
          " data plane takes device pointers on the worker's device (a host buffer or another "
          "device's tensor?)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckEngineDispatchArgs(absl::string_view plane, int device,
                                     kernels::DevicePointerCache& known, int rank,
                                     const absl::Status& step, int64_t runtime_max,
                                     int num_local_experts, const void* hidden,
                                     const int32_t* topk_ids, const float* topk_weights,
                                     int64_t num_tokens, const EngineRecvBuffers& out) {
  RETURN_IF_ERROR(CheckEngineDevicePointers("dispatch", plane, device, known,
                                            {{"hidden", hidden},
                                             {"topk_ids", topk_ids},
                                             {"topk_weights", topk_weights},
                                             {"recv_hidden", out.hidden},
                                             {"recv_topk_ids", out.topk_ids},
                                             {"recv_topk_weights", out.topk_weights},
                                             {"source_counts", out.source_counts},
                                             {"expert_counts", out.expert_counts}}));
  RETURN_IF_ERROR(step);
  RETURN_IF_ERROR(CheckEngineRecvBuffers("dispatch", rank, out, runtime_max, num_local_experts));
  return CheckEngineInputs("dispatch", rank, num_tokens, hidden, topk_ids, topk_weights);
}

absl::Status CheckEngineForwardArgs(absl::string_view plane, int device,
                                    kernels::DevicePointerCache& known, int rank,
                                    const absl::Status& loaded, const absl::Status& step,
                                    const void* hidden, const int32_t* topk_ids,
                                    const float* topk_weights, int64_t num_tokens,
                                    const void* output) {
  RETURN_IF_ERROR(loaded);
  RETURN_IF_ERROR(CheckEngineDevicePointers("forward", plane, device, known,
                                            {{"hidden", hidden},
                                             {"topk_ids", topk_ids},
                                             {"topk_weights", topk_weights},
                                             {"output", output}}));
  RETURN_IF_ERROR(step);
  RETURN_IF_ERROR(CheckEngineInputs("forward", rank, num_tokens, hidden, topk_ids, topk_weights));
  return CheckEngineOutput("forward", rank, num_tokens, output);
}

absl::Status CheckGpuEngineCombineArgs(absl::string_view plane, int device,
                                       kernels::DevicePointerCache& known, int rank, int64_t rows,
                                       int64_t runtime_max, const void* expert_out,
                                       const void* output, int64_t step_tokens) {
  RETURN_IF_ERROR(CheckEngineDevicePointers("combine", plane, device, known,
                                            {{"expert_out", expert_out}, {"output", output}}));
  return CheckEngineCombineArgs("combine", rank, rows, runtime_max, expert_out, output,
                                step_tokens);
}

kernels::UnpackReceivedParams EngineUnpackParams(const core::EpDispatcherOptions& options,
                                                 const EngineRecvBuffers& out, const uint8_t* recv,
                                                 int64_t runtime_max, int first_expert,
                                                 int num_local_experts) {
  kernels::UnpackReceivedParams p;
  p.recv = recv;
  p.runtime_max = runtime_max;
  p.rows = out.rows;
  p.hidden_size = options.workspace.hidden;
  p.top_k = options.workspace.top_k;
  p.ep_size = options.workspace.ep_size;
  p.first_expert = first_expert;
  p.num_local_experts = num_local_experts;
  p.invalid_expert_id = options.invalid_expert_id;
  p.hidden = reinterpret_cast<uint16_t*>(out.hidden);
  p.topk_ids = out.topk_ids;
  p.topk_weights = out.topk_weights;
  p.source_counts = out.source_counts;
  p.expert_counts = out.expert_counts;
  return p;
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
