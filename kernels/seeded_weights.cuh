#pragma once

// Host launcher of seeded SwiGLU expert weights generated on the GPU: the
// same bits as core::ExpertSet::GenerateSwiGlu (both evaluate the stream of
// core/seeded_stream.h), written straight into the device layout of
// kernels/device_experts.h, so a worker's experts never cross PCIe.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

struct SeededSwiGluParams {
  uint64_t seed = 0;
  int layer = 0;
  int first_expert = 0;         // global id of local expert 0
  int num_experts = 0;          // L
  int64_t hidden = 0;           // H
  int64_t intermediate = 0;     // I
  uint16_t* gate_up = nullptr;  // device [L, 2I, H] bf16: gate rows [0, I), up rows [I, 2I)
  uint16_t* down = nullptr;     // device [L, H, I] bf16
};

// LaunchSeededSwiGluWeights()
//
// Enqueues on `stream` the generation of experts [first_expert,
// first_expert + L) of `layer`: gate and up uniform in [-1/sqrt(H), 1/sqrt(H)),
// down in [-1/sqrt(I), 1/sqrt(I)), bf16, bit-identical to
// core::ExpertSet::GenerateSwiGlu(seed, layer, first_expert, L, H, I). Writes
// every element of gate_up [L, 2I, H] and down [L, H, I]. Nothing is
// enqueued for L = 0 (the pointers may then be null).
//
// Errors (checked on the host, nothing enqueued):
//   kInvalidArgument  hidden or intermediate < 1, num_experts or
//                     first_expert < 0, a null pointer with L > 0.
//   kInternal         a launch failed (cudaGetErrorString in the message).
// Never allocates or synchronises.
// Example: seed 1, layer 0, expert 0, H 64, I 16: gate[0] = 0xbdf8 (the value
// tests/core/experts_test.cc pins for the host generator).
absl::Status LaunchSeededSwiGluWeights(const SeededSwiGluParams& params, cudaStream_t stream);

}  // namespace moe_ep::kernels
