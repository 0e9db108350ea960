// Status and Result<T>: the error vocabulary of slidestream.
//
// Codes and their meaning follow Abseil's canonical codes (absl/status/status.h): corrupt input
// is kDataLoss, a full disk or an exceeded memory budget is kResourceExhausted, a bad argument
// from the user is kInvalidArgument, a missing file is kNotFound, an interrupted run kCancelled.
// A Status is never silently dropped: every fallible function is [[nodiscard]].
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

namespace slide::core {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

// "OK", "INVALID_ARGUMENT", ... (Abseil's spelling). Never null.
const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message is "<context>: <message>"; an OK status stays OK.
  Status with_context(std::string_view context) const;
  // "INVALID_ARGUMENT: message", or "OK".
  std::string to_string() const;
  // Marks a status as deliberately ignored (for destructors and best-effort cleanup).
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }
Status invalid_argument(std::string message);
Status not_found(std::string message);
Status already_exists(std::string message);
Status permission_denied(std::string message);
Status resource_exhausted(std::string message);
Status failed_precondition(std::string message);
Status out_of_range(std::string message);
Status unimplemented(std::string message);
Status internal_error(std::string message);
Status data_loss(std::string message);
Status cancelled(std::string message);
Status unavailable(std::string message);
// Maps an errno value to a Status: ENOSPC/EDQUOT -> kResourceExhausted, ENOENT -> kNotFound,
// EACCES/EPERM/EROFS -> kPermissionDenied, others -> kInternal. Message: "<what>: <strerror>".
Status errno_status(int err, std::string_view what);

// Result<T>: a T or a non-OK Status. Accessing value() of an error is a programmer error (assert).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { assert(ok()); return std::get<T>(v_); }
  const T& value() const& { assert(ok()); return std::get<T>(v_); }
  T&& value() && { assert(ok()); return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

namespace detail {
inline Status to_status(const Status& s) { return s; }
template <typename T>
Status to_status(const Result<T>& r) { return r.status(); }
}  // namespace detail

}  // namespace slide::core

#define SLIDE_CONCAT_INNER_(a, b) a##b
#define SLIDE_CONCAT_(a, b) SLIDE_CONCAT_INNER_(a, b)

// Returns the status of `expr` (a Status or a Result) from the enclosing function if it is not OK.
#define SLIDE_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                \
    ::slide::core::Status slide_status_ = ::slide::core::detail::to_status((expr));   \
    if (!slide_status_.ok()) return slide_status_;                                    \
  } while (0)

// Same, prefixing the message with `context` (any std::string-convertible expression).
#define SLIDE_RETURN_IF_ERROR_CTX(expr, context)                                      \
  do {                                                                                \
    ::slide::core::Status slide_status_ = ::slide::core::detail::to_status((expr));   \
    if (!slide_status_.ok()) return slide_status_.with_context(context);              \
  } while (0)

// SLIDE_ASSIGN_OR_RETURN(auto x, make_x()); declares/assigns the value or returns the error.
#define SLIDE_ASSIGN_OR_RETURN(lhs, expr) \
  SLIDE_ASSIGN_OR_RETURN_IMPL_(SLIDE_CONCAT_(slide_result_, __LINE__), lhs, expr, "")
#define SLIDE_ASSIGN_OR_RETURN_CTX(lhs, expr, context) \
  SLIDE_ASSIGN_OR_RETURN_IMPL_(SLIDE_CONCAT_(slide_result_, __LINE__), lhs, expr, context)
#define SLIDE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr, context)                         \
  auto tmp = (expr);                                                                  \
  if (!tmp.ok()) {                                                                    \
    std::string slide_ctx_ = (context);                                               \
    return slide_ctx_.empty() ? tmp.status() : tmp.status().with_context(slide_ctx_); \
  }                                                                                   \
  lhs = std::move(tmp).value()
