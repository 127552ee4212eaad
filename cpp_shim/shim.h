// replaygrad's C++ shim: the C ABI over the torch internals that Rust and Python cannot
// reach on a stock torch wheel. It makes no decisions; the Rust crate (rust/ffi.rs) is its
// only caller.
//
// Conventions
// - Every function returns an rg_status. On RG_ERROR the message and kind are available
//   from rg_last_error_message / rg_last_error_kind (thread-local, valid until the next
//   failing call on this thread). On RG_PYTHON_ERROR a Python exception is set (it was
//   raised by Python code the call ran: a hook, a custom Function's backward).
// - rg_node is torch::autograd::Node, rg_tensor is at::Tensor (tch's C_tensor), rg_sv is
//   torch::autograd::SavedVariable.
// - A function that "returns a new reference" to a node hands the caller one strong
//   reference, to be dropped with rg_node_decref. Borrowed pointers stay valid while the
//   node that handed them out is alive.
// - Tensors handed out are new heap at::Tensor handles owned by the caller (tch's
//   Tensor::from_ptr takes them); a null tensor pointer means "undefined tensor" (None).
// - Functions that touch Python objects or call Python code need the GIL.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct _object PyObject;
typedef struct rg_node rg_node;
typedef struct rg_tensor rg_tensor;
typedef struct rg_sv rg_sv;
typedef struct rg_collector rg_collector;
typedef struct rg_engine_call rg_engine_call;
// The hooks of a node that the replay calls itself (see rg_node_apply): per hook kind
// (rg_hook_kind order), their positions in the node's list; for retains_grad hooks, the
// outputs they watch. `tensor_pre_done`: the node's other tensor pre-hooks and retains_grad
// hooks were called already (rg_node_call_new_tensor_pre_hooks).
typedef struct {
  const uint32_t* planned[4];
  size_t n_planned[4];
  int tensor_pre_done;
} rg_planned_hooks;

typedef enum {
  RG_OK = 0,
  RG_ERROR = 1,
  RG_PYTHON_ERROR = 2,
} rg_status;

// The Python exception type torch raises for the C++ exception that failed the call.
typedef enum {
  RG_KIND_RUNTIME = 0,
  RG_KIND_INDEX = 1,
  RG_KIND_VALUE = 2,
  RG_KIND_TYPE = 3,
  RG_KIND_NOT_IMPLEMENTED = 4,
  RG_KIND_MEMORY = 5,
  RG_KIND_LINALG = 6, // c10::LinAlgError: torch.linalg.LinAlgError
} rg_error_kind;

const char* rg_last_error_message(void);
int rg_last_error_kind(void);

// ---- node handles ----------------------------------------------------------------------
void rg_node_incref(rg_node* node);
void rg_node_decref(rg_node* node);
// The gradient edge of a tensor: (grad_fn, output_nr) for a non-leaf, (AccumulateGrad, 0)
// for a leaf that requires grad, a null node otherwise. New reference.
rg_status rg_tensor_gradient_edge(const rg_tensor* t, rg_node** node, uint32_t* input_nr);
// The edge autograd.grad/backward(inputs=) differentiate with respect to: (grad_fn,
// output_nr) for a non-leaf, the existing AccumulateGrad for a leaf, a null node for a leaf
// that has none (it was never used in a graph). New reference.
rg_status rg_tensor_input_edge(const rg_tensor* t, rg_node** node, uint32_t* input_nr);
// The node behind a Python grad_fn object (C++ node or Python custom Function context).
// New reference; null if `obj` is neither.
rg_status rg_node_from_pyobject(PyObject* obj, rg_node** node);
// The Python object for a node (the same object on every call). New reference.
rg_status rg_node_to_pyobject(rg_node* node, PyObject** out);

typedef enum {
  RG_NODE_GENERIC = 0,      // generated nodes and other C++ nodes
  RG_NODE_ACCUMULATE_GRAD = 1,
  RG_NODE_PYTHON = 2,       // PyNode: a Python torch.autograd.Function
  RG_NODE_CPP_FUNCTION = 3, // CppNode<T>: a C++ torch::autograd::Function
} rg_node_kind;

