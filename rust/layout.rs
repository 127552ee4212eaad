//! What a replay needs besides the order: which steps run in the graph and which run as
//! themselves (opaque), every SavedVariable of every traced step as one flat list of slots,
//! the hooks each step calls, and the structural key of all of it.

use std::collections::HashMap;
use std::ops::Range;

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::errors::ShimError;
use crate::ffi::{Collector, HookKind, NodeKind, NodeRef, RawSavedVariable};
use crate::graph::{meta_records, Graph, Snapshot};
use crate::order::{Schedule, NO_STEP};

/// One hook the engine calls for a step, in the engine's order (call_tensor_pre_hooks:
/// tensor pre-hooks then retains_grad hooks; call_pre_hooks; call_post_hooks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HookRef {
    pub kind: HookKind,
    /// Position in the node's list; for RetainsGrad, the output it watches.
    pub index: u32,
    /// A Python hook (a dict of callables) that can be traced; otherwise a C++ hook.
    pub python: bool,
    /// For Python tensor pre-hooks: the input they see and replace.
    pub value_idx: Option<u32>,
}

/// How a step runs in the replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepMode {
    /// In the graph: the node is called with its saved values swapped for replay inputs.
    Traced,
    /// A graph break: the current graph's node runs as itself, eagerly.
    Opaque,
    /// AccumulateGrad whose gradient is handed back by the replay and accumulated right
    /// after it, by the node itself (nothing can observe the difference).
    DeferredAccumulate,
    /// AccumulateGrad run in place, eagerly, because hooks observe `.grad` around it.
    EagerAccumulate,
    /// Popped but not needed (`inputs=`): only its tensor pre-hooks run and its captures
    /// are taken (evaluate_function with `!needed_`).
    Skipped,
}

#[derive(Debug)]
pub struct StepLayout {
    pub mode: StepMode,
    /// Slots of this step's saved values in [`Layout::svs`]/[`Layout::values`].
    pub saved: Range<u32>,
    /// This step's hooks in [`Layout::hooks`].
    pub hooks: Range<u32>,
    /// This step's lifted sizes in [`Layout::sizes`] (see [`crate::ffi::VisitedNode::lifted`]).
    pub sizes: Range<u32>,
    /// The last `hooked` slots of `saved` are unpacked when the replay runs, by unpack hook
    /// `group` (numbered in order of first appearance; the steps of one checkpointed block
    /// share one), see [`crate::ffi::VisitedNode::hooked`].
    pub hooked: u32,
    pub group: u32,
}

pub struct Layout {
    pub steps: Vec<StepLayout>,
    pub hooks: Vec<HookRef>,
    /// Slot → the node's own SavedVariable (swapped during the call).
    pub svs: Vec<*const RawSavedVariable>,
    /// Slot → the value it held when planned (as a replay input; None if undefined), kept where
    /// compiled_args collected it.
    pub values: Collector,
    /// The lifted sizes of every traced step: replay inputs, not part of the key, so that a
    /// compiled replay serves every batch size (its compiler decides what to specialise).
    pub sizes: Vec<i64>,
    /// Per step: the digests its part of the key is made of.
    pub digests: Vec<StepDigest>,
    pub key: u128,
}

impl Layout {
    pub fn num_saved(&self) -> usize {
        self.svs.len()
    }
}

/// The hooks the engine calls for node `n`: all of them when it runs, only
/// call_tensor_pre_hooks' when it is popped without being needed.
fn hooks_of(
    node: &NodeRef,
    graph: &Graph,
    n: u32,
    runs: bool,
    out: &mut Vec<HookRef>,
) -> Result<(), ShimError> {
    let counts = graph.nodes[n as usize].hooks;
    for i in 0..counts.tensor_pre {
        let Some((python, value_idx)) = node.hook_kind(HookKind::TensorPre, i as usize)? else {
            continue;
        };
        out.push(HookRef {
            kind: HookKind::TensorPre,
            index: i,
            python,
            value_idx,
        });
    }
    if counts.retains_grad > 0 {
        for output in node.retains_grad_outputs(counts.retains_grad)? {
            out.push(HookRef {
                kind: HookKind::RetainsGrad,
                index: output,
                python: false,
                value_idx: None,
            });
        }
    }
    if !runs {
        return Ok(());
    }
    for i in 0..counts.pre {
        let Some((python, _)) = node.hook_kind(HookKind::Pre, i as usize)? else {
            continue;
        };
        out.push(HookRef {
            kind: HookKind::Pre,
            index: i,
            python,
            value_idx: None,
        });
    }
    for i in 0..counts.post {
        let Some((python, _)) = node.hook_kind(HookKind::Post, i as usize)? else {
            continue;
        };
        out.push(HookRef {
            kind: HookKind::Post,
            index: i,
            python,
            value_idx: None,
        });
    }
    Ok(())
}

