// Implementation of shim.h. Only what Rust and Python cannot do on a stock torch wheel:
// every entry point catches all C++ exceptions and turns them into an rg_status.
#include "shim.h"

#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/tensor.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/input_buffer.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/csrc/autograd/utils/warnings.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/utils/torch_dispatch_mode.h>

#include <ATen/SavedTensorHooks.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::FunctionPreHook;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using torch::dynamo::autograd::AutogradCompilerCall;
using torch::dynamo::autograd::CompiledNodeArgs;
using torch::dynamo::autograd::NodeCall;
using torch::dynamo::autograd::PyCompilerGuard;
using torch::dynamo::autograd::PyCompilerInterface;
using torch::dynamo::autograd::SizeInput;
using torch::dynamo::autograd::SwapSavedVariables;
using torch::dynamo::autograd::TraceState;
using torch::dynamo::autograd::TensorArg;
using torch::dynamo::autograd::TensorArgs;

namespace {

// ---- errors ------------------------------------------------------------------------------

thread_local std::string last_message;
thread_local int last_kind = RG_KIND_RUNTIME;

rg_status fail(int kind, const char* message) {
  last_kind = kind;
  last_message = message;
  return RG_ERROR;
}

// A torch error as torch's CATCH_CORE_ERRORS hands it to Python: ATen type names made
// Python ones ("CPUDoubleType" -> "torch.DoubleTensor").
rg_status fail_torch(int kind, const c10::Error& e) {
  last_kind = kind;
  last_message = torch::processErrorMsg(e.what_without_backtrace());
  return RG_ERROR;
}

// Maps the in-flight exception to a status, the way torch's HANDLE_TH_ERRORS maps it to a
// Python exception type.
rg_status translate_current_exception() {
  try {
    throw;
  } catch (python_error& e) {
    e.restore();
    return RG_PYTHON_ERROR;
  } catch (const c10::IndexError& e) {
    return fail_torch(RG_KIND_INDEX, e);
  } catch (const c10::ValueError& e) {
    return fail_torch(RG_KIND_VALUE, e);
  } catch (const c10::TypeError& e) {
    return fail_torch(RG_KIND_TYPE, e);
  } catch (const c10::NotImplementedError& e) {
    return fail_torch(RG_KIND_NOT_IMPLEMENTED, e);
  } catch (const c10::LinAlgError& e) {
    return fail_torch(RG_KIND_LINALG, e);
  } catch (const c10::Error& e) {
    return fail_torch(RG_KIND_RUNTIME, e);
  } catch (const std::bad_alloc& e) {
    return fail(RG_KIND_MEMORY, e.what());
  } catch (const std::exception& e) {
    return fail(RG_KIND_RUNTIME, e.what());
  } catch (...) {
    return fail(RG_KIND_RUNTIME, "unknown C++ exception");
  }
}

#define RG_TRY try {
#define RG_CATCH                        \
  }                                     \
  catch (...) {                         \
    return translate_current_exception(); \
  }                                     \
  return RG_OK;

// The opaque C types are never defined: they are the torch types themselves.
Node* as_node(rg_node* n) {
  return reinterpret_cast<Node*>(n);
}
rg_node* as_rg(Node* n) {
  return reinterpret_cast<rg_node*>(n);
}
const at::Tensor& as_tensor(const rg_tensor* t) {
  return *reinterpret_cast<const at::Tensor*>(t);
}
SavedVariable* as_sv(const rg_sv* sv) {
  return const_cast<SavedVariable*>(reinterpret_cast<const SavedVariable*>(sv));
}
// The tensor of a handle (null: undefined), moved out of it; the handle stays to be freed.
at::Tensor take_tensor(rg_tensor* t) {
  return t ? std::move(*reinterpret_cast<at::Tensor*>(t)) : at::Tensor();
}
rg_tensor* new_handle(at::Tensor t) {
  if (!t.defined()) {
    return nullptr;
  }
  return reinterpret_cast<rg_tensor*>(new at::Tensor(std::move(t)));
}
variable_list to_list(const rg_tensor* const* ts, size_t n) {
  variable_list out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.emplace_back(ts[i] ? as_tensor(ts[i]) : at::Tensor());
  }
  return out;
}
// The tensors of `n` handles (null: undefined), moved out of them.
variable_list take_list(rg_tensor* const* ts, size_t n) {
  variable_list out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.emplace_back(take_tensor(ts[i]));
  }
  return out;
}

void write_list(variable_list&& list, rg_tensor** out) {
  for (size_t i = 0; i < list.size(); ++i) {
    out[i] = new_handle(std::move(list[i]));
  }
}

// Node types are told apart by their C++ type name: PyNode and the Python hook structs
// export no typeinfo from libtorch_python, so dynamic_cast cannot reach them.
constexpr const char* kPyNode = "N5torch8autograd6PyNodeE";
constexpr const char* kCppNodePrefix = "N5torch8autograd7CppNodeI";
constexpr const char* kGeneratedPrefix = "N5torch8autograd9generated";
constexpr const char* kPyTensorPreHook = "N5torch8autograd23PyFunctionTensorPreHookE";
constexpr const char* kPyPreHook = "N5torch8autograd17PyFunctionPreHookE";
constexpr const char* kPyPostHook = "N5torch8autograd18PyFunctionPostHookE";

constexpr const char* kPyPostAccGradHooks = "N5torch8autograd32PyFunctionTensorPostAccGradHooksE";

// A Python hook's dict of callables is empty once every hook in it was removed through its
// handle: the hook does nothing, as if it were not there.
bool dict_is_empty(PyObject* dict) {
  PyGILState_STATE gil = PyGILState_Ensure();
  bool empty = PyDict_Size(dict) == 0;
  PyGILState_Release(gil);
  return empty;
}

template <typename T>
bool type_is(const T& obj, const char* mangled) {
  return std::strcmp(typeid(obj).name(), mangled) == 0;
}

// What replaygrad needs to know of a node's C++ type: its kind, and for torch's own nodes
// whether it is a formula with a functional form (see has_functional_form) or a CopySlices.
enum class NodeType : uintptr_t {
  kGeneric = 0,
  kFormula = 1,     // a generated node or CopyBackwards
  kCopySlices = 2,
  kAccumulateGrad = 3,
  kPython = 4,
  kCppFunction = 5,
};

NodeType node_type_uncached(Node& node) {
  if (dynamic_cast<AccumulateGrad*>(&node)) {
    return NodeType::kAccumulateGrad;
  }
  const char* name = typeid(node).name();
  if (std::strcmp(name, kPyNode) == 0) {
    return NodeType::kPython;
  }
  if (std::strncmp(name, kCppNodePrefix, std::strlen(kCppNodePrefix)) == 0) {
    return NodeType::kCppFunction;
  }
  if (std::strncmp(name, kGeneratedPrefix, std::strlen(kGeneratedPrefix)) == 0 ||
      typeid(node) == typeid(torch::autograd::CopyBackwards)) {
    return NodeType::kFormula;
  }
  if (typeid(node) == typeid(torch::autograd::CopySlices)) {
    return NodeType::kCopySlices;
  }
  return NodeType::kGeneric;
}

// The type is found once per C++ type: dynamic_cast, and type_info comparisons (a strcmp of
// the names when the type_info objects differ), cost more than the rest of a node's visit.
// The cache is a small table shared by all threads: each entry is a type_info address with
// the NodeType in its low bits (type_info objects are pointer-aligned), written and read
// atomically, so a reader sees a whole entry or a miss.
NodeType node_type(Node& node) {
  constexpr size_t kSlots = 256;
  static_assert(alignof(std::type_info) >= 8, "the type lives in a type_info address's low bits");
  static std::atomic<uintptr_t> cache[kSlots];
  const auto type = reinterpret_cast<uintptr_t>(&typeid(node));
  auto& slot = cache[(type >> 4) % kSlots];
  uintptr_t entry = slot.load(std::memory_order_relaxed);
  if ((entry & ~uintptr_t{7}) == type) {
    return static_cast<NodeType>(entry & 7);
  }
  NodeType found = node_type_uncached(node);
  slot.store(type | static_cast<uintptr_t>(found), std::memory_order_relaxed);
  return found;
}

rg_node_kind kind_of(NodeType type) {
  switch (type) {
    case NodeType::kAccumulateGrad:
      return RG_NODE_ACCUMULATE_GRAD;
    case NodeType::kPython:
      return RG_NODE_PYTHON;
    case NodeType::kCppFunction:
      return RG_NODE_CPP_FUNCTION;
    default:
      return RG_NODE_GENERIC;
  }
}

rg_node_kind kind_of(Node& node) {
  return kind_of(node_type(node));
}

// Empties a map: clear() zeroes an unordered_map's buckets also when it is empty, as most
// of the maps a collector empties for every node are.
template <typename Map>
void clear_map(Map& map) {
  if (!map.empty()) {
    map.clear();
  }
}

// TensorArgs keeps the SavedVariable -> TensorArg map that compiled_args fills private.
// Explicit instantiation may name private members; this reads that one field.
using SavedVariableMap = std::unordered_map<const SavedVariable*, TensorArg*>;
template <typename Tag, typename Tag::type Member>
struct PrivateAccess {
  friend typename Tag::type get(Tag) {
    return Member;
  }
};
struct TensorArgsSavedVariables {
  using type = SavedVariableMap TensorArgs::*;
  friend type get(TensorArgsSavedVariables);
};
template struct PrivateAccess<TensorArgsSavedVariables, &TensorArgs::_saved_variables>;

SavedVariableMap& saved_variable_map(TensorArgs& args) {
  return args.*get(TensorArgsSavedVariables());
}

using TensorArgMap = std::unordered_map<const c10::TensorImpl*, TensorArg>;
struct TensorArgsArgs {
  using type = TensorArgMap TensorArgs::*;
  friend type get(TensorArgsArgs);
};
template struct PrivateAccess<TensorArgsArgs, &TensorArgs::_args>;
struct TensorArgsNextId {
  using type = uint32_t TensorArgs::*;
  friend type get(TensorArgsNextId);
};
template struct PrivateAccess<TensorArgsNextId, &TensorArgs::_next_id>;

// Forgets the tensors of the nodes visited before: TensorArg ids (part of a node's key)
// count from 1 for every node, so the key of a node does not depend on where it is in the
// graph. Saved values are replay inputs one per SavedVariable, so which of them alias does
// not change the replay.
void reset_tensor_args(TensorArgs& args) {
  clear_map(saved_variable_map(args));
  clear_map(args.*get(TensorArgsArgs()));
  args.inputs.clear();
  args.input_origins.clear();
  args.*get(TensorArgsNextId()) = 1;
}

// A CompiledNodeArgs's key is emptied through its private size, so that one serves every
// node a collector visits.
struct CompiledNodeArgsKeySize {
  using type = size_t CompiledNodeArgs::*;
  friend type get(CompiledNodeArgsKeySize);
};
template struct PrivateAccess<CompiledNodeArgsKeySize, &CompiledNodeArgs::_specialization_key_size>;

// The engine replays a GraphTask's delayed warnings with a method libtorch does not export;
// these read its queue (and the grad mode a GraphTask runs with) the same way.
struct DelayedWarnings {
  using type = std::vector<c10::Warning> torch::autograd::utils::DelayWarningHandler::*;
  friend type get(DelayedWarnings);
};
template struct PrivateAccess<DelayedWarnings, &torch::autograd::utils::DelayWarningHandler::warnings_>;
struct DelayedWarningsMutex {
  using type = std::mutex torch::autograd::utils::DelayWarningHandler::*;
  friend type get(DelayedWarningsMutex);
};
template struct PrivateAccess<DelayedWarningsMutex, &torch::autograd::utils::DelayWarningHandler::mutex_>;
struct ThreadLocalAutograd {
  using type = c10::AutogradState at::ThreadLocalState::*;
  friend type get(ThreadLocalAutograd);
};
template struct PrivateAccess<ThreadLocalAutograd, &at::ThreadLocalState::autograd_tls_>;

// Builds a SavedVariable from `t` the way SwapSavedVariables::before does: with the user's
// default saved-tensor hooks off, so no pack hook runs for our replacement.
SavedVariable make_saved(const at::Tensor& t) {
  bool prior = at::SavedTensorDefaultHooks::set_tracing(true);
  try {
    SavedVariable sv(t, /*is_output=*/false);
    at::SavedTensorDefaultHooks::set_tracing(prior);
    return sv;
  } catch (...) {
    at::SavedTensorDefaultHooks::set_tracing(prior);
    throw;
  }
}

