#include "cublas_api.h"

#include <dlfcn.h>

#include <cstring>
#include <string>
#include <type_traits>

namespace slide::train::cuda {
namespace {

#define SLIDE_CUBLAS_STR2(x) #x
#define SLIDE_CUBLAS_STR(x) SLIDE_CUBLAS_STR2(x)  // expands first: cublasCreate -> "cublasCreate_v2"

slide::core::Result<const CublasApi*> load() {
  void* lib = nullptr;
  std::string tried;
  for (const char* file : {SLIDE_CUBLAS_SONAME, SLIDE_CUBLAS_PATH}) {
    lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* why = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(why != nullptr ? why : file);
  }
  if (lib == nullptr)
    return slide::core::unavailable("cuda: cannot open cuBLAS (" + tried + "): the cuda backend needs " +
                                    SLIDE_CUBLAS_SONAME + " where the loader finds it (e.g. on LD_LIBRARY_PATH)");
  auto* api = new CublasApi;  // kept for the process's life, as the library is
  // dlsym's void* into a function pointer: memcpy, the conversion POSIX guarantees to work.
#define SLIDE_CUBLAS_RESOLVE(f, T)                                                                           \
  static_assert(std::is_same_v<decltype(static_cast<T>(&::f)), T>);                                         \
  if (void* sym = dlsym(lib, SLIDE_CUBLAS_STR(f)); sym != nullptr) {                                        \
    static_assert(sizeof(api->f) == sizeof(sym));                                                            \
    std::memcpy(&api->f, &sym, sizeof(sym));                                                                 \
  } else {                                                                                                   \
    delete api;                                                                                              \
    dlclose(lib);                                                                                            \
    return slide::core::unavailable(std::string("cuda: ") + SLIDE_CUBLAS_SONAME + " has no " +               \
                                    SLIDE_CUBLAS_STR(f) + " (another cuBLAS than the one this build was "    \
                                    "compiled against?)");                                                   \
  }
  SLIDE_CUBLAS_FUNCTIONS(SLIDE_CUBLAS_RESOLVE)
#undef SLIDE_CUBLAS_RESOLVE
  return static_cast<const CublasApi*>(api);
}

}  // namespace

slide::core::Result<const CublasApi*> cublas_api() {
  static const slide::core::Result<const CublasApi*> loaded = load();
  return loaded;
}

const char* cublas_library_name() { return SLIDE_CUBLAS_SONAME; }

}  // namespace slide::train::cuda
