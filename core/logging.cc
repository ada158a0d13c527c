#include "core/logging.h"

#include <atomic>
#include <chrono>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "spdlog/pattern_formatter.h"
#include "spdlog/spdlog.h"

namespace moe_ep::core {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<int64_t> g_generation{0};
std::atomic<int64_t> g_epoch{0};

std::string ContextText() {
  const int rank = g_rank.load(std::memory_order_relaxed);
  if (rank < 0) return "rank=- gen=- epoch=-";
  return absl::StrCat("rank=", rank, " gen=", g_generation.load(std::memory_order_relaxed),
                      " epoch=", g_epoch.load(std::memory_order_relaxed));
}

// %* in the text pattern: "rank=1 gen=3 epoch=7".
class ContextFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& /*msg*/, const std::tm& /*tm*/,
              spdlog::memory_buf_t& dest) override {
    const std::string text = ContextText();
    dest.append(text.data(), text.data() + text.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<ContextFlag>();
  }
};

// RFC 3339 UTC with microseconds: "2025-01-02T10:11:12.345678Z".
std::string Timestamp(spdlog::log_clock::time_point time) {
  const auto since_epoch = time.time_since_epoch();
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(since_epoch - seconds).count();
  const std::time_t t = static_cast<std::time_t>(seconds.count());
  std::tm tm = {};
  gmtime_r(&t, &tm);
  return absl::StrFormat("%04d-%02d-%02dT%02d:%02d:%02d.%06dZ", tm.tm_year + 1900, tm.tm_mon + 1,
                         tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(micros));
}

class JsonFormatter final : public spdlog::formatter {
 public:
  explicit JsonFormatter(LogFields fields) : fields_(fields) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    nlohmann::ordered_json line;
    line["ts"] = Timestamp(msg.time);
    const auto level = spdlog::level::to_string_view(msg.level);
    line["level"] = std::string(level.data(), level.size());
    line["logger"] = std::string(msg.logger_name.data(), msg.logger_name.size());
    const int rank = g_rank.load(std::memory_order_relaxed);
    if (fields_ == LogFields::kPlain) {
      // No worker fields.
    } else if (rank < 0) {
      line["rank"] = nullptr;
      line["generation"] = nullptr;
      line["epoch"] = nullptr;
    } else {
      line["rank"] = rank;
      line["generation"] = g_generation.load(std::memory_order_relaxed);
      line["epoch"] = g_epoch.load(std::memory_order_relaxed);
    }
    line["thread"] = msg.thread_id;
    line["msg"] = std::string(msg.payload.data(), msg.payload.size());
    const std::string text = line.dump(-1, ' ', /*ensure_ascii=*/false,
                                       nlohmann::ordered_json::error_handler_t::replace);
    dest.append(text.data(), text.data() + text.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>(fields_);
  }

 private:
  const LogFields fields_;
};

}  // namespace

void SetLogContext(int rank, int64_t generation, int64_t epoch) {
  g_generation.store(generation, std::memory_order_relaxed);
  g_epoch.store(epoch, std::memory_order_relaxed);
  g_rank.store(rank, std::memory_order_relaxed);
}

absl::StatusOr<std::unique_ptr<spdlog::formatter>> MakeLogFormatter(const std::string& format,
                                                                    LogFields fields) {
  if (format == "json") return std::unique_ptr<spdlog::formatter>(new JsonFormatter(fields));
  if (format == "text") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    if (fields == LogFields::kWorker) {
      formatter->add_flag<ContextFlag>('*').set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%*] %v");
    } else {
      formatter->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] %v");
    }
    return std::unique_ptr<spdlog::formatter>(std::move(formatter));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--log-format: expected \"text\" or \"json\", got \"", format, "\""));
}

absl::Status ConfigureLogFormat(const std::string& format, LogFields fields) {
  absl::StatusOr<std::unique_ptr<spdlog::formatter>> formatter = MakeLogFormatter(format, fields);
  if (!formatter.ok()) return formatter.status();
  spdlog::default_logger()->set_formatter(std::move(*formatter));
  return absl::OkStatus();
}

}  // namespace moe_ep::core
