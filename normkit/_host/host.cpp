// normkit's C++ host path: LayerNorm / RMSNorm / GroupNorm calls as cheap as torch's own norms.
//
// A call is: recognise the case (plain CUDA tensors, no mode or transform active, arguments this
// path knows), look its launch plan up by everything the Triton backend's host function reads
// (shapes, strides, dtypes, flags, eps, pointer alignment, device), allocate the outputs from
// torch's caching allocator, and launch the recorded kernels on the current stream (cuLaunchKernel;
// cuLaunchKernelEx with the cluster dimension for thread-block cluster kernels). When
// gradients are needed the output gets a C++ autograd node (no Python on the way), whose backward
// replays the backward's plan the same way. Plans are recorded from one run of the Python host
// functions (plans.py); a case the C++ side does not know returns None, and normkit.functional
// runs its Python path (which also raises the errors for bad arguments).
//
// Built by torch.utils.cpp_extension as a plain C++ extension: no CUDA headers. The few CUDA
// driver API entry points it needs are declared here and taken from libcuda.so.1 at run time; the
// current device and stream come from c10's device-guard interface, and the caching allocator
// from a tensor torch allocated, so the same source builds against CPU-only torch (CI).
#include <Python.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

namespace py = pybind11;
using at::Tensor;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

namespace {

// ----------------------------------------------------------------------------- CUDA driver API

namespace cu {
using Result = int;
using Function = struct CUfunc_st*;
using Stream = struct CUstream_st*;
using Context = struct CUctx_st*;
using Device = int;
Result (*launch_kernel)(Function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Stream,
                        void**, void**) = nullptr;
Result (*ctx_get_current)(Context*) = nullptr;
Result (*ctx_set_current)(Context) = nullptr;
Result (*primary_ctx_retain)(Context*, Device) = nullptr;
Result (*device_get)(Device*, int) = nullptr;
Result (*get_error_string)(Result, const char**) = nullptr;
Result (*memset_d8_async)(unsigned long long, unsigned char, size_t, Stream) = nullptr;
// cuLaunchKernelEx (CUDA 12) for cluster launches, with cuda.h's CUlaunchAttribute / CUlaunchConfig
// layouts: an id padded to 8 bytes and a 64-byte value union; optional (null: plans with clusters
// are not stored)
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    char bytes[64];
    unsigned cluster_dim[3];
    void* align;
  } value;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");
constexpr int kLaunchAttributeClusterDimension = 4;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared;
  Stream stream;
  LaunchAttribute* attrs;
  unsigned n_attrs;
};
Result (*launch_kernel_ex)(const LaunchConfig*, Function, void**, void**) = nullptr;

std::string load() {  // "" on success, else why not
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW);
  if (!h) return "libcuda.so.1 could not be opened (no NVIDIA driver)";
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    return fn != nullptr;
  };
  if (!sym(launch_kernel, "cuLaunchKernel") || !sym(ctx_get_current, "cuCtxGetCurrent") ||
      !sym(ctx_set_current, "cuCtxSetCurrent") || !sym(primary_ctx_retain, "cuDevicePrimaryCtxRetain") ||
      !sym(device_get, "cuDeviceGet") || !sym(get_error_string, "cuGetErrorString") ||
      !sym(memset_d8_async, "cuMemsetD8Async"))
    return "libcuda.so.1 lacks a driver API entry point";
  sym(launch_kernel_ex, "cuLaunchKernelEx");
  return "";
}

void check(Result r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  if (get_error_string) get_error_string(r, &msg);
  TORCH_CHECK(false, "normkit host path: ", what, " failed: CUDA error ", r, " (", msg ? msg : "?", ")");
}

Context primary_context(int index) {  // retained once per device, never released
  static std::mutex mu;
  static std::array<Context, 64> ctxs{};
  TORCH_CHECK(index >= 0 && index < 64, "normkit host path: device index ", index);
  std::lock_guard<std::mutex> g(mu);
  if (!ctxs[index]) {
    Device dev = 0;
    check(device_get(&dev, index), "cuDeviceGet");
    check(primary_ctx_retain(&ctxs[index], dev), "cuDevicePrimaryCtxRetain");
  }
  return ctxs[index];
}
}  // namespace cu

// ----------------------------------------------------------------------------- torch plumbing

// torch < 2.13 holds autograd nodes in std::shared_ptr (deleted through deleteNode), later ones in
// c10::intrusive_ptr: make ours with whichever this torch's Edge holds.
using NodePtr = decltype(torch::autograd::Edge::function);
template <class P> struct IsSharedPtr : std::false_type {};
template <class T> struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

template <class N> NodePtr make_node() {
  if constexpr (IsSharedPtr<NodePtr>::value) {
    return NodePtr(new N(), [](N* n) { deleteNode(n); });  // found by ADL in torch::autograd
  } else {
    return c10::make_intrusive<N>();
  }
}

PyTypeObject* tensor_type = nullptr;
PyTypeObject* parameter_type = nullptr;
c10::DispatchKeySet bad_tensor_keys;  // wrappers, lazy conjugates, functorch/Python tensors
c10::DispatchKeySet bad_tls_keys;     // a functorch transform or Python dispatcher is active
c10::Allocator* cuda_allocator = nullptr;
const c10::DispatchKeySet cuda_keys(c10::DispatchKey::CUDA);

bool plain_tensor(PyObject* o) { return Py_TYPE(o) == tensor_type || Py_TYPE(o) == parameter_type; }

bool dtype_ok(at::ScalarType s) {
  return s == at::kHalf || s == at::kBFloat16 || s == at::kFloat;
}

bool tensor_ok(const Tensor& t, c10::Device dev) {
  if (t.device() != dev || t.layout() != c10::kStrided || !dtype_ok(t.scalar_type())) return false;
  if (t.key_set().has_any(bad_tensor_keys)) return false;
  return !(t.unsafeGetTensorImpl()->autograd_meta() && t._fw_grad(0).defined());  // forward-AD dual
}

bool modes_ok() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  if (at::impl::PythonTorchFunctionTLS::stack_len() > 0) return false;
  return !c10::impl::tls_local_dispatch_key_set().included_.has_any(bad_tls_keys);
}

// Under CUDA autocast torch runs the norms in float32: with every tensor already float32 there is
// nothing to cast and the kernels give what torch's contract asks; otherwise Python casts first.
bool autocast_ok(const Tensor& x, const Tensor& w, const Tensor& b) {
  if (!at::autocast::is_autocast_enabled(at::kCUDA)) return true;
  for (const Tensor* t : {&x, &w, &b})
    if (t->defined() && t->scalar_type() != at::kFloat) return false;
  return true;
}

bool functorch_active() {
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

bool aligned(const Tensor& t) {
  return !t.defined() || (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

Tensor alloc(c10::IntArrayRef sizes, at::ScalarType dtype) {
  return at::detail::empty_generic(sizes, cuda_allocator, cuda_keys, dtype, std::nullopt);
}

Tensor alloc_strided(c10::IntArrayRef sizes, c10::IntArrayRef strides, at::ScalarType dtype) {
  return at::detail::empty_strided_generic(sizes, strides, cuda_allocator, cuda_keys, dtype);
}

// The current device switched to `dev` for the scope (only if it differs).
struct DeviceScope {
  const c10::impl::DeviceGuardImplInterface* impl;
  c10::Device prev;
  bool switched;
  explicit DeviceScope(c10::Device dev)
      : impl(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)), prev(impl->getDevice()), switched(prev != dev) {
    if (switched) impl->setDevice(dev);
  }
  ~DeviceScope() {
    if (switched) impl->uncheckedSetDevice(prev);
  }
  cu::Stream stream(c10::Device dev) const {
    return static_cast<cu::Stream>(impl->getStream(dev).native_handle());
  }
};

// ----------------------------------------------------------------------------- plans

constexpr int kMaxSlots = 64;
constexpr int kMaxParams = 64;
constexpr size_t kMaxParamBytes = 1024;
constexpr size_t kMaxPlans = 4096;  // then the cache starts over
constexpr int kMaxRecordFailures = 3;

struct Patch {
  uint32_t offset, slot;
  int64_t byte_offset;
  bool aligned16;  // the kernel was specialized on this pointer being 16-byte aligned
};
struct LaunchSpec {
  cu::Function fn;
  unsigned grid[3], block, shared;
  // CTAs per thread-block cluster; {0, 0, 0}: a plain launch. A cluster of one CTA is launched as a cluster
  // (cuLaunchKernelEx): the kernel's cluster instructions are illegal in a plain launch.
  unsigned cluster[3] = {0, 0, 0};
  bool clustered() const { return cluster[0] > 0; }
  std::vector<uint8_t> params;
  std::vector<uint32_t> offsets;
  std::vector<Patch> patches;
};
struct AllocSpec {
  int role;  // 0: temporary in the recorded layout; 1-7: the op's outputs, allocated by the op
  at::ScalarType dtype;
  std::vector<int64_t> sizes, strides;
  bool zero = false;  // the run allocated it zeroed (torch.zeros: the amax a kernel accumulates into)
};
constexpr int kMaxOuts = 8;  // outs[1..7]: the roles of an op's outputs
struct Plan {
  int n_inputs = 0;
  cu::Context ctx = nullptr;
  std::vector<AllocSpec> allocs;
  std::vector<Tensor> persistent;  // backend state the kernels use across calls (kept alive here)
  std::vector<LaunchSpec> launches;
};
using PlanPtr = std::shared_ptr<const Plan>;

struct Key {
  std::array<int64_t, 192> v;  // only v[0..n) is read: left uninitialized (a key is made per call)
  int n = 0;
  void add(int64_t a) {
    TORCH_INTERNAL_ASSERT(n < 192);
    v[n++] = a;
  }
  void add_double(double d) {
    int64_t bits;
    std::memcpy(&bits, &d, 8);
    add(bits);
  }
  bool operator==(const Key& o) const { return n == o.n && std::memcmp(v.data(), o.v.data(), 8 * n) == 0; }
  std::vector<int64_t> list() const { return std::vector<int64_t>(v.begin(), v.begin() + n); }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < k.n; i++) h = (h ^ static_cast<uint64_t>(k.v[i])) * 1099511628211ull;
    return h ^ (h >> 31);
  }
};

// A key's first call runs the Python host function as it is (compiling kernels, creating backend
// state); its second records that function's run as the plan; later calls replay. A run that
// cannot be replayed is recorded again at most kMaxRecordFailures times, then the key stays Python.
struct Entry {
  PlanPtr plan;
  int failures = 0;
};
enum class Action { kReplay, kPython, kRecord };

std::mutex cache_mu;
std::unordered_map<Key, Entry, KeyHash> cache;
std::string last_failure;
std::atomic<uint64_t> n_replays{0}, n_python{0}, n_records{0}, n_failures{0}, n_vjp{0}, n_misaligned{0};

Action lookup(const Key& key, PlanPtr& plan) {
  std::lock_guard<std::mutex> g(cache_mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxPlans) cache.clear();
    cache.emplace(key, Entry{});
    return Action::kPython;
  }
  if (it->second.plan) {
    plan = it->second.plan;
    return Action::kReplay;
  }
  return it->second.failures >= kMaxRecordFailures ? Action::kPython : Action::kRecord;
}

template <class T> T item(py::handle seq, size_t i) { return py::cast<T>(seq[py::int_(i)]); }

// Plan data from plans.build_plan -> Plan (GIL held).
PlanPtr to_plan(py::handle data, int n_inputs, int device) {
  auto plan = std::make_shared<Plan>();
  plan->n_inputs = n_inputs;
  plan->ctx = cu::primary_context(device);
  py::tuple allocs = data[py::int_(0)], persistent = data[py::int_(1)], launches = data[py::int_(2)];
  for (auto a : allocs) {
    AllocSpec s;
    s.role = item<int>(a, 0);
    s.dtype = reinterpret_cast<THPDtype*>(a[py::int_(1)].ptr())->scalar_type;
    s.sizes = item<std::vector<int64_t>>(a, 2);
    s.strides = item<std::vector<int64_t>>(a, 3);
    s.zero = py::len(a) > 4 && item<bool>(a, 4);
    plan->allocs.push_back(std::move(s));
  }
  for (auto t : persistent) plan->persistent.push_back(THPVariable_Unpack(t.ptr()));
  const size_t slots = n_inputs + plan->allocs.size() + plan->persistent.size();
  TORCH_CHECK(slots <= kMaxSlots, "normkit host path: plan with ", slots, " buffers");
  for (auto l : launches) {
    LaunchSpec s;
    s.fn = reinterpret_cast<cu::Function>(static_cast<uintptr_t>(item<uint64_t>(l, 0)));
    for (int i = 0; i < 3; i++) s.grid[i] = item<unsigned>(l, 1 + i);
    s.block = item<unsigned>(l, 4);
    s.shared = item<unsigned>(l, 5);
    std::string bytes = item<py::bytes>(l, 6);
    s.params.assign(bytes.begin(), bytes.end());
    for (auto o : py::tuple(l[py::int_(7)])) s.offsets.push_back(py::cast<uint32_t>(o));
    for (auto p : py::tuple(l[py::int_(8)])) {
      Patch q{item<uint32_t>(p, 0), item<uint32_t>(p, 1), item<int64_t>(p, 2), item<bool>(p, 3)};
      TORCH_CHECK(q.slot < slots && q.offset + 8 <= s.params.size(), "normkit host path: bad plan patch");
      s.patches.push_back(q);
    }
    TORCH_CHECK(s.params.size() <= kMaxParamBytes && s.offsets.size() <= kMaxParams,
                "normkit host path: plan with too many kernel parameters");
    for (auto o : s.offsets) TORCH_CHECK(o < s.params.size(), "normkit host path: bad plan offset");
    for (int i = 0; i < 3; i++) s.cluster[i] = item<unsigned>(l[py::int_(9)], i);
    for (int i = 0; i < 3; i++)
      TORCH_CHECK(s.clustered() ? s.cluster[i] >= 1 && s.grid[i] % s.cluster[i] == 0 : s.cluster[i] == 0,
                  "normkit host path: bad plan cluster");
    plan->launches.push_back(std::move(s));
  }
  return plan;
}

