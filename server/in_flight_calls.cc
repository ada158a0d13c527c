#include "server/in_flight_calls.h"

namespace moe_ep::server {

// One per call: counts the call for its lifetime and lets every hook proceed.
class InFlightCalls::Interceptor final : public grpc::experimental::Interceptor {
 public:
  explicit Interceptor(InFlightCalls* calls) : calls_(calls) { calls_->Add(1); }
  ~Interceptor() override { calls_->Add(-1); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  InFlightCalls* calls_;
};

class InFlightCalls::Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(InFlightCalls* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* /*info*/) override {
    return new Interceptor(calls_);
  }

 private:
  InFlightCalls* calls_;
};

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
InFlightCalls::MakeInterceptorFactory() {
  return std::make_unique<Factory>(this);
}

int64_t InFlightCalls::count() const {
  absl::MutexLock lock(&mu_);
  return count_;
}

bool InFlightCalls::WaitIdle(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(this, &InFlightCalls::IdleLocked), deadline);
}

bool InFlightCalls::IdleLocked() const { return count_ == 0; }

void InFlightCalls::Add(int64_t delta) {
  absl::MutexLock lock(&mu_);
  count_ += delta;
}

}  // namespace moe_ep::server
