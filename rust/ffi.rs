//! The only place that calls the C++ shim (`cpp_shim/shim.h`). Raw declarations first, then
//! safe wrappers: [`NodeRef`] (an owned strong reference to a `torch::autograd::Node`),
//! [`Collector`] (the `compiled_args` visitor) and free functions that run nodes and hooks.
//! Every shim status becomes a [`ShimError`].

use std::ffi::{c_char, c_int, CStr};
use std::ptr::{self, NonNull};

use tch::Tensor;
use torch_sys::C_tensor;

use crate::errors::{ErrorKind, ShimError};

/// `torch::autograd::Node`, never dereferenced on this side.
#[repr(C)]
pub struct RawNode {
    _private: [u8; 0],
}
/// `torch::autograd::SavedVariable`.
#[repr(C)]
pub struct RawSavedVariable {
    _private: [u8; 0],
}
#[repr(C)]
struct RawCollector {
    _private: [u8; 0],
}
/// `PyObject`, for the few calls that hand Python objects across.
pub type PyObjectPtr = *mut pyo3::ffi::PyObject;

const RG_OK: c_int = 0;
const RG_ERROR: c_int = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct RawNodeInfo {
    sequence_nr: u64,
    type_name: *const c_char,
    kind: u32,
    num_inputs: u32,
    num_outputs: u32,
    num_tensor_pre_hooks: u32,
    num_retains_grad_hooks: u32,
    num_pre_hooks: u32,
    num_post_hooks: u32,
    has_post_acc_grad_hooks: u32,
    non_strided_inputs: u32,
    nested_inputs: u32,
}

impl Default for RawNodeInfo {
    fn default() -> Self {
        RawNodeInfo {
            sequence_nr: 0,
            type_name: ptr::null(),
            kind: 0,
            num_inputs: 0,
            num_outputs: 0,
            num_tensor_pre_hooks: 0,
            num_retains_grad_hooks: 0,
            num_pre_hooks: 0,
            num_post_hooks: 0,
            has_post_acc_grad_hooks: 0,
            non_strided_inputs: 0,
            nested_inputs: 0,
        }
    }
}