void store(const Key& key, py::handle plan_data, py::handle why, int n_inputs, int device) {
  PlanPtr plan;
  py::object why_not = py::reinterpret_borrow<py::object>(why);
  if (!plan_data.is_none()) plan = to_plan(plan_data, n_inputs, device);
  if (plan && !cu::launch_kernel_ex)
    for (const auto& l : plan->launches)
      if (l.clustered()) {
        plan = nullptr;
        why_not = py::str("the plan launches clusters and the driver lacks cuLaunchKernelEx");
        break;
      }
  std::lock_guard<std::mutex> g(cache_mu);
  Entry& e = cache[key];
  if (plan) {
    e.plan = std::move(plan);
    n_records++;
  } else if (!why_not.is_none()) {  // None and None: the recorder was busy in another thread; try later
    e.failures++;
    n_failures++;
    last_failure = py::cast<std::string>(why_not);
  }
}

// Replays `plan` with the call's input pointers; `make(role, spec)` allocates the op's outputs.
// Returns false, launching nothing, if a buffer's alignment is not what the kernels assume.
template <class Make>
bool replay(const Plan& plan, const Tensor* inputs, c10::Device dev, Make&& make, Tensor (&outs)[kMaxOuts]) {
  DeviceScope scope(dev);
  cu::Context cur = nullptr;
  cu::check(cu::ctx_get_current(&cur), "cuCtxGetCurrent");
  if (cur != plan.ctx) cu::check(cu::ctx_set_current(plan.ctx), "cuCtxSetCurrent");  // e.g. a fresh thread
  uint64_t ptrs[kMaxSlots];
  int s = 0;
  for (; s < plan.n_inputs; s++) ptrs[s] = inputs[s].defined() ? reinterpret_cast<uint64_t>(inputs[s].data_ptr()) : 0;
  c10::SmallVector<Tensor, 8> temps;
  c10::SmallVector<std::pair<uint64_t, size_t>, 2> zeroed;
  for (const auto& a : plan.allocs) {
    Tensor t = a.role ? make(a.role, a) : alloc_strided(a.sizes, a.strides, a.dtype);
    ptrs[s++] = reinterpret_cast<uint64_t>(t.data_ptr());
    if (a.zero && t.nbytes()) zeroed.emplace_back(ptrs[s - 1], t.nbytes());
    if (a.role) {
      outs[a.role] = std::move(t);
    } else {
      temps.push_back(std::move(t));
    }
  }
  for (const auto& t : plan.persistent) ptrs[s++] = reinterpret_cast<uint64_t>(t.data_ptr());
  for (const auto& l : plan.launches)
    for (const auto& p : l.patches)
      if (p.aligned16 && ((ptrs[p.slot] + p.byte_offset) & 15)) {
        n_misaligned++;
        return false;
      }
  cu::Stream stream = scope.stream(dev);
  for (const auto& z : zeroed) cu::check(cu::memset_d8_async(z.first, 0, z.second, stream), "cuMemsetD8Async");
  for (const auto& l : plan.launches) {
    alignas(16) uint8_t buf[kMaxParamBytes];
    std::memcpy(buf, l.params.data(), l.params.size());
    for (const auto& p : l.patches) {
      uint64_t v = ptrs[p.slot] + p.byte_offset;
      std::memcpy(buf + p.offset, &v, 8);
    }
    void* params[kMaxParams];
    for (size_t i = 0; i < l.offsets.size(); i++) params[i] = buf + l.offsets[i];
    if (l.clustered()) {
      cu::LaunchAttribute attr{};
      attr.id = cu::kLaunchAttributeClusterDimension;
      std::memcpy(attr.value.cluster_dim, l.cluster, sizeof l.cluster);
      const cu::LaunchConfig config{l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared, stream, &attr, 1};
      cu::check(cu::launch_kernel_ex(&config, l.fn, params, nullptr), "cuLaunchKernelEx");
    } else {
      cu::check(cu::launch_kernel(l.fn, l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared, stream, params,
                                  nullptr),
                "cuLaunchKernel");
    }
  }
  n_replays++;
  return true;
}

// ----------------------------------------------------------------------------- Python callbacks

struct Callbacks {
  py::object row_fwd, row_bwd, gn_fwd, gn_bwd, row_vjp, gn_vjp;
};
Callbacks* callbacks = nullptr;   // set by _init, never freed (lives as long as the process)
// Tests without a GPU: row calls on CPU tensors take the eager entry and the autograd node too, each
// running the Python host functions (never a plan). Off outside those tests (_serve_cpu_calls).
bool cpu_calls = false;
PyObject* act_names[8] = {};      // activation code -> name (code 0: None)
int n_acts = 0;
PyObject* triton_name = nullptr;

