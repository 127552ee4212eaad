//! Graph tests: real autograd graphs built with tch, planned by the crate, and checked
//! against what the engine does with the same graph.

use replaygrad::errors::{ErrorKind, ShimError};
use replaygrad::ffi::{Inputs, NodeKind, NodeRef};
use replaygrad::layout::StepMode;
use replaygrad::plan::{DeferredValue, Plan};
use tch::{Device, Kind, Tensor};

fn leaf(values: &[f32]) -> Tensor {
    Tensor::from_slice(values).set_requires_grad(true)
}

fn plan_of(roots: &[&Tensor]) -> Plan {
    let edges: Vec<(NodeRef, u32)> = roots
        .iter()
        .map(|t| {
            NodeRef::gradient_edge(t)
                .expect("gradient_edge")
                .expect("root requires grad")
        })
        .collect();
    Plan::build(&edges).expect("plan")
}

fn names(plan: &Plan) -> Vec<String> {
    let g = &plan.snapshot.graph;
    plan.schedule
        .steps
        .iter()
        .map(|&n| g.name(n).to_owned())
        .collect()
}

const ACC: &str = "torch::autograd::AccumulateGrad";

fn allclose(a: &Tensor, b: &Tensor) -> bool {
    a.allclose(b, 1e-6, 1e-6, false)
}

/// Runs a plan's steps with the engine's routing (sum of arrivals per input, in arrival
/// order) and returns the gradient reaching each AccumulateGrad step, by step.
fn run(plan: &Plan, root_grads: Vec<Tensor>, swap_saved: bool) -> Vec<(u32, Tensor)> {
    let mut outputs: Vec<Vec<Option<Tensor>>> = Vec::new();
    let mut leaves = Vec::new();
    for s in 0..plan.num_steps() as u32 {
        let mut inputs = Vec::new();
        for k in 0..plan.schedule.num_slots(s) {
            let mut total: Option<Tensor> = None;
            for src in plan.schedule.slot_sources(s, k) {
                let g = if src.is_root() {
                    Some(root_grads[src.index as usize].shallow_clone())
                } else {
                    outputs[src.step as usize][src.index as usize]
                        .as_ref()
                        .map(|t| t.shallow_clone())
                };
                total = match (total, g) {
                    (Some(t), Some(g)) => Some(t + g),
                    (t, g) => t.or(g),
                };
            }
            inputs.push(total);
        }
        let step = &plan.layout.steps[s as usize];
        if step.mode == StepMode::DeferredAccumulate {
            leaves.push((s, inputs[0].as_ref().expect("leaf grad").shallow_clone()));
            outputs.push(Vec::new());
            continue;
        }
        let saved: Vec<Option<Tensor>> = (step.saved.start..step.saved.end)
            .map(|i| plan.layout.values.value(i as usize).expect("saved value"))
            .collect();
        let out = plan
            .apply(s, Inputs::Taken(inputs), swap_saved.then_some(&saved[..]), true)
            .expect("apply");
        outputs.push(out);
    }
    leaves
}

#[test]
fn chain_is_planned_in_engine_order_with_its_saved_values() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    let w = leaf(&[0.5, -1.0, 2.0]);
    let y = (&x * &w).sin().sum(Kind::Float);
    let plan = plan_of(&[&y]);
    assert_eq!(
        names(&plan),
        vec!["SumBackward0", "SinBackward0", "MulBackward0", ACC, ACC]
    );
    let saved: Vec<usize> = plan.layout.steps.iter().map(|s| s.saved.len()).collect();
    assert_eq!(saved, vec![0, 1, 2, 0, 0]);
    assert_eq!(plan.layout.num_saved(), 3);

    // The replay's gradients equal the engine's.
    let leaves = run(&plan, vec![Tensor::from(1.0f32)], true);
    y.backward();
    assert!(allclose(&leaves[0].1, &x.grad()) || allclose(&leaves[0].1, &w.grad()));
    let got: Vec<Tensor> = leaves.into_iter().map(|(_, g)| g).collect();
    assert!(got.iter().any(|g| allclose(g, &x.grad())));
    assert!(got.iter().any(|g| allclose(g, &w.grad())));
}