extern "C" {
    fn rg_last_error_message() -> *const c_char;
    fn rg_last_error_kind() -> c_int;

    fn rg_node_incref(node: *mut RawNode);
    fn rg_node_decref(node: *mut RawNode);
    fn rg_tensor_gradient_edge(t: *const C_tensor, node: *mut *mut RawNode, input_nr: *mut u32) -> c_int;
    fn rg_tensor_input_edge(t: *const C_tensor, node: *mut *mut RawNode, input_nr: *mut u32) -> c_int;
    fn rg_node_from_pyobject(obj: PyObjectPtr, node: *mut *mut RawNode) -> c_int;
    fn rg_node_to_pyobject(node: *mut RawNode, out: *mut PyObjectPtr) -> c_int;
    fn rg_node_describe(
        node: *mut RawNode,
        info: *mut RawNodeInfo,
        nodes: *mut *mut RawNode,
        input_nrs: *mut u32,
        edge_cap: usize,
        meta: *mut u8,
        meta_cap: usize,
        meta_len: *mut usize,
    ) -> c_int;
    fn rg_node_next_edges(
        node: *mut RawNode,
        nodes: *mut *mut RawNode,
        input_nrs: *mut u32,
        n: usize,
    ) -> c_int;
    fn rg_node_name(node: *mut RawNode, buf: *mut c_char, cap: usize, len: *mut usize) -> c_int;
    fn rg_node_is_traceable(node: *mut RawNode, out: *mut c_int) -> c_int;
    fn rg_python_function_passes_none(node: *mut RawNode, input: usize, out: *mut c_int) -> c_int;

    fn rg_node_hook_dict(
        node: *mut RawNode,
        kind: c_int,
        i: usize,
        is_python: *mut c_int,
        dict: *mut PyObjectPtr,
        value_idx: *mut i64,
    ) -> c_int;
    fn rg_node_retains_grad_outputs(node: *mut RawNode, outputs: *mut u32, n: usize) -> c_int;
    fn rg_node_call_pre_hook(
        node: *mut RawNode,
        kind: c_int,
        i: usize,
        values: *const *const C_tensor,
        n: usize,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn rg_node_call_post_hook(
        node: *mut RawNode,
        i: usize,
        outputs: *const *const C_tensor,
        n_outputs: usize,
        inputs: *const *const C_tensor,
        n_inputs: usize,
        out: *mut *mut C_tensor,
    ) -> c_int;

    fn rg_collector_new(out: *mut *mut RawCollector) -> c_int;
    fn rg_collector_free(c: *mut RawCollector);
    fn rg_collector_visit(
        c: *mut RawCollector,
        node: *mut RawNode,
        supported: *mut c_int,
        n_saved: *mut usize,
        key: *mut *const u8,
        key_len: *mut usize,
        sizes: *mut *const i64,
        n_sizes: *mut usize,
        lifted: *mut c_int,
        n_hooked: *mut usize,
        group: *mut usize,
    ) -> c_int;
    fn rg_collector_end_visits(c: *mut RawCollector);
    fn rg_collector_len(c: *const RawCollector) -> usize;
    fn rg_collector_saved_variables(
        c: *const RawCollector,
        out: *mut *const RawSavedVariable,
        n: usize,
    ) -> c_int;
    fn rg_collector_value(c: *const RawCollector, i: usize, value: *mut *mut C_tensor) -> c_int;
    fn rg_collector_values_to_list(c: *const RawCollector, lift: c_int, out: *mut PyObjectPtr) -> c_int;
    fn rg_collector_forget(c: *mut RawCollector, begin: usize, end: usize) -> c_int;
    fn rg_collector_first_modified(
        c: *const RawCollector,
        begin: usize,
        end: usize,
        slot: *mut usize,
    ) -> c_int;
    fn rg_saved_variable_unpack_value(
        sv: *const RawSavedVariable,
        saved_for: *mut RawNode,
        value: *mut *mut C_tensor,
    ) -> c_int;
    fn rg_unpack_hooks_defer(code: PyObjectPtr) -> c_int;
    fn rg_buffer_sum_function(out: *mut PyObjectPtr) -> c_int;

    fn rg_node_apply(
        node: *mut RawNode,
        inputs: *const *mut C_tensor,
        n_inputs: usize,
        take_inputs: c_int,
        svs: *const *const RawSavedVariable,
        saved: *const *const C_tensor,
        n_saved: usize,
        live: *const RawPlannedHooks,
        out: *mut *mut C_tensor,
        cap: usize,
        n_out: *mut usize,
    ) -> c_int;
    fn rg_python_function_outputs(
        node: *mut RawNode,
        result: PyObjectPtr,
        sizes: PyObjectPtr,
        out: *mut *mut C_tensor,
        cap: usize,
        n_out: *mut usize,
    ) -> c_int;
    fn rg_node_has_new_hooks(
        node: *mut RawNode,
        planned: *const RawPlannedHooks,
        tensor_pre_only: c_int,
        out: *mut c_int,
    ) -> c_int;
    fn rg_node_call_new_tensor_pre_hooks(
        node: *mut RawNode,
        planned: *const RawPlannedHooks,
        values: *const *const C_tensor,
        count: usize,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn rg_node_apply_lifted(
        node: *mut RawNode,
        inputs: *const *const C_tensor,
        n_inputs: usize,
        saved: *const *const C_tensor,
        n_saved: usize,
        sizes: PyObjectPtr,
        out: *mut *mut C_tensor,
        cap: usize,
        n_out: *mut usize,
    ) -> c_int;
    fn rg_node_type_not_liftable(node: *mut RawNode) -> c_int;
    fn rg_node_accumulate(node: *mut RawNode, grad: *mut C_tensor, planned: *const RawPlannedHooks) -> c_int;
    fn rg_node_accumulate_product(
        node: *mut RawNode,
        a: *mut C_tensor,
        b: *mut C_tensor,
        planned: *const RawPlannedHooks,
    ) -> c_int;
    fn rg_validate_root_grads(
        nodes: *const *mut RawNode,
        input_nrs: *const u32,
        n: usize,
        grads: *const *const C_tensor,
        out: *mut *mut C_tensor,
    ) -> c_int;
    fn rg_nodes_release_variables(nodes: *const *mut RawNode, n: usize) -> c_int;
    fn rg_graphs_lock() -> c_int;
    fn rg_graphs_unlock();

    fn rg_engine_hook_install(callback: PyObjectPtr) -> c_int;
    fn rg_engine_hook_uninstall() -> c_int;
    fn rg_engine_set_enabled(enabled: c_int);
    fn rg_engine_enabled() -> c_int;
    fn rg_warnings_push() -> c_int;
    fn rg_warnings_pop(in_exception: c_int) -> c_int;
    fn rg_engine_call_info(
        capsule: PyObjectPtr,
        n_roots: *mut usize,
        n_outputs: *mut usize,
        accumulate_grad: *mut c_int,
        keep_graph: *mut c_int,
        create_graph: *mut c_int,
    ) -> c_int;
    fn rg_engine_call_roots(
        capsule: PyObjectPtr,
        nodes: *mut *mut RawNode,
        input_nrs: *mut u32,
        grads: *mut *mut C_tensor,
    ) -> c_int;
    fn rg_engine_call_outputs(capsule: PyObjectPtr, nodes: *mut *mut RawNode, input_nrs: *mut u32) -> c_int;
}

/// Turns a shim status into a Result, fetching the thread's error on failure.
fn check(status: c_int) -> Result<(), ShimError> {
    match status {
        RG_OK => Ok(()),
        RG_ERROR => {
            // SAFETY: the shim keeps a valid NUL-terminated thread-local message.
            let message = unsafe { CStr::from_ptr(rg_last_error_message()) }
                .to_string_lossy()
                .into_owned();
            let kind = ErrorKind::from_code(unsafe { rg_last_error_kind() });
            Err(ShimError::Torch { kind, message })
        }
        _ => Err(ShimError::Python),
    }
}

/// What kind of node the engine is running; decides how the replay treats it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeKind {
    /// Generated backward nodes and other C++ nodes.
    Generic,
    AccumulateGrad,
    /// `PyNode`: a Python `torch.autograd.Function`.
    PythonFunction,
    /// `CppNode<T>`: a C++ `torch::autograd::Function`.
    CppFunction,
}

impl NodeKind {
    fn from_code(code: u32) -> Self {
        match code {
            1 => NodeKind::AccumulateGrad,
            2 => NodeKind::PythonFunction,
            3 => NodeKind::CppFunction,
            _ => NodeKind::Generic,
        }
    }
}

/// `typeid(*node).name()`: a NUL-terminated string in a library's static data, stable for the
/// process; its address tells the C++ type (read as a string only for a type not seen yet).
#[derive(Clone, Copy, Debug)]
pub struct TypeName(NonNull<c_char>);

impl TypeName {
    pub fn address(self) -> usize {
        self.0.as_ptr() as usize
    }

    pub fn to_cstr(self) -> &'static CStr {
        // SAFETY: a typeid name: NUL-terminated, in static storage.
        unsafe { CStr::from_ptr(self.0.as_ptr()) }
    }
}

/// The per-node facts one shim call returns.
#[derive(Clone, Copy, Debug)]
pub struct NodeInfo {
    pub sequence_nr: u64,
    pub type_name: TypeName,
    pub kind: NodeKind,
    pub num_inputs: u32,
    pub num_outputs: u32,
    pub num_tensor_pre_hooks: u32,
    pub num_retains_grad_hooks: u32,
    pub num_pre_hooks: u32,
    pub num_post_hooks: u32,
    pub has_post_acc_grad_hooks: bool,
    /// Every input's metadata has the strided layout (no sparse or mkldnn gradients).
    pub strided_inputs: bool,
    /// An input's metadata is a nested tensor's.
    pub nested_inputs: bool,
}

/// The hook lists of a node the engine calls, in the shim's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HookKind {
    TensorPre = 0,
    Pre = 1,
    Post = 2,
    RetainsGrad = 3,
}

/// The hooks of a node that the replay calls itself: running the node for real with these
/// ([`apply_node`]'s `live`), the shim calls its other hooks as the engine would (hooks
/// registered since the call was planned by an earlier hook of the backward).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlannedHooks {
    /// Per [`HookKind`]: the positions of the planned hooks in the node's list (for
    /// retains_grad hooks, the outputs they watch).
    pub planned: [Vec<u32>; 4],
    /// The node's other tensor pre-hooks and retains_grad hooks were called already
    /// ([`call_new_tensor_pre_hooks`]).
    pub tensor_pre_done: bool,
}

