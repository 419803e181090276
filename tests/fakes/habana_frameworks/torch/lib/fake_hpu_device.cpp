// TEST DOUBLE: a host-memory `hpu` device for the bridge simulator (tests only).
//
// The real bridge (libhabana_pytorch*_plugin.so, loaded by habana_frameworks/torch/__init__.py) gives torch's
// built-in HPU device type an allocator, a device guard and kernels for the HPU dispatch key. This library
// does the same with host memory: tensors report device hpu:0 and their bytes live in ordinary malloc'ed
// memory, so every CPU kernel can run on them. What it registers:
// - an allocator for DeviceType::HPU (c10::SetAllocator), counting live and peak bytes for torch.hpu's
//   memory API;
// - a device guard with one device (hpu:0, the process's one Gaudi) and one stream (C10_REGISTER_GUARD_IMPL),
//   so the autograd engine and torch.device('hpu') contexts work;
// - kernels on the HPU key for factories, copies, resizing and the view ops, which must alias their input;
// - every other aten op: a boxed fallback that runs the CPU kernel on CPU aliases of the same memory (no
//   copy), then hands the results back as hpu tensors sharing that memory. In-place and out= ops therefore
//   write into the hpu tensor itself.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/detail/HPUHooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <cstring>

namespace {

constexpr c10::DeviceType kHpu = c10::DeviceType::HPU;

// One device per process, as the bridge has it: the process opens one Gaudi (its module, HLS_MODULE_ID) and torch
// sees it as hpu:0 whatever the module. backend/habana_device/HPUDevice.cpp get_or_create_aten_device() answers
// {kHPU, 0}; HPUAllocator.cpp's storages carry device index allocator_active_device_id, TORCH_CHECKed to be 0;
// HPUGuardImpl.h's deviceCount() is 1 and exchangeDevice to another index fails its check. How many Gaudis the
// machine has is torch.hpu.device_count()'s answer (synDeviceGetCount, Python side), not the guard's.
c10::Device current() { return c10::Device(kHpu, 0); }
// HPUGuardImpl.h exchangeDevice: an index other than the current one (0) becomes the allocator's active device,
// which TORCH_CHECK requires to be 0.
void check_active(int index) { TORCH_CHECK(index == 0, "habana active device: ", index, " != 0"); }

std::atomic<int64_t> live_bytes{0};
std::atomic<int64_t> peak_bytes{0};
std::atomic<int64_t> allocations{0};

void count_allocation(int64_t n) {
  int64_t now = (live_bytes += n);
  int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  ++allocations;
}

// Each block remembers its size in a header so the deleter can update the counters.
constexpr size_t kHeader = 64;  // keeps the payload 64-byte aligned, as CPU kernels expect

void release(void* payload) {
  if (payload == nullptr) return;
  char* block = static_cast<char*>(payload) - kHeader;
  live_bytes -= *reinterpret_cast<int64_t*>(block);
  std::free(block);
}

struct HostBackedHpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) return {nullptr, nullptr, &release, current()};
    void* block = std::aligned_alloc(kHeader, kHeader + ((n + kHeader - 1) / kHeader) * kHeader);
    TORCH_CHECK(block != nullptr, "fake hpu: out of host memory allocating ", n, " bytes");
    *static_cast<int64_t*>(block) = static_cast<int64_t>(n);
    count_allocation(static_cast<int64_t>(n));
    void* payload = static_cast<char*>(block) + kHeader;
    return {payload, payload, &release, current()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

HostBackedHpuAllocator hpu_allocator;

struct OneDeviceGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kHpu; }
  // HPUGuardImpl.h: exchangeDevice to another index than 0 fails ("habana active device: N != 0"); setDevice
  // takes any index and changes nothing (its comment: "there is always 1 device in play"); uncheckedSetDevice
  // warns about an index other than 0.
  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (old.index() != d.index()) check_active(d.index());
    return old;
  }
  c10::Device getDevice() const override { return current(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() != 0) TORCH_WARN("habana active device: ", d.index(), " != 0");
  }
  c10::Stream getStream(c10::Device d) const noexcept override {  // noexcept in torch 2.6's interface
    return c10::Stream(c10::Stream::DEFAULT, d.has_index() ? d : current());
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return getStream(d); }
  c10::Stream getNewStream(c10::Device d, int) const override { return getStream(d); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getStream(d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return getStream(current()); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }  // HPUGuardImpl.h
  // Work is synchronous: events are always complete and there is nothing to wait for.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(HPU, OneDeviceGuard);

}  // namespace

