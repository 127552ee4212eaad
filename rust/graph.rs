//! A snapshot of the reachable autograd graph as plain data: nodes, next edges in CSR form,
//! root edges. [`Graph`] knows nothing of torch, so the planning code over it is testable
//! without an interpreter; [`snapshot`] builds one from live nodes through the shim.

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;

use crate::errors::ShimError;
use crate::ffi::{prefetch_lines, prefetch_node, NodeKind, NodeRef, RawNode, TypeName};

/// Marks an invalid edge (the engine's `!edge.is_valid()`: an input that needs no grad).
pub const NO_NODE: u32 = u32::MAX;

/// `Edge{function, input_nr}` with the function as a node index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Edge {
    pub node: u32,
    pub input_nr: u32,
}

impl Edge {
    pub const INVALID: Edge = Edge {
        node: NO_NODE,
        input_nr: 0,
    };

    pub fn new(node: u32, input_nr: u32) -> Self {
        Edge { node, input_nr }
    }

    pub fn is_valid(&self) -> bool {
        self.node != NO_NODE
    }
}

/// How many hooks of each kind the engine will call on a node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct HookCounts {
    pub tensor_pre: u32,
    pub retains_grad: u32,
    pub pre: u32,
    pub post: u32,
    pub post_acc_grad: bool,
}

impl HookCounts {
    pub fn any(&self) -> bool {
        self.tensor_pre + self.retains_grad + self.pre + self.post > 0 || self.post_acc_grad
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeData {
    pub sequence_nr: u64,
    pub kind: NodeKind,
    /// Index into [`Graph::type_names`].
    pub type_index: u32,
    pub num_inputs: u32,
    pub hooks: HookCounts,
    /// Every input is expected with the strided layout (see [`crate::ffi::NodeInfo`]).
    pub strided_inputs: bool,
}

/// The reachable graph. Node 0.. are numbered in discovery order from the roots.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub nodes: Vec<NodeData>,
    /// `edges[edge_start[n]..edge_start[n + 1]]` are node n's next edges.
    pub edge_start: Vec<u32>,
    pub edges: Vec<Edge>,
    /// The root edges, in the order the caller gave the roots.
    pub roots: Vec<Edge>,
    /// The edges to differentiate with respect to (`inputs=`), in the caller's order;
    /// invalid where the input is not reachable from the roots.
    pub outputs: Vec<Edge>,
    /// Display names of node types (`name()`), shared by nodes of the same type.
    pub type_names: Vec<String>,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn next_edges(&self, node: u32) -> &[Edge] {
        let n = node as usize;
        &self.edges[self.edge_start[n] as usize..self.edge_start[n + 1] as usize]
    }

    pub fn name(&self, node: u32) -> &str {
        &self.type_names[self.nodes[node as usize].type_index as usize]
    }

    /// Builds a graph from per-node edge lists (for tests and tools).
    pub fn from_adjacency(
        nodes: Vec<NodeData>,
        adjacency: Vec<Vec<Edge>>,
        roots: Vec<Edge>,
        type_names: Vec<String>,
    ) -> Self {
        assert_eq!(nodes.len(), adjacency.len(), "one edge list per node");
        let mut edge_start = Vec::with_capacity(nodes.len() + 1);
        let mut edges = Vec::new();
        edge_start.push(0);
        for list in adjacency {
            edges.extend(list);
            edge_start.push(edges.len() as u32);
        }
        Graph {
            nodes,
            edge_start,
            edges,
            roots,
            outputs: Vec::new(),
            type_names,
        }
    }
}

/// A hasher for pointer keys: the walk does one lookup per edge, and SipHash would dominate.
#[derive(Default)]
pub(crate) struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        // Fibonacci hashing; node addresses are 16-byte aligned, so rotate the low bits out.
        self.0 = (n as u64).rotate_right(4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type PtrMap<V> = HashMap<usize, V, BuildHasherDefault<PtrHasher>>;

/// A graph together with the live nodes it was taken from (`handles[i]` is node i) and the
/// metadata of their inputs.
pub struct Snapshot {
    pub graph: Graph,
    pub handles: Vec<NodeRef>,
    /// `input_meta[meta_start[n]..meta_start[n + 1]]`: node n's input metadata bytes (see
    /// `rg_node_describe`).
    pub input_meta: Vec<u8>,
    pub meta_start: Vec<u32>,
    /// Some node takes a nested tensor (see [`MetaRecord::is_nested`]).
    pub nested_inputs: bool,
}

impl Snapshot {
    /// The metadata (dtype, device, shape) of node `n`'s inputs, as bytes.
    pub fn input_meta(&self, n: u32) -> &[u8] {
        let n = n as usize;
        &self.input_meta[self.meta_start[n] as usize..self.meta_start[n + 1] as usize]
    }

    /// Appends the dims of the input metadata `edges` point at (what the outputs sent along
    /// them are validated against), valid edges in order. False where one has no plain
    /// shape (a nested tensor).
    pub fn edge_dims(&self, edges: &[Edge], out: &mut Vec<i64>) -> bool {
        for e in edges.iter().filter(|e| e.is_valid()) {
            let record = meta_records(self.input_meta(e.node)).nth(e.input_nr as usize);
            let Some(record) = record.filter(|r| !r.is_nested()) else {
                return false;
            };
            out.extend(
                record
                    .dims
                    .chunks_exact(8)
                    .map(|d| i64::from_ne_bytes(d.try_into().expect("chunks_exact(8) yields 8 bytes"))),
            );
        }
        true
    }
}

/// One input's metadata record in [`Snapshot::input_meta`] (see `rg_node_describe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaRecord<'a> {
    /// Six i32: dtype, device type and index, layout, rank (-1 for a nested tensor), the
    /// dtype gradients are cast to (a leaf's `grad_dtype`).
    pub head: &'a [u8],
    /// `rank` native-endian i64s; empty for a nested tensor.
    pub dims: &'a [u8],
}

impl MetaRecord<'_> {
    pub const HEAD: usize = 6 * 4;