impl PlannedHooks {
    /// The shim's view, borrowing the lists.
    fn raw(&self) -> RawPlannedHooks {
        RawPlannedHooks {
            planned: self.planned.each_ref().map(|list| list.as_ptr()),
            n_planned: self.planned.each_ref().map(Vec::len),
            tensor_pre_done: c_int::from(self.tensor_pre_done),
        }
    }
}

/// `rg_planned_hooks`.
#[repr(C)]
struct RawPlannedHooks {
    planned: [*const u32; 4],
    n_planned: [usize; 4],
    tensor_pre_done: c_int,
}

/// An owned strong reference to a `torch::autograd::Node` (an `intrusive_ptr` count).
///
/// Dropping it can drop the node's Python wrapper, so Python-facing code drops these with
/// the GIL held.
pub struct NodeRef(NonNull<RawNode>);

// SAFETY: Node refcounts are atomic; the Python side effects of the last decref are covered
// by holding the GIL where Python objects exist (see the type's docs).
unsafe impl Send for NodeRef {}

impl NodeRef {
    /// Takes over a reference the shim handed out ("new reference").
    fn from_new(ptr: *mut RawNode) -> Option<Self> {
        NonNull::new(ptr).map(NodeRef)
    }

    /// Takes a new strong reference to a borrowed node pointer.
    ///
    /// # Safety
    /// `ptr` must point to a live node.
    pub unsafe fn from_borrowed(ptr: NonNull<RawNode>) -> Self {
        rg_node_incref(ptr.as_ptr());
        NodeRef(ptr)
    }

    pub fn as_ptr(&self) -> *mut RawNode {
        self.0.as_ptr()
    }

    /// The gradient edge of a tensor, as `torch::autograd::impl::gradient_edge` gives it;
    /// `None` when the tensor does not require grad.
    pub fn gradient_edge(tensor: &Tensor) -> Result<Option<(NodeRef, u32)>, ShimError> {
        let mut node = ptr::null_mut();
        let mut input_nr = 0;
        // SAFETY: `tensor` is a live at::Tensor handle.
        check(unsafe { rg_tensor_gradient_edge(tensor.as_ptr(), &mut node, &mut input_nr) })?;
        Ok(NodeRef::from_new(node).map(|n| (n, input_nr)))
    }

    /// The edge to differentiate with respect to (`inputs=`): the grad_fn edge of a non-leaf,
    /// the existing AccumulateGrad of a leaf, None for a leaf that has none yet.
    pub fn input_edge(tensor: &Tensor) -> Result<Option<(NodeRef, u32)>, ShimError> {
        let mut node = ptr::null_mut();
        let mut input_nr = 0;
        // SAFETY: `tensor` is a live at::Tensor handle.
        check(unsafe { rg_tensor_input_edge(tensor.as_ptr(), &mut node, &mut input_nr) })?;
        Ok(NodeRef::from_new(node).map(|n| (n, input_nr)))
    }

    /// The node behind a Python grad_fn object, if it is one.
    ///
    /// # Safety
    /// `obj` must be a live Python object and the GIL must be held.
    pub unsafe fn from_pyobject(obj: PyObjectPtr) -> Result<Option<NodeRef>, ShimError> {
        let mut node = ptr::null_mut();
        check(rg_node_from_pyobject(obj, &mut node))?;
        Ok(NodeRef::from_new(node))
    }

    /// The node's Python object (a new reference). Needs the GIL.
    pub fn to_pyobject(&self) -> Result<PyObjectPtr, ShimError> {
        let mut out = ptr::null_mut();
        // SAFETY: the node is alive while self is.
        check(unsafe { rg_node_to_pyobject(self.as_ptr(), &mut out) })?;
        Ok(out)
    }

    /// What the graph walk reads of the node, in one shim call where the buffers suffice:
    /// its info; its next edges, appended to `nodes` (borrowed pointers, None for invalid
    /// edges) and `input_nrs`; the metadata of its inputs, appended to `meta` as bytes (see
    /// `rg_node_describe`).
    pub fn describe(
        &self,
        nodes: &mut Vec<Option<NonNull<RawNode>>>,
        input_nrs: &mut Vec<u32>,
        meta: &mut Vec<u8>,
    ) -> Result<NodeInfo, ShimError> {
        const EDGE_CAP: usize = 8;
        const META_CAP: usize = 256;
        let mut raw = RawNodeInfo::default();
        let mut edge_buf = [ptr::null_mut(); EDGE_CAP];
        let mut nr_buf = [0u32; EDGE_CAP];
        let meta_start = meta.len();
        let mut meta_cap = META_CAP;
        let mut meta_len = 0usize;
        loop {
            // Written by the shim, not zeroed first (a memset of the whole capacity per node).
            meta.reserve(meta_cap);
            // SAFETY: the node is alive while self is; each buffer holds its stated capacity
            // (the metadata buffer: `meta_cap` bytes of spare capacity).
            check(unsafe {
                rg_node_describe(
                    self.as_ptr(),
                    &mut raw,
                    edge_buf.as_mut_ptr(),
                    nr_buf.as_mut_ptr(),
                    EDGE_CAP,
                    meta.spare_capacity_mut().as_mut_ptr().cast::<u8>(),
                    meta_cap,
                    &mut meta_len,
                )
            })?;
            if meta_len <= meta_cap {
                break;
            }
            // Many or high-dimensional inputs: ask again with room for all of them.
            meta_cap = meta_len;
        }
        // SAFETY: the shim wrote the first `meta_len` (<= `meta_cap`) bytes of the spare
        // capacity.
        unsafe { meta.set_len(meta_start + meta_len) };
        let num_outputs = raw.num_outputs as usize;
        if num_outputs <= EDGE_CAP {
            nodes.extend(edge_buf[..num_outputs].iter().map(|&p| NonNull::new(p)));
            input_nrs.extend_from_slice(&nr_buf[..num_outputs]);
        } else {
            self.next_edges(raw.num_outputs, nodes, input_nrs)?;
        }
        let type_name = NonNull::new(raw.type_name.cast_mut())
            .map(TypeName)
            .ok_or_else(|| ShimError::new(ErrorKind::Runtime, "rg_node_describe gave no type name"))?;
        Ok(NodeInfo {
            sequence_nr: raw.sequence_nr,
            type_name,
            kind: NodeKind::from_code(raw.kind),
            num_inputs: raw.num_inputs,
            num_outputs: raw.num_outputs,
            num_tensor_pre_hooks: raw.num_tensor_pre_hooks,
            num_retains_grad_hooks: raw.num_retains_grad_hooks,
            num_pre_hooks: raw.num_pre_hooks,
            num_post_hooks: raw.num_post_hooks,
            has_post_acc_grad_hooks: raw.has_post_acc_grad_hooks != 0,
            strided_inputs: raw.non_strided_inputs == 0,
            nested_inputs: raw.nested_inputs != 0,
        })
    }

