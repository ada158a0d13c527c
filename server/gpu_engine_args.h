#pragma once

// What both GPU transports' engine calls (server/gpu_engine_calls.cc,
// server/onesided_engine_calls.cc) check and build alike, written once
// (issue 34 item 1): the device-pointer check of an engine's buffers, a
// dispatch's and a forward's argument checks and the unpack parameters of its receive region. The
// stream events and the expert-output pack are kernels/ (kernels/plane_events.h,
// kernels/engine_rows.cuh).

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/ep_dispatcher.h"
#include "kernels/device_calls.h"
#include "kernels/engine_rows.cuh"
#include "server/data_plane.h"

namespace moe_ep::server {

// CheckEngineDevicePointers()
//
// Every non-null pointer of `ptrs` (name, pointer) is device memory of CUDA
// device `device` (or managed memory): the GPU planes' engine calls take
// device pointers on the worker's device, and the Python layer leaves the
// tensors' device to this check (issue 30 item 3). `known` is the
// plane's memory of addresses already checked (a hash lookup each in an
// engine's steady state instead of a driver call: issue 30 item 3).
// Errors: kInvalidArgument naming the call, the pointer, `plane` and `device`.
absl::Status CheckEngineDevicePointers(
    const char* call, absl::string_view plane, int device, kernels::DevicePointerCache& known,
    std::initializer_list<std::pair<const char*, const void*>> ptrs);

// CheckEngineDispatchArgs()
//
// The argument checks of both GPU planes' dispatch on `rank`, whose failure
// makes the plane refuse the step (issue 30 item 1), in the order their
// errors are reported: CheckEngineDevicePointers of the eight buffers (the
// inputs and `out`'s, named as moe_ep_dispatch names them); `step`, the
// plane dispatcher's geometry check of T (a committed geometry, 0 <= T <=
// R: computed by the caller, reported here); CheckEngineRecvBuffers for R =
// `runtime_max` and `num_local_experts`; CheckEngineInputs of the T =
// `num_tokens` inputs. Errors: the first failing check's.
absl::Status CheckEngineDispatchArgs(absl::string_view plane, int device,
                                     kernels::DevicePointerCache& known, int rank,
                                     const absl::Status& step, int64_t runtime_max,
                                     int num_local_experts, const void* hidden,
                                     const int32_t* topk_ids, const float* topk_weights,
                                     int64_t num_tokens, const EngineRecvBuffers& out);

// CheckEngineForwardArgs()
//
// The argument checks of both GPU planes' forward on `rank`, whose failure
// makes the plane refuse the step as a refused dispatch (issue 30 item 1),
// in the order their errors are reported: `loaded`, the plane's check that
// the layer's experts are loaded (computed by the caller, reported here);
// CheckEngineDevicePointers of the four buffers (named as moe_ep_forward
// names them); `step`, the dispatcher's geometry check of T (0 <= T <= R);
// CheckEngineInputs and CheckEngineOutput of the T = `num_tokens` rows.
// Errors: the first failing check's.
absl::Status CheckEngineForwardArgs(absl::string_view plane, int device,
                                    kernels::DevicePointerCache& known, int rank,
                                    const absl::Status& loaded, const absl::Status& step,
                                    const void* hidden, const int32_t* topk_ids,
                                    const float* topk_weights, int64_t num_tokens,
                                    const void* output);

// CheckGpuEngineCombineArgs()
//
// The argument checks of both GPU planes' combine on `rank`, whose failure
// makes the plane refuse the combine when a step is dispatched (issue 30
// item 1), in the order their errors are reported: CheckEngineDevicePointers
// of `expert_out` and `output`; CheckEngineCombineArgs for R = `runtime_max`
// and the dispatched step's `step_tokens`. Errors: the first failing check's.
absl::Status CheckGpuEngineCombineArgs(absl::string_view plane, int device,
                                       kernels::DevicePointerCache& known, int rank, int64_t rows,
                                       int64_t runtime_max, const void* expert_out,
                                       const void* output, int64_t step_tokens);

// EngineUnpackParams()
//
// The unpack of a dispatch's receive region `recv` (R = `runtime_max`) into
// the caller's `out`, for the rank holding experts [first_expert,
// first_expert + num_local_experts) of a workspace of `options`
// (kernels/engine_rows.cuh LaunchUnpackReceived). Pure.
kernels::UnpackReceivedParams EngineUnpackParams(const core::EpDispatcherOptions& options,
                                                 const EngineRecvBuffers& out, const uint8_t* recv,
                                                 int64_t runtime_max, int first_expert,
                                                 int num_local_experts);

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
