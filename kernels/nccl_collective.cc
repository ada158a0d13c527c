#include "kernels/nccl_collective.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

using Clock = std::chrono::steady_clock;

std::string NcclText(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return absl::StrFormat("%s%s%s", ncclGetErrorString(r), (last && *last) ? ": " : "",
                         last ? last : "");
}

// Polls `comm` until its last operation is no longer in progress. Returns the
// final result (ncclSuccess or an error), or ncclInProgress at the deadline.
ncclResult_t PollComm(ncclComm_t comm, Clock::time_point deadline) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() >= deadline) return ncclInProgress;
    std::this_thread::yield();
  }
}

}  // namespace

bool IsDevicePointer(const void* ptr) { return DeviceOrdinalOf(ptr) != kNotDeviceMemory; }

int DeviceOrdinalOf(const void* ptr) {
  if (ptr == nullptr) return kNotDeviceMemory;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return kNotDeviceMemory;
  }
  if (attr.type == cudaMemoryTypeManaged) return kManagedMemory;
  return attr.type == cudaMemoryTypeDevice ? attr.device : kNotDeviceMemory;
}

absl::StatusOr<std::string> NcclCollective::NewUniqueId() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    return absl::UnavailableError(absl::StrFormat("ncclGetUniqueId: %s", ncclGetErrorString(r)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCollective>> NcclCollective::Create(
    const std::string& unique_id, int rank, int size, int device,
    std::chrono::milliseconds timeout) {
  if (unique_id.size() != NCCL_UNIQUE_ID_BYTES) {
    return absl::InvalidArgumentError(absl::StrFormat("unique_id: expected %d bytes, got %d",
                                                      NCCL_UNIQUE_ID_BYTES, unique_id.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank: expected in [0, size=%d) with size >= 1, got %d", size, rank));
  }
  int num_devices = 0;
  RETURN_IF_ERROR(internal::CudaStatus(cudaGetDeviceCount(&num_devices), "cudaGetDeviceCount"));
  if (device < 0 || device >= num_devices) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "device: expected in [0, %d) on rank %d, got %d", num_devices, rank, device));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  std::unique_ptr<NcclCollective> c(new NcclCollective());
  c->rank_ = rank;
  c->size_ = size;
  c->device_ = device;
  c->timeout_ = timeout;
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking), "cudaStreamCreate"));

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const Clock::time_point deadline = Clock::now() + timeout;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  if (r == ncclSuccess || r == ncclInProgress) r = PollComm(comm, deadline);
  if (r != ncclSuccess) {
    const std::string text = comm ? NcclText(r, comm) : ncclGetErrorString(r);
    if (comm != nullptr) ncclCommAbort(comm);
    if (r == ncclInProgress) {
      return absl::DeadlineExceededError(
          absl::StrFormat("NCCL init of rank %d/%d: not all ranks joined within %d ms", rank, size,
                          timeout.count()));
    }
    return absl::UnavailableError(absl::StrFormat("NCCL init of rank %d/%d: %s", rank, size, text));
  }
  c->comm_ = comm;
  return c;
}

NcclCollective::~NcclCollective() {
  cudaSetDevice(device_);
  // Abort rather than finalize + destroy: it is local, so tearing down never
  // waits on a peer that is gone. Every collective this object returned from
  // has been enqueued; callers synchronise before destroying. Nor on the
  // caller's CUDA graphs that captured work here (AbortNcclComm).
  AbortNcclComm(comm_, device_, graph_refs_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status NcclCollective::CheckUsable() const {
  if (comm_ == nullptr || revoked_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("NCCL communicator of rank %d was %s after an earlier error (%s); form a "
                        "new group or shrink it",
                        rank_, comm_ == nullptr ? "aborted" : "revoked", last_error_));
  }
  return absl::OkStatus();
}

void NcclCollective::Abort() {
  AbortNcclComm(comm_, device_, graph_refs_);
  comm_ = nullptr;
}

absl::Status NcclCollective::Revoke() {
  if (comm_ == nullptr) return CheckUsable();
  if (revoked_) return absl::OkStatus();
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  ncclResult_t r = ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT);
  if (r == ncclSuccess || r == ncclInProgress) r = PollComm(comm_, Clock::now() + timeout_);
  if (r == ncclSuccess) {
    revoked_ = true;
    if (last_error_.empty()) last_error_ = "revoked for a rank mask";
    return absl::OkStatus();
  }
  absl::Status failed =
      r == ncclInProgress
          ? absl::DeadlineExceededError(absl::StrFormat(
                "ncclCommRevoke on rank %d: not quiescent within %d ms", rank_, timeout_.count()))
          : absl::UnavailableError(
                absl::StrFormat("ncclCommRevoke on rank %d: %s", rank_, NcclText(r, comm_)));
  if (last_error_.empty()) last_error_ = std::string(failed.message());
  Abort();
  return failed;
}

