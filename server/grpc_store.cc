#include "server/grpc_store.h"

#include <algorithm>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gloo/common/error.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "server/store_limits.h"

namespace moe_ep::server {
namespace {

// Pause between attempts while rank 0's worker is not reachable yet.
constexpr absl::Duration kRetryInterval = absl::Milliseconds(100);
// Extra time given to the RPC beyond the server-side wait, so that the server
// answers DEADLINE_EXCEEDED (with the missing keys) before the client gives up.
constexpr absl::Duration kRpcSlack = absl::Milliseconds(500);

// Sends `secret` with the call when there is one. One that gRPC would abort
// on (server/store_limits.h IsSendableSecret; Join refuses those) is not
// sent: a store that wants a secret then answers PERMISSION_DENIED.
void AddSecret(grpc::ClientContext* context, const std::string& secret) {
  if (!secret.empty() && IsSendableSecret(secret)) context->AddMetadata(kSecretMetadataKey, secret);
}

// Runs `attempt` (one RPC with the given deadline and server-side wait in ms)
// until it succeeds or fails with something other than UNAVAILABLE, or the
// overall deadline passes. With `stop`, each attempt waits at most
// GrpcStore::kStopCheckInterval (a server-side DEADLINE_EXCEEDED then means
// "not yet": the next attempt waits again) and a set flag ends the call.
// Throws gloo::IoException on failure.
void CallWithRetry(const std::string& what, const std::string& address, absl::Duration timeout,
                   const std::string& secret, const std::atomic<bool>* stop,
                   const std::function<grpc::Status(grpc::ClientContext*, int64_t)>& attempt) {
  const absl::Time deadline = absl::Now() + timeout;
  grpc::Status last;
  while (true) {
    if (stop != nullptr && stop->load()) {
      throw gloo::IoException(absl::StrCat("rendezvous store at ", address, ": ", what,
                                           " stopped: the caller gave up"));
    }
    const absl::Duration remaining = deadline - absl::Now();
    if (remaining <= absl::ZeroDuration()) break;
    const absl::Duration slice =
        stop != nullptr ? std::min(remaining, GrpcStore::kStopCheckInterval) : remaining;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + slice + kRpcSlack));
    context.set_wait_for_ready(true);
    AddSecret(&context, secret);
    last = attempt(&context, std::max<int64_t>(0, absl::ToInt64Milliseconds(slice)));
    if (last.ok()) return;
    if (last.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      if (slice < remaining) continue;  // a slice of a longer wait
      break;
    }
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE) {
      throw gloo::IoException(absl::StrCat("rendezvous store at ", address, ": ", what,
                                           " failed: gRPC code ", last.error_code(), ": ",
                                           last.error_message()));
    }
    absl::SleepFor(std::min(kRetryInterval, deadline - absl::Now()));
  }
  throw gloo::IoException(
      absl::StrCat("Timed out after ", absl::ToInt64Milliseconds(timeout),
                   " ms: rendezvous store at ", address, ": ", what,
                   // A sliced wait's last answer names only its slice: leave it out.
                   last.ok() || last.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED
                       ? std::string()
                       : absl::StrCat(" (", last.error_message(), ")")));
}

absl::Mutex g_peer_credentials_mu;
std::shared_ptr<grpc::ChannelCredentials> g_peer_credentials ABSL_GUARDED_BY(g_peer_credentials_mu);

std::shared_ptr<grpc::ChannelCredentials> PeerChannelCredentials() {
  absl::MutexLock lock(&g_peer_credentials_mu);
  return g_peer_credentials != nullptr ? g_peer_credentials : grpc::InsecureChannelCredentials();
}

}  // namespace

void SetPeerChannelCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials) {
  absl::MutexLock lock(&g_peer_credentials_mu);
  g_peer_credentials = std::move(credentials);
}

GrpcStore::GrpcStore(std::string address, absl::Duration timeout, std::string secret,
                     std::shared_ptr<const std::atomic<bool>> stop)
    : address_(std::move(address)),
      timeout_(timeout),
      secret_(std::move(secret)),
      stop_(std::move(stop)) {
  grpc::ChannelArguments args;
  // Rank 0 may come up late: reconnect quickly instead of gRPC's default
  // backoff (up to 120 s), which would outlast a typical join timeout.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  const std::shared_ptr<grpc::Channel> channel =
      grpc::CreateCustomChannel(address_, PeerChannelCredentials(), args);
  stub_ = v1::Rendezvous::NewStub(channel);
  worker_ = v1::Worker::NewStub(channel);
}