    /// A nested tensor's metadata has no plain shape.
    pub fn is_nested(&self) -> bool {
        self.head[16..20] == (-1i32).to_ne_bytes()
    }
}

/// The records of one node's input metadata bytes, in input order (a truncated record ends
/// the sequence).
pub fn meta_records(meta: &[u8]) -> impl Iterator<Item = MetaRecord<'_>> {
    let mut rest = meta;
    std::iter::from_fn(move || {
        if rest.len() < MetaRecord::HEAD {
            return None;
        }
        let (head, tail) = rest.split_at(MetaRecord::HEAD);
        let rank = i32::from_ne_bytes([head[16], head[17], head[18], head[19]]);
        let len = usize::try_from(rank).unwrap_or(0) * 8;
        if tail.len() < len {
            return None;
        }
        let (dims, tail) = tail.split_at(len);
        rest = tail;
        Some(MetaRecord { head, dims })
    })
}

/// The sizes of a snapshot's buffers.
#[derive(Clone, Copy, Default)]
struct Sizes {
    nodes: usize,
    edges: usize,
    meta: usize,
}

thread_local! {
    /// Those of the last snapshot taken on this thread: a training loop plans graphs of one
    /// size, whose buffers are then allocated at their size, not grown (copied) to it.
    static LAST_SIZES: Cell<Sizes> = const { Cell::new(Sizes { nodes: 0, edges: 0, meta: 0 }) };
}

/// How far back [`snapshot`] looks, and so how far ahead it guesses, along a chain.
const STRIDE_NODES: usize = 3;

