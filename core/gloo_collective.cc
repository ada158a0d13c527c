#include "core/gloo_collective.h"

#include <netdb.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/memory/memory.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoallv.h"
#include "gloo/barrier.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace moe_ep::core {
namespace {

std::chrono::milliseconds ToChronoMs(absl::Duration d) {
  int64_t ms = absl::ToInt64Milliseconds(d);
  return std::chrono::milliseconds(ms < 1 ? 1 : ms);
}

// Gloo reports timeouts as IoException text: "Timed out waiting ...ms",
// "Read timeout", "Write timeout", "Wait timeout for key(s)", "Application
// timeout caused pair closure". Everything else (connection closed by peer,
// reset, refused, enforce failures on a torn-down pair) means a peer is gone.
absl::Status FromGlooError(const std::string& op, int rank, absl::Duration timeout,
                           const std::string& what) {
  const std::string lower = absl::AsciiStrToLower(what);
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(absl::StrCat("gloo ", op, " on rank ", rank,
                                                    " did not complete within ",
                                                    absl::FormatDuration(timeout), ": ", what));
  }
  return absl::UnavailableError(
      absl::StrCat("gloo ", op, " on rank ", rank, " failed, a peer is unreachable: ", what));
}

}  // namespace

GlooCollective::GlooCollective(std::shared_ptr<gloo::rendezvous::Store> store, std::string prefix,
                               int rank, int size, std::string host, absl::Duration timeout)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      rank_(rank),
      size_(size),
      host_(std::move(host)),
      timeout_(timeout) {}

GlooCollective::~GlooCollective() = default;

namespace {

// A peer that closed its socket must become an error, not SIGPIPE (see Create).
void IgnoreSigpipeIfDefault() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCollective>> GlooCollective::Create(
    std::shared_ptr<gloo::rendezvous::Store> store, const std::string& prefix, int rank, int size,
    const std::string& host, absl::Duration timeout) {
  IgnoreSigpipeIfDefault();
  if (store == nullptr) return absl::InvalidArgumentError("store: must not be null");
  if (prefix.empty()) return absl::InvalidArgumentError("prefix: must not be empty");
  if (size < 1) return absl::InvalidArgumentError(absl::StrCat("size: expected >= 1, got ", size));
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: expected in [0, ", size, "), got ", rank));
  }
  if (timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout: expected > 0, got ", absl::FormatDuration(timeout)));
  }
  if (host.empty()) return absl::InvalidArgumentError("host: must not be empty");
  // Gloo's own lookup mishandles getaddrinfo failures (it only checks for -1
  // and then reads an uninitialised list), so resolve the name here first.
  {
    struct addrinfo hints = {};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo* result = nullptr;
    const int rv = getaddrinfo(host.c_str(), nullptr, &hints, &result);
    if (rv != 0) {
      return absl::InvalidArgumentError(absl::StrCat("host \"", host, "\" (rank ", rank,
                                                     "): cannot resolve: ", gai_strerror(rv)));
    }
    freeaddrinfo(result);
  }
  auto group =
      absl::WrapUnique(new GlooCollective(std::move(store), prefix, rank, size, host, timeout));
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = host;
    group->device_ = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("host \"", host, "\" (rank ", rank,
                                                   "): cannot bind a Gloo TCP device: ", e.what()));
  } catch (...) {
    return absl::InvalidArgumentError(
        absl::StrCat("host \"", host, "\" (rank ", rank, "): cannot bind a Gloo TCP device"));
  }
  try {
    group->prefix_store_ = std::make_unique<gloo::rendezvous::PrefixStore>(prefix, *group->store_);
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToChronoMs(timeout));
    context->connectFullMesh(*group->prefix_store_, group->device_);
    // connectFullMesh can return on one rank while a peer is still finishing
    // its side of the handshake; a rank that then exits at once would reset
    // that peer's connection. The barrier makes Create complete everywhere.
    gloo::BarrierOptions barrier(context);
    barrier.setTimeout(ToChronoMs(timeout));
    gloo::barrier(barrier);
    group->context_ = std::move(context);
  } catch (const std::exception& e) {
    return FromGlooError(absl::StrCat("rendezvous (prefix \"", prefix, "\", size ", size, ")"),
                         rank, timeout, e.what());
  } catch (...) {
    return absl::UnavailableError(
        absl::StrCat("gloo rendezvous on rank ", rank, " failed with an unknown exception"));
  }
  return group;
}

template <typename Op>
absl::Status GlooCollective::Guarded(const char* op_name, Op&& op) {
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group broken by earlier error: ", broken_.message(), "; re-join"));
  }
  try {
    op();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    broken_ = FromGlooError(op_name, rank_, timeout_, e.what());
  } catch (...) {
    broken_ = absl::UnavailableError(
        absl::StrCat("gloo ", op_name, " on rank ", rank_, " failed with an unknown exception"));
  }
  // Close every pair now: a peer still waiting on this rank (a ring step of
  // an all-gather whose dead rank is not its neighbour) then sees its pair
  // fail at once instead of waiting out the group timeout (issue 12 item 6).
  context_.reset();
  return broken_;
}

