//! `kungfu-train`: an elastic, adaptive data-parallel training program.
//!
//! Softmax regression on a synthetic classification task (the data is
//! generated from a fixed seed, so every worker has the same), trained
//! with synchronous SGD: each worker computes the gradient of its shard of
//! the global batch, one allreduce sums them (with the loss and the
//! squared norm of the local gradient riding along), every worker applies
//! the same update. While it trains:
//!
//! - the gradient noise scale is monitored and the adaptive batch size
//!   policy proposes batch sizes from it;
//! - a schedule proposes a scale-out (one more worker), a strategy swap
//!   (RING) and a scale-in (back to the start size) at given epochs;
//! - every worker takes each agreed action at the same step; new workers
//!   are started by `kungfu-run -w` and receive the step, the strategy and
//!   the model; a removed worker is told it is detached and exits.
//!
//! The task is meant to be hard enough that a lost, duplicated or
//! misweighted update shows: ten overlapping classes, so accuracy still
//! rises over the six epochs, and every worker starts from its own random
//! parameters, so a worker that missed the model it should have received
//! disagrees with the others.
//!
//! ```text
//! kungfu-run -w -np 2 target/debug/kungfu-train [--epochs 6] [--train 8192]
//! kungfu-train --baseline [--batch-schedule STEP:BATCH,...]
//! ```
//! The baseline is the same training in one process without KungFu,
//! starting from rank 0's parameters; `--batch-schedule` replays the batch
//! sizes a distributed run agreed on (`STEP:BATCH`: from the step after
//! `STEP` on, batches of `BATCH`), so its parameters should match the
//! distributed run's up to the rounding of the sums.
//!
//! Rank 0 prints per epoch: loss, accuracy, noise scale, batch size,
//! cluster size, strategy. Every worker prints a `state` line with a
//! digest of its parameters after each synchronisation of the state, at
//! the end of each epoch and when it is detached, and at the end its
//! accuracy.

use std::time::Duration;

use anyhow::{bail, Context as _};
use kungfu::{Worker, WorkerEnv};
use kungfu_adaptation::{
    sq_norm, Action, Adapter, AdaptiveBatchSize, Context, NoiseScale, Policy, Progress,
};
use kungfu_collectives::ReduceOp;
use kungfu_topology::{fnv1a64, Strategy};
use kungfu_transport::mem::SeededRng;

const FEATURES: usize = 32;
const CLASSES: usize = 10;
const PARAMS: usize = CLASSES * FEATURES + CLASSES;
/// Spread of the class means in units of the per-sample noise: small
/// enough that the classes overlap (the best accuracy is far from 1), so
/// the model keeps improving for several epochs.
const SEPARATION: f32 = 0.32;
/// The seed of the class means (train and test share them).
const MEANS_SEED: u64 = 11;
/// The seed of rank 0's initial parameters (the baseline starts there).
const INIT_SEED: u64 = 100;

struct Args {
    epochs: u64,
    train: usize,
    test: usize,
    batch: u32,
    lr: f32,
    grow_at: u64,
    swap_at: u64,
    shrink_at: u64,
    baseline: bool,
    /// For the baseline: (step, batch size from the next step on).
    batch_schedule: Vec<(u64, u64)>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        epochs: 6,
        train: 8192,
        test: 2048,
        batch: 64,
        lr: 0.1,
        grow_at: 2,
        swap_at: 3,
        shrink_at: 4,
        baseline: false,
        batch_schedule: Vec::new(),
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--baseline" {
            a.baseline = true;
            i += 1;
            continue;
        }
        let v = args
            .get(i + 1)
            .with_context(|| format!("{flag} needs a value"))?;
        let num = || -> anyhow::Result<u64> {
            v.parse().with_context(|| format!("{flag} needs a number"))
        };
        match flag {
            "--epochs" => a.epochs = num()?,
            "--train" => a.train = num()? as usize,
            "--test" => a.test = num()? as usize,
            "--batch" => a.batch = num()? as u32,
            "--lr" => a.lr = v.parse().context("--lr needs a number")?,
            "--grow-at" => a.grow_at = num()?,
            "--swap-at" => a.swap_at = num()?,
            "--shrink-at" => a.shrink_at = num()?,
            "--batch-schedule" => a.batch_schedule = parse_schedule(v)?,
            _ => bail!("unknown option {flag:?}"),
        }
        i += 2;
    }
    if a.train == 0 || a.test == 0 || a.batch == 0 || a.epochs == 0 {
        bail!("--train, --test, --batch and --epochs must be positive");
    }
    Ok(a)
}