#[test]
fn swapped_saved_values_are_used_and_then_restored() {
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    let y = (&a * &b).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let mul = 1u32;
    assert_eq!(names(&plan)[mul as usize], "MulBackward0");
    let ones = Tensor::ones([2], (Kind::Float, Device::Cpu));
    // Replace both saved values by 10 and 100: the gradients must follow the replacements.
    let ten = Tensor::full([2], 10.0, (Kind::Float, Device::Cpu));
    let hundred = Tensor::full([2], 100.0, (Kind::Float, Device::Cpu));
    let out = plan
        .apply(
            mul,
            Inputs::Lent(&[Some(ones.shallow_clone())]),
            Some(&[Some(ten.shallow_clone()), Some(hundred.shallow_clone())]),
            false,
        )
        .unwrap();
    let grads: Vec<Tensor> = out.into_iter().map(|g| g.unwrap()).collect();
    let mut seen: Vec<f64> = grads.iter().map(|g| g.double_value(&[0])).collect();
    seen.sort_by(f64::total_cmp);
    assert_eq!(seen, vec![10.0, 100.0]);
    // The node's own saved values are back: an ordinary backward is still right.
    y.backward();
    assert!(allclose(&a.grad(), &b.detach()));
    assert!(allclose(&b.grad(), &a.detach()));
}

#[test]
fn diamond_sums_both_branches_before_the_shared_node() {
    let x = leaf(&[0.3, -0.7]);
    let h = &x * 2.0;
    let y = (h.sin() + h.cos()).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let order = names(&plan);
    // `x * 2.0` is mul.Scalar: MulBackward1.
    assert_eq!(
        order,
        vec![
            "SumBackward0",
            "AddBackward0",
            "CosBackward0",
            "SinBackward0",
            "MulBackward1",
            ACC
        ]
    );
    let mul = 4u32;
    assert_eq!(plan.schedule.slot_sources(mul, 0).len(), 2);
    let leaves = run(&plan, vec![Tensor::from(1.0f32)], true);
    y.backward();
    assert!(allclose(&leaves[0].1, &x.grad()));
}

#[test]
fn node_with_several_inputs_gets_each_gradient_in_its_slot() {
    let x = leaf(&[1.0, 2.0, 3.0, 4.0]);
    let parts = (&x * 3.0).unbind(0);
    // Consumers of unbind's outputs, created in the opposite order of the outputs.
    let y = parts[3].exp() * 2.0 + parts[1].sin() + &parts[0] * 5.0;
    let y = y.sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let unbind = names(&plan).iter().position(|n| n == "UnbindBackward0").unwrap() as u32;
    assert_eq!(plan.schedule.num_slots(unbind), 4);
    assert!(
        plan.schedule.slot_sources(unbind, 2).is_empty(),
        "output 2 is unused"
    );
    let leaves = run(&plan, vec![Tensor::from(1.0f32)], true);
    y.backward();
    assert!(allclose(&leaves[0].1, &x.grad()));
}

#[test]
fn list_valued_saved_values_are_laid_out() {
    // IndexBackward0 keeps a vector<SavedVariable> of index tensors.
    let x = leaf(&[1.0, 2.0, 3.0, 4.0]);
    let idx = Tensor::from_slice(&[0i64, 2, 2]);
    let y = x.index(&[Some(idx)]).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let index = names(&plan).iter().position(|n| n == "IndexBackward0").unwrap();
    assert_eq!(plan.layout.steps[index].saved.len(), 1);
    let leaves = run(&plan, vec![Tensor::from(1.0f32)], true);
    y.backward();
    assert!(allclose(&leaves[0].1, &x.grad()));
    assert_eq!(x.grad().double_value(&[2]), 2.0);
}

#[test]
fn several_roots_and_a_repeated_root() {
    let x = leaf(&[1.0, -1.0]);
    let a = (&x * &x).sum(Kind::Float);
    let b = x.exp().sum(Kind::Float);
    let plan = plan_of(&[&a, &b, &a]);
    assert_eq!(plan.snapshot.graph.roots.len(), 3);
    let a_step = plan.schedule.step_of[plan.snapshot.graph.roots[0].node as usize];
    assert_eq!(
        plan.schedule.slot_sources(a_step, 0).len(),
        2,
        "a is a root twice"
    );
    let ones = || Tensor::from(1.0f32);
    let leaves = run(&plan, vec![ones(), ones(), ones()], true);
    let expected = &x * 4.0 + x.exp();
    assert!(allclose(&leaves[0].1, &expected.detach()));
}