py::object wrap(const Tensor& t) {
  if (!t.defined()) return py::none();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

Tensor unwrap(py::handle o) { return o.is_none() ? Tensor() : THPVariable_Unpack(o.ptr()); }

py::handle act_name(int act) { return act ? py::handle(act_names[act]) : py::handle(Py_None); }

int activation_code(PyObject* a) {
  if (a == Py_None) return 0;
  if (!PyUnicode_CheckExact(a)) return -1;
  for (int i = 1; i <= n_acts; i++)
    if (a == act_names[i] || PyUnicode_Compare(a, act_names[i]) == 0) return i;
  if (PyErr_Occurred()) PyErr_Clear();
  return -1;
}

// ----------------------------------------------------------------------------- layouts

// An [M, N] view of t's last k dims with unit column stride (what the kernels read), or false when
// none exists: the Python path then copies. row_stride is the stride between rows (N if M <= 1).
bool rows_view(const Tensor& t, int64_t k, int64_t& M, int64_t& N, int64_t& row_stride) {
  const auto sz = t.sizes();
  const auto st = t.strides();
  const int64_t d = static_cast<int64_t>(sz.size());
  M = 1;
  N = 1;
  for (int64_t i = 0; i < d - k; i++) M *= sz[i];
  for (int64_t i = d - k; i < d; i++) N *= sz[i];
  if (N > 1) {
    int64_t expect = 1;
    for (int64_t i = d - 1; i >= d - k; i--) {
      if (sz[i] == 1) continue;
      if (st[i] != expect) return false;
      expect *= sz[i];
    }
  }
  row_stride = N;
  if (M > 1) {
    bool first = true;
    int64_t expect = 0;
    for (int64_t i = d - k - 1; i >= 0; i--) {
      if (sz[i] == 1) continue;
      if (first) {
        row_stride = st[i];
        first = false;
      } else if (st[i] != expect) {
        return false;
      }
      expect = st[i] * sz[i];
    }
  }
  return true;
}

// GroupNorm layouts: 0 NCHW (contiguous), 1 channels_last (channels innermost, dense), -1 neither.
int gn_layout(const Tensor& x) {
  if (x.is_contiguous()) return 0;
  const int64_t d = x.dim();
  if (d < 3 || x.size(1) == 1) return -1;
  int64_t expect = 1;
  auto dense = [&](int64_t i) {
    if (x.size(i) == 1) return true;
    if (x.stride(i) != expect) return false;
    expect *= x.size(i);
    return true;
  };
  if (!dense(1)) return -1;
  for (int64_t i = d - 1; i >= 2; i--)
    if (!dense(i)) return -1;
  return dense(0) ? 1 : -1;
}

// A fresh tensor of x's sizes in GroupNorm layout `layout`, strides as the Python path makes them.
Tensor alloc_like(const Tensor& x, int layout, at::ScalarType dtype) {
  if (layout == 0) return alloc(x.sizes(), dtype);
  const int64_t d = x.dim();
  std::vector<int64_t> strides(d);
  int64_t expect = x.size(1);
  strides[1] = 1;
  for (int64_t i = d - 1; i >= 2; i--) {
    strides[i] = expect;
    expect *= x.size(i);
  }
  strides[0] = expect;
  return alloc_strided(x.sizes(), strides, dtype);
}

bool read_real(PyObject* o, double& v) {  // an exact float or int (not a bool), finite
  if (PyFloat_CheckExact(o)) {
    v = PyFloat_AS_DOUBLE(o);
  } else if (PyLong_CheckExact(o)) {
    v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  return std::isfinite(v);
}

bool read_eps(PyObject* o, double& eps) { return read_real(o, eps) && eps >= 0.0; }

// normalized_shape as the user passed it: an int or a tuple/list of ints; false otherwise.
bool read_shape(PyObject* o, int64_t* dims, int64_t& k) {
  if (PyLong_CheckExact(o)) {
    k = 1;
    dims[0] = PyLong_AsLongLong(o);
  } else if (PyTuple_Check(o) || PyList_Check(o)) {
    k = PySequence_Fast_GET_SIZE(o);
    if (k < 1 || k > 16) return false;
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (int64_t i = 0; i < k; i++) {
      if (!PyLong_CheckExact(items[i])) return false;
      dims[i] = PyLong_AsLongLong(items[i]);
    }
  } else {
    return false;
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool needs_grad(const Tensor& x, const Tensor& w, const Tensor& b) {
  return c10::GradMode::is_enabled() &&
         (x.requires_grad() || (w.defined() && w.requires_grad()) || (b.defined() && b.requires_grad()));
}

int64_t dtype_code(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1; }

// ----------------------------------------------------------------------------- ops, shared

bool backend_ok(PyObject* o) {
  if (o == Py_None) return true;
  if (!PyUnicode_CheckExact(o)) return false;
  if (o == triton_name) return true;
  const int cmp = PyUnicode_Compare(o, triton_name);
  if (PyErr_Occurred()) PyErr_Clear();
  return cmp == 0;
}

// Which of a plan's inputs share a pointer (weight and bias the same tensor, dy and dh the same
// gradient, ...): for each input, 1 + the first earlier one with its pointer, or 0, as base-16 digits.
// A plan takes an aliased input's pointer from the first input that has it (plans.pointer_slot), so
// calls alias alike exactly when their keys do. At most 15 inputs.
int64_t alias_code(const Tensor* t, int n) {
  int64_t code = 0;
  for (int i = 0; i < n; i++) {
    int64_t digit = 0;
    const void* p = t[i].defined() ? t[i].data_ptr() : nullptr;
    for (int j = 0; p && j < i && !digit; j++)
      if (t[j].defined() && t[j].data_ptr() == p) digit = j + 1;
    code = code * 16 + digit;
  }
  return code;
}

bool plain_args(PyObject* x, PyObject* w, PyObject* b) {
  return plain_tensor(x) && (w == Py_None || plain_tensor(w)) && (b == Py_None || plain_tensor(b));
}

bool param_ok(const Tensor& p, c10::Device dev, c10::IntArrayRef shape) {
  return !p.defined() || (tensor_ok(p, dev) && p.sizes() == shape && p.is_contiguous());
}

// One call of an op through its plan: replay it, or run the Python host function (`python(record)`
// -> (out1, ..., out_n, plan, why)), recording it when the key is due. outs[1..n]: the op's outputs.
template <class Make, class Python>
void run(const Key& key, const Tensor* inputs, int n_inputs, c10::Device dev, Make&& make, Python&& python,
         Tensor (&outs)[kMaxOuts], int n_out = 3) {
  PlanPtr plan;
  Action action = dev.is_cuda() ? lookup(key, plan) : Action::kPython;  // CPU: the tests' cpu_calls, no plans
  if (action == Action::kReplay && replay(*plan, inputs, dev, make, outs)) return;
  const bool record = action == Action::kRecord;
  n_python++;
  py::gil_scoped_acquire gil;  // held already in a forward; the backward runs on autograd's thread
  py::tuple r = python(record);
  for (int i = 0; i < n_out; i++) outs[i + 1] = unwrap(r[i]);
  if (record) store(key, r[n_out], r[n_out + 1], n_inputs, dev.index());
}

// The backward node of either op: its saved tensors and the differentiable fallback.
struct NormBackward : public Node {
  SavedVariable x_, w_, b_, mean_, rstd_;
  double eps_ = 0;
  int act_ = 0;

  void release_variables() override {
    x_.reset_data();
    w_.reset_data();
    b_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
  }
  // A backward that is itself differentiated (create_graph) or transformed: torch ops, in Python.
  bool differentiable(const Tensor& dy) const {
    return c10::GradMode::is_enabled() || functorch_active() || !tensor_ok(dy, dy.device());
  }
  // python(needs) -> the gradients in the order of `need` (GroupNorm: dx, dw, db; rows: dx, dres, dw, db
  // mapped by `order`: out[order[i]] = r[i])
  template <size_t K, class Python>
  variable_list differentiable_grads(const bool (&need)[K], Python&& python, const int* order = nullptr) {
    n_vjp++;
    variable_list out(K);
    py::gil_scoped_acquire gil;
    py::tuple needs(K);
    for (size_t i = 0; i < K; i++) needs[i] = py::bool_(need[i]);
    py::tuple r = python(needs);
    for (size_t i = 0; i < K; i++) {
      out[order ? order[i] : i] = need[i] ? unwrap(r[i]) : Tensor();
    }
    return out;
  }
};

// The output y gets a node of type N saving what its backward needs.
template <class N>
N* attach(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& mean, const Tensor& rstd,
          double eps, int act) {
  auto node = make_node<N>();
  auto* n = static_cast<N*>(node.get());
  n->set_next_edges(torch::autograd::collect_next_edges(x, w, b));
  n->x_ = SavedVariable(x, false);
  n->w_ = SavedVariable(w, false);
  n->b_ = SavedVariable(b, false);
  n->mean_ = SavedVariable(mean, false);
  n->rstd_ = SavedVariable(rstd, false);
  n->eps_ = eps;
  n->act_ = act;
  torch::autograd::set_history(y, node);
  return n;
}

int64_t bwd_align(const Tensor* t) {  // dy, x, w, b (with an activation), mean, rstd
  return aligned(t[0]) | aligned(t[1]) << 1 | aligned(t[2]) << 2 | aligned(t[3]) << 3 | aligned(t[4]) << 4 |
         aligned(t[5]) << 5;
}

// ----------------------------------------------------------------------------- LayerNorm / RMSNorm

bool upcasts[2] = {true, false};  // torch's CUDA autocast runs layer_norm / rms_norm in float32 (set by _setup)

// Mirror of normkit._layout.row_view(t, shape, strided=True, lead): 0 where the rows of t (its last k
// dims a row) need a copy, else the number of leading dims of the view the kernels get (1: [M, N],
// 2: [O, I, N], `inner` = I). force_n / force_inner: the leading sizes of another operand's view,
// which t must be walked with (the residual, dy and dh with x's rows).
int row_view_dims(const Tensor& t, int64_t k, int64_t& inner, int force_n = 0, int64_t force_inner = 0) {
  const int64_t d = t.dim();
  inner = 1;
  if (k == 1 && d == 2 && !force_n) return 1;
  if (d > 16) return 0;
  std::pair<int64_t, int64_t> rows[16], cols[16];  // (size, stride), outermost first, size-1 dims dropped
  auto merge = [&](int64_t lo, int64_t hi, std::pair<int64_t, int64_t>* out) {
    int n = 0;
    for (int64_t i = lo; i < hi; i++) {
      const int64_t size = t.size(i), stride = t.stride(i);
      if (size == 1) continue;
      if (n && out[n - 1].second == stride * size) {
        out[n - 1] = {out[n - 1].first * size, stride};
      } else {
        out[n++] = {size, stride};
      }
    }
    return n;
  };
  const int nr = merge(0, d - k, rows), nc = merge(d - k, d, cols);
  if (nc > 1) return 0;
  const int want = force_n ? force_n : (nr <= 1 ? 1 : nr);
  if (want == 1) return nr <= 1 ? 1 : 0;
  if (want == 2) {
    if (nr <= 1) {
      inner = force_inner;
      return 2;
    }
    if (nr == 2 && (!force_n || rows[1].first == force_inner)) {
      inner = rows[1].first;
      return 2;
    }
  }
  return 0;
}

// Adds how t's rows reach the kernels to `key`: (0, M, N, row stride) for one row stride and
// contiguous columns (the common case: shapes with the same rows share it), else t's sizes and
// strides, of which the view the Python path makes (row_view) is a function. n, inner: that view's
// leading dims. False where the rows need a copy (the Python path's case).
bool add_layout(Key& key, const Tensor& t, int64_t k, int& n, int64_t& inner, int force_n = 0,
                int64_t force_inner = 0) {
  int64_t M, N, rs;
  if (force_n <= 1 && rows_view(t, k, M, N, rs)) {
    for (int64_t v : {int64_t(0), M, N, rs}) key.add(v);
    n = 1;
    inner = 1;
    return true;
  }
  n = row_view_dims(t, k, inner, force_n, force_inner);
  if (!n || t.dim() > 8) return false;
  key.add(n);
  key.add(t.dim());
  for (int64_t v : t.sizes()) key.add(v);
  for (int64_t v : t.strides()) key.add(v);
  return true;
}

bool read_bool(PyObject* o, bool& v) {
  if (o != Py_True && o != Py_False) return false;
  v = o == Py_True;
  return true;
}

// None (-> `none`), or a torch.dtype among `allowed`
bool read_dtype(PyObject* o, std::initializer_list<at::ScalarType> allowed, std::optional<at::ScalarType>& d) {
  d.reset();
  if (o == Py_None) return true;
  if (!THPDtype_Check(o)) return false;
  const at::ScalarType s = reinterpret_cast<THPDtype*>(o)->scalar_type;
  for (auto a : allowed)
    if (a == s) {
      d = s;
      return true;
    }
  return false;
}

bool is_fp8(at::ScalarType s) { return s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2; }

int64_t opt_code(const std::optional<at::ScalarType>& d) { return d ? static_cast<int64_t>(*d) : -1; }

// The node's edges and outputs: x, weight, bias, residual, then, for a call with the adaLN modulation
// or a gate (and only then: a plain call's node has the first 4), mod_scale, mod_shift, gate.
constexpr int kRowEdges = 4, kRowEdgesExtra = 7;

struct RowNormBackward : public NormBackward {
  SavedVariable ms_, mt_, g_;  // the modulation tables and the gate (undefined where absent)
  int64_t ndim_ = 1;
  bool rms_ = false, prenorm_ = false;
  double weight_offset_ = 0;
  at::ScalarType x_dtype_ = at::kFloat;
  std::optional<at::ScalarType> r_dtype_;  // the residual's dtype (set with a residual)
  std::string name() const override { return "NormkitRowNormBackward"; }
  void release_variables() override {
    NormBackward::release_variables();
    ms_.reset_data();
    mt_.reset_data();
    g_.reset_data();
  }
  variable_list apply(variable_list&& grads) override;
};

// A LayerNorm/RMSNorm call as this path reads it: normkit.functional's arguments, the fused options
// resolved as _check_fusion / _autocast_rows resolve them.
struct RowCall {
  Tensor x, w, b, r, scale;  // r: the residual; scale: a tensor out_scale
  Tensor ms, mt, g;          // the adaLN modulation tables (scale=, shift=) and the gate (gate=)
  bool extra = false;        // any of ms, mt, g: their plans have 8 inputs, their nodes 7 edges
  int64_t ndim = 1, w_rows = 1;
  double eps = 0, weight_offset = 0, scale_value = 0;  // scale_value: a float out_scale (float8 only)
  bool rms = false, prenorm = false, amax = false, float_scale = false;
  int act = 0;
  std::optional<at::ScalarType> out_dtype, h_dtype;  // out_dtype: unset when it is x's dtype
  Key layout;                                        // x's rows, then the residual's
  int lead_n = 1;
  int64_t inner = 1;
};

// A weight/bias the kernels take in place: (shape) -> 1, (heads, *shape) -> heads, 0: not this path's
// case (wrong shape, strided: the Python path copies or raises), -1: None.
int64_t param_rows_of(const Tensor& p, c10::Device dev, c10::IntArrayRef shape, int64_t heads) {
  if (!p.defined()) return -1;
  if (!tensor_ok(p, dev) || !p.is_contiguous()) return 0;
  if (p.sizes() == shape) return 1;
  if (heads > 0 && p.dim() == static_cast<int64_t>(shape.size()) + 1 && p.size(0) == heads &&
      p.sizes().slice(1) == shape)
    return heads;
  return 0;
}

// A modulation table or a gate: a floating tensor on x's device, plain (as tensor_ok); float64 too,
// which the Python path takes for them (any float dtype) with x of another dtype.
bool aux_ok(const Tensor& t, c10::Device dev) {
  if (t.device() != dev || t.layout() != c10::kStrided) return false;
  const at::ScalarType s = t.scalar_type();
  if (!dtype_ok(s) && s != at::kDouble) return false;
  if (t.key_set().has_any(bad_tensor_keys)) return false;
  return !(t.unsafeGetTensorImpl()->autograd_meta() && t._fw_grad(0).defined());
}

// Mirror of normkit._layout.sample_rows: (S, rows per sample) of a modulation table t (lead + the k
// normalized dims) applied per sample to x, or false where its lead is not a prefix of x's leading
// dims followed by ones.
bool sample_rows(const Tensor& t, const Tensor& x, int64_t k, int64_t& S, int64_t& per) {
  const int64_t tl = t.dim() - k, xl = x.dim() - k;
  if (tl > xl) return false;
  int64_t last = -1;
  for (int64_t i = 0; i < tl; i++)
    if (t.size(i) != 1) last = i;
  S = per = 1;
  for (int64_t i = 0; i <= last; i++) {
    if (t.size(i) != x.size(i)) return false;
    S *= x.size(i);
  }
  for (int64_t i = last + 1; i < xl; i++) per *= x.size(i);
  return true;
}

// Adds a modulation table to `key` (dtype, alignment, sizes, strides: the kernels get its row stride
// and, through x's rows per sample, its row count), or false where the Python path would raise or
// copy it (normkit._layout.mod_table reads [S, N] views with unit column stride in place).
bool add_table(Key& key, const Tensor& t, const RowCall& c, c10::IntArrayRef shape, int64_t& S, int64_t& per) {
  const int64_t k = c.ndim;
  if (!aux_ok(t, c.x.device()) || t.dim() < k || t.dim() > 8 || t.sizes().slice(t.dim() - k) != shape ||
      !sample_rows(t, c.x, k, S, per))
    return false;
  int64_t M, N, rs;
  if (!rows_view(t, k, M, N, rs)) return false;
  key.add(dtype_code(t));
  key.add(aligned(t));
  key.add(t.dim());
  for (int64_t v : t.sizes()) key.add(v);
  for (int64_t v : t.strides()) key.add(v);
  return true;
}

// The adaLN modulation (normkit.functional._check_modulation) and the gate (_check_gate) of a call:
// false where the Python path raises (it says why) or copies. Their layouts go into c.layout.
bool finish_extra(RowCall& c, c10::IntArrayRef shape) {
  const c10::Device dev = c.x.device();
  if (c.g.defined()) {
    if (c.ms.defined() || c.mt.defined() || c.r.defined() || !aux_ok(c.g, dev) || c.g.sizes() != c.x.sizes())
      return false;
    int n_g = 0;
    int64_t inner_g = 0;
    c.layout.add(-2);  // a gate's rows follow
    return add_layout(c.layout, c.g, c.ndim, n_g, inner_g, c.lead_n, c.inner);
  }
  if ((c.w.defined() && c.w.dim() > c.ndim) || (c.b.defined() && c.b.dim() > c.ndim)) return false;  // per head
  int64_t S[2] = {-1, -1}, per[2] = {-1, -1};
  c.layout.add(-3);  // the modulation tables follow
  for (int i = 0; i < 2; i++) {
    const Tensor& t = i ? c.mt : c.ms;
    c.layout.add(t.defined());
    if (t.defined() && !add_table(c.layout, t, c, shape, S[i], per[i])) return false;
  }
  return !(c.ms.defined() && c.mt.defined() && (S[0] != S[1] || per[0] != per[1]));
}

// The part of reading a row call that both entry points share, the eager one (parse_row) and the
// dispatcher's (parse_row_op): c's tensors (x, w, b, r, scale: undefined where absent), scalars and
// options are read; checks the options together and the tensors, and resolves the rest of c.
// dims: normalized_shape. autocast: apply torch's autocast contract (the public functions do; the
// ops do not: under torch.compile the graph has applied it). r_dtype: the residual_dtype asked for.
bool finish_row(RowCall& c, const int64_t* dims, bool autocast, const std::optional<at::ScalarType>& r_dtype) {
  if ((c.prenorm || r_dtype) && !c.r.defined()) return false;  // errors: Python raises them
  if (c.weight_offset != 0 && !c.w.defined()) return false;
  const bool fp8 = c.out_dtype && is_fp8(*c.out_dtype);
  if (fp8 != (c.scale.defined() || c.float_scale)) return false;  // float8 needs a scale, a scale needs float8
  if (!modes_ok() || functorch_active()) return false;
  const c10::Device dev = c.x.device();
  const int64_t d = c.x.dim();
  if (c.ndim < 1 || c.ndim > d || !tensor_ok(c.x, dev)) return false;
  const c10::IntArrayRef shape(dims, c.ndim);
  if (c.x.sizes().slice(d - c.ndim) != shape) return false;
  if (c.r.defined()) {
    if (!tensor_ok(c.r, dev) || c.r.sizes() != c.x.sizes()) return false;
    c.h_dtype = r_dtype ? *r_dtype : c.r.scalar_type();
  }
  if (c.scale.defined()) {
    if (!tensor_ok(c.scale, dev) || c.scale.numel() != 1 || (c.scale.requires_grad() && c10::GradMode::is_enabled()))
      return false;
    c.scale_value = 0;
  }
  const int64_t heads = d > c.ndim + 1 ? c.x.size(d - c.ndim - 1) : 0;
  const int64_t wr = param_rows_of(c.w, dev, shape, heads), br = param_rows_of(c.b, dev, shape, heads);
  if (wr == 0 || br == 0 || (wr > 0 && br > 0 && (wr == 1) != (br == 1))) return false;  // mixed: Python expands
  c.w_rows = std::max<int64_t>({wr, br, int64_t(1)});
  if (c.out_dtype == c.x.scalar_type()) c.out_dtype.reset();
  if (autocast && at::autocast::is_autocast_enabled(at::kCUDA) && upcasts[c.rms] &&
      c.x.scalar_type() != at::kFloat && !c.out_dtype)
    c.out_dtype = at::kFloat;  // torch's contract: float32 out, computed in one pass from x (_autocast_rows)
  if (!add_layout(c.layout, c.x, c.ndim, c.lead_n, c.inner)) return false;
  if (c.r.defined()) {
    int n_r = 0;
    int64_t inner_r = 0;
    if (!add_layout(c.layout, c.r, c.ndim, n_r, inner_r, c.lead_n, c.inner)) return false;
  }
  c.extra = c.ms.defined() || c.mt.defined() || c.g.defined();
  return !c.extra || finish_extra(c, shape);
}

// Sets each field (name, where its position goes) to its name's position in `names` (-1: not there);
// returns the positions of the names no field has.
template <size_t K>
std::vector<int> positions(py::sequence names, const std::pair<const char*, int*> (&fields)[K]) {
  for (const auto& f : fields) *f.second = -1;
  std::vector<int> unread;
  const int n = static_cast<int>(py::len(names));
  for (int i = 0; i < n; i++) {
    const std::string name = py::cast<std::string>(names[i]);
    bool known = false;
    for (const auto& f : fields)
      if (name == f.first) *f.second = i, known = true;
    if (!known) unread.push_back(i);
  }
  return unread;
}

// The positions of the eager entry's arguments, from normkit._op_args.HOST_ROW (the order in which
// functional._via_host passes them), handed over once by _setup: a call passes the first `plain` of
// them, the first `fused`, or all `all`. Every name there must be one this file reads (else _setup
// fails, and the Python path serves every call: an option the plans do not know is never dropped).
struct HostRowArgs {
  int x, shape, weight, bias, eps, rms, activation, backend, residual, prenorm, residual_dtype, weight_offset,
      out_dtype, out_scale, return_amax, autocast, mod_scale, mod_shift, gate;
  Py_ssize_t plain, fused, all;
};
HostRowArgs host_args{};

void set_host_row_args(py::sequence names, py::tuple lengths) {
  HostRowArgs h{};
  // by tier: the plain call's arguments, the fused options, then the modulation and the gate
  const std::pair<const char*, int*> fields[] = {
      {"x", &h.x}, {"normalized_shape", &h.shape}, {"weight", &h.weight}, {"bias", &h.bias}, {"eps", &h.eps},
      {"rms", &h.rms}, {"activation", &h.activation}, {"backend", &h.backend}, {"residual", &h.residual},
      {"prenorm", &h.prenorm}, {"residual_dtype", &h.residual_dtype}, {"weight_offset", &h.weight_offset},
      {"out_dtype", &h.out_dtype}, {"out_scale", &h.out_scale}, {"return_amax", &h.return_amax},
      {"autocast", &h.autocast}, {"mod_scale", &h.mod_scale}, {"mod_shift", &h.mod_shift}, {"gate", &h.gate}};
  h.plain = py::cast<Py_ssize_t>(lengths[0]);
  h.fused = py::cast<Py_ssize_t>(lengths[1]);
  h.all = py::cast<Py_ssize_t>(lengths[2]);
  const Py_ssize_t tiers[3] = {h.plain, h.fused, h.all};
  TORCH_CHECK(py::len(names) == static_cast<size_t>(h.all) && h.plain <= h.fused && h.fused <= h.all,
              "normkit host path: the eager entry's argument list and its lengths disagree");
  for (int i : positions(names, fields))
    TORCH_CHECK(false, "normkit host path: the eager entry passes ", py::cast<std::string>(names[i]),
                ", which it does not read");
  for (size_t k = 0; k < std::size(fields); k++)  // each field within its tier: 8 plain, 8 fused, 3 more
    TORCH_CHECK(*fields[k].second >= 0 && *fields[k].second < tiers[k < 8 ? 0 : k < 16 ? 1 : 2],
                "normkit host path: the eager entry's argument ", fields[k].first, " is missing or misplaced");
  host_args = h;
}

// Recognises a call this path serves: the eager entry's arguments (HOST_ROW: x, normalized_shape,
// weight, bias, eps, rms, activation, backend[, residual, prenorm, residual_dtype, weight_offset,
// out_dtype, out_scale, return_amax, autocast[, mod_scale, mod_shift, gate]]) as normkit.functional
// passes them (autocast: apply torch's autocast contract, as the public functions do; False where the
// caller has applied it or wants none); false for anything else (the Python path runs, and raises the
// errors for bad arguments).
bool parse_row(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, RowCall& c) {
  const HostRowArgs& h = host_args;
  if ((nargs != h.plain && nargs != h.fused && nargs != h.all) || (kwnames && PyTuple_GET_SIZE(kwnames)))
    return false;
  PyObject *pw = args[h.weight], *pb = args[h.bias], *prms = args[h.rms];
  if (!plain_args(args[h.x], pw, pb) || !backend_ok(args[h.backend]) || (prms != Py_True && prms != Py_False))
    return false;
  c.rms = prms == Py_True;
  c.act = activation_code(args[h.activation]);
  if (c.act < 0 || (c.rms && pb != Py_None)) return false;
  if (c.rms && args[h.eps] == Py_None) {
    c.eps = 1.1920928955078125e-07;  // torch.finfo(float32).eps, F.rms_norm's default for these dtypes
  } else if (!read_eps(args[h.eps], c.eps)) {
    return false;
  }
  PyObject *pr = Py_None, *pscale = Py_None;
  bool autocast = true;
  std::optional<at::ScalarType> r_dtype;
  if (nargs >= h.fused) {
    pr = args[h.residual];
    pscale = args[h.out_scale];
    if (pr != Py_None && !plain_tensor(pr)) return false;
    if (pscale != Py_None && !plain_tensor(pscale)) {
      if (!read_real(pscale, c.scale_value)) return false;
      c.float_scale = true;
    }
    if (!read_bool(args[h.prenorm], c.prenorm) || !read_bool(args[h.return_amax], c.amax) ||
        !read_bool(args[h.autocast], autocast) ||
        !read_dtype(args[h.residual_dtype], {at::kHalf, at::kBFloat16, at::kFloat}, r_dtype) ||
        !read_real(args[h.weight_offset], c.weight_offset) ||
        !read_dtype(args[h.out_dtype], {at::kHalf, at::kBFloat16, at::kFloat, at::kFloat8_e4m3fn, at::kFloat8_e5m2},
                    c.out_dtype))
      return false;
  }
  if (nargs == h.all) {
    for (int i : {h.mod_scale, h.mod_shift, h.gate})
      if (args[i] != Py_None && !plain_tensor(args[i])) return false;
    if (args[h.mod_scale] != Py_None) c.ms = THPVariable_Unpack(args[h.mod_scale]);
    if (args[h.mod_shift] != Py_None) c.mt = THPVariable_Unpack(args[h.mod_shift]);
    if (args[h.gate] != Py_None) c.g = THPVariable_Unpack(args[h.gate]);
  }
  int64_t dims[16];
  if (!read_shape(args[h.shape], dims, c.ndim)) return false;
  c.x = THPVariable_Unpack(args[h.x]);
  if (pw != Py_None) c.w = THPVariable_Unpack(pw);
  if (pb != Py_None) c.b = THPVariable_Unpack(pb);
  if (pr != Py_None) c.r = THPVariable_Unpack(pr);
  if (pscale != Py_None && plain_tensor(pscale)) c.scale = THPVariable_Unpack(pscale);
  return finish_row(c, dims, autocast, r_dtype);
}

// The forward's inputs as its plans number them: x, weight, bias, residual, a tensor out_scale, then,
// in calls with the modulation or a gate only (plans.row_fwd), mod_scale, mod_shift, gate.
int row_inputs(const RowCall& c, Tensor (&in)[8]) {
  in[0] = c.x, in[1] = c.w, in[2] = c.b, in[3] = c.r, in[4] = c.scale;
  if (!c.extra) return 5;
  in[5] = c.ms, in[6] = c.mt, in[7] = c.g;
  return 8;
}

Key row_fwd_key(const RowCall& c, bool store_stats, bool store_h) {
  Key key;
  Tensor in[8];
  const int n_in = row_inputs(c, in);
  // kind 1: a plain or fused call; 5: one with the modulation or a gate (their tables follow the layout)
  for (int64_t v : {int64_t(c.extra ? 5 : 1), int64_t(c.x.device().index()), dtype_code(c.x), dtype_code(c.w),
                    dtype_code(c.b), dtype_code(c.r), dtype_code(c.scale), opt_code(c.h_dtype), opt_code(c.out_dtype),
                    int64_t(c.rms), int64_t(c.act), int64_t(store_stats), int64_t(store_h), int64_t(c.amax), c.w_rows,
                    alias_code(in, n_in)})
    key.add(v);
  key.add_double(c.eps);
  key.add_double(c.weight_offset);
  key.add_double(c.scale_value);
  key.add(c.float_scale);
  key.add(aligned(c.x) | aligned(c.w) << 1 | aligned(c.b) << 2 | aligned(c.r) << 3 | aligned(c.scale) << 4);
  for (int i = 0; i < c.layout.n; i++) key.add(c.layout.v[i]);  // with a gate's alignment and dtype below
  if (c.g.defined()) {
    key.add(dtype_code(c.g));
    key.add(aligned(c.g));
  }
  return key;
}

// A statistics output (mean, rstd) of a replay in the shape the Python host function hands it out
// (x's leading dims; [B, G] for GroupNorm), which the recorded buffer may have flat ([M]): the ops
// return it as their fake implementations say. Any other recorded buffer: as recorded.
Tensor alloc_stats(const AllocSpec& a, c10::IntArrayRef shape) {
  int64_t n = 1, m = 1, expect = 1;
  for (int64_t v : shape) n *= v;
  bool dense = true;
  for (int64_t i = static_cast<int64_t>(a.sizes.size()) - 1; i >= 0; i--) {
    m *= a.sizes[i];
    if (a.sizes[i] != 1 && a.strides[i] != expect) dense = false;
    expect *= a.sizes[i];
  }
  return dense && n == m ? alloc(shape, a.dtype) : alloc_strided(a.sizes, a.strides, a.dtype);
}

// One forward through its plan, or the Python host function (recording it when due): the core of
// both entry points, the eager one (py_row_norm) and the dispatcher's (row_fwd_op). store_stats:
// mean/rstd are kept; store_h: h is written. outs[1..5] = y, mean, rstd, h, amax (undefined: absent).
void row_forward(const RowCall& c, bool store_stats, bool store_h, Tensor (&outs)[kMaxOuts]) {
  Tensor inputs[8];
  const int n_in = row_inputs(c, inputs);
  const c10::IntArrayRef lead = c.x.sizes().slice(0, c.x.dim() - c.ndim);
  auto make = [&](int role, const AllocSpec& a) {
    if (role == 1 || role == 4) return alloc(c.x.sizes(), a.dtype);
    if (role == 5) return alloc({}, at::kFloat);  // the amax: 4 bytes, handed out as a 0-dim float32
    if (role == 2 || role == 3) return alloc_stats(a, lead);
    return alloc_strided(a.sizes, a.strides, a.dtype);
  };
  run(row_fwd_key(c, store_stats, store_h), inputs, n_in, c.x.device(), make, [&](bool record) {  // GIL held
    py::object out_dtype = c.out_dtype ? py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(*c.out_dtype))) : py::none();
    py::object h_dtype = c.h_dtype ? py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(*c.h_dtype))) : py::none();
    return callbacks->row_fwd(wrap(c.x), wrap(c.w), wrap(c.b), wrap(c.r), wrap(c.scale), wrap(c.ms), wrap(c.mt),
                              wrap(c.g), c.ndim, c.eps, c.rms,
                              act_name(c.act), store_stats, store_h, h_dtype, c.weight_offset, out_dtype,
                              c.float_scale ? py::object(py::float_(c.scale_value)) : py::none(), c.amax, record);
  }, outs, 5);
}