absl::StatusOr<std::unique_ptr<NcclCollective>> NcclCollective::Shrink(
    absl::Span<const int> exclude) {
  if (comm_ == nullptr) RETURN_IF_ERROR(CheckUsable());
  for (size_t i = 0; i < exclude.size(); ++i) {
    if (exclude[i] < 0 || exclude[i] >= size_ || (i > 0 && exclude[i] <= exclude[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrFormat("Shrink on rank %d: excluded ranks expected ascending in [0, %d), "
                          "entry %d is %d",
                          rank_, size_, i, exclude[i]));
    }
    if (exclude[i] == rank_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Shrink on rank %d: this rank is excluded (an excluded rank does not call Shrink)",
          rank_));
    }
  }
  if (exclude.empty()) {
    // NCCL refuses a shrink excluding nobody (excludeRanksCount 0), and a
    // revoked communicator allows no split: keep this one, or make a fresh
    // one (ncclCommInitRank) after a revoke.
    return absl::InvalidArgumentError(absl::StrFormat(
        "Shrink on rank %d: exclude: expected at least one rank, got none; keep this "
        "communicator, or after a revoke create a new one with a fresh unique id",
        rank_));
  }
  std::vector<int> list(exclude.begin(), exclude.end());
  const int count = static_cast<int>(list.size());
  const int flags = revoked_ ? NCCL_SHRINK_ABORT : NCCL_SHRINK_DEFAULT;
  return Derive(absl::StrFormat("Shrink on rank %d (excluding %d of %d)", rank_, count, size_),
                /*split=*/false, [&](ncclConfig_t* config, ncclComm_t* shrunk) {
                  return ncclCommShrink(comm_, list.data(), count, shrunk, config, flags);
                });
}

absl::StatusOr<std::unique_ptr<NcclCollective>> NcclCollective::Derive(
    const std::string& what, bool split,
    absl::FunctionRef<ncclResult_t(ncclConfig_t*, ncclComm_t*)> derive) {
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  std::unique_ptr<NcclCollective> c(new NcclCollective());
  c->device_ = device_;
  c->timeout_ = timeout_;
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t child = nullptr;
  const Clock::time_point deadline = Clock::now() + timeout_;
  ncclResult_t r = derive(&config, &child);
  if ((r == ncclSuccess || r == ncclInProgress) && child != nullptr) r = PollComm(child, deadline);
  // ncclCommSplit is a call of the parent too: it completes on both.
  if (split && r == ncclSuccess) r = PollComm(comm_, deadline);
  if (r != ncclSuccess || child == nullptr) {
    // No child without an error code: NCCL's internal error.
    const std::string text = NcclText(r == ncclSuccess ? ncclInternalError : r, comm_);
    if (child != nullptr) ncclCommAbort(child);
    absl::Status failed = r == ncclInProgress
                              ? absl::DeadlineExceededError(absl::StrFormat(
                                    "%s: not complete within %d ms", what, timeout_.count()))
                              : absl::UnavailableError(absl::StrFormat("%s: %s", what, text));
    // A failed split leaves the parent unusable; a failed shrink leaves it
    // as it was (revoked, or healthy for the caller to keep).
    return split ? Fail(std::move(failed)) : failed;
  }
  c->comm_ = child;
  ncclCommUserRank(child, &c->rank_);
  ncclCommCount(child, &c->size_);
  return c;
}