#[test]
fn accumulate_grads_of_one_node_are_ordered_like_the_engine() {
    // Five leaves feed one node: their AccumulateGrads become ready together and tie on
    // sequence_nr; libstdc++'s heap pops them 0, 2, 4, 1, 3.
    let leaves: Vec<Tensor> = (0..5).map(|i| leaf(&[i as f32])).collect();
    let y = Tensor::stack(&leaves, 0).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let order: Vec<u32> = plan.schedule.steps.clone();
    assert_eq!(names(&plan)[..2], ["SumBackward0", "StackBackward0"]);
    let stack_node = plan.schedule.steps[1];
    let targets: Vec<u32> = plan
        .snapshot
        .graph
        .next_edges(stack_node)
        .iter()
        .map(|e| e.node)
        .collect();
    let popped: Vec<usize> = order[2..]
        .iter()
        .map(|n| targets.iter().position(|t| t == n).unwrap())
        .collect();
    assert_eq!(popped, vec![0, 2, 4, 1, 3]);
}

#[test]
fn node_kinds_and_modes() {
    let x = leaf(&[1.0]);
    let y = (&x * 2.0).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let kinds: Vec<NodeKind> = plan
        .schedule
        .steps
        .iter()
        .map(|&n| plan.snapshot.graph.nodes[n as usize].kind)
        .collect();
    assert_eq!(
        kinds,
        vec![NodeKind::Generic, NodeKind::Generic, NodeKind::AccumulateGrad]
    );
    let modes: Vec<StepMode> = plan.layout.steps.iter().map(|s| s.mode).collect();
    assert_eq!(
        modes,
        vec![StepMode::Traced, StepMode::Traced, StepMode::DeferredAccumulate]
    );
}

#[test]
fn the_key_is_structural() {
    let key = |scale: f64, n: usize| {
        let x = Tensor::ones([n as i64], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = (x.addcmul(&x, &x) * scale).sum(Kind::Float);
        plan_of(&[&y]).layout.key
    };
    // Fresh graphs of the same structure share a key ...
    assert_eq!(key(2.0, 3), key(2.0, 3));
    // ... a different scalar does not; a different size does (sizes are lifted, see
    // sizes_of_torch_nodes_are_lifted_out_of_the_key).
    assert_ne!(key(2.0, 3), key(3.0, 3));
    assert_eq!(key(2.0, 3), key(2.0, 4));
}

#[test]
fn a_nodes_specialisation_does_not_depend_on_where_it_is() {
    // Each SinBackward0 saves a different tensor; compiled_args numbers the tensors it
    // sees, and those numbers restart at every node.
    let x = leaf(&[0.1, 0.2, 0.3]);
    let y = x.sin().sin().sin().sin().sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let sins: Vec<_> = names(&plan)
        .iter()
        .zip(&plan.layout.digests)
        .filter(|(name, _)| name.as_str() == "SinBackward0")
        .map(|(_, digest)| digest[2])
        .collect();
    assert_eq!(sins.len(), 4);
    assert!(sins.iter().all(|d| *d == sins[0]), "{sins:?}");
}

#[test]
fn released_graph_fails_like_the_engine() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.exp().sum(Kind::Float);
    let plan = plan_of(&[&y]);
    plan.release_variables(0..plan.num_steps()).unwrap();
    match plan_of_result(&y) {
        Err(ShimError::Torch { kind, message }) => {
            assert_eq!(kind, ErrorKind::Runtime);
            assert!(
                message.contains("backward through the graph a second time"),
                "{message}"
            );
        }
        other => panic!("expected the engine's error, got {:?}", other.map(|_| ())),
    }
}

fn plan_of_result(root: &Tensor) -> Result<Plan, ShimError> {
    let edge = NodeRef::gradient_edge(root)?.expect("root requires grad");
    Plan::build(&[edge])
}

#[test]
fn bad_step_numbers_are_errors_not_crashes() {
    let x = leaf(&[1.0]);
    let y = x.exp().sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let err = plan
        .apply(99, Inputs::Lent(&[]), None, true)
        .expect_err("out of range");
    assert!(matches!(
        err,
        ShimError::Torch {
            kind: ErrorKind::Index,
            ..
        }
    ));
    let err = plan
        .apply(1, Inputs::Lent(&[None]), Some(&[]), false)
        .expect_err("wrong saved count");
    assert!(matches!(
        err,
        ShimError::Torch {
            kind: ErrorKind::Value,
            ..
        }
    ));
}

#[test]
fn a_graph_just_planned_has_no_new_hooks() {
    let x = leaf(&[1.0, 2.0]);
    let y = (x.exp() * x.sin()).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    for s in 0..plan.num_steps() as u32 {
        assert!(!plan.has_new_hooks(s).expect("live hooks"), "step {s}");
    }
    assert!(plan
        .steps_with_new_hooks()
        .expect("steps with new hooks")
        .is_empty());
    assert!(plan.has_new_hooks(plan.num_steps() as u32).is_err());
}