// The accelerator hooks: torch.accelerator and the autograd engine ask them which accelerator is present.
namespace at {
struct HPUHooks final : at::HPUHooksInterface {
  HPUHooks(at::HPUHooksArgs) {}
  void init() const override {}
  bool hasHPU() const override { return true; }
#if TORCH_RELEASE >= 207  // the accelerator hooks' isBuilt / isAvailable came with torch 2.7
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
#endif
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  // One device in the process (the bridge's own hooks, HPUHooksInterface.cpp, answer every device query from
  // its guard, HPUGuardImpl.h).
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    if (d != 0) check_active(d);
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  c10::Device getDeviceFromPtr(void*) const override { return current(); }
  bool isPinnedPtr(const void*) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
};
REGISTER_HPU_HOOKS(HPUHooks);

// A Gaudi's torch is a CPU build (Intel's PyTorch beside the bridge): its CUDA hooks are the default interface,
// built for nothing, and HPU is the one accelerator. PyPI's Linux builds of the torch each Gaudi release ships
// (2.6-2.10) are CUDA builds: there torch's accelerator query (at::getAccelerator, behind torch.accelerator, the
// DataLoader's pin-memory check and the autograd engine's streams) finds two built and refuses ("Cannot have both
// HPU and cuda."). torch creates its CUDA hooks object while torch._C loads, before any plugin, so the simulated
// plugin makes that object the default interface in place (its dynamic type: both classes hold no data): every
// query then answers as a CPU build's. A test double's stand-in, nothing of the bridge.
#if TORCH_RELEASE >= 207  // torch 2.6 asks whether CUDA devices exist, not whether CUDA is built: no refusal
struct CPUBuildCUDAHooks final : at::CUDAHooksInterface {};
struct StandAsACPUBuild {
  StandAsACPUBuild() {
    auto& hooks = const_cast<at::CUDAHooksInterface&>(at::detail::getCUDAHooks());
    if (!hooks.isBuilt()) return;  // a CPU build already
    static_assert(sizeof(CPUBuildCUDAHooks) == sizeof(void*), "a vtable pointer only");
    CPUBuildCUDAHooks cpu_build;
    std::memcpy(static_cast<void*>(&hooks), static_cast<void*>(&cpu_build), sizeof(void*));  // the vtable
  }
} stand_as_a_cpu_build;
#endif
}  // namespace at

namespace {

struct RegisterAllocator {
  RegisterAllocator() { c10::SetAllocator(kHpu, &hpu_allocator); }
} register_allocator;

// A CPU tensor over the same bytes (sizes, strides and offset kept). Its storage holds the hpu storage alive
// and is resizable: a CPU kernel that resizes an out= tensor moves it to fresh CPU memory, which the fallback
// then hands to the hpu tensor.
at::Tensor cpu_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kHpu) return t;
  auto* keep = new c10::Storage(t.storage());
  c10::DataPtr ptr(keep->mutable_data(), keep, [](void* c) { delete static_cast<c10::Storage*>(c); }, at::kCPU);
  c10::Storage storage(c10::Storage::use_byte_size_t(), keep->nbytes(), std::move(ptr), c10::GetCPUAllocator(), true);
  auto cpu = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      t.dtype());
  cpu.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return cpu;
}

// An hpu tensor over the bytes of a CPU result (no copy): its storage keeps the CPU storage alive.
at::Tensor hpu_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != at::kCPU) return t;
  auto* ctx = new c10::Storage(t.storage());
  void* data = ctx->mutable_data();
  count_allocation(static_cast<int64_t>(ctx->nbytes()));  // the device holds these bytes until the alias dies
  c10::DataPtr ptr(data, ctx, [](void* c) {
    auto* held = static_cast<c10::Storage*>(c);
    live_bytes -= static_cast<int64_t>(held->nbytes());
    delete held;
  }, current());
  c10::Storage storage(c10::Storage::use_byte_size_t(), ctx->nbytes(), std::move(ptr), &hpu_allocator, true);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::HPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return out;
}

// Allocations land on the process's one device, hpu:0, whatever index a factory names: the storage carries the
// allocator's device (HPUAllocator.cpp CreateDataPtr, index allocator_active_device_id, which is 0). The bridge's
// factory kernels themselves (empty_hpu_lazy, the eager empty) are not published: closed source.
at::Tensor empty_hpu(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                     std::optional<at::Device> device, std::optional<bool>, std::optional<at::MemoryFormat> fmt) {
  return at::detail::empty_generic(size, &hpu_allocator, c10::DispatchKeySet(c10::DispatchKey::HPU),
                                   c10::dtype_or_default(dtype), fmt);
}