/// Walks the graph reachable from the root edges, breadth first (the engine's
/// compute_dependencies visits the same set), holding a strong reference to every node.
/// `outputs` are the edges of `inputs=` (None for an input without a node); they are
/// located in the walked graph, not walked from.
pub fn snapshot(roots: &[(NodeRef, u32)], outputs: &[Option<(NodeRef, u32)>]) -> Result<Snapshot, ShimError> {
    let last = LAST_SIZES.get();
    let mut graph = Graph {
        nodes: Vec::with_capacity(last.nodes),
        edge_start: Vec::with_capacity(last.nodes + 1),
        edges: Vec::with_capacity(last.edges),
        ..Graph::default()
    };
    // Nodes in discovery order, borrowed (reachable from the roots, so alive); each gets its
    // strong reference in `handles` when it is described.
    let mut discovered: Vec<NonNull<RawNode>> = Vec::with_capacity(last.nodes);
    let mut handles: Vec<NodeRef> = Vec::with_capacity(last.nodes);
    let mut index: PtrMap<u32> = PtrMap::with_capacity_and_hasher(last.nodes, Default::default());
    // Type display names: one name() call per C++ type. Python Functions all share the
    // PyNode type, so they are told apart by name() (the Function's class name).
    let mut types_by_typeid: PtrMap<u32> = PtrMap::default();
    let mut types_by_name: HashMap<String, u32> = HashMap::new();

    let mut discover = |node: NonNull<RawNode>, discovered: &mut Vec<NonNull<RawNode>>| -> u32 {
        let key = node.as_ptr() as usize;
        if let Some(&i) = index.get(&key) {
            return i;
        }
        let i = discovered.len() as u32;
        index.insert(key, i);
        // Its fields are read when it is described: load them now. (Its reference count is
        // incremented then too: an atomic increment would wait here for the load.)
        prefetch_node(node);
        discovered.push(node);
        i
    };

    for (node, input_nr) in roots {
        // SAFETY: `node` is a live reference owned by the caller.
        let ptr = unsafe { NonNull::new_unchecked(node.as_ptr()) };
        let i = discover(ptr, &mut discovered);
        graph.roots.push(Edge::new(i, *input_nr));
    }

    let mut next_nodes: Vec<Option<NonNull<RawNode>>> = Vec::new();
    let mut input_nrs: Vec<u32> = Vec::new();
    let mut input_meta: Vec<u8> = Vec::with_capacity(last.meta);
    let mut meta_start: Vec<u32> = Vec::with_capacity(last.nodes + 1);
    meta_start.push(0);
    let mut nested_inputs = false;
    graph.edge_start.push(0);
    let mut n = 0usize;
    while n < discovered.len() {
        next_nodes.clear();
        input_nrs.clear();
        if n + 1 == discovered.len() && n >= STRIDE_NODES {
            // A chain: the next node is known only once this one is described, and waiting
            // for it to load is most of a walk over a graph larger than the cache. The nodes
            // of a loop's ops are made one after another, mostly a constant stride apart:
            // load where the stride of the last ones points, STRIDE_NODES ahead (a guess;
            // where it is wrong, a useless load).
            let here = discovered[n].as_ptr() as usize;
            let back = discovered[n - STRIDE_NODES].as_ptr() as usize;
            prefetch_lines(here.wrapping_add(here.wrapping_sub(back)));
        }
        // SAFETY: the node is reachable from the roots the caller holds, so it is alive.
        handles.push(unsafe { NodeRef::from_borrowed(discovered[n]) });
        let info = handles[n].describe(&mut next_nodes, &mut input_nrs, &mut input_meta)?;
        meta_start.push(input_meta.len() as u32);
        nested_inputs |= info.nested_inputs;
        let type_index = if info.kind == NodeKind::PythonFunction {
            let name = handles[n].name()?;
            let next = graph.type_names.len() as u32;
            *types_by_name.entry(name.clone()).or_insert_with(|| {
                graph.type_names.push(name);
                next
            })
        } else {
            let key = info.type_name.address();
            match types_by_typeid.get(&key) {
                Some(&t) => t,
                None => {
                    let t = graph.type_names.len() as u32;
                    graph.type_names.push(display_name(&handles[n], info.type_name)?);
                    types_by_typeid.insert(key, t);
                    t
                }
            }
        };
        graph.nodes.push(NodeData {
            sequence_nr: info.sequence_nr,
            kind: info.kind,
            type_index,
            num_inputs: info.num_inputs,
            hooks: crate::graph::HookCounts {
                tensor_pre: info.num_tensor_pre_hooks,
                retains_grad: info.num_retains_grad_hooks,
                pre: info.num_pre_hooks,
                post: info.num_post_hooks,
                post_acc_grad: info.has_post_acc_grad_hooks,
            },
            strided_inputs: info.strided_inputs,
        });

        for (next, &input_nr) in next_nodes.iter().zip(&input_nrs) {
            let edge = match next {
                Some(ptr) => Edge::new(discover(*ptr, &mut discovered), input_nr),
                None => Edge::INVALID,
            };
            graph.edges.push(edge);
        }
        graph.edge_start.push(graph.edges.len() as u32);
        n += 1;
    }
    LAST_SIZES.set(Sizes {
        nodes: handles.len(),
        edges: graph.edges.len(),
        meta: input_meta.len(),
    });
    graph.outputs = outputs
        .iter()
        .map(|o| match o {
            Some((node, input_nr)) => match index.get(&(node.as_ptr() as usize)) {
                Some(&i) => Edge::new(i, *input_nr),
                None => Edge::INVALID,
            },
            None => Edge::INVALID,
        })
        .collect();
    Ok(Snapshot {
        graph,
        handles,
        input_meta,
        meta_start,
        nested_inputs,
    })
}