typedef struct {
  uint64_t sequence_nr;
  // typeid(*node).name(): static storage, identifies the C++ type.
  const char* type_name;
  uint32_t kind;
  uint32_t num_inputs;
  uint32_t num_outputs;
  uint32_t num_tensor_pre_hooks;
  uint32_t num_retains_grad_hooks;
  uint32_t num_pre_hooks;
  uint32_t num_post_hooks;
  uint32_t has_post_acc_grad_hooks;
  // Inputs whose metadata has a layout other than strided (sparse, mkldnn, ...).
  uint32_t non_strided_inputs;
  // Inputs whose metadata is a nested tensor's (strided or jagged).
  uint32_t nested_inputs;
} rg_node_info;

// Everything the graph walk reads of a node, in one call: its info; next_edges()[0..min(count,
// edge_cap)) as borrowed node pointers (null for invalid edges) and input_nrs (count is
// info->num_outputs); and the metadata of its inputs (what the engine checks gradients
// against) as bytes, written up to meta_cap, full length in *meta_len: per input the int32s
// dtype (c10::ScalarType), device type, device index, layout (c10::Layout), dim count (-1
// for nested tensors, which have no plain shape) and the dtype the engine casts gradients to
// (a leaf's grad_dtype; -1 for none, -2 for a non-differentiable output's metadata), then
// the sizes as int64s.
rg_status rg_node_describe(rg_node* node, rg_node_info* info, rg_node** nodes, uint32_t* input_nrs,
                           size_t edge_cap, uint8_t* meta, size_t meta_cap, size_t* meta_len);
// Fills next_edges()[0..n): borrowed node pointers (null for invalid edges) and input_nrs.
rg_status rg_node_next_edges(rg_node* node, rg_node** nodes, uint32_t* input_nrs, size_t n);
// node->name() into buf (truncated to cap); *len is the full length.
rg_status rg_node_name(rg_node* node, char* buf, size_t cap, size_t* len);
// node->is_traceable(); a Python Function without an `is_traceable` attribute is not
// traceable (torch raises AttributeError there; the error is cleared).
rg_status rg_node_is_traceable(rg_node* node, int* out);
// For a Python Function's node: *out = 1 if PyNode::apply hands its backward None for an
// undefined gradient at `input` (materialize_grads off, or a non-differentiable output with
// materialize_non_diff_grads off), 0 if zeros. An error for other nodes.
rg_status rg_python_function_passes_none(rg_node* node, size_t input, int* out);

// ---- hooks -----------------------------------------------------------------------------
typedef enum {
  RG_HOOK_TENSOR_PRE = 0, // tensor_pre_hooks()[i]
  RG_HOOK_PRE = 1,        // pre_hooks()[i]
  RG_HOOK_POST = 2,       // post_hooks()[i]
  RG_HOOK_RETAINS_GRAD = 3, // retains_grad_hooks()[i]: i is the output index it watches
} rg_hook_kind;

// Whether a hook is a Python hook backed by a dict of callables (is_python 1, or 2 when the
// dict is empty: every hook in it was removed), the dict itself (a new reference; pass
// dict = NULL to skip it, e.g. without Python) and, for tensor pre-hooks, the input it
// watches (-1 otherwise). A C++ hook (e.g. retain_grad()) has no dict (is_python 0).
rg_status rg_node_hook_dict(rg_node* node, int kind, size_t i, int* is_python, PyObject** dict,
                            int64_t* value_idx);
// The outputs (sorted) that carry a retains_grad hook.
rg_status rg_node_retains_grad_outputs(rg_node* node, uint32_t* outputs, size_t n);
// Runs one pre-kind hook (tensor pre, pre, retains grad) on `values` as the engine does and
// writes the resulting list (same length) to out.
rg_status rg_node_call_pre_hook(rg_node* node, int kind, size_t i, const rg_tensor* const* values,
                                size_t n, rg_tensor** out);
// Runs post_hooks()[i](outputs, inputs); writes the new outputs (same length as outputs).
rg_status rg_node_call_post_hook(rg_node* node, size_t i, const rg_tensor* const* outputs,
                                 size_t n_outputs, const rg_tensor* const* inputs, size_t n_inputs,
                                 rg_tensor** out);

