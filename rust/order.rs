//! The engine's execution order, computed rather than observed: dependency counts over the
//! reachable graph, then the ready queue by `sequence_nr` (engine.cpp: compute_dependencies,
//! evaluate_function, ReadyQueue/CompareNodeTaskTime), with the exact tie-breaking of
//! libstdc++'s `std::priority_queue`. It also records, for every input buffer slot, which
//! gradients arrive there and in which order: the engine sums them in that order.

use crate::graph::{Edge, Graph};

/// Marks "not executed" in [`Schedule::step_of`] and the graph root in [`Source::step`].
pub const NO_STEP: u32 = u32::MAX;

/// Where a gradient comes from: output `index` of step `step`, or root gradient `index`
/// when `step == NO_STEP` (the engine's GraphRoot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Source {
    pub step: u32,
    pub index: u32,
}

impl Source {
    pub fn root(index: u32) -> Self {
        Source { step: NO_STEP, index }
    }

    pub fn output(step: u32, index: u32) -> Self {
        Source { step, index }
    }

    pub fn is_root(&self) -> bool {
        self.step == NO_STEP
    }
}

/// The engine's run of a graph: which nodes run, in which order, fed by what.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Node index of each step, in execution order. A step is a node the engine pops from
    /// its ready queue; with `inputs=` some are popped only to capture or to run their
    /// tensor pre-hooks (`needed[s]` false).
    pub steps: Vec<u32>,
    /// Step of each node, NO_STEP for nodes that are never popped.
    pub step_of: Vec<u32>,
    /// Whether the step's node runs (exec_info's `needed_`; always true without inputs=).
    pub needed: Vec<bool>,
    /// Step s's input slots (one per node input) are `slot_start[s]..slot_start[s + 1]`.
    pub slot_start: Vec<u32>,
    /// Slot k's incoming gradients are `sources[source_start[k]..source_start[k + 1]]`, in
    /// arrival order (the order InputBuffer::add accumulates them).
    pub source_start: Vec<u32>,
    pub sources: Vec<Source>,
    /// Step s captures `captures[capture_start[s]..capture_start[s + 1]]`.
    pub capture_start: Vec<u32>,
    pub captures: Vec<Capture>,
}

/// `ExecInfo::Capture`: input `input_nr` of the step's node is returned as result
/// `output_idx` of autograd.grad.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Capture {
    pub input_nr: u32,
    pub output_idx: u32,
}

impl Schedule {
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// The sources of input `input_nr` of step `step`.
    pub fn slot_sources(&self, step: u32, input_nr: u32) -> &[Source] {
        let k = (self.slot_start[step as usize] + input_nr) as usize;
        &self.sources[self.source_start[k] as usize..self.source_start[k + 1] as usize]
    }

    pub fn num_slots(&self, step: u32) -> u32 {
        self.slot_start[step as usize + 1] - self.slot_start[step as usize]
    }

    pub fn step_captures(&self, step: u32) -> &[Capture] {
        let s = step as usize;
        &self.captures[self.capture_start[s] as usize..self.capture_start[s + 1] as usize]
    }
}

/// The engine's exec_info for `inputs=` (GraphTask::init_to_execute): which nodes are
/// needed (have a path to an output) and which inputs are captured.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecInfo {
    pub needed: Vec<bool>,
    /// Per node, (input_nr, output_idx) captures.
    pub captures: Vec<Vec<Capture>>,
}

impl ExecInfo {
    fn should_execute(&self, node: u32) -> bool {
        self.needed[node as usize] || !self.captures[node as usize].is_empty()
    }