/// `STEP:BATCH,...` (empty: none).
fn parse_schedule(v: &str) -> anyhow::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    for item in v.split(',').filter(|s| !s.is_empty()) {
        let (s, b) = item
            .split_once(':')
            .with_context(|| format!("--batch-schedule: {item:?} is not STEP:BATCH"))?;
        let (s, b): (u64, u64) = (
            s.parse().context("--batch-schedule: bad step")?,
            b.parse().context("--batch-schedule: bad batch size")?,
        );
        if b == 0 {
            bail!("--batch-schedule: batch sizes must be positive");
        }
        out.push((s, b));
    }
    Ok(out)
}

/// Samples of a 10-class problem: Gaussian class means, unit noise.
struct Data {
    x: Vec<f32>,
    y: Vec<u8>,
}

fn gaussian(rng: &mut SeededRng) -> f32 {
    let u1 = (rng.below(1 << 30) as f64 + 1.0) / f64::from(1u32 << 30);
    let u2 = rng.below(1 << 30) as f64 / f64::from(1u32 << 30);
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

fn make_data(seed: u64, n: usize) -> Data {
    let mut means_rng = SeededRng::new(MEANS_SEED);
    let means: Vec<f32> = (0..CLASSES * FEATURES)
        .map(|_| SEPARATION * gaussian(&mut means_rng))
        .collect();
    let mut rng = SeededRng::new(seed);
    let mut x = Vec::with_capacity(n * FEATURES);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let c = rng.below(CLASSES as u64) as usize;
        for d in 0..FEATURES {
            x.push(means[c * FEATURES + d] + gaussian(&mut rng));
        }
        y.push(c as u8);
    }
    Data { x, y }
}

/// Initial parameters, small and random: each worker draws its own (from
/// `seed`), so only a working state synchronisation makes them agree.
fn init_params(seed: u64) -> Vec<f32> {
    let mut rng = SeededRng::new(seed);
    (0..PARAMS).map(|_| 0.1 * gaussian(&mut rng)).collect()
}

/// Class probabilities of sample `i` under `params`.
fn probs(params: &[f32], data: &Data, i: usize) -> [f32; CLASSES] {
    let x = &data.x[i * FEATURES..(i + 1) * FEATURES];
    let mut z = [0f32; CLASSES];
    for (c, zc) in z.iter_mut().enumerate() {
        let w = &params[c * FEATURES..(c + 1) * FEATURES];
        *zc = params[CLASSES * FEATURES + c] + w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
    }
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for zc in &mut z {
        *zc = (*zc - m).exp();
        s += *zc;
    }
    z.map(|v| v / s)
}

/// Adds the gradient of the loss summed over `samples` to `g`; returns
/// the summed loss.
fn grad_sum(
    params: &[f32],
    data: &Data,
    samples: impl Iterator<Item = usize>,
    g: &mut [f32],
) -> f32 {
    let mut loss = 0.0;
    for i in samples {
        let p = probs(params, data, i);
        let y = data.y[i] as usize;
        loss -= p[y].max(1e-12).ln();
        let x = &data.x[i * FEATURES..(i + 1) * FEATURES];
        for c in 0..CLASSES {
            let d = p[c] - f32::from(u8::from(c == y));
            for (gw, xv) in g[c * FEATURES..(c + 1) * FEATURES].iter_mut().zip(x) {
                *gw += d * xv;
            }
            g[CLASSES * FEATURES + c] += d;
        }
    }
    loss
}

/// (mean loss, accuracy) on `data`.
fn evaluate(params: &[f32], data: &Data) -> (f64, f64) {
    let (mut loss, mut right) = (0.0f64, 0usize);
    for i in 0..data.y.len() {
        let p = probs(params, data, i);
        let y = data.y[i] as usize;
        loss -= f64::from(p[y].max(1e-12)).ln();
        let best = (0..CLASSES)
            .max_by(|&a, &b| p[a].total_cmp(&p[b]))
            .expect("classes");
        right += usize::from(best == y);
    }
    let n = data.y.len() as f64;
    (loss / n, right as f64 / n)
}

/// The index of the `k`-th sample seen in training (a fixed shuffle,
/// walked round and round).
fn sample(order: &[usize], k: u64) -> usize {
    order[(k % order.len() as u64) as usize]
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = SeededRng::new(seed);
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
    v
}

fn digest(params: &[f32]) -> u64 {
    fnv1a64(0xcbf2_9ce4_8422_2325, bytemuck::cast_slice(params))
}