// ---- saved values ----------------------------------------------------------------------
rg_status rg_collector_new(rg_collector** out);
void rg_collector_free(rg_collector* c);
// Visits node->compiled_args(): appends each SavedVariable of the node (in a deterministic
// order: collection order of their tensors, hooked ones last, by hook id) and its unpacked
// value to the collector. Outputs the number appended, the node's specialisation bytes and
// size inputs (valid until the next call). *supported is 0 when the node does not implement
// compiled_args, or has saved variables behind saved_tensors_hooks that it must unpack itself
// (nothing is appended then). *n_hooked counts the last slots appended whose values come from
// the unpack hook `*group` (see rg_unpack_hooks_defer) when the node runs (undefined here).
// *lifted is 1 when the sizes can be given to rg_node_apply_lifted instead of the node's own
// (one of torch's generated nodes or CopyBackwards, or a CopySlices wrapping one), preceded
// by the dims of the input metadata its valid edges point at (what its outputs are
// validated against; the caller has them from rg_node_describe). The key ends with the
// positions of the node's slots whose values rg_collector_values_to_list can lift.
rg_status rg_collector_visit(rg_collector* c, rg_node* node, int* supported, size_t* n_saved,
                             const uint8_t** key, size_t* key_len, const int64_t** sizes,
                             size_t* n_sizes, int* lifted, size_t* n_hooked,
                             uintptr_t* group);
// Frees what only visiting needs: the tables that give a tensor saved twice one slot, the
// unpacked tensors they keep alive, and the buffers of the last visit's key and sizes (no
// longer valid). Call it after the last rg_collector_visit.
void rg_collector_end_visits(rg_collector* c);
size_t rg_collector_len(const rg_collector* c);
// The SavedVariables' addresses (borrowed), slot by slot: writes n = rg_collector_len(c).
rg_status rg_collector_saved_variables(const rg_collector* c, const rg_sv** out, size_t n);
// Slot i's value: a new handle to the unpacked value, detached from the graph but reporting
// the original's requires_grad (null for an undefined saved value).
rg_status rg_collector_value(const rg_collector* c, size_t i, rg_tensor** value);
// Drops the values of slots [begin, end) (undefined from then on): those of a node that runs
// as itself, with its own saved variables, so that they are freed when the node releases
// them, as in the engine.
rg_status rg_collector_forget(rg_collector* c, size_t begin, size_t end);
// The first slot in [begin, end) whose value was modified in place since it was planned
// (its version counter moved on) or whose SavedVariable was released since (a backward
// through its node), or end if none was.
rg_status rg_collector_first_modified(const rg_collector* c, size_t begin, size_t end,
                                      size_t* slot);
// Unpacks a node's own SavedVariable as the node would when it runs (its unpack hook
// called, if it has one; its errors raised, e.g. "modified by an inplace operation") and
// outputs the value detached, as rg_collector_value's (null if undefined).
rg_status rg_saved_variable_unpack_value(const rg_sv* sv, rg_node* saved_for, rg_tensor** value);
// Registers the code of an unpack hook (saved_tensors_hooks) whose calls may be made before
// their node runs, in a batch (non-reentrant checkpointing's: its first call recomputes the
// block's forward, later ones look values up). rg_collector_visit traces a node of torch's
// whose hooked saved variables all have one such hook. Needs the GIL.
rg_status rg_unpack_hooks_defer(PyObject* code);
// Every slot's value as a new Python list of tensors (None where undefined), in one call:
// this runs for every backward call. With `lift`, the 0-dim float64 CPU values that do not
// require grad are given as 1-element 1-dim tensors sharing their storage (a compiled
// replay indexes them back; Dynamo reads a 0-dim float64 input as a float too). Needs the GIL.
rg_status rg_collector_values_to_list(const rg_collector* c, int lift, PyObject** out);