    /// init_to_execute over `graph.outputs`: with accumulate_grad (backward(inputs=)) the
    /// output nodes are needed; otherwise (autograd.grad) their inputs are captured. A node
    /// is needed when one of its next nodes should execute.
    pub fn new(graph: &Graph, accumulate_grad: bool) -> Self {
        let n = graph.len();
        let mut info = ExecInfo {
            needed: vec![false; n],
            captures: vec![Vec::new(); n],
        };
        let mut queue: Vec<u32> = Vec::new();
        for (i, out) in graph.outputs.iter().enumerate() {
            if !out.is_valid() {
                continue;
            }
            if accumulate_grad {
                info.needed[out.node as usize] = true;
            } else {
                info.captures[out.node as usize].push(Capture {
                    input_nr: out.input_nr,
                    output_idx: i as u32,
                });
            }
            queue.push(out.node);
        }
        // Reverse edges, to walk from the outputs to the nodes that lead to them.
        let mut parent_start = vec![0u32; n + 1];
        for e in graph.edges.iter().filter(|e| e.is_valid()) {
            parent_start[e.node as usize + 1] += 1;
        }
        for i in 0..n {
            parent_start[i + 1] += parent_start[i];
        }
        let mut fill = parent_start.clone();
        let mut parents = vec![0u32; parent_start[n] as usize];
        for node in 0..n as u32 {
            for e in graph.next_edges(node).iter().filter(|e| e.is_valid()) {
                parents[fill[e.node as usize] as usize] = node;
                fill[e.node as usize] += 1;
            }
        }
        let mut queued = vec![false; n];
        for &q in &queue {
            queued[q as usize] = true;
        }
        while let Some(node) = queue.pop() {
            let range = parent_start[node as usize] as usize..parent_start[node as usize + 1] as usize;
            for &p in &parents[range] {
                info.needed[p as usize] = true;
                if !queued[p as usize] {
                    queued[p as usize] = true;
                    queue.push(p);
                }
            }
        }
        info
    }
}

/// `std::priority_queue<T, std::vector<T>, Less>` as libstdc++ implements it (push_heap,
/// pop_heap/__adjust_heap), so that equal priorities pop in the same order as in the engine.
/// Entries are (priority, value); the largest priority is on top.
#[derive(Default)]
pub struct StdPriorityQueue {
    heap: Vec<(u64, u32)>,
}

impl StdPriorityQueue {
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    // comp(a, b) of CompareNodeTaskTime: a runs after b.
    fn less(a: &(u64, u32), b: &(u64, u32)) -> bool {
        a.0 < b.0
    }

    /// std::__push_heap: sift `value` up from `hole` towards `top`.
    fn sift_up(&mut self, mut hole: usize, top: usize, value: (u64, u32)) {
        while hole > top {
            let parent = (hole - 1) / 2;
            if !Self::less(&self.heap[parent], &value) {
                break;
            }
            self.heap[hole] = self.heap[parent];
            hole = parent;
        }
        self.heap[hole] = value;
    }

    pub fn push(&mut self, priority: u64, value: u32) {
        self.heap.push((priority, value));
        let last = self.heap.len() - 1;
        let item = self.heap[last];
        self.sift_up(last, 0, item);
    }

    pub fn pop(&mut self) -> Option<u32> {
        let len = self.heap.len();
        if len == 0 {
            return None;
        }
        let top = self.heap[0];
        if len > 1 {
            // std::__pop_heap: move the last element out, put top in its place, and
            // __adjust_heap the moved element from the root over the first len-1 entries.
            let value = self.heap[len - 1];
            self.heap[len - 1] = top;
            self.adjust_heap(len - 1, value);
        }
        self.heap.pop();
        Some(top.1)
    }

    /// std::__adjust_heap(first, 0, len, value): move the hole down to a leaf along the
    /// larger children (the right one on ties), then sift `value` up from there.
    fn adjust_heap(&mut self, len: usize, value: (u64, u32)) {
        let mut hole = 0usize;
        let mut child = 0usize;
        while child < (len - 1) / 2 {
            child = 2 * (child + 1);
            if Self::less(&self.heap[child], &self.heap[child - 1]) {
                child -= 1;
            }
            self.heap[hole] = self.heap[child];
            hole = child;
        }
        if len & 1 == 0 && child == (len - 2) / 2 {
            child = 2 * (child + 1);
            self.heap[hole] = self.heap[child - 1];
            hole = child - 1;
        }
        self.sift_up(hole, 0, value);
    }
}