// Swaps given values into a node's SavedVariables and swaps the originals back when it goes
// out of scope, so an exception from the node (or from Python) leaves the graph intact.
class SavedSwap {
 public:
  SavedSwap() = default;
  // Swapping happens after construction so that the destructor undoes a partial swap.
  void swap_in(const rg_sv* const* svs, const rg_tensor* const* values, size_t n) {
    stash_.reserve(n);
    targets_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      stash_.push_back(make_saved(values[i] ? as_tensor(values[i]) : at::Tensor()));
      std::swap(*as_sv(svs[i]), stash_.back());
      targets_.push_back(as_sv(svs[i]));
    }
  }
  ~SavedSwap() {
    for (size_t i = 0; i < targets_.size(); ++i) {
      std::swap(*targets_[i], stash_[i]);
    }
  }
  SavedSwap(const SavedSwap&) = delete;
  SavedSwap& operator=(const SavedSwap&) = delete;

 private:
  std::vector<SavedVariable> stash_;
  std::vector<SavedVariable*> targets_;
};

// Releases the GIL (where this thread holds it) while a node or C++ hook runs, as the engine
// runs them: C++ code that calls into the engine (a backward inside a C++ Function's
// backward, e.g. a checkpoint) refuses to be called with the GIL held, and other Python
// threads run meanwhile. Python nodes and hooks take it back themselves.
class WithoutGil {
 public:
  WithoutGil() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      release_.emplace();
    }
  }

 private:
  std::optional<pybind11::gil_scoped_release> release_;
};

// A replay swaps its values into live nodes (their SavedVariables, and for a lifted node the
// input metadata its edges point at) for the duration of one node, fake tensors while a
// compiler traces it; the graph may be another thread's too (backward calls through one
// graph from several threads, retain_graph=True). Planning, swapping, releasing saved
// variables and validating against input metadata hold this lock, so that no thread sees
// another's swapped values and swaps do not overlap. Recursive: a node may run a backward.
std::recursive_mutex graph_mutex;

// Holds graph_mutex; waits for it without the GIL, which its holder may need.
class GraphLock {
 public:
  GraphLock() : lock_(graph_mutex, std::try_to_lock) {
    if (!lock_.owns_lock()) {
      WithoutGil no_gil;
      lock_.lock();
    }
  }

 private:
  std::unique_lock<std::recursive_mutex> lock_;
};

// Engine's call_function: outputs are checked and cast against the next nodes' input
// metadata before anything else sees them.
void validate(const Node& node, const edge_list& edges, variable_list& outputs) {
  GraphLock lock;
  torch::autograd::validate_outputs(edges, outputs, [&](const std::string& msg) {
    return "Function " + node.name() + " returned an " + msg;
  });
}

// A Python sequence of int or torch.SymInt (a step's lifted sizes) as a TraceState takes
// them. Needs the GIL.
std::vector<std::optional<c10::SymInt>> lifted_sizes(PyObject* sizes) {
  std::vector<std::optional<c10::SymInt>> out;
  for (const auto& item : py::handle(sizes)) {
    out.emplace_back(py::cast<c10::SymInt>(item));
  }
  return out;
}

// While it lives, the input metadata `edges` point at (what a node's outputs are validated
// against) has the shapes of `swap`'s sizes; swapped back when it goes, also on error.
class EdgeShapesSwapped {
 public:
  EdgeShapesSwapped(SwapSavedVariables& swap, edge_list& edges) : swap_(swap), edges_(edges) {
    swap_.before(edges_);
  }
  ~EdgeShapesSwapped() {
    swap_.after(edges_);
  }
  EdgeShapesSwapped(const EdgeShapesSwapped&) = delete;
  EdgeShapesSwapped& operator=(const EdgeShapesSwapped&) = delete;

 private:
  SwapSavedVariables& swap_;
  edge_list& edges_;
};

// Writes a node's outputs to the caller's `cap` slots.
rg_status hand_out(variable_list&& outputs, rg_tensor** out, size_t cap, size_t* n_out) {
  if (outputs.size() > cap) {
    return fail(RG_KIND_RUNTIME, "replaygrad: a node returned more outputs than it has edges");
  }
  *n_out = outputs.size();
  write_list(std::move(outputs), out);
  return RG_OK;
}

// ---- the engine hook ----------------------------------------------------------------------

using torch::autograd::GraphRoot;
using torch::autograd::GraphTask;

PyObject* engine_callback = nullptr; // strong reference, set while the hook is installed
thread_local bool engine_enabled = false;
thread_local bool in_callback = false;
// rg_warnings_push's handlers, innermost last.
thread_local std::vector<std::unique_ptr<torch::PyWarningHandler>> warning_handlers;
constexpr const char* kCallCapsule = "replaygrad.engine_call";
constexpr const char* kExpiredCapsule = "replaygrad.engine_call (expired)";

struct EngineCall {
  const GraphRoot* graph_root;
  const GraphTask* graph_task;
  bool accumulate_grad;
  const edge_list* outputs;
};

// DelayWarningHandler::replay_warnings, which Engine::execute calls after a run.
void replay_delayed_warnings(GraphTask& task) {
  auto& handler = task.warning_handler_;
  std::lock_guard<std::mutex> lock(handler.*get(DelayedWarningsMutex()));
  for (const auto& warning : handler.*get(DelayedWarnings())) {
    c10::warn(warning);
  }
}

// What Engine::execute does after init_to_execute when no compiled autograd is installed
// (with a GraphRoot: the engine always makes one while a hook is installed).
variable_list run_engine(const c10::intrusive_ptr<Node>& graph_root, const GraphTask& graph_task) {
  auto task = const_cast<GraphTask&>(graph_task).shared_from_this();
  auto future = torch::autograd::Engine::get_default_engine().execute_with_graph_task(
      task, graph_root, torch::autograd::InputBuffer(variable_list()));
  future->wait();
  replay_delayed_warnings(*task);
  return future->value().toTensorVector();
}

// GraphTask::exec_post_processing's final callbacks (callbacks may queue more).
void run_final_callbacks(const GraphTask& graph_task) {
  auto& task = const_cast<GraphTask&>(graph_task);
  std::unique_lock<std::mutex> lock(task.final_callbacks_lock_);
  for (size_t i = 0; i < task.final_callbacks_.size(); ++i) {
    lock.unlock();
    task.final_callbacks_[i]();
    lock.lock();
  }
}

variable_list from_python_results(PyObject* results) {
  THPObjectPtr seq(PySequence_Fast(results, "the replaygrad engine callback must return a sequence"));
  if (!seq) {
    throw python_error();
  }
  variable_list out;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.get(), i);
    if (item == Py_None) {
      out.emplace_back();
    } else if (THPVariable_Check(item)) {
      out.push_back(THPVariable_Unpack(item));
    } else {
      PyErr_SetString(PyExc_TypeError, "the replaygrad engine callback returned a non-Tensor");
      throw python_error();
    }
  }
  return out;
}

// Engine::compiled_autograd_fn. Runs with the GraphTask current (GraphTaskGuard) and the
// GIL released.
variable_list engine_hook(
    const c10::intrusive_ptr<Node>& graph_root,
    const GraphTask& graph_task,
    bool accumulate_grad,
    const edge_list& outputs) {
  auto* root = dynamic_cast<const GraphRoot*>(graph_root.get());
  if (root && root->next_edges().size() == 1) {
    // Without a compiled-autograd hook the engine starts a single root's node itself, with
    // no GraphRoot before it, and compute_dependencies never records that node as one of
    // the graph's: torch._C._will_engine_execute_node says it will not run (and
    // register_multi_grad_hook counts on that), whether replaygrad runs the call or not.
    const_cast<GraphTask&>(graph_task).nodes_in_graph_.erase(root->next_edges()[0].function.get());
  }
  if (!engine_enabled || in_callback || !root) {
    return run_engine(graph_root, graph_task);
  }
  EngineCall call{root, &graph_task, accumulate_grad, &outputs};
  std::optional<variable_list> results;
  {
    pybind11::gil_scoped_acquire gil;
    PyObject* callback = engine_callback;
    if (!callback) {
      return run_engine(graph_root, graph_task);
    }
    THPObjectPtr capsule(PyCapsule_New(&call, kCallCapsule, nullptr));
    if (!capsule) {
      throw python_error();
    }
    Py_INCREF(callback);
    THPObjectPtr owned_callback(callback);
    THPObjectPtr returned;
    {
      // The engine runs a backward under a copy of the caller's thread-local state (grad
      // mode, saved-tensor hooks, dispatch modes): what the backward changes there (e.g. an
      // unpack hook entering saved_tensors_hooks) does not leak to the caller.
      at::ThreadLocalStateGuard tls_guard(graph_task.thread_locals_);
      in_callback = true;
      returned = THPObjectPtr(PyObject_CallOneArg(callback, capsule.get()));
      in_callback = false;
    }
    // The capsule points at this frame: make any copy Python kept unusable.
    PyCapsule_SetName(capsule.get(), kExpiredCapsule);
    if (!returned) {
      python_error error;
      error.persist();
      throw error;
    }
    if (returned.get() != Py_None) {
      results = from_python_results(returned.get());
    }
  }
  if (!results) {
    return run_engine(graph_root, graph_task);
  }
  run_final_callbacks(graph_task);
  return std::move(*results);
}

const EngineCall& engine_call(PyObject* capsule) {
  void* ptr = PyCapsule_GetPointer(capsule, kCallCapsule);
  if (!ptr) {
    PyErr_Clear();
    TORCH_CHECK(false, "replaygrad: engine call used outside of its callback");
  }
  return *static_cast<const EngineCall*>(ptr);
}

// Node types whose formula fails on symbolic sizes (their kernels' fake implementations
// take none, e.g. upsampling's backward): their sizes stay in the key.
std::mutex unliftable_mutex;
std::unordered_set<const std::type_info*> unliftable_types;
std::atomic<bool> any_unliftable{false};

bool liftable_type(const Node& node) {
  if (!any_unliftable.load(std::memory_order_acquire)) {
    return true;
  }
  std::lock_guard<std::mutex> lock(unliftable_mutex);
  return unliftable_types.count(&typeid(node)) == 0;
}

// Addresses to slot numbers: open addressing with linear probing, no allocation per entry
// (a plan records one entry per saved tensor).
class SlotTable {
 public:
  // The slot recorded for `key`; records `slot` for it if there is none.
  size_t find_or_insert(const void* key, size_t slot) {
    if (2 * (used_ + 1) > entries_.size()) {
      grow();
    }
    const size_t mask = entries_.size() - 1;
    for (size_t i = hash(key) & mask;; i = (i + 1) & mask) {
      auto& entry = entries_[i];
      if (entry.first == key) {
        return entry.second;
      }
      if (entry.first == nullptr) {
        entry = {key, slot};
        ++used_;
        return slot;
      }
    }
  }

 private:
  static size_t hash(const void* key) {
    // Fibonacci hashing of the address, its alignment bits dropped.
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(key) >> 4) * 0x9E3779B97F4A7C15ull >> 16);
  }

  void grow() {
    std::vector<std::pair<const void*, size_t>> old(std::max<size_t>(64, 2 * entries_.size()));
    old.swap(entries_);
    used_ = 0;
    for (const auto& [key, slot] : old) {
      if (key != nullptr) {
        find_or_insert(key, slot);
      }
    }
  }

  std::vector<std::pair<const void*, size_t>> entries_;
  size_t used_ = 0;
};

// A wrapped number's value: its dtype and the bytes of its element.
struct WrappedValue {
  c10::ScalarType dtype;
  std::array<uint64_t, 2> bits;
  bool operator==(const WrappedValue& other) const {
    return dtype == other.dtype && bits == other.bits;
  }
};

struct WrappedValueHash {
  size_t operator()(const WrappedValue& v) const {
    return static_cast<size_t>((v.bits[0] ^ (v.bits[1] * 31) ^ static_cast<uint64_t>(v.dtype)) *
                               0x9E3779B97F4A7C15ull);
  }
};