fn display_name(node: &NodeRef, type_name: TypeName) -> Result<String, ShimError> {
    let name = node.name()?;
    if name.is_empty() {
        return Ok(type_name.to_cstr().to_string_lossy().into_owned());
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(seq: u64) -> NodeData {
        NodeData {
            sequence_nr: seq,
            kind: NodeKind::Generic,
            type_index: 0,
            num_inputs: 1,
            hooks: HookCounts::default(),
            strided_inputs: true,
        }
    }

    #[test]
    fn csr_from_adjacency() {
        let g = Graph::from_adjacency(
            vec![data(2), data(1), data(0)],
            vec![
                vec![Edge::new(1, 0), Edge::INVALID],
                vec![Edge::new(2, 0)],
                vec![],
            ],
            vec![Edge::new(0, 0)],
            vec!["X".into()],
        );
        assert_eq!(g.next_edges(0), &[Edge::new(1, 0), Edge::INVALID]);
        assert_eq!(g.next_edges(1), &[Edge::new(2, 0)]);
        assert!(g.next_edges(2).is_empty());
        assert!(!g.next_edges(0)[1].is_valid());
    }

    fn record(rank: i32, dims: &[i64]) -> Vec<u8> {
        let head = [6, 0, -1, 0, rank, 6];
        let mut out: Vec<u8> = head.iter().flat_map(|v| v.to_ne_bytes()).collect();
        out.extend(dims.iter().flat_map(|v| v.to_ne_bytes()));
        out
    }

    #[test]
    fn edge_dims_read_the_records_edges_point_at() {
        // Node 1 has inputs of shapes (2, 3) and (); node 2 a nested tensor input.
        let g = Graph::from_adjacency(
            vec![data(3), data(2), data(1)],
            vec![
                vec![Edge::new(1, 0), Edge::INVALID, Edge::new(1, 1)],
                vec![],
                vec![],
            ],
            vec![Edge::new(0, 0)],
            vec!["X".into()],
        );
        let mut input_meta = record(1, &[4]);
        let node1 = input_meta.len() as u32;
        input_meta.extend(record(2, &[2, 3]));
        input_meta.extend(record(0, &[]));
        let node2 = input_meta.len() as u32;
        input_meta.extend(record(-1, &[]));
        let meta_start = vec![0, node1, node2, input_meta.len() as u32];
        let snapshot = Snapshot {
            graph: g,
            handles: Vec::new(),
            input_meta,
            meta_start,
            nested_inputs: true,
        };
        let records: Vec<_> = meta_records(snapshot.input_meta(1)).collect();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].dims.len(), 16);
        assert!(meta_records(snapshot.input_meta(2)).all(|r| r.is_nested()));

        let mut dims = vec![7];
        assert!(snapshot.edge_dims(snapshot.graph.next_edges(0), &mut dims));
        assert_eq!(dims, [7, 2, 3]);
        assert!(!snapshot.edge_dims(&[Edge::new(2, 0)], &mut dims));
        // An input the node does not have: no shape to validate against.
        assert!(!snapshot.edge_dims(&[Edge::new(1, 2)], &mut dims));
    }

    #[test]
    fn ptr_hasher_spreads_aligned_addresses() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..1000usize {
            let mut h = PtrHasher::default();
            h.write_usize(0x7f00_0000_0000 + i * 16);
            seen.insert(h.finish() >> 54);
        }
        assert!(seen.len() > 500, "top bits should vary: {}", seen.len());
    }
}