/// Proposes a scale-out, a strategy swap and a scale-in when training
/// enters the given epochs (the worker that proposes first wins; every
/// worker proposes the same here).
struct Schedule {
    base: u32,
    grow_at: u64,
    swap_at: u64,
    shrink_at: u64,
    last_epoch: Option<u64>,
}

impl Policy for Schedule {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        let e = cx.progress.epoch;
        // a worker that just joined starts counting here
        let Some(prev) = self.last_epoch.replace(e) else {
            return Vec::new();
        };
        if prev == e {
            return Vec::new();
        }
        let mut out = Vec::new();
        if e == self.grow_at {
            out.push(Action::Resize(self.base + 1));
        }
        if e == self.shrink_at {
            out.push(Action::Resize(self.base));
        }
        if e == self.swap_at {
            out.push(Action::SetStrategy(Strategy::Ring));
        }
        out
    }
}

/// The training state every worker shares: [samples seen, batch size,
/// epoch, base size].
type Progress4 = [u64; 4];

/// Prints this worker's view of the state (the test checks that every
/// worker alive at `step` prints the same digest).
fn print_state(w: &Worker, why: &str, step: u64, params: &[f32]) {
    println!(
        "state {why} step {step}: rank {} of {} params {:016x}",
        w.rank(),
        w.size(),
        digest(params)
    );
}

async fn train(args: Args) -> anyhow::Result<()> {
    let mut w = Worker::start(WorkerEnv::from_env()?).await?;
    let train = make_data(1, args.train);
    let test = make_data(2, args.test);
    let order = shuffled(args.train, 3);
    // A worker that joins late draws yet other parameters: it must get
    // the trained ones from sync_state.
    let seed = INIT_SEED + w.rank() as u64 + if w.is_fresh() { 1000 } else { 0 };
    let mut params = init_params(seed);
    let mut prog: Progress4 = [0, u64::from(args.batch), 0, w.size() as u64];
    let mut step = sync(&mut w, 0, &mut params, &mut prog).await?;
    print_state(&w, "synced", step, &params);
    let policies: Vec<Box<dyn Policy>> = vec![
        Box::new(AdaptiveBatchSize {
            min: 32,
            max: 1024,
            every: 10,
            tolerance: 0.25,
        }),
        Box::new(Schedule {
            base: prog[3] as u32,
            grow_at: args.grow_at,
            swap_at: args.swap_at,
            shrink_at: args.shrink_at,
            last_epoch: None,
        }),
    ];
    let mut ad = Adapter::new(w.session().clone(), policies);
    let mut noise = NoiseScale::new(0.2);
    let mut b_simple = None;
    let mut gbuf = vec![0f32; PARAMS + 2];
    if w.rank() == 0 {
        println!(
            "training: {} samples, {} features, {} classes, {} epochs, {} workers",
            args.train,
            FEATURES,
            CLASSES,
            args.epochs,
            w.size()
        );
    }
    while prog[2] < args.epochs {
        let (n, r) = (w.size() as u64, w.rank() as u64);
        let b = prog[1];
        let (lo, hi) = (b * r / n, b * (r + 1) / n);
        gbuf.fill(0.0);
        let samples = (prog[0] + lo..prog[0] + hi).map(|k| sample(&order, k));
        let loss = grad_sum(&params, &train, samples, &mut gbuf[..PARAMS]);
        let mine = (hi - lo).max(1) as f32;
        let small_sq = sq_norm(&gbuf[..PARAMS]) / f64::from(mine * mine);
        gbuf[PARAMS] = loss;
        gbuf[PARAMS + 1] = small_sq as f32;
        w.session()
            .allreduce_in_place("grad", &mut gbuf, ReduceOp::Sum)
            .await?;
        let bf = b as f32;
        for (p, g) in params.iter_mut().zip(&gbuf[..PARAMS]) {
            *p -= args.lr * g / bf;
        }
        let big_sq = sq_norm(&gbuf[..PARAMS]) / f64::from(bf * bf);
        if n > 1 {
            let mean_small = f64::from(gbuf[PARAMS + 1]) / n as f64;
            if let Some(e) = noise.update(mean_small, big_sq, b as f64 / n as f64, b as f64) {
                b_simple = e.b_simple;
            }
        }
        step += 1;
        prog[0] += b;
        let epoch = prog[0] / args.train as u64;
        if epoch > prog[2] {
            prog[2] = epoch;
            print_state(&w, &format!("epoch {epoch}"), step, &params);
            if w.rank() == 0 {
                let (l, acc) = evaluate(&params, &test);
                println!(
                    "epoch {epoch}: loss {l:.6} accuracy {acc:.4} noise scale {} batch {b} workers {n} strategy {}",
                    b_simple.map_or("-".into(), |v| format!("{v:.1}")),
                    w.session().strategy()
                );
            }
        }
        ad.progress = Progress {
            step,
            epoch: prog[2],
            batch_size: prog[1] as u32,
            metrics: kungfu_adaptation::Metrics {
                noise_scale: b_simple,
                loss: Some(f64::from(gbuf[PARAMS]) / b as f64),
                ..Default::default()
            },
        };
        if prog[2] >= args.epochs {
            break;
        }
        for a in ad.after_step().await? {
            match a {
                Action::SetBatchSize(nb) => {
                    prog[1] = u64::from(nb);
                    if w.rank() == 0 {
                        println!(
                            "step {step}: batch size {b} -> {nb} (noise scale {b_simple:.1?})"
                        );
                    }
                }
                Action::SetStrategy(s) => {
                    if w.rank() == 0 {
                        println!("step {step}: strategy -> {s}");
                    }
                }
                Action::SetTransport(t) => {
                    // every worker, right after the same agreement
                    let epoch = w.swap_transport(t).await?;
                    if w.rank() == 0 {
                        println!("step {step}: transport -> {} ({epoch})", w.transport_name());
                    }
                }
                Action::Resize(size) => {
                    let before = w.size();
                    let res = w.resize(size as usize).await?;
                    if res.detached {
                        print_state(&w, "detached", step, &params);
                        println!("rank {r}: detached at step {step}; leaving");
                        return Ok(());
                    }
                    if res.changed {
                        step = sync(&mut w, step, &mut params, &mut prog).await?;
                        print_state(&w, "synced", step, &params);
                        ad.set_session(w.session().clone());
                        if w.rank() == 0 {
                            println!("step {step}: workers {before} -> {}", w.size());
                        }
                    }
                }
                Action::Custom { .. } => {}
            }
        }
    }
    let (l, acc) = evaluate(&params, &test);
    println!(
        "final: rank {} of {} loss {l:.6} accuracy {acc:.4} params {:016x} step {step}",
        w.rank(),
        w.size(),
        digest(&params)
    );
    w.session().barrier("end").await?;
    w.close(Duration::from_secs(5)).await;
    Ok(())
}

