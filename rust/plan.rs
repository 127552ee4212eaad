//! A plan: the snapshot, the engine's schedule and the saved-value layout of one backward
//! call, plus the operations a replay performs on the live graph (run a step's node with
//! given saved values, run a C++ hook, run deferred effects, release saved variables).

use std::sync::Mutex;

use pyo3::prelude::*;
use tch::Tensor;

use crate::errors::{ErrorKind, ShimError};
use crate::ffi::{self, HookKind, NodeKind, NodeRef, PlannedHooks};
use crate::graph::{snapshot, Edge, Snapshot};
use crate::layout::{layout, HookRef, Layout, StepMode};
use crate::order::{schedule, ExecInfo, Schedule};

pub struct Plan {
    pub snapshot: Snapshot,
    pub schedule: Schedule,
    pub layout: Layout,
    /// Steps whose nodes' new tensor pre-hooks were called before their planned pre-hooks
    /// (see [`Plan::call_new_tensor_pre_hooks`]).
    tensor_pre_done: Mutex<Vec<u32>>,
}

/// A value the replay hands back for a deferred effect.
#[derive(Debug)]
pub enum DeferredValue {
    /// A gradient (None: undefined).
    Tensor(Option<Tensor>),
    /// A weight's gradient as the factors of its product `a.t() @ b`, for an accumulation
    /// (see [`ffi::accumulate_product`]).
    Product(Option<Tensor>, Option<Tensor>),
}

/// Something the replay hands back for the plan to do to the live graph right after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deferred {
    /// Accumulate into the variable of this step's AccumulateGrad.
    Accumulate { step: u32 },
    /// Call the retains_grad hook (a C++ hook) watching `output` of this step's node.
    RetainGrad { step: u32, hook: u32 },
}

impl Plan {
    /// Plans the backward from root edges (the gradient edges of the root tensors), over
    /// the whole graph (`.backward()`).
    pub fn build(roots: &[(NodeRef, u32)]) -> Result<Plan, ShimError> {
        Plan::build_for(roots, None, true, true)
    }

    /// Plans a backward with respect to `outputs` (the edges of `inputs=`, None for an
    /// input without a node), accumulating into them (`backward(inputs=)`) or capturing
    /// their gradients (`autograd.grad`). `trace_functions`: see [`layout`].
    ///
    /// The schedule is the one of an engine without a compiled-autograd hook (a single
    /// root is queued directly, not through a GraphRoot), even when the call came through
    /// replaygrad's hook, whose presence makes the engine build a GraphRoot.
    pub fn build_for(
        roots: &[(NodeRef, u32)],
        outputs: Option<&[Option<(NodeRef, u32)>]>,
        accumulate_grad: bool,
        trace_functions: bool,
    ) -> Result<Plan, ShimError> {
        // Not while another thread has its values swapped into the nodes.
        let _lock = ffi::GraphsLock::acquire()?;
        let snapshot = snapshot(roots, outputs.unwrap_or(&[]))?;
        let exec = outputs.map(|_| ExecInfo::new(&snapshot.graph, accumulate_grad));
        let schedule = schedule(&snapshot.graph, exec.as_ref(), false);
        let layout = layout(&snapshot, &schedule, trace_functions)?;
        Ok(Plan {
            snapshot,
            schedule,
            layout,
            tensor_pre_done: Mutex::default(),
        })
    }

    /// Whether the call runs nothing but torch's own formulas and accumulations: no Python
    /// Function or C++ custom Function, no hook but retains_grad's, no step that runs as
    /// itself, no saved value behind saved_tensors_hooks (steps not needed by `inputs=`
    /// only take captures). No code of the user's runs during such a call, so none can tell
    /// whether the engine runs it (its current graph task, `queue_callback`, the current
    /// node).
    pub fn runs_only_formulas(&self) -> bool {
        let graph = &self.snapshot.graph;
        self.schedule.steps.iter().all(|&n| {
            matches!(
                graph.nodes[n as usize].kind,
                NodeKind::Generic | NodeKind::AccumulateGrad
            )
        }) && self.layout.steps.iter().all(|s| {
            matches!(
                s.mode,
                StepMode::Traced | StepMode::DeferredAccumulate | StepMode::Skipped
            ) && s.hooked == 0
        }) && self
            .layout
            .hooks
            .iter()
            .all(|h| h.kind == HookKind::RetainsGrad && !h.python)
    }

    /// Whether this plan is of a backward from `roots` (the same nodes and input numbers, in
    /// order).
    pub fn has_roots(&self, roots: &[(NodeRef, u32)]) -> bool {
        let graph = &self.snapshot.graph;
        graph.roots.len() == roots.len()
            && graph
                .roots
                .iter()
                .zip(roots)
                .all(|(edge, root)| self.is_edge(edge, root))
    }

