// HDF5 C API helpers for the files libtrain writes (MIL attention files, predict's per-slide
// predictions): an owning handle, errors naming the file, string attributes, and durable commits.
#pragma once

#include <hdf5.h>

#include <filesystem>
#include <string>
#include <system_error>

#include "slide/core/durable.h"
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

// Closes the file `f` now, checked (HDF5 writes what it still buffers at the close: a failed
// close can lose data). Close every object opened in the file first: with HDF5's default close
// degree the file stays open until the last of them closes, unchecked.
inline slide::core::Status close_file(Id& f, const std::string& path) {
  const hid_t id = f.id;
  f.id = H5I_INVALID_HID;
  if (id >= 0 && H5Fclose(id) < 0) return error(path, "close");
  return slide::core::ok_status();
}

// Writes an HDF5 file through `write(partial)` (which creates `partial`, writes it and closes it,
// checked) and commits it under `path` (slide::core::commit_file: fsync, rename, fsync of the
// directory): a file under that name is complete, even after a crash. On any error `partial` is
// removed and nothing replaces `path`.
template <typename Write>
slide::core::Status write_committed(const std::string& path, Write&& write) {
  const std::string partial = path + ".partial";
  if (slide::core::Status s = write(partial); !s.ok()) {
    std::error_code ec;
    std::filesystem::remove(partial, ec);
    return s;
  }
  return slide::core::commit_file(partial, path);
}

}  // namespace slide::train::h5