/// Shares the model and the progress from a worker that has them.
async fn sync(
    w: &mut Worker,
    step: u64,
    params: &mut [f32],
    prog: &mut Progress4,
) -> anyhow::Result<u64> {
    let mut bufs: [(&str, &mut [u8]); 2] = [
        ("params", bytemuck::cast_slice_mut(params)),
        ("progress", bytemuck::cast_slice_mut(prog)),
    ];
    Ok(w.sync_state(step, &mut bufs).await?)
}

/// The same training in one process, from rank 0's initial parameters,
/// with the initial batch size or the batch sizes of `--batch-schedule`.
fn baseline(args: &Args) {
    let train = make_data(1, args.train);
    let test = make_data(2, args.test);
    let order = shuffled(args.train, 3);
    let mut params = init_params(INIT_SEED);
    let mut g = vec![0f32; PARAMS];
    let mut b = u64::from(args.batch);
    let (mut seen, mut step, mut epoch) = (0u64, 0u64, 0u64);
    while epoch < args.epochs {
        g.fill(0.0);
        grad_sum(
            &params,
            &train,
            (seen..seen + b).map(|k| sample(&order, k)),
            &mut g,
        );
        for (p, gv) in params.iter_mut().zip(&g) {
            *p -= args.lr * gv / b as f32;
        }
        seen += b;
        step += 1;
        if seen / args.train as u64 > epoch {
            epoch = seen / args.train as u64;
            let (l, acc) = evaluate(&params, &test);
            println!("baseline epoch {epoch}: loss {l:.6} accuracy {acc:.4} batch {b}");
        }
        if let Some(&(_, nb)) = args.batch_schedule.iter().find(|(s, _)| *s == step) {
            b = nb;
        }
    }
    let (l, acc) = evaluate(&params, &test);
    println!(
        "baseline: loss {l:.6} accuracy {acc:.4} params {:016x} step {step}",
        digest(&params)
    );
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("kungfu-train: {e:#}");
            std::process::exit(2);
        }
    };
    if args.baseline {
        baseline(&args);
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = rt.block_on(train(args)) {
        eprintln!("kungfu-train: {e:#}");
        std::process::exit(1);
    }
}
