//! `kungfu-quickstart`: the quick start of the README (scripts/doc-commands.py checks that the two
//! stay the same, and runs it under kungfu-run).
use kungfu::{Worker, WorkerEnv};
use kungfu_collectives::ReduceOp;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let w = Worker::start(WorkerEnv::from_env()?).await?;
    let s = w.session();
    // many ops in flight at once, matched by name
    let a = s.allreduce("grad/fc1", &[1.0f32; 1024], ReduceOp::Sum);
    let b = s.allreduce("grad/fc2", &[2.0f32; 256], ReduceOp::Avg);
    let (a, b) = (a.await?, b.await?);
    println!("rank {}: {} {}", w.rank(), a[0], b[0]);
    // small tensors fused: one allreduce per (type, operator); the group
    // borrows the inputs until submit
    let step = [w.rank() as u64];
    let mut g = s.group();
    let c = g.allreduce("bias/fc1", &[3.0f32; 16], ReduceOp::Sum);
    let d = g.allreduce("bias/fc2", &[4.0f32; 8], ReduceOp::Sum);
    let e = g.allreduce("steps", &step, ReduceOp::Max);
    g.submit();
    let (c, d, e) = (c.await?, d.await?, e.await?);
    println!("rank {}: fused {} {} {}", w.rank(), c[0], d[0], e[0]);
    w.close(std::time::Duration::from_secs(10)).await;
    Ok(())
}
