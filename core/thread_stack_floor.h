#pragma once

// A floor under the stack size that libraries request for their threads.
//
// civetweb (behind prometheus-cpp's /metrics Exposer) starts its threads with
// pthread_attr_setstacksize(~40 KB). glibc refuses a stack smaller than the
// process's static TLS plus a minimum, and a CUDA build links cuBLAS, cuBLASLt,
// cudart and NCCL, whose static TLS alone is ~180 KB: pthread_create fails and
// the Exposer throws "null context when constructing CivetServer" (seen on
// this project's CUDA build; the CPU-only build was not affected). This file
// interposes pthread_attr_setstacksize for the worker's executables and raises
// any request below kMinThreadStackBytes to it; larger requests pass unchanged.

#include <cstddef>

namespace moe_ep::core {

// 1 MiB: room for the static TLS of the CUDA libraries and the thread's own use.
inline constexpr size_t kMinThreadStackBytes = size_t{1} << 20;

// Returns the stack size pthread_attr_setstacksize(attr, requested) will set:
// max(requested, kMinThreadStackBytes). Calling it also makes sure the
// interposer's object file is linked into the executable.
size_t EffectiveThreadStackBytes(size_t requested);

}  // namespace moe_ep::core
