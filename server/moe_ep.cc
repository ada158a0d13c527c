// The C API of server/moe_ep.h over server/worker_process.h (the worker) and
// WorkerService::RunOnDataPlane (its data plane). Each entry point converts
// its C arguments, calls C++ that returns absl::Status, and records the
// status in the calling thread's message; no C++ exception crosses the C
// boundary (anything thrown becomes MOE_EP_INTERNAL).

#include "server/moe_ep.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/command_line.h"
#include "core/expert_placement.h"
#include "core/geometry.h"
#include "core/status_macros.h"
#include "server/worker_flags.h"
#include "server/worker_process.h"

struct moe_ep_worker {
  std::unique_ptr<moe_ep::server::WorkerProcess> process;
};

namespace {

using moe_ep::server::DataPlane;
using moe_ep::server::WorkerProcess;

thread_local std::string g_last_error;

moe_ep_status Record(const absl::Status& status) {
  if (status.ok()) {
    g_last_error.clear();
    return MOE_EP_OK;
  }
  g_last_error = std::string(status.message());
  return static_cast<moe_ep_status>(status.code());
}

// Runs `body`, turning a thrown exception into kInternal.
template <typename Body>
moe_ep_status Guard(const char* call, Body&& body) {
  try {
    return Record(body());
  } catch (const std::exception& e) {
    return Record(absl::InternalError(absl::StrCat(call, ": ", e.what())));
  } catch (...) {
    return Record(absl::InternalError(absl::StrCat(call, ": unknown exception")));
  }
}

absl::Status RequireWorker(const moe_ep_worker* worker, const char* call) {
  if (worker == nullptr || worker->process == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(call, ": worker must not be NULL"));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Time> SlotDeadline(int64_t timeout_ms, const char* call) {
  if (timeout_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": timeout_ms: expected >= 0 (0 = no limit), got ", timeout_ms));
  }
  return timeout_ms == 0 ? absl::InfiniteFuture() : absl::Now() + absl::Milliseconds(timeout_ms);
}

absl::Status FromGrpc(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

// Runs `fn` on the worker's data plane under its collective slot; a data
// call (`needs_steps`) only once the worker is ready for steps
// (moe_ep_worker_wait_ready_for_steps).
template <typename Fn>
absl::Status OnDataPlane(moe_ep_worker* worker, const char* call, int64_t timeout_ms,
                         bool needs_steps, Fn&& fn) {
  RETURN_IF_ERROR(RequireWorker(worker, call));
  ASSIGN_OR_RETURN(absl::Time deadline, SlotDeadline(timeout_ms, call));
  return worker->process->worker().RunOnDataPlane(call, deadline, needs_steps, fn);
}

// The readiness check of a data call that runs an RPC handler in process
// (its own slot): the worker is ready for steps now.
absl::Status RequireReadyForSteps(moe_ep_worker* worker, const char* call) {
  return OnDataPlane(
      worker, call, 0, true,
      [](DataPlane&, const moe_ep::core::EpDispatcherOptions&) { return absl::OkStatus(); });
}

absl::Status StatsStatus(const absl::StatusOr<moe_ep::core::StepStats>& stats) {
  return stats.status();
}

// A data call with a negative timeout: this rank's argument error. Every
// data call on the CPU plane opens with a round its peers wait in
// (core/engine_call_round.h), so the call still enters it under no slot
// limit, refusing it through `refuse` (a token or row count of -1, which
// every plane refuses), and the peers return ABORTED at once instead of
// waiting out the group's timeout; then the timeout is named (SlotDeadline's
// words). On the GPU planes a refused moe_ep_dispatch or moe_ep_forward
// enqueues its refusal (the peers' step ends at once; server/moe_ep.h), as
// for any argument error, and so does a moe_ep_combine (both GPU planes
// refuse it in place).
absl::Status RefuseNegativeTimeout(const char* call, int64_t timeout_ms,
                                   const std::function<absl::Status()>& refuse) {
  (void)refuse();
  return SlotDeadline(timeout_ms, call).status();
}

absl::Status Dispatch(const char* call, bool end_step, moe_ep_worker* worker,
                      const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                      int64_t num_tokens, uint16_t* recv_hidden, int32_t* recv_topk_ids,
                      float* recv_topk_weights, int64_t recv_rows, int64_t* source_counts,
                      int64_t* expert_counts, void* stream, int64_t timeout_ms) {
  if (timeout_ms < 0) {
    return RefuseNegativeTimeout(call, timeout_ms, [&] {
      return Dispatch(call, end_step, worker, nullptr, nullptr, nullptr, -1, nullptr, nullptr,
                      nullptr, 0, nullptr, nullptr, stream, 0);
    });
  }
  return OnDataPlane(
      worker, call, timeout_ms, true,
      [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) -> absl::Status {
        if (end_step && plane.backend() != "gloo") {
          return absl::UnimplementedError(absl::StrCat(
              call, ": the ", plane.data_plane(),
              " plane runs dispatch + combine steps only; moe_ep_dispatch_only is the gloo "
              "plane's"));
        }
        moe_ep::server::EngineRecvBuffers out;
        out.rows = recv_rows;
        out.hidden = reinterpret_cast<moe_ep::core::bf16_t*>(recv_hidden);
        out.topk_ids = recv_topk_ids;
        out.topk_weights = recv_topk_weights;
        out.source_counts = source_counts;
        out.expert_counts = expert_counts;
        out.end_step = end_step;
        return StatsStatus(
            plane.EngineDispatch(hidden, topk_ids, topk_weights, num_tokens, out, stream));
      });
}

}  // namespace

