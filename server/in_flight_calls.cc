#include "server/in_flight_calls.h"

#include <algorithm>
#include <utility>

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
      grpc::experimental::ServerRpcInfo* info) override {
    // nullptr: this factory is ignored for the call (grpcpp's contract).
    return calls_->Counted(info->method()) ? new Interceptor(calls_) : nullptr;
  }

 private:
  InFlightCalls* calls_;
};

InFlightCalls::InFlightCalls(std::vector<std::string> uncounted_methods)
    : uncounted_methods_(std::move(uncounted_methods)) {}

bool InFlightCalls::Counted(const char* method) const {
  if (method == nullptr) return true;
  return std::find(uncounted_methods_.begin(), uncounted_methods_.end(), method) ==
         uncounted_methods_.end();
}

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
