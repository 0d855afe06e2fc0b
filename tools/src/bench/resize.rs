//! `kungfu-bench resize`: the latency of elastic resizes, with the model
//! checked after each.

use std::time::Duration;

use kungfu::{Worker, WorkerEnv};
use kungfu_collectives::ReduceOp;

/// The model's value at `step`: every step adds the average of the ranks'
/// gradients, which is `1 + j % 7` whatever the cluster size.
fn model_at(step: u64, j: usize) -> f32 {
    step as f32 * (1 + j % 7) as f32
}

/// `kungfu-bench resize`: a data-parallel loop whose cluster goes through
/// `sizes`, `steps` steps apart. Every step allreduces a gradient and
/// checks the model; after each resize the model and step are synced
/// from a worker that has them (new workers learn both) and checked, and
/// the resize latency (last session ready minus last join begun: the
/// process start of new workers is excluded) is printed by rank 0.
pub(super) async fn resize_bench(
    sizes: &[usize],
    steps: usize,
    bytes: usize,
) -> anyhow::Result<bool> {
    let mut w = Worker::start(WorkerEnv::from_env()?).await?;
    let len = (bytes / 4).max(1);
    let mut model = vec![0f32; len];
    let mut grad = vec![0f32; len];
    let joined_late = w.is_fresh();
    let mut step = w.sync_state(0, &mut [("model", &mut model)]).await?;
    let mut ok = check_model(&w, step, &model, "start");
    let mut latencies = Vec::new();
    // the step at which this worker last went through a resize
    let mut resized_at = None;
    if joined_late {
        latencies.push(report_resize(&w, None).await?);
        resized_at = Some(step);
    }
    loop {
        if step > 0 && step % steps as u64 == 0 && resized_at != Some(step) {
            resized_at = Some(step);
            let k = (step / steps as u64 - 1) as usize;
            let Some(&n) = sizes.get(k) else { break };
            let before = w.size();
            let r = w.resize(n).await?;
            if r.detached {
                println!("# detached at step {step} (the cluster shrank to {n})");
                return Ok(ok);
            }
            if r.changed {
                step = w.sync_state(step, &mut [("model", &mut model)]).await?;
                ok &= check_model(&w, step, &model, "resize");
                latencies.push(report_resize(&w, Some(before)).await?);
            }
        }
        let (n, me) = (w.size() as f32, w.rank() as f32);
        for (j, g) in grad.iter_mut().enumerate() {
            *g = (1 + j % 7) as f32 + me - (n - 1.0) / 2.0;
        }
        let s = w.session();
        s.allreduce_in_place("grad", &mut grad, ReduceOp::Sum)
            .await?;
        for (m, g) in model.iter_mut().zip(&grad) {
            *m += g / n;
        }
        step += 1;
        ok &= check_model(&w, step, &model, "step");
    }
    let s = w.session();
    let wrong = s
        .allreduce("bench/resize-ok", &[u32::from(!ok)], ReduceOp::Max)
        .await?[0];
    if w.rank() == 0 {
        let ms: Vec<f64> = latencies.iter().flatten().map(|l| l * 1e3).collect();
        println!(
            "# kungfu-bench resize: {} steps, sizes {sizes:?}, model {} bytes, final size {}, version {}, model checked {}",
            step,
            len * 4,
            w.size(),
            w.version(),
            if wrong == 0 { "on every worker" } else { "WRONG on some worker" }
        );
        if !ms.is_empty() {
            let mean = ms.iter().sum::<f64>() / ms.len() as f64;
            let max = ms.iter().copied().fold(0.0, f64::max);
            println!("# resize latency (process start excluded): mean {mean:.1} ms, max {max:.1} ms over {} resizes", ms.len());
        }
    }
    w.close(Duration::from_secs(10)).await;
    Ok(ok && wrong == 0)
}

fn check_model(w: &Worker, step: u64, model: &[f32], at: &str) -> bool {
    let bad = model
        .iter()
        .enumerate()
        .find(|(j, m)| **m != model_at(step, *j));
    if let Some((j, m)) = bad {
        eprintln!(
            "rank {}: model[{j}] = {m} at step {step} ({at}), expected {}",
            w.rank(),
            model_at(step, j)
        );
    }
    bad.is_none()
}

/// After a change: every worker's join times; rank 0 prints the latency.
/// Returns it on rank 0 (`None` elsewhere).
async fn report_resize(w: &Worker, before: Option<usize>) -> anyhow::Result<Option<f64>> {
    let secs = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let (began, ready) = w.joined();
    let t = w
        .session()
        .allreduce(
            "bench/resize-times",
            &[secs(began), secs(ready)],
            ReduceOp::Max,
        )
        .await?;
    if w.rank() != 0 {
        return Ok(None);
    }
    let latency = t[1] - t[0];
    let from = before.map_or("?".to_string(), |b| b.to_string());
    println!(
        "# resize {from} -> {} (version {}): latency {:.1} ms",
        w.size(),
        w.version(),
        latency * 1e3
    );
    Ok(Some(latency))
}
