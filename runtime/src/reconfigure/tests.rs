use std::time::Duration;

use kungfu_collectives::ReduceOp;

use super::*;

fn peer(host: &str, port: u16) -> Peer {
    Peer {
        host: host.into(),
        port,
    }
}

fn secret(s: &str) -> JobSecret {
    JobSecret::new(s.as_bytes()).unwrap()
}

#[test]
fn a_handle_parses_back_to_itself() {
    let k = secret("job one");
    for (p, s) in [
        (peer("127.0.0.1", 4000), Some(&k)),
        (peer("::1", 4001), Some(&k)),
        (peer("node-7.cluster", 65535), None),
    ] {
        let h = WorkerHandle::new(0xdead_beef_0123_4567, 42, p, s);
        let text = h.encode();
        assert!(
            text.starts_with("kungfu:1:deadbeef01234567:000000000000002a:"),
            "{text}"
        );
        assert_eq!(WorkerHandle::parse(&text, s, 42).unwrap(), h, "{text}");
    }
}

#[test]
fn a_handle_of_another_job_is_refused() {
    let (mine, theirs) = (secret("job one"), secret("job two"));
    let h = WorkerHandle::new(1, 7, peer("127.0.0.1", 4000), Some(&theirs)).encode();
    let e = WorkerHandle::parse(&h, Some(&mine), 7).unwrap_err();
    assert!(e.contains("another job"), "{e}");
    // one without a proof, in a job with a secret, and the other way round
    let bare = WorkerHandle::new(1, 7, peer("127.0.0.1", 4000), None).encode();
    let e = WorkerHandle::parse(&bare, Some(&mine), 7).unwrap_err();
    assert!(e.contains("proves no job secret"), "{e}");
    let e = WorkerHandle::parse(&h, None, 7).unwrap_err();
    assert!(e.contains("this worker has none"), "{e}");
    // the same secret, another cluster id
    let other = WorkerHandle::new(1, 8, peer("127.0.0.1", 4000), Some(&mine)).encode();
    let e = WorkerHandle::parse(&other, Some(&mine), 7).unwrap_err();
    assert!(e.contains("cluster id"), "{e}");
    // a proof that covers another address (the address was changed)
    let moved = WorkerHandle::new(1, 7, peer("127.0.0.1", 4000), Some(&mine))
        .encode()
        .replace(":4000", ":4001");
    let e = WorkerHandle::parse(&moved, Some(&mine), 7).unwrap_err();
    assert!(e.contains("does not match"), "{e}");
}

#[test]
fn a_malformed_handle_says_what_is_wrong() {
    let good = WorkerHandle::new(1, 0, peer("127.0.0.1", 4000), None).encode();
    for (text, says) in [
        ("", "not a kungfu handle"),
        ("gloo:0:-1:0:", "not a kungfu handle"),
        ("kungfu:1:", "expected ID:CLUSTER"),
        ("kungfu:1:xyz:0000000000000000:-:127.0.0.1:1", "worker id"),
        ("kungfu:1:0000000000000001:00:-:127.0.0.1:1", "cluster id"),
        (
            "kungfu:1:0000000000000001:0000000000000000:zz:127.0.0.1:1",
            "proof",
        ),
        (
            "kungfu:1:0000000000000001:0000000000000000:-:127.0.0.1",
            "address",
        ),
        (
            "kungfu:1:0000000000000001:0000000000000000:-:127.0.0.1:0",
            "port not 0",
        ),
        (
            "kungfu:1:0000000000000001:0000000000000000:-:a:1,b:2",
            "one HOST:PORT",
        ),
    ] {
        let e = WorkerHandle::parse(text, None, 0).unwrap_err();
        assert!(e.contains(says), "{text:?}: {e}");
    }
    let long = format!("{good}{}", "x".repeat(MAX_HANDLE));
    assert!(WorkerHandle::parse(&long, None, 0)
        .unwrap_err()
        .contains("at most"));
    assert!(WorkerHandle::parse(&good, None, 0).is_ok());
}

#[test]
fn versions_differ_by_uuid_and_members() {
    let m = |id, port| WorkerHandle::new(id, 0, peer("127.0.0.1", port), None);
    let ab = [m(1, 4000), m(2, 4001)];
    let ba = [m(2, 4001), m(1, 4000)];
    assert_eq!(version_of(5, &ab), version_of(5, &ab));
    assert_ne!(version_of(5, &ab), version_of(6, &ab));
    assert_ne!(version_of(5, &ab), version_of(5, &ba));
    assert_ne!(version_of(5, &ab), version_of(5, &ab[..1]));
}