// The value of `impl` if it is a wrapped number of a plain CPU tensor.
static std::optional<WrappedValue> wrapped_value(const c10::TensorImpl* impl) {
  if (!impl->is_wrapped_number() || typeid(*impl) != typeid(c10::TensorImpl) ||
      !impl->has_storage() || impl->device_type() != c10::kCPU ||
      impl->key_set().has_any(c10::python_ks) || impl->itemsize() > sizeof(uint64_t) * 2) {
    return std::nullopt;
  }
  WrappedValue v{c10::typeMetaToScalarType(impl->dtype()), {0, 0}};
  std::memcpy(v.bits.data(), impl->data(), impl->itemsize());
  return v;
}

// Deterministic slot order of a visited node's saved variables: by TensorArg id (ids follow
// the collection order; equal ids mean the same tensor, so their relative order is moot).
struct Slot {
  const SavedVariable* sv;
  TensorArg* arg;
  bool operator<(const Slot& other) const {
    return std::make_pair(arg->id, reinterpret_cast<uintptr_t>(sv)) <
           std::make_pair(other.arg->id, reinterpret_cast<uintptr_t>(other.sv));
  }
};
using SlotOrder = std::vector<Slot>;
void ordered_slots(const SavedVariableMap& unpacked, SlotOrder& out) {
  out.clear();
  for (const auto& [sv, arg] : unpacked) {
    out.push_back({sv, arg});
  }
  std::sort(out.begin(), out.end());
}

// The slot order of a visited node's hooked saved variables (see rg_collector_visit), after
// the others: by hook id, the collection order.
using HookedOrder = std::vector<std::pair<size_t, const SavedVariable*>>;
void ordered_hooked(const AutogradCompilerCall& compiler, HookedOrder& out) {
  out.clear();
  for (const auto& [sv, ids] : compiler.sv_to_hooks) {
    out.emplace_back(ids.first, sv);
  }
  std::sort(out.begin(), out.end());
}

// Appends the shapes node's outputs are validated against (the input metadata its valid
// edges point at), in the order SwapSavedVariables::before(Edge&) swaps them. False for
// nested tensors (whose metadata has no plain shape).
bool edge_dims(const Node& node, std::vector<int64_t>& out) {
  for (const Edge& edge : node.next_edges()) {
    if (!edge.is_valid()) {
      continue;
    }
    const auto& m = edge.function->input_metadata(edge.input_nr);
    if (m.is_nested_tensor() || m.is_cpp_nested_tensor()) {
      return false;
    }
    for (const auto& d : m.shape_as_dim_vector()) {
      out.push_back(d.guard_int(__FILE__, __LINE__));
    }
  }
  return true;
}

// Whether a node's apply_with_saved runs through the compiler interface's call_function
// (see LiftedApply): torch's generated formulas and CopyBackwards (copy_, e.g. of an indexed
// assignment `x[i] = y`).
bool has_functional_form(Node& node) {
  return node_type(node) == NodeType::kFormula;
}

// The node whose formula a lifted apply of `node` runs: the in-place op's node for a
// CopySlices (which wraps it), the node itself otherwise.
Node& formula_node(Node& node) {
  if (node_type(node) == NodeType::kCopySlices) {
    const auto& fn = static_cast<torch::autograd::CopySlices&>(node).fn;
    if (fn) {
      return *fn;
    }
  }
  return node;
}

// Stands in for torch's compiled-autograd compiler while a generated node (or a CopySlices
// wrapping one) runs through its apply_with_saved: between swapping its state in and back,
// that method hands the work to call_function, which runs the node's own apply() on the
// swapped state; a CopySlices hands over its own steps around that call (the prologue and
// epilogue below, which do what its apply() does, on its swapped geometry). An error is kept
// and rethrown by the caller once apply_with_saved has swapped everything back (it does not
// undo its swaps on an exception); the calls after it do nothing.
class LiftedApply : public PyCompilerInterface {
 public:
  explicit LiftedApply(Node& node) : node_(formula_node(node)) {}

  std::string bind_function(PyObject* /*py_compiler*/, const std::string& fn_name,
                            torch::dynamo::autograd::functional_apply_t fn,
                            std::vector<at::TypePtr> schema, bool is_custom_function,
                            bool is_traceable) const override {
    // Each node type binds its functional form once per process, with whichever compiler is
    // active: register it where torch's compiled autograd looks it up, as torch's own
    // compiler interface does, so that it keeps working after replaygrad ran this type.
    auto wrapped = py::cpp_function([schema = std::move(schema), fn = std::move(fn)](
                                        std::vector<std::optional<at::Tensor>>& grads,
                                        const py::args& args) -> py::object {
      TORCH_CHECK(args.size() == schema.size(), "replaygrad: wrong number of packed arguments");
      std::vector<at::IValue> values;
      values.reserve(args.size());
      for (size_t i = 0; i < schema.size(); ++i) {
        if (schema[i]->isSubtypeOf(*at::ListType::ofTensors())) {
          auto tensors = py::cast<std::vector<std::optional<at::Tensor>>>(args[i]);
          variable_list list;
          for (auto& t : tensors) {
            list.push_back(t.has_value() ? *t : at::Tensor());
          }
          values.emplace_back(std::move(list));
        } else {
          values.emplace_back(torch::jit::toIValue(args[i], schema[i], std::nullopt));
        }
      }
      variable_list inputs;
      for (auto& g : grads) {
        inputs.push_back(g.has_value() ? *g : at::Tensor());
      }
      return torch::jit::toPyObject(at::IValue(fn(inputs, values)));
    });
    // Best effort: an error here would leave the node's state swapped (apply_with_saved
    // calls this between its swaps), and only torch's compiled autograd needs it.
    try {
      py::object ops = py::module_::import("torch._dynamo.compiled_autograd").attr("ops");
      ops.attr("add")(fn_name, wrapped, is_custom_function, is_traceable);
    } catch (const py::error_already_set&) {
      PyErr_Clear();
    } catch (const std::exception&) {
    }
    return fn_name;
  }

  variable_list call_function(PyObject* /*py_compiler*/, const char* method_name,
                              const std::string& /*fn_name*/, const variable_list& inputs,
                              const torch::dynamo::autograd::ivalue_list& /*packed_args*/,
                              const c10::IValue& /*output_metadata*/) const override {
    TORCH_CHECK(std::strcmp(method_name, "apply_functional") == 0,
                "replaygrad: unexpected compiled-autograd call ", method_name);
    if (error_) {
      return {};
    }
    try {
      return node_(variable_list(inputs));
    } catch (...) {
      error_ = std::current_exception();
      return {};
    }
  }

  // CopySlices, before its node: the gradient of the whole base, and the window of it that
  // the in-place op wrote (and a contiguous copy of that window, the node's input).
  variable_list call_copy_slices_prologue(PyObject* /*py_compiler*/, const variable_list& inputs,
                                          const at::TensorGeometry& base,
                                          const at::TensorGeometry& view) const override {
    if (error_) {
      return variable_list(3);
    }
    try {
      const at::Tensor& grad = inputs.at(0);
      auto result = grad.new_empty_strided_symint(base.sym_sizes(), base.sym_strides());
      result.copy_(grad);
      auto window = result.as_strided_symint(view.sym_sizes(), view.sym_strides(),
                                             view.sym_storage_offset() - base.sym_storage_offset());
      auto input = window.clone(at::MemoryFormat::Contiguous);
      return {std::move(result), std::move(window), std::move(input)};
    } catch (...) {
      error_ = std::current_exception();
      return variable_list(3);
    }
  }

  // CopySlices, after its node: the node's gradient for the view written into the window
  // (the base's gradient), its other gradients as they are.
  variable_list call_copy_slices_epilogue(PyObject* /*py_compiler*/,
                                          const std::vector<bool>& needs_input_grad,
                                          const at::Tensor& result, const variable_list& res,
                                          const at::Tensor& grad_slice) const override {
    variable_list grads(needs_input_grad.size());
    if (error_) {
      return grads;
    }
    try {
      for (size_t i = 0; i < res.size() && i < grads.size(); ++i) {
        if (!needs_input_grad[i] || !res[i].defined()) {
          continue;
        }
        if (i == 0) {
          grad_slice.copy_(res[0]);
          grads[0] = result;
        } else {
          grads[i] = res[i];
        }
      }
    } catch (...) {
      error_ = std::current_exception();
      return variable_list(needs_input_grad.size());
    }
    return grads;
  }

  // A hooked saved value (see rg_collector_visit): the value its unpack hook returned, given
  // by hook id.
  at::Tensor call_unpack(PyObject* /*py_compiler*/, std::optional<size_t> hook_id,
                         size_t /*hook_input_id*/) const override {
    TORCH_CHECK(hook_id.has_value() && *hook_id < unpacked_.size(),
                "replaygrad: no value for a hooked saved variable");
    return unpacked_[*hook_id];
  }

  void set_unpacked(variable_list values) {
    unpacked_ = std::move(values);
  }

  void rethrow() const {
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

 private:
  Node& node_;
  variable_list unpacked_;
  mutable std::exception_ptr error_;
};

// The code objects of the unpack hooks whose calls a replay may make before their nodes run
// (see rg_unpack_hooks_defer). Held for the process; read and written with the GIL.
std::vector<PyObject*> deferrable_unpack_codes;

// The one unpack hook of all of a node's hooked SavedVariables, if there is one and its code
// is deferrable; else null.
PyObject* deferrable_unpack_hook(const AutogradCompilerCall& compiler) {
  PyObject* found = nullptr;
  for (const auto& [sv, ids] : compiler.sv_to_hooks) {
    PyObject* hook = compiler.hooks.at(ids.first).ptr(getPyInterpreter());
    if (found == nullptr) {
      if (!PyFunction_Check(hook) ||
          std::find(deferrable_unpack_codes.begin(), deferrable_unpack_codes.end(),
                    PyFunction_GET_CODE(hook)) == deferrable_unpack_codes.end()) {
        return nullptr;
      }
      found = hook;
    } else if (hook != found) {
      return nullptr;
    }
  }
  return found;
}

// InputBuffer::accumulate's test (input_buffer.cpp) of a gradient that may take a sum in
// place: a plain dense tensor that no other tensor, C++ holder or view shares.
bool can_accumulate_in_place(const at::Tensor& v) {
  return !(at::isTensorSubclassLike(v) || v._is_zerotensor() || v.is_nested()) &&
         v.is_non_overlapping_and_dense() && v.use_count() == 1 && v.has_storage() &&
         v.storage().use_count() == 1;
}

// Whether the Python tensor `obj`, an argument of a METH_FASTCALL call, is held by nothing
// but the caller's stack and the one variable or container it was read from. CPython 3.14
// may push borrowed references (LOAD_FAST_BORROW), and free-threaded builds split the count
// between threads: there the count proves nothing.
bool held_once(PyObject* obj) {
#if PY_VERSION_HEX >= 0x030E0000 || defined(Py_GIL_DISABLED)
  (void)obj;
  return false;
#else
  return Py_REFCNT(obj) == 2;
#endif
}

// buffer_sum(*grads) for replays that run uncompiled: InputBuffer::add over gradients in
// arrival order (None skipped), in place where the engine's accumulate would be. A gradient is
// summed into in place only when nothing else can see it: the engine's test on its C++ use
// counts, and no Python reference but the one the replay passes (held_once), or a sum made
// here. Otherwise the sum is a new tensor, as in the engine (with grad mode on, always).
PyObject* buffer_sum_in_place(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  THPObjectPtr total;
  // `total` is a sum made here, or a gradient held_once: no one else sees it change.
  bool ours = false;
  for (Py_ssize_t k = 0; k < nargs; ++k) {
    PyObject* arg = args[k];
    if (arg == Py_None) {
      continue;
    }
    if (!THPVariable_Check(arg)) {
      PyErr_Format(PyExc_TypeError, "buffer_sum: expected Tensor or None, got %s",
                   Py_TYPE(arg)->tp_name);
      return nullptr;
    }
    if (!total) {
      ours = held_once(arg);
      total = THPObjectPtr(Py_NewRef(arg));
      continue;
    }
    const at::Tensor& old_var = THPVariable_Unpack(total.get());
    const at::Tensor& var = THPVariable_Unpack(arg);
    at::Tensor sum;
    // With grad mode on (create_graph) the engine always makes a new sum.
    const bool may_reuse = !at::GradMode::is_enabled();
    if (old_var.is_sparse() || old_var.is_sparse_csr()) {
      // Onto a sparse sum the new gradient comes first.
      if (may_reuse && held_once(arg) && can_accumulate_in_place(var)) {
        const_cast<at::Tensor&>(var).add_(old_var);
        total = THPObjectPtr(Py_NewRef(arg));
        ours = false;
        continue;
      }
      sum = var + old_var;
    } else if (may_reuse && ours && can_accumulate_in_place(old_var) &&
               !at::isTensorSubclassLike(var)) {
      const_cast<at::Tensor&>(old_var).add_(var);
      continue;
    } else {
      sum = old_var + var;
    }
    total = THPObjectPtr(THPVariable_Wrap(std::move(sum)));
    if (!total) {
      return nullptr;
    }
    ours = true;
  }
  if (!total) {
    Py_RETURN_NONE;
  }
  return total.release();
  END_HANDLE_TH_ERRORS
}

PyMethodDef buffer_sum_def = {"buffer_sum", reinterpret_cast<PyCFunction>(buffer_sum_in_place),
                              METH_FASTCALL, nullptr};

} // namespace

