//! The `replaygrad._core` module: converts between Python and the core, and calls it.
//! No planning logic lives here.

use std::sync::atomic::{AtomicUsize, Ordering};

use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use tch::Tensor;

use crate::ffi::{self, EngineCall, HookKind, Inputs, NodeKind, NodeRef};
use crate::layout::StepMode;
use crate::order::NO_STEP;
use crate::plan::{Deferred, DeferredValue, Plan};

/// A Python object → an optional tensor (None stays None).
fn to_tensor(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Option<Tensor>> {
    if obj.is_none() {
        return Ok(None);
    }
    // SAFETY: `obj` is alive and we hold the GIL.
    match unsafe { Tensor::pyobject_unpack(obj.as_ptr() as *mut _) } {
        Ok(Some(t)) => Ok(Some(t)),
        Ok(None) => Err(PyTypeError::new_err(format!(
            "{what} must be a Tensor or None, got {}",
            obj.get_type().name()?
        ))),
        Err(e) => Err(PyRuntimeError::new_err(e.to_string())),
    }
}

/// A deferred effect's value: a gradient (a tensor or None), or a pair of tensors (or
/// None), the factors of a product (see [`DeferredValue::Product`]).
fn deferred_value(obj: &Bound<'_, PyAny>) -> PyResult<DeferredValue> {
    if let Ok(pair) = obj.cast::<PyTuple>() {
        if pair.len() != 2 {
            return Err(PyTypeError::new_err(format!(
                "a product's factors are a pair, got {} values",
                pair.len()
            )));
        }
        return Ok(DeferredValue::Product(
            to_tensor(&pair.get_item(0)?, "factor")?,
            to_tensor(&pair.get_item(1)?, "factor")?,
        ));
    }
    Ok(DeferredValue::Tensor(to_tensor(obj, "gradient")?))
}

fn to_tensors(seq: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<Option<Tensor>>> {
    seq.try_iter()?.map(|item| to_tensor(&item?, what)).collect()
}

fn to_py<'py>(py: Python<'py>, t: Option<Tensor>) -> PyResult<Bound<'py, PyAny>> {
    match t {
        None => Ok(py.None().into_bound(py)),
        Some(t) => {
            let ptr = t
                .pyobject_wrap()
                .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
            // SAFETY: THPVariable_Wrap returns a new reference (null with a Python error).
            unsafe { Bound::from_owned_ptr_or_err(py, ptr as *mut pyo3::ffi::PyObject) }
        }
    }
}

fn to_py_tuple<'py>(py: Python<'py>, ts: Vec<Option<Tensor>>) -> PyResult<Bound<'py, PyTuple>> {
    let items = ts
        .into_iter()
        .map(|t| to_py(py, t))
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, items)
}

fn kind_name(kind: NodeKind) -> &'static str {
    match kind {
        NodeKind::Generic => "generic",
        NodeKind::AccumulateGrad => "accumulate_grad",
        NodeKind::PythonFunction => "python_function",
        NodeKind::CppFunction => "cpp_function",
    }
}

fn mode_name(mode: StepMode) -> &'static str {
    match mode {
        StepMode::Traced => "traced",
        StepMode::Opaque => "opaque",
        StepMode::DeferredAccumulate => "deferred_accumulate",
        StepMode::EagerAccumulate => "eager_accumulate",
        StepMode::Skipped => "skipped",
    }
}

fn hook_kind_name(kind: HookKind) -> &'static str {
    match kind {
        HookKind::TensorPre => "tensor_pre",
        HookKind::Pre => "pre",
        HookKind::Post => "post",
        HookKind::RetainsGrad => "retains_grad",
    }
}

/// The plan of one backward call (see `replaygrad._core.pyi`).
#[pyclass(name = "Plan", module = "replaygrad._core")]
pub struct PyPlan {
    plan: Plan,
    /// The engine's call this plan was made for (root gradients, flags), if any.
    call: Option<CallData>,
    /// Deferred effects performed so far (run_deferred goes on from there).
    effects_done: AtomicUsize,
    /// Steps whose nodes' saved variables were released so far (the first ones).
    released: AtomicUsize,
}

// SAFETY: a plan is only used through its Python methods, which all run with the GIL held
// (none releases it), so never from two threads at once. What it owns (node references,
// tensors, the addresses of its nodes' SavedVariables) may be used and dropped on any
// thread: torch's reference counts are atomic. Dropping must be allowed anywhere: a replay
// that raised leaves its plan in a reference cycle (through the traceback and Dynamo's
// state), which the garbage collector may free on another thread; an unsendable class
// would be leaked there, with the saved tensors it holds.
unsafe impl Send for PyPlan {}
unsafe impl Sync for PyPlan {}