at::Tensor empty_strided_hpu(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &hpu_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::HPU), c10::dtype_or_default(dtype));
}

// empty_like and the other "like" factories: contiguous on hpu, whatever the source's layout (as above).
at::Tensor empty_like_hpu(const at::Tensor& self, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                          std::optional<at::Device>, std::optional<bool>, std::optional<at::MemoryFormat>) {
  return empty_hpu(self.sizes(), dtype.has_value() ? dtype : std::optional<at::ScalarType>(self.scalar_type()),
                   std::nullopt, std::nullopt, std::nullopt, at::MemoryFormat::Contiguous);
}

at::Tensor& copy_hpu(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  cpu_alias(self).copy_(cpu_alias(src), non_blocking);
  return self;
}

at::Tensor copy_from_hpu(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  cpu_alias(dst).copy_(cpu_alias(self), non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize_hpu(const at::Tensor& self, const at::Tensor& dst) {
  const_cast<at::Tensor&>(dst).resize_(self.sizes());
  return copy_from_hpu(self, dst, false);
}

const at::Tensor& resize_hpu(const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.sizes() == size && !fmt.has_value()) return self;  // as the CPU's resize_: nothing to do
  int64_t needed = 0;
  impl->set_sizes_contiguous(size);
  if (fmt.has_value() && *fmt != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*fmt);
  needed = static_cast<int64_t>(at::detail::computeStorageNbytes(self.sizes(), self.strides(),
                                                                  self.dtype().itemsize(), self.storage_offset()));
  if (needed > static_cast<int64_t>(self.storage().nbytes())) {
    auto fresh = hpu_allocator.allocate(needed);
    if (self.storage().nbytes() > 0) std::memcpy(fresh.get(), self.storage().data(), self.storage().nbytes());
    self.storage().set_data_ptr_noswap(std::move(fresh));
    self.storage().set_nbytes(needed);
  }
  return self;
}

at::Tensor& set_storage_hpu(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                            c10::IntArrayRef stride) {
  self.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {  // set_'s default: contiguous
    self.unsafeGetTensorImpl()->set_sizes_contiguous(size);
    self.unsafeGetTensorImpl()->set_storage_offset(offset);
  } else {
    self.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride, offset);
  }
  return self;
}

// In lazy mode the bridge's set_ kernels without a storage offset (set_(), set_.source_Storage,
// set_.source_Tensor) are HABANA_ASSERT(false, ...) then std::terminate() (habana_kernels/lazy_kernels.cpp):
// the process aborts. torch's UntypedStorage.resize_ on an hpu storage goes through set_.source_Storage
// (at::native::resize_bytes_nocuda), so FSDP2's freeing and regrowing of gathered parameters aborts too.
// set_.source_Storage_storage_offset has a lazy kernel and works. Set from Python when the bridge loads.
std::atomic<bool> lazy_mode{false};
void abort_in_lazy_mode(const char* op) {
  if (!lazy_mode.load()) return;
  std::fprintf(stderr, "%s: This function should not be called in lazy flow. Something went wrong.\n", op);
  std::fflush(stderr);
  std::terminate();
}

at::Tensor& set_source_storage_hpu(at::Tensor& self, c10::Storage source) {
  abort_in_lazy_mode("set_.source_Storage");
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_hpu(self, std::move(source), 0, {n}, {});
}

at::Tensor& set_tensor_hpu(at::Tensor& self, const at::Tensor& source) {
  abort_in_lazy_mode("set_.source_Tensor");
  if (!self.is_same(source)) set_storage_hpu(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
  return self;
}

at::Tensor& set_empty_hpu(at::Tensor& self) {
  abort_in_lazy_mode("set_");
  return set_storage_hpu(self, c10::Storage(c10::Storage::use_byte_size_t(), 0, hpu_allocator.allocate(0), &hpu_allocator, true), 0, {0}, {});
}

// Ops that return a view must alias their input's storage: run the CPU kernel on the alias and rebuild the
// view over the hpu tensor's own storage.
at::Tensor rebase_view(const at::Tensor& base, const at::Tensor& cpu_view) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), cpu_view.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(cpu_view.sizes(), cpu_view.strides(), cpu_view.storage_offset());
  return out;
}