    /// Whether this plan's `inputs=` edges are `outputs` (those the engine made for the same
    /// tensors, in order): the same nodes and input numbers where the plan found the edge in
    /// its graph. An edge it did not find is not reachable from the roots, whichever node the
    /// engine gave it (a fresh Identity for a leaf without an AccumulateGrad).
    pub fn has_outputs(&self, outputs: &[Option<(NodeRef, u32)>]) -> bool {
        let graph = &self.snapshot.graph;
        graph.outputs.len() == outputs.len()
            && graph.outputs.iter().zip(outputs).all(|(edge, output)| {
                !edge.is_valid() || output.as_ref().is_some_and(|output| self.is_edge(edge, output))
            })
    }

    /// Whether the plan's (valid) `edge` is the live edge `(node, input_nr)`.
    fn is_edge(&self, edge: &Edge, (node, input_nr): &(NodeRef, u32)) -> bool {
        edge.input_nr == *input_nr && self.snapshot.handles[edge.node as usize].as_ptr() == node.as_ptr()
    }

    pub fn num_steps(&self) -> usize {
        self.schedule.len()
    }

    fn check_step(&self, step: u32) -> Result<usize, ShimError> {
        let s = step as usize;
        if s >= self.schedule.len() {
            return Err(ShimError::new(
                ErrorKind::Index,
                format!(
                    "step {step} out of range for a plan of {} steps",
                    self.schedule.len()
                ),
            ));
        }
        Ok(s)
    }

    pub fn node(&self, step: u32) -> Result<&NodeRef, ShimError> {
        let s = self.check_step(step)?;
        Ok(&self.snapshot.handles[self.schedule.steps[s] as usize])
    }

    pub fn num_outputs(&self, step: u32) -> Result<u32, ShimError> {
        let s = self.check_step(step)?;
        Ok(self.snapshot.graph.next_edges(self.schedule.steps[s]).len() as u32)
    }

    pub fn hook(&self, step: u32, position: u32) -> Result<HookRef, ShimError> {
        let s = self.check_step(step)?;
        let range = &self.layout.steps[s].hooks;
        let i = range.start + position;
        if i >= range.end {
            return Err(ShimError::new(
                ErrorKind::Index,
                format!("step {step} has no hook {position}"),
            ));
        }
        Ok(self.layout.hooks[i as usize])
    }

    /// Runs the step's node on `inputs`. With `saved`, the step's saved values are replaced
    /// by these for the call; without, the node runs with its own. `live`: it runs for real
    /// (not traced: a step that runs as itself, or any step of an uncompiled replay), and
    /// its hooks the replay does not call itself (registered since the call was planned)
    /// are called around it as the engine calls them (see cpp_shim/shim.h, rg_node_apply).
    pub fn apply(
        &self,
        step: u32,
        inputs: ffi::Inputs<'_>,
        saved: Option<&[Option<Tensor>]>,
        live: bool,
    ) -> Result<Vec<Option<Tensor>>, ShimError> {
        let s = self.check_step(step)?;
        let node = self.node(step)?;
        let num_outputs = self.num_outputs(step)?;
        let (svs, values): (&[_], &[Option<Tensor>]) = match saved {
            Some(values) => {
                let range = &self.layout.steps[s].saved;
                let svs = &self.layout.svs[range.start as usize..range.end as usize];
                if svs.len() != values.len() {
                    return Err(ShimError::new(
                        ErrorKind::Value,
                        format!("step {step} has {} saved values, got {}", svs.len(), values.len()),
                    ));
                }
                (svs, values)
            }
            None => (&[], &[]),
        };
        let planned = live.then(|| self.planned_hooks(s));
        ffi::apply_node(node, num_outputs, inputs, svs, values, planned.as_ref())
    }

    /// The gradients the step's Python Function node makes of `result`, what its backward
    /// returned (see [`ffi::python_function_outputs`]).
    pub fn function_outputs(
        &self,
        step: u32,
        result: &pyo3::Bound<'_, pyo3::PyAny>,
        sizes: Option<&pyo3::Bound<'_, pyo3::PyAny>>,
    ) -> Result<Vec<Option<Tensor>>, ShimError> {
        self.check_step(step)?;
        ffi::python_function_outputs(self.node(step)?, self.num_outputs(step)?, result, sizes)
    }

    /// Runs the step's AccumulateGrad on `grad` (see [`ffi::accumulate`]).
    pub fn accumulate(&self, step: u32, grad: Option<Tensor>) -> Result<(), ShimError> {
        let s = self.check_step(step)?;
        ffi::accumulate(self.node(step)?, grad, &self.planned_hooks(s))
    }