    /// `next_edges()`: borrowed node pointers (None for invalid edges) and input_nrs,
    /// appended to the given vectors.
    fn next_edges(
        &self,
        count: u32,
        nodes: &mut Vec<Option<NonNull<RawNode>>>,
        input_nrs: &mut Vec<u32>,
    ) -> Result<(), ShimError> {
        let n = count as usize;
        let start = nodes.len();
        let mut raw_nodes: Vec<*mut RawNode> = vec![ptr::null_mut(); n];
        input_nrs.resize(start + n, 0);
        // SAFETY: both buffers hold n entries.
        check(unsafe {
            rg_node_next_edges(
                self.as_ptr(),
                raw_nodes.as_mut_ptr(),
                input_nrs[start..].as_mut_ptr(),
                n,
            )
        })?;
        nodes.extend(raw_nodes.into_iter().map(NonNull::new));
        Ok(())
    }

    /// See [`prefetch_node`].
    #[inline]
    pub fn prefetch(&self) {
        prefetch_node(self.0);
    }

    pub fn name(&self) -> Result<String, ShimError> {
        let mut buf = vec![0 as c_char; 128];
        let mut len = 0usize;
        // SAFETY: buf holds `cap` bytes.
        check(unsafe { rg_node_name(self.as_ptr(), buf.as_mut_ptr(), buf.len(), &mut len) })?;
        if len >= buf.len() {
            buf = vec![0 as c_char; len + 1];
            // SAFETY: as above, with a buffer that fits.
            check(unsafe { rg_node_name(self.as_ptr(), buf.as_mut_ptr(), buf.len(), &mut len) })?;
        }
        let bytes: Vec<u8> = buf[..len].iter().map(|&c| c as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub fn is_traceable(&self) -> Result<bool, ShimError> {
        let mut out = 0;
        // SAFETY: the node is alive while self is.
        check(unsafe { rg_node_is_traceable(self.as_ptr(), &mut out) })?;
        Ok(out != 0)
    }

    /// For a Python Function's node: whether its backward gets None for an undefined
    /// gradient at `input` (not zeros), as PyNode::apply decides.
    pub fn passes_none(&self, input: usize) -> Result<bool, ShimError> {
        let mut out = 0;
        // SAFETY: the node is alive while self is.
        check(unsafe { rg_python_function_passes_none(self.as_ptr(), input, &mut out) })?;
        Ok(out != 0)
    }

    /// Whether hook `i` of `kind` is a Python hook and, for tensor pre-hooks, the input it
    /// watches; None for a Python hook whose callables were all removed (it does nothing).
    pub fn hook_kind(&self, kind: HookKind, i: usize) -> Result<Option<(bool, Option<u32>)>, ShimError> {
        let mut is_python = 0;
        let mut value_idx = -1i64;
        // SAFETY: the node is alive while self is; a null dict pointer asks for no object.
        check(unsafe {
            rg_node_hook_dict(
                self.as_ptr(),
                kind as c_int,
                i,
                &mut is_python,
                ptr::null_mut(),
                &mut value_idx,
            )
        })?;
        Ok((is_python != 2).then(|| (is_python != 0, u32::try_from(value_idx).ok())))
    }

    /// The dict of callables behind Python hook `i` of `kind` (a new reference), None for
    /// a C++ hook. Needs the GIL.
    pub fn hook_dict(&self, kind: HookKind, i: usize) -> Result<Option<PyObjectPtr>, ShimError> {
        let mut dict = ptr::null_mut();
        let mut value_idx = -1i64;
        let mut is_python = 0;
        // SAFETY: the node is alive while self is.
        check(unsafe {
            rg_node_hook_dict(
                self.as_ptr(),
                kind as c_int,
                i,
                &mut is_python,
                &mut dict,
                &mut value_idx,
            )
        })?;
        Ok((!dict.is_null()).then_some(dict))
    }

    pub fn retains_grad_outputs(&self, count: u32) -> Result<Vec<u32>, ShimError> {
        let mut out = vec![0u32; count as usize];
        // SAFETY: out holds `count` entries.
        check(unsafe { rg_node_retains_grad_outputs(self.as_ptr(), out.as_mut_ptr(), out.len()) })?;
        Ok(out)
    }
}

impl Clone for NodeRef {
    fn clone(&self) -> Self {
        // SAFETY: self keeps the node alive.
        unsafe { NodeRef::from_borrowed(self.0) }
    }
}

impl Drop for NodeRef {
    fn drop(&mut self) {
        // SAFETY: we own one reference.
        unsafe { rg_node_decref(self.as_ptr()) }
    }
}

fn tensor_ptrs(values: &[Option<Tensor>]) -> Vec<*const C_tensor> {
    values
        .iter()
        .map(|v| v.as_ref().map_or(ptr::null(), |t| t.as_ptr()))
        .collect()
}

fn take_tensors(raw: Vec<*mut C_tensor>) -> Vec<Option<Tensor>> {
    raw.into_iter()
        .map(|p| {
            // SAFETY: the shim hands out owned `new at::Tensor` handles (or null).
            (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p) })
        })
        .collect()
}