struct CallData {
    root_grads: Vec<Option<Tensor>>,
    accumulate_grad: bool,
    keep_graph: bool,
}

#[pymethods]
impl PyPlan {
    /// Whether the call runs nothing but torch's formulas and accumulations (no code of the
    /// user's: see `Plan::runs_only_formulas`), so that it can run without the engine.
    #[getter]
    fn runs_only_formulas(&self) -> bool {
        self.plan.runs_only_formulas()
    }

    /// Takes the engine's call behind `call` (the capsule the hook passed) as this plan's
    /// when it is the call the plan was made for by `plan_backward` (the same roots, the
    /// same `inputs=` edges, accumulating or not): its validated root gradients and flags
    /// replace the plan's. False (and the plan unchanged) for any other call.
    fn adopt(&mut self, call: &Bound<'_, PyAny>) -> PyResult<bool> {
        // SAFETY: live object, GIL held.
        let call = unsafe { EngineCall::read(call.as_ptr()) }?;
        let same = self
            .call
            .as_ref()
            .is_some_and(|c| c.accumulate_grad == call.accumulate_grad)
            && !call.create_graph
            && self.plan.has_roots(&call.roots)
            && match &call.outputs {
                None => self.plan.snapshot.graph.outputs.is_empty(),
                Some(outputs) => !outputs.is_empty() && self.plan.has_outputs(outputs),
            };
        if !same {
            return Ok(false);
        }
        self.call = Some(CallData {
            root_grads: call.root_grads,
            accumulate_grad: call.accumulate_grad,
            keep_graph: call.keep_graph,
        });
        Ok(true)
    }

    /// Hex digest of everything a compiled replay specialises on.
    #[getter]
    fn key(&self) -> String {
        format!("{:032x}", self.plan.layout.key)
    }