struct rg_collector {
  AutogradCompilerCall compiler{SizeInput::STATIC};
  // One node call and one CompiledNodeArgs for all visits (the args' key is emptied before
  // each): CompiledNodeArgs allocates its key buffer when it is made.
  NodeCall node_call{0, nullptr};
  CompiledNodeArgs args{compiler, node_call};
  std::vector<const SavedVariable*> svs;
  std::vector<at::Tensor> values;
  // Each value's version when planned (0 for an undefined one).
  std::vector<uint32_t> versions;
  std::vector<uint8_t> key;
  std::vector<int64_t> sizes;
  // The visited node's hooked saved variables, reused across visits.
  HookedOrder hooked;
  // The visited node's saved variables by (TensorArg id, address), reused across visits.
  SlotOrder order;
  // A tensor saved more than once (by several nodes, or twice by one) gets one value, the
  // one of its first slot (index into `values`): a compiled replay then takes it as one
  // input, as torch's compiled autograd does. Keyed by the unpacked tensor, which its value
  // or `sources` keeps alive so that its address is not reused by another tensor during the
  // walk.
  SlotTable first_slot;
  std::vector<at::Tensor> sources;
  // Wrapped numbers (the Python scalars ops take as 0-dim tensors, e.g. the 0.9 of
  // `y * 0.9`) are made anew by every op that takes one: equal ones (same dtype and bits)
  // get one value, as if they were one tensor, the first one seen (`first_slot`'s key).
  std::unordered_map<WrappedValue, const void*, WrappedValueHash> first_wrapped;
  // The slots that took another wrapped number's value, with their own tensor (its version
  // is checked as the slot's; see rg_collector_first_modified), in slot order.
  std::vector<std::pair<size_t, at::Tensor>> aliases;
  // The slots whose value a compiled replay takes lifted (see lifted_scalar), with that
  // tensor (one per value), in slot order.
  std::vector<std::pair<size_t, at::Tensor>> scalars;
};

// Runs `call` (hooks, which take the GIL themselves) without the GIL and writes the `count`
// values it returns to `out`: a hook may not change their number.
template <typename Call>
rg_status write_hook_values(const char* message, size_t count, rg_tensor** out, Call call) {
  variable_list result;
  {
    WithoutGil no_gil;
    result = call();
  }
  if (result.size() != count) {
    return fail(RG_KIND_RUNTIME, message);
  }
  write_list(std::move(result), out);
  return RG_OK;
}

extern "C" {

const char* rg_last_error_message(void) {
  return last_message.c_str();
}

int rg_last_error_kind(void) {
  return last_kind;
}

void rg_node_incref(rg_node* node) {
  c10::raw::intrusive_ptr::incref(as_node(node));
}

void rg_node_decref(rg_node* node) {
  c10::raw::intrusive_ptr::decref(as_node(node));
}

rg_status rg_tensor_gradient_edge(const rg_tensor* t, rg_node** node, uint32_t* input_nr) {
  RG_TRY
  *node = nullptr;
  *input_nr = 0;
  const at::Tensor& tensor = as_tensor(t);
  if (!tensor.defined() || (!tensor.requires_grad() && !tensor.grad_fn())) {
    return RG_OK;
  }
  Edge edge = torch::autograd::impl::gradient_edge(tensor);
  if (edge.function) {
    *input_nr = edge.input_nr;
    *node = as_rg(edge.function.release());
  }
  RG_CATCH
}

rg_status rg_tensor_input_edge(const rg_tensor* t, rg_node** node, uint32_t* input_nr) {
  RG_TRY
  *node = nullptr;
  *input_nr = 0;
  const at::Tensor& tensor = as_tensor(t);
  c10::intrusive_ptr<Node> fn = tensor.grad_fn();
  if (fn) {
    *input_nr = tensor.output_nr();
  } else {
    fn = torch::autograd::impl::try_get_grad_accumulator(tensor);
  }
  if (fn) {
    *node = as_rg(fn.release());
  }
  RG_CATCH
}

rg_status rg_node_from_pyobject(PyObject* obj, rg_node** node) {
  RG_TRY
  *node = nullptr;
  c10::intrusive_ptr<Node> found;
  if (torch::autograd::THPCppFunction_Check(obj)) {
    found = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  } else if (THPFunction_Check(obj)) {
    found = reinterpret_cast<THPFunction*>(obj)->cdata;
  }
  if (found) {
    *node = as_rg(found.release());
  }
  RG_CATCH
}

rg_status rg_node_to_pyobject(rg_node* node, PyObject** out) {
  RG_TRY
  *out = torch::autograd::functionToPyObject(as_node(node)->getptr());
  if (!*out) {
    throw python_error();
  }
  RG_CATCH
}

rg_status rg_node_describe(rg_node* n, rg_node_info* info, rg_node** nodes, uint32_t* input_nrs,
                           size_t edge_cap, uint8_t* meta, size_t meta_cap, size_t* meta_len) {
  RG_TRY
  Node& node = *as_node(n);
  info->sequence_nr = node.sequence_nr();
  info->type_name = typeid(node).name();
  info->kind = kind_of(node);
  info->num_inputs = static_cast<uint32_t>(node.num_inputs());
  info->num_outputs = static_cast<uint32_t>(node.num_outputs());
  info->num_tensor_pre_hooks = static_cast<uint32_t>(node.tensor_pre_hooks().size());
  info->num_retains_grad_hooks = static_cast<uint32_t>(node.retains_grad_hooks().size());
  info->num_pre_hooks = static_cast<uint32_t>(node.pre_hooks().size());
  info->num_post_hooks = static_cast<uint32_t>(node.post_hooks().size());
  info->non_strided_inputs = 0;
  info->nested_inputs = 0;
  const auto& post_acc = node.tensor_post_acc_grad_hooks();
  info->has_post_acc_grad_hooks =
      post_acc != nullptr &&
      !(type_is(*post_acc, kPyPostAccGradHooks) &&
        dict_is_empty(static_cast<torch::autograd::PyFunctionTensorPostAccGradHooks*>(post_acc.get())->dict));

  const edge_list& edges = node.next_edges();
  for (size_t i = 0; i < edges.size() && i < edge_cap; ++i) {
    nodes[i] = as_rg(edges[i].function.get());
    input_nrs[i] = edges[i].input_nr;
  }

  size_t len = 0;
  auto put = [&](const void* data, size_t size) {
    if (len + size <= meta_cap) {
      std::memcpy(meta + len, data, size);
    }
    len += size;
  };
  for (uint32_t i = 0; i < info->num_inputs; ++i) {
    const auto& m = node.input_metadata(i);
    bool nested = m.is_nested_tensor() || m.is_cpp_nested_tensor();
    c10::Layout layout = m.layout();
    if (layout != c10::kStrided) {
      info->non_strided_inputs += 1;
    }
    // The dtype the engine casts a gradient to (a leaf's `grad_dtype`, -1 for none: any
    // dtype goes; -2 where the metadata is a non-differentiable output's, which has none).
    const int32_t grad_dtype =
        m.was_default_constructed() ? -2
                                    : (m.grad_dtype() ? static_cast<int32_t>(*m.grad_dtype()) : -1);
    int32_t head[6] = {
        static_cast<int32_t>(c10::typeMetaToScalarType(m.dtype())),
        static_cast<int32_t>(m.device().type()),
        static_cast<int32_t>(m.device().index()),
        static_cast<int32_t>(layout),
        0,
        grad_dtype,
    };
    if (nested) {
      info->nested_inputs += 1;
      head[4] = -1;  // no plain shape
      put(head, sizeof head);
      continue;
    }
    const auto& shape = m.shape_as_dim_vector();
    head[4] = static_cast<int32_t>(shape.size());
    put(head, sizeof head);
    for (const auto& d : shape) {
      // (guard_int is a call; a plain int, the usual case, is read inline.)
      const auto plain = d.maybe_as_int();
      int64_t v = plain ? *plain : d.guard_int(__FILE__, __LINE__);
      put(&v, sizeof v);
    }
  }
  *meta_len = len;
  RG_CATCH
}

rg_status rg_node_next_edges(rg_node* n, rg_node** nodes, uint32_t* input_nrs, size_t count) {
  RG_TRY
  const edge_list& edges = as_node(n)->next_edges();
  if (count > edges.size()) {
    return fail(RG_KIND_INDEX, "rg_node_next_edges: more edges asked for than the node has");
  }
  for (size_t i = 0; i < count; ++i) {
    nodes[i] = as_rg(edges[i].function.get());
    input_nrs[i] = edges[i].input_nr;
  }
  RG_CATCH
}

rg_status rg_node_name(rg_node* n, char* buf, size_t cap, size_t* len) {
  RG_TRY
  std::string name = as_node(n)->name();
  *len = name.size();
  if (cap > 0) {
    size_t k = std::min(cap - 1, name.size());
    std::memcpy(buf, name.data(), k);
    buf[k] = '\0';
  }
  RG_CATCH
}

// What PyNode::is_traceable reads: the class attribute `is_traceable` of the node's Function
// (its `_forward_cls`), looked up in the classes' dicts, as getattr finds a class attribute
// (not on a metaclass). torch.autograd.Function does not define it in 2.13, so for most
// Functions PyNode::is_traceable raises AttributeError and throws, a few microseconds a node
// at every plan; the lookup raises nothing. -1 where `_forward_cls` is not a class.
int python_function_traceable(PyObject* ctx) {
  PyGILState_STATE gil = PyGILState_Ensure();
  // Made on the first call, with the GIL held (the caller may not hold it).
  static PyObject* const forward_cls = PyUnicode_InternFromString("_forward_cls");
  static PyObject* const is_traceable = PyUnicode_InternFromString("is_traceable");
  int traceable = -1;
  PyObject* cls = ctx ? _PyType_Lookup(Py_TYPE(ctx), forward_cls) : nullptr;  // borrowed
  if (cls && PyType_Check(cls)) {
    PyObject* flag = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(cls), is_traceable);
    traceable = flag ? PyObject_IsTrue(flag) : 0;
    if (traceable < 0) {
      PyErr_Clear();
      traceable = 0;
    }
  }
  PyGILState_Release(gil);
  return traceable;
}

rg_status rg_node_is_traceable(rg_node* n, int* out) {
  RG_TRY
  *out = 0;
  Node& node = *as_node(n);
  if (node_type(node) == NodeType::kPython) {
    int traceable = python_function_traceable(static_cast<torch::autograd::PyNode&>(node).pyobj());
    if (traceable >= 0) {
      *out = traceable;
      return RG_OK;
    }
  }
  try {
    *out = node.is_traceable() ? 1 : 0;
  } catch (python_error&) {
    // PyNode::is_traceable reads the class attribute `is_traceable`, which
    // torch.autograd.Function does not define in 2.13: not traceable.
    PyErr_Clear();
  }
  RG_CATCH
}

rg_status rg_python_function_passes_none(rg_node* n, size_t input, int* out) {
  RG_TRY
  *out = 0;
  Node& node = *as_node(n);
  if (node_type(node) != NodeType::kPython) {
    return fail(RG_KIND_RUNTIME, "rg_python_function_passes_none: not a Python Function's node");
  }
  auto* fn = reinterpret_cast<THPFunction*>(static_cast<torch::autograd::PyNode&>(node).pyobj());
  if (fn == nullptr || input >= node.num_inputs()) {
    return fail(RG_KIND_INDEX, "rg_python_function_passes_none: no such input");
  }
  // PyNode::to_py_args.
  *out = !fn->materialize_grads || (node.input_metadata(input).was_default_constructed() &&
                                    !fn->materialize_non_diff_grads);
  RG_CATCH
}