    /// Runs the step's AccumulateGrad on the product `a.t() @ b` (see
    /// [`ffi::accumulate_product`]).
    pub fn accumulate_product(
        &self,
        step: u32,
        a: Option<Tensor>,
        b: Option<Tensor>,
    ) -> Result<(), ShimError> {
        let s = self.check_step(step)?;
        ffi::accumulate_product(self.node(step)?, a, b, &self.planned_hooks(s))
    }

    /// Whether the step's node got hooks since it was planned (registered by an earlier
    /// hook of this backward); for a skipped step, tensor pre-hooks or retains_grad hooks,
    /// all the engine calls for a node it does not run.
    pub fn has_new_hooks(&self, step: u32) -> Result<bool, ShimError> {
        let s = self.check_step(step)?;
        let skipped = self.layout.steps[s].mode == StepMode::Skipped;
        ffi::has_new_hooks(self.node(step)?, &self.planned_hooks(s), skipped)
    }

    /// The traced and skipped steps whose nodes got hooks since they were planned (see
    /// [`Plan::has_new_hooks`]): those a compiled replay does not call.
    pub fn steps_with_new_hooks(&self) -> Result<Vec<u32>, ShimError> {
        let mut out = Vec::new();
        for (s, step) in self.layout.steps.iter().enumerate() {
            let mode = step.mode;
            if (mode == StepMode::Traced || mode == StepMode::Skipped) && self.has_new_hooks(s as u32)? {
                out.push(s as u32);
            }
        }
        Ok(out)
    }

    /// Calls the tensor pre-hooks and retains_grad hooks the step's node got since it was
    /// planned on `values`, before the replay calls the step's planned pre-hooks (the
    /// engine calls all tensor pre-hooks first); the node then does not call them again.
    /// None if they were called already.
    pub fn call_new_tensor_pre_hooks(
        &self,
        step: u32,
        values: &[Option<Tensor>],
    ) -> Result<Option<Vec<Option<Tensor>>>, ShimError> {
        let s = self.check_step(step)?;
        let planned = self.planned_hooks(s);
        if planned.tensor_pre_done {
            return Ok(None);
        }
        let out = ffi::call_new_tensor_pre_hooks(self.node(step)?, &planned, values)?;
        self.done_steps().push(step);
        Ok(Some(out))
    }