/// Calls a shim function that writes up to `num_outputs` tensor handles (and their count),
/// and takes them over, also when it failed (a partial write).
fn node_outputs(
    num_outputs: u32,
    call: impl FnOnce(*mut *mut C_tensor, usize, &mut usize) -> c_int,
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let cap = num_outputs as usize;
    let mut out: Vec<*mut C_tensor> = vec![ptr::null_mut(); cap];
    let mut n_out = 0usize;
    let status = call(out.as_mut_ptr(), cap, &mut n_out);
    out.truncate(n_out);
    let outputs = take_tensors(out);
    check(status)?;
    Ok(outputs)
}

/// Calls a shim function that writes exactly `count` tensor handles, and takes them over,
/// also when it failed (the handles written are null until it succeeds).
fn written_values(
    count: usize,
    call: impl FnOnce(*mut *mut C_tensor) -> c_int,
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let mut out: Vec<*mut C_tensor> = vec![ptr::null_mut(); count];
    let status = call(out.as_mut_ptr());
    let values = take_tensors(out);
    check(status)?;
    Ok(values)
}

/// A node's input gradients for [`apply_node`].
pub enum Inputs<'a> {
    /// The caller keeps them: the node gets references of its own.
    Lent(&'a [Option<Tensor>]),
    /// Handed over: the node holds the caller's references, and can free a gradient no one
    /// else holds while it runs, as the engine moves its input buffer into the call.
    Taken(Vec<Option<Tensor>>),
}

/// Runs `node(inputs)` like the engine's call_function (grad mode off, validate_outputs),
/// with `saved[i]` swapped into `svs[i]` for the call. With `live` (the node runs for real,
/// not traced), its hooks other than those are called around it. Returns one entry per next
/// edge.
pub fn apply_node(
    node: &NodeRef,
    num_outputs: u32,
    mut inputs: Inputs<'_>,
    svs: &[*const RawSavedVariable],
    saved: &[Option<Tensor>],
    live: Option<&PlannedHooks>,
) -> Result<Vec<Option<Tensor>>, ShimError> {
    debug_assert_eq!(svs.len(), saved.len());
    // The shim writes through these pointers (moves from the handles) only when taking.
    let (input_ptrs, take): (Vec<*mut C_tensor>, bool) = match &mut inputs {
        Inputs::Lent(values) => (
            tensor_ptrs(values)
                .into_iter()
                .map(<*const _>::cast_mut)
                .collect(),
            false,
        ),
        Inputs::Taken(values) => (
            values
                .iter_mut()
                .map(|v| v.as_mut().map_or(ptr::null_mut(), |t| t.as_mut_ptr()))
                .collect(),
            true,
        ),
    };
    let saved_ptrs = tensor_ptrs(saved);
    let live = live.map(PlannedHooks::raw);
    let live_ptr = live
        .as_ref()
        .map_or(ptr::null(), |raw| raw as *const RawPlannedHooks);
    node_outputs(num_outputs, |out, cap, n_out| {
        // SAFETY: pointer arrays are valid for their lengths (taken handles are left empty,
        // and dropped with `inputs`); svs point into the live node; `live` (and the
        // retains_grad outputs it points at) outlives the call.
        unsafe {
            rg_node_apply(
                node.as_ptr(),
                input_ptrs.as_ptr(),
                input_ptrs.len(),
                c_int::from(take),
                svs.as_ptr(),
                saved_ptrs.as_ptr(),
                saved_ptrs.len(),
                live_ptr,
                out,
                cap,
                n_out,
            )
        }
    })
}

/// What a Python Function's node makes of `result`, the value its backward returned (the
/// shim's `rg_python_function_outputs`: PyNode::apply's checks, then validate_outputs
/// against the metadata its edges point at, with `sizes` for their dims if given): one
/// entry per next edge. The GIL must be held (`result` and `sizes` are live objects).
pub fn python_function_outputs(
    node: &NodeRef,
    num_outputs: u32,
    result: &pyo3::Bound<'_, pyo3::PyAny>,
    sizes: Option<&pyo3::Bound<'_, pyo3::PyAny>>,
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let sizes = sizes.map_or(ptr::null_mut(), |s| s.as_ptr());
    node_outputs(num_outputs, |out, cap, n_out| {
        // SAFETY: the node is alive; `result` and `sizes` (or null) are live objects; the
        // GIL is held.
        unsafe { rg_python_function_outputs(node.as_ptr(), result.as_ptr(), sizes, out, cap, n_out) }
    })
}

/// [`apply_node`] for a node whose sizes are lifted ([`VisitedNode::lifted`]): its saved
/// values and sizes are replaced by `saved` and `sizes` (a Python sequence of int or
/// torch.SymInt) while it runs.
pub fn apply_node_lifted(
    node: &NodeRef,
    num_outputs: u32,
    inputs: &[Option<Tensor>],
    saved: &[Option<Tensor>],
    sizes: &pyo3::Bound<'_, pyo3::PyAny>,
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let input_ptrs = tensor_ptrs(inputs);
    let saved_ptrs = tensor_ptrs(saved);
    node_outputs(num_outputs, |out, cap, n_out| {
        // SAFETY: pointer arrays are valid for their lengths; `sizes` is a live object.
        unsafe {
            rg_node_apply_lifted(
                node.as_ptr(),
                input_ptrs.as_ptr(),
                input_ptrs.len(),
                saved_ptrs.as_ptr(),
                saved_ptrs.len(),
                sizes.as_ptr(),
                out,
                cap,
                n_out,
            )
        }
    })
}

/// From now on the sizes of nodes of `node`'s type are part of the key (not lifted): for
/// types whose formula fails on symbolic sizes.
pub fn mark_type_not_liftable(node: &NodeRef) -> Result<(), ShimError> {
    // SAFETY: the node is alive.
    check(unsafe { rg_node_type_not_liftable(node.as_ptr()) })
}

/// Releases the saved variables of `nodes`, in order, as the engine does after running each
/// one, under one hold of the graph lock.
pub fn release_variables<'a>(nodes: impl Iterator<Item = &'a NodeRef>) -> Result<(), ShimError> {
    let ptrs: Vec<*mut RawNode> = nodes.map(NodeRef::as_ptr).collect();
    // SAFETY: `ptrs` holds `ptrs.len()` live nodes, kept alive by the borrowed handles.
    check(unsafe { rg_nodes_release_variables(ptrs.as_ptr(), ptrs.len()) })
}