// The dict of callables behind Python hook `i` of `kind` (borrowed), nullptr for a C++ hook;
// for a tensor pre-hook, *value_idx is the input it watches. Throws on a bad index.
static PyObject* hook_dict(Node& node, int kind, size_t i, int64_t* value_idx) {
  *value_idx = -1;
  switch (kind) {
    case RG_HOOK_TENSOR_PRE: {
      auto& hooks = node.tensor_pre_hooks();
      TORCH_CHECK_INDEX(i < hooks.size(), "rg_node_hook_dict: tensor pre-hook index out of range");
      if (type_is(*hooks[i], kPyTensorPreHook)) {
        auto* h = static_cast<torch::autograd::PyFunctionTensorPreHook*>(hooks[i].get());
        *value_idx = static_cast<int64_t>(h->value_idx);
        return h->dict;
      }
      return nullptr;
    }
    case RG_HOOK_PRE: {
      auto& hooks = node.pre_hooks();
      TORCH_CHECK_INDEX(i < hooks.size(), "rg_node_hook_dict: pre-hook index out of range");
      if (type_is(*hooks[i], kPyPreHook)) {
        return static_cast<torch::autograd::PyFunctionPreHook*>(hooks[i].get())->dict;
      }
      return nullptr;
    }
    case RG_HOOK_POST: {
      auto& hooks = node.post_hooks();
      TORCH_CHECK_INDEX(i < hooks.size(), "rg_node_hook_dict: post-hook index out of range");
      if (type_is(*hooks[i], kPyPostHook)) {
        return static_cast<torch::autograd::PyFunctionPostHook*>(hooks[i].get())->dict;
      }
      return nullptr;
    }
    case RG_HOOK_RETAINS_GRAD:
      return nullptr; // always C++ (retain_grad())
    default:
      TORCH_CHECK_VALUE(false, "rg_node_hook_dict: unknown hook kind");
  }
}

rg_status rg_node_hook_dict(rg_node* n, int kind, size_t i, int* is_python, PyObject** dict,
                            int64_t* value_idx) {
  RG_TRY
  if (dict) {
    *dict = nullptr;
  }
  PyObject* found = hook_dict(*as_node(n), kind, i, value_idx);
  if (is_python) {
    *is_python = found == nullptr ? 0 : (dict_is_empty(found) ? 2 : 1);
  }
  if (found && dict) {
    Py_INCREF(found);
    *dict = found;
  }
  RG_CATCH
}

rg_status rg_node_retains_grad_outputs(rg_node* n, uint32_t* outputs, size_t count) {
  RG_TRY
  auto& hooks = as_node(n)->retains_grad_hooks();
  if (count != hooks.size()) {
    return fail(RG_KIND_INDEX, "rg_node_retains_grad_outputs: wrong count");
  }
  size_t k = 0;
  for (const auto& entry : hooks) {
    outputs[k++] = static_cast<uint32_t>(entry.first);
  }
  std::sort(outputs, outputs + count);
  RG_CATCH
}

rg_status rg_node_call_pre_hook(rg_node* n, int kind, size_t i, const rg_tensor* const* values,
                                size_t count, rg_tensor** out) {
  RG_TRY
  Node& node = *as_node(n);
  FunctionPreHook* hook = nullptr;
  if (kind == RG_HOOK_TENSOR_PRE && i < node.tensor_pre_hooks().size()) {
    hook = node.tensor_pre_hooks()[i].get();
  } else if (kind == RG_HOOK_PRE && i < node.pre_hooks().size()) {
    hook = node.pre_hooks()[i].get();
  } else if (kind == RG_HOOK_RETAINS_GRAD) {
    auto it = node.retains_grad_hooks().find(i);
    if (it != node.retains_grad_hooks().end()) {
      hook = it->second.get();
    }
  }
  if (!hook) {
    return fail(RG_KIND_INDEX, "rg_node_call_pre_hook: no such hook");
  }
  return write_hook_values("rg_node_call_pre_hook: hook changed the number of values", count,
                           out, [&] { return (*hook)(to_list(values, count)); });
  RG_CATCH
}

rg_status rg_node_call_post_hook(rg_node* n, size_t i, const rg_tensor* const* outputs,
                                 size_t n_outputs, const rg_tensor* const* inputs, size_t n_inputs,
                                 rg_tensor** out) {
  RG_TRY
  Node& node = *as_node(n);
  if (i >= node.post_hooks().size()) {
    return fail(RG_KIND_INDEX, "rg_node_call_post_hook: no such hook");
  }
  return write_hook_values(
      "rg_node_call_post_hook: hook changed the number of values", n_outputs, out, [&] {
        return (*node.post_hooks()[i])(to_list(outputs, n_outputs), to_list(inputs, n_inputs));
      });
  RG_CATCH
}

rg_status rg_collector_new(rg_collector** out) {
  RG_TRY
  *out = new rg_collector();
  RG_CATCH
}

void rg_collector_free(rg_collector* c) {
  delete c;
}

// Whether `v` is an immutable plain value whose repr identifies it: also torch's dtypes,
// devices, layouts and memory formats (a forward keeping its input's dtype for the
// backward's cast, `ctx.dtype = x.dtype`, is common), and torch.Size. Of the builtin types,
// not their subclasses: numpy's float64 is a float, which Dynamo traces as a 0-dim array,
// and an IntEnum an int.
static bool is_plain_value(PyObject* v) {
  if (v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
      PyComplex_CheckExact(v) || PyUnicode_CheckExact(v) || PyBytes_CheckExact(v) ||
      THPDtype_Check(v) || THPDevice_Check(v) || THPLayout_Check(v) ||
      THPMemoryFormat_Check(v)) {
    return true;
  }
  if (PyTuple_CheckExact(v) || THPSize_Check(v)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); ++i) {
      if (!is_plain_value(PyTuple_GET_ITEM(v, i))) {
        return false;
      }
    }
    return true;
  }
  return false;
}

// A Python Function's backward may read whatever its forward put on ctx, and a compiled
// replay bakes in what it read; compiled_args keys only the saved tensors. So the ctx's
// attributes join the key when they are plain values (name, type and repr); with any other
// value (a tensor kept outside save_for_backward, an object) the node runs as itself.
static bool append_ctx_state(PyObject* ctx, std::vector<uint8_t>& key) {
  if (!ctx) {
    return false;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  bool plain = true;
  PyObject* dict = PyObject_GenericGetDict(ctx, nullptr);
  if (!dict) {
    PyErr_Clear();
    plain = false;
  } else {
    PyObject* name;
    PyObject* value;
    Py_ssize_t pos = 0;
    while (plain && PyDict_Next(dict, &pos, &name, &value)) {
      if (!PyUnicode_Check(name) || !is_plain_value(value)) {
        plain = false;
        break;
      }
      THPObjectPtr repr(PyObject_Repr(value));
      const char* type = Py_TYPE(value)->tp_name;
      const char* n = PyUnicode_AsUTF8(name);
      const char* r = repr ? PyUnicode_AsUTF8(repr.get()) : nullptr;
      if (!n || !r) {
        PyErr_Clear();
        plain = false;
        break;
      }
      for (const char* part : {n, type, r}) {
        key.insert(key.end(), part, part + std::strlen(part) + 1);
      }
    }
    Py_DECREF(dict);
  }
  PyGILState_Release(gil);
  return plain;
}

// Whether a tensor's Python object is a torch.Tensor (or, with `parameter`, an
// nn.Parameter) of its own class with no attributes of its own.
static bool plain_tensor_object(PyObject* obj, bool parameter) {
  auto* type = Py_TYPE(obj);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      !(parameter && type == reinterpret_cast<PyTypeObject*>(ParameterClass))) {
    return false;
  }
  PyObject** dict = _PyObject_GetDictPtr(obj);
  return !(dict && *dict && PyDict_GET_SIZE(*dict) > 0);
}

// A Python Function's backward sees its saved tensors as the Python objects it saved: one of
// a subclass (whose __torch_function__ runs there) or with attributes of its own would be a
// plain tensor in a compiled replay, so a node that saved one runs as itself.
static bool plain_saved_objects(const SavedVariableMap& unpacked,
                                const std::vector<at::Tensor>& tensors) {
  PyGILState_STATE gil = PyGILState_Ensure();
  bool plain = true;
  for (const auto& [sv, arg] : unpacked) {
    if (!arg->defined()) {
      continue;
    }
    PyObject* obj = tensors[arg->index()].unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
    if (obj && !plain_tensor_object(obj, /*parameter=*/true)) {
      plain = false;
      break;
    }
  }
  PyGILState_Release(gil);
  return plain;
}

// Inference tensors have no version counter (and are never modified behind autograd's back).
static uint32_t version_of(const at::Tensor& value) {
  c10::TensorImpl* impl = value.unsafeGetTensorImpl();
  return impl->is_inference() ? 0 : impl->version_counter().current_version();
}

// A dense tensor of no subclass (no Python dispatch).
static bool plain_dense(const c10::TensorImpl* impl) {
  return typeid(*impl) == typeid(c10::TensorImpl) && impl->layout() == c10::kStrided &&
         !impl->key_set().has_any(c10::python_ks);
}

// A saved value as a replay input: detached from the graph, but reporting requires_grad as
// the unpacked original does (backward formulas such as linalg_solve_backward ask
// `A.requires_grad()` to decide which gradients to compute).
static at::Tensor detached_value(const at::Tensor& unpacked) {
  if (!unpacked.defined()) {
    return unpacked;
  }
  at::Tensor value;
  c10::TensorImpl* impl = unpacked.unsafeGetTensorImpl();
  if (plain_dense(impl)) {
    // What detach() makes of a plain dense tensor (make_variable_non_differentiable_view:
    // a shallow copy sharing the version counter, without autograd metadata), without the
    // dispatcher's two copies and profiler bookkeeping.
    value = at::Tensor(impl->shallow_copy_and_detach(
        torch::autograd::impl::version_counter(unpacked),
        /*allow_tensor_metadata_change=*/false));
  } else {
    // Subclasses and other tensor kinds detach themselves (a __torch_dispatch__ sees it).
    value = unpacked.detach();
  }
  if (unpacked.requires_grad()) {
    value.set_requires_grad(true);
  }
  return value;
}

// A saved value as a replay input, planned for every saved value of every call. A plain dense
// tensor that is not a view, whose Python object (if it has one yet) is a plain torch.Tensor,
// is the input itself: replays run without grad mode, where its grad_fn is never looked at,
// and it needs no new tensor, nor a new Python object when it already has one (a tensor of
// the forward the user let go of keeps it while the graph holds the tensor). Others are
// detached: a view's base and a subclass's type would be seen by the compiler.
static at::Tensor replay_value(const at::Tensor& unpacked) {
  c10::TensorImpl* impl = unpacked.unsafeGetTensorImpl();
  if (plain_dense(impl)) {
    const auto* meta = static_cast<const torch::autograd::AutogradMeta*>(impl->autograd_meta());
    PyObject* obj = impl->pyobj_slot()->load_pyobj();
    if ((meta == nullptr || !meta->is_view_) &&
        (obj == nullptr || plain_tensor_object(obj, /*parameter=*/false))) {
      return unpacked;
    }
  }
  return detached_value(unpacked);
}

// A 0-dim float64 CPU tensor given to Dynamo is read as a float too (FakeTensorConverter
// makes a symbol of its item()); when the graph does not use that float, AOTAutograd's
// tensorify_python_scalars pass has Dynamo trace the frame again (it raises
// TensorifyScalarRestartAnalysis), about a quarter of the first call of a chain of `* 0.9`.
// Wrapped numbers are such tensors. A compiled replay takes such a value (not requiring
// grad: its formula may ask) as a 1-element 1-dim tensor sharing its storage and version
// counter, and indexes it back in the graph.
static bool liftable_scalar(const at::Tensor& value) {
  const c10::TensorImpl* impl = value.unsafeGetTensorImpl();
  // (The dtype, a field, first; dim() only of a plain tensor: a subclass's asks Python.)
  return impl->dtype() == caffe2::TypeMeta::Make<double>() && plain_dense(impl) &&
         impl->dim() == 0 && impl->device_type() == c10::kCPU && !value.requires_grad();
}