// ---- running nodes ---------------------------------------------------------------------
// Runs node(inputs) with grad mode off and then validate_outputs(next_edges) as the engine's
// call_function does. If n_saved > 0, each svs[i] is first swapped with a SavedVariable built
// from saved[i] (no saved-tensor hooks run) and swapped back afterwards, also on error.
// `live`: the node runs for real (not traced), and `live` holds the hooks the replay calls
// around this call. The node's other hooks (registered since the call was planned by an
// earlier hook of this backward or while it runs, or Python hooks whose callables were all
// removed then, which may have got some since) are called here as the engine calls them:
// tensor pre-hooks, retains_grad hooks and pre-hooks before it, post hooks after it (given
// the inputs only if the node had post hooks when it was called). Null: traced.
// `take_inputs`: the node takes the inputs over, their handles are left undefined, so that
// it can free a gradient no one else holds while it runs, as the engine moves its input
// buffer into the call (a Function with boxed_grads_call clears the list it gets).
rg_status rg_node_apply(rg_node* node, rg_tensor* const* inputs, size_t n_inputs,
                        int take_inputs, const rg_sv* const* svs, const rg_tensor* const* saved,
                        size_t n_saved, const rg_planned_hooks* live, rg_tensor** out,
                        size_t cap, size_t* n_out);
// What PyNode::apply does with what a Python Function's backward returned, for a backward
// the replay called itself (traced into a compiled graph): a value that is not a tuple is
// one gradient; trailing None beyond the Function's forward inputs are dropped; then the
// count must match those inputs, the gradient of an input that was not a tensor must be
// None, the others a tensor or None (each check raising the engine's RuntimeError), and the
// tensor inputs' gradients are checked and cast by validate_outputs(next_edges), as the
// engine's call_function does. `sizes` (or NULL): a Python sequence of int or torch.SymInt,
// the dims of the input metadata the node's valid edges point at (see edge dims in
// rg_collector_visit), which the outputs are validated against instead of the metadata's
// own (symbolic while a compiler traces with dynamic shapes). Writes one entry per next
// edge. Needs the GIL.
rg_status rg_python_function_outputs(rg_node* node, PyObject* result, PyObject* sizes,
                                     rg_tensor** out, size_t cap, size_t* n_out);
// *out = 1 if the node has hooks other than `planned` that do something (not a Python hook
// without callables), else 0; with `tensor_pre_only`, only tensor pre-hooks and retains_grad
// hooks count (all the engine calls for a node it does not run). Needs the GIL.
rg_status rg_node_has_new_hooks(rg_node* node, const rg_planned_hooks* planned,
                                int tensor_pre_only, int* out);
// Calls the tensor pre-hooks and retains_grad hooks of the node other than `planned` on
// `count` values, writing `count` results: what the engine calls before the node's pre-hooks,
// for a node whose planned pre-hooks the replay is about to call.
rg_status rg_node_call_new_tensor_pre_hooks(rg_node* node, const rg_planned_hooks* planned,
                                            const rg_tensor* const* values, size_t count,
                                            rg_tensor** out);
// rg_node_apply for a node whose sizes are lifted (see rg_collector_visit), with its saved
// values (in slot order, as planned) and sizes replaced by the given ones while it runs:
// `sizes` is a Python sequence of int or torch.SymInt, one per planned size. Runs the node
// through apply_with_saved, so that symbolic sizes (a compiler tracing with dynamic shapes)
// reach its formula instead of the sizes it keeps. Needs the GIL.
rg_status rg_node_apply_lifted(rg_node* node, const rg_tensor* const* inputs, size_t n_inputs,
                               const rg_tensor* const* saved, size_t n_saved, PyObject* sizes,
                               rg_tensor** out, size_t cap, size_t* n_out);