absl::Status GlooCollective::AllToAllV(const void* send, absl::Span<const int64_t> send_bytes,
                                       void* recv, absl::Span<const int64_t> recv_bytes) {
  if (static_cast<int>(send_bytes.size()) != size_ ||
      static_cast<int>(recv_bytes.size()) != size_) {
    return absl::InvalidArgumentError(absl::StrCat("AllToAllV: send_bytes and recv_bytes need ",
                                                   size_, " entries, got ", send_bytes.size(),
                                                   " and ", recv_bytes.size()));
  }
  int64_t total_send = 0;
  int64_t total_recv = 0;
  for (int p = 0; p < size_; ++p) {
    if (send_bytes[p] < 0 || recv_bytes[p] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("AllToAllV: negative byte count for peer ", p,
                                                     ": send ", send_bytes[p], ", recv ",
                                                     recv_bytes[p]));
    }
    total_send += send_bytes[p];
    total_recv += recv_bytes[p];
  }
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllToAllV: rank ", rank_, " sends itself ", send_bytes[rank_],
                     " bytes but expects to receive ", recv_bytes[rank_]));
  }
  if ((total_send > 0 && send == nullptr) || (total_recv > 0 && recv == nullptr)) {
    return absl::InvalidArgumentError("AllToAllV: null buffer with a nonzero byte count");
  }
  return Guarded("AllToAllV", [&] {
    gloo::AlltoallvOptions opts(context_);
    char* in = total_send > 0 ? static_cast<char*>(const_cast<void*>(send)) : dummy_;
    char* out = total_recv > 0 ? static_cast<char*>(recv) : dummy_;
    opts.setInput(in, std::vector<int64_t>(send_bytes.begin(), send_bytes.end()));
    opts.setOutput(out, std::vector<int64_t>(recv_bytes.begin(), recv_bytes.end()));
    opts.setTag(next_tag_++);
    opts.setTimeout(ToChronoMs(OpTimeout()));
    gloo::alltoallv(opts);
  });
}

absl::Status GlooCollective::AllGather(const void* send, int64_t bytes_per_rank, void* recv) {
  if (bytes_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllGather: bytes_per_rank expected >= 0, got ", bytes_per_rank));
  }
  // Zero bytes still synchronises the group, so a dead peer is still noticed.
  if (bytes_per_rank == 0) return Barrier();
  if (send == nullptr || recv == nullptr) {
    return absl::InvalidArgumentError("AllGather: null buffer with a nonzero byte count");
  }
  return Guarded("AllGather", [&] {
    gloo::AllgatherOptions opts(context_);
    opts.setInput(static_cast<char*>(const_cast<void*>(send)), bytes_per_rank);
    opts.setOutput(static_cast<char*>(recv), bytes_per_rank * size_);
    opts.setTag(next_tag_++);
    opts.setTimeout(ToChronoMs(OpTimeout()));
    gloo::allgather(opts);
  });
}

absl::Status GlooCollective::AllReduceSum(float* data, int64_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllReduceSum: count expected >= 0, got ", count));
  }
  if (count == 0) return Barrier();
  if (data == nullptr) return absl::InvalidArgumentError("AllReduceSum: data is null");
  return Guarded("AllReduceSum", [&] {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, static_cast<size_t>(count));
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setTag(next_tag_++);
    opts.setTimeout(ToChronoMs(OpTimeout()));
    gloo::allreduce(opts);
  });
}

absl::Status GlooCollective::Barrier() {
  return Guarded("Barrier", [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(next_tag_++);
    opts.setTimeout(ToChronoMs(OpTimeout()));
    gloo::barrier(opts);
  });
}

absl::Duration GlooCollective::OpTimeout() const {
  if (call_deadline_ == absl::InfiniteFuture()) return timeout_;
  return std::clamp(call_deadline_ - absl::Now(), absl::Milliseconds(1), timeout_);
}

absl::StatusOr<std::unique_ptr<ControlCollective>> GlooCollective::Split(
    absl::Span<const int> ranks, const std::string& tag) {
  if (tag.empty()) return absl::InvalidArgumentError("Split: tag must not be empty");
  if (ranks.empty()) return absl::InvalidArgumentError("Split: ranks must not be empty");
  int sub_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size_) {
      return absl::InvalidArgumentError(
          absl::StrCat("Split: ranks[", i, "] = ", ranks[i], " is outside [0, ", size_, ")"));
    }
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Split: ranks must be strictly ascending, got [", absl::StrJoin(ranks, ", "), "]"));
    }
    if (ranks[i] == rank_) sub_rank = static_cast<int>(i);
  }
  if (sub_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat("Split: ranks [", absl::StrJoin(ranks, ", "),
                                                   "] do not contain this rank (", rank_, ")"));
  }
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("group broken by earlier error: ", broken_.message(), "; re-join"));
  }
  auto sub = Create(store_, absl::StrCat(prefix_, "/", tag), sub_rank,
                    static_cast<int>(ranks.size()), host_, timeout_);
  if (!sub.ok()) return sub.status();
  return std::unique_ptr<ControlCollective>(std::move(sub).value());
}

}  // namespace moe_ep::core