/// Whether the gradients node `n` receives and the ones it returns are all expected strided.
/// Sparse and mkldnn gradients (a sparse leaf, `to_mkldnn()`) stay out of compiled graphs:
/// compilers trace dense tensors (inductor cannot compile sparse ones, and a node run on
/// fake tensors returns strided gradients where mkldnn ones are due).
fn strided_gradients(graph: &Graph, n: u32) -> bool {
    graph.nodes[n as usize].strided_inputs
        && graph
            .next_edges(n)
            .iter()
            .all(|e| !e.is_valid() || graph.nodes[e.node as usize].strided_inputs)
}

/// Whether the node can run inside a traced graph, before looking at its saved state;
/// `trace_functions`: see [`layout`].
fn may_trace(node: &NodeRef, kind: NodeKind, trace_functions: bool) -> Result<bool, ShimError> {
    match kind {
        NodeKind::AccumulateGrad => Ok(false),
        // CppNode<T> never reports T::is_traceable, so no C++ Function can be trusted.
        NodeKind::CppFunction => Ok(false),
        // A Python Function's backward is traced by the compiler where it says so
        // (`is_traceable = True`), otherwise by Dynamo where the replay finds that it can be
        // (see replaygrad._replay.traced_functions): its state is laid out alike.
        NodeKind::PythonFunction => Ok(trace_functions || node.is_traceable()?),
        // torch's own nodes: traced whenever compiled_args describes their state, as
        // torch's compiled autograd does. Their is_traceable() is about the TorchScript
        // tracer (false for every view's backward, e.g. TBackward0), not about running
        // them with swapped saved values.
        NodeKind::Generic => Ok(true),
    }
}

/// What the key of one step is made of, as three digests: the step's structure (node type,
/// edges, mode, hooks, captures), the metadata of its inputs (what validate_outputs checks
/// against) and its specialisation (compiled_args' non-tensor state and sizes). Kept so that
/// a new key can be explained by the steps and parts that differ.
pub type StepDigest = [u64; 3];

/// Byte buffers of one step's key parts, reused from step to step.
#[derive(Default)]
struct KeyParts {
    structure: Vec<u8>,
    metadata: Vec<u8>,
    specialization: Vec<u8>,
}

impl KeyParts {
    fn clear(&mut self) {
        self.structure.clear();
        self.metadata.clear();
        self.specialization.clear();
    }

    fn digest(&self) -> StepDigest {
        [
            xxh3_64(&self.structure),
            xxh3_64(&self.metadata),
            xxh3_64(&self.specialization),
        ]
    }
}

/// How many steps ahead `layout` asks the CPU to load a node: visiting one takes about as
/// long as a load from memory, and nodes of a large graph are not in the cache.
const PREFETCH_STEPS: usize = 3;

/// Bytes of step digests hashed in one update (see `layout`).
const DIGEST_BLOCK: usize = 4096;

fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Visits every step's node (in execution order) and lays out its saved values and hooks,
/// with the digests of everything a compiled replay specialises on and the key over them.
/// `trace_functions`: the replay may have Dynamo trace the backward of Python Functions
/// that do not say they are traceable (a compiled one), so their state is laid out;
/// otherwise they run as themselves (opaque), holding their saved values alone, which the
/// engine frees when they ran.
pub fn layout(snapshot: &Snapshot, schedule: &Schedule, trace_functions: bool) -> Result<Layout, ShimError> {
    let graph = &snapshot.graph;
    let mut collector = Collector::new()?;
    let mut steps = Vec::with_capacity(schedule.len());
    let mut digests = Vec::with_capacity(schedule.len());
    let mut hooks = Vec::new();
    let mut hasher = Xxh3::new();
    hasher.update(b"replaygrad-plan-v2");
    hash_u32(&mut hasher, graph.roots.len() as u32);
    for root in &graph.roots {
        hash_u32(&mut hasher, schedule.step_of[root.node as usize]);
        hash_u32(&mut hasher, root.input_nr);
    }
    hash_u32(&mut hasher, graph.outputs.len() as u32);

    let mut parts = KeyParts::default();
    // The steps' digests are hashed in blocks: a stateful update per digest costs more.
    let mut digest_bytes = Vec::with_capacity(DIGEST_BLOCK + std::mem::size_of::<StepDigest>());
    let mut num_saved = 0u32;
    let mut sizes = Vec::new();
    // Unpack hook (its address) -> group number, in order of first appearance.
    let mut groups: HashMap<usize, u32> = HashMap::new();
    for (s, &n) in schedule.steps.iter().enumerate() {
        if let Some(&ahead) = schedule.steps.get(s + PREFETCH_STEPS) {
            snapshot.handles[ahead as usize].prefetch();
        }
        let node = &snapshot.handles[n as usize];
        let data = &graph.nodes[n as usize];
        let runs = schedule.needed[s];
        let hook_start = hooks.len() as u32;
        if data.hooks.any() {
            hooks_of(node, graph, n, runs, &mut hooks)?;
        }
        let step_hooks = &hooks[hook_start as usize..];
        let has_python_post = step_hooks.iter().any(|h| h.kind == HookKind::Post);
        let has_cpp_hook = step_hooks.iter().any(|h| !h.python);

        parts.clear();
        let st = &mut parts.structure;
        st.extend_from_slice(graph.name(n).as_bytes());
        st.extend_from_slice(&[0, data.kind as u8]);
        put_u32(st, data.num_inputs);
        let edges = graph.next_edges(n);
        put_u32(st, edges.len() as u32);
        for e in edges {
            put_u32(
                st,
                if e.is_valid() {
                    schedule.step_of[e.node as usize]
                } else {
                    NO_STEP
                },
            );
            put_u32(st, e.input_nr);
        }
        for c in schedule.step_captures(s as u32) {
            put_u32(st, c.input_nr);
            put_u32(st, c.output_idx);
        }
        for h in step_hooks {
            st.extend_from_slice(&[h.kind as u8, h.python as u8]);
            put_u32(st, h.index);
            put_u32(st, h.value_idx.unwrap_or(u32::MAX));
        }
        // Shapes are not part of the key: the gradients validated against them come from
        // replay inputs (whose shapes the compiler guards on) or from sizes that are (see
        // below).
        without_dims(snapshot.input_meta(n), &mut parts.metadata);

        let mut mode = if !runs {
            StepMode::Skipped
        } else if data.kind == NodeKind::AccumulateGrad {
            // Post hooks and post-accumulate-grad hooks read `.grad` right after this
            // node; a C++ hook may do anything. Then accumulate in place, as the engine.
            if has_python_post || has_cpp_hook || data.hooks.post_acc_grad {
                StepMode::EagerAccumulate
            } else {
                StepMode::DeferredAccumulate
            }
        } else if strided_gradients(graph, n) && may_trace(node, data.kind, trace_functions)? {
            StepMode::Traced
        } else {
            StepMode::Opaque
        };

        let saved_start = num_saved;
        let sizes_start = sizes.len() as u32;
        let (mut hooked, mut group) = (0u32, u32::MAX);
        if mode == StepMode::Traced {
            let visited = collector.visit(node)?;
            if visited.supported {
                num_saved += visited.num_saved as u32;
                if visited.hooked > 0 {
                    hooked = visited.hooked as u32;
                    let next = groups.len() as u32;
                    group = *groups.entry(visited.group).or_insert(next);
                }
                let sp = &mut parts.specialization;
                put_u32(sp, visited.num_saved as u32);
                put_u32(sp, visited.key.len() as u32);
                sp.extend_from_slice(visited.key);
                // A lifted node's sizes: the shapes its outputs are validated against, then
                // its own (the order rg_node_apply_lifted takes them in).
                let lifted = visited.lifted && snapshot.edge_dims(edges, &mut sizes);
                put_u32(sp, visited.sizes.len() as u32);
                sp.push(lifted as u8);
                if lifted {
                    sizes.extend_from_slice(visited.sizes);
                } else if data.kind == NodeKind::PythonFunction
                    // (Without trace_functions, a traced one is traceable: may_trace asked.)
                    && trace_functions
                    && !node.is_traceable()?
                    && snapshot.edge_dims(edges, &mut sizes)
                {
                    // A Python Function that does not say it is traceable runs as itself,
                    // or Dynamo traces its backward, guarding on the shapes it reads (see
                    // replaygrad._replay.traced_functions): the key keeps no size, as an
                    // opaque node's does not. Its outputs are validated against the lifted
                    // shapes of the inputs its edges point at.
                } else {
                    sizes.truncate(sizes_start as usize);
                    // Traced with the sizes it keeps, and its outputs validated against the
                    // shapes of the inputs its edges point at: the key specialises on both.
                    for v in visited.sizes {
                        sp.extend_from_slice(&v.to_le_bytes());
                    }
                    for e in edges.iter().filter(|e| e.is_valid()) {
                        sp.extend_from_slice(snapshot.input_meta(e.node));
                    }
                }
            } else {
                // compiled_args not implemented (e.g. a third-party Node subclass): its
                // saved state is unknown, so it can only run as itself.
                mode = StepMode::Opaque;
            }
        }
        parts.structure.push(mode as u8);
        put_u32(&mut parts.structure, hooked);
        put_u32(&mut parts.structure, group);
        let digest = parts.digest();
        for d in digest {
            digest_bytes.extend_from_slice(&d.to_le_bytes());
        }
        if digest_bytes.len() >= DIGEST_BLOCK {
            hasher.update(&digest_bytes);
            digest_bytes.clear();
        }
        digests.push(digest);
        steps.push(StepLayout {
            mode,
            saved: saved_start..num_saved,
            hooks: hook_start..hooks.len() as u32,
            sizes: sizes_start..sizes.len() as u32,
            hooked,
            group,
        });
    }
    hasher.update(&digest_bytes);
    collector.end_visits();
    let svs = collector.saved_variables()?;
    debug_assert_eq!(svs.len(), num_saved as usize);
    Ok(Layout {
        steps,
        hooks,
        svs,
        values: collector,
        sizes,
        digests,
        key: hasher.digest128(),
    })
}