// From now on, nodes of this node's type (for a CopySlices: of the type it wraps) are not
// lifted (see rg_collector_visit): their sizes are part of the key. For types whose formula
// fails on symbolic sizes.
rg_status rg_node_type_not_liftable(rg_node* node);
// Runs an AccumulateGrad node on `grad`, which it takes over: the handle is left undefined,
// so that AccumulateGrad can steal a gradient no one else holds (make it .grad without a
// copy), as it does in the engine. `grad` may be NULL (no gradient). The node's hooks other
// than `planned` are called around it (see rg_node_apply's `live`).
rg_status rg_node_accumulate(rg_node* node, rg_tensor* grad, const rg_planned_hooks* planned);
// rg_node_accumulate of the product a.t() @ b (a weight's gradient from a matrix product's
// factors, both taken over), added to the variable's .grad with one addmm_ where the node
// would add the product in place and nothing else would see it (no hooks); otherwise the
// product is formed and accumulated. An undefined factor: no gradient.
rg_status rg_node_accumulate_product(rg_node* node, rg_tensor* a, rg_tensor* b,
                                     const rg_planned_hooks* planned);
// validate_outputs over root edges (nodes may be null for edges of tensors that need no
// grad), as Engine::execute does before running; writes the checked/cast grads to out.
rg_status rg_validate_root_grads(rg_node* const* nodes, const uint32_t* input_nrs, size_t n,
                                 const rg_tensor* const* grads, rg_tensor** out);
// Node::release_variables of each of `n` nodes, in order, as the engine calls it after running
// each one, under one hold of the graph lock.
rg_status rg_nodes_release_variables(rg_node* const* nodes, size_t n);
// Takes the lock that planning and swapping values into live nodes hold (recursive; waits
// without the GIL), so that a thread plans no node another thread has swapped values into.
rg_status rg_graphs_lock(void);
// Releases it once.
void rg_graphs_unlock(void);
// A new reference to `buffer_sum(*grads)`, a Python function (METH_FASTCALL) for replays run
// uncompiled: the sum of the gradients in arrival order (None skipped, None if all are), into
// the first one in place where InputBuffer::add would accumulate in place and nothing else
// can see the change: a gradient no C++ holder, view or other Python reference than the
// caller's argument shares, or a sum made in the call. Needs the GIL.
rg_status rg_buffer_sum_function(PyObject** out);

// ---- the engine hook -------------------------------------------------------------------
// Engine::execute hands a backward call to the function installed with
// Engine::set_compiled_autograd, after it has validated the root gradients, built the
// GraphTask (dependencies, exec_info) and made it current. replaygrad installs one that,
// on threads where it is enabled and outside a replay, calls a Python callable with the call
// (a capsule named "replaygrad.engine_call", valid only during the callback). The callable
// returns the captured gradients (a sequence of Tensor/None; empty for backward()), or None
// to have the engine run the call itself. Everywhere else the hook runs the engine as
// Engine::execute would. After the callback, the GraphTask's final callbacks run.

// Installs the hook with `callback` (a new reference is kept). torch's own compiled autograd
// uses the same slot: callers check that it is off first.
rg_status rg_engine_hook_install(PyObject* callback);
// Removes the hook (Engine::set_compiled_autograd(nullptr)) and drops the callback.
rg_status rg_engine_hook_uninstall(void);
// Whether backward calls on this thread go to the callback.
void rg_engine_set_enabled(int enabled);
int rg_engine_enabled(void);
// Buffers the C++ warnings raised on this thread (torch's PyWarningHandler, which a Python
// binding of torch installs around its call, as the engine's run_backward does) until the
// matching rg_warnings_pop issues them as Python warnings (RG_PYTHON_ERROR: one was turned
// into an error by a filter; with in_exception, such a warning is printed instead). Pushes
// and pops pair up, innermost first, on one thread. Need the GIL.
rg_status rg_warnings_push(void);
rg_status rg_warnings_pop(int in_exception);
// The call's shape: root count, output (inputs=) count, and the GraphTask's flags.
rg_status rg_engine_call_info(PyObject* capsule, size_t* n_roots, size_t* n_outputs,
                              int* accumulate_grad, int* keep_graph, int* create_graph);
// Root edges (new references) and the validated root gradients (new handles or null).
rg_status rg_engine_call_roots(PyObject* capsule, rg_node** nodes, uint32_t* input_nrs,
                               rg_tensor** grads);
// Output edges (inputs=): new references, null for inputs without a node.
rg_status rg_engine_call_outputs(PyObject* capsule, rg_node** nodes, uint32_t* input_nrs);

#ifdef __cplusplus
}
#endif
