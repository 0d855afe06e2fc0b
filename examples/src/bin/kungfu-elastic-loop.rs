//! `kungfu-elastic-loop`: the elastic training loop of docs/adaptation.md
//! (the README's "Elastic and adaptive training" runs it), compiled and
//! run by `examples/tests/elastic_loop.rs` so that it cannot rot. The part
//! between the `docs/adaptation.md` markers is what that page shows.
//!
//! The model is a toy (least squares on random data); what matters is the
//! loop: the application feeds the adapter the step and the batch size in
//! use, or `ScaleSchedule` never fires (it matches the step) and
//! `AdaptiveBatchSize` fires at every step (step 0 is a multiple of any
//! period).
//!
//! ```text
//! kungfu-run -w -np 2 target/debug/kungfu-elastic-loop
//! ```
//! At the end every worker left prints the actions it agreed to, with
//! their steps, and a digest of its model.

use std::time::Duration;

use kungfu::{BootstrapError, Worker, WorkerEnv};
use kungfu_adaptation::{
    Action, Adapter, AdaptiveBatchSize, FastestStrategy, GradientMonitor, ScaleSchedule,
};
use kungfu_topology::{fnv1a64, Strategy};
use kungfu_transport::mem::SeededRng;

const DIM: usize = 64;
const STEPS: u64 = 300;
const LR: f32 = 0.05;

async fn train() -> anyhow::Result<()> {
    // docs/adaptation.md: begin
    let mut w = Worker::start(WorkerEnv::from_env()?).await?;
    let (mut model, mut batch) = (vec![0f32; DIM], [256u32]);
    let mut step = sync(&mut w, 0, &mut model, &mut batch).await?; // new workers learn it
    let mut ad = Adapter::new(
        w.session().clone(),
        vec![
            Box::new(AdaptiveBatchSize {
                min: 32,
                max: 1024,
                every: 10,
                tolerance: 0.25,
            }),
            Box::new(FastestStrategy::new(
                vec![Strategy::Ring, Strategy::Star],
                50,
                0.1,
            )),
            Box::new(ScaleSchedule {
                at: vec![(100, 3), (200, 2)],
            }),
        ],
    );
    let mut mon = GradientMonitor::new(0.1, 10); // noise scale + variance, riding on the allreduce
    let mut grad = vec![0f32; DIM + 1]; // the gradient and one spare element
    while step < STEPS {
        let local = (batch[0] as usize).div_ceil(w.size()); // this worker's share
        local_gradient(&model, step, w.rank(), local, &mut grad[..DIM]);
        mon.allreduce_sum(w.session(), "grad", &mut grad, local as f64)
            .await?;
        for (m, g) in model.iter_mut().zip(&grad[..DIM]) {
            *m -= LR * g / w.size() as f32;
        }
        step += 1;
        // what the policies read: ScaleSchedule matches the step,
        // AdaptiveBatchSize acts every `every` steps on the batch in use
        ad.progress.step = step;
        ad.progress.batch_size = batch[0];
        ad.progress.metrics.noise_scale = mon.noise_estimate.and_then(|e| e.b_simple);
        for a in ad.after_step().await? {
            // strategy swaps are applied by the adapter
            match a {
                Action::SetBatchSize(b) => batch[0] = b,
                Action::Resize(n) => {
                    let r = w.resize(n as usize).await?;
                    if r.detached {
                        return Ok(());
                    }
                    if r.changed {
                        step = sync(&mut w, step, &mut model, &mut batch).await?;
                        ad.set_session(w.session().clone());
                    }
                }
                _ => {}
            }
        }
    }
    // docs/adaptation.md: end
    for (at, a) in ad.history() {
        println!("agreed at step {at}: {a:?}");
    }
    println!(
        "final: rank {} of {} step {step} batch {} model {:016x}",
        w.rank(),
        w.size(),
        batch[0],
        fnv1a64(0, bytemuck::cast_slice(&model))
    );
    w.session().barrier("end").await?;
    w.close(Duration::from_secs(5)).await;
    Ok(())
}

// docs/adaptation.md: begin sync
/// Hands the step, the model and the batch size to workers that joined.
async fn sync(
    w: &mut Worker,
    step: u64,
    model: &mut [f32],
    batch: &mut [u32; 1],
) -> Result<u64, BootstrapError> {
    let mut state: [(&str, &mut [u8]); 2] = [
        ("model", bytemuck::cast_slice_mut(model)),
        ("batch", bytemuck::cast_slice_mut(batch)),
    ];
    w.sync_state(step, &mut state).await
}
// docs/adaptation.md: end sync

/// The mean gradient of `|x.model - y|^2 / 2` over `n` random examples of
/// `y = x.target + noise` (drawn from the step and the rank), into `g`.
fn local_gradient(model: &[f32], step: u64, rank: usize, n: usize, g: &mut [f32]) {
    let mut rng = SeededRng::new(step.wrapping_mul(0x9e37_79b9) ^ rank as u64);
    let mut normal = move || {
        let u1 = (rng.below(1 << 30) as f64 + 1.0) / f64::from(1u32 << 30);
        let u2 = rng.below(1 << 30) as f64 / f64::from(1u32 << 30);
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    };
    let target = |i: usize| if i.is_multiple_of(2) { 1.0 } else { -0.5 };
    g.fill(0.0);
    let mut x = vec![0f32; model.len()];
    for _ in 0..n {
        x.iter_mut().for_each(|v| *v = normal());
        let y: f32 = x
            .iter()
            .enumerate()
            .map(|(i, v)| v * target(i))
            .sum::<f32>()
            + normal();
        let err = x.iter().zip(model).map(|(a, b)| a * b).sum::<f32>() - y;
        for (gv, xv) in g.iter_mut().zip(&x) {
            *gv += err * xv / n as f32;
        }
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    if let Err(e) = rt.block_on(train()) {
        eprintln!("kungfu-elastic-loop: {e:#}");
        std::process::exit(1);
    }
}