/// Runs an AccumulateGrad node on `grad`, handing it over so that the node can steal it, and
/// its hooks other than `planned` around it.
pub fn accumulate(node: &NodeRef, mut grad: Option<Tensor>, planned: &PlannedHooks) -> Result<(), ShimError> {
    let raw = grad.as_mut().map_or(ptr::null_mut(), |t| t.as_mut_ptr());
    let planned = planned.raw();
    // SAFETY: `raw` is null or the live handle of `grad`, which the shim moves from and
    // which is dropped (empty) afterwards; `planned` points into a value that outlives the call.
    let status = unsafe { rg_node_accumulate(node.as_ptr(), raw, &planned) };
    drop(grad);
    check(status)
}

/// Runs an AccumulateGrad node on the product `a.t() @ b`, handing both over: added to the
/// variable's `.grad` with one `addmm_` where the node would add the product in place and
/// nothing else sees it, otherwise formed and accumulated as [`accumulate`] does.
pub fn accumulate_product(
    node: &NodeRef,
    mut a: Option<Tensor>,
    mut b: Option<Tensor>,
    planned: &PlannedHooks,
) -> Result<(), ShimError> {
    let raw_a = a.as_mut().map_or(ptr::null_mut(), |t| t.as_mut_ptr());
    let raw_b = b.as_mut().map_or(ptr::null_mut(), |t| t.as_mut_ptr());
    let planned = planned.raw();
    // SAFETY: as in `accumulate`, for both factors.
    let status = unsafe { rg_node_accumulate_product(node.as_ptr(), raw_a, raw_b, &planned) };
    drop((a, b));
    check(status)
}

/// Runs one of the node's pre-kind hooks (tensor pre-hook, pre-hook, retains_grad) on
/// `values`, as the engine does.
pub fn call_pre_hook(
    node: &NodeRef,
    kind: HookKind,
    i: usize,
    values: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let ptrs = tensor_ptrs(values);
    written_values(ptrs.len(), |out| {
        // SAFETY: both arrays hold values.len() entries.
        unsafe { rg_node_call_pre_hook(node.as_ptr(), kind as c_int, i, ptrs.as_ptr(), ptrs.len(), out) }
    })
}

/// Whether `node` has hooks other than `planned` that do something (not a Python hook whose
/// callables were all removed); with `tensor_pre_only`, tensor pre-hooks and retains_grad
/// hooks only. Needs the GIL.
pub fn has_new_hooks(
    node: &NodeRef,
    planned: &PlannedHooks,
    tensor_pre_only: bool,
) -> Result<bool, ShimError> {
    let planned = planned.raw();
    let mut out: c_int = 0;
    // SAFETY: `planned` and `out` outlive the call.
    check(unsafe { rg_node_has_new_hooks(node.as_ptr(), &planned, tensor_pre_only as c_int, &mut out) })?;
    Ok(out != 0)
}

/// Calls the tensor pre-hooks and retains_grad hooks of `node` other than `planned` on
/// `values`, as the engine does before the node's pre-hooks.
pub fn call_new_tensor_pre_hooks(
    node: &NodeRef,
    planned: &PlannedHooks,
    values: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let ptrs = tensor_ptrs(values);
    let planned = planned.raw();
    written_values(ptrs.len(), |out| {
        // SAFETY: both arrays hold values.len() entries; `planned` outlives the call.
        unsafe { rg_node_call_new_tensor_pre_hooks(node.as_ptr(), &planned, ptrs.as_ptr(), ptrs.len(), out) }
    })
}

/// Runs `post_hooks()[i](outputs, inputs)`.
pub fn call_post_hook(
    node: &NodeRef,
    i: usize,
    outputs: &[Option<Tensor>],
    inputs: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let out_ptrs = tensor_ptrs(outputs);
    let in_ptrs = tensor_ptrs(inputs);
    written_values(out_ptrs.len(), |out| {
        // SAFETY: arrays are valid for their lengths.
        unsafe {
            rg_node_call_post_hook(
                node.as_ptr(),
                i,
                out_ptrs.as_ptr(),
                out_ptrs.len(),
                in_ptrs.as_ptr(),
                in_ptrs.len(),
                out,
            )
        }
    })
}

/// `validate_outputs` over the root edges, as `Engine::execute` does first.
pub fn validate_root_grads(
    roots: &[(Option<&NodeRef>, u32)],
    grads: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>, ShimError> {
    let nodes: Vec<*mut RawNode> = roots
        .iter()
        .map(|(n, _)| n.map_or(ptr::null_mut(), |n| n.as_ptr()))
        .collect();
    let input_nrs: Vec<u32> = roots.iter().map(|(_, nr)| *nr).collect();
    let ptrs = tensor_ptrs(grads);
    written_values(ptrs.len(), |out| {
        // SAFETY: all arrays hold roots.len() entries.
        unsafe {
            rg_validate_root_grads(
                nodes.as_ptr(),
                input_nrs.as_ptr(),
                nodes.len(),
                ptrs.as_ptr(),
                out,
            )
        }
    })
}

/// The lock under which a thread plans, and swaps values into live nodes (see
/// cpp_shim/shim.h, rg_graphs_lock): held while the guard lives, on the thread that took
/// it. Recursive.
pub struct GraphsLock(std::marker::PhantomData<*const ()>);

impl GraphsLock {
    pub fn acquire() -> Result<GraphsLock, ShimError> {
        // SAFETY: no arguments; the shim waits for the lock without the GIL.
        check(unsafe { rg_graphs_lock() })?;
        Ok(GraphsLock(std::marker::PhantomData))
    }
}

impl Drop for GraphsLock {
    fn drop(&mut self) {
        // SAFETY: this guard's acquire took the lock once on this thread.
        unsafe { rg_graphs_unlock() }
    }
}

/// What `compiled_args` tells about one node.
pub struct VisitedNode<'a> {
    /// False when the node does not implement `compiled_args`: its saved state is unknown.
    pub supported: bool,
    pub num_saved: usize,
    /// The node's specialisation bytes (non-tensor state, tensor metadata).
    pub key: &'a [u8],
    /// Its size inputs (sizes the node keeps, e.g. `self_sym_sizes`); when `lifted`,
    /// preceded by the dims its outputs are validated against.
    pub sizes: &'a [i64],
    /// The sizes can be replaced when it runs ([`apply_node_lifted`]): a compiled replay
    /// takes them as inputs instead of specialising on them.
    pub lifted: bool,
    /// The last `hooked` of its saved values come from its unpack hook `group` (an address,
    /// the same for the nodes of one checkpointed block) when it runs, not from the plan.
    pub hooked: usize,
    pub group: usize,
}

