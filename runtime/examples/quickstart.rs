//! The quick start of the README (scripts/doc-commands.py checks that the two
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
    w.close(std::time::Duration::from_secs(10)).await;
    Ok(())
}
