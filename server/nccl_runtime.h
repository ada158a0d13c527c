#pragma once

// The NCCL runtime check of a CUDA build (issue 16 item 1): the libnccl
// found at run time must be the release the worker was built against, else
// the worker (moe-ep-worker or the embedded one, server/worker_process.h)
// refuses to start with a message naming both versions, instead of failing
// later inside a collective. Source: DESIGN §11, §14.

#include "absl/status/status.h"

namespace moe_ep::server {

// Compares NCCL version codes (NCCL_VERSION_CODE encoding since 2.9:
// major * 10000 + minor * 100 + patch): major and minor must be equal (NCCL
// keeps its ABI within a minor release; patch releases only fix bugs).
// Errors: kFailedPrecondition "NCCL runtime 2.19.3 differs from the NCCL
// 2.21.5 this library was built against ...". Pure and thread-safe.
absl::Status CompareNcclVersions(int built_against, int at_run_time);

// On a CUDA build: ncclGetVersion() against NCCL_VERSION_CODE through
// CompareNcclVersions (kUnavailable when ncclGetVersion fails). Without
// CUDA: OK (there is no NCCL). Thread-safe.
absl::Status CheckNcclRuntime();

}  // namespace moe_ep::server
