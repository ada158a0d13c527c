#include "server/reflection_v1.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/server_callback.h"

namespace moe_ep::server {
namespace {

constexpr char kV1AlphaMethod[] = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";

// A finished call that never started: UNIMPLEMENTED for unknown methods.
class FinishedReactor : public grpc::ServerGenericBidiReactor {
 public:
  explicit FinishedReactor(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// One relayed stream: the v1 call from the client (this reactor) and the
// v1alpha call to the same server (`upstream_`). Two independent chains:
//   requests:  client read -> upstream write -> next client read; the
//              client's half-close -> upstream WritesDone.
//   responses: upstream read -> client write -> next upstream read; the
//              upstream's end (OnDone, with its status) -> Finish.
// The upstream has a hold until the request chain ends, so an upstream write
// is never started after its OnDone, and one while a client write is in
// flight, so Finish never overtakes it. Deleted after both OnDone()s.
class Relay : public grpc::ServerGenericBidiReactor {
 public:
  Relay(grpc::GenericCallbackServerContext* ctx, const std::shared_ptr<grpc::Channel>& channel)
      : stub_(channel), upstream_(this) {
    context_.set_deadline(ctx->deadline());
    stub_.PrepareBidiStreamingCall(&context_, kV1AlphaMethod, grpc::StubOptions(), &upstream_);
    upstream_.AddHold();
    upstream_.StartRead(&response_);
    upstream_.StartCall();
    StartRead(&request_);
  }

  // Requests: the client's message goes upstream, or the client half-closed
  // (or the call ended): close the upstream's write side.
  void OnReadDone(bool ok) override {
    if (ok) {
      upstream_.StartWrite(&request_);
      return;
    }
    upstream_.StartWritesDone();
    upstream_.RemoveHold();
  }
  void UpstreamWriteDone(bool ok) {
    if (ok) {
      StartRead(&request_);
    } else {  // the upstream ended; its status arrives in UpstreamDone
      upstream_.RemoveHold();
    }
  }

  // Responses: the upstream's answer goes to the client; a hold keeps the
  // upstream (and so Finish) waiting until that write is done.
  void UpstreamReadDone(bool ok) {
    if (!ok) return;
    upstream_.AddHold();
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (ok) {
      upstream_.StartRead(&response_);
    } else {
      context_.TryCancel();  // the client is gone
    }
    upstream_.RemoveHold();
  }

  void UpstreamDone(const grpc::Status& status) {
    Finish(status);
    Release();
  }
  void OnCancel() override { context_.TryCancel(); }
  void OnDone() override { Release(); }

 private:
  class Upstream : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Upstream(Relay* relay) : relay_(relay) {}
    void OnReadDone(bool ok) override { relay_->UpstreamReadDone(ok); }
    void OnWriteDone(bool ok) override { relay_->UpstreamWriteDone(ok); }
    void OnDone(const grpc::Status& status) override { relay_->UpstreamDone(status); }

   private:
    Relay* const relay_;
  };

  void Release() {
    bool last;
    {
      absl::MutexLock lock(&mu_);
      last = --references_ == 0;
    }
    if (last) delete this;
  }

  grpc::ClientContext context_;
  grpc::GenericStub stub_;
  Upstream upstream_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer response_;
  absl::Mutex mu_;
  int references_ ABSL_GUARDED_BY(mu_) = 2;  // this reactor's and the upstream's OnDone
};

}  // namespace

void ReflectionV1Service::Attach(grpc::Server* server) {
  std::shared_ptr<grpc::Channel> channel = server->InProcessChannel(grpc::ChannelArguments());
  absl::MutexLock lock(&mu_);
  in_process_ = std::move(channel);
}

grpc::ServerGenericBidiReactor* ReflectionV1Service::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  if (ctx->method() != kReflectionV1Method) {
    return new FinishedReactor(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                            absl::StrCat("unknown method ", ctx->method())));
  }
  std::shared_ptr<grpc::Channel> channel;
  {
    absl::MutexLock lock(&mu_);
    channel = in_process_;
  }
  if (channel == nullptr) {
    return new FinishedReactor(grpc::Status(grpc::StatusCode::UNAVAILABLE, "starting"));
  }
  return new Relay(ctx, channel);
}

}  // namespace moe_ep::server
