//! An adapter driving one instance of each policy over 40 steps on every
//! worker of an in-memory cluster: the decisions evolve with the state the
//! adapter carries between steps (an agreed batch size becomes the batch
//! size the policy sees next), and every worker records the same ones.

use std::time::Duration;

use kungfu_adaptation::{Action, Adapter, AdaptiveBatchSize, ScaleSchedule};
use kungfu_collectives::{Session, SessionConfig};
use kungfu_transport::mem::MemConfig;

#[test]
fn agreed_batch_sizes_carry_over_to_the_next_decision() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = SessionConfig {
            op_timeout: Duration::from_secs(20),
            ..SessionConfig::default()
        };
        let mut tasks = Vec::new();
        for s in Session::local_cluster(2, MemConfig::default(), config) {
            tasks.push(tokio::spawn(async move {
                let mut ad = Adapter::new(
                    s,
                    vec![
                        Box::new(AdaptiveBatchSize {
                            min: 32,
                            max: 4096,
                            every: 10,
                            tolerance: 0.1,
                        }),
                        Box::new(ScaleSchedule {
                            at: vec![(15, 3), (35, 2)],
                        }),
                    ],
                );
                // the application sets the batch size once; the adapter
                // keeps it up to date with what is agreed
                ad.progress.batch_size = 128;
                for step in 1..=40 {
                    ad.progress.step = step;
                    ad.progress.metrics.noise_scale = Some(if step <= 25 { 1000.0 } else { 300.0 });
                    ad.after_step().await.expect("agreement");
                }
                (ad.history().to_vec(), ad.progress.batch_size)
            }));
        }
        let want = vec![
            (10, Action::SetBatchSize(1000)),
            (15, Action::Resize(3)),
            // step 20: the noise scale is the batch size in use: nothing
            (30, Action::SetBatchSize(300)),
            (35, Action::Resize(2)),
        ];
        for t in tasks {
            let (history, batch) = tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("no deadlock")
                .unwrap();
            assert_eq!(history, want);
            assert_eq!(batch, 300);
        }
    });
}