/// Simulates the engine on `graph` from its roots (Engine::execute, evaluate_function).
/// Roots hang off a GraphRoot node, which runs only if needed. Without a compiled-autograd
/// hook installed (`graph_root` false) the engine skips that dummy node for a single root and
/// queues the root directly, whatever exec_info says.
pub fn schedule(graph: &Graph, exec: Option<&ExecInfo>, graph_root: bool) -> Schedule {
    let n = graph.len();
    let should_execute = |node: u32| exec.is_none_or(|e| e.should_execute(node));
    // compute_dependencies: one count per valid edge into a node, root edges included.
    let mut dependencies = vec![0u32; n];
    for e in graph.roots.iter().chain(graph.edges.iter()) {
        if e.is_valid() {
            dependencies[e.node as usize] += 1;
        }
    }

    let mut steps: Vec<u32> = Vec::with_capacity(n);
    let mut needed: Vec<bool> = Vec::with_capacity(n);
    let mut step_of = vec![NO_STEP; n];
    // (target node, input_nr, source) in arrival order.
    let mut arrivals: Vec<(u32, u32, Source)> = Vec::with_capacity(graph.edges.len() + graph.roots.len());
    let mut ready = StdPriorityQueue::default();

    // evaluate_function's loop over outputs: every edge counts down its target; only
    // targets that should execute get a buffer and are queued when ready.
    let mut deliver = |edges: &[Edge],
                       from: Source,
                       ready: &mut StdPriorityQueue,
                       arrivals: &mut Vec<(u32, u32, Source)>,
                       single_root: bool| {
        for (i, e) in edges.iter().enumerate() {
            if !e.is_valid() {
                continue;
            }
            let source = Source {
                step: from.step,
                index: i as u32,
            };
            let d = &mut dependencies[e.node as usize];
            *d -= 1;
            if single_root || should_execute(e.node) {
                arrivals.push((e.node, e.input_nr, source));
                if *d == 0 {
                    ready.push(graph.nodes[e.node as usize].sequence_nr, e.node);
                }
            }
        }
    };

    if graph.roots.len() == 1 && !graph_root {
        deliver(&graph.roots, Source::root(0), &mut ready, &mut arrivals, true);
    } else if exec.is_none() || graph.roots.iter().any(|r| r.is_valid() && should_execute(r.node)) {
        // GraphRoot runs only if needed, like any node.
        deliver(&graph.roots, Source::root(0), &mut ready, &mut arrivals, false);
    }
    while let Some(node) = ready.pop() {
        let step = steps.len() as u32;
        steps.push(node);
        step_of[node as usize] = step;
        let runs = exec.is_none_or(|e| e.needed[node as usize]);
        needed.push(runs);
        if runs {
            deliver(
                graph.next_edges(node),
                Source::output(step, 0),
                &mut ready,
                &mut arrivals,
                false,
            );
        }
    }

    // Group arrivals into per-step, per-input slots, keeping arrival order within a slot.
    let mut slot_start = Vec::with_capacity(steps.len() + 1);
    slot_start.push(0u32);
    for &node in &steps {
        let last = *slot_start.last().unwrap_or(&0);
        slot_start.push(last + graph.nodes[node as usize].num_inputs);
    }
    let num_slots = *slot_start.last().unwrap_or(&0) as usize;
    let slot_of = |node: u32, input_nr: u32| -> Option<usize> {
        let step = step_of[node as usize];
        (step != NO_STEP && input_nr < graph.nodes[node as usize].num_inputs)
            .then(|| (slot_start[step as usize] + input_nr) as usize)
    };
    let mut source_start = vec![0u32; num_slots + 1];
    for &(node, input_nr, _) in &arrivals {
        if let Some(k) = slot_of(node, input_nr) {
            source_start[k + 1] += 1;
        }
    }
    for k in 0..num_slots {
        source_start[k + 1] += source_start[k];
    }
    let mut fill = source_start.clone();
    let mut sources = vec![Source::root(0); *source_start.last().unwrap_or(&0) as usize];
    for &(node, input_nr, source) in &arrivals {
        if let Some(k) = slot_of(node, input_nr) {
            sources[fill[k] as usize] = source;
            fill[k] += 1;
        }
    }

    let mut capture_start = Vec::with_capacity(steps.len() + 1);
    let mut captures = Vec::new();
    capture_start.push(0u32);
    for &node in &steps {
        if let Some(e) = exec {
            captures.extend_from_slice(&e.captures[node as usize]);
        }
        capture_start.push(captures.len() as u32);
    }
    Schedule {
        steps,
        step_of,
        needed,
        slot_start,
        source_start,
        sources,
        capture_start,
        captures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::NodeKind;
    use crate::graph::{HookCounts, NodeData};

    const ACC: u64 = u64::MAX;

    fn node(seq: u64, num_inputs: u32) -> NodeData {
        let kind = if seq == ACC {
            NodeKind::AccumulateGrad
        } else {
            NodeKind::Generic
        };
        NodeData {
            sequence_nr: seq,
            kind,
            type_index: 0,
            num_inputs,
            hooks: HookCounts::default(),
            strided_inputs: true,
        }
    }

    fn e(node: u32, input_nr: u32) -> Edge {
        Edge::new(node, input_nr)
    }

    fn graph(nodes: Vec<NodeData>, adjacency: Vec<Vec<Edge>>, roots: Vec<Edge>) -> Graph {
        Graph::from_adjacency(nodes, adjacency, roots, vec!["N".into()])
    }

    #[test]
    fn chain_runs_in_sequence_order() {
        // loss(3) -> b(2) -> a(1) -> acc
        let g = graph(
            vec![node(3, 1), node(2, 1), node(1, 1), node(ACC, 1)],
            vec![vec![e(1, 0)], vec![e(2, 0)], vec![e(3, 0)], vec![]],
            vec![e(0, 0)],
        );
        let s = schedule(&g, None, false);
        assert_eq!(s.steps, vec![0, 1, 2, 3]);
        assert_eq!(s.slot_sources(0, 0), &[Source::root(0)]);
        assert_eq!(s.slot_sources(3, 0), &[Source::output(2, 0)]);
    }

    #[test]
    fn diamond_waits_for_both_branches_and_sums_in_arrival_order() {
        // root(10) -> sin(5), cos(7) -> shared h(2) -> acc
        let g = graph(
            vec![node(10, 1), node(5, 1), node(7, 1), node(2, 1), node(ACC, 1)],
            vec![
                vec![e(1, 0), e(2, 0)],
                vec![e(3, 0)],
                vec![e(3, 0)],
                vec![e(4, 0)],
                vec![],
            ],
            vec![e(0, 0)],
        );
        let s = schedule(&g, None, false);
        // cos (seq 7) before sin (seq 5); h only after both.
        assert_eq!(s.steps, vec![0, 2, 1, 3, 4]);
        let h = s.step_of[3];
        assert_eq!(
            s.slot_sources(h, 0),
            &[Source::output(1, 0), Source::output(2, 0)]
        );
    }

    #[test]
    fn gradients_arriving_out_of_input_order_land_in_their_slots() {
        // A node with two inputs (e.g. the two outputs of unbind) fed by two consumers that
        // run in the opposite order of input_nr.
        let g = graph(
            vec![node(10, 1), node(4, 1), node(6, 1), node(2, 2), node(ACC, 1)],
            vec![
                vec![e(1, 0), e(2, 0)],
                vec![e(3, 0)],
                vec![e(3, 1)],
                vec![e(4, 0)],
                vec![],
            ],
            vec![e(0, 0)],
        );
        let s = schedule(&g, None, false);
        let m = s.step_of[3];
        // node 2 (seq 6) runs first and feeds input 1; node 1 feeds input 0.
        assert_eq!(s.slot_sources(m, 0), &[Source::output(s.step_of[1], 0)]);
        assert_eq!(s.slot_sources(m, 1), &[Source::output(s.step_of[2], 0)]);
        assert_eq!(s.num_slots(m), 2);
    }

    #[test]
    fn accumulate_grad_runs_as_soon_as_ready() {
        // mul(5) has two leaves; add(3) is lower priority than both AccumulateGrads.
        let g = graph(
            vec![
                node(9, 1),
                node(5, 1),
                node(3, 1),
                node(ACC, 1),
                node(ACC, 1),
                node(ACC, 1),
            ],
            vec![
                vec![e(1, 0), e(2, 0)],
                vec![e(3, 0), e(4, 0)],
                vec![e(5, 0)],
                vec![],
                vec![],
                vec![],
            ],
            vec![e(0, 0)],
        );
        let s = schedule(&g, None, false);
        assert_eq!(s.steps, vec![0, 1, 3, 4, 2, 5]);
    }

    #[test]
    fn several_roots_and_a_duplicated_root() {
        // backward([a, b, a]): a's slot gets two root gradients.
        let g = graph(
            vec![node(4, 1), node(6, 1), node(ACC, 1)],
            vec![vec![e(2, 0)], vec![e(2, 0)], vec![]],
            vec![e(0, 0), e(1, 0), e(0, 0)],
        );
        let s = schedule(&g, None, false);
        assert_eq!(s.steps, vec![1, 0, 2]);
        assert_eq!(
            s.slot_sources(s.step_of[0], 0),
            &[Source::root(0), Source::root(2)]
        );
        assert_eq!(
            s.slot_sources(2, 0),
            &[Source::output(0, 0), Source::output(1, 0)]
        );
    }

    #[test]
    fn root_reachable_from_another_root_waits_for_it() {
        // loss2 = g(loss1); backward([loss1, loss2]): loss1 runs after loss2.
        let g = graph(
            vec![node(5, 1), node(8, 1), node(ACC, 1)],
            vec![vec![e(2, 0)], vec![e(0, 0)], vec![]],
            vec![e(0, 0), e(1, 0)],
        );
        let s = schedule(&g, None, false);
        assert_eq!(s.steps, vec![1, 0, 2]);
        assert_eq!(s.slot_sources(1, 0), &[Source::root(0), Source::output(0, 0)]);
    }

    #[test]
    fn invalid_edges_are_skipped() {
        let g = graph(
            vec![node(3, 1), node(ACC, 1)],
            vec![vec![Edge::INVALID, e(1, 0)], vec![]],
            vec![e(0, 0)],
        );
        let s = schedule(&g, None, false);
        assert_eq!(s.steps, vec![0, 1]);
        assert_eq!(s.slot_sources(1, 0), &[Source::output(0, 1)]);
    }

    /// Equal priorities (every AccumulateGrad has UINT64_MAX) do not pop first-in first-out
    /// in libstdc++; these sequences are traced by hand through push_heap/__adjust_heap.
    #[test]
    fn priority_queue_breaks_ties_like_libstdcxx() {
        let drain = |n: u32| {
            let mut q = StdPriorityQueue::default();
            for v in 0..n {
                q.push(7, v);
            }
            std::iter::from_fn(move || q.pop()).collect::<Vec<u32>>()
        };
        assert_eq!(drain(3), vec![0, 1, 2]);
        assert_eq!(drain(5), vec![0, 2, 4, 1, 3]);
    }

    #[test]
    fn priority_queue_pops_by_priority() {
        let mut q = StdPriorityQueue::default();
        for (i, p) in [5u64, 1, 9, 3, 7, 9, 2].iter().enumerate() {
            q.push(*p, i as u32);
        }
        let mut got = Vec::new();
        while let Some(v) = q.pop() {
            got.push(v);
        }
        let prios = [5u64, 1, 9, 3, 7, 9, 2];
        let ps: Vec<u64> = got.iter().map(|&v| prios[v as usize]).collect();
        let mut sorted = ps.clone();
        sorted.sort_by(|a, b| b.cmp(a));
        assert_eq!(ps, sorted);
    }
}
