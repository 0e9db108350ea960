// HDF5 C API helpers for the files libtrain writes (MIL attention files, predict's per-slide
// predictions): an owning handle, errors naming the file, and string attributes.
#pragma once

#include <hdf5.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "slide/core/status.h"

namespace slide::train::h5 {

// An HDF5 identifier closed by `close` when it goes out of scope.
struct Id {
  hid_t id = H5I_INVALID_HID;
  herr_t (*close)(hid_t) = nullptr;
  Id(hid_t i, herr_t (*c)(hid_t)) : id(i), close(c) {}
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;
  ~Id() {
    if (id >= 0 && close) close(id);
  }
  bool ok() const { return id >= 0; }
};

inline slide::core::Status error(const std::string& path, const std::string& what) {
  return slide::core::internal_error(path + ": HDF5: " + what);
}

// A scalar variable-length UTF-8 string attribute `name` on `loc`.
inline slide::core::Status write_string_attr(hid_t loc, const char* name, const std::string& value,
                                             const std::string& path) {
  Id type(H5Tcopy(H5T_C_S1), H5Tclose);
  if (!type.ok() || H5Tset_size(type.id, H5T_VARIABLE) < 0 || H5Tset_cset(type.id, H5T_CSET_UTF8) < 0)
    return error(path, "string type");
  Id space(H5Screate(H5S_SCALAR), H5Sclose);
  Id attr(H5Acreate2(loc, name, type.id, space.id, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  const char* p = value.c_str();
  if (!attr.ok() || H5Awrite(attr.id, type.id, &p) < 0) return error(path, std::string("attribute ") + name);
  return slide::core::ok_status();
}

// The file written as `partial` (closed) renamed to `path`: a file under that name is complete.
inline slide::core::Status rename_into_place(const std::string& partial, const std::string& path) {
  std::error_code ec;
  std::filesystem::rename(partial, path, ec);
  if (ec) return slide::core::errno_status(ec.value(), "rename " + partial + " to " + path);
  return slide::core::ok_status();
}

}  // namespace slide::train::h5
