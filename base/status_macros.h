// Status plumbing shared by every layer: early-return macros for absl::Status and StatusOr.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ORYX_CONCAT_INNER_(a, b) a##b
#define ORYX_CONCAT_(a, b) ORYX_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define ORYX_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::absl::Status oryx_status_ = (expr);          \
    if (!oryx_status_.ok()) return oryx_status_;   \
  } while (0)

// `ORYX_ASSIGN_OR_RETURN(auto x, MakeX());` unwraps a StatusOr or returns its error.
#define ORYX_ASSIGN_OR_RETURN(lhs, expr) \
  ORYX_ASSIGN_OR_RETURN_IMPL_(ORYX_CONCAT_(oryx_statusor_, __LINE__), lhs, expr)
#define ORYX_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()