absl::StatusOr<v1::GetStatusResponse> GrpcStore::PeerStatus(absl::Duration timeout) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::GetStatusResponse response;
  const grpc::Status status = worker_->GetStatus(&context, v1::GetStatusRequest(), &response);
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("GetStatus of ", address_, ": ", status.error_message()));
  }
  return response;
}

void GrpcStore::set(const std::string& key, const std::vector<char>& data) {
  v1::SetRequest request;
  request.set_key(key);
  request.set_value(data.data(), data.size());
  CallWithRetry(absl::StrCat("set \"", key, "\""), address_, timeout_, secret_, stop_.get(),
                [&](grpc::ClientContext* context, int64_t /*wait_ms*/) {
                  v1::SetResponse response;
                  return stub_->Set(context, request, &response);
                });
}

std::vector<char> GrpcStore::get(const std::string& key) {
  v1::GetRequest request;
  request.set_key(key);
  v1::GetResponse response;
  CallWithRetry(absl::StrCat("get \"", key, "\""), address_, timeout_, secret_, stop_.get(),
                [&](grpc::ClientContext* context, int64_t wait_ms) {
                  request.set_timeout_ms(wait_ms);
                  return stub_->Get(context, request, &response);
                });
  return std::vector<char>(response.value().begin(), response.value().end());
}

void GrpcStore::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds(0));
}

void GrpcStore::wait(const std::vector<std::string>& keys,
                     const std::chrono::milliseconds& timeout) {
  const absl::Duration limit = timeout.count() > 0 ? absl::FromChrono(timeout) : timeout_;
  v1::WaitRequest request;
  for (const std::string& key : keys) request.add_keys(key);
  CallWithRetry(absl::StrCat("wait for \"", absl::StrJoin(keys, "\", \""), "\""), address_, limit,
                secret_, stop_.get(), [&](grpc::ClientContext* context, int64_t wait_ms) {
                  request.set_timeout_ms(wait_ms);
                  v1::WaitResponse response;
                  return stub_->Wait(context, request, &response);
                });
}

bool GrpcStore::Answers(absl::Duration timeout) { return Probe(timeout) == ProbeResult::kAnswers; }

bool IsUnansweredHandshake(const grpc::Status& status) {
  // With the 100 ms minimum connect timeout of these channels, a process
  // that accepts the TCP connection but never answers (stopped, or too busy
  // to run its server) fails fast as UNAVAILABLE "connection attempt timed
  // out before receiving SETTINGS frame" (gRPC 1.51). Only that: a TCP
  // connect that times out ("connect() timed out": a node that is gone) or
  // is refused is not it.
  return status.error_code() == grpc::StatusCode::UNAVAILABLE &&
         absl::StrContains(status.error_message(), "SETTINGS frame");
}

GrpcStore::ProbeResult GrpcStore::Probe(absl::Duration timeout) {
  grpc::ClientContext context;
  const absl::Time start = absl::Now();
  context.set_deadline(absl::ToChronoTime(start + timeout));
  AddSecret(&context, secret_);
  v1::GetRequest request;
  request.set_key("probe");
  request.set_timeout_ms(0);
  v1::GetResponse response;
  const grpc::Status status = stub_->Get(&context, request, &response);
  const bool in_time = absl::Now() - start < timeout;
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return in_time && !IsUnansweredHandshake(status) ? ProbeResult::kRefuses : ProbeResult::kSilent;
  }
  // A live store answers the missing key at once with DEADLINE_EXCEEDED
  // (in time); the probe's own deadline comes at `timeout` (start is read
  // before the deadline is set, so that one is never in time).
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED && !in_time) {
    return ProbeResult::kSilent;
  }
  return ProbeResult::kAnswers;
}

grpc::Status GrpcStore::Arrive(const v1::ArriveRequest& request, v1::ArriveResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Milliseconds(request.timeout_ms()) + kRpcSlack));
  AddSecret(&context, secret_);
  return stub_->Arrive(&context, request, response);
}

bool GrpcStore::Poll(const std::string& key, absl::Duration timeout, std::string* value) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  AddSecret(&context, secret_);
  v1::GetRequest request;
  request.set_key(key);
  request.set_timeout_ms(0);
  v1::GetResponse response;
  if (!stub_->Get(&context, request, &response).ok()) return false;
  *value = response.value();
  return true;
}

}  // namespace moe_ep::server