/// A worker started alone (no launcher), over `transport`, with `secret`.
async fn alone(transport: &str, secret: &str) -> Worker {
    let vars = [
        ("KUNGFU_TRANSPORT", transport.to_string()),
        ("KUNGFU_JOB_SECRET", secret.to_string()),
        ("KUNGFU_CONNECT_TIMEOUT_MS", "20000".to_string()),
    ];
    let get = move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    let w = Worker::start(WorkerEnv::from_vars(&get).unwrap())
        .await
        .unwrap();
    assert_eq!((w.rank(), w.size()), (0, 1));
    w
}

/// Every worker of `ws` reconfigures to `order` (indices into `ws`) at
/// once; returns the workers (in `ws`'s order) and their results.
async fn reconfigure_all(
    ws: Vec<Worker>,
    uuid: i64,
    order: &[usize],
) -> (Vec<Worker>, Vec<Result<Reconfigured, String>>) {
    let handles: Vec<String> = order.iter().map(|&i| ws[i].handle().encode()).collect();
    let tasks: Vec<_> = ws
        .into_iter()
        .enumerate()
        .map(|(i, mut w)| {
            let handles = handles.clone();
            let listed = order.contains(&i);
            tokio::spawn(async move {
                let r = if listed {
                    w.reconfigure(uuid, &handles, Duration::from_secs(20))
                        .await
                        .map_err(|e| e.to_string())
                } else {
                    Err("not listed".into())
                };
                (w, r)
            })
        })
        .collect();
    let mut out = (Vec::new(), Vec::new());
    for t in tasks {
        let (w, r) = t.await.unwrap();
        out.0.push(w);
        out.1.push(r);
    }
    out
}

/// The sum over the listed workers of (their index in `ws` + 1), as each
/// of them computes it in an allreduce.
async fn sums(ws: &[Worker], order: &[usize]) -> Vec<u64> {
    let ops: Vec<_> = order
        .iter()
        .map(|&i| {
            let s = ws[i].session().clone();
            tokio::spawn(async move {
                s.allreduce("sum", &[i as u64 + 1], ReduceOp::Sum)
                    .await
                    .unwrap()[0]
            })
        })
        .collect();
    let mut out = Vec::new();
    for o in ops {
        out.push(o.await.unwrap());
    }
    out
}

/// Three workers that started alone become one cluster, shrink by the
/// middle one, take it back, split in two and merge, as torch's
/// fault-tolerance suite asks of a backend; ranks follow the lists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_started_alone_reconfigure_as_listed() {
    for transport in ["tcp", "shm"] {
        let mut ws = Vec::new();
        for _ in 0..3 {
            ws.push(alone(transport, "reconfigure test").await);
        }
        let (ws, r) = reconfigure_all(ws, 100, &[0, 1, 2]).await;
        for (i, r) in r.iter().enumerate() {
            let r = r.as_ref().unwrap();
            assert_eq!((r.rank, r.size), (i, 3), "{transport}");
        }
        assert_eq!(sums(&ws, &[0, 1, 2]).await, vec![6; 3], "{transport}");
        // the middle one left out: the last becomes rank 1
        let (ws, r) = reconfigure_all(ws, 101, &[0, 2]).await;
        assert_eq!(r[2].as_ref().unwrap().rank, 1, "{transport}");
        assert_eq!((ws[2].rank(), ws[2].size()), (1, 2), "{transport}");
        assert_eq!(sums(&ws, &[0, 2]).await, vec![4; 2], "{transport}");
        // back to three, in another order
        let (ws, r) = reconfigure_all(ws, 102, &[2, 0, 1]).await;
        assert_eq!(
            r.iter()
                .map(|r| r.as_ref().unwrap().rank)
                .collect::<Vec<_>>(),
            vec![1, 2, 0],
            "{transport}"
        );
        assert_eq!(sums(&ws, &[2, 0, 1]).await, vec![6; 3], "{transport}");
        // two disjoint clusters at once, then one again
        let h: Vec<String> = ws.iter().map(|w| w.handle().encode()).collect();
        let tasks: Vec<_> = ws
            .into_iter()
            .enumerate()
            .map(|(i, mut w)| {
                let (uuid, list) = if i == 0 {
                    (103, vec![h[0].clone()])
                } else {
                    (104, vec![h[1].clone(), h[2].clone()])
                };
                tokio::spawn(async move {
                    let r = w.reconfigure(uuid, &list, Duration::from_secs(20)).await;
                    (w, r.unwrap())
                })
            })
            .collect();
        let mut ws = Vec::new();
        for t in tasks {
            ws.push(t.await.unwrap().0);
        }
        assert_eq!(
            ws.iter().map(Worker::size).collect::<Vec<_>>(),
            vec![1, 2, 2]
        );
        assert_eq!(sums(&ws, &[1, 2]).await, vec![5; 2], "{transport}");
        assert_eq!(sums(&ws, &[0]).await, vec![1], "{transport}");
        let (ws, r) = reconfigure_all(ws, 105, &[0, 1, 2]).await;
        assert!(r.iter().all(Result::is_ok), "{transport}: {r:?}");
        assert_eq!(sums(&ws, &[0, 1, 2]).await, vec![6; 3], "{transport}");
        for w in ws {
            w.close(Duration::from_millis(100)).await;
        }
    }
}