/// Cache lines [`NodeRef::prefetch`] loads: torch's Node base is about 600 bytes (edges,
/// hook lists, input metadata), a generated node's saved variables follow.
const NODE_PREFETCH_LINES: usize = 14;

/// Hints the CPU to load a node object (its first cache lines: the fields a visit reads,
/// saved variables of small nodes included) before it is described or visited.
#[inline]
pub fn prefetch_node(node: NonNull<RawNode>) {
    prefetch_lines(node.as_ptr() as usize);
}

/// Hints the CPU to load the [`NODE_PREFETCH_LINES`] cache lines from `address`, which need
/// not be a node's (nor any object's): a prefetch never faults.
#[inline]
pub fn prefetch_lines(address: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = address as *const i8;
        for line in 0..NODE_PREFETCH_LINES {
            // SAFETY: a prefetch never faults; wrapping_add computes no out-of-bounds
            // reference.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(line * 64)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// The `compiled_args` visitor over a graph's nodes; accumulates their saved values.
pub struct Collector(NonNull<RawCollector>);

impl Collector {
    pub fn new() -> Result<Self, ShimError> {
        let mut raw = ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { rg_collector_new(&mut raw) })?;
        NonNull::new(raw).map(Collector).ok_or_else(|| ShimError::Torch {
            kind: ErrorKind::Runtime,
            message: "rg_collector_new returned null".into(),
        })
    }

    /// Visits one node; Python Functions call into Python, so hold the GIL where they exist.
    pub fn visit(&mut self, node: &NodeRef) -> Result<VisitedNode<'_>, ShimError> {
        let mut supported = 0;
        let mut num_saved = 0usize;
        let mut key = ptr::null();
        let mut key_len = 0usize;
        let mut sizes = ptr::null();
        let mut n_sizes = 0usize;
        let mut lifted = 0;
        let mut hooked = 0usize;
        let mut group = 0usize;
        // SAFETY: out-pointers to locals; the collector and node are alive.
        check(unsafe {
            rg_collector_visit(
                self.0.as_ptr(),
                node.as_ptr(),
                &mut supported,
                &mut num_saved,
                &mut key,
                &mut key_len,
                &mut sizes,
                &mut n_sizes,
                &mut lifted,
                &mut hooked,
                &mut group,
            )
        })?;
        // SAFETY: the buffers live in the collector until the next visit (borrow of self).
        let key = if key_len == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(key, key_len) }
        };
        let sizes = if n_sizes == 0 {
            &[][..]
        } else {
            unsafe { std::slice::from_raw_parts(sizes, n_sizes) }
        };
        Ok(VisitedNode {
            supported: supported != 0,
            num_saved,
            key,
            sizes,
            lifted: lifted != 0,
            hooked,
            group,
        })
    }

    /// Frees what only [`Collector::visit`] needs (see `rg_collector_end_visits`); the slots
    /// stay. Call it after the last visit: a later one would not know the tensors seen before.
    pub fn end_visits(&mut self) {
        // SAFETY: the collector is alive; no visit's buffers are borrowed (`&mut self`).
        unsafe { rg_collector_end_visits(self.0.as_ptr()) };
    }

    /// Slots collected so far.
    pub fn len(&self) -> usize {
        // SAFETY: the collector is alive.
        unsafe { rg_collector_len(self.0.as_ptr()) }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The SavedVariable of every slot (the node's own, swapped during a traced call).
    pub fn saved_variables(&self) -> Result<Vec<*const RawSavedVariable>, ShimError> {
        let n = self.len();
        let mut svs = vec![ptr::null(); n];
        // SAFETY: `svs` has room for the n slots the collector holds.
        check(unsafe { rg_collector_saved_variables(self.0.as_ptr(), svs.as_mut_ptr(), n) })?;
        Ok(svs)
    }

    /// Slot `i`'s value as planned (see `rg_collector_visit`; None if undefined).
    pub fn value(&self, i: usize) -> Result<Option<Tensor>, ShimError> {
        let mut value = ptr::null_mut();
        // SAFETY: out-pointer to a local; the shim checks the index.
        check(unsafe { rg_collector_value(self.0.as_ptr(), i, &mut value) })?;
        // SAFETY: an owned handle or null.
        Ok((!value.is_null()).then(|| unsafe { Tensor::from_ptr(value) }))
    }

    /// The first slot in `slots` whose value was modified in place since it was planned.
    pub fn first_modified(&self, slots: std::ops::Range<usize>) -> Result<Option<usize>, ShimError> {
        let mut slot = 0usize;
        // SAFETY: out-pointer to a local; the shim clamps the range.
        check(unsafe { rg_collector_first_modified(self.0.as_ptr(), slots.start, slots.end, &mut slot) })?;
        Ok((slot < slots.end.min(self.len())).then_some(slot))
    }

    /// Drops the values of `slots` (see the shim's `rg_collector_forget`).
    pub fn forget(&mut self, slots: std::ops::Range<usize>) -> Result<(), ShimError> {
        // SAFETY: the collector is alive and borrowed mutably; the shim clamps the range.
        check(unsafe { rg_collector_forget(self.0.as_ptr(), slots.start, slots.end) })
    }

    /// Every slot's value as a new Python list (None where undefined); with `lift`, the
    /// 0-dim float64 values a compiled replay takes as 1-element tensors (see the shim's
    /// `rg_collector_values_to_list`).
    ///
    /// # Safety
    /// The GIL must be held.
    pub unsafe fn values_to_list(&self, lift: bool) -> Result<PyObjectPtr, ShimError> {
        let mut out = ptr::null_mut();
        check(rg_collector_values_to_list(
            self.0.as_ptr(),
            c_int::from(lift),
            &mut out,
        ))?;
        Ok(out)
    }
}

// SAFETY: the collector is only mutated while a layout is built (`&mut self`); afterwards it
// is read. What it holds (tensors, SavedVariable addresses) may be used and freed on any
// thread: torch's reference counts are atomic.
unsafe impl Send for Collector {}
unsafe impl Sync for Collector {}

impl Drop for Collector {
    fn drop(&mut self) {
        // SAFETY: we own the collector.
        unsafe { rg_collector_free(self.0.as_ptr()) }
    }
}

/// Unpacks `sv`, a SavedVariable of `node`, as the node would when it runs (calling its
/// unpack hook, if any), detached.
///
/// # Safety
/// `sv` must be the address of one of `node`'s SavedVariables.
pub unsafe fn unpack_saved_value(
    sv: *const RawSavedVariable,
    node: &NodeRef,
) -> Result<Option<Tensor>, ShimError> {
    let mut value = ptr::null_mut();
    check(rg_saved_variable_unpack_value(sv, node.as_ptr(), &mut value))?;
    // SAFETY: an owned handle or null.
    Ok((!value.is_null()).then(|| Tensor::from_ptr(value)))
}

/// Lets replays call unpack hooks with this code before their nodes run (see
/// cpp_shim/shim.h, rg_unpack_hooks_defer).
///
/// # Safety
/// `code` must be a live Python object and the GIL held.
pub unsafe fn defer_unpack_hooks(code: PyObjectPtr) -> Result<(), ShimError> {
    check(rg_unpack_hooks_defer(code))
}

/// A new reference to the shim's `buffer_sum(*grads)` for uncompiled replays, which sums in
/// place where the engine's InputBuffer would (see cpp_shim/shim.h, rg_buffer_sum_function).
///
/// # Safety
/// The GIL must be held.
pub unsafe fn buffer_sum_function() -> Result<PyObjectPtr, ShimError> {
    let mut out = ptr::null_mut();
    check(rg_buffer_sum_function(&mut out))?;
    Ok(out)
}

/// The engine hook: while installed, Engine::execute hands backward calls on threads where
/// it is enabled to `callback` (see cpp_shim/shim.h).
///
/// # Safety
/// `callback` must be a live Python object and the GIL held.
pub unsafe fn engine_hook_install(callback: PyObjectPtr) -> Result<(), ShimError> {
    check(rg_engine_hook_install(callback))
}

pub fn engine_hook_uninstall() -> Result<(), ShimError> {
    // SAFETY: no arguments; drops the shim's callback reference (GIL held by the caller).
    check(unsafe { rg_engine_hook_uninstall() })
}

/// Whether backward calls on the current thread go to the hook's callback.
pub fn engine_set_enabled(enabled: bool) {
    // SAFETY: sets a thread-local flag.
    unsafe { rg_engine_set_enabled(c_int::from(enabled)) }
}

/// Buffers this thread's C++ warnings until [`warnings_pop`] issues them as Python warnings
/// (see cpp_shim/shim.h, rg_warnings_push).
///
/// # Safety
/// The GIL must be held.
pub unsafe fn warnings_push() -> Result<(), ShimError> {
    check(rg_warnings_push())
}

/// Issues the warnings buffered since the matching [`warnings_push`] as Python warnings.
///
/// # Safety
/// The GIL must be held.
pub unsafe fn warnings_pop(in_exception: bool) -> Result<(), ShimError> {
    check(rg_warnings_pop(c_int::from(in_exception)))
}

pub fn engine_enabled() -> bool {
    // SAFETY: reads a thread-local flag.
    unsafe { rg_engine_enabled() != 0 }
}

/// A backward call the engine handed to the hook's callback.
pub struct EngineCall {
    pub roots: Vec<(NodeRef, u32)>,
    /// The root gradients after the engine's validate_outputs.
    pub root_grads: Vec<Option<Tensor>>,
    /// `inputs=` edges (None for an input without a node); None for a plain backward().
    pub outputs: Option<Vec<Option<(NodeRef, u32)>>>,
    pub accumulate_grad: bool,
    pub keep_graph: bool,
    pub create_graph: bool,
}

impl EngineCall {
    /// Reads the call behind the capsule the hook passed to the callback.
    ///
    /// # Safety
    /// `capsule` must be a live Python object and the GIL held.
    pub unsafe fn read(capsule: PyObjectPtr) -> Result<EngineCall, ShimError> {
        let (mut n_roots, mut n_outputs) = (0usize, 0usize);
        let (mut accumulate_grad, mut keep_graph, mut create_graph) = (0, 0, 0);
        check(rg_engine_call_info(
            capsule,
            &mut n_roots,
            &mut n_outputs,
            &mut accumulate_grad,
            &mut keep_graph,
            &mut create_graph,
        ))?;
        let mut nodes: Vec<*mut RawNode> = vec![ptr::null_mut(); n_roots];
        let mut input_nrs = vec![0u32; n_roots];
        let mut grads: Vec<*mut C_tensor> = vec![ptr::null_mut(); n_roots];
        let status = rg_engine_call_roots(
            capsule,
            nodes.as_mut_ptr(),
            input_nrs.as_mut_ptr(),
            grads.as_mut_ptr(),
        );
        let root_nodes: Vec<Option<NodeRef>> = nodes.into_iter().map(NodeRef::from_new).collect();
        let root_grads = take_tensors(grads);
        check(status)?;
        let mut roots = Vec::with_capacity(n_roots);
        for (node, nr) in root_nodes.into_iter().zip(input_nrs) {
            roots.push((
                node.ok_or_else(|| ShimError::new(ErrorKind::Runtime, "a root edge has no node"))?,
                nr,
            ));
        }
        let outputs = if n_outputs == 0 {
            None
        } else {
            let mut nodes: Vec<*mut RawNode> = vec![ptr::null_mut(); n_outputs];
            let mut input_nrs = vec![0u32; n_outputs];
            let status = rg_engine_call_outputs(capsule, nodes.as_mut_ptr(), input_nrs.as_mut_ptr());
            let edges: Vec<Option<(NodeRef, u32)>> = nodes
                .into_iter()
                .zip(input_nrs)
                .map(|(n, nr)| NodeRef::from_new(n).map(|n| (n, nr)))
                .collect();
            check(status)?;
            Some(edges)
        };
        Ok(EngineCall {
            roots,
            root_grads,
            outputs,
            accumulate_grad: accumulate_grad != 0,
            keep_graph: keep_graph != 0,
            create_graph: create_graph != 0,
        })
    }
}