bool grad_of(const Tensor& t) { return t.defined() && t.requires_grad(); }

// Whether a row call records its graph (grad mode on and an input that requires grad).
bool row_grad(const RowCall& c) {
  return c10::GradMode::is_enabled() && (c.x.requires_grad() || grad_of(c.w) || grad_of(c.b) || grad_of(c.r) ||
                                         (c.extra && (grad_of(c.ms) || grad_of(c.mt) || grad_of(c.g))));
}

PyObject* py_row_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  RowCall c;
  if (!callbacks || !parse_row(args, nargs, kwnames, c) || (!c.x.is_cuda() && !cpu_calls)) Py_RETURN_NONE;
  const bool grad = row_grad(c);
  if (grad && c.out_dtype && is_fp8(*c.out_dtype)) Py_RETURN_NONE;  // a float8 y's gradient: the Python path
  const bool store_h = c.r.defined() && (grad || c.prenorm);  // with grad the backward normalizes h again
  Tensor outs[kMaxOuts];  // y, mean, rstd, h, amax
  row_forward(c, grad, store_h, outs);
  if (grad) {
    auto node = make_node<RowNormBackward>();
    auto* n = static_cast<RowNormBackward*>(node.get());
    if (c.extra) {
      n->set_next_edges(torch::autograd::collect_next_edges(c.x, c.w, c.b, c.r, c.ms, c.mt, c.g));
      n->ms_ = SavedVariable(c.ms, false);
      n->mt_ = SavedVariable(c.mt, false);
      n->g_ = SavedVariable(c.g, false);
    } else {
      n->set_next_edges(torch::autograd::collect_next_edges(c.x, c.w, c.b, c.r));
    }
    torch::autograd::set_history(outs[1], node);
    if (c.prenorm) torch::autograd::set_history(outs[4], node);
    // what was normalized: h (an output of this node when prenorm returns it) or x
    n->x_ = c.r.defined() ? SavedVariable(outs[4], c.prenorm) : SavedVariable(c.x, false);
    n->w_ = SavedVariable(c.w, false);
    n->b_ = SavedVariable(c.b, false);
    n->mean_ = SavedVariable(outs[2], false);
    n->rstd_ = SavedVariable(outs[3], false);
    n->eps_ = c.eps;
    n->act_ = c.act;
    n->ndim_ = c.ndim;
    n->rms_ = c.rms;
    n->prenorm_ = c.prenorm;
    n->weight_offset_ = c.weight_offset;
    n->x_dtype_ = c.x.scalar_type();
    if (c.r.defined()) n->r_dtype_ = c.r.scalar_type();
  }
  if (!c.prenorm && !c.amax) return THPVariable_Wrap(std::move(outs[1]));
  py::list out;
  out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outs[1]))));
  if (c.prenorm) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outs[4]))));
  if (c.amax) out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(outs[5]))));
  return py::tuple(out).release().ptr();
  END_HANDLE_TH_ERRORS
}

// Test hook: what the fast path makes of a call (None: not its case), and the forward's plan key.
PyObject* py_parse_row(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  RowCall c;
  if (!parse_row(args, nargs, kwnames, c)) Py_RETURN_NONE;
  const bool grad = row_grad(c);
  int64_t M = 0, N = 0, rs = 0;
  rows_view(c.x, c.ndim, M, N, rs);
  py::object out_dtype = c.out_dtype ? py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(*c.out_dtype))) : py::none();
  return py::make_tuple(c.ndim, M, N, rs, c.eps, c.act, grad, c.lead_n, c.w_rows, out_dtype,
                        row_fwd_key(c, grad, c.r.defined() && (grad || c.prenorm)).list())
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