at::Tensor view_hpu(const at::Tensor& self, c10::SymIntArrayRef size) {
  return rebase_view(self, cpu_alias(self).view_symint(size));
}
at::Tensor view_dtype_hpu(const at::Tensor& self, at::ScalarType dtype) {
  return rebase_view(self, cpu_alias(self).view(dtype));
}
at::Tensor as_strided_hpu(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                          std::optional<c10::SymInt> offset) {
  return rebase_view(self, cpu_alias(self).as_strided_symint(size, stride, std::move(offset)));
}
at::Tensor reshape_alias_hpu(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return rebase_view(self, cpu_alias(self).as_strided_symint(size, stride));
}
at::Tensor unfold_hpu(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return rebase_view(self, cpu_alias(self).unfold(dim, size, step));
}
at::Tensor view_as_real_hpu(const at::Tensor& self) { return rebase_view(self, at::view_as_real(cpu_alias(self))); }
at::Tensor view_as_complex_hpu(const at::Tensor& self) {
  return rebase_view(self, at::view_as_complex(cpu_alias(self)));
}

// The HPU's own random generator (hpu/random.py reads and seeds it): random ops on hpu tensors draw from it,
// not from the CPU generator, as on a Gaudi. The CPU kernels draw from the default CPU generator, so its
// state is swapped with this one around each op tagged nondeterministic_seeded.
at::Generator& hpu_generator() {
  static at::Generator g = at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val);
  return g;
}

struct HpuRandomScope {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  explicit HpuRandomScope(bool active) {
    if (!active) return;
    saved = cpu.get_state();
    cpu.set_state(hpu_generator().get_state());
  }
  ~HpuRandomScope() {
    if (!saved.defined()) return;
    hpu_generator().set_state(cpu.get_state());
    cpu.set_state(saved);
  }
};

// SDPA's backend choice: the math composition (ops that torch.compile's fake tensors can trace); the CPU's
// choice would hand traced hpu tensors to a CPU kernel.
int64_t fused_sdp_choice_hpu(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             double, bool, std::optional<double>, bool) {
  return 0;  // sdp::SDPBackend::math
}

// Every other op: CPU kernel on aliases of the same memory. Inputs that are views or in-place targets keep
// working because the aliases share the bytes; results that the CPU kernel returned as one of its (aliased)
// inputs are handed back as that hpu input.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  std::vector<at::Tensor> originals;
  std::vector<at::Tensor> aliases;
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (hpu tensor, its CPU alias) for out= / in-place
  const size_t first = stack->size() - n_args;
  for (size_t k = first; k < stack->size(); ++k) {
    c10::IValue& arg = (*stack)[k];
    if (arg.isTensor()) {
      auto t = arg.toTensor();
      if (t.defined() && t.device().type() == kHpu) {
        auto a = cpu_alias(t);
        originals.push_back(t);
        aliases.push_back(a);
        arg = a;
        const auto* info = schema.arguments()[k - first].alias_info();
        if (info != nullptr && info->isWrite()) written.emplace_back(t, a);
      }
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        at::Tensor t = list.get(i);
        if (t.defined() && t.device().type() == kHpu) {
          auto a = cpu_alias(t);
          originals.push_back(t);
          aliases.push_back(a);
          list.set(i, a);
        }
      }
      arg = list;
    } else if (arg.isList()) {  // Tensor?[] (index)
      auto list = arg.toList();
      for (size_t i = 0; i < list.size(); ++i) {
        c10::IValue v = list.get(i);
        if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kHpu) {
          list.set(i, cpu_alias(v.toTensor()));
        }
      }
      arg = list;
    } else if (arg.isDevice() && arg.toDevice().type() == kHpu) {
      arg = c10::IValue(c10::Device(at::kCPU));
    }
  }
  // Factory-style arguments (device=hpu) are run on the CPU and moved back below.
  {
    HpuRandomScope random(op.hasTag(at::Tag::nondeterministic_seeded));
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  for (auto& [hpu, cpu] : written) {  // resized by the kernel: the hpu tensor takes the new memory and shape
    if (cpu.storage().data() != hpu.storage().data() || cpu.sizes() != hpu.sizes() || cpu.strides() != hpu.strides()) {
      auto* impl = hpu.unsafeGetTensorImpl();
      if (cpu.storage().data() != hpu.storage().data()) impl->set_storage_keep_dtype(hpu_alias(cpu).storage());
      impl->set_sizes_and_strides(cpu.sizes(), cpu.strides(), cpu.storage_offset());
    }
  }
  auto back = [&](const at::Tensor& r) -> at::Tensor {
    if (!r.defined() || r.device().type() != at::kCPU) return r;
    for (size_t i = 0; i < aliases.size(); ++i) {
      if (r.is_same(aliases[i])) return originals[i];
    }
    // A Gaudi's kernels write contiguous outputs: torch's fake tensors assume it for hpu
    // (torch/_subclasses/fake_impls.py is_noncontiguous_supported), so compiled graphs' views rely on it.
    return hpu_alias(r.is_contiguous() ? r : r.contiguous());
  };
  for (size_t k = stack->size() - schema.returns().size(); k < stack->size(); ++k) {
    c10::IValue& r = (*stack)[k];
    if (r.isTensor()) {
      r = back(r.toTensor());
    } else if (r.isTensorList()) {
      auto list = r.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) list.set(i, back(list.get(i)));
      r = list;
    }
  }
}