absl::Status NcclCollective::Fail(absl::Status status) {
  last_error_ = std::string(status.message());
  // Revoke rather than abort: the survivors of a lost peer may shrink this
  // communicator (Shrink); Revoke aborts when it cannot revoke.
  if (comm_ != nullptr && !revoked_) Revoke().IgnoreError();
  return status;
}

absl::Status NcclCollective::WaitForNccl(ncclResult_t started, const char* what) {
  ncclResult_t r = started;
  if (r == ncclSuccess || r == ncclInProgress) r = PollComm(comm_, WaitDeadline());
  if (r == ncclSuccess) return absl::OkStatus();
  if (r == ncclInProgress) {
    return Fail(absl::DeadlineExceededError(absl::StrFormat(
        "%s on rank %d: NCCL still in progress after %d ms", what, rank_, timeout_.count())));
  }
  return Fail(absl::UnavailableError(
      absl::StrFormat("%s on rank %d: %s", what, rank_, NcclText(r, comm_))));
}

Clock::time_point NcclCollective::WaitDeadline() const {
  const Clock::time_point now = Clock::now();
  const Clock::time_point by_timeout = now + timeout_;
  if (call_deadline_ == absl::InfiniteFuture()) return by_timeout;
  const absl::Duration left = std::max(call_deadline_ - absl::Now(), absl::ZeroDuration());
  return std::min(by_timeout, now + absl::ToChronoMilliseconds(left));
}

absl::Status NcclCollective::Synchronize() {
  RETURN_IF_ERROR(CheckUsable());
  const Clock::time_point deadline = WaitDeadline();
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream_);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      const ncclResult_t bad = r != ncclSuccess ? r : state;
      return Fail(absl::UnavailableError(absl::StrFormat(
          "NCCL error on rank %d while waiting for the stream: %s", rank_, NcclText(bad, comm_))));
    }
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) {
      return Fail(internal::CudaStatus(q, absl::StrFormat("stream of rank %d", rank_)));
    }
    if (Clock::now() >= deadline) {
      return Fail(absl::DeadlineExceededError(
          absl::StrFormat("rank %d: collective did not complete within %d ms (a peer may be gone)",
                          rank_, timeout_.count())));
    }
    std::this_thread::yield();
  }
}

ncclResult_t NcclCollective::PostAllToAllV(const char* send, absl::Span<const int64_t> send_bytes,
                                           char* recv, absl::Span<const int64_t> recv_bytes) {
  ncclResult_t r = ncclSuccess;
  int64_t send_off = 0;
  int64_t recv_off = 0;
  for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
    if (send_bytes[p] > 0) {
      r = ncclSend(send + send_off, send_bytes[p], ncclChar, p, comm_, stream_);
    }
    if (r == ncclSuccess && recv_bytes[p] > 0) {
      r = ncclRecv(recv + recv_off, recv_bytes[p], ncclChar, p, comm_, stream_);
    }
    send_off += send_bytes[p];
    recv_off += recv_bytes[p];
  }
  return r;
}

absl::Status NcclCollective::EnqueueAllToAllV(const char* send,
                                              absl::Span<const int64_t> send_bytes, char* recv,
                                              absl::Span<const int64_t> recv_bytes) {
  RETURN_IF_ERROR(graph_refs_.NoteEnqueue(stream_));
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) r = PostAllToAllV(send, send_bytes, recv, recv_bytes);
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  return WaitForNccl(r, "AllToAllV");
}

