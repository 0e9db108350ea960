#include "slide/core/status.h"

#include <cerrno>
#include <cstring>

namespace slide::core {

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnknown: return "UNKNOWN";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kAborted: return "ABORTED";
    case StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDataLoss: return "DATA_LOSS";
  }
  return "UNKNOWN";
}

Status Status::with_context(std::string_view context) const {
  if (ok() || context.empty()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status invalid_argument(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status not_found(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status already_exists(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
Status permission_denied(std::string m) { return Status(StatusCode::kPermissionDenied, std::move(m)); }
Status resource_exhausted(std::string m) { return Status(StatusCode::kResourceExhausted, std::move(m)); }
Status failed_precondition(std::string m) { return Status(StatusCode::kFailedPrecondition, std::move(m)); }
Status out_of_range(std::string m) { return Status(StatusCode::kOutOfRange, std::move(m)); }
Status unimplemented(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }
Status internal_error(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
Status data_loss(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
Status cancelled(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }
Status unavailable(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }

Status errno_status(int err, std::string_view what) {
  std::string m(what);
  m += ": ";
  m += std::strerror(err);
  switch (err) {
    case ENOSPC:
#ifdef EDQUOT
    case EDQUOT:
#endif
      return resource_exhausted(std::move(m));
    case ENOENT: return not_found(std::move(m));
    case EACCES:
    case EPERM:
    case EROFS: return permission_denied(std::move(m));
    default: return internal_error(std::move(m));
  }
}

}  // namespace slide::core
