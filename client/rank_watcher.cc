#include "client/rank_watcher.h"

#include <chrono>
#include <utility>

#include "client/grpc_status.h"

namespace moe_ep::client {
namespace {

using HealthResponse = grpc::health::v1::HealthCheckResponse;

std::chrono::system_clock::time_point After(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(d));
}

constexpr const char kReadinessName[] = "moe_ep.v1.Worker";  // proto/rpc/health.h

}  // namespace

RankWatcher::RankWatcher(std::string target, RankWatcherOptions options,
                         std::function<void()> on_change)
    : target_(std::move(target)), options_(std::move(options)), on_change_(std::move(on_change)) {
  auto channel = MakeWorkerChannel(target_, options_.channel);
  health_ = grpc::health::v1::Health::NewStub(channel);
  worker_ = v1::Worker::NewStub(channel);
  watch_thread_ = std::thread(&RankWatcher::WatchLoop, this);
  probe_thread_ = std::thread(&RankWatcher::ProbeLoop, this);
}

RankWatcher::~RankWatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  stop_cv_.notify_all();
  watch_thread_.join();
  probe_thread_.join();
}

RankObservation RankWatcher::Observe() const {
  std::lock_guard<std::mutex> lock(mu_);
  return observation_;
}

void RankWatcher::ResetReadiness() {
  std::lock_guard<std::mutex> lock(mu_);
  observation_.readiness = HealthResponse::UNKNOWN;
}

bool RankWatcher::SleepFor(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  stop_cv_.wait_for(lock, absl::ToChronoNanoseconds(d), [this] { return stopping_; });
  return !stopping_;
}

void RankWatcher::WatchLoop() {
  while (true) {
    grpc::ClientContext context;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      watch_context_ = &context;
    }
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(kReadinessName);
    std::unique_ptr<grpc::ClientReader<HealthResponse>> reader = health_->Watch(&context, request);
    HealthResponse response;
    while (reader->Read(&response)) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        observation_.watch_open = true;
        observation_.watch_error = absl::OkStatus();
        observation_.readiness = response.status();
      }
      Changed();
    }
    const absl::Status ended = ToAbslStatus(reader->Finish());
    bool was_open = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      watch_context_ = nullptr;
      if (stopping_) return;
      was_open = observation_.watch_open;
      observation_.watch_open = false;
      observation_.readiness = HealthResponse::UNKNOWN;
      observation_.watch_error =
          ended.ok() ? absl::UnavailableError("health Watch ended by the worker") : ended;
      if (was_open) observation_.watch_lost_at = absl::Now();
    }
    if (was_open) Changed();
    if (!SleepFor(options_.retry_interval)) return;
  }
}

void RankWatcher::ProbeLoop() {
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(After(options_.probe_timeout));
    v1::GetStatusRequest request;
    v1::GetStatusResponse response;
    const absl::Time asked = absl::Now();
    const absl::Status status = ToAbslStatus(worker_->GetStatus(&context, request, &response));
    bool changed = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      const bool was_ok = observation_.probed && observation_.probe.ok();
      // Each failure in a row is a change: a threshold may be crossed.
      changed = !observation_.probed || was_ok != status.ok() ||
                observation_.probe.code() != status.code() || !status.ok();
      observation_.probe_failures = status.ok() ? 0 : observation_.probe_failures + 1;
      if (status.ok()) {
        changed = changed || response.generation() != observation_.status.generation() ||
                  response.state() != observation_.status.state() ||
                  response.group_broken() != observation_.status.group_broken();
        observation_.status = response;
        observation_.last_answer = absl::Now();
        observation_.last_answer_asked = asked;
      }
      observation_.probed = true;
      observation_.probe = status;
    }
    if (changed) Changed();
    if (!SleepFor(options_.probe_interval)) return;
  }
}

}  // namespace moe_ep::client