/// Input metadata records (see [`meta_records`]) without their dims.
fn without_dims(meta: &[u8], out: &mut Vec<u8>) {
    for record in meta_records(meta) {
        out.extend_from_slice(record.head);
    }
}

fn hash_u32(h: &mut Xxh3, v: u32) {
    h.update(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::without_dims;

    fn record(head: [i32; 6], dims: &[i64]) -> Vec<u8> {
        let mut out: Vec<u8> = head.iter().flat_map(|v| v.to_ne_bytes()).collect();
        out.extend(dims.iter().flat_map(|v| v.to_ne_bytes()));
        out
    }

    #[test]
    fn without_dims_keeps_every_record_head_and_drops_the_dims() {
        let a = record([6, 0, -1, 0, 2, -1], &[64, 8]);
        let b = record([7, 0, -1, 0, 0, -1], &[]);
        let c = record([6, 0, -1, 0, 1, -1], &[3]);
        let mut meta = a.clone();
        meta.extend(&b);
        meta.extend(&c);
        let mut out = Vec::new();
        without_dims(&meta, &mut out);
        let mut expected = a[..24].to_vec();
        expected.extend(&b);
        expected.extend(&c[..24]);
        assert_eq!(out, expected);

        // The same records with other dims give the same bytes; another rank does not.
        let mut other = record([6, 0, -1, 0, 2, -1], &[5, 8]);
        other.extend(&b);
        other.extend(record([6, 0, -1, 0, 1, -1], &[9]));
        let mut out2 = Vec::new();
        without_dims(&other, &mut out2);
        assert_eq!(out, out2);
        let mut out3 = Vec::new();
        without_dims(&record([6, 0, -1, 0, 1, -1], &[64]), &mut out3);
        assert_ne!(out3, out[..24].to_vec());
    }
}
