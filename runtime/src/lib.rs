//! The KungFu-rs worker runtime: find the peers, connect, start a session.
//!
//! A worker started by `kungfu-run`, torchrun, Slurm's `srun` or Open MPI's
//! `mpirun` calls [`Worker::start`] with [`WorkerEnv::from_env`] and gets a
//! connected [`kungfu_collectives::Session`]. See [`mod@env`] for the variables
//! each launcher sets.
//!
//! # Quick start
//!
//! ```no_run
//! use kungfu::{Worker, WorkerEnv};
//! use kungfu_collectives::ReduceOp;
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let w = Worker::start(WorkerEnv::from_env()?).await?;
//! let s = w.session();
//! let sum = s.allreduce("x", &[s.rank().0 as f32], ReduceOp::Sum).await?;
//! println!("rank {} of {}: {sum:?}", w.rank(), w.size());
//! # Ok(()) }
//! ```

mod connect;
pub mod elastic;
pub mod env;
mod error;
pub mod etcd;
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod http;
pub mod listen;
mod pending;
pub mod reconfigure;
pub mod recover;
pub mod rendezvous;
mod resize;
pub mod store;
mod swap;
mod worker;
pub use error::BootstrapError;
pub use reconfigure::{ReconfigureError, ReconfigurePlan, Reconfigured, WorkerHandle};
pub use recover::Recovered;
pub use resize::Resized;
pub use swap::TransportSwap;
pub use worker::Worker;

pub use env::{Discovery, Launcher, WorkerEnv};