#[test]
fn input_metadata_bytes_are_dtype_device_and_shape() {
    // y = (x * x).sum() over a 2x3 double leaf: SumBackward0's input is the 0-dim root
    // gradient, MulBackward0's the 2x3 product.
    let x = Tensor::ones([2, 3], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let y = (&x * &x).sum(Kind::Double);
    let plan = plan_of(&[&y]);
    let meta_of = |name: &str| {
        let n = (0..plan.snapshot.graph.len() as u32)
            .find(|&n| plan.snapshot.graph.name(n) == name)
            .expect("node present");
        plan.snapshot.input_meta(n).to_vec()
    };
    let head = |ndim: i32| -> Vec<u8> {
        // c10::ScalarType::Double = 7, DeviceType::CPU = 0, index -1, Layout::Strided = 0,
        // and the dtype gradients are cast to: Double.
        [7i32, 0, -1, 0, ndim, 7]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    };
    assert_eq!(meta_of("SumBackward0"), head(0));
    let mut mul = head(2);
    mul.extend(2i64.to_le_bytes());
    mul.extend(3i64.to_le_bytes());
    assert_eq!(meta_of("MulBackward0"), mul);
}

#[test]
fn nodes_with_sparse_gradients_run_opaque() {
    // ToDenseBackward0 returns the sparse gradient of a sparse leaf: it stays out of
    // compiled graphs; SumBackward0 (dense in, dense out) is traced.
    let x = Tensor::eye(3, (Kind::Float, Device::Cpu))
        .to_sparse(None, None::<&[i64]>, None)
        .set_requires_grad(true);
    let y = x.to_dense(None, false).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    let modes: Vec<(String, StepMode)> = names(&plan)
        .into_iter()
        .zip(plan.layout.steps.iter().map(|s| s.mode))
        .collect();
    assert_eq!(
        modes,
        [
            ("SumBackward0".to_owned(), StepMode::Traced),
            ("ToDenseBackward0".to_owned(), StepMode::Opaque),
            (ACC.to_owned(), StepMode::DeferredAccumulate),
        ]
    );
}

#[test]
fn saved_values_modified_in_place_after_planning_are_reported() {
    let a = leaf(&[1.0, 2.0]);
    let s = Tensor::from_slice(&[3.0f32, 4.0]);
    let y = (&a * &s).sum(Kind::Float); // MulBackward0 saves s
    let plan = plan_of(&[&y]);
    let last = plan.num_steps() as u32;
    plan.check_saved_versions(0, last).expect("nothing modified yet");
    let _ = s.shallow_clone().g_add_scalar_(1.0);
    let err = plan.check_saved_versions(0, last).unwrap_err();
    match err {
        ShimError::Torch { kind, message } => {
            assert_eq!(kind, ErrorKind::Runtime);
            assert!(message.contains("modified by an inplace operation"), "{message}");
            // The message names tensors as torch's Python bindings do.
            assert!(message.contains("torch.FloatTensor"), "{message}");
        }
        other => panic!("expected a torch error, got {other:?}"),
    }
    // Steps after the one that saved it are not affected.
    plan.check_saved_versions(2, last).expect("no saved values there");
}

#[test]
fn sizes_of_torch_nodes_are_lifted_out_of_the_key() {
    // An MLP-like graph at two batch sizes: the same key, and the sizes the nodes keep
    // (mm's, sum's) and the shapes their outputs are validated against are the plan's
    // lifted sizes instead.
    let w = Tensor::ones([3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let planned = |batch: i64| {
        let x = Tensor::ones([batch, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = x.mm(&w).tanh().sum(Kind::Float);
        let plan = plan_of(&[&y]);
        (plan.layout.key, plan.layout.sizes.clone(), names(&plan))
    };
    let (key4, sizes4, order) = planned(4);
    let (key7, sizes7, _) = planned(7);
    assert_eq!(key4, key7, "{order:?}");
    assert_ne!(sizes4, sizes7);
    assert!(
        sizes4.contains(&4) && sizes7.contains(&7),
        "{sizes4:?} {sizes7:?}"
    );
    // Another rank is another graph.
    let x = Tensor::ones([2, 4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let y = x.matmul(&w).tanh().sum(Kind::Float);
    assert_ne!(plan_of(&[&y]).layout.key, key4);
}

#[test]
fn only_formulas_and_the_roots_a_plan_was_made_for() {
    let x = leaf(&[1.0, 2.0]);
    let a = (&x * 2.0).sin().sum(Kind::Float);
    let b = x.exp().sum(Kind::Float);
    let plan = plan_of(&[&a, &b]);
    assert!(
        plan.runs_only_formulas(),
        "torch's formulas and an AccumulateGrad"
    );
    let edge = |t: &Tensor| NodeRef::gradient_edge(t).unwrap().unwrap();
    assert!(plan.has_roots(&[edge(&a), edge(&b)]));
    assert!(!plan.has_roots(&[edge(&b), edge(&a)]), "another order");
    assert!(!plan.has_roots(&[edge(&a)]), "fewer roots");

    // A step that runs as itself (a sparse gradient) is none of torch's formulas traced.
    let s = Tensor::eye(2, (Kind::Float, Device::Cpu))
        .to_sparse(None, None::<&[i64]>, None)
        .set_requires_grad(true);
    let y = s.to_dense(None, false).sum(Kind::Float);
    assert!(!plan_of(&[&y]).runs_only_formulas());

    // A grad with respect to x only: the AccumulateGrad of w is popped, not needed.
    let w = leaf(&[3.0, 4.0]);
    let z = (&x * &w).sum(Kind::Float);
    let input = NodeRef::input_edge(&x).unwrap();
    let plan = Plan::build_for(&[edge(&z)], Some(&[input]), false, true).expect("plan");
    assert!(plan.layout.steps.iter().any(|s| s.mode == StepMode::Skipped));
    assert!(plan.runs_only_formulas(), "steps not needed run nothing");
    let w_edge = NodeRef::input_edge(&w).unwrap();
    assert!(plan.has_outputs(&[NodeRef::input_edge(&x).unwrap()]));
    assert!(!plan.has_outputs(&[w_edge]), "another input");
    assert!(!plan.has_outputs(&[]), "fewer inputs");
}

#[test]
fn the_graphs_lock_is_recursive_and_keeps_other_threads_from_planning() {
    use replaygrad::ffi::GraphsLock;
    use std::sync::mpsc;
    use std::time::Duration;

    let outer = GraphsLock::acquire().expect("lock");
    // Planning on the thread that holds it takes it again.
    let x = leaf(&[1.0, 2.0]);
    let y = x.sin().sum(Kind::Float);
    assert_eq!(names(&plan_of(&[&y])), ["SumBackward0", "SinBackward0", ACC]);

    let (done, planned) = mpsc::channel();
    let other = std::thread::spawn(move || {
        let x = leaf(&[1.0, 2.0]);
        let y = x.exp().sum(Kind::Float);
        let steps = plan_of(&[&y]).num_steps();
        done.send(steps).expect("send");
    });
    assert!(
        planned.recv_timeout(Duration::from_millis(300)).is_err(),
        "another thread planned while this one held the lock"
    );
    drop(outer);
    assert_eq!(planned.recv_timeout(Duration::from_secs(30)), Ok(3));
    other.join().expect("join");
}

#[test]
fn a_product_is_accumulated_in_place_into_an_existing_grad() {
    // x @ w.t() with w a leaf: w's gradient reaches its AccumulateGrad through TBackward0.
    let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])
        .view([2, 3])
        .set_requires_grad(true);
    let x = Tensor::from_slice(&[1.0f32, 0.5, -1.0, 2.0, 0.0, 1.0]).view([2, 3]);
    let y = x.mm(&w.tr()).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    assert_eq!(plan.deferred().len(), 1, "w's accumulation only");
    let g = Tensor::from_slice(&[1.0f32, 2.0, -1.0, 0.5]).view([2, 2]);
    let product = g.tr().mm(&x);
    let factors = |_| {
        Ok(DeferredValue::Product(
            Some(g.shallow_clone()),
            Some(x.shallow_clone()),
        ))
    };
    // No .grad yet: the product becomes it.
    plan.run_deferred(0..1, &mut factors.clone())
        .expect("first accumulation");
    let first = w.grad();
    assert!(allclose(&first, &product));
    // Then it is added in place: the same tensor, twice the product.
    plan.run_deferred(0..1, &mut factors.clone())
        .expect("second accumulation");
    assert_eq!(w.grad().data_ptr(), first.data_ptr());
    assert!(allclose(&w.grad(), &(&product * 2.0)));
}

#[test]
fn an_undefined_factor_is_no_gradient() {
    let w = Tensor::from_slice(&[1.0f32, 2.0])
        .view([1, 2])
        .set_requires_grad(true);
    let x = Tensor::from_slice(&[3.0f32, 4.0]).view([1, 2]);
    let y = x.mm(&w.tr()).sum(Kind::Float);
    let plan = plan_of(&[&y]);
    plan.run_deferred(0..1, &mut |_| {
        Ok(DeferredValue::Product(None, Some(x.shallow_clone())))
    })
    .expect("no gradient");
    assert!(!w.grad().defined());
}
