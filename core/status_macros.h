#pragma once

// Status helpers missing from Debian 12's abseil (20220623 has no absl/log and
// no status macros). These are the project's only home-made error helpers.
// Source: ../shared/STYLE.md §3.

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spdlog/spdlog.h"

#define MOE_EP_CONCAT_INNER_(a, b) a##b
#define MOE_EP_CONCAT_(a, b) MOE_EP_CONCAT_INNER_(a, b)

// RETURN_IF_ERROR(expr): returns the absl::Status of `expr` from the enclosing
// function when it is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status moe_ep_status_ = (expr);          \
    if (!moe_ep_status_.ok()) return moe_ep_status_; \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates the absl::StatusOr `expr`; returns its
// status when not OK, else moves its value into `lhs` (which may declare).
#define ASSIGN_OR_RETURN(lhs, expr) \
  MOE_EP_ASSIGN_OR_RETURN_IMPL_(MOE_EP_CONCAT_(moe_ep_statusor_, __LINE__), lhs, expr)
#define MOE_EP_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

// CHECK(cond): "cannot happen" invariants only. Logs and aborts.
#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      spdlog::critical("CHECK failed at {}:{}: {}", __FILE__, __LINE__, #cond); \
      std::abort();                                                             \
    }                                                                           \
  } while (0)