// A LayerNorm/RMSNorm backward as its plans run it: the one core of the autograd node
// (RowNormBackward::apply) and of the backward ops' dispatcher kernels (serve_op).
struct RowBwdCall {
  Tensor dy, dh, z, w, b, mean, rstd, ms, mt, g;  // z: what was normalized (h; with a gate the ungated x);
                                                  // b: the bias (the kernels read it with act or ms only)
  int64_t ndim = 1;
  bool rms = false, extra = false;  // extra: ms, mt or g (their plans have 10 inputs, 7 outputs)
  int act = 0;
  double weight_offset = 0;
  bool need_dx = true, need_dres = false, need_dg = false;
  at::ScalarType x_dtype = at::kFloat;  // dx's dtype
  // dres's dtype (read only with need_dres), the wanted parameter and modulation gradients' dtypes
  std::optional<at::ScalarType> r_dtype, dw_dtype, db_dtype, ds_dtype, dt_dtype;
};

py::object dtype_object(const std::optional<at::ScalarType>& d) {
  return d ? py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(*d))) : py::none();
}

// The plan key of a row backward; makes dy / dh contiguous where their rows need a copy (e.g. the
// expanded gradient of a sum()). False where z's rows need one (the Python path's case).
bool row_bwd_key(RowBwdCall& c, Key& key) {
  int n = 0, n2 = 0;
  int64_t inner = 0, inner2 = 0;
  if (!add_layout(key, c.z, c.ndim, n, inner)) return false;
  if (!add_layout(key, c.dy, c.ndim, n2, inner2, n, inner)) {
    c.dy = c.dy.contiguous();
    TORCH_CHECK(add_layout(key, c.dy, c.ndim, n2, inner2, n, inner), "normkit host path: dy without a row view");
  }
  if (c.dh.defined() && !add_layout(key, c.dh, c.ndim, n2, inner2, n, inner)) {
    c.dh = c.dh.contiguous();
    TORCH_CHECK(add_layout(key, c.dh, c.ndim, n2, inner2, n, inner), "normkit host path: dh without a row view");
  }
  // the bias only recomputes act's input, or with a scale the affine output that dscale sums
  const Tensor inputs[10] = {c.dy, c.z, c.w, c.act || c.ms.defined() ? c.b : Tensor(), c.mean, c.rstd, c.dh,
                             c.ms, c.mt, c.g};
  const int n_in = c.extra ? 10 : 7;
  const int64_t w_rows = c.w.defined() ? (c.w.dim() > c.ndim ? c.w.size(0) : 1)
                                       : (c.b.defined() && c.b.dim() > c.ndim ? c.b.size(0) : 1);
  int64_t align = 0;
  for (int i = 0; i < n_in; i++) align |= int64_t(aligned(inputs[i])) << i;
  // kind 2: a plain or fused backward; 6: one with the modulation or a gate (the forward's key has
  // their layouts: the saved tables and gate are the forward's)
  for (int64_t v : {int64_t(c.extra ? 6 : 2), int64_t(c.z.device().index()), dtype_code(c.z), dtype_code(c.dy),
                    dtype_code(c.dh), dtype_code(c.w), dtype_code(inputs[3]), opt_code(c.dw_dtype),
                    opt_code(c.db_dtype), int64_t(c.rms), int64_t(c.act), int64_t(c.need_dx), int64_t(c.need_dres),
                    int64_t(c.x_dtype), opt_code(c.r_dtype), w_rows, alias_code(inputs, n_in), align})
    key.add(v);
  key.add_double(c.weight_offset);
  if (c.extra) {
    for (int64_t v : {opt_code(c.ds_dtype), opt_code(c.dt_dtype), int64_t(c.need_dg), dtype_code(c.g)}) key.add(v);
    if (c.g.defined())
      TORCH_CHECK(add_layout(key, c.g, c.ndim, n2, inner2, n, inner), "normkit host path: gate rows");
    for (const Tensor* t : {&c.ms, &c.mt}) {
      key.add(t->defined() ? t->dim() : -1);
      if (!t->defined()) continue;
      key.add(dtype_code(*t));
      for (int64_t v : t->sizes()) key.add(v);
      for (int64_t v : t->strides()) key.add(v);
    }
  }
  return true;
}

// One row backward through its plan or the Python host function (plans.row_bwd). outs[1..7]: the
// first gradient buffer (dx, or dres when only it is wanted), dweight, dbias, a second buffer (dres
// in its own dtype), dscale, dshift, dgate (undefined: not wanted).
void row_backward(const RowBwdCall& c, const Key& key, Tensor (&outs)[kMaxOuts]) {
  const Tensor inputs[10] = {c.dy, c.z, c.w, c.act || c.ms.defined() ? c.b : Tensor(), c.mean, c.rstd, c.dh,
                             c.ms, c.mt, c.g};
  const int64_t d = c.z.dim();
  const c10::IntArrayRef pshape = c.w.defined() ? c.w.sizes() : c.b.defined() ? c.b.sizes()
                                                                               : c.z.sizes().slice(d - c.ndim);
  auto make = [&](int role, const AllocSpec& a) {
    if (role == 2 || role == 3) return alloc(pshape, a.dtype);
    return alloc(role == 5 ? c.ms.sizes() : role == 6 ? c.mt.sizes() : c.z.sizes(), a.dtype);
  };
  run(key, inputs, c.extra ? 10 : 7, c.z.device(), make, [&](bool record) {
    py::tuple needs = py::make_tuple(c.need_dx, c.need_dres);
    py::tuple params = py::make_tuple(dtype_object(c.dw_dtype), dtype_object(c.db_dtype));
    py::object x_dtype = dtype_object(c.x_dtype), r_dtype = dtype_object(c.r_dtype);
    if (!c.extra)
      return callbacks->row_bwd(wrap(c.dy), wrap(c.dh), wrap(c.z), wrap(c.w), wrap(c.b), wrap(c.mean), wrap(c.rstd),
                                c.ndim, c.rms, act_name(c.act), needs, params, c.weight_offset, x_dtype, r_dtype,
                                record);
    return callbacks->row_bwd(wrap(c.dy), wrap(c.dh), wrap(c.z), wrap(c.w), wrap(c.b), wrap(c.mean), wrap(c.rstd),
                              c.ndim, c.rms, act_name(c.act), needs, params, c.weight_offset, x_dtype, r_dtype, record,
                              wrap(c.ms), wrap(c.mt), py::make_tuple(dtype_object(c.ds_dtype), dtype_object(c.dt_dtype)),
                              wrap(c.g), c.need_dg);
  }, outs, c.extra ? 7 : 4);
}

variable_list RowNormBackward::apply(variable_list&& grads) {
  const int n_out = static_cast<int>(num_outputs());  // kRowEdges, or kRowEdgesExtra with ms/mt/gate
  RowBwdCall c;
  c.dy = grads[0];
  c.dh = prenorm_ && grads.size() > 1 ? grads[1] : Tensor();
  if (!c.dy.defined() && !c.dh.defined()) return variable_list(n_out);
  // edges: x, weight, bias, residual[, mod_scale, mod_shift, gate]
  bool need[kRowEdgesExtra] = {};
  for (int i = 0; i < n_out; i++) need[i] = task_should_compute_output(i);
  c.z = x_.unpack(getptr()), c.w = w_.unpack(), c.b = b_.unpack(), c.mean = mean_.unpack(), c.rstd = rstd_.unpack();
  if (n_out == kRowEdgesExtra) c.ms = ms_.unpack(), c.mt = mt_.unpack(), c.g = g_.unpack();
  const Tensor &dy = c.dy, &dh = c.dh;
  const c10::Device dev = c.z.device();
  if (!dy.defined() || differentiable(dy) || dy.device() != dev || (dh.defined() && (!tensor_ok(dh, dev)))) {
    // python returns (dx, dres, dw, db, dscale, dshift, dgate); the node's outputs are (dx, dw, db, dres, ...)
    static const int order[kRowEdgesExtra] = {0, 3, 1, 2, 4, 5, 6};
    const bool need_vjp[kRowEdgesExtra] = {need[0], need[3], need[1], need[2], need[4], need[5], need[6]};
    variable_list out = differentiable_grads(need_vjp, [&](py::tuple) {
      return callbacks->row_vjp(wrap(dy), wrap(dh), wrap(c.z), wrap(c.w), wrap(c.b), ndim_, eps_, rms_, act_name(act_),
                                weight_offset_, py::make_tuple(need[0], need[1], need[2], need[3]),
                                dtype_object(x_dtype_), dtype_object(r_dtype_), wrap(c.ms), wrap(c.mt),
                                py::make_tuple(need[4], need[5]), wrap(c.g), need[6]);
    }, order);
    out.resize(n_out);  // differentiable_grads placed them in the node's order (dx, dw, db, dres, ...)
    return out;
  }
  c.ndim = ndim_, c.rms = rms_, c.act = act_, c.weight_offset = weight_offset_;
  c.extra = n_out == kRowEdgesExtra;
  c.need_dx = need[0], c.need_dres = need[3], c.need_dg = need[6] && c.g.defined();
  c.x_dtype = x_dtype_, c.r_dtype = r_dtype_;
  auto dtype_if = [](bool want, const Tensor& t) {
    return want && t.defined() ? std::optional<at::ScalarType>(t.scalar_type()) : std::nullopt;
  };
  c.dw_dtype = dtype_if(need[1], c.w), c.db_dtype = dtype_if(need[2], c.b);
  c.ds_dtype = dtype_if(need[4], c.ms), c.dt_dtype = dtype_if(need[5], c.mt);
  Key key;
  TORCH_CHECK(row_bwd_key(c, key), "normkit host path: saved rows without a view");
  Tensor outs[kMaxOuts];
  row_backward(c, key, outs);
  // as row_norm_backward_fused hands them out: the kernel writes dx once (in the residual's dtype when
  // only the residual wants it), or twice when x and the residual want different dtypes
  Tensor dx = need[0] ? outs[1] : Tensor();
  Tensor dres = need[3] ? (outs[4].defined() ? outs[4] : outs[1]) : Tensor();
  variable_list out = {dx, c.dw_dtype ? outs[2] : Tensor(), c.db_dtype ? outs[3] : Tensor(), dres};
  if (n_out == kRowEdgesExtra) {
    out.push_back(c.ds_dtype ? outs[5] : Tensor());
    out.push_back(c.dt_dtype ? outs[6] : Tensor());
    out.push_back(c.need_dg ? outs[7] : Tensor());
  }
  return out;
}

// ----------------------------------------------------------------------------- GroupNorm

struct GroupNormBackward : public NormBackward {
  int64_t groups_ = 1;
  int layout_ = 0;
  std::string name() const override { return "NormkitGroupNormBackward"; }
  variable_list apply(variable_list&& grads) override;
};

int64_t spatial(const Tensor& x) {
  int64_t s = 1;
  for (int64_t i = 2; i < x.dim(); i++) s *= x.size(i);
  return s;
}

struct GnCall {
  Tensor x, w, b;
  int64_t groups, B, C, S;
  double eps;
  int act, layout;
};

// The part of reading a GroupNorm call both entry points share (c.x, w, b, groups, eps, act read).
// autocast: apply torch's autocast contract (the public function; the op does not).
bool finish_gn(GnCall& c, bool autocast) {
  if (!modes_ok() || functorch_active()) return false;
  const c10::Device dev = c.x.device();
  if (c.x.dim() < 2 || !tensor_ok(c.x, dev)) return false;
  c.B = c.x.size(0);
  c.C = c.x.size(1);
  c.S = spatial(c.x);
  if (c.groups <= 0 || c.C % c.groups) return false;
  const int64_t C = c.C;
  c.layout = gn_layout(c.x);
  return param_ok(c.w, dev, C) && param_ok(c.b, dev, C) && c.layout >= 0 &&
         (!autocast || autocast_ok(c.x, c.w, c.b));
}

// (x, num_groups, weight, bias, eps, activation, backend) as normkit.functional passes them.
bool parse_gn(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, GnCall& c) {
  if (nargs != 7 || (kwnames && PyTuple_GET_SIZE(kwnames))) return false;
  PyObject *pw = args[2], *pb = args[3];
  if (!plain_args(args[0], pw, pb) || !backend_ok(args[6]) || !PyLong_CheckExact(args[1])) return false;
  c.groups = PyLong_AsLongLong(args[1]);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  c.act = activation_code(args[5]);
  if (c.act < 0 || !read_eps(args[4], c.eps)) return false;
  c.x = THPVariable_Unpack(args[0]);
  if (pw != Py_None) c.w = THPVariable_Unpack(pw);
  if (pb != Py_None) c.b = THPVariable_Unpack(pb);
  return finish_gn(c, true);
}

Key gn_fwd_key(const GnCall& c) {
  Key key;
  for (int64_t v : {int64_t(3), int64_t(c.x.device().index()), dtype_code(c.x), dtype_code(c.w), dtype_code(c.b),
                    int64_t(c.act), c.B, c.C, c.S, c.groups, int64_t(c.layout)})
    key.add(v);
  const Tensor in[3] = {c.x, c.w, c.b};
  key.add(alias_code(in, 3));  // weight and bias may be one tensor
  key.add_double(c.eps);
  key.add(aligned(c.x) | aligned(c.w) << 1 | aligned(c.b) << 2);
  return key;
}

// One GroupNorm forward through its plan or the Python host function, the core of both entry points
// (py_group_norm, gn_fwd_op): outs[1..3] = y (in x's layout), mean, rstd.
void gn_forward(const GnCall& c, Tensor (&outs)[kMaxOuts]) {
  const Tensor inputs[3] = {c.x, c.w, c.b};
  const int64_t stat_shape[2] = {c.B, c.groups};
  auto make = [&](int role, const AllocSpec& a) {
    return role == 1 ? alloc_like(c.x, c.layout, a.dtype) : alloc_stats(a, stat_shape);
  };
  run(gn_fwd_key(c), inputs, 3, c.x.device(), make, [&](bool record) {
    return callbacks->gn_fwd(wrap(c.x), wrap(c.w), wrap(c.b), c.groups, c.eps, act_name(c.act), bool(c.layout),
                             record);
  }, outs);
}