extern "C" {

const char* moe_ep_version(void) {
  static const std::string version(moe_ep::core::Version());
  return version.c_str();
}

int32_t moe_ep_abi_version(void) { return MOE_EP_ABI_VERSION; }

const char* moe_ep_last_error(void) { return g_last_error.c_str(); }

moe_ep_status moe_ep_noop(void) { return MOE_EP_OK; }

moe_ep_status moe_ep_worker_start(int32_t argc, const char* const* argv, moe_ep_worker** out) {
  return Guard("moe_ep_worker_start", [&]() -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("moe_ep_worker_start: out is NULL");
    *out = nullptr;
    if (argc < 0 || (argc > 0 && argv == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe_ep_worker_start: argc: expected >= 0 with argv not NULL, got ", argc));
    }
    std::vector<const char*> args = {"moe-ep-worker"};
    for (int i = 0; i < argc; ++i) {
      if (argv[i] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("moe_ep_worker_start: argv[", i, "] is NULL"));
      }
      args.push_back(argv[i]);
    }
    moe_ep::server::WorkerFlags flags;
    // An embedded worker's default plane stays nccl, the one its engine
    // calls were first measured on (bench/results/embedded/); the one-sided
    // plane serves the same calls (--gpu-data-plane one-sided; issue 34,
    // bench/results/onesided-engine/).
    flags.gpu_data_plane = "nccl";
    std::ostringstream help;
    std::ostringstream errors;
    if (std::optional<int> exit = moe_ep::server::ParseWorkerFlags(
            static_cast<int>(args.size()), args.data(), &flags, help, errors)) {
      const std::string text =
          *exit == 0 ? "--help and --version print and exit; not here" : errors.str();
      return absl::InvalidArgumentError(absl::StrCat("moe_ep_worker_start: ", text));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<WorkerProcess> process, WorkerProcess::Start(flags));
    *out = new moe_ep_worker{std::move(process)};
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_worker_stop(moe_ep_worker* worker, int64_t drain_timeout_ms) {
  return Guard("moe_ep_worker_stop", [&]() -> absl::Status {
    if (worker == nullptr) return absl::OkStatus();
    std::unique_ptr<moe_ep_worker> owned(worker);
    if (drain_timeout_ms < 0) drain_timeout_ms = 0;
    if (owned->process == nullptr) return absl::OkStatus();
    const int64_t running = owned->process->in_flight();
    if (!owned->process->Shutdown(absl::Now() + absl::Milliseconds(drain_timeout_ms))) {
      return absl::DeadlineExceededError(absl::StrCat(
          "moe_ep_worker_stop: ", running, " RPC(s) were running; those still running after ",
          drain_timeout_ms, " ms were cancelled"));
    }
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_worker_address(const moe_ep_worker* worker, const char** address) {
  return Guard("moe_ep_worker_address", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireWorker(worker, "moe_ep_worker_address"));
    if (address == nullptr) {
      return absl::InvalidArgumentError("moe_ep_worker_address: address is NULL");
    }
    *address = worker->process->address().c_str();
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_worker_wait_ready(moe_ep_worker* worker, int64_t timeout_ms) {
  return Guard("moe_ep_worker_wait_ready", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireWorker(worker, "moe_ep_worker_wait_ready"));
    if (timeout_ms < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe_ep_worker_wait_ready: timeout_ms: expected >= 0, got ", timeout_ms));
    }
    const absl::Time deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    while (!worker->process->ready()) {
      if (absl::Now() >= deadline) {
        moe_ep::v1::GetStatusRequest request;
        moe_ep::v1::GetStatusResponse status;
        worker->process->worker().GetStatus(nullptr, &request, &status);
        return absl::DeadlineExceededError(absl::StrCat(
            "moe_ep_worker_wait_ready: worker at ", worker->process->address(), " not ready after ",
            timeout_ms, " ms (state ", moe_ep::v1::WorkerState_Name(status.state()),
            "); form and configure the group first (moe-ep up --targets, or the Group client)"));
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_worker_wait_ready_for_steps(moe_ep_worker* worker, int32_t experts,
                                                 int64_t timeout_ms) {
  return Guard("moe_ep_worker_wait_ready_for_steps", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireWorker(worker, "moe_ep_worker_wait_ready_for_steps"));
    if (experts != MOE_EP_STEPS_OWN_EXPERTS && experts != MOE_EP_STEPS_WORKER_EXPERTS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "moe_ep_worker_wait_ready_for_steps: experts: expected MOE_EP_STEPS_OWN_EXPERTS (0) or "
          "MOE_EP_STEPS_WORKER_EXPERTS (1), got ",
          experts));
    }
    ASSIGN_OR_RETURN(absl::Time deadline,
                     SlotDeadline(timeout_ms, "moe_ep_worker_wait_ready_for_steps"));
    return worker->process->worker().WaitReadyForSteps(experts == MOE_EP_STEPS_WORKER_EXPERTS,
                                                       deadline);
  });
}

moe_ep_status moe_ep_worker_info_get(moe_ep_worker* worker, moe_ep_worker_info* info) {
  return Guard("moe_ep_worker_info_get", [&]() -> absl::Status {
    if (info == nullptr || info->struct_size < sizeof(uint64_t)) {
      return absl::InvalidArgumentError(
          "moe_ep_worker_info_get: info is NULL or its struct_size is not set");
    }
    moe_ep_worker_info full = {};
    full.struct_size = info->struct_size;
    RETURN_IF_ERROR(OnDataPlane(
        worker, "moe_ep_worker_info_get", 0, false,
        [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions& options) -> absl::Status {
          const moe_ep::core::WorkspaceSpec& spec = options.workspace;
          const int rank = plane.collective().rank();
          ASSIGN_OR_RETURN(
              moe_ep::core::ExpertPlacement placement,
              moe_ep::core::ExpertPlacement::Contiguous(options.num_experts, spec.ep_size));
          full.rank = rank;
          full.world_size = spec.ep_size;
          full.hidden = spec.hidden;
          full.top_k = spec.top_k;
          full.num_experts = options.num_experts;
          full.first_expert = placement.FirstExpert(rank);
          full.num_local_experts = placement.NumLocalExperts(rank);
          full.capacity_tokens = spec.capacity_tokens;
          full.invalid_expert_id = options.invalid_expert_id;
          full.backend = plane.backend() == "nccl" ? MOE_EP_BACKEND_NCCL : MOE_EP_BACKEND_GLOO;
          full.epoch = plane.epoch();
          full.device = plane.cuda_device();
          return absl::OkStatus();
        }));
    moe_ep::v1::GetStatusRequest request;
    moe_ep::v1::GetStatusResponse status;
    worker->process->worker().GetStatus(nullptr, &request, &status);
    full.generation = status.generation();
    full.runtime_max_tokens_per_rank = status.runtime_max_tokens_per_rank();
    const size_t bytes = info->struct_size < sizeof(full) ? info->struct_size : sizeof(full);
    std::memcpy(info, &full, bytes);
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_sync_token_counts(moe_ep_worker* worker, int64_t local_tokens, int64_t* counts,
                                       int64_t* runtime_max_tokens_per_rank) {
  return Guard("moe_ep_sync_token_counts", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireWorker(worker, "moe_ep_sync_token_counts"));
    bool gloo = false;
    std::vector<int64_t> all;
    int64_t runtime_max = 0;
    // The CPU plane: one engine call round carries the counts (server/
    // engine_call_round.h), in step with the other data calls.
    RETURN_IF_ERROR(OnDataPlane(
        worker, "moe_ep_sync_token_counts", 0, true,
        [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions& options) -> absl::Status {
          if (plane.backend() != "gloo") return absl::OkStatus();
          gloo = true;
          all.assign(options.workspace.ep_size, 0);
          RETURN_IF_ERROR(plane.EngineSyncTokenCounts(&local_tokens, all.data(), nullptr));
          absl::StatusOr<int64_t> chosen = moe_ep::core::ChooseRuntimeMaxTokens(
              all, options.cuda_graph_buckets, options.workspace.capacity_tokens);
          if (!chosen.ok()) {
            // Every rank fails alike here (the counts are agreed): name the
            // rank whose count set R, so each rank can tell whose batch it is.
            const auto most = std::max_element(all.begin(), all.end());
            return absl::Status(
                chosen.status().code(),
                absl::StrCat("moe_ep_sync_token_counts: rank ", most - all.begin(), " has ", *most,
                             " tokens, the most of the ranks: ", chosen.status().message()));
          }
          runtime_max = *chosen;
          return absl::OkStatus();
        }));
    if (gloo) {
      if (counts != nullptr) std::copy(all.begin(), all.end(), counts);
      if (runtime_max_tokens_per_rank != nullptr) *runtime_max_tokens_per_rank = runtime_max;
      return absl::OkStatus();
    }
    // The GPU planes: the service's own handler, called in process (no
    // transport): the same checks, state and error counting as the RPC.
    moe_ep::v1::SyncTokenCountsRequest request;
    request.set_local_tokens(local_tokens);
    moe_ep::v1::SyncTokenCountsResponse response;
    RETURN_IF_ERROR(
        FromGrpc(worker->process->worker().SyncTokenCounts(nullptr, &request, &response)));
    if (counts != nullptr) {
      for (int i = 0; i < response.token_counts_size(); ++i) counts[i] = response.token_counts(i);
    }
    if (runtime_max_tokens_per_rank != nullptr) {
      *runtime_max_tokens_per_rank = response.runtime_max_tokens_per_rank();
    }
    return absl::OkStatus();
  });
}

moe_ep_status moe_ep_sync_token_counts_async(moe_ep_worker* worker, const int64_t* local_tokens,
                                             int64_t* counts, void* stream, int64_t timeout_ms) {
  return Guard("moe_ep_sync_token_counts_async", [&]() -> absl::Status {
    return OnDataPlane(
        worker, "moe_ep_sync_token_counts_async", timeout_ms, true,
        [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) -> absl::Status {
          if (plane.backend() == "gloo") {
            return absl::UnimplementedError(
                "sync_token_counts on device memory: the gloo data plane agrees host counts; use "
                "moe_ep_sync_token_counts");
          }
          return plane.EngineSyncTokenCounts(local_tokens, counts, stream);
        });
  });
}

moe_ep_status moe_ep_commit_geometry(moe_ep_worker* worker, int64_t epoch,
                                     int64_t runtime_max_tokens_per_rank, int64_t local_tokens) {
  return Guard("moe_ep_commit_geometry", [&]() -> absl::Status {
    RETURN_IF_ERROR(RequireReadyForSteps(worker, "moe_ep_commit_geometry"));
    moe_ep::v1::CommitGeometryRequest request;
    request.set_epoch(epoch);
    request.set_runtime_max_tokens_per_rank(runtime_max_tokens_per_rank);
    request.set_local_tokens(local_tokens);
    moe_ep::v1::CommitGeometryResponse response;
    return FromGrpc(worker->process->worker().CommitGeometry(nullptr, &request, &response));
  });
}

moe_ep_status moe_ep_dispatch(moe_ep_worker* worker, const uint16_t* hidden,
                              const int32_t* topk_ids, const float* topk_weights,
                              int64_t num_tokens, uint16_t* recv_hidden, int32_t* recv_topk_ids,
                              float* recv_topk_weights, int64_t recv_rows, int64_t* source_counts,
                              int64_t* expert_counts, void* stream, int64_t timeout_ms) {
  return Guard("moe_ep_dispatch", [&]() -> absl::Status {
    return Dispatch("moe_ep_dispatch", false, worker, hidden, topk_ids, topk_weights, num_tokens,
                    recv_hidden, recv_topk_ids, recv_topk_weights, recv_rows, source_counts,
                    expert_counts, stream, timeout_ms);
  });
}

moe_ep_status moe_ep_receive_buffers(moe_ep_worker* worker, uint16_t** recv_hidden,
                                     int32_t** recv_topk_ids, float** recv_topk_weights,
                                     int64_t* recv_rows) {
  return Guard("moe_ep_receive_buffers", [&]() -> absl::Status {
    if (recv_hidden == nullptr || recv_topk_ids == nullptr || recv_topk_weights == nullptr ||
        recv_rows == nullptr) {
      return absl::InvalidArgumentError(
          "moe_ep_receive_buffers: recv_hidden, recv_topk_ids, recv_topk_weights and recv_rows "
          "must not be NULL");
    }
    return OnDataPlane(worker, "moe_ep_receive_buffers", 0, false,
                       [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                         ASSIGN_OR_RETURN(const moe_ep::server::EngineRecvBuffers b,
                                          plane.EngineReceiveBuffers());
                         *recv_hidden = reinterpret_cast<uint16_t*>(b.hidden);
                         *recv_topk_ids = b.topk_ids;
                         *recv_topk_weights = b.topk_weights;
                         *recv_rows = b.rows;
                         return absl::OkStatus();
                       });
  });
}

moe_ep_status moe_ep_dispatch_only(moe_ep_worker* worker, const uint16_t* hidden,
                                   const int32_t* topk_ids, const float* topk_weights,
                                   int64_t num_tokens, uint16_t* recv_hidden,
                                   int32_t* recv_topk_ids, float* recv_topk_weights,
                                   int64_t recv_rows, int64_t* source_counts,
                                   int64_t* expert_counts, void* stream, int64_t timeout_ms) {
  return Guard("moe_ep_dispatch_only", [&]() -> absl::Status {
    return Dispatch("moe_ep_dispatch_only", true, worker, hidden, topk_ids, topk_weights,
                    num_tokens, recv_hidden, recv_topk_ids, recv_topk_weights, recv_rows,
                    source_counts, expert_counts, stream, timeout_ms);
  });
}

moe_ep_status moe_ep_combine(moe_ep_worker* worker, const uint16_t* expert_out, int64_t recv_rows,
                             uint16_t* output, void* stream, int64_t timeout_ms) {
  return Guard("moe_ep_combine", [&]() -> absl::Status {
    if (timeout_ms < 0) {
      return RefuseNegativeTimeout("moe_ep_combine", timeout_ms, [&] {
        return OnDataPlane(worker, "moe_ep_combine", 0, true,
                           [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                             return StatsStatus(plane.EngineCombine(nullptr, -1, nullptr, stream));
                           });
      });
    }
    return OnDataPlane(
        worker, "moe_ep_combine", timeout_ms, true,
        [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
          return StatsStatus(plane.EngineCombine(expert_out, recv_rows, output, stream));
        });
  });
}

moe_ep_status moe_ep_forward(moe_ep_worker* worker, int32_t layer, const uint16_t* hidden,
                             const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
                             uint16_t* output, void* stream, int64_t timeout_ms) {
  return Guard("moe_ep_forward", [&]() -> absl::Status {
    if (timeout_ms < 0) {
      return RefuseNegativeTimeout("moe_ep_forward", timeout_ms, [&] {
        return OnDataPlane(worker, "moe_ep_forward", 0, true,
                           [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                             return StatsStatus(plane.EngineForward(layer, nullptr, nullptr,
                                                                    nullptr, -1, nullptr, stream));
                           });
      });
    }
    return OnDataPlane(worker, "moe_ep_forward", timeout_ms, true,
                       [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                         return StatsStatus(plane.EngineForward(
                             layer, hidden, topk_ids, topk_weights, num_tokens, output, stream));
                       });
  });
}

moe_ep_status moe_ep_check_step(moe_ep_worker* worker, int64_t timeout_ms) {
  return Guard("moe_ep_check_step", [&]() -> absl::Status {
    return OnDataPlane(worker, "moe_ep_check_step", timeout_ms, true,
                       [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                         return plane.EngineCheckStep();
                       });
  });
}

moe_ep_status moe_ep_graph_token(moe_ep_worker* worker, uint64_t* token) {
  return Guard("moe_ep_graph_token", [&]() -> absl::Status {
    if (token == nullptr) return absl::InvalidArgumentError("moe_ep_graph_token: token is NULL");
    return OnDataPlane(worker, "moe_ep_graph_token", 0, false,
                       [&](DataPlane& plane, const moe_ep::core::EpDispatcherOptions&) {
                         *token = plane.workspace_token();
                         return absl::OkStatus();
                       });
  });
}

moe_ep_status moe_ep_check_graph(moe_ep_worker* worker, uint64_t token) {
  uint64_t current = 0;
  const moe_ep_status status = moe_ep_graph_token(worker, &current);
  if (status != MOE_EP_OK) return status;
  if (current == token) return MOE_EP_OK;
  g_last_error = absl::StrCat(
      "moe_ep_check_graph: the graph was captured on workspace ", token,
      ", the worker now runs workspace ", current,
      " (the group re-formed or the workspace was re-allocated); capture the graph again");
  return MOE_EP_RECAPTURE;
}

}  // extern "C"
