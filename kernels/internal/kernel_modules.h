#pragma once

// One kernel of each translation unit whose kernels a worker launches once
// it has a dispatcher (the step path, and LoadExperts' seeded weights, which
// may run while a peer is mid-step):
// the handle through which kernels/kernel_preload.cc finds that unit's CUDA
// module and loads all of it. Each is defined at the end of its .cu file
// (the kernels live in anonymous namespaces). Not part of the public API.

namespace moe_ep::kernels::internal {

const void* CombineReduceModule();      // kernels/combine_reduce.cu
const void* DispatchPackModule();       // kernels/dispatch_pack.cu
const void* EngineRowsModule();         // kernels/engine_rows.cu
const void* ExpertKernelsModule();      // kernels/expert_kernels.cu (cub's sort too)
const void* Fp8DispatchModule();        // kernels/fp8_dispatch.cu
const void* Fp8ExpertKernelsModule();   // kernels/fp8_expert_kernels.cu
const void* Fp8GroupedGemmModule();     // kernels/fp8_grouped_gemm.cu
const void* GroupedGemmModule();        // kernels/grouped_gemm.cu
const void* HopperGroupedGemmModule();  // kernels/hopper_grouped_gemm.cu
const void* Mxfp4GroupedGemmModule();   // kernels/mxfp4_grouped_gemm.cu
const void* RmsNormModule();            // kernels/rms_norm.cu
const void* RouteModule();
const void* SeededWeightsModule();     // kernels/seeded_weights.cu              // kernels/route.cu
const void* SharedExpertPackModule();  // kernels/shared_expert_pack.cu
const void* StepHeaderModule();        // kernels/step_header.cu
const void* OneSidedKernelsModule();   // kernels/onesided/onesided_kernels.cu
const void* NcclPeerWindowModule();    // kernels/onesided/nccl_peer_window.cu

}  // namespace moe_ep::kernels::internal