PyObject* py_group_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  GnCall c;
  if (!callbacks || !parse_gn(args, nargs, kwnames, c) || !c.x.is_cuda()) Py_RETURN_NONE;
  Tensor outs[kMaxOuts];
  gn_forward(c, outs);
  if (needs_grad(c.x, c.w, c.b)) {
    auto* n = attach<GroupNormBackward>(outs[1], c.x, c.w, c.b, outs[2], outs[3], c.eps, c.act);
    n->groups_ = c.groups;
    n->layout_ = c.layout;
  }
  return THPVariable_Wrap(std::move(outs[1]));
  END_HANDLE_TH_ERRORS
}

PyObject* py_parse_gn(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  GnCall c;
  if (!parse_gn(args, nargs, kwnames, c)) Py_RETURN_NONE;
  return py::make_tuple(c.groups, c.B, c.C, c.S, c.eps, c.act, c.layout, needs_grad(c.x, c.w, c.b),
                        gn_fwd_key(c).list())
      .release()
      .ptr();
  END_HANDLE_TH_ERRORS
}

// A GroupNorm backward as its plans run it: the one core of the autograd node
// (GroupNormBackward::apply) and of group_norm_bwd's dispatcher kernel (serve_op).
struct GnBwdCall {
  Tensor dy, x, w, b, mean, rstd;  // b: the bias (the kernels read it with act only)
  int64_t groups = 1;
  int act = 0, layout = 0;
  std::optional<at::ScalarType> dw_dtype, db_dtype;  // the wanted parameter gradients' dtypes
};

// outs[1..3]: dx (in x's layout), dweight, dbias (undefined: not wanted).
void gn_backward(GnBwdCall& c, Tensor (&outs)[kMaxOuts]) {
  const Tensor& x = c.x;
  if (gn_layout(c.dy) != c.layout || c.dy.sizes() != x.sizes()) {  // the kernels walk dy with x's strides
    Tensor d2 = at::empty_strided(x.sizes(), x.strides(), c.dy.options());  // x is dense in its layout
    d2.copy_(c.dy);
    c.dy = d2;
  }
  const c10::Device dev = x.device();
  const Tensor inputs[6] = {c.dy, x, c.w, c.act ? c.b : Tensor(), c.mean, c.rstd};
  Key key;
  for (int64_t v : {int64_t(4), int64_t(dev.index()), dtype_code(x), dtype_code(c.dy), dtype_code(c.w),
                    dtype_code(inputs[3]), opt_code(c.dw_dtype), opt_code(c.db_dtype), int64_t(c.act), x.size(0),
                    x.size(1), spatial(x), c.groups, int64_t(c.layout), bwd_align(inputs), alias_code(inputs, 6)})
    key.add(v);
  auto make = [&](int role, const AllocSpec& a) {
    return role == 1 ? alloc_like(x, c.layout, a.dtype) : alloc_strided(a.sizes, a.strides, a.dtype);
  };
  run(key, inputs, 6, dev, make, [&](bool record) {
    return callbacks->gn_bwd(wrap(c.dy), wrap(x), wrap(c.w), wrap(c.b), wrap(c.mean), wrap(c.rstd), c.groups,
                             act_name(c.act), py::make_tuple(dtype_object(c.dw_dtype), dtype_object(c.db_dtype)),
                             bool(c.layout), record);
  }, outs);
}

variable_list GroupNormBackward::apply(variable_list&& grads) {
  GnBwdCall c;
  c.dy = grads[0];
  if (!c.dy.defined()) return variable_list(3);
  const bool need[3] = {task_should_compute_output(0), task_should_compute_output(1), task_should_compute_output(2)};
  c.x = x_.unpack(), c.w = w_.unpack(), c.b = b_.unpack(), c.mean = mean_.unpack(), c.rstd = rstd_.unpack();
  if (differentiable(c.dy) || c.dy.device() != c.x.device()) {
    return differentiable_grads(need, [&](py::tuple needs) {
      return callbacks->gn_vjp(wrap(c.dy), wrap(c.x), wrap(c.w), wrap(c.b), groups_, eps_, act_name(act_), needs);
    });
  }
  c.groups = groups_, c.act = act_, c.layout = layout_;
  if (need[1] && c.w.defined()) c.dw_dtype = c.w.scalar_type();
  if (need[2] && c.b.defined()) c.db_dtype = c.b.scalar_type();
  Tensor outs[kMaxOuts];
  gn_backward(c, outs);
  return {need[0] ? outs[1] : Tensor(), c.dw_dtype ? outs[2] : Tensor(), c.db_dtype ? outs[3] : Tensor()};
}

// ----------------------------------------------------------------------------- the dispatcher's kernels
// normkit's custom ops (normkit::row_norm_fwd, ..., defined once, in normkit/_library.py) get these
// kernels for CUDA tensors, so torch.compile's generated code, which calls the ops through the
// dispatcher, reaches the plans above without Python:
//   - an Autograd<device> kernel: with grad mode off or no input requiring grad it goes on below
//     autograd, in C++ (the custom op's own Autograd kernel is Python); otherwise it calls that Python
//     autograd kernel (the registered autograd formula), given to _register_ops;
//   - a <device> kernel: reads the op's arguments (finish_row / finish_gn, as the eager entry points)
//     and runs the op's plan (row_forward / gn_forward, as they do; the backward ops row_backward /
//     gn_backward, as the autograd nodes do); a call it does not serve (CPU tensors, float64, a layout
//     that needs a copy, a backend other than Triton, the host path inactive or switched off by
//     python_path()) calls the op's Python implementation.
// Registered by _register_ops at extension load (normkit._host.load_extension); the returned handle
// unregisters them when it is released.

enum OpId { kRowFwd, kRowFusedFwd, kRowBwd, kRowFusedBwd, kGnFwd, kGnBwd, kNumOps };
const char* const op_names[kNumOps] = {"row_norm_fwd", "row_norm_fused_fwd", "row_norm_bwd", "row_norm_fused_bwd",
                                       "group_norm_fwd", "group_norm_bwd"};
std::array<PyObject*, kNumOps> op_python{}, op_autograd{};  // owned references, set by _register_ops
std::atomic<bool> ops_enabled{true};
std::atomic<uint64_t> n_op_served{0}, n_op_python{0}, n_op_autograd_python{0};
std::vector<std::string> act_strings;  // activation code - 1 -> name (no GIL needed to compare)

int iv_activation(const c10::IValue& v) {
  if (v.isNone()) return 0;
  if (!v.isString()) return -1;
  const auto& s = v.toStringRef();
  for (size_t i = 0; i < act_strings.size(); i++)
    if (act_strings[i] == s) return static_cast<int>(i) + 1;
  return -1;
}

bool iv_backend(const c10::IValue& v) { return v.isNone() || (v.isString() && v.toStringRef() == "triton"); }

Tensor iv_tensor(const c10::IValue& v) { return v.isTensor() ? v.toTensor() : Tensor(); }

bool iv_dtype(const c10::IValue& v, std::initializer_list<at::ScalarType> allowed, std::optional<at::ScalarType>& d) {
  d.reset();
  if (v.isNone()) return true;
  if (!v.isInt()) return false;
  const auto s = static_cast<at::ScalarType>(v.toInt());
  for (auto a : allowed)
    if (a == s) {
      d = s;
      return true;
    }
  return false;
}

// positions() for an op's argument list (normkit._op_args), which must have every name a field reads.
template <size_t K>
std::vector<int> op_positions(py::sequence names, const std::pair<const char*, int*> (&fields)[K], const char* op) {
  std::vector<int> unread = positions(names, fields);
  for (const auto& f : fields) TORCH_CHECK(*f.second >= 0, "normkit host path: ", op, " has no argument ", f.first);
  return unread;
}

// The positions of row_norm_fused_fwd's arguments (row_norm_fwd's are its first eight), from the ops'
// one definition, normkit._op_args, handed over once at load (set_op_args): the op kernels read
// arguments by name. An argument this file does not read (an option added there later) must be None for a call
// to be served: the plans do not know it.
struct RowOpArgs {
  int x, ndim, weight, bias, eps, rms, activation, backend, residual, residual_dtype, weight_offset, out_dtype,
      out_scale, out_scale_value, want_amax, mod_scale, mod_shift, gate;
  std::vector<int> unread;
};
RowOpArgs op_args{};

void set_row_op_args(py::sequence names) {
  RowOpArgs r{};
  const std::pair<const char*, int*> fields[] = {
      {"x", &r.x}, {"normalized_ndim", &r.ndim}, {"weight", &r.weight}, {"bias", &r.bias}, {"eps", &r.eps},
      {"rms", &r.rms}, {"activation", &r.activation}, {"backend", &r.backend}, {"residual", &r.residual},
      {"residual_dtype", &r.residual_dtype}, {"weight_offset", &r.weight_offset}, {"out_dtype", &r.out_dtype},
      {"out_scale", &r.out_scale}, {"out_scale_value", &r.out_scale_value}, {"want_amax", &r.want_amax},
      {"mod_scale", &r.mod_scale}, {"mod_shift", &r.mod_shift}, {"gate", &r.gate}};
  r.unread = op_positions(names, fields, "row_norm_fused_fwd");
  op_args = std::move(r);
}

// The positions of row_norm_fused_bwd's arguments (row_norm_bwd's are its first twelve), from
// normkit._op_args as the forward's (set_row_op_args).
struct RowBwdOpArgs {
  int dy, x, ndim, weight, bias, mean, rstd, rms, activation, dweight_dtype, dbias_dtype, backend, weight_offset, dh,
      dx_dtype, dres_dtype, mod_scale, mod_shift, dscale_dtype, dshift_dtype, gate;
  std::vector<int> unread;
};
RowBwdOpArgs bwd_op_args{};

void set_row_bwd_op_args(py::sequence names) {
  RowBwdOpArgs r{};
  const std::pair<const char*, int*> fields[] = {
      {"dy", &r.dy}, {"x", &r.x}, {"normalized_ndim", &r.ndim}, {"weight", &r.weight}, {"bias", &r.bias},
      {"mean", &r.mean}, {"rstd", &r.rstd}, {"rms", &r.rms}, {"activation", &r.activation},
      {"dweight_dtype", &r.dweight_dtype}, {"dbias_dtype", &r.dbias_dtype}, {"backend", &r.backend},
      {"weight_offset", &r.weight_offset}, {"dh", &r.dh}, {"dx_dtype", &r.dx_dtype}, {"dres_dtype", &r.dres_dtype},
      {"mod_scale", &r.mod_scale}, {"mod_shift", &r.mod_shift}, {"dscale_dtype", &r.dscale_dtype},
      {"dshift_dtype", &r.dshift_dtype}, {"gate", &r.gate}};
  r.unread = op_positions(names, fields, "row_norm_fused_bwd");
  bwd_op_args = std::move(r);
}

// The positions of group_norm_fwd's and group_norm_bwd's arguments, from normkit._op_args as the row
// ops' (set_row_op_args); n: how many the op takes.
struct GnOpArgs {
  int x, groups, weight, bias, eps, activation, backend;
  size_t n;
  std::vector<int> unread;
};
GnOpArgs gn_op_args{};

void set_gn_op_args(py::sequence names) {
  GnOpArgs r{};
  const std::pair<const char*, int*> fields[] = {
      {"x", &r.x}, {"num_groups", &r.groups}, {"weight", &r.weight}, {"bias", &r.bias}, {"eps", &r.eps},
      {"activation", &r.activation}, {"backend", &r.backend}};
  r.unread = op_positions(names, fields, "group_norm_fwd");
  r.n = py::len(names);
  gn_op_args = std::move(r);
}

// eps: the forward's, which the torch backend's CPU kernel uses to recompute the activation's input
// with the forward's bits; the plans (GPU kernels) do not need it, and serve a call with or without it.
// A call may leave eps and an argument this file does not read out (their default, None, as a schema's
// trailing defaults): n_min, the fewest arguments a call passes, is one past the last position of the others.
struct GnBwdOpArgs {
  int dy, x, groups, weight, bias, mean, rstd, activation, dweight_dtype, dbias_dtype, backend, eps;
  size_t n, n_min;
  std::vector<int> unread;
};
GnBwdOpArgs gn_bwd_op_args{};

void set_gn_bwd_op_args(py::sequence names) {
  GnBwdOpArgs r{};
  const std::pair<const char*, int*> fields[] = {
      {"dy", &r.dy}, {"x", &r.x}, {"num_groups", &r.groups}, {"weight", &r.weight}, {"bias", &r.bias},
      {"mean", &r.mean}, {"rstd", &r.rstd}, {"activation", &r.activation}, {"dweight_dtype", &r.dweight_dtype},
      {"dbias_dtype", &r.dbias_dtype}, {"backend", &r.backend}, {"eps", &r.eps}};
  r.unread = op_positions(names, fields, "group_norm_bwd");
  r.n = py::len(names);
  r.n_min = 0;
  for (const auto& f : fields)
    if (f.second != &r.eps) r.n_min = std::max(r.n_min, static_cast<size_t>(*f.second) + 1);
  gn_bwd_op_args = std::move(r);
}

// The op kernels' argument positions, one table of normkit._op_args (HOST_OPS) at a time: `op` is
// row_norm_fused_fwd (row_norm_fwd's lead it), row_norm_fused_bwd (row_norm_bwd's), group_norm_fwd or
// group_norm_bwd. Fails (the load fails) on a name a kernel reads that the table lacks.
void set_op_args(const std::string& op, py::sequence names) {
  if (op == "row_norm_fused_fwd") set_row_op_args(names);
  else if (op == "row_norm_fused_bwd") set_row_bwd_op_args(names);
  else if (op == "group_norm_fwd") set_gn_op_args(names);
  else if (op == "group_norm_bwd") set_gn_bwd_op_args(names);
  else TORCH_CHECK(false, "normkit host path: no op kernel reads ", op, "'s arguments");
}