// Whether every gradient `node` takes has dimensions. A wrapped number lifted and indexed
// back in the graph is a plain 0-dim tensor: with a 0-dim gradient (`loss * 0.1`, `loss`
// 0-dim) type promotion then computes in float64, where eager's wrapped number leaves the
// product in the gradient's dtype (rounded once, not twice). Nested and unknown shapes count
// as 0-dim.
static bool takes_dimensioned_gradients(const Node& node) {
  for (uint32_t i = 0; i < node.num_inputs(); ++i) {
    const auto& m = node.input_metadata(i);
    if (m.is_nested_tensor() || m.is_cpp_nested_tensor() || m.shape_as_dim_vector().empty()) {
      return false;
    }
  }
  return true;
}

static at::Tensor lifted_scalar(const at::Tensor& value) {
  auto impl = value.unsafeGetTensorImpl()->shallow_copy_and_detach(
      torch::autograd::impl::version_counter(value), /*allow_tensor_metadata_change=*/true);
  impl->set_wrapped_number(false);
  const int64_t one = 1;
  impl->set_sizes_and_strides(c10::IntArrayRef(&one, 1), c10::IntArrayRef(&one, 1));
  impl->set_allow_tensor_metadata_change(false);
  return at::Tensor(std::move(impl));
}

rg_status rg_collector_visit(rg_collector* c, rg_node* n, int* supported, size_t* n_saved,
                             const uint8_t** key, size_t* key_len, const int64_t** sizes,
                             size_t* n_sizes, int* lifted, size_t* n_hooked,
                             uintptr_t* group) {
  RG_TRY
  *supported = 1;
  *n_saved = 0;
  *lifted = 0;
  *n_hooked = 0;
  *group = 0;
  c->key.clear();
  c->sizes.clear();
  Node& node = *as_node(n);
  AutogradCompilerCall& compiler = c->compiler;
  SavedVariableMap& unpacked = saved_variable_map(compiler.tensor_args);
  reset_tensor_args(compiler.tensor_args);
  clear_map(compiler.sv_to_hooks);
  compiler.hooks.clear();
  compiler.packed_inputs.clear();
  // The node's sizes are copied to c->sizes below: torch's list need not keep every node's.
  compiler.all_size_inputs.clear();
  size_t ivalues_before = compiler.lifted_ivalue_args.args.size();

  // One node at a time: the previous node's call is not needed any more, and a map of all
  // of them would only grow (rehashing) and be freed at the end.
  clear_map(compiler.node_calls);
  NodeCall& node_call = c->node_call;
  node_call.tensor_pre_hooks.clear();
  node_call.cpp_tensor_pre_hooks.clear();
  node_call.pre_hooks.clear();
  node_call.post_hooks.clear();
  node_call.post_acc_grad_hooks.clear();
  node_call.graph_output.clear();
  // The node is lent to the call for the visit, without a reference of its own (the plan
  // holds one): released, not dropped, when the visit ends.
  node_call.node = c10::intrusive_ptr<Node>::reclaim(&node);
  struct Lent {
    c10::intrusive_ptr<Node>& node;
    ~Lent() { (void)node.release(); }
  } lent{node_call.node};
  CompiledNodeArgs& args = c->args;
  args.*get(CompiledNodeArgsKeySize()) = 0;
  const NodeType type = node_type(node);
  auto opaque = [&] {
    *supported = 0;
    *key_len = 0;
    *n_sizes = 0;
    clear_map(unpacked);
    clear_map(compiler.sv_to_hooks);
    auto& lifted = compiler.lifted_ivalue_args.args;
    lifted.erase(lifted.begin() + static_cast<std::ptrdiff_t>(ivalues_before), lifted.end());
    return RG_OK;
  };
  try {
    node.compiled_args(args);
  } catch (const c10::NotImplementedError&) {
    // A node type that does not describe its state (e.g. a third-party Node subclass):
    // it can only run as itself.
    return opaque();
  } catch (python_error&) {
    // A Python Function whose `_compiled_autograd_key` raises (AOTAutograd's backward of
    // a compiled backward has no `symints`; its backward raises that double backward is
    // not supported): its state is unknown, so it runs as itself, raising what it raises
    // where the engine runs it. (The error, caught here, is dropped.)
    if (type != NodeType::kPython) {
      throw;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyErr_Clear();
    PyGILState_Release(gil);
    return opaque();
  }
  // CopySlices runs the node of the in-place op it wraps: traced only when that node is one
  // of torch's own (a custom Function's backward must run as itself, every call). Nothing
  // derives from CopySlices, so its type is compared (a dynamic_cast per node costs more).
  if (type == NodeType::kCopySlices) {
    const auto& copy_slices = static_cast<torch::autograd::CopySlices&>(node);
    if (!copy_slices.fn || kind_of(*copy_slices.fn) != RG_NODE_GENERIC) {
      return opaque();
    }
  }
  // Saved values behind saved_tensors_hooks: their unpack hooks run when the node runs, not
  // when the replay is planned, so that recomputation happens in engine order and its memory
  // is freed as it goes. A node of torch's whose hooked values all have one deferrable
  // unpack hook (non-reentrant checkpointing's) is traced, those values coming from its
  // unpack at run time (appended as undefined slots); any other runs as itself.
  PyObject* unpack_hook = nullptr;
  if (!compiler.sv_to_hooks.empty()) {
    if (kind_of(type) == RG_NODE_GENERIC) {
      unpack_hook = deferrable_unpack_hook(compiler);
    }
    if (unpack_hook == nullptr) {
      return opaque();
    }
  }
  auto node_key = args.key();
  c->key.assign(node_key.key, node_key.key + node_key.key_size);
  if (type == NodeType::kPython &&
      (!append_ctx_state(static_cast<torch::autograd::PyNode&>(node).pyobj(), c->key) ||
       !plain_saved_objects(unpacked, compiler.tensor_args.inputs))) {
    return opaque();
  }
  // The sizes of a generated node, or of a CopySlices wrapping one, can be lifted (see
  // rg_node_apply_lifted).
  Node& formula = formula_node(node);
  if (compiler.lifted_ivalue_args.args.size() == ivalues_before && has_functional_form(formula) &&
      liftable_type(formula)) {
    *lifted = 1;
  }
  auto& ivalues = compiler.lifted_ivalue_args.args;
  ivalues.erase(ivalues.begin() + static_cast<std::ptrdiff_t>(ivalues_before), ivalues.end());
  for (const auto& size : compiler.all_size_inputs) {
    c->sizes.push_back(size.value);
  }

  auto& plain = c->order;
  ordered_slots(unpacked, plain);
  const size_t scalars_before = c->scalars.size();
  // Whether the node's wrapped numbers may be lifted (see takes_dimensioned_gradients),
  // found when the first one is met: -1 not yet known.
  int lifts_wrapped = -1;
  auto may_lift = [&](const c10::TensorImpl* impl) {
    if (!impl->is_wrapped_number()) {
      return true;
    }
    if (lifts_wrapped < 0) {
      lifts_wrapped = takes_dimensioned_gradients(node) && takes_dimensioned_gradients(formula);
    }
    return lifts_wrapped == 1;
  };
  for (const auto& [sv, arg] : plain) {
    at::Tensor value;
    if (arg->defined()) {
      const at::Tensor& source = compiler.tensor_args.inputs[arg->index()];
      const size_t slot = c->values.size();
      const c10::TensorImpl* impl = source.unsafeGetTensorImpl();
      const void* same = impl;
      if (auto wrapped = wrapped_value(impl)) {
        same = c->first_wrapped.try_emplace(*wrapped, impl).first->second;
      }
      const size_t first = c->first_slot.find_or_insert(same, slot);
      if (first == slot) {
        value = replay_value(source);
        if (!value.is_same(source)) {
          c->sources.push_back(source);
        }
        if (liftable_scalar(value) && may_lift(impl)) {
          c->scalars.emplace_back(slot, lifted_scalar(value));
        }
      } else {
        value = c->values[first];
        if (same != impl) {
          c->aliases.emplace_back(slot, source);
        }
        auto lifted = std::lower_bound(c->scalars.begin(), c->scalars.end(), first,
                                       [](const auto& s, size_t i) { return s.first < i; });
        if (lifted != c->scalars.end() && lifted->first == first && may_lift(impl)) {
          c->scalars.emplace_back(slot, lifted->second);
        }
      }
      c->versions.push_back(version_of(same != impl ? source : value));
    } else {
      c->versions.push_back(0);
    }
    c->svs.push_back(sv);
    c->values.push_back(std::move(value));
  }
  // Which slots are lifted is part of the key: the replay indexes them back.
  const size_t node_first = c->values.size() - plain.size();
  for (size_t i = scalars_before; i < c->scalars.size(); ++i) {
    const auto position = static_cast<uint32_t>(c->scalars[i].first - node_first);
    const auto* bytes = reinterpret_cast<const uint8_t*>(&position);
    c->key.insert(c->key.end(), bytes, bytes + sizeof(position));
  }
  auto& hooked = c->hooked;
  ordered_hooked(compiler, hooked);
  for (const auto& [id, sv] : hooked) {
    c->svs.push_back(sv);
    c->versions.push_back(0);
    c->values.emplace_back();
  }
  *n_saved = plain.size() + hooked.size();
  *n_hooked = hooked.size();
  *group = reinterpret_cast<uintptr_t>(unpack_hook);
  *key = c->key.data();
  *key_len = c->key.size();
  *sizes = c->sizes.data();
  *n_sizes = c->sizes.size();
  clear_map(unpacked);
  clear_map(compiler.sv_to_hooks);
  RG_CATCH
}

void rg_collector_end_visits(rg_collector* c) {
  // Swapped with empty ones, so that their memory is freed (clear() keeps it).
  auto release = [](auto& container) {
    std::remove_reference_t<decltype(container)>().swap(container);
  };
  c->first_slot = SlotTable();
  release(c->sources);
  release(c->first_wrapped);
  release(c->order);
  release(c->hooked);
  release(c->key);
  release(c->sizes);
}

size_t rg_collector_len(const rg_collector* c) {
  return c->svs.size();
}

rg_status rg_collector_saved_variables(const rg_collector* c, const rg_sv** out, size_t n) {
  RG_TRY
  if (n != c->svs.size()) {
    return fail(RG_KIND_INDEX, "rg_collector_saved_variables: wrong number of slots");
  }
  for (size_t i = 0; i < n; ++i) {
    out[i] = reinterpret_cast<const rg_sv*>(c->svs[i]);
  }
  RG_CATCH
}

rg_status rg_collector_value(const rg_collector* c, size_t i, rg_tensor** value) {
  RG_TRY
  if (i >= c->values.size()) {
    return fail(RG_KIND_INDEX, "rg_collector_value: slot out of range");
  }
  *value = c->values[i].defined() ? new_handle(c->values[i]) : nullptr;
  RG_CATCH
}

rg_status rg_collector_forget(rg_collector* c, size_t begin, size_t end) {
  RG_TRY
  end = std::min(end, c->values.size());
  for (size_t i = begin; i < end; ++i) {
    c->values[i] = at::Tensor();
  }
  auto in_range = [&](const auto& entry) { return entry.first >= begin && entry.first < end; };
  c->aliases.erase(std::remove_if(c->aliases.begin(), c->aliases.end(), in_range),
                   c->aliases.end());
  c->scalars.erase(std::remove_if(c->scalars.begin(), c->scalars.end(), in_range),
                   c->scalars.end());
  RG_CATCH
}

rg_status rg_collector_first_modified(const rg_collector* c, size_t begin, size_t end,
                                      size_t* slot) {
  RG_TRY
  end = std::min(end, c->values.size());
  *slot = end;
  auto alias = std::lower_bound(c->aliases.begin(), c->aliases.end(), begin,
                                [](const auto& a, size_t i) { return a.first < i; });
  for (size_t i = begin; i < end; ++i) {
    const bool aliased = alias != c->aliases.end() && alias->first == i;
    const at::Tensor& value = aliased ? (alias++)->second : c->values[i];
    if (!value.defined()) {
      continue;
    }
    // Modified in place, or released by a backward through its node since (a nested
    // backward without retain_graph, e.g. from a hook): its unpack raises either way.
    const SavedVariable& sv = *c->svs[i];
    auto raw = sv.get_raw_data();
    if (version_of(value) != c->versions[i] || (raw.has_value() && !raw->defined())) {
      *slot = i;
      break;
    }
  }
  RG_CATCH
}

rg_status rg_saved_variable_unpack_value(const rg_sv* sv, rg_node* saved_for, rg_tensor** value) {
  RG_TRY
  *value = nullptr;
  at::Tensor unpacked = as_sv(sv)->unpack(as_node(saved_for)->getptr());
  *value = new_handle(detached_value(unpacked));
  RG_CATCH
}

rg_status rg_buffer_sum_function(PyObject** out) {
  RG_TRY
  *out = PyCFunction_New(&buffer_sum_def, nullptr);
  if (!*out) {
    throw python_error();
  }
  RG_CATCH
}

rg_status rg_unpack_hooks_defer(PyObject* code) {
  RG_TRY
  if (!PyCode_Check(code)) {
    return fail(RG_KIND_TYPE, "rg_unpack_hooks_defer: expected a code object");
  }
  if (std::find(deferrable_unpack_codes.begin(), deferrable_unpack_codes.end(), code) ==
      deferrable_unpack_codes.end()) {
    deferrable_unpack_codes.push_back(Py_NewRef(code));
  }
  RG_CATCH
}

rg_status rg_collector_values_to_list(const rg_collector* c, int lift, PyObject** out) {
  RG_TRY
  THPObjectPtr list(PyList_New(static_cast<Py_ssize_t>(c->values.size())));
  if (!list) {
    throw python_error();
  }
  auto scalar = c->scalars.begin();
  for (size_t i = 0; i < c->values.size(); ++i) {
    const bool lifted = lift && scalar != c->scalars.end() && scalar->first == i;
    const at::Tensor& value = lifted ? (scalar++)->second : c->values[i];
    // A replay makes one Python tensor per saved value per call (hundreds on a long chain),
    // alive for the call. Tracked by the cycle collector, they are moved to older
    // generations by collections during calls, which soon triggers a full collection of the
    // heap (hundreds of ms once torch is imported; eager autograd makes no such objects). A
    // tensor wrapped here for the first time (a plain torch.Tensor: the detached value of a
    // dense tensor) refers to no Python object, so it cannot be part of a cycle: untracked.
    const bool fresh =
        value.defined() && value.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj() == nullptr;
    PyObject* item = value.defined() ? THPVariable_Wrap(value) : Py_NewRef(Py_None);
    if (!item) {
      throw python_error();
    }
    if (fresh && Py_TYPE(item) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
      PyObject_GC_UnTrack(item);
    }
    PyList_SET_ITEM(list.get(), static_cast<Py_ssize_t>(i), item);
  }
  *out = list.release();
  RG_CATCH
}

// The profiler event the engine records around each node it evaluates. Profilers give it the
// sequence number and forward thread of the node's own event, which must come right after.
// Its name is only built while something records.
#define RECORD_EVALUATE_FUNCTION(node)                                                          \
  RECORD_FUNCTION(c10::str("autograd::engine::evaluate_function: ", (node).name()),             \
                  c10::ArrayRef<const c10::IValue>())

// Whether the replay calls hook `i` of `kind` itself (for retains_grad hooks: the one
// watching output i).
static bool is_planned(const rg_planned_hooks& planned, int kind, size_t i) {
  const uint32_t* begin = planned.planned[kind];
  const uint32_t* end = begin + planned.n_planned[kind];
  return std::find(begin, end, i) != end;
}

// Calls the tensor pre-hooks and retains_grad hooks of `node` other than `planned`, as
// call_tensor_pre_hooks does: in list order (the replay called the planned ones already).
static variable_list call_new_tensor_pre_hooks(Node& node, const rg_planned_hooks& planned,
                                               variable_list inputs) {
  auto& tensor_pre = node.tensor_pre_hooks();
  for (size_t i = 0; i < tensor_pre.size(); ++i) {
    if (!is_planned(planned, RG_HOOK_TENSOR_PRE, i)) {
      inputs = (*tensor_pre[i])(inputs);
    }
  }
  for (const auto& [output, hook] : node.retains_grad_hooks()) {
    if (!is_planned(planned, RG_HOOK_RETAINS_GRAD, output)) {
      inputs = (*hook)(inputs);
    }
  }
  return inputs;
}

// Calls the hooks of `node` other than `planned` that the engine calls before it: those of
// call_tensor_pre_hooks (unless the replay called them already, before the node's planned
// pre-hooks), then those of call_pre_hooks.
static variable_list call_new_pre_hooks(Node& node, const rg_planned_hooks& planned,
                                        variable_list inputs) {
  if (!planned.tensor_pre_done) {
    inputs = call_new_tensor_pre_hooks(node, planned, std::move(inputs));
  }
  auto& pre = node.pre_hooks();
  for (size_t i = 0; i < pre.size(); ++i) {
    if (!is_planned(planned, RG_HOOK_PRE, i)) {
      inputs = (*pre[i])(inputs);
    }
  }
  return inputs;
}

// Calls the post hooks of `node` other than `planned` after it ran, as call_post_hooks does:
// given the inputs only if the node had post hooks when it was called.
static variable_list call_new_post_hooks(Node& node, const rg_planned_hooks& planned,
                                         variable_list outputs, bool had_post_hooks,
                                         const variable_list& inputs) {
  auto& post = node.post_hooks();
  const variable_list none;
  for (size_t i = 0; i < post.size(); ++i) {
    if (!is_planned(planned, RG_HOOK_POST, i)) {
      outputs = (*post[i])(outputs, had_post_hooks ? inputs : none);
    }
  }
  return outputs;
}

rg_status rg_node_has_new_hooks(rg_node* n, const rg_planned_hooks* planned,
                                int tensor_pre_only, int* out) {
  RG_TRY
  Node& node = *as_node(n);
  const size_t sizes[] = {node.tensor_pre_hooks().size(),
                          tensor_pre_only ? 0 : node.pre_hooks().size(),
                          tensor_pre_only ? 0 : node.post_hooks().size()};
  bool found = false;
  for (int kind : {RG_HOOK_TENSOR_PRE, RG_HOOK_PRE, RG_HOOK_POST}) {
    for (size_t i = 0; i < sizes[kind] && !found; ++i) {
      if (!is_planned(*planned, kind, i)) {
        int64_t value_idx = -1;
        PyObject* dict = hook_dict(node, kind, i, &value_idx);
        found = dict == nullptr || !dict_is_empty(dict);
      }
    }
  }
  for (const auto& entry : node.retains_grad_hooks()) {
    found = found || !is_planned(*planned, RG_HOOK_RETAINS_GRAD, entry.first);
  }
  *out = found ? 1 : 0;
  RG_CATCH
}

rg_status rg_node_call_new_tensor_pre_hooks(rg_node* n, const rg_planned_hooks* planned,
                                            const rg_tensor* const* values, size_t count,
                                            rg_tensor** out) {
  RG_TRY
  return write_hook_values(
      "rg_node_call_new_tensor_pre_hooks: a hook changed the number of values", count, out,
      [&] { return call_new_tensor_pre_hooks(*as_node(n), *planned, to_list(values, count)); });
  RG_CATCH
}

rg_status rg_node_apply(rg_node* n, rg_tensor* const* inputs, size_t n_inputs,
                        int take_inputs, const rg_sv* const* svs, const rg_tensor* const* saved,
                        size_t n_saved, const rg_planned_hooks* live, rg_tensor** out,
                        size_t cap, size_t* n_out) {
  RG_TRY
  Node& node = *as_node(n);
  *n_out = 0;
  variable_list outputs;
  {
    std::optional<GraphLock> lock;
    if (n_saved > 0) {
      lock.emplace();
    }
    SavedSwap swap;
    swap.swap_in(svs, saved, n_saved);
    at::AutoGradMode grad_mode(false);
    WithoutGil no_gil;
    RECORD_EVALUATE_FUNCTION(node);
    variable_list args = take_inputs ? take_list(inputs, n_inputs) : to_list(inputs, n_inputs);
    if (live != nullptr) {
      args = call_new_pre_hooks(node, *live, std::move(args));
    }
    // As in call_function: post hooks get the inputs if the node had any when it was called.
    const bool had_post_hooks = !node.post_hooks().empty();
    outputs = node(live != nullptr && had_post_hooks ? variable_list(args) : std::move(args));
    validate(node, node.next_edges(), outputs);
    if (live != nullptr) {
      outputs = call_new_post_hooks(node, *live, std::move(outputs), had_post_hooks, args);
    }
  }
  return hand_out(std::move(outputs), out, cap, n_out);
  RG_CATCH
}

rg_status rg_python_function_outputs(rg_node* n, PyObject* result, PyObject* sizes,
                                     rg_tensor** out, size_t cap, size_t* n_out) {
  RG_TRY
  *n_out = 0;
  Node& node = *as_node(n);
  if (node_type(node) != NodeType::kPython) {
    return fail(RG_KIND_RUNTIME, "rg_python_function_outputs: not a Python Function's node");
  }
  auto* fn = reinterpret_cast<THPFunction*>(static_cast<torch::autograd::PyNode&>(node).pyobj());
  if (fn == nullptr) {
    return fail(RG_KIND_RUNTIME, "rg_python_function_outputs: the Function's ctx is gone");
  }
  const std::vector<bool>& is_variable_input = fn->is_variable_input;
  const auto expected = static_cast<Py_ssize_t>(is_variable_input.size());
  THPObjectPtr values(PyTuple_Check(result) ? (Py_INCREF(result), result)
                                            : PyTuple_Pack(1, result));
  if (!values) {
    throw python_error();
  }
  Py_ssize_t count = PyTuple_GET_SIZE(values.get());
  if (count > expected) {
    bool extra_none = true;
    for (Py_ssize_t i = expected; i < count; ++i) {
      extra_none = extra_none && PyTuple_GET_ITEM(values.get(), i) == Py_None;
    }
    if (extra_none) {
      count = expected;
    }
  }
  if (count != expected) {
    return fail(RG_KIND_RUNTIME, ("function " + node.name() +
                                  " returned an incorrect number of gradients (expected " +
                                  std::to_string(expected) + ", got " + std::to_string(count) +
                                  ")")
                                     .c_str());
  }
  variable_list outputs;
  outputs.reserve(node.num_outputs());
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* value = PyTuple_GET_ITEM(values.get(), i);
    if (!is_variable_input[i]) {
      if (value != Py_None) {
        return fail(RG_KIND_RUNTIME,
                    ("function " + node.name() +
                     " returned a gradient different than None at position " +
                     std::to_string(i + 1) +
                     ", but the corresponding forward input was not a Variable")
                        .c_str());
      }
      continue;
    }
    if (value == Py_None) {
      outputs.emplace_back();
    } else if (THPVariable_Check(value)) {
      outputs.emplace_back(THPVariable_Unpack(value));
    } else {
      return fail(RG_KIND_RUNTIME,
                  (std::string("expected Variable or None (got ") + Py_TYPE(value)->tp_name + ")")
                      .c_str());
    }
  }
  if (sizes == nullptr) {
    WithoutGil no_gil;
    validate(node, node.next_edges(), outputs);
    return hand_out(std::move(outputs), out, cap, n_out);
  }
  auto symbolic = lifted_sizes(sizes);
  GraphLock lock;
  std::vector<int64_t> dims;
  if (!edge_dims(node, dims) || symbolic.size() != dims.size()) {
    return fail(RG_KIND_RUNTIME, "rg_python_function_outputs: wrong number of sizes");
  }
  // The metadata's shapes swapped for the given sizes while validating, as
  // rg_node_apply_lifted does.
  AutogradCompilerCall compiler{SizeInput::STATIC};
  auto& node_call = compiler.node_calls.lookup(node.getptr());
  TraceState state(std::move(symbolic), node.num_outputs());
  SwapSavedVariables swap(compiler, state, nullptr, node_call);
  auto& edges = const_cast<edge_list&>(node.next_edges());
  EdgeShapesSwapped swapped(swap, edges);
  {
    WithoutGil no_gil;
    validate(node, edges, outputs);
  }
  return hand_out(std::move(outputs), out, cap, n_out);
  RG_CATCH
}