    fn done_steps(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        // A panic while it was held left a list of step numbers, still valid.
        self.tensor_pre_done
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The hooks of step `s`'s node that the replay calls itself.
    fn planned_hooks(&self, s: usize) -> PlannedHooks {
        let range = &self.layout.steps[s].hooks;
        let mut planned: [Vec<u32>; 4] = Default::default();
        for hook in &self.layout.hooks[range.start as usize..range.end as usize] {
            planned[hook.kind as usize].push(hook.index);
        }
        PlannedHooks {
            planned,
            tensor_pre_done: self.done_steps().contains(&(s as u32)),
        }
    }

    /// Runs a traced step's node with its saved values and lifted sizes replaced by
    /// `saved` and `sizes` (a Python sequence of int or torch.SymInt): what a compiler
    /// tracing the replay with symbolic sizes calls.
    pub fn apply_lifted(
        &self,
        step: u32,
        inputs: &[Option<Tensor>],
        saved: &[Option<Tensor>],
        sizes: &Bound<'_, PyAny>,
    ) -> Result<Vec<Option<Tensor>>, ShimError> {
        let n_sizes = sizes
            .len()
            .map_err(|e| ShimError::new(ErrorKind::Type, e.to_string()))?;
        let s = self.check_step(step)?;
        let layout = &self.layout.steps[s];
        let expected = (layout.saved.len(), layout.sizes.len());
        if layout.sizes.is_empty() || expected != (saved.len(), n_sizes) {
            return Err(ShimError::new(
                ErrorKind::Value,
                format!(
                    "step {step} takes {} saved values and {} lifted sizes, got {} and {n_sizes}",
                    expected.0,
                    expected.1,
                    saved.len()
                ),
            ));
        }
        let node = self.node(step)?;
        ffi::apply_node_lifted(node, self.num_outputs(step)?, inputs, saved, sizes)
    }

    /// The values of the step's hooked saved variables (the last slots of its range, see
    /// [`crate::layout::StepLayout::hooked`]), unpacked now as the node would unpack them when
    /// it runs: each calls its unpack hook.
    pub fn unpack_hooked(&self, step: u32) -> Result<Vec<Option<Tensor>>, ShimError> {
        let s = self.check_step(step)?;
        let layout = &self.layout.steps[s];
        let node = self.node(step)?;
        let slots = (layout.saved.end - layout.hooked)..layout.saved.end;
        slots
            .map(|slot| {
                // SAFETY: the slot's SavedVariable belongs to this step's node.
                unsafe { ffi::unpack_saved_value(self.layout.svs[slot as usize], node) }
            })
            .collect()
    }

    /// Runs hook `position` of the step (a hook the engine would call; C++ hooks run here).
    pub fn call_hook(
        &self,
        step: u32,
        position: u32,
        values: &[Option<Tensor>],
        inputs: &[Option<Tensor>],
    ) -> Result<Vec<Option<Tensor>>, ShimError> {
        let hook = self.hook(step, position)?;
        let node = self.node(step)?;
        match hook.kind {
            HookKind::Post => ffi::call_post_hook(node, hook.index as usize, values, inputs),
            kind => ffi::call_pre_hook(node, kind, hook.index as usize, values),
        }
    }

    /// The effects a replay returns values for, in engine order.
    pub fn deferred(&self) -> Vec<Deferred> {
        let mut out = Vec::new();
        for (s, step) in self.layout.steps.iter().enumerate() {
            for position in 0..step.hooks.len() as u32 {
                let hook = self.layout.hooks[(step.hooks.start + position) as usize];
                if hook.kind == HookKind::RetainsGrad {
                    out.push(Deferred::RetainGrad {
                        step: s as u32,
                        hook: position,
                    });
                }
            }
            if step.mode == StepMode::DeferredAccumulate {
                out.push(Deferred::Accumulate { step: s as u32 });
            }
        }
        out
    }

    /// Performs the deferred effects in `range` (indices into [`Plan::deferred`]) with the
    /// values the replay returned, in that order. Values are taken out of `values` one by
    /// one so that AccumulateGrad can steal a gradient nobody else holds, as in the engine.
    pub fn run_deferred(
        &self,
        range: std::ops::Range<usize>,
        values: &mut dyn FnMut(usize) -> Result<DeferredValue, ShimError>,
    ) -> Result<(), ShimError> {
        let effects = self.deferred();
        for (i, &effect) in effects.get(range.clone()).unwrap_or(&[]).iter().enumerate() {
            let i = range.start + i;
            match (effect, values(i)?) {
                (Deferred::Accumulate { step }, DeferredValue::Tensor(value)) => {
                    self.accumulate(step, value)?
                }
                (Deferred::Accumulate { step }, DeferredValue::Product(a, b)) => {
                    self.accumulate_product(step, a, b)?
                }
                (Deferred::RetainGrad { step, hook }, DeferredValue::Tensor(value)) => {
                    let output = self.hook(step, hook)?.index as usize;
                    let s = step as usize;
                    let width =
                        self.snapshot.graph.nodes[self.schedule.steps[s] as usize].num_inputs as usize;
                    let mut list: Vec<Option<Tensor>> = (0..width).map(|_| None).collect();
                    if output < width {
                        list[output] = value;
                    }
                    self.call_hook(step, hook, &list, &[])?;
                }
                (Deferred::RetainGrad { .. }, DeferredValue::Product(..)) => {
                    return Err(ShimError::new(
                        ErrorKind::Value,
                        format!("deferred effect {i} takes a gradient, not a product's factors"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Checks that the saved values of steps `from..=to` were not modified in place since
    /// they were planned (by a hook or a node that ran outside the graph since): the node
    /// would then raise when it unpacks them, as in the engine, and so does this.
    pub fn check_saved_versions(&self, from: u32, to: u32) -> Result<(), ShimError> {
        let steps = &self.layout.steps;
        let (from, to) = (from as usize, to as usize);
        if from > to || from >= steps.len() {
            return Ok(());
        }
        let last = &steps[to.min(steps.len() - 1)];
        let slots = steps[from].saved.start as usize..last.saved.end as usize;
        let Some(slot) = self.layout.values.first_modified(slots)? else {
            return Ok(());
        };
        let step = steps.partition_point(|s| s.saved.end as usize <= slot);
        // SAFETY: the slot's SavedVariable belongs to that step's node.
        unsafe { ffi::unpack_saved_value(self.layout.svs[slot], self.node(step as u32)?) }?;
        Ok(())
    }

    /// Drops the plan's values of the saved slots `slots` (those of steps that run as
    /// themselves, with their own saved variables): the plan no longer keeps them alive.
    pub fn forget_saved(&mut self, slots: std::ops::Range<usize>) -> Result<(), ShimError> {
        self.layout.values.forget(slots)
    }

    /// Frees the saved variables of the nodes of the steps in `steps` that ran, as the
    /// engine does without retain_graph (a step popped only to capture keeps them).
    pub fn release_variables(&self, steps: std::ops::Range<usize>) -> Result<(), ShimError> {
        let ran = self.schedule.steps.iter().zip(&self.schedule.needed);
        ffi::release_variables(
            ran.skip(steps.start)
                .take(steps.len())
                .filter(|&(_, &needed)| needed)
                .map(|(&n, _)| &self.snapshot.handles[n as usize]),
        )
    }
}