/// What a reconfigure refuses leaves the cluster as it was; an abort
/// fails the ops in flight, and a reconfigure with a fresh uuid brings
/// the workers back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_change_nothing_and_an_abort_is_recoverable() {
    let mut ws = Vec::new();
    for _ in 0..2 {
        ws.push(alone("tcp", "refusals").await);
    }
    let stranger = alone("tcp", "another job").await;
    let (mut ws, r) = reconfigure_all(ws, 7, &[0, 1]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    let h: Vec<String> = ws.iter().map(|w| w.handle().encode()).collect();
    let t = Duration::from_secs(5);
    let w = &mut ws[0];
    let refused = [
        (w.reconfigure(8, &[], t).await, "no handles"),
        (
            w.reconfigure(8, &[h[1].clone()], t).await,
            "not among the 1",
        ),
        (
            w.reconfigure(8, &[h[0].clone(), h[0].clone()], t).await,
            "name the same worker",
        ),
        (
            w.reconfigure(8, &[h[0].clone(), stranger.handle().encode()], t)
                .await,
            "another job",
        ),
        (
            w.reconfigure(8, &[h[0].clone(), "x".into()], t).await,
            "handle 1",
        ),
        (w.reconfigure(7, &h, t).await, "already used"),
    ];
    for (r, says) in refused {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(says), "{says}: {e}");
    }
    assert_eq!(
        sums(&ws, &[0, 1]).await,
        vec![3, 3],
        "a refusal changed the cluster"
    );
    // an op that waits for a peer that never posts it, aborted
    let s = ws[0].session().clone();
    let pending = tokio::spawn(async move { s.allreduce("never", &[1u8], ReduceOp::Sum).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    ws[0].abort();
    let got = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .expect("the abort did not end the op")
        .unwrap();
    assert!(got.is_err(), "{got:?}");
    assert!(ws[0]
        .session()
        .allreduce("after", &[1u8], ReduceOp::Sum)
        .await
        .is_err());
    let (ws, r) = reconfigure_all(ws, 9, &[0, 1]).await;
    assert!(r.iter().all(Result::is_ok), "{r:?}");
    assert_eq!(sums(&ws, &[0, 1]).await, vec![3, 3]);
    for w in ws {
        w.close(Duration::from_millis(100)).await;
    }
    stranger.close(Duration::ZERO).await;
}

/// A listed worker that never comes fails the others' reconfigure at
/// their timeout, naming it, and they are in no cluster until the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_never_comes_fails_the_reconfigure_at_its_timeout() {
    let mut a = alone("tcp", "absent").await;
    let b = alone("tcp", "absent").await;
    let list = vec![a.handle().encode(), b.handle().encode()];
    let t0 = std::time::Instant::now();
    let e = a
        .reconfigure(1, &list, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    assert!(matches!(e, ReconfigureError::Connect { .. }), "{e}");
    assert!(a
        .session()
        .allreduce("x", &[1u8], ReduceOp::Sum)
        .await
        .is_err());
    // alone again, with a fresh uuid
    let r = a
        .reconfigure(2, &list[..1], Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!((r.rank, r.size), (0, 1));
    assert_eq!(
        a.session()
            .allreduce("x", &[1u8], ReduceOp::Sum)
            .await
            .unwrap(),
        vec![1]
    );
    a.close(Duration::ZERO).await;
    b.close(Duration::ZERO).await;
}