absl::Status NcclCollective::GroupedAllToAllV(absl::Span<const AllToAllVPart> parts) {
  RETURN_IF_ERROR(CheckUsable());
  if (parts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GroupedAllToAllV on rank %d: expected at least one part", rank_));
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const AllToAllVPart& part = parts[i];
    if (static_cast<int>(part.send_bytes.size()) != size_ ||
        static_cast<int>(part.recv_bytes.size()) != size_) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "GroupedAllToAllV on rank %d: part %d send_bytes/recv_bytes expected %d entries, got "
          "%d/%d",
          rank_, i, size_, part.send_bytes.size(), part.recv_bytes.size()));
    }
    for (int p = 0; p < size_; ++p) {
      if (part.send_bytes[p] < 0 || part.recv_bytes[p] < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "GroupedAllToAllV on rank %d: part %d counts for peer %d expected >= 0, got send %d "
            "recv %d",
            rank_, i, p, part.send_bytes[p], part.recv_bytes[p]));
      }
    }
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(graph_refs_.NoteEnqueue(stream_));
  ncclResult_t r = ncclGroupStart();
  for (size_t i = 0; i < parts.size() && r == ncclSuccess; ++i) {
    r = PostAllToAllV(static_cast<const char*>(parts[i].send), parts[i].send_bytes,
                      static_cast<char*>(parts[i].recv), parts[i].recv_bytes);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = end;
  return WaitForNccl(r, "GroupedAllToAllV");
}

absl::Status NcclCollective::AllToAllV(const void* send, absl::Span<const int64_t> send_bytes,
                                       void* recv, absl::Span<const int64_t> recv_bytes) {
  RETURN_IF_ERROR(CheckUsable());
  if (static_cast<int>(send_bytes.size()) != size_ ||
      static_cast<int>(recv_bytes.size()) != size_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AllToAllV on rank %d: send_bytes/recv_bytes expected %d entries, got %d/%d", rank_, size_,
        send_bytes.size(), recv_bytes.size()));
  }
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int p = 0; p < size_; ++p) {
    if (send_bytes[p] < 0 || recv_bytes[p] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "AllToAllV on rank %d: counts for peer %d expected >= 0, got send %d recv %d", rank_, p,
          send_bytes[p], recv_bytes[p]));
    }
    send_total += send_bytes[p];
    recv_total += recv_bytes[p];
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  return EnqueueAllToAllV(static_cast<const char*>(send), send_bytes, static_cast<char*>(recv),
                          recv_bytes);
}

absl::Status NcclCollective::CallComm(const char* what,
                                      absl::FunctionRef<ncclResult_t(ncclComm_t)> call) {
  RETURN_IF_ERROR(CheckUsable());
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  return WaitForNccl(call(comm_), what);
}

absl::Status NcclCollective::AllGather(const void* send, int64_t bytes_per_rank, void* recv) {
  RETURN_IF_ERROR(CheckUsable());
  if (bytes_per_rank < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AllGather on rank %d: bytes_per_rank expected >= 0, got %d", rank_, bytes_per_rank));
  }
  if (bytes_per_rank == 0) return absl::OkStatus();
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(graph_refs_.NoteEnqueue(stream_));
  return WaitForNccl(ncclAllGather(send, recv, bytes_per_rank, ncclChar, comm_, stream_),
                     "AllGather");
}

absl::Status NcclCollective::AllReduceSum(float* data, int64_t count) {
  RETURN_IF_ERROR(CheckUsable());
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AllReduceSum on rank %d: count expected >= 0, got %d", rank_, count));
  }
  if (count == 0) return absl::OkStatus();
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(graph_refs_.NoteEnqueue(stream_));
  return WaitForNccl(ncclAllReduce(data, data, count, ncclFloat, ncclSum, comm_, stream_),
                     "AllReduceSum");
}

absl::StatusOr<std::unique_ptr<StreamCollective>> NcclCollective::Split(absl::Span<const int> ranks,
                                                                        const std::string& tag) {
  RETURN_IF_ERROR(CheckUsable());
  bool has_self = false;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size_ || (i > 0 && ranks[i] <= ranks[i - 1])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Split '%s' on rank %d: ranks expected ascending and in [0, %d), entry %d is %d", tag,
          rank_, size_, i, ranks[i]));
    }
    has_self = has_self || ranks[i] == rank_;
  }
  if (!has_self) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Split '%s': ranks do not contain this rank %d", tag, rank_));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<NcclCollective> sub,
                   Derive(absl::StrFormat("Split '%s' on rank %d", tag, rank_), /*split=*/true,
                          [&](ncclConfig_t* config, ncclComm_t* child) {
                            return ncclCommSplit(comm_, ranks.front(), rank_, child, config);
                          }));
  return std::unique_ptr<StreamCollective>(std::move(sub));
}

}  // namespace moe_ep::kernels