// ---- torch.autocast('hpu'), as hpu_ops/autocast_helpers.h registers it ---------------------------------------
// An op whose name is in the lower-precision list runs with its floating hpu inputs cast to the autocast dtype
// (layer/group/instance/batch norm: the first input only); in the fp32 list, cast to float32; in the fixed
// promote list (and in neither list), in the widest floating type of its inputs; any other op falls through.
// The lists are the ones the bridge read when it loaded (set from Python: fake_hpu::set_autocast_lists).
std::mutex lists_mutex;
std::unordered_set<std::string> lower_ops, fp32_ops;
const std::unordered_set<std::string> lower_first_ops{"layer_norm", "group_norm", "instance_norm", "batch_norm"};
const std::unordered_set<std::string> promote_ops{"add", "addcmul", "addcdiv", "cat", "div", "exp",
                                                  "mul", "pow", "sub", "iadd", "truediv", "stack"};

bool eligible(const at::Tensor& t) {
  return t.defined() && t.device().type() == kHpu && t.is_floating_point() && t.scalar_type() != at::kDouble;
}

void autocast_hpu(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  std::string name = op.schema().name();
  name = name.substr(name.find("::") + 2);
  enum { kLower, kLowerFirst, kFp32, kPromote, kNone } policy = kNone;
  {
    std::lock_guard<std::mutex> lock(lists_mutex);
    if (lower_ops.count(name)) policy = lower_first_ops.count(name) ? kLowerFirst : kLower;
    else if (fp32_ops.count(name)) policy = kFp32;
    else if (promote_ops.count(name)) policy = kPromote;
  }
  for (const auto& arg : op.schema().arguments()) {  // out= and in-place variants write their own dtype: no cast
    if (arg.alias_info() != nullptr && arg.alias_info()->isWrite()) policy = kNone;
  }
  const c10::DispatchKeySet below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::AutocastHPU);
  if (policy == kNone) {  // a fallthrough: composite ops decompose into ops that autocast sees again
    op.redispatchBoxed(below, stack);
    return;
  }
  const size_t n_args = op.schema().arguments().size();
  at::ScalarType to = at::autocast::get_autocast_dtype(at::kHPU);
  if (policy == kFp32) to = at::kFloat;
  if (policy == kPromote) {
    for (size_t k = stack->size() - n_args; k < stack->size(); ++k) {
      const c10::IValue& arg = (*stack)[k];
      if (arg.isTensor() && eligible(arg.toTensor()) && arg.toTensor().scalar_type() == at::kFloat) to = at::kFloat;
      if (arg.isTensorList()) {
        for (const at::Tensor& t : arg.toTensorVector()) {
          if (eligible(t) && t.scalar_type() == at::kFloat) to = at::kFloat;
        }
      }
    }
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastHPU);
  const size_t first = stack->size() - n_args;
  const size_t end = policy == kLowerFirst ? first + 1 : stack->size();
  for (size_t k = first; k < end; ++k) {
    c10::IValue& arg = (*stack)[k];
    if (arg.isTensor()) {
      at::Tensor t = arg.toTensor();
      if (eligible(t) && t.scalar_type() != to) arg = t.to(to);
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        at::Tensor t = list.get(i);
        if (eligible(t) && t.scalar_type() != to) list.set(i, t.to(to));
      }
      arg = list;
    }
  }
  op.redispatchBoxed(below, stack);
}