rg_status rg_node_apply_lifted(rg_node* n, const rg_tensor* const* inputs, size_t n_inputs,
                               const rg_tensor* const* saved, size_t n_saved, PyObject* sizes,
                               rg_tensor** out, size_t cap, size_t* n_out) {
  RG_TRY
  Node& node = *as_node(n);
  *n_out = 0;
  GraphLock lock;
  // The node's state as compiled_args describes it: its saved variables (mapped to the given
  // values in slot order) and its size inputs.
  AutogradCompilerCall compiler{SizeInput::STATIC};
  auto& node_call = compiler.node_calls.lookup(node.getptr());
  CompiledNodeArgs args(compiler, node_call);
  {
    // compiled_args unpacks the node's real saved values: not for the tracer's modes.
    torch::torch_dispatch_mode::StashTorchDispatchStackGuard no_modes;
    node.compiled_args(args);
  }
  SavedVariableMap& unpacked = saved_variable_map(compiler.tensor_args);
  SlotOrder slots;
  ordered_slots(unpacked, slots);
  if (slots.size() + compiler.sv_to_hooks.size() != n_saved ||
      !compiler.lifted_ivalue_args.args.empty()) {
    return fail(RG_KIND_RUNTIME, "rg_node_apply_lifted: the node's state is not the planned one");
  }
  // Hooked saved values come after these (see below).
  for (size_t i = 0; i < slots.size(); ++i) {
    TensorArg* arg = slots[i].arg;
    if (arg->defined()) {
      if (!saved[i]) {
        return fail(RG_KIND_RUNTIME, "rg_node_apply_lifted: a saved value is missing");
      }
      arg->proxy_tensor = as_tensor(saved[i]);
    }
  }
  auto symbolic = lifted_sizes(sizes);
  // Hooked saved values come last (as planned): what their unpack hook returned.
  HookedOrder hooked;
  ordered_hooked(compiler, hooked);
  variable_list unpacked_values(compiler.hooks.size());
  for (size_t j = 0; j < hooked.size(); ++j) {
    const rg_tensor* value = saved[slots.size() + j];
    if (!value) {
      return fail(RG_KIND_RUNTIME, "rg_node_apply_lifted: a saved value is missing");
    }
    unpacked_values.at(hooked[j].first) = as_tensor(value);
  }
  std::vector<int64_t> dims;
  if (!edge_dims(node, dims) ||
      symbolic.size() != dims.size() + compiler.all_size_inputs.size()) {
    return fail(RG_KIND_RUNTIME, "rg_node_apply_lifted: wrong number of sizes");
  }
  TraceState state(std::move(symbolic), node.num_outputs());
  SwapSavedVariables swap(compiler, state, nullptr, node_call);
  auto& edges = const_cast<edge_list&>(node.next_edges());
  auto interface = std::make_unique<LiftedApply>(node);
  interface->set_unpacked(std::move(unpacked_values));
  const LiftedApply& apply = *interface;
  variable_list outputs;
  {
    PyCompilerGuard guard(std::move(interface));
    // The shapes outputs are validated against, swapped back at the end of the scope.
    EdgeShapesSwapped swapped(swap, edges);
    at::AutoGradMode grad_mode(false);
    outputs = node.apply_with_saved(to_list(inputs, n_inputs), swap);
    apply.rethrow();
    validate(node, edges, outputs);
  }
  return hand_out(std::move(outputs), out, cap, n_out);
  RG_CATCH
}

