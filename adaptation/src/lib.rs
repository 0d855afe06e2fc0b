//! Adaptation for KungFu-rs: monitors over live training metrics, the
//! adaptation-policy API, and the agreement that makes every worker take the
//! same action at the same step.
//!
//! ```no_run
//! # async fn run(session: kungfu_collectives::Session<kungfu_transport::any::AnyTransport>)
//! # -> Result<(), kungfu_collectives::CollectiveError> {
//! use kungfu_adaptation::{Action, Adapter, AdaptiveBatchSize};
//! let mut ad = Adapter::new(
//!     session,
//!     vec![Box::new(AdaptiveBatchSize { min: 32, max: 4096, every: 100, tolerance: 0.2 })],
//! );
//! ad.progress.batch_size = 256;
//! for step in 1..=1000u64 {
//!     // ... compute and allreduce gradients, update the monitors ...
//!     ad.progress.step = step;
//!     for a in ad.after_step().await? {
//!         if let Action::SetBatchSize(b) = a {
//!             println!("step {step}: batch size {b} from now on");
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod monitor;
pub mod policy;
pub mod sync;

pub use monitor::{
    gradient_variance, sq_norm, sq_norm_bytes, Ema, GradientMonitor, NoiseEstimate, NoiseScale,
};
pub use policy::{
    Action, Adapter, AdaptiveBatchSize, Context, FastestStrategy, Metrics, Policy, Progress,
    ScaleOnPlateau, ScaleSchedule, MAX_CUSTOM,
};
pub use sync::{model_averaging, sync_sgd, PairAveraging};
