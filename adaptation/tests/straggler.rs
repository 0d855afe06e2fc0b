//! Straggler detection end to end: per-peer statistics of real ops over an
//! in-memory cluster, read by a policy through `Context::straggler`, and
//! the workers' agreement on who straggles.

use std::time::Duration;

use kungfu_adaptation::{Action, Adapter, Context, Policy};
use kungfu_collectives::{ReduceOp, Session, SessionConfig};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::mem::MemConfig;

/// Rank 2 starts each op this long after rank 0 has started it.
const LATE: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(30);
const STRAGGLER: u16 = 7;

/// Proposes the straggler it sees (its rank, as a custom action).
struct ReportStraggler;

impl Policy for ReportStraggler {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        cx.straggler(3.0)
            .map(|r| Action::Custom {
                kind: STRAGGLER,
                value: u64::from(r.0),
            })
            .into_iter()
            .collect()
    }
}

/// Rank 2 waits for rank 0's word that an op started (a channel: the
/// delay is certain, not a race), then `LATE` more. The root of the star
/// sees rank 2's frames at least `LATE` into each op and rank 1's within
/// milliseconds: far past the factor of 3, however loaded the machine.
#[test]
fn every_worker_agrees_on_the_straggler() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = SessionConfig {
            strategy: Strategy::Star,
            op_timeout: LONG,
            ..SessionConfig::default()
        };
        let (started, start) = tokio::sync::mpsc::unbounded_channel();
        let mut start = Some(start);
        let mut tasks = Vec::new();
        for s in Session::local_cluster(3, MemConfig::default(), config) {
            let started = started.clone();
            let mut start = if s.rank() == Rank(2) {
                start.take()
            } else {
                None
            };
            tasks.push(tokio::spawn(async move {
                for i in 0..4 {
                    if let Some(start) = start.as_mut() {
                        let op = tokio::time::timeout(LONG, start.recv()).await;
                        assert_eq!(op, Ok(Some(i)), "rank 0 started op {i}");
                        tokio::time::sleep(LATE).await;
                    }
                    let h = s.allreduce(&format!("g{i}"), &[1.0f32; 4096], ReduceOp::Sum);
                    if s.rank() == Rank(0) {
                        started.send(i).unwrap();
                    }
                    h.await.unwrap();
                }
                let mut ad = Adapter::new(s, vec![Box::new(ReportStraggler)]);
                ad.progress.step = 4;
                ad.after_step().await.unwrap()
            }));
        }
        for t in tasks {
            let decided = t.await.unwrap();
            assert_eq!(
                decided,
                vec![Action::Custom {
                    kind: STRAGGLER,
                    value: 2
                }]
            );
        }
    });
}