    /// Per step, the digests of its structure, input metadata and specialisation, packed
    /// as 24 little-endian bytes per step (for explaining why a key changed).
    fn step_digests<'py>(&self, py: Python<'py>) -> Bound<'py, pyo3::types::PyBytes> {
        let mut out = Vec::with_capacity(self.plan.layout.digests.len() * 24);
        for d in &self.plan.layout.digests {
            for v in d {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        pyo3::types::PyBytes::new(py, &out)
    }

    #[getter]
    fn num_steps(&self) -> usize {
        self.plan.num_steps()
    }

    #[getter]
    fn num_saved(&self) -> usize {
        self.plan.layout.num_saved()
    }

    #[getter]
    fn num_roots(&self) -> usize {
        self.plan.snapshot.graph.roots.len()
    }

    /// The root gradients of the engine call, validated by the engine.
    fn root_grads<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let call = self
            .call
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("not an engine call's plan"))?;
        to_py_tuple(
            py,
            call.root_grads
                .iter()
                .map(|g| g.as_ref().map(|t| t.shallow_clone()))
                .collect(),
        )
    }

    /// Whether a node of the graph takes a nested tensor (strided or jagged).
    #[getter]
    fn nested_inputs(&self) -> bool {
        self.plan.snapshot.nested_inputs
    }

    /// Whether the engine call keeps the graph (retain_graph).
    #[getter]
    fn keep_graph(&self) -> bool {
        self.call.as_ref().is_none_or(|c| c.keep_graph)
    }

    /// Whether the engine call accumulates into `.grad` (backward) or returns captured
    /// gradients (autograd.grad).
    #[getter]
    fn accumulate_grad(&self) -> bool {
        self.call.as_ref().is_none_or(|c| c.accumulate_grad)
    }

    /// How many gradients the replay captures (autograd.grad's results).
    #[getter]
    fn num_captures(&self) -> usize {
        self.plan.snapshot.graph.outputs.len()
    }

    /// Node names in execution order.
    fn order(&self) -> Vec<String> {
        let g = &self.plan.snapshot.graph;
        self.plan
            .schedule
            .steps
            .iter()
            .map(|&n| g.name(n).to_owned())
            .collect()
    }

    /// The grad_fn objects of the steps, in execution order.
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = (0..self.plan.num_steps() as u32)
            .map(|step| self.node_object(py, step))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, out)
    }

    /// Whether the step's node says it is traceable (a Python Function's `is_traceable`
    /// class attribute; false where the class has none).
    fn is_traceable(&self, step: u32) -> PyResult<bool> {
        Ok(self.plan.node(step)?.is_traceable()?)
    }

    /// For a Python Function's step: per input, whether its backward gets None for an
    /// undefined gradient there (`set_materialize_grads(False)`, or a non-differentiable
    /// output with `_materialize_non_diff_grads` off), not zeros. Part of the key.
    fn passes_none(&self, step: u32) -> PyResult<Vec<bool>> {
        let node = self.plan.node(step)?;
        let n = self.plan.schedule.steps[step as usize];
        let inputs = self.plan.snapshot.graph.nodes[n as usize].num_inputs;
        Ok((0..inputs as usize)
            .map(|i| node.passes_none(i))
            .collect::<Result<Vec<_>, _>>()?)
    }

    /// The grad_fn object of one step (what `torch._C._current_autograd_node()` returns while
    /// the engine runs it).
    fn node_object<'py>(&self, py: Python<'py>, step: u32) -> PyResult<Bound<'py, PyAny>> {
        let ptr = self.plan.node(step)?.to_pyobject()?;
        // SAFETY: a new reference from functionToPyObject.
        Ok(unsafe { Bound::from_owned_ptr(py, ptr) })
    }

    /// Per step: (name, kind, mode, sequence_nr, num_inputs, num_outputs, saved_start,
    /// saved_end, slots, outputs, hooks, captures). slots[i] lists (step, index) sources of
    /// input i (step -1: root gradient `index`); outputs[j] is (target step or -1,
    /// input_nr); hooks are (kind, index, python, value_idx or -1); captures are
    /// (input_nr, result index).
    fn steps<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let plan = &self.plan;
        let g = &plan.snapshot.graph;
        let mut out = Vec::with_capacity(plan.num_steps());
        for (s, &n) in plan.schedule.steps.iter().enumerate() {
            let data = &g.nodes[n as usize];
            let step = &plan.layout.steps[s];
            let slots: Vec<Vec<(i64, u32)>> = (0..data.num_inputs)
                .map(|i| {
                    plan.schedule
                        .slot_sources(s as u32, i)
                        .iter()
                        .map(|src| (if src.is_root() { -1 } else { i64::from(src.step) }, src.index))
                        .collect()
                })
                .collect();
            let outputs: Vec<(i64, u32)> = g
                .next_edges(n)
                .iter()
                .map(|e| {
                    let target = if e.is_valid() {
                        plan.schedule.step_of[e.node as usize]
                    } else {
                        NO_STEP
                    };
                    (if target == NO_STEP { -1 } else { i64::from(target) }, e.input_nr)
                })
                .collect();
            let hooks: Vec<(&str, u32, bool, i64)> = plan.layout.hooks
                [step.hooks.start as usize..step.hooks.end as usize]
                .iter()
                .map(|h| {
                    (
                        hook_kind_name(h.kind),
                        h.index,
                        h.python,
                        h.value_idx.map_or(-1, i64::from),
                    )
                })
                .collect();
            let item = (
                g.name(n),
                kind_name(data.kind),
                mode_name(step.mode),
                data.sequence_nr,
                data.num_inputs,
                outputs.len(),
                step.saved.start,
                step.saved.end,
                slots,
                outputs,
                hooks,
                plan.schedule
                    .step_captures(s as u32)
                    .iter()
                    .map(|c| (c.input_nr, c.output_idx))
                    .collect::<Vec<_>>(),
            );
            out.push(item.into_pyobject(py)?);
        }
        PyList::new(py, out)
    }

    /// The traced steps whose last saved values come from an unpack hook when the replay
    /// runs (non-reentrant checkpointing): (step, count, group), the steps of one
    /// checkpointed block sharing a group (numbered in order of first appearance).
    fn hooked_steps(&self) -> Vec<(u32, u32, u32)> {
        self.plan
            .layout
            .steps
            .iter()
            .enumerate()
            .filter(|(_, step)| step.hooked > 0)
            .map(|(s, step)| (s as u32, step.hooked, step.group))
            .collect()
    }

    /// The values of a step's hooked saved variables (see `hooked_steps`), unpacked now as
    /// its node would unpack them, calling their unpack hook.
    fn unpack<'py>(&self, py: Python<'py>, step: u32) -> PyResult<Bound<'py, PyTuple>> {
        let out = self.plan.unpack_hooked(step)?;
        to_py_tuple(py, out)
    }

    /// The saved values of traced steps, one per slot, as planned (replay inputs); with
    /// `lift`, as a compiled replay takes them (0-dim float64 values that do not require
    /// grad as 1-element tensors sharing their storage, part of the key).
    #[pyo3(signature = (lift=false))]
    fn saved_values<'py>(&self, py: Python<'py>, lift: bool) -> PyResult<Bound<'py, PyList>> {
        // SAFETY: the GIL is held; the shim returns a new reference to a list.
        let list = unsafe { self.plan.layout.values.values_to_list(lift) }?;
        Ok(unsafe { Bound::from_owned_ptr(py, list) }.cast_into::<PyList>()?)
    }

    /// For every Python hook of the plan, in replay order: the hook's dict of callables (by
    /// handle id), which the replay reads when it reaches the hook, as the engine does
    /// (hooks are inputs of a replay, not part of its key).
    fn hook_dicts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut out = Vec::new();
        if !self.plan.layout.hooks.iter().any(|h| h.python) {
            // Most plans: no step to look at.
            return PyList::new(py, out);
        }
        for (s, step) in self.plan.layout.steps.iter().enumerate() {
            for i in step.hooks.clone() {
                let hook = self.plan.layout.hooks[i as usize];
                if !hook.python {
                    continue;
                }
                let node = self.plan.node(s as u32)?;
                let dict = node
                    .hook_dict(hook.kind, hook.index as usize)?
                    .ok_or_else(|| PyRuntimeError::new_err("a Python hook lost its dict"))?;
                // SAFETY: a new reference to the hook's dict.
                out.push(unsafe { Bound::from_owned_ptr(py, dict) });
            }
        }
        PyList::new(py, out)
    }

    /// (step, kind, hook position or -1) of each deferred effect, in the order the replay
    /// returns their values.
    fn deferred(&self) -> Vec<(u32, &'static str, i64)> {
        self.plan
            .deferred()
            .into_iter()
            .map(|d| match d {
                Deferred::Accumulate { step } => (step, "accumulate", -1),
                Deferred::RetainGrad { step, hook } => (step, "retain_grad", i64::from(hook)),
            })
            .collect()
    }

    /// validate_outputs over the root edges, as the engine does first.
    fn validate_root_grads<'py>(
        &self,
        py: Python<'py>,
        grads: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let grads = to_tensors(grads, "grad")?;
        let plan = &self.plan;
        let roots: Vec<(Option<&NodeRef>, u32)> = plan
            .snapshot
            .graph
            .roots
            .iter()
            .map(|e| (Some(&plan.snapshot.handles[e.node as usize]), e.input_nr))
            .collect();
        let out = crate::ffi::validate_root_grads(&roots, &grads)?;
        to_py_tuple(py, out)
    }

    /// Runs a step's node with `saved` swapped in (or its own saved values when None) and,
    /// given `sizes`, its lifted sizes replaced by them (ints or torch.SymInts, see
    /// `size_ranges`). `live`: the node runs for real, and hooks it got since it was planned
    /// are called around it, as the engine calls them (not with `sizes`: a traced run).
    /// `take`: the node takes the gradients over, and the list `inputs` is emptied first, so
    /// that a gradient referenced nowhere else is freed when the node lets go of it (as the
    /// engine moves its input buffer into the call).
    #[pyo3(signature = (step, inputs, saved=None, sizes=None, live=false, take=false))]
    #[allow(clippy::too_many_arguments)]
    fn apply<'py>(
        &self,
        py: Python<'py>,
        step: u32,
        inputs: &Bound<'py, PyAny>,
        saved: Option<&Bound<'py, PyAny>>,
        sizes: Option<&Bound<'py, PyAny>>,
        live: bool,
        take: bool,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let tensors = to_tensors(inputs, "gradient")?;
        let saved = saved.map(|s| to_tensors(s, "saved value")).transpose()?;
        let out = match (sizes, saved.as_deref()) {
            (Some(_), _) if live || take => {
                return Err(PyValueError::new_err(
                    "live hooks and taken inputs are for nodes run for real, not with sizes",
                ))
            }
            (Some(sizes), Some(saved)) => self.plan.apply_lifted(step, &tensors, saved, sizes)?,
            (Some(_), None) => return Err(PyValueError::new_err("sizes are given only with saved values")),
            (None, saved) if take => {
                let list = inputs
                    .cast::<PyList>()
                    .map_err(|_| PyTypeError::new_err("taken inputs are given as a list"))?;
                list.del_slice(0, list.len())?;
                self.plan.apply(step, Inputs::Taken(tensors), saved, live)?
            }
            (None, saved) => self.plan.apply(step, Inputs::Lent(&tensors), saved, live)?,
        };
        to_py_tuple(py, out)
    }

    /// The gradients a Python Function's step hands on, made of `result`, what the
    /// Function's backward returned when the replay called it itself (traced into a compiled
    /// graph): PyNode::apply's checks of the count and types, then validate_outputs, each
    /// raising the engine's error; `sizes`: the step's lifted sizes (the dims of the
    /// metadata its outputs are validated against), if given. One entry per next edge.
    #[pyo3(signature = (step, result, sizes=None))]
    fn function_outputs<'py>(
        &self,
        py: Python<'py>,
        step: u32,
        result: &Bound<'py, PyAny>,
        sizes: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        to_py_tuple(py, self.plan.function_outputs(step, result, sizes)?)
    }

    /// Whether the step's node got hooks since the call was planned (registered by an
    /// earlier hook of this backward), which `apply(..., live=True)` calls around it.
    fn has_new_hooks(&self, step: u32) -> PyResult<bool> {
        Ok(self.plan.has_new_hooks(step)?)
    }

    /// The traced steps whose nodes got hooks since the call was planned (registered during
    /// the backward), and the skipped ones (nodes the call does not need, whose tensor
    /// pre-hooks the engine calls all the same) whose nodes got tensor pre-hooks: hooks a
    /// compiled replay does not call.
    fn steps_with_new_hooks(&self) -> PyResult<Vec<u32>> {
        Ok(self.plan.steps_with_new_hooks()?)
    }

    /// Calls the tensor pre-hooks and retains_grad hooks the step's node got since the call
    /// was planned on `values` (what the engine calls before the node's pre-hooks, which the
    /// replay is about to call); the node does not call them again when it runs. `values`
    /// as they are where they were called already.
    fn new_tensor_pre_hooks<'py>(
        &self,
        py: Python<'py>,
        step: u32,
        values: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let tensors = to_tensors(values, "gradient")?;
        match self.plan.call_new_tensor_pre_hooks(step, &tensors)? {
            Some(out) => Ok(to_py_tuple(py, out)?.into_any()),
            None => Ok(values.clone()),
        }
    }

    /// From now on, nodes of the type of this step's node keep their sizes in the key (its
    /// formula failed on symbolic sizes).
    fn mark_not_liftable(&self, step: u32) -> PyResult<()> {
        Ok(crate::ffi::mark_type_not_liftable(self.plan.node(step)?)?)
    }

    /// The lifted sizes of the traced steps, in step order (see `size_ranges`): a replay
    /// input, like the saved values.
    fn sizes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.plan.layout.sizes)
    }

    /// Per step, the range of `sizes` that are its lifted sizes (empty for steps whose
    /// sizes are part of the key, or that keep none): the dims of the inputs its edges
    /// point at, then the sizes the node keeps.
    fn size_ranges(&self) -> Vec<(u32, u32)> {
        self.plan
            .layout
            .steps
            .iter()
            .map(|s| (s.sizes.start, s.sizes.end))
            .collect()
    }

    /// Runs a step's AccumulateGrad on `inputs[0]`, handing the gradient over so that it
    /// can be stolen as in the engine: with `take`, it is also removed from `inputs` (no
    /// post hook needs it afterwards).
    fn accumulate(&self, step: u32, inputs: &Bound<'_, PyList>, take: bool) -> PyResult<()> {
        if inputs.len() != 1 {
            return Err(PyRuntimeError::new_err(format!(
                "AccumulateGrad takes 1 gradient, got {}",
                inputs.len()
            )));
        }
        let item = inputs.get_item(0)?;
        // AccumulateGrad steals a gradient whose C++ use count shows no other holder; the
        // engine keeps one reference more for a node with post hooks (which here is the
        // Python object in `inputs`). Python holders of that object (a hook that kept it,
        // a tensor a hook returned) do not show in the C++ count: with references beyond
        // the list's and `item`'s (counted before a C++ handle makes torch take one too),
        // one more C++ reference is held for the call so that the gradient is copied, as
        // the engine would.
        // SAFETY: `item` is a live object (a reference we hold).
        let shared = !take && unsafe { pyo3::ffi::Py_REFCNT(item.as_ptr()) } > 2;
        let grad = to_tensor(&item, "gradient")?;
        let _held = grad.as_ref().filter(|_| shared).map(|t| t.shallow_clone());
        drop(item);
        if take {
            inputs.del_item(0)?;
        }
        Ok(self.plan.accumulate(step, grad)?)
    }

    /// Runs hook `position` of a step through the engine's hook interface.
    #[pyo3(signature = (step, position, values, inputs=None))]
    fn call_hook<'py>(
        &self,
        py: Python<'py>,
        step: u32,
        position: u32,
        values: &Bound<'py, PyAny>,
        inputs: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let values = to_tensors(values, "gradient")?;
        let inputs = inputs
            .map(|i| to_tensors(i, "gradient"))
            .transpose()?
            .unwrap_or_default();
        let out = self.plan.call_hook(step, position, &values, &inputs)?;
        to_py_tuple(py, out)
    }

    /// Performs the plan's next deferred effects, one per value the replay appended to
    /// `values` (a gradient, or for an accumulation the pair of factors `(a, b)` of the
    /// gradient `a.t() @ b`), going on from the effects performed before. `values` is emptied
    /// first, so that a gradient referenced nowhere else can be stolen by AccumulateGrad
    /// instead of copied. `complete=True` (the end of the replay): these must be all the
    /// remaining ones.
    #[pyo3(signature = (values, complete=true))]
    fn run_deferred(&self, values: &Bound<'_, PyList>, complete: bool) -> PyResult<()> {
        let expected = self.plan.deferred().len();
        let start = self.effects_done.load(Ordering::Relaxed);
        let end = start + values.len();
        if end > expected || (complete && end != expected) {
            return Err(PyRuntimeError::new_err(format!(
                "replay returned {end} deferred values, the plan expects {expected}"
            )));
        }
        let taken: Vec<DeferredValue> = values
            .iter()
            .map(|v| deferred_value(&v))
            .collect::<PyResult<_>>()?;
        values.del_slice(0, values.len())?;
        self.effects_done.store(end, Ordering::Relaxed);
        let mut taken = taken.into_iter();
        self.plan.run_deferred(start..end, &mut |_| {
            Ok(taken.next().unwrap_or(DeferredValue::Tensor(None)))
        })?;
        Ok(())
    }

    /// The kind of a step's node (as in `steps()`: generic, accumulate_grad,
    /// python_function, cpp_function).
    fn kind(&self, step: u32) -> PyResult<&'static str> {
        let node = *self
            .plan
            .schedule
            .steps
            .get(step as usize)
            .ok_or_else(|| PyIndexError::new_err(format!("no step {step}")))?;
        Ok(kind_name(self.plan.snapshot.graph.nodes[node as usize].kind))
    }

    /// Drops the plan's values of saved slots `first..end` (those of steps a replay runs as
    /// themselves, with their own saved variables), so that the plan does not keep them
    /// alive until it is dropped; they read as None from then on.
    fn forget_saved(&mut self, first: usize, end: usize) -> PyResult<()> {
        Ok(self.plan.forget_saved(first..end)?)
    }

    /// Raises what the node would (RuntimeError: "... modified by an inplace operation") if
    /// a saved value of steps `first..=last` was modified in place since it was planned.
    fn check_saved_versions(&self, first: u32, last: u32) -> PyResult<()> {
        Ok(self.plan.check_saved_versions(first, last)?)
    }

    /// Frees the saved variables of the nodes that ran, as the engine does unless the call
    /// keeps its graph (retain_graph, or a plan made outside a backward call: then nothing
    /// is freed): of every one, or of those before step `before` (those that ran before an
    /// error, or before code outside the graph runs, which could reach them). Goes on from
    /// the steps released before.
    #[pyo3(signature = (before=None))]
    fn release_variables(&self, before: Option<usize>) -> PyResult<()> {
        if self.keep_graph() {
            return Ok(());
        }
        let start = self.released.load(Ordering::Relaxed);
        let end = before.unwrap_or(usize::MAX).min(self.plan.num_steps());
        if start < end {
            self.plan.release_variables(start..end)?;
            self.released.store(end, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// A root or input given as a GradientEdge `(node, output_nr)` rather than a tensor.
fn gradient_edge_of(item: &Bound<'_, PyAny>) -> PyResult<Option<(NodeRef, u32)>> {
    let (node, output_nr): (Bound<'_, PyAny>, u32) = item.extract()?;
    // SAFETY: live object, GIL held.
    match unsafe { NodeRef::from_pyobject(node.as_ptr()) }? {
        Some(n) => Ok(Some((n, output_nr))),
        None => Err(PyTypeError::new_err(format!(
            "GradientEdge first object must be an autograd.graph.Node but got {}",
            node.get_type().name()?
        ))),
    }
}

fn is_tensor(item: &Bound<'_, PyAny>) -> bool {
    // SAFETY: live object, GIL held.
    unsafe { tch::python::pyobject_check(item.as_ptr() as *mut _) }.unwrap_or(false)
}

/// The gradient edges of `roots` (tensors or GradientEdges).
fn root_edges(roots: &Bound<'_, PyAny>) -> PyResult<Vec<(NodeRef, u32)>> {
    let mut edges = Vec::new();
    for (i, item) in roots.try_iter()?.enumerate() {
        let item = item?;
        let edge = if is_tensor(&item) {
            let tensor = to_tensor(&item, "tensors")?
                .ok_or_else(|| PyTypeError::new_err("tensors must not contain None"))?;
            NodeRef::gradient_edge(&tensor)?
        } else {
            gradient_edge_of(&item)?
        };
        match edge {
            Some(edge) => edges.push(edge),
            None => {
                return Err(PyRuntimeError::new_err(format!(
                    "element {i} of tensors does not require grad and does not have a grad_fn"
                )))
            }
        }
    }
    Ok(edges)
}

/// The edges of `inputs=` (tensors or GradientEdges), as the engine takes them: None for a
/// leaf without an AccumulateGrad (unreachable).
fn input_edges(inputs: &Bound<'_, PyAny>) -> PyResult<Vec<Option<(NodeRef, u32)>>> {
    let mut outputs = Vec::new();
    for item in inputs.try_iter()? {
        let item = item?;
        outputs.push(if is_tensor(&item) {
            let tensor = to_tensor(&item, "inputs")?
                .ok_or_else(|| PyTypeError::new_err("inputs must not contain None"))?;
            NodeRef::input_edge(&tensor)?
        } else {
            gradient_edge_of(&item)?
        });
    }
    Ok(outputs)
}

/// Plans the backward of `roots` (tensors or GradientEdges): walks the graph, orders it as
/// the engine would and lays out its saved values. With `inputs` (tensors or
/// GradientEdges), plans a backward with respect to them: accumulating into them
/// (`backward(inputs=)`) or capturing their gradients (`autograd.grad`).
/// `trace_functions`: for a compiled replay, which may trace Python Functions that do not
/// say they are traceable (their saved values are laid out); else they are opaque.
#[pyfunction]
#[pyo3(signature = (roots, inputs=None, accumulate_grad=true, trace_functions=true))]
fn plan(
    roots: &Bound<'_, PyAny>,
    inputs: Option<&Bound<'_, PyAny>>,
    accumulate_grad: bool,
    trace_functions: bool,
) -> PyResult<PyPlan> {
    let edges = root_edges(roots)?;
    let outputs = inputs.map(input_edges).transpose()?;
    Ok(PyPlan {
        plan: Plan::build_for(&edges, outputs.as_deref(), accumulate_grad, trace_functions)?,
        call: None,
        effects_done: AtomicUsize::new(0),
        released: AtomicUsize::new(0),
    })
}

/// Plans `torch.autograd.backward(tensors, grads, retain_graph=keep_graph, inputs=inputs)`
/// (`accumulate_grad`; else `torch.autograd.grad(tensors, inputs, grads, ...)`), with
/// create_graph=False, as the engine would plan it, for replaygrad to run without the
/// engine: `grads` are taken as the engine's validated root gradients (the caller checked
/// that validate_outputs would keep them as they are).
#[pyfunction]
#[pyo3(signature = (
    tensors, grads, keep_graph, inputs=None, accumulate_grad=true, trace_functions=true
))]
fn plan_backward(
    tensors: &Bound<'_, PyAny>,
    grads: &Bound<'_, PyAny>,
    keep_graph: bool,
    inputs: Option<&Bound<'_, PyAny>>,
    accumulate_grad: bool,
    trace_functions: bool,
) -> PyResult<PyPlan> {
    let roots = root_edges(tensors)?;
    let root_grads = to_tensors(grads, "grads")?;
    if root_grads.len() != roots.len() {
        return Err(PyValueError::new_err(format!(
            "got {} gradients for {} tensors",
            root_grads.len(),
            roots.len()
        )));
    }
    if inputs.is_none() && !accumulate_grad {
        return Err(PyValueError::new_err(
            "a backward that does not accumulate needs inputs",
        ));
    }
    let outputs = inputs.map(input_edges).transpose()?;
    Ok(PyPlan {
        plan: Plan::build_for(&roots, outputs.as_deref(), accumulate_grad, trace_functions)?,
        call: Some(CallData {
            root_grads,
            accumulate_grad,
            keep_graph,
        }),
        effects_done: AtomicUsize::new(0),
        released: AtomicUsize::new(0),
    })
}

/// Plans the backward call the engine handed to the hook's callback (`call` is the capsule
/// it passed). Returns None for calls replaygrad leaves to the engine (create_graph=True).
/// `trace_functions`: see [`plan`].
#[pyfunction]
#[pyo3(signature = (call, trace_functions=true))]
fn plan_engine_call(call: &Bound<'_, PyAny>, trace_functions: bool) -> PyResult<Option<PyPlan>> {
    // SAFETY: live object, GIL held.
    let call = unsafe { EngineCall::read(call.as_ptr()) }?;
    if call.create_graph {
        return Ok(None);
    }
    let plan = Plan::build_for(
        &call.roots,
        call.outputs.as_deref(),
        call.accumulate_grad,
        trace_functions,
    )?;
    Ok(Some(PyPlan {
        plan,
        call: Some(CallData {
            root_grads: call.root_grads,
            accumulate_grad: call.accumulate_grad,
            keep_graph: call.keep_graph,
        }),
        effects_done: AtomicUsize::new(0),
        released: AtomicUsize::new(0),
    }))
}

/// `with CppWarnings():` buffers the C++ warnings raised on this thread while the block runs
/// and issues them as Python warnings when it ends, as a Python binding of torch (the
/// engine's `run_backward` among them) does around its call; code that calls torch's C++
/// without a binding (the shim runs nodes and hooks) would otherwise log them. A warning
/// turned into an error by a filter is raised at the end of the block, or printed when
/// the block raises.
#[pyclass(module = "replaygrad._core")]
struct CppWarnings;

#[pymethods]
impl CppWarnings {
    #[new]
    fn new() -> Self {
        CppWarnings
    }

    fn __enter__(&self) -> PyResult<()> {
        // SAFETY: GIL held.
        Ok(unsafe { ffi::warnings_push() }?)
    }

    fn __exit__(
        &self,
        exc_type: &Bound<'_, PyAny>,
        _exc_value: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        // SAFETY: GIL held.
        unsafe { ffi::warnings_pop(!exc_type.is_none()) }?;
        Ok(false)
    }
}

/// Installs the engine hook: Engine::execute hands backward calls on enabled threads to
/// `callback(call)`, which returns captured gradients or None to let the engine run.
#[pyfunction]
fn engine_hook_install(callback: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: live object, GIL held.
    Ok(unsafe { ffi::engine_hook_install(callback.as_ptr()) }?)
}

/// Lets replays call saved_tensors_hooks unpack hooks with this code object before their
/// nodes run, in a batch (see `PyPlan.hooked_steps`).
#[pyfunction]
fn defer_unpack_hooks(code: &Bound<'_, PyAny>) -> PyResult<()> {
    // SAFETY: live object, GIL held.
    Ok(unsafe { ffi::defer_unpack_hooks(code.as_ptr()) }?)
}

/// Removes the engine hook.
#[pyfunction]
fn engine_hook_uninstall() -> PyResult<()> {
    Ok(ffi::engine_hook_uninstall()?)
}

/// Enables or disables the hook's callback for backward calls on the current thread;
/// returns the prior state.
#[pyfunction]
fn engine_set_enabled(enabled: bool) -> bool {
    let prior = ffi::engine_enabled();
    ffi::engine_set_enabled(enabled);
    prior
}

/// The node behind a grad_fn object, compared by identity: True when both objects wrap
/// the same `torch::autograd::Node`.
#[pyfunction]
fn same_node(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<bool> {
    // SAFETY: live objects, GIL held.
    let na = unsafe { NodeRef::from_pyobject(a.as_ptr()) }?;
    let nb = unsafe { NodeRef::from_pyobject(b.as_ptr()) }?;
    Ok(matches!((na, nb), (Some(x), Some(y)) if x.as_ptr() == y.as_ptr()))
}

/// Whether the type of every item of the list `values` is one of `types` (exactly: not a
/// subclass of one), e.g. saved values Dynamo can fake. The check in Python takes ~20 ns
/// per item, on every call, for hundreds of saved values.
#[pyfunction]
fn only_types(values: &Bound<'_, PyList>, types: &Bound<'_, PyTuple>) -> bool {
    values.iter().all(|v| {
        let t = v.get_type();
        types.iter().any(|allowed| allowed.is(&t))
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // tch's THPVariable_Wrap needs torch's Python types initialised.
    m.py().import("torch")?;
    m.add_class::<PyPlan>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(same_node, m)?)?;
    m.add_function(wrap_pyfunction!(only_types, m)?)?;
    m.add_function(wrap_pyfunction!(plan_engine_call, m)?)?;
    m.add_function(wrap_pyfunction!(plan_backward, m)?)?;
    m.add_class::<CppWarnings>()?;
    m.add_function(wrap_pyfunction!(engine_hook_install, m)?)?;
    m.add_function(wrap_pyfunction!(engine_hook_uninstall, m)?)?;
    m.add_function(wrap_pyfunction!(engine_set_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(defer_unpack_hooks, m)?)?;
    // SAFETY: GIL held; the shim returns a new reference.
    let buffer_sum = unsafe { Bound::from_owned_ptr(m.py(), ffi::buffer_sum_function()?) };
    m.add("buffer_sum", buffer_sum)?;
    m.add("TORCH_VERSION", env!("REPLAYGRAD_TORCH_VERSION"))?;
    Ok(())
}
