//! The built-in policies driven step by step, and what a policy reads
//! from its context.

use std::time::Duration;

use kungfu_collectives::{OpStats, PeerStats};
use kungfu_topology::{Rank, Strategy};

use super::*;

/// One policy instance driven over 60 steps, its decisions applied
/// as an adapter would: it acts only at every 10th step, only when
/// the noise scale is off the batch in use by more than the
/// tolerance, on multiples of the cluster size, within its bounds.
#[test]
fn adaptive_batch_size_follows_the_noise_scale() {
    let mut p = AdaptiveBatchSize {
        min: 32,
        max: 4096,
        every: 10,
        tolerance: 0.1,
    };
    let mut prog = Progress {
        batch_size: 128,
        ..Progress::default()
    };
    let mut decided = Vec::new();
    for step in 1..=70 {
        let (size, noise) = match step {
            ..=25 => (4, Some(1001.0)),
            26..=35 => (4, Some(1040.0)),
            36..=45 => (4, Some(1e9)),
            46..=55 => (4, Some(20.0)),
            56..=60 => (4, Some(f64::NAN)),
            _ => (3, Some(1001.0)),
        };
        prog.step = step;
        prog.metrics.noise_scale = noise;
        let got = p.after_step(&cx(size, Strategy::Auto, &prog, &[], &[]));
        for a in &got {
            if let Action::SetBatchSize(b) = a {
                prog.batch_size = *b;
            }
        }
        if !got.is_empty() {
            decided.push((step, got));
        }
    }
    assert_eq!(
        decided,
        vec![
            // 1001 rounded to a multiple of 4
            (10, vec![Action::SetBatchSize(1000)]),
            // step 20: 1001 is within 10% of 1000; step 30: 1040 too
            (40, vec![Action::SetBatchSize(4096)]),
            (50, vec![Action::SetBatchSize(32)]),
            // step 60: no finite estimate; step 70: 3 workers
            (70, vec![Action::SetBatchSize(1002)]),
        ]
    );
    prog.metrics.noise_scale = None;
    prog.step = 80;
    assert!(p
        .after_step(&cx(3, Strategy::Auto, &prog, &[], &[]))
        .is_empty());
}

fn cx<'a>(
    size: usize,
    strategy: Strategy,
    progress: &'a Progress,
    ops: &'a [(Strategy, OpStats)],
    peers: &'a [PeerStats],
) -> Context<'a> {
    Context {
        rank: Rank(0),
        size,
        strategy,
        progress,
        ops,
        peers,
    }
}

fn stats(bytes: u64, ms: u64) -> OpStats {
    OpStats {
        ops: 1,
        bytes,
        busy: Duration::from_millis(ms),
    }
}

#[test]
fn fastest_strategy_explores_then_keeps_the_fastest() {
    let mut p = FastestStrategy::new(vec![Strategy::Ring, Strategy::Star], 10, 0.1);
    let prog = |step| Progress {
        step,
        ..Progress::default()
    };
    // window 1 on RING: 1000 B in 10 ms; STAR not measured yet
    let ops = [(Strategy::Ring, stats(1000, 10))];
    let got = p.after_step(&cx(4, Strategy::Ring, &prog(10), &ops, &[]));
    assert_eq!(got, vec![Action::SetStrategy(Strategy::Star)]);
    // not a window step
    assert!(p
        .after_step(&cx(4, Strategy::Star, &prog(11), &ops, &[]))
        .is_empty());
    // window 2 on STAR: 1000 B more in 40 ms: slower; back to RING
    let ops = [
        (Strategy::Ring, stats(1000, 10)),
        (Strategy::Star, stats(1000, 40)),
    ];
    let got = p.after_step(&cx(4, Strategy::Star, &prog(20), &ops, &[]));
    assert_eq!(got, vec![Action::SetStrategy(Strategy::Ring)]);
    // window 3 on RING as fast as before: stay
    let ops = [
        (Strategy::Ring, stats(2000, 20)),
        (Strategy::Star, stats(1000, 40)),
    ];
    assert!(p
        .after_step(&cx(4, Strategy::Ring, &prog(30), &ops, &[]))
        .is_empty());
    // window 4: RING became 10x slower (a slow link): STAR wins again
    let ops = [
        (Strategy::Ring, stats(3000, 120)),
        (Strategy::Star, stats(1000, 40)),
    ];
    let got = p.after_step(&cx(4, Strategy::Ring, &prog(40), &ops, &[]));
    assert_eq!(got, vec![Action::SetStrategy(Strategy::Star)]);
    assert_eq!(p.rates()[0].1, Some(1000.0 / 0.1));
}

#[test]
fn scale_policies_propose_resizes() {
    let mut sched = ScaleSchedule {
        at: vec![(5, 4), (9, 2)],
    };
    let at = |step| Progress {
        step,
        ..Progress::default()
    };
    assert_eq!(
        sched.after_step(&cx(2, Strategy::Auto, &at(5), &[], &[])),
        vec![Action::Resize(4)]
    );
    assert!(sched
        .after_step(&cx(4, Strategy::Auto, &at(6), &[], &[]))
        .is_empty());

    let mut p = ScaleOnPlateau::new(10, 1, 8, 0.1);
    let tp = |step, t| Progress {
        step,
        metrics: Metrics {
            throughput: Some(t),
            ..Metrics::default()
        },
        ..Progress::default()
    };
    let run = |p: &mut ScaleOnPlateau, n, step, t| {
        p.after_step(&cx(n, Strategy::Auto, &tp(step, t), &[], &[]))
    };
    assert_eq!(run(&mut p, 2, 10, 100.0), vec![Action::Resize(3)]);
    assert!(run(&mut p, 3, 15, 150.0).is_empty(), "only every 10 steps");
    assert_eq!(run(&mut p, 3, 20, 150.0), vec![Action::Resize(4)]);
    // 4 workers are barely faster than 3: back to 3, and stay
    assert_eq!(run(&mut p, 4, 30, 155.0), vec![Action::Resize(3)]);
    assert!(p.settled());
    assert!(run(&mut p, 3, 40, 150.0).is_empty());
}

#[test]
fn a_straggler_stands_out() {
    let peer = |ms: u64| PeerStats {
        ops: 10,
        frames: 10,
        bytes: 1000,
        last_frame: Duration::from_millis(ms * 10),
    };
    let prog = Progress::default();
    let peers = [PeerStats::default(), peer(1), peer(2), peer(30)];
    let c = cx(4, Strategy::Auto, &prog, &[], &peers);
    assert_eq!(c.straggler(3.0), Some(Rank(3)));
    let peers = [PeerStats::default(), peer(1), peer(2), peer(3)];
    let c = cx(4, Strategy::Auto, &prog, &[], &peers);
    assert_eq!(c.straggler(3.0), None);
}