void set_autocast_lists(std::vector<std::string> lower, std::vector<std::string> fp32) {
  std::lock_guard<std::mutex> lock(lists_mutex);
  lower_ops = {lower.begin(), lower.end()};
  fp32_ops = {fp32.begin(), fp32.end()};
}

// The bridge has its own kernel for each aten op it supports; torch's CompositeExplicitAutograd kernels (which
// would otherwise take precedence over the fallback, e.g. math_native_layer_norm) are decompositions a real
// backend does not run, and the NonFunctional ones of structured ops (exp, add, ...) allocate outputs in the
// input's layout where a Gaudi writes them contiguous. Every aten op with a CPU kernel, no hpu kernel yet and no alias in its results is
// therefore routed to the CPU kernel too (device changes, copies and factories keep their own path).
int64_t route_cpu_kernels() {
  static std::unique_ptr<torch::Library> lib;
  static std::deque<std::string> names;
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::HPU, __FILE__, __LINE__);
  // (ops with an hpu kernel above are skipped anyway; these keep torch's own path: device moves and pinning)
  const std::unordered_set<std::string> own_path{"_to_copy", "_local_scalar_dense", "_pin_memory", "is_pinned",
                                                 "lift_fresh"};
  int64_t routed = 0;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasSchema() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::HPU) ||
        !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))) {
      continue;
    }
    std::string base = name.name.substr(6);
    if (own_path.count(base)) continue;
    bool aliases = false;
    for (const auto& r : op->schema().returns()) aliases = aliases || (r.alias_info() != nullptr && !r.alias_info()->isWrite());
    if (aliases) continue;
    names.push_back(name.overload_name.empty() ? base : base + "." + name.overload_name);
    lib->impl(names.back().c_str(), torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
    ++routed;
  }
  return routed;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, HPU, m) {
  m.impl("empty.memory_format", empty_hpu);
  m.impl("empty_strided", empty_strided_hpu);
  m.impl("empty_like", empty_like_hpu);
  m.impl("copy_", copy_hpu);
  m.impl("_copy_from", copy_from_hpu);
  m.impl("_copy_from_and_resize", copy_from_and_resize_hpu);
  m.impl("resize_", resize_hpu);
  m.impl("set_.source_Storage_storage_offset", set_storage_hpu);
  m.impl("set_.source_Storage", set_source_storage_hpu);
  m.impl("set_.source_Tensor", set_tensor_hpu);
  m.impl("set_", set_empty_hpu);
  m.impl("view", view_hpu);
  m.impl("view.dtype", view_dtype_hpu);
  m.impl("as_strided", as_strided_hpu);
  m.impl("_reshape_alias", reshape_alias_hpu);
  m.impl("unfold", unfold_hpu);
  m.impl("view_as_real", view_as_real_hpu);
  m.impl("view_as_complex", view_as_complex_hpu);
  m.impl("_fused_sdp_choice", fused_sdp_choice_hpu);
}

TORCH_LIBRARY_IMPL(_, AutocastHPU, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&autocast_hpu>());
}

TORCH_LIBRARY_IMPL(_, HPU, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>()); }

// torch.hpu's memory API reads these (habana_frameworks/torch/hpu/memory.py in the bridge).
TORCH_LIBRARY(fake_hpu, m) {
  m.def("memory_allocated() -> int", [] { return live_bytes.load(); });
  m.def("max_memory_allocated() -> int", [] { return peak_bytes.load(); });
  m.def("reset_peak_memory_stats() -> ()", [] { peak_bytes.store(live_bytes.load()); });
  m.def("num_allocs() -> int", [] { return allocations.load(); });
  m.def("set_autocast_lists(str[] lower, str[] fp32) -> ()", set_autocast_lists);
  m.def("route_cpu_kernels() -> int", route_cpu_kernels);
  m.def("set_lazy(bool lazy) -> ()", [](bool lazy) { lazy_mode = lazy; });
  m.def("get_rng_state() -> Tensor", [] { return hpu_generator().get_state(); });
  m.def("set_rng_state(Tensor state) -> ()", [](const at::Tensor& state) { hpu_generator().set_state(state); });
  m.def("manual_seed(int seed) -> ()", [](int64_t seed) { hpu_generator().set_current_seed(seed); });
  m.def("initial_seed() -> int", [] { return static_cast<int64_t>(hpu_generator().current_seed()); });
}