// row_norm_fwd and row_norm_fused_fwd (normkit._op_args): a[0..n) as the op's arguments (one that is
// not there: None, its default); false where this path leaves the call to Python.
bool parse_row_op(const c10::IValue* a, size_t n, bool fused, RowCall& c) {
  static const c10::IValue none;
  const RowOpArgs& p = op_args;
  auto arg = [&](int i) -> const c10::IValue& { return static_cast<size_t>(i) < n ? a[i] : none; };
  if (!arg(p.x).isTensor() || !iv_backend(arg(p.backend))) return false;
  for (int i : p.unread)
    if (!arg(i).isNone()) return false;
  c.x = arg(p.x).toTensor();
  c.w = iv_tensor(arg(p.weight));
  c.b = iv_tensor(arg(p.bias));
  c.rms = arg(p.rms).toBool();
  c.act = iv_activation(arg(p.activation));
  c.eps = arg(p.eps).toDouble();
  c.ndim = arg(p.ndim).toInt();
  if (c.act < 0 || (c.rms && c.b.defined()) || !std::isfinite(c.eps) || c.eps < 0) return false;
  if (c.ndim < 1 || c.ndim > 16 || c.ndim > c.x.dim()) return false;
  std::optional<at::ScalarType> r_dtype;
  if (fused) {
    for (int i : {p.residual, p.out_scale, p.mod_scale, p.mod_shift, p.gate})
      if (!arg(i).isNone() && !arg(i).isTensor()) return false;
    c.r = iv_tensor(arg(p.residual));
    c.scale = iv_tensor(arg(p.out_scale));
    c.ms = iv_tensor(arg(p.mod_scale));
    c.mt = iv_tensor(arg(p.mod_shift));
    c.g = iv_tensor(arg(p.gate));
    c.weight_offset = arg(p.weight_offset).isNone() ? 0.0 : arg(p.weight_offset).toDouble();
    c.amax = !arg(p.want_amax).isNone() && arg(p.want_amax).toBool();
    if (!iv_dtype(arg(p.residual_dtype), {at::kHalf, at::kBFloat16, at::kFloat}, r_dtype) ||
        !iv_dtype(arg(p.out_dtype), {at::kHalf, at::kBFloat16, at::kFloat, at::kFloat8_e4m3fn, at::kFloat8_e5m2},
                  c.out_dtype) ||
        !std::isfinite(c.weight_offset))
      return false;
    if (!arg(p.out_scale_value).isNone()) {
      if (c.scale.defined()) return false;  // both a tensor and a float scale: Python says what it makes of it
      c.scale_value = arg(p.out_scale_value).toDouble();
      c.float_scale = true;
      if (!std::isfinite(c.scale_value)) return false;
    }
  }
  int64_t dims[16];
  for (int64_t i = 0; i < c.ndim; i++) dims[i] = c.x.size(c.x.dim() - c.ndim + i);
  return finish_row(c, dims, /*autocast=*/false, r_dtype);
}

// group_norm_fwd (normkit._op_args): a[0..n) as the op's arguments; false where this path leaves the
// call to Python (an argument this file does not read that is not None among them).
bool parse_gn_op(const c10::IValue* a, size_t n, GnCall& c) {
  const GnOpArgs& p = gn_op_args;
  if (n != p.n || !a[p.x].isTensor() || !iv_backend(a[p.backend])) return false;
  for (int i : p.unread)
    if (!a[i].isNone()) return false;
  c.x = a[p.x].toTensor();
  c.groups = a[p.groups].toInt();
  c.w = iv_tensor(a[p.weight]);
  c.b = iv_tensor(a[p.bias]);
  c.eps = a[p.eps].toDouble();
  c.act = iv_activation(a[p.activation]);
  if (c.act < 0 || !std::isfinite(c.eps) || c.eps < 0) return false;
  return finish_gn(c, /*autocast=*/false);
}

// Statistics an op was handed (mean, rstd): float32, contiguous, one per row or group, on dev.
bool stats_ok(const Tensor& t, c10::Device dev, int64_t n) {
  return t.device() == dev && t.layout() == c10::kStrided && t.scalar_type() == at::kFloat && t.is_contiguous() &&
         t.numel() == n && !t.key_set().has_any(bad_tensor_keys);
}

bool grad_ok(const Tensor& t, const Tensor& x) {  // a gradient the kernels read: x's shape, device
  return tensor_ok(t, x.device()) && t.sizes() == x.sizes();
}

// row_norm_bwd and row_norm_fused_bwd (normkit._op_args): a[0..n) as the op's arguments, read as
// normkit._library._bwd reads them; false where this path leaves the call to Python (any check the
// Python implementation makes, or a case the plans do not take in place).
bool parse_row_bwd_op(const c10::IValue* a, size_t n, bool fused, RowBwdCall& c) {
  static const c10::IValue none;
  const RowBwdOpArgs& p = bwd_op_args;
  auto arg = [&](int i) -> const c10::IValue& { return static_cast<size_t>(i) < n ? a[i] : none; };
  if (!arg(p.dy).isTensor() || !arg(p.x).isTensor() || !arg(p.rstd).isTensor() || !iv_backend(arg(p.backend)))
    return false;
  for (int i : p.unread)
    if (!arg(i).isNone()) return false;
  for (int i : {p.weight, p.bias, p.mean})
    if (!arg(i).isNone() && !arg(i).isTensor()) return false;
  c.dy = arg(p.dy).toTensor();
  c.z = arg(p.x).toTensor();
  c.w = iv_tensor(arg(p.weight));
  c.b = iv_tensor(arg(p.bias));
  c.rstd = arg(p.rstd).toTensor();
  c.rms = arg(p.rms).toBool();
  c.mean = c.rms ? Tensor() : iv_tensor(arg(p.mean));  // RMSNorm's is absent
  c.act = iv_activation(arg(p.activation));
  c.ndim = arg(p.ndim).toInt();
  const std::initializer_list<at::ScalarType> floats = {at::kHalf, at::kBFloat16, at::kFloat};
  if (c.act < 0 || !iv_dtype(arg(p.dweight_dtype), floats, c.dw_dtype) ||
      !iv_dtype(arg(p.dbias_dtype), floats, c.db_dtype))
    return false;
  c.x_dtype = c.z.scalar_type();
  if (fused) {
    for (int i : {p.dh, p.mod_scale, p.mod_shift, p.gate})
      if (!arg(i).isNone() && !arg(i).isTensor()) return false;
    c.weight_offset = arg(p.weight_offset).toDouble();
    c.dh = iv_tensor(arg(p.dh));
    c.ms = iv_tensor(arg(p.mod_scale));
    c.mt = iv_tensor(arg(p.mod_shift));
    c.g = iv_tensor(arg(p.gate));
    std::optional<at::ScalarType> dx_dtype;
    if (!iv_dtype(arg(p.dx_dtype), floats, dx_dtype) || !iv_dtype(arg(p.dres_dtype), floats, c.r_dtype) ||
        !iv_dtype(arg(p.dscale_dtype), floats, c.ds_dtype) || !iv_dtype(arg(p.dshift_dtype), floats, c.dt_dtype) ||
        !std::isfinite(c.weight_offset))
      return false;
    if (dx_dtype) c.x_dtype = *dx_dtype;
    if (c.r_dtype == c.x_dtype) c.r_dtype.reset();  // then dres is dx: the caller uses dx
  }
  c.need_dx = true;
  c.need_dres = c.r_dtype.has_value();
  c.need_dg = c.g.defined();
  c.extra = c.ms.defined() || c.mt.defined() || c.g.defined();
  // checks: the forward's (finish_row, finish_extra) on the tensors the backward reads
  if (!modes_ok() || functorch_active()) return false;
  const c10::Device dev = c.z.device();
  const int64_t d = c.z.dim();
  if (c.ndim < 1 || c.ndim > 16 || c.ndim > d || !tensor_ok(c.z, dev) || !grad_ok(c.dy, c.z)) return false;
  if ((c.dh.defined() && !grad_ok(c.dh, c.z)) || (c.rms && c.b.defined())) return false;
  if ((c.weight_offset != 0 && !c.w.defined()) || (c.dw_dtype && !c.w.defined())) return false;
  if ((c.ds_dtype && !c.ms.defined()) || (c.dt_dtype && !c.mt.defined())) return false;
  const c10::IntArrayRef shape = c.z.sizes().slice(d - c.ndim);
  int64_t M = 1;
  for (int64_t i = 0; i < d - c.ndim; i++) M *= c.z.size(i);
  if (!stats_ok(c.rstd, dev, M) || (!c.rms && !stats_ok(c.mean, dev, M))) return false;
  const int64_t heads = d > c.ndim + 1 ? c.z.size(d - c.ndim - 1) : 0;
  const int64_t wr = param_rows_of(c.w, dev, shape, heads), br = param_rows_of(c.b, dev, shape, heads);
  if (wr == 0 || br == 0 || (wr > 0 && br > 0 && (wr == 1) != (br == 1))) return false;  // mixed: Python expands
  if (!c.extra) return true;
  if (c.g.defined())  // the gated norm: no modulation, no dh, no residual (the backend's contract)
    return !c.ms.defined() && !c.mt.defined() && !c.dh.defined() && !c.need_dres && aux_ok(c.g, dev) &&
           c.g.sizes() == c.z.sizes();
  if (wr > 1 || br > 1) return false;  // per head: not with the modulation
  int64_t S[2] = {-1, -1}, per[2] = {-1, -1};
  for (int i = 0; i < 2; i++) {
    const Tensor& t = i ? c.mt : c.ms;
    int64_t rows = 0, cols = 0, rs = 0;
    if (t.defined() && (!aux_ok(t, dev) || t.dim() < c.ndim || t.dim() > 8 || t.sizes().slice(t.dim() - c.ndim) !=
                        shape || !sample_rows(t, c.z, c.ndim, S[i], per[i]) || !rows_view(t, c.ndim, rows, cols, rs)))
      return false;
  }
  return !(c.ms.defined() && c.mt.defined() && (S[0] != S[1] || per[0] != per[1]));
}

// group_norm_bwd (normkit._op_args): a[0..n) as the op's arguments, read as
// normkit._library._group_norm_bwd_impl reads them.
bool parse_gn_bwd_op(const c10::IValue* a, size_t n, GnBwdCall& c) {
  static const c10::IValue none;
  const GnBwdOpArgs& p = gn_bwd_op_args;
  auto arg = [&](int i) -> const c10::IValue& { return static_cast<size_t>(i) < n ? a[i] : none; };
  if (n > p.n || n < p.n_min || !a[p.dy].isTensor() || !a[p.x].isTensor() || !a[p.mean].isTensor() ||
      !a[p.rstd].isTensor() || !iv_backend(a[p.backend]))
    return false;
  for (int i : p.unread)
    if (!arg(i).isNone()) return false;
  const std::initializer_list<at::ScalarType> floats = {at::kHalf, at::kBFloat16, at::kFloat};
  c.dy = a[p.dy].toTensor();
  c.x = a[p.x].toTensor();
  c.groups = a[p.groups].toInt();
  c.w = iv_tensor(a[p.weight]);
  c.b = iv_tensor(a[p.bias]);
  c.mean = a[p.mean].toTensor();
  c.rstd = a[p.rstd].toTensor();
  c.act = iv_activation(a[p.activation]);
  if (c.act < 0 || !iv_dtype(a[p.dweight_dtype], floats, c.dw_dtype) || !iv_dtype(a[p.dbias_dtype], floats, c.db_dtype))
    return false;
  if (!arg(p.eps).isNone() && !arg(p.eps).isDouble()) return false;  // unused: the plans recompute from the stats
  if (!modes_ok() || functorch_active() || (c.dw_dtype && !c.w.defined())) return false;
  const c10::Device dev = c.x.device();
  if (c.x.dim() < 2 || !tensor_ok(c.x, dev) || !grad_ok(c.dy, c.x)) return false;
  const int64_t B = c.x.size(0), C = c.x.size(1);
  c.layout = gn_layout(c.x);
  return c.groups > 0 && C % c.groups == 0 && c.layout >= 0 && param_ok(c.w, dev, C) && param_ok(c.b, dev, C) &&
         stats_ok(c.mean, dev, B * c.groups) && stats_ok(c.rstd, dev, B * c.groups);
}

// The calls the op kernels serve: CUDA tensors, or CPU ones in the tests without a GPU (cpu_calls:
// then every call runs the Python host functions, never a plan).
bool served(const Tensor& x) { return x.is_cuda() || cpu_calls; }

// An absent output as the ops return it: an empty 1-D tensor (a custom op cannot return None).
Tensor absent(const Tensor& like, at::ScalarType dtype) {
  return like.is_cuda() ? alloc({0}, dtype) : at::empty({0}, like.options().dtype(dtype));
}

// Serves one call of op K from the stack's arguments a[0..n), or returns false (nothing done).
template <int K>
bool serve_op(const c10::IValue* a, torch::jit::Stack* stack, size_t n) {
  Tensor outs[kMaxOuts];
  if constexpr (K == kRowFwd || K == kRowFusedFwd) {
    RowCall c;
    if (!parse_row_op(a, n, K == kRowFusedFwd, c) || !served(c.x)) return false;
    row_forward(c, /*store_stats=*/true, /*store_h=*/c.r.defined(), outs);  // y, mean, rstd, h, amax
    const at::ScalarType stat = outs[3].scalar_type();
    Tensor mean = outs[2].defined() ? outs[2] : absent(c.x, stat);
    torch::jit::drop(*stack, n);
    stack->emplace_back(std::move(outs[1]));
    if (K == kRowFusedFwd) stack->emplace_back(outs[4].defined() ? outs[4] : absent(c.x, c.x.scalar_type()));
    stack->emplace_back(std::move(mean));
    stack->emplace_back(std::move(outs[3]));
    if (K == kRowFusedFwd) stack->emplace_back(outs[5].defined() ? outs[5] : absent(c.x, stat));
  } else if constexpr (K == kGnFwd) {
    GnCall c;
    if (!parse_gn_op(a, n, c) || !served(c.x)) return false;
    gn_forward(c, outs);
    torch::jit::drop(*stack, n);
    for (int i = 1; i <= 3; i++) stack->emplace_back(std::move(outs[i]));
  } else if constexpr (K == kRowBwd || K == kRowFusedBwd) {
    RowBwdCall c;
    Key key;
    if (!parse_row_bwd_op(a, n, K == kRowFusedBwd, c) || !served(c.z) || !row_bwd_key(c, key)) return false;
    row_backward(c, key, outs);
    // as normkit._library._bwd returns them: an absent gradient is an empty tensor of x's dtype
    auto out = [&](int role) { return outs[role].defined() ? std::move(outs[role]) : absent(c.z, c.z.scalar_type()); };
    torch::jit::drop(*stack, n);
    stack->emplace_back(out(1));  // dx
    if (K == kRowFusedBwd) stack->emplace_back(out(4));  // dres in its own dtype
    stack->emplace_back(out(2));
    stack->emplace_back(out(3));
    if (K == kRowFusedBwd)
      for (int role : {5, 6, 7}) stack->emplace_back(out(role));  // dscale, dshift, dgate
  } else {
    static_assert(K == kGnBwd);
    GnBwdCall c;
    if (!parse_gn_bwd_op(a, n, c) || !served(c.x)) return false;
    gn_backward(c, outs);
    torch::jit::drop(*stack, n);
    stack->emplace_back(std::move(outs[1]));
    for (int role : {2, 3}) stack->emplace_back(outs[role].defined() ? std::move(outs[role]) : absent(c.x, c.x.scalar_type()));
  }
  return true;
}

