#include "slide/cache/bag.h"

#include <fcntl.h>
#include <hdf5.h>
#include <lzf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>

#include "slide/core/csv.h"
#include "slide/core/durable.h"
#include "slide/core/file.h"
#include "slide/core/file_name.h"

namespace slide::cache {
namespace {

using slide::core::StatusCode;

constexpr H5Z_filter_t kLzfFilterId = 32000;  // h5py's LZF filter (registered with The HDF Group)
constexpr unsigned kLzfFilterVersion = 4;       // h5py's lzf_filter.c, H5PY_FILTER_LZF_VERSION

// The LZF filter, byte for byte the format of h5py's lzf_filter.c (h5py reads and writes it
// natively, without a plugin), on Debian's liblzf. cd_values: [filter version, LZF API version,
// uncompressed chunk bytes]. Debian's hdf5-plugin-lzf would provide it, but its library is not
// linked against liblzf (lzf_compress is undefined: HDF5's dlopen refuses it), so it is
// registered here.
herr_t lzf_set_local(hid_t dcpl, hid_t type, hid_t) {
  unsigned flags = 0;
  size_t n = 8;
  unsigned values[8] = {0};
  if (H5Pget_filter_by_id2(dcpl, kLzfFilterId, &flags, &n, values, 0, nullptr, nullptr) < 0) return -1;
  hsize_t chunk[32];
  const int ndims = H5Pget_chunk(dcpl, 32, chunk);
  if (ndims < 0) return -1;
  size_t bytes = H5Tget_size(type);
  for (int i = 0; i < ndims; ++i) bytes *= chunk[i];
  values[0] = kLzfFilterVersion;
  values[1] = LZF_VERSION;
  values[2] = static_cast<unsigned>(bytes);
  return H5Pmodify_filter(dcpl, kLzfFilterId, flags, std::max<size_t>(n, 3), values);
}

// HDF5's filter contract: return the new size and swap *buf, or 0 on failure (for an optional
// filter, a chunk that does not shrink is then stored as is).
size_t lzf_filter(unsigned flags, size_t cd_nelmts, const unsigned cd_values[], size_t nbytes, size_t* buf_size,
                  void** buf) {
  void* out = nullptr;
  size_t out_size = 0;
  unsigned status = 0;
  if ((flags & H5Z_FLAG_REVERSE) == 0) {
    out_size = *buf_size;
    out = std::malloc(out_size);
    if (out == nullptr) return 0;
    status = lzf_compress(*buf, static_cast<unsigned>(nbytes), out, static_cast<unsigned>(out_size));
  } else {
    out_size = (cd_nelmts >= 3 && cd_values[2] != 0) ? cd_values[2] : *buf_size;
    while (status == 0) {
      std::free(out);
      out = std::malloc(out_size);
      if (out == nullptr) return 0;
      status = lzf_decompress(*buf, static_cast<unsigned>(nbytes), out, static_cast<unsigned>(out_size));
      if (status == 0) {
        if (errno != E2BIG) break;  // EINVAL: corrupt data
        out_size += *buf_size;
      }
    }
  }
  if (status == 0) {
    std::free(out);
    return 0;
  }
  std::free(*buf);
  *buf = out;
  *buf_size = out_size;
  return status;
}

// HDF5 prints its error stack to stderr by default; we turn that off once and turn the stack into
// the message of a Status instead. The LZF filter is registered here too, unless a plugin did.
//
// H5dont_atexit: HDF5 1.10 (Debian's 1.10.8) cannot close a file whose H5Fclose failed (a full
// disk, or EFBIG, while flushing): the file ID stays registered half torn down, and the
// library's atexit clean-up (H5_term_library -> H5F__close_cb) then segfaults, turning a clean
// "disk full" error into exit 139. Every object of ours is closed explicitly (Hid), so the
// clean-up at exit has nothing to do but that; it is switched off. This must precede the
// library's initialisation (the first HDF5 call of the process), hence here, first of all.
void quiet_hdf5() {
  static std::once_flag once;
  std::call_once(once, [] {
    H5dont_atexit();
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    if (H5Zfilter_avail(kLzfFilterId) <= 0) {
      static const H5Z_class2_t kLzfClass = {H5Z_CLASS_T_VERS, kLzfFilterId, 1, 1, "lzf", nullptr, lzf_set_local,
                                             lzf_filter};
      H5Zregister(&kLzfClass);
    }
    H5Eclear2(H5E_DEFAULT);
  });
}

herr_t collect_error(unsigned n, const H5E_error2_t* err, void* data) {
  auto* out = static_cast<std::string*>(data);
  // The innermost (n == 0) entry says what failed first; the outer ones add little.
  if (n == 0 && err->desc != nullptr) *out = err->desc;
  return 0;
}

std::string hdf5_error_message() {
  std::string msg;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect_error, &msg);
  H5Eclear2(H5E_DEFAULT);
  return msg.empty() ? std::string("HDF5 error") : msg;
}

// A failed HDF5 call: errno (set by the POSIX driver underneath) decides disk full and permission
// problems; the HDF5 stack supplies the message.
Status hdf5_status(StatusCode fallback, const std::string& what) {
  const int err = errno;
  std::string msg = what + ": " + hdf5_error_message();
  if (err == ENOSPC || err == EDQUOT) return slide::core::resource_exhausted(msg + " (disk full)");
  if (err == EFBIG) return slide::core::resource_exhausted(msg + " (file too large: " + std::strerror(err) + ")");
  if (fallback == StatusCode::kInternal && (err == EACCES || err == EPERM || err == EROFS)) {
    return slide::core::permission_denied(msg + ": " + std::strerror(err));
  }
  return Status(fallback, msg);
}

// Owning HDF5 identifier; the closer depends on the object kind.
class Hid {
 public:
  using Closer = herr_t (*)(hid_t);
  Hid() = default;
  Hid(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Hid(const Hid&) = delete;
  Hid& operator=(const Hid&) = delete;
  Hid(Hid&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Hid& operator=(Hid&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  ~Hid() { reset(); }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now, returning whether HDF5 reported success.
  bool reset() {
    bool ok = true;
    if (id_ >= 0 && closer_ != nullptr) ok = closer_(id_) >= 0;
    id_ = H5I_INVALID_HID;
    return ok;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

Hid plist(hid_t cls) { return Hid(H5Pcreate(cls), H5Pclose); }

// IEEE binary16, little-endian, laid out as h5py lays out numpy.float16.
Hid make_half_type() {
  Hid t(H5Tcopy(H5T_IEEE_F32LE), H5Tclose);
  H5Tset_fields(t.get(), 15, 10, 5, 0, 10);
  H5Tset_size(t.get(), 2);
  H5Tset_ebias(t.get(), 15);
  return t;
}

Hid make_string_type() {
  Hid t(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(t.get(), H5T_VARIABLE);
  H5Tset_cset(t.get(), H5T_CSET_UTF8);
  return t;
}

Status write_attr_string(hid_t obj, const char* name, const std::string& value) {
  Hid type = make_string_type();
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) return hdf5_status(StatusCode::kInternal, std::string("create attribute ") + name);
  const char* p = value.c_str();
  if (H5Awrite(attr.get(), type.get(), &p) < 0) {
    return hdf5_status(StatusCode::kInternal, std::string("write attribute ") + name);
  }
  return slide::core::ok_status();
}

template <typename T>
Status write_attr_scalar(hid_t obj, const char* name, hid_t file_type, hid_t mem_type, T value) {
  Hid space(H5Screate(H5S_SCALAR), H5Sclose);
  Hid attr(H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.valid()) return hdf5_status(StatusCode::kInternal, std::string("create attribute ") + name);
  if (H5Awrite(attr.get(), mem_type, &value) < 0) {
    return hdf5_status(StatusCode::kInternal, std::string("write attribute ") + name);
  }
  return slide::core::ok_status();
}

// Whether attribute `attr` holds exactly one element (a scalar, or an array of one): H5Aread
// writes every element, so reading an array of 100 into one value would overrun it.
bool single_element(hid_t attr) {
  Hid space(H5Aget_space(attr), H5Sclose);
  return space.valid() && H5Sget_simple_extent_npoints(space.get()) == 1;
}

// Reads a string attribute, fixed or variable length; false when absent, not a string or not a
// single element.
bool read_attr_string(hid_t obj, const char* name, std::string* out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!attr.valid() || !single_element(attr.get())) return false;
  Hid ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) return false;
  if (H5Tis_variable_str(ftype.get()) > 0) {
    Hid mtype = make_string_type();
    char* p = nullptr;
    if (H5Aread(attr.get(), mtype.get(), &p) < 0) return false;
    *out = p != nullptr ? p : "";
    Hid space(H5Aget_space(attr.get()), H5Sclose);
    H5Dvlen_reclaim(mtype.get(), space.get(), H5P_DEFAULT, &p);
    return true;
  }
  const size_t n = H5Tget_size(ftype.get());
  std::string buf(n, '\0');
  Hid mtype(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(mtype.get(), n);
  if (H5Aread(attr.get(), mtype.get(), buf.data()) < 0) return false;
  buf.resize(std::strlen(buf.c_str()));
  *out = buf;
  return true;
}

// Reads a numeric attribute of one element into `out` (converted to `mem_type`); false when
// absent, not convertible or not a single element.
template <typename T>
bool read_attr_scalar(hid_t obj, const char* name, hid_t mem_type, T* out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Hid attr(H5Aopen(obj, name, H5P_DEFAULT), H5Aclose);
  if (!attr.valid() || !single_element(attr.get())) return false;
  return H5Aread(attr.get(), mem_type, out) >= 0;
}

std::string parent_dir(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

// File access: HDF5's file locking as configured (HDF5_USE_FILE_LOCKING overrides this), but not
// an error on filesystems without locks.
Hid file_access_plist() {
  Hid fapl = plist(H5P_FILE_ACCESS);
  H5Pset_file_locking(fapl.get(), 1, 1);
  return fapl;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Names and small helpers

const char* feature_dtype_name(FeatureDtype dtype) {
  return dtype == FeatureDtype::kFloat16 ? "float16" : "float32";
}

Result<FeatureDtype> parse_feature_dtype(const std::string& name) {
  if (name == "float32" || name == "f32" || name == "fp32") return FeatureDtype::kFloat32;
  if (name == "float16" || name == "f16" || name == "fp16" || name == "half") return FeatureDtype::kFloat16;
  return slide::core::invalid_argument("unknown feature dtype '" + name + "' (float32 or float16)");
}

const char* compression_name(Compression compression) {
  switch (compression) {
    case Compression::kGzip: return "gzip";
    case Compression::kLzf: return "lzf";
    case Compression::kNone: break;
  }
  return "none";
}

Result<Compression> parse_compression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "gzip") return Compression::kGzip;
  if (name == "lzf") return Compression::kLzf;
  return slide::core::invalid_argument("unknown compression '" + name + "' (none, gzip or lzf)");
}

bool compression_available(Compression compression) {
  quiet_hdf5();
  unsigned config = 0;
  switch (compression) {
    case Compression::kNone: return true;
    case Compression::kGzip:
      return H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0 && H5Zget_filter_info(H5Z_FILTER_DEFLATE, &config) >= 0 &&
             (config & H5Z_FILTER_CONFIG_ENCODE_ENABLED) != 0;
    case Compression::kLzf: {
      const bool ok = H5Zfilter_avail(kLzfFilterId) > 0;  // registered by quiet_hdf5()
      H5Eclear2(H5E_DEFAULT);
      return ok;
    }
  }
  return false;
}

std::string bag_file_name(const std::string& slide_id) { return slide::core::slide_file_stem(slide_id) + ".h5"; }

std::string legacy_bag_file_name(const std::string& slide_id) {
  std::string name = slide_id;
  for (char& c : name) {
    const bool keep = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
                      c == '_' || c == '-';
    if (!keep) c = '_';
  }
  if (!name.empty() && name[0] == '.') name[0] = '_';
  if (name.empty()) name = "_";
  return name + ".h5";
}

uint16_t float_to_half(float value) {
  uint32_t f;
  std::memcpy(&f, &value, 4);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t abs = f & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): value / 2^-24 rounded to nearest even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14 + (113 - exp) ... bits to drop so 2^-24 is the unit
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits.
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  uint32_t f;
  if (exp == 0x1f) {
    f = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    f = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    f = sign;
  } else {  // subnormal: normalise
    uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    f = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

// ------------------------------------------------------------------------------------------------
// BagWriter

struct BagWriter::Impl {
  std::string path;
  std::string partial;
  int64_t dim = 0;
  BagWriterOptions options;
  Hid file, features, coords, half_type;
  std::vector<float> feature_buf;    // up to chunk_rows x dim
  std::vector<uint16_t> half_buf;    // the same rows as float16, for the write
  std::vector<int32_t> coord_buf;    // up to chunk_rows x 2
  int64_t buffered = 0;              // rows in the buffers
  int64_t written = 0;               // rows in the file
  bool dead = false;
  bool done = false;

  Status fail(Status s) {
    dead = true;
    return s;
  }

  Status flush_rows() {
    if (buffered == 0) return slide::core::ok_status();
    const hsize_t new_rows = static_cast<hsize_t>(written + buffered);
    const hsize_t udim = static_cast<hsize_t>(dim);
    hsize_t fdims[2] = {new_rows, udim};
    hsize_t cdims[2] = {new_rows, 2};
    if (H5Dset_extent(features.get(), fdims) < 0 || H5Dset_extent(coords.get(), cdims) < 0) {
      return fail(hdf5_status(StatusCode::kInternal, "extend datasets of " + partial));
    }
    auto write_rows = [&](hid_t ds, hsize_t cols, hid_t mem_type, const void* data) -> Status {
      Hid fspace(H5Dget_space(ds), H5Sclose);
      hsize_t start[2] = {static_cast<hsize_t>(written), 0};
      hsize_t count[2] = {static_cast<hsize_t>(buffered), cols};
      if (!fspace.valid() || H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
        return hdf5_status(StatusCode::kInternal, "select rows to write in " + partial);
      Hid mspace(H5Screate_simple(2, count, nullptr), H5Sclose);
      if (H5Dwrite(ds, mem_type, mspace.get(), fspace.get(), H5P_DEFAULT, data) < 0) {
        return hdf5_status(StatusCode::kInternal, "write rows to " + partial);
      }
      return slide::core::ok_status();
    };
    Status s;
    if (options.dtype == FeatureDtype::kFloat16) {
      const size_t n = static_cast<size_t>(buffered * dim);
      half_buf.resize(n);
      for (size_t i = 0; i < n; ++i) half_buf[i] = float_to_half(feature_buf[i]);
      s = write_rows(features.get(), udim, half_type.get(), half_buf.data());
    } else {
      s = write_rows(features.get(), udim, H5T_NATIVE_FLOAT, feature_buf.data());
    }
    if (!s.ok()) return fail(s);
    s = write_rows(coords.get(), 2, H5T_NATIVE_INT32, coord_buf.data());
    if (!s.ok()) return fail(s);
    written += buffered;
    buffered = 0;
    return slide::core::ok_status();
  }

  void close_all() {
    features.reset();
    coords.reset();
    half_type.reset();
    file.reset();
  }
};

BagWriter::BagWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

BagWriter::~BagWriter() { discard(); }

Result<std::unique_ptr<BagWriter>> BagWriter::create(const std::string& path, int64_t feature_dim,
                                                     const BagAttributes& attributes,
                                                     const BagWriterOptions& options) {
  quiet_hdf5();
  if (feature_dim < 1) return slide::core::invalid_argument("bag " + path + ": feature_dim must be >= 1");
  if (options.chunk_rows < 1) return slide::core::invalid_argument("bag " + path + ": chunk_rows must be >= 1");
  if (options.compression == Compression::kGzip && (options.gzip_level < 1 || options.gzip_level > 9)) {
    return slide::core::invalid_argument("bag " + path + ": gzip level must be 1..9");
  }
  if (attributes.slide_id.empty()) return slide::core::invalid_argument("bag " + path + ": empty slide id");
  if (!compression_available(options.compression)) {
    return slide::core::failed_precondition(
        std::string("bag ") + path + ": the HDF5 " + compression_name(options.compression) +
        " filter is not available in this HDF5 library");
  }

  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->partial = path + ".partial";
  impl->dim = feature_dim;
  impl->options = options;
  // Chunks of at most kMaxChunkFeatureBytes of features: HDF5 refuses a chunk of 4 GiB or more
  // (H5Pset_chunk), and the writer buffers one chunk (a 10^6-row chunk of 2560-d features would be
  // 10 GiB); fewer rows per chunk change nothing that a reader sees.
  const int64_t elem = options.dtype == FeatureDtype::kFloat16 ? 2 : 4;
  impl->options.chunk_rows = std::min(options.chunk_rows, std::max<int64_t>(1, kMaxChunkFeatureBytes / (feature_dim * elem)));
  impl->half_type = make_half_type();

  // A leftover .partial of a killed run is truncated (H5F_ACC_TRUNC).
  Hid fapl = file_access_plist();
  errno = 0;
  impl->file = Hid(H5Fcreate(impl->partial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!impl->file.valid()) {
    const int err = errno;
    std::string msg = "create bag " + impl->partial + ": " + hdf5_error_message();
    if (err == ENOENT) return slide::core::not_found(msg + ": no such directory");
    if (err == EACCES || err == EPERM || err == EROFS) return slide::core::permission_denied(msg + ": " + std::strerror(err));
    if (err == ENOSPC || err == EDQUOT) return slide::core::resource_exhausted(msg + " (disk full)");
    return slide::core::internal_error(msg);
  }

  const hsize_t chunk = static_cast<hsize_t>(impl->options.chunk_rows);
  const hsize_t udim = static_cast<hsize_t>(feature_dim);
  auto make_dataset = [&](const char* name, hsize_t cols, hid_t type, Hid* out) -> Status {
    hsize_t dims[2] = {0, cols};
    hsize_t maxdims[2] = {H5S_UNLIMITED, cols};
    hsize_t chunk_dims[2] = {chunk, cols};
    Hid space(H5Screate_simple(2, dims, maxdims), H5Sclose);
    Hid dcpl = plist(H5P_DATASET_CREATE);
    if (H5Pset_chunk(dcpl.get(), 2, chunk_dims) < 0)
      return hdf5_status(StatusCode::kInternal, std::string("chunk layout of ") + name + " in " + impl->partial);
    // Shuffle first, then the compressor (the pipeline runs in the order filters are added).
    bool filters_ok = true;
    if (options.compression == Compression::kGzip) {
      filters_ok = H5Pset_shuffle(dcpl.get()) >= 0 &&
                   H5Pset_deflate(dcpl.get(), static_cast<unsigned>(options.gzip_level)) >= 0;
    } else if (options.compression == Compression::kLzf) {
      filters_ok = H5Pset_shuffle(dcpl.get()) >= 0 &&  // as h5py sets it
                   H5Pset_filter(dcpl.get(), kLzfFilterId, H5Z_FLAG_OPTIONAL, 0, nullptr) >= 0;
    }
    if (!filters_ok)
      return hdf5_status(StatusCode::kInternal, std::string("compression filters of ") + name + " in " + impl->partial);
    *out = Hid(H5Dcreate2(impl->file.get(), name, type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT),
               H5Dclose);
    if (!out->valid()) return hdf5_status(StatusCode::kInternal, std::string("create ") + name + " in " + impl->partial);
    return slide::core::ok_status();
  };
  const hid_t ftype = options.dtype == FeatureDtype::kFloat16 ? impl->half_type.get() : H5T_IEEE_F32LE;
  Status s = make_dataset("features", udim, ftype, &impl->features);
  if (s.ok()) s = make_dataset("coords", 2, H5T_STD_I32LE, &impl->coords);
  auto cleanup = [&](Status st) {
    impl->close_all();
    ::unlink(impl->partial.c_str());
    return st;
  };
  if (!s.ok()) return cleanup(s);

  const hid_t root = impl->file.get();
  const int32_t size_l0 = attributes.tile_size_l0_px > 0 ? attributes.tile_size_l0_px : attributes.tile_size_px;
  for (Status st : {write_attr_string(root, "slide_id", attributes.slide_id),
                    write_attr_string(root, "label", attributes.label),
                    write_attr_scalar(root, "tile_size_px", H5T_STD_I32LE, H5T_NATIVE_INT32, attributes.tile_size_px),
                    write_attr_scalar(root, "mpp_um", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, attributes.mpp_um),
                    write_attr_string(root, "model", attributes.model),
                    write_attr_string(root, "layer", attributes.layer),
                    write_attr_scalar(root, "feature_dim", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                      static_cast<int32_t>(feature_dim)),
                    write_attr_string(root, "weights_sha256", attributes.weights_sha256),
                    write_attr_string(root, "tool_version", attributes.tool_version),
                    write_attr_scalar(root, "format_version", H5T_STD_I32LE, H5T_NATIVE_INT32, kBagFormatVersion),
                    write_attr_scalar(impl->coords.get(), "patch_size", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                      attributes.patch_size > 0 ? attributes.patch_size : attributes.tile_size_px),
                    write_attr_scalar(impl->coords.get(), "patch_size_level0", H5T_STD_I32LE, H5T_NATIVE_INT32, size_l0),
                    write_attr_scalar(impl->coords.get(), "patch_level", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                      attributes.patch_level),
                    write_attr_scalar(impl->coords.get(), "level0_magnification", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                      attributes.level0_magnification),
                    write_attr_scalar(impl->coords.get(), "target_magnification", H5T_STD_I32LE, H5T_NATIVE_INT32,
                                      attributes.target_magnification),
                    write_attr_scalar(impl->coords.get(), "overlap", H5T_STD_I32LE, H5T_NATIVE_INT32, attributes.overlap),
                    write_attr_scalar(impl->coords.get(), "level0_width", H5T_STD_I64LE, H5T_NATIVE_INT64,
                                      attributes.level0_width),
                    write_attr_scalar(impl->coords.get(), "level0_height", H5T_STD_I64LE, H5T_NATIVE_INT64,
                                      attributes.level0_height)}) {
    if (!st.ok()) return cleanup(st);
  }
  if (attributes.encoder_input_px > 0) {
    Status st = write_attr_scalar(root, "encoder_input_px", H5T_STD_I32LE, H5T_NATIVE_INT32, attributes.encoder_input_px);
    if (!st.ok()) return cleanup(st);
  }
  if (!attributes.stain_normalization.empty()) {
    Status st = write_attr_string(root, "stain_normalization", attributes.stain_normalization);
    if (!st.ok()) return cleanup(st);
  }
  if (!attributes.precision.empty()) {
    Status st = write_attr_string(root, "precision", attributes.precision);
    if (!st.ok()) return cleanup(st);
  }
  if (attributes.attention_heads > 0) {
    Status st = write_attr_scalar(root, "attention_heads", H5T_STD_I32LE, H5T_NATIVE_INT32, attributes.attention_heads);
    if (!st.ok()) return cleanup(st);
  }
  impl->feature_buf.reserve(static_cast<size_t>(impl->options.chunk_rows * feature_dim));
  impl->coord_buf.reserve(static_cast<size_t>(impl->options.chunk_rows * 2));
  return std::unique_ptr<BagWriter>(new BagWriter(std::move(impl)));
}

Status BagWriter::append(int64_t rows, std::span<const float> features, std::span<const int64_t> coords) {
  Impl& m = *impl_;
  if (m.dead || m.done) return slide::core::failed_precondition("bag " + m.partial + ": writer is closed after an error");
  if (rows < 0 || features.size() != static_cast<size_t>(rows * m.dim) || coords.size() != static_cast<size_t>(rows * 2)) {
    return slide::core::invalid_argument("bag " + m.partial + ": append of " + std::to_string(rows) + " rows got " +
                                         std::to_string(features.size()) + " feature values and " +
                                         std::to_string(coords.size()) + " coordinates (D = " + std::to_string(m.dim) + ")");
  }
  for (size_t i = 0; i < features.size(); ++i) {
    const float v = features[i];
    // NaN is never written; nor an inf, or a value float16 would turn into one.
    if (!std::isfinite(v) || (m.options.dtype == FeatureDtype::kFloat16 && std::fabs(v) >= 65520.0f)) {
      const auto row = m.written + m.buffered + static_cast<int64_t>(i) / m.dim, col = static_cast<int64_t>(i) % m.dim;
      return slide::core::out_of_range(
          "bag " + m.partial + ": feature row " + std::to_string(row) + ", column " + std::to_string(col) + " is " +
          (std::isnan(v) ? std::string("NaN") : std::to_string(v)) +
          (std::isfinite(v) ? ", beyond float16's range (use float32)" : ": features must be finite"));
    }
  }
  for (int64_t c : coords) {
    if (c < std::numeric_limits<int32_t>::min() || c > std::numeric_limits<int32_t>::max()) {
      return slide::core::invalid_argument("bag " + m.partial + ": coordinate " + std::to_string(c) +
                                           " does not fit the int32 /coords");
    }
  }
  int64_t r = 0;
  while (r < rows) {
    const int64_t take = std::min(rows - r, m.options.chunk_rows - m.buffered);
    m.feature_buf.insert(m.feature_buf.end(), features.begin() + r * m.dim, features.begin() + (r + take) * m.dim);
    for (int64_t i = r * 2; i < (r + take) * 2; ++i) m.coord_buf.push_back(static_cast<int32_t>(coords[i]));
    m.buffered += take;
    r += take;
    if (m.buffered == m.options.chunk_rows) {
      SLIDE_RETURN_IF_ERROR(m.flush_rows());
      m.feature_buf.clear();
      m.coord_buf.clear();
    }
  }
  return slide::core::ok_status();
}

Status BagWriter::commit() {
  Impl& m = *impl_;
  if (m.dead || m.done) return slide::core::failed_precondition("bag " + m.partial + ": writer is closed");
  auto fail = [&](Status s) {
    m.dead = true;
    m.close_all();
    ::unlink(m.partial.c_str());
    return s;
  };
  Status s = m.flush_rows();
  if (!s.ok()) return fail(s);
  errno = 0;
  if (H5Fflush(m.file.get(), H5F_SCOPE_GLOBAL) < 0) return fail(hdf5_status(StatusCode::kInternal, "flush " + m.partial));
  m.features.reset();
  m.coords.reset();
  m.half_type.reset();
  if (!m.file.reset()) return fail(hdf5_status(StatusCode::kInternal, "close " + m.partial));
  s = slide::core::fsync_path(m.partial, false);
  if (!s.ok()) return fail(s);
  if (::rename(m.partial.c_str(), m.path.c_str()) != 0) {
    return fail(slide::core::errno_status(errno, "rename " + m.partial + " to " + m.path));
  }
  m.done = true;
  return slide::core::fsync_path(parent_dir(m.path), true);
}

void BagWriter::discard() {
  if (!impl_ || impl_->done) return;
  impl_->close_all();
  ::unlink(impl_->partial.c_str());
  impl_->dead = true;
}

int64_t BagWriter::rows() const { return impl_->written + impl_->buffered; }
int64_t BagWriter::feature_dim() const { return impl_->dim; }
const std::string& BagWriter::path() const { return impl_->path; }
std::string BagWriter::partial_path() const { return impl_->partial; }

// ------------------------------------------------------------------------------------------------
// BagReader

struct BagReader::Impl {
  BagInfo info;
  Hid file, features, coords, half_type;
};

BagReader::BagReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BagReader::~BagReader() = default;
const BagInfo& BagReader::info() const { return impl_->info; }

Result<std::unique_ptr<BagReader>> BagReader::open(const std::string& path) {
  quiet_hdf5();
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return slide::core::errno_status(errno, "open bag " + path);
  if (::access(path.c_str(), R_OK) != 0) return slide::core::errno_status(errno, "open bag " + path);
  auto impl = std::make_unique<Impl>();
  impl->info.path = path;
  impl->info.file_bytes = static_cast<int64_t>(st.st_size);
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    H5Eclear2(H5E_DEFAULT);
    return slide::core::data_loss("bag " + path + ": not an HDF5 file");
  }
  Hid fapl = file_access_plist();
  impl->file = Hid(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!impl->file.valid()) return hdf5_status(StatusCode::kDataLoss, "open bag " + path);
  const hid_t f = impl->file.get();

  auto open_2d = [&](const char* name, Hid* ds, hsize_t* dims) -> Status {
    if (H5Lexists(f, name, H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return slide::core::data_loss("bag " + path + ": no /" + name + " dataset");
    }
    *ds = Hid(H5Dopen2(f, name, H5P_DEFAULT), H5Dclose);
    if (!ds->valid()) return hdf5_status(StatusCode::kDataLoss, "bag " + path + ": open /" + name);
    Hid space(H5Dget_space(ds->get()), H5Sclose);
    if (H5Sget_simple_extent_ndims(space.get()) != 2) {
      return slide::core::data_loss("bag " + path + ": /" + name + " is not two-dimensional");
    }
    if (H5Sget_simple_extent_dims(space.get(), dims, nullptr) < 0)
      return hdf5_status(StatusCode::kDataLoss, "bag " + path + ": extent of /" + name);
    return slide::core::ok_status();
  };
  hsize_t fdims[2] = {0, 0}, cdims[2] = {0, 0};
  SLIDE_RETURN_IF_ERROR(open_2d("features", &impl->features, fdims));
  SLIDE_RETURN_IF_ERROR(open_2d("coords", &impl->coords, cdims));
  if (cdims[1] != 2) return slide::core::data_loss("bag " + path + ": /coords is N x " + std::to_string(cdims[1]) + ", not N x 2");
  // A feature row of 1 .. 2^20 values (the largest encoders give a few thousand), and N x D x 4
  // bytes within int64: the readers size buffers as N * D, which a damaged extent must not wrap.
  constexpr hsize_t kMaxFeatureDim = hsize_t{1} << 20;
  if (fdims[1] < 1 || fdims[1] > kMaxFeatureDim)
    return slide::core::data_loss("bag " + path + ": /features is N x " + std::to_string(fdims[1]) +
                                  ", the feature dimension must be 1 .. " + std::to_string(kMaxFeatureDim));
  if (fdims[0] > static_cast<hsize_t>(std::numeric_limits<int64_t>::max()) / (fdims[1] * 4))
    return slide::core::data_loss("bag " + path + ": /features has " + std::to_string(fdims[0]) +
                                  " rows, more than any file can hold");
  if (cdims[0] != fdims[0]) {
    return slide::core::data_loss("bag " + path + ": /features has " + std::to_string(fdims[0]) + " rows but /coords " +
                                  std::to_string(cdims[0]));
  }
  {
    Hid t(H5Dget_type(impl->features.get()), H5Tclose);
    const size_t size = H5Tget_size(t.get());
    if (H5Tget_class(t.get()) != H5T_FLOAT || (size != 2 && size != 4)) {
      return slide::core::data_loss("bag " + path + ": /features is not float32 or float16");
    }
    impl->info.dtype = size == 2 ? FeatureDtype::kFloat16 : FeatureDtype::kFloat32;
    Hid ct(H5Dget_type(impl->coords.get()), H5Tclose);
    if (H5Tget_class(ct.get()) != H5T_INTEGER) return slide::core::data_loss("bag " + path + ": /coords is not integer");
    Hid dcpl(H5Dget_create_plist(impl->features.get()), H5Pclose);
    const int nfilters = H5Pget_nfilters(dcpl.get());
    for (int i = 0; i < nfilters; ++i) {
      unsigned flags = 0;
      size_t nelem = 0;
      const H5Z_filter_t id = H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &nelem, nullptr, 0,
                                             nullptr, nullptr);
      if (id == H5Z_FILTER_DEFLATE) impl->info.compression = Compression::kGzip;
      if (id == kLzfFilterId) impl->info.compression = Compression::kLzf;
    }
  }
  impl->info.num_tiles = static_cast<int64_t>(fdims[0]);
  impl->info.feature_dim = static_cast<int64_t>(fdims[1]);
  impl->half_type = make_half_type();

  BagAttributes& a = impl->info.attributes;
  read_attr_string(f, "slide_id", &a.slide_id);
  read_attr_string(f, "label", &a.label);
  read_attr_scalar(f, "tile_size_px", H5T_NATIVE_INT32, &a.tile_size_px);
  read_attr_scalar(f, "mpp_um", H5T_NATIVE_DOUBLE, &a.mpp_um);
  read_attr_string(f, "model", &a.model);
  read_attr_string(f, "layer", &a.layer);
  read_attr_string(f, "weights_sha256", &a.weights_sha256);
  read_attr_string(f, "tool_version", &a.tool_version);
  read_attr_scalar(impl->coords.get(), "patch_size_level0", H5T_NATIVE_INT32, &a.tile_size_l0_px);
  read_attr_scalar(f, "encoder_input_px", H5T_NATIVE_INT32, &a.encoder_input_px);
  read_attr_string(f, "stain_normalization", &a.stain_normalization);
  read_attr_string(f, "precision", &a.precision);
  read_attr_scalar(f, "attention_heads", H5T_NATIVE_INT32, &a.attention_heads);
  int32_t version = 0;
  if (read_attr_scalar(f, "format_version", H5T_NATIVE_INT32, &version) && version > kBagFormatVersion) {
    return slide::core::failed_precondition("bag " + path + ": format version " + std::to_string(version) +
                                            " is newer than this reader's (" + std::to_string(kBagFormatVersion) + ")");
  }
  H5Eclear2(H5E_DEFAULT);
  // CLAM's own files have no slide id: the file name is the id there.
  if (a.slide_id.empty()) a.slide_id = std::filesystem::path(path).stem().string();
  return std::unique_ptr<BagReader>(new BagReader(std::move(impl)));
}

namespace {

Status read_rows(const std::string& path, const char* name, hid_t ds, int64_t n, int64_t row_begin, int64_t row_count,
                 hsize_t cols, hid_t mem_type, void* out) {
  if (row_begin < 0 || row_count < 0 || row_begin + row_count > n) {
    return slide::core::out_of_range("bag " + path + ": rows [" + std::to_string(row_begin) + ", " +
                                     std::to_string(row_begin + row_count) + ") of /" + name + " outside 0.." +
                                     std::to_string(n));
  }
  if (row_count == 0) return slide::core::ok_status();
  Hid fspace(H5Dget_space(ds), H5Sclose);
  hsize_t start[2] = {static_cast<hsize_t>(row_begin), 0};
  hsize_t count[2] = {static_cast<hsize_t>(row_count), cols};
  if (!fspace.valid() || H5Sselect_hyperslab(fspace.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
    return hdf5_status(StatusCode::kDataLoss, "bag " + path + ": select rows of /" + name);
  Hid mspace(H5Screate_simple(2, count, nullptr), H5Sclose);
  if (H5Dread(ds, mem_type, mspace.get(), fspace.get(), H5P_DEFAULT, out) < 0) {
    return hdf5_status(StatusCode::kDataLoss, "bag " + path + ": read /" + name);
  }
  return slide::core::ok_status();
}

}  // namespace

namespace {

// Features are never passed on when not finite: the first NaN or inf names its row and column.
Status check_finite(const std::string& path, int64_t row_begin, int64_t d, std::span<const float> rows) {
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!std::isfinite(rows[i])) {
      const auto row = row_begin + static_cast<int64_t>(i) / d, col = static_cast<int64_t>(i) % d;
      return slide::core::data_loss("bag " + path + ": /features row " + std::to_string(row) + " (tile " +
                                    std::to_string(row) + "), column " + std::to_string(col) + " is " +
                                    (std::isnan(rows[i]) ? "NaN" : "inf") + ": features must be finite");
    }
  }
  return slide::core::ok_status();
}

}  // namespace

Status BagReader::read_features(int64_t row_begin, int64_t row_count, std::span<float> out) const {
  const Impl& m = *impl_;
  const int64_t d = m.info.feature_dim;
  if (row_count >= 0 && out.size() != static_cast<size_t>(row_count * d)) {
    return slide::core::invalid_argument("bag " + m.info.path + ": output holds " + std::to_string(out.size()) +
                                         " values, need " + std::to_string(row_count) + " x " + std::to_string(d));
  }
  if (m.info.dtype == FeatureDtype::kFloat32) {
    SLIDE_RETURN_IF_ERROR(read_rows(m.info.path, "features", m.features.get(), m.info.num_tiles, row_begin, row_count,
                                    static_cast<hsize_t>(d), H5T_NATIVE_FLOAT, out.data()));
    return check_finite(m.info.path, row_begin, d, out);
  }
  // float16: read the bits into the upper half of `out` viewed as uint16, then widen in place from
  // the front (each float is written at or before the half it came from has been read).
  const size_t n = out.size();
  auto* bits = reinterpret_cast<uint16_t*>(out.data()) + n;  // second half of the float buffer
  SLIDE_RETURN_IF_ERROR(read_rows(m.info.path, "features", m.features.get(), m.info.num_tiles, row_begin, row_count,
                                  static_cast<hsize_t>(d), m.half_type.get(), bits));
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, bits + i, 2);
    out[i] = half_to_float(b);
  }
  return check_finite(m.info.path, row_begin, d, out);
}

Status BagReader::read_coords(int64_t row_begin, int64_t row_count, std::span<int32_t> out) const {
  const Impl& m = *impl_;
  if (row_count >= 0 && out.size() != static_cast<size_t>(row_count * 2)) {
    return slide::core::invalid_argument("bag " + m.info.path + ": output holds " + std::to_string(out.size()) +
                                         " values, need " + std::to_string(row_count) + " x 2");
  }
  return read_rows(m.info.path, "coords", m.coords.get(), m.info.num_tiles, row_begin, row_count, 2,
                   H5T_NATIVE_INT32, out.data());
}

Result<Bag> BagReader::read_all() const {
  Bag bag;
  bag.info = impl_->info;
  bag.features.resize(static_cast<size_t>(bag.info.num_tiles * bag.info.feature_dim));
  bag.coords.resize(static_cast<size_t>(bag.info.num_tiles * 2));
  SLIDE_RETURN_IF_ERROR(read_features(0, bag.info.num_tiles, bag.features));
  SLIDE_RETURN_IF_ERROR(read_coords(0, bag.info.num_tiles, bag.coords));
  return bag;
}

Result<Bag> read_bag(const std::string& path) {
  SLIDE_ASSIGN_OR_RETURN(auto reader, BagReader::open(path));
  return reader->read_all();
}

// ------------------------------------------------------------------------------------------------
// Directory listing and manifest

Result<std::vector<BagInfo>> list_bags(const std::string& dir, bool skip_bad, std::vector<Status>* skipped) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return slide::core::not_found("bag directory " + dir + " does not exist");
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 3 && name.compare(name.size() - 3, 3, ".h5") == 0 && entry.is_regular_file()) {
      files.push_back(entry.path().string());
    }
  }
  if (ec) return slide::core::internal_error("list " + dir + ": " + ec.message());
  std::sort(files.begin(), files.end());
  std::vector<BagInfo> out;
  for (const auto& f : files) {
    auto r = BagReader::open(f);
    if (!r.ok()) {
      if (!skip_bad) return r.status();
      if (skipped != nullptr) skipped->push_back(r.status());
      continue;
    }
    out.push_back((*r)->info());
  }
  return out;
}


Status write_manifest(const std::string& dir, const std::vector<BagInfo>& bags) {
  std::vector<const BagInfo*> sorted;
  for (const auto& b : bags) sorted.push_back(&b);
  std::sort(sorted.begin(), sorted.end(),
            [](const BagInfo* a, const BagInfo* b) { return a->attributes.slide_id < b->attributes.slide_id; });
  std::ostringstream os;
  os << "slide_id,file,num_tiles,feature_dim,dtype,label\n";
  for (const BagInfo* b : sorted) {
    os << slide::core::csv_quote(b->attributes.slide_id) << ','
       << slide::core::csv_quote(std::filesystem::path(b->path).filename().string())
       << ',' << b->num_tiles << ',' << b->feature_dim << ',' << feature_dtype_name(b->dtype) << ','
       << slide::core::csv_quote(b->attributes.label) << '\n';
  }
  return slide::core::write_file_atomic(dir + "/" + kManifestName, os.str());
}

Result<std::vector<ManifestEntry>> read_manifest(const std::string& path) {
  SLIDE_ASSIGN_OR_RETURN(std::string text, slide::core::read_file(path));
  const std::string dir = parent_dir(path);
  std::vector<ManifestEntry> out;
  std::istringstream is(text);
  std::string line;
  int line_no = 0;
  bool header = false;
  while (std::getline(is, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (slide::core::csv_line_is_blank(line)) continue;
    auto fields = slide::core::split_csv_line(line);
    if (!header) {
      if (fields.size() < 5 || fields[0] != "slide_id" || fields[1] != "file" || fields[2] != "num_tiles" ||
          fields[3] != "feature_dim" || fields[4] != "dtype") {
        return slide::core::data_loss(path + ":" + std::to_string(line_no) +
                                      ": header is not slide_id,file,num_tiles,feature_dim,dtype,label");
      }
      header = true;
      continue;
    }
    auto bad = [&](const std::string& what) {
      return slide::core::data_loss(path + ":" + std::to_string(line_no) + ": " + what);
    };
    if (fields.size() < 5) return bad("expected at least 5 fields, got " + std::to_string(fields.size()));
    ManifestEntry e;
    e.slide_id = fields[0];
    if (fields[1].empty()) return bad("empty file name");
    e.path = dir + "/" + fields[1];
    try {
      size_t used = 0;
      e.num_tiles = std::stoll(fields[2], &used);
      if (used != fields[2].size() || e.num_tiles < 0) return bad("num_tiles '" + fields[2] + "' is not a count");
      e.feature_dim = std::stoll(fields[3], &used);
      if (used != fields[3].size() || e.feature_dim < 1) return bad("feature_dim '" + fields[3] + "' is not a size");
    } catch (const std::exception&) {
      return bad("num_tiles '" + fields[2] + "' / feature_dim '" + fields[3] + "' are not numbers");
    }
    auto dt = parse_feature_dtype(fields[4]);
    if (!dt.ok()) return bad(dt.status().message());
    e.dtype = *dt;
    if (fields.size() > 5) e.label = fields[5];
    out.push_back(std::move(e));
  }
  if (!header) return slide::core::data_loss(path + ": empty manifest (no header)");
  return out;
}

}  // namespace slide::cache