rg_status rg_node_type_not_liftable(rg_node* n) {
  RG_TRY
  const Node& node = formula_node(*as_node(n));
  std::lock_guard<std::mutex> lock(unliftable_mutex);
  unliftable_types.insert(&typeid(node));
  any_unliftable.store(true, std::memory_order_release);
  RG_CATCH
}

namespace {
// Node::mutex_, which AccumulateGrad::apply holds while it accumulates.
struct NodeMutex {
  using type = std::mutex Node::*;
  friend type get(NodeMutex);
};
template struct PrivateAccess<NodeMutex, &Node::mutex_>;
}  // namespace

// Runs `node` (an AccumulateGrad) on `grad` as the engine does, with its hooks other than
// `planned` around it; the caller holds no GIL and has grad mode off.
static void run_accumulate(Node& node, at::Tensor grad, const rg_planned_hooks& planned) {
  variable_list inputs(1);
  inputs[0] = std::move(grad);
  RECORD_EVALUATE_FUNCTION(node);
  inputs = call_new_pre_hooks(node, planned, std::move(inputs));
  // As in call_function, the inputs are kept for post hooks, a reference AccumulateGrad
  // allows for when it steals the gradient. For the planned ones the caller keeps them.
  const bool had_post_hooks = !node.post_hooks().empty();
  const bool new_post_hooks = node.post_hooks().size() > planned.n_planned[RG_HOOK_POST];
  auto outputs = node(new_post_hooks ? variable_list(inputs) : std::move(inputs));
  call_new_post_hooks(node, planned, std::move(outputs), had_post_hooks, inputs);
}

rg_status rg_node_accumulate(rg_node* n, rg_tensor* grad, const rg_planned_hooks* planned) {
  RG_TRY
  Node& node = *as_node(n);
  if (!dynamic_cast<AccumulateGrad*>(&node)) {
    return fail(RG_KIND_VALUE, "rg_node_accumulate: not an AccumulateGrad node");
  }
  at::Tensor value = take_tensor(grad);
  at::AutoGradMode grad_mode(false);
  WithoutGil no_gil;
  run_accumulate(node, std::move(value), *planned);
  RG_CATCH
}

// Whether AccumulateGrad::apply, given the product a.t() @ b, would add it to the
// variable's .grad in place (accumulateGrad's case 2.3) and nothing else would see the
// product: no hooks on the node or the variable; the grad, a and b plain dense tensors of
// one dtype and device, the grad not sharing memory with a or b (addmm_ would refuse) and
// obeying the gradient layout contract (else the node warns).
static bool adds_product_in_place(AccumulateGrad& node, const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor& variable = node.variable;
  if (!variable.defined() || !variable.requires_grad() || variable.grad_fn() ||
      !node.tensor_pre_hooks().empty() || !node.pre_hooks().empty() ||
      !node.post_hooks().empty() || !node.retains_grad_hooks().empty() ||
      node.tensor_post_acc_grad_hooks() != nullptr) {
    return false;
  }
  const at::Tensor& grad = variable.grad();
  auto plain = [&](const at::Tensor& t) {
    return t.defined() && t.layout() == at::kStrided && t.dim() == 2 &&
           t.scalar_type() == grad.scalar_type() && t.device() == grad.device() &&
           !at::isTensorSubclassLike(t);
  };
  return plain(grad) && plain(a) && plain(b) && a.size(0) == b.size(0) &&
         grad.size(0) == a.size(1) && grad.size(1) == b.size(1) && !grad.is_alias_of(a) &&
         !grad.is_alias_of(b) && torch::autograd::utils::obeys_layout_contract(grad, variable);
}

rg_status rg_node_accumulate_product(rg_node* n, rg_tensor* a, rg_tensor* b,
                                     const rg_planned_hooks* planned) {
  RG_TRY
  Node& node = *as_node(n);
  auto* accumulate = dynamic_cast<AccumulateGrad*>(&node);
  if (!accumulate) {
    return fail(RG_KIND_VALUE, "rg_node_accumulate_product: not an AccumulateGrad node");
  }
  at::Tensor left = take_tensor(a);
  at::Tensor right = take_tensor(b);
  at::AutoGradMode grad_mode(false);
  WithoutGil no_gil;
  if (!left.defined() || !right.defined()) {
    // No gradient arrived (the product's factor is undefined): the node does nothing.
    run_accumulate(node, at::Tensor(), *planned);
  } else if (adds_product_in_place(*accumulate, left, right)) {
    RECORD_EVALUATE_FUNCTION(node);
    std::lock_guard<std::mutex> lock(node.*get(NodeMutex()));
    accumulate->variable.mutable_grad().addmm_(left.t(), right);
  } else {
    at::Tensor product = left.t().mm(right);
    left.reset();
    right.reset();
    run_accumulate(node, std::move(product), *planned);
  }
  RG_CATCH
}

rg_status rg_validate_root_grads(rg_node* const* nodes, const uint32_t* input_nrs, size_t n,
                                 const rg_tensor* const* grads, rg_tensor** out) {
  RG_TRY
  edge_list edges;
  for (size_t i = 0; i < n; ++i) {
    if (nodes[i]) {
      edges.emplace_back(c10::intrusive_ptr<Node>::reclaim_copy(as_node(nodes[i])), input_nrs[i]);
    } else {
      edges.emplace_back();
    }
  }
  variable_list values = to_list(grads, n);
  GraphLock lock;
  torch::autograd::validate_outputs(edges, values, [](const std::string& msg) { return msg; });
  write_list(std::move(values), out);
  RG_CATCH
}

rg_status rg_nodes_release_variables(rg_node* const* nodes, size_t n) {
  RG_TRY
  GraphLock lock;
  for (size_t i = 0; i < n; ++i) {
    as_node(nodes[i])->release_variables();
  }
  RG_CATCH
}

rg_status rg_graphs_lock(void) {
  RG_TRY
  GraphLock lock;
  graph_mutex.lock();  // recursive: held once more, past this scope
  RG_CATCH
}

void rg_graphs_unlock(void) {
  graph_mutex.unlock();
}

rg_status rg_engine_hook_install(PyObject* callback) {
  RG_TRY
  Py_XINCREF(callback);
  Py_XDECREF(engine_callback);
  engine_callback = callback;
  torch::autograd::Engine::set_compiled_autograd(&engine_hook);
  RG_CATCH
}

rg_status rg_engine_hook_uninstall(void) {
  RG_TRY
  torch::autograd::Engine::set_compiled_autograd(nullptr);
  Py_XDECREF(engine_callback);
  engine_callback = nullptr;
  RG_CATCH
}

void rg_engine_set_enabled(int enabled) {
  engine_enabled = enabled != 0;
}

int rg_engine_enabled(void) {
  return engine_enabled ? 1 : 0;
}

rg_status rg_warnings_push(void) {
  RG_TRY
  warning_handlers.push_back(std::make_unique<torch::PyWarningHandler>());
  RG_CATCH
}

rg_status rg_warnings_pop(int in_exception) {
  RG_TRY
  TORCH_CHECK(!warning_handlers.empty(), "rg_warnings_pop without rg_warnings_push");
  torch::PyWarningHandler* handler = warning_handlers.back().release();
  warning_handlers.pop_back();
  if (in_exception) {
    handler->set_in_exception();
  }
  // Issues the warnings, and throws python_error for one a filter turned into an error (a
  // delete expression lets it through and frees the handler; unique_ptr::reset would
  // terminate).
  delete handler;
  RG_CATCH
}

rg_status rg_engine_call_info(PyObject* capsule, size_t* n_roots, size_t* n_outputs,
                              int* accumulate_grad, int* keep_graph, int* create_graph) {
  RG_TRY
  const EngineCall& call = engine_call(capsule);
  *n_roots = call.graph_root->next_edges().size();
  *n_outputs = call.outputs->size();
  *accumulate_grad = call.accumulate_grad ? 1 : 0;
  *keep_graph = call.graph_task->keep_graph_ ? 1 : 0;
  *create_graph = (call.graph_task->thread_locals_.*get(ThreadLocalAutograd())).get_grad_mode() ? 1 : 0;
  RG_CATCH
}

rg_status rg_engine_call_roots(PyObject* capsule, rg_node** nodes, uint32_t* input_nrs,
                               rg_tensor** grads) {
  RG_TRY
  const EngineCall& call = engine_call(capsule);
  const edge_list& edges = call.graph_root->next_edges();
  for (size_t i = 0; i < edges.size(); ++i) {
    c10::intrusive_ptr<Node> fn = edges[i].function;
    input_nrs[i] = edges[i].input_nr;
    nodes[i] = fn ? as_rg(fn.release()) : nullptr;
    grads[i] = i < call.graph_root->outputs.size() ? new_handle(call.graph_root->outputs[i]) : nullptr;
  }
  RG_CATCH
}

rg_status rg_engine_call_outputs(PyObject* capsule, rg_node** nodes, uint32_t* input_nrs) {
  RG_TRY
  const EngineCall& call = engine_call(capsule);
  for (size_t i = 0; i < call.outputs->size(); ++i) {
    const Edge& edge = (*call.outputs)[i];
    c10::intrusive_ptr<Node> fn = edge.function;
    input_nrs[i] = edge.input_nr;
    nodes[i] = fn ? as_rg(fn.release()) : nullptr;
  }
  RG_CATCH
}

} // extern "C"
