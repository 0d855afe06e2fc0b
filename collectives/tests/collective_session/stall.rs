//! The stall report: ranks that posted an op learn who has not, from the
//! beacons on each other's heartbeats.

use super::*;
use kungfu_transport::endpoint::Liveness;

/// Polls `f` until it holds, for at most 10 s.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn every_rank_names_the_one_that_did_not_post() {
    rt().block_on(async {
        let ss = sessions(3, Strategy::Ring, 5, LONG);
        for s in &ss {
            s.transport()
                .watch_peers(Liveness::with_timeout(Duration::from_millis(600)));
            // beacons go out at half of it, and travel on heartbeats every
            // 100 ms
            s.watch_stalls(Duration::from_secs(1));
        }
        let early: Vec<_> = ss[..2]
            .iter()
            .map(|s| s.allreduce("grad/fc1", &[s.rank().0 as i32 + 1], ReduceOp::Sum))
            .collect();
        for s in &ss {
            until("a stall naming rank 2 everywhere", || {
                let r = s.stall_report();
                r.len() == 1 && r[0].missing == [Rank(2)] && r[0].posted == [Rank(0), Rank(1)]
            })
            .await;
        }
        let r = ss[2].stall_report();
        assert_eq!(&*r[0].name, "grad/fc1");
        assert!(r[0].waited >= Duration::from_secs(1), "{:?}", r[0]);
        assert!(r[0].unknown.is_empty());
        assert!(
            r[0].to_string()
                .contains("rank 2 has not posted it (posted by 0, 1)"),
            "{}",
            r[0]
        );
        // the late rank posts: the op completes and the report empties
        let late = ss[2].allreduce("grad/fc1", &[3], ReduceOp::Sum);
        assert_eq!(late.await.unwrap(), vec![6]);
        for h in early {
            assert_eq!(h.await.unwrap(), vec![6]);
        }
        for s in &ss {
            until("an empty report", || s.stall_report().is_empty()).await;
        }
    });
}

#[test]
fn without_heartbeats_the_others_are_unknown_not_missing() {
    rt().block_on(async {
        let ss = sessions(2, Strategy::Ring, 6, LONG);
        ss[0].watch_stalls(Duration::from_millis(100));
        let h = ss[0].allreduce("lonely", &[1u8], ReduceOp::Sum);
        until("a stall", || !ss[0].stall_report().is_empty()).await;
        let r = ss[0].stall_report();
        assert_eq!(
            (r[0].posted.clone(), r[0].unknown.clone()),
            (vec![Rank(0)], vec![Rank(1)])
        );
        assert!(r[0].missing.is_empty(), "{:?}", r[0]);
        drop(ss[1].allreduce("lonely", &[2u8], ReduceOp::Sum));
        assert_eq!(h.await.unwrap(), vec![3]);
    });
}