// A boxed argument as the op's Python implementation takes it (dtypes arrive as integers).
py::object to_python(const c10::IValue& v, const c10::Argument& arg) {
  if (v.isNone()) return py::none();
  if (v.isTensor()) return wrap(v.toTensor());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isString()) return py::str(v.toStringRef());
  if (v.isInt()) {
    c10::TypePtr t = arg.real_type();
    if (auto o = t->cast<c10::OptionalType>()) t = o->getElementType();
    if (t->kind() == c10::TypeKind::ScalarTypeType)
      return py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
    return py::int_(v.toInt());
  }
  TORCH_CHECK(false, "normkit host path: argument ", arg.name(), " of type ", v.tagKind());
}

// Calls fn(*args) (the op's Python implementation or its Python autograd kernel) for the call on the
// stack and puts its outputs there.
// keys: passed first (the autograd kernel's signature) where given.
void call_python(PyObject* fn, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                 const c10::DispatchKeySet* keys = nullptr) {
  TORCH_CHECK(fn, "normkit host path: no Python kernel for ", op.schema().name());
  py::gil_scoped_acquire gil;
  const auto& args = op.schema().arguments();
  const size_t n = args.size();
  const size_t base = stack->size() - n;
  const size_t k = keys ? 1 : 0;
  py::tuple pa(n + k);
  if (keys) pa[0] = py::cast(*keys);  // torch._C.DispatchKeySet (pybind11 types are shared with torch)
  for (size_t i = 0; i < n; i++) pa[i + k] = to_python((*stack)[base + i], args[i]);
  py::object r = py::reinterpret_borrow<py::object>(fn)(*pa);
  torch::jit::drop(*stack, n);
  for (auto o : py::tuple(r)) stack->emplace_back(THPVariable_Unpack(o.ptr()));
}

template <int K>
void op_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  if (ops_enabled.load(std::memory_order_relaxed) && callbacks &&
      serve_op<K>(stack->data() + (stack->size() - n), stack, n)) {
    n_op_served++;
    return;
  }
  n_op_python++;
  call_python(op_python[K], op, stack);
}

template <int K>
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  bool grad = false;
  if (c10::GradMode::is_enabled())
    for (size_t i = stack->size() - n; i < stack->size() && !grad; i++)
      grad = (*stack)[i].isTensor() && (*stack)[i].toTensor().requires_grad();
  if (!grad) {  // as the custom op's autograd kernel does: on below autograd
    at::AutoDispatchBelowAutograd below;
    op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
    return;
  }
  n_op_autograd_python++;
  call_python(op_autograd[K], op, stack, &ks);
}

template <int K>
void register_op(torch::Library& lib, c10::DispatchKey backend, c10::DispatchKey autograd) {
  lib.impl(op_names[K], torch::dispatch(backend, torch::CppFunction::makeFromBoxedFunction<&op_kernel<K>>()));
  lib.impl(op_names[K], torch::dispatch(autograd, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<K>>()));
}

// impls: {op name: (its Python implementation, its Python autograd kernel)}. Registers the kernels
// for `device` ("CUDA"; the CPU tests use "CPU", where every call goes to the Python
// implementation) and returns the handle that keeps them registered.
py::capsule register_ops(py::dict impls, const std::string& device) {
  for (int k = 0; k < kNumOps; k++) {
    py::tuple t = impls[py::str(op_names[k])];
    PyObject* fns[2] = {py::object(t[0]).release().ptr(), py::object(t[1]).release().ptr()};
    std::swap(op_python[k], fns[0]);  // the previous ones (a second registration) are kept: a kernel may run
    std::swap(op_autograd[k], fns[1]);
  }
  const c10::DispatchKey backend = c10::parseDispatchKey(device);
  const c10::DispatchKey autograd = c10::parseDispatchKey("Autograd" + device);
  auto* lib = new torch::Library(torch::Library::IMPL, "normkit", std::nullopt, __FILE__, __LINE__);
  register_op<kRowFwd>(*lib, backend, autograd);
  register_op<kRowFusedFwd>(*lib, backend, autograd);
  register_op<kRowBwd>(*lib, backend, autograd);
  register_op<kRowFusedBwd>(*lib, backend, autograd);
  register_op<kGnFwd>(*lib, backend, autograd);
  register_op<kGnBwd>(*lib, backend, autograd);
  return py::capsule(lib, [](void* p) { delete static_cast<torch::Library*>(p); });
}

// Test hook: what op `name`'s kernel makes of a call (the Python arguments as the op takes them):
// its plan key (group_norm_bwd: True), or None where it leaves the call to Python. Any device.
py::object parse_op(const std::string& name, py::args args) {
  std::vector<c10::IValue> a;
  for (auto o : args) {
    PyObject* p = o.ptr();
    if (p == Py_None) a.emplace_back();
    else if (THPVariable_Check(p)) a.emplace_back(THPVariable_Unpack(p));
    else if (THPDtype_Check(p)) a.emplace_back(static_cast<int64_t>(reinterpret_cast<THPDtype*>(p)->scalar_type));
    else if (PyBool_Check(p)) a.emplace_back(p == Py_True);
    else if (PyLong_Check(p)) a.emplace_back(py::cast<int64_t>(o));
    else if (PyFloat_Check(p)) a.emplace_back(PyFloat_AS_DOUBLE(p));
    else if (PyUnicode_Check(p)) a.emplace_back(py::cast<std::string>(o));
    else TORCH_CHECK(false, "parse_op: argument of type ", Py_TYPE(p)->tp_name);
  }
  if (name == "row_norm_fwd" || name == "row_norm_fused_fwd") {
    const bool fused = name == "row_norm_fused_fwd";
    TORCH_CHECK(a.size() >= 8u && (fused || a.size() == 8u), "parse_op: arguments");
    RowCall c;
    if (!parse_row_op(a.data(), a.size(), fused, c)) return py::none();
    return py::cast(row_fwd_key(c, true, c.r.defined()).list());
  }
  if (name == "group_norm_fwd") {
    TORCH_CHECK(a.size() == gn_op_args.n, "parse_op: arguments");
    GnCall c;
    if (!parse_gn_op(a.data(), a.size(), c)) return py::none();
    return py::cast(gn_fwd_key(c).list());
  }
  if (name == "row_norm_bwd" || name == "row_norm_fused_bwd") {
    const bool fused = name == "row_norm_fused_bwd";
    TORCH_CHECK(a.size() >= 12u && (fused || a.size() == 12u), "parse_op: arguments");
    RowBwdCall c;
    Key key;
    if (!parse_row_bwd_op(a.data(), a.size(), fused, c) || !row_bwd_key(c, key)) return py::none();
    return py::cast(key.list());
  }
  TORCH_CHECK(name == "group_norm_bwd" && a.size() <= gn_bwd_op_args.n && a.size() >= gn_bwd_op_args.n_min,
              "parse_op: ", name, " with ", a.size(), " arguments");
  GnBwdCall c;
  return parse_gn_bwd_op(a.data(), a.size(), c) ? py::cast(true) : py::none();
}

// ----------------------------------------------------------------------------- module

#define NORMKIT_FASTCALL(fn) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fn)), METH_FASTCALL | METH_KEYWORDS
PyMethodDef fast_methods[] = {
    {"row_norm", NORMKIT_FASTCALL(py_row_norm),
     "row_norm(x, normalized_shape, weight, bias, eps, rms, activation, backend[, residual, prenorm, residual_dtype, "
     "weight_offset, out_dtype, out_scale, return_amax, autocast[, mod_scale, mod_shift, gate]]) -> y or "
     "(y[, h][, amax]), or None: not its case"},
    {"group_norm", NORMKIT_FASTCALL(py_group_norm),
     "group_norm(x, num_groups, weight, bias, eps, activation, backend) -> Tensor, or None: not its case"},
    {"_parse_row", NORMKIT_FASTCALL(py_parse_row), "test hook: row_norm's reading of a call"},
    {"_parse_gn", NORMKIT_FASTCALL(py_parse_gn), "test hook: group_norm's reading of a call"},
    {nullptr, nullptr, 0, nullptr}};

// What needs no GPU: the tensor types, key sets and the activation names (at import).
void setup(py::tuple activations, py::tuple autocast_upcasts, py::sequence host_row_args, py::tuple host_row_lengths) {
  set_host_row_args(host_row_args, host_row_lengths);
  upcasts[0] = py::cast<bool>(autocast_upcasts[0]);  // layer_norm
  upcasts[1] = py::cast<bool>(autocast_upcasts[1]);  // rms_norm
  tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  py::object parameter = py::module_::import("torch.nn").attr("Parameter");
  parameter_type = reinterpret_cast<PyTypeObject*>(parameter.release().ptr());
  TORCH_CHECK(activations.size() < 8, "normkit host path: too many activations");
  n_acts = static_cast<int>(activations.size());
  act_strings.clear();
  for (int i = 0; i < n_acts; i++) {
    act_names[i + 1] = py::object(activations[i]).release().ptr();
    act_strings.push_back(py::cast<std::string>(activations[i]));
  }
  triton_name = PyUnicode_InternFromString("triton");
  using K = c10::DispatchKey;
  bad_tensor_keys = c10::DispatchKeySet({K::Python, K::PythonTLSSnapshot, K::FuncTorchBatched,
                                         K::FuncTorchGradWrapper, K::Functionalize, K::Conjugate, K::Negative,
                                         K::ZeroTensor, K::BatchedNestedTensor});
  bad_tls_keys = c10::DispatchKeySet({K::FuncTorchDynamicLayerFrontMode, K::Python, K::PythonDispatcher,
                                      K::PythonTLSSnapshot, K::Tracer});  // Tracer: torch.jit.trace
}

// What needs the driver and a CUDA device: called on the first CUDA call. "" or why it cannot run.
void set_callbacks(py::dict cbs);

std::string init(py::dict cbs) {
  std::string why = cu::load();
  if (!why.empty()) return why;
  // torch's CUDA caching allocator (or the one configured in its place), as at::empty uses it
  cuda_allocator = at::empty({1}, at::TensorOptions().device(at::kCUDA)).storage().allocator();
  if (!cuda_allocator) return "torch's CUDA tensors have no allocator to share";
  set_callbacks(cbs);
  return "";
}

void set_callbacks(py::dict cbs) {
  auto* c = new Callbacks();
  c->row_fwd = cbs["row_fwd"];
  c->row_bwd = cbs["row_bwd"];
  c->gn_fwd = cbs["gn_fwd"];
  c->gn_bwd = cbs["gn_bwd"];
  c->row_vjp = cbs["row_vjp"];
  c->gn_vjp = cbs["gn_vjp"];
  callbacks = c;
}

}  // namespace

// Test hooks: the layout logic on plain tensors (no GPU needed).
py::tuple rows_view_py(const Tensor& t, int64_t k) {
  int64_t M = 0, N = 0, s = 0;
  bool ok = rows_view(t, k, M, N, s);
  return py::make_tuple(ok, M, N, s);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  PyModule_AddFunctions(m.ptr(), fast_methods);
  m.def("_setup", &setup);
  m.def("_init", &init);
  m.def("_rows_view", &rows_view_py);
  m.def("_gn_layout", [](const Tensor& t) { return gn_layout(t); });
  m.def("_register_ops", &register_ops);
  m.def("_set_op_args", &set_op_args);  // load_extension's; tests add an argument the kernels do not read
  m.def("_serve_cpu_calls", [](py::dict cbs, bool on) {  // tests without a GPU (cpu_calls)
    if (!callbacks) set_callbacks(cbs);
    cpu_calls = on;
  });
  m.def("_parse_op", &parse_op);
  m.def("_set_ops_enabled", [](bool on) { ops_enabled = on; });
  m.def("_ops_enabled", []() { return ops_enabled.load(); });
  m.def("_stats", []() {
    std::lock_guard<std::mutex> g(cache_mu);
    py::dict d;
    d["plans"] = cache.size();
    d["replays"] = n_replays.load();
    d["python_runs"] = n_python.load();
    d["records"] = n_records.load();
    d["record_failures"] = n_failures.load();
    d["differentiable_backwards"] = n_vjp.load();
    d["misaligned"] = n_misaligned.load();
    d["op_served"] = n_op_served.load();  // op calls through the dispatcher served by the C++ kernels
    d["op_python"] = n_op_python.load();  // ... left to the op's Python implementation
    d["op_autograd_python"] = n_op_autograd_python.load();  // ... with grad: the op's Python autograd
    d["last_failure"] = last_failure;
    return d;
  });
  m.def("_clear", []() {
    std::lock_guard<std::mutex> g(cache_mu);
    cache.clear();
  });
}

