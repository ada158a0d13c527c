#include "server/health.h"

#include "grpcpp/server.h"

namespace moe_ep::server {

void EnableDefaultHealthService() { grpc::EnableDefaultHealthCheckService(true); }

void HealthReporter::Attach(grpc::HealthCheckServiceInterface* service) {
  absl::MutexLock lock(&mu_);
  if (service == nullptr) return;
  services_.push_back(service);
  ApplyLocked();
}

void HealthReporter::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_ = serving;
  ApplyLocked();
}

void HealthReporter::Shutdown() {
  absl::MutexLock lock(&mu_);
  serving_ = false;
  ApplyLocked();
  shut_down_ = true;
  // The default service's Shutdown() sets every name NOT_SERVING and ignores
  // later updates, so a draining server never reports SERVING again.
  for (grpc::HealthCheckServiceInterface* service : services_) service->Shutdown();
}

bool HealthReporter::serving() const {
  absl::MutexLock lock(&mu_);
  return serving_;
}

void HealthReporter::ApplyLocked() {
  if (shut_down_) return;
  for (grpc::HealthCheckServiceInterface* service : services_) {
    service->SetServingStatus("", serving_);
    service->SetServingStatus(kWorkerServiceName, serving_);
  }
}

}  // namespace moe_ep::server
