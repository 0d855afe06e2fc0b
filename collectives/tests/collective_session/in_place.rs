//! Ops on the caller's memory ([`Session::submit_in`]): no copy in or out,
//! frames landing in it, and the memory held until everyone is done.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use kungfu_collectives::reference;
use kungfu_transport::Region;

use super::*;

fn spec(kind: OpKind, count: usize) -> OpSpec {
    OpSpec {
        kind,
        dtype: DType::I32,
        count,
        check: 0,
    }
}

fn ints(v: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// Allreduce, broadcast and allgather of three ranks, each run in a region
/// laid out by `init_work_in` (over many chunks, so frames land in place
/// out of order): the output is in the region, the same bytes as the
/// reference, and `bytes()` of the output is that memory, not a copy.
#[test]
fn ops_in_the_callers_memory_leave_their_output_there() {
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Ring, 7, LONG);
        let count = 1000;
        let kinds = [
            OpKind::Allreduce(ReduceOp::Sum),
            OpKind::Broadcast { root: Rank(1) },
            OpKind::Allgather,
        ];
        for (k, kind) in kinds.into_iter().enumerate() {
            let spec = spec(kind, count);
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    ints(
                        &(0..count as i32)
                            .map(|i| i * 7 + r as i32 * 1000)
                            .collect::<Vec<_>>(),
                    )
                })
                .collect();
            let regions: Vec<Arc<Region>> = (0..n)
                .map(|r| {
                    let mut work = vec![0xaa; spec.work_len(n).unwrap()];
                    spec.init_work_in(&inputs[r], Rank(r as u32), n, &mut work);
                    Region::from_vec(work)
                })
                .collect();
            let name = format!("in-place/{k}");
            let hs: Vec<_> = ss
                .iter()
                .zip(&regions)
                .map(|(s, r)| s.submit_in(&name, spec, r.clone()))
                .collect();
            for (r, h) in hs.into_iter().enumerate() {
                let out = h.await.unwrap();
                let want = reference::expected(&spec, r, &inputs).unwrap();
                let got = out.bytes().expect("every rank has an output");
                assert_eq!(got, &want[..], "{kind:?} rank {r}");
                let region = &regions[r];
                let lent = region.read(0..region.len()).unwrap();
                assert_eq!(
                    got.as_ptr(),
                    lent.as_slice().as_ptr(),
                    "{kind:?}: not a copy"
                );
                assert!(
                    region.write(0..1).is_err(),
                    "the output shares it, read-only"
                );
                drop(out);
                drop(lent);
                assert_eq!(region.shares(), 0);
            }
        }
    });
}

/// A region over memory the op does not own: its release hook runs once,
/// after the op and its output are done with it; a region of the wrong
/// length is refused at once (and released).
#[test]
#[allow(unsafe_code)] // a region over memory it does not own is unsafe to make
fn foreign_memory_is_released_once_when_everyone_is_done() {
    rt().block_on(async {
        let n = 2;
        let ss = sessions(n, Strategy::Star, 3, LONG);
        let spec = spec(OpKind::Allreduce(ReduceOp::Max), 64);
        let released = Arc::new(AtomicUsize::new(0));
        let mut bufs: Vec<Vec<i32>> = (0..n).map(|r| vec![r as i32; 64]).collect();
        let mut hs = Vec::new();
        for (s, buf) in ss.iter().zip(bufs.iter_mut()) {
            let seen = released.clone();
            let ptr = NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
            // SAFETY: `buf` outlives the region (the test waits for the
            // hook before it reads `bufs`) and nothing else touches it.
            let region = unsafe {
                Region::foreign(
                    ptr,
                    256,
                    Box::new(move || {
                        seen.fetch_add(1, Ordering::SeqCst);
                    }),
                )
            };
            hs.push(s.submit_in("foreign", spec, region));
        }
        for h in hs {
            let out = h.await.unwrap();
            assert_eq!(out.to_vec::<i32>(), vec![1; 64]);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while released.load(Ordering::SeqCst) < n && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(released.load(Ordering::SeqCst), n, "each released once");
        assert_eq!(
            bufs,
            vec![vec![1; 64]; n],
            "the output is in the caller's memory"
        );

        // The op lets go of the caller's memory only after its completion
        // ran, even where the completion drops the output first: the C ABI
        // completes its ops from the release.
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut bufs: Vec<Vec<i32>> = (0..n).map(|r| vec![r as i32; 64]).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (r, (s, buf)) in ss.iter().zip(bufs.iter_mut()).enumerate() {
            let ptr = NonNull::new(buf.as_mut_ptr().cast::<u8>()).unwrap();
            let (o1, o2, tx) = (order.clone(), order.clone(), tx.clone());
            // SAFETY: as above; the test waits for both releases.
            let region = unsafe {
                Region::foreign(
                    ptr,
                    256,
                    Box::new(move || {
                        o1.lock().unwrap().push(("release", r));
                        let _ = tx.send(());
                    }),
                )
            };
            let callback = Box::new(move |out: Result<kungfu_collectives::OpOutput, _>| {
                drop(out.unwrap());
                o2.lock().unwrap().push(("callback", r));
            });
            s.submit_in_with_callback("ordered", spec, region, callback);
        }
        for _ in 0..n {
            tokio::time::timeout(LONG, rx.recv())
                .await
                .unwrap()
                .unwrap();
        }
        let order = order.lock().unwrap().clone();
        for r in 0..n {
            let at = |what| order.iter().position(|&e| e == (what, r));
            assert!(
                at("callback") < at("release") && at("release").is_some(),
                "rank {r}: released before its completion ran: {order:?}"
            );
        }
        assert_eq!(bufs, vec![vec![1; 64]; n]);

        let short = Region::from_vec(vec![0; 255]);
        let r = ss[0].submit_in("short", spec, short.clone()).await;
        match r {
            Err(CollectiveError::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("256 working bytes, got 255"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(Arc::strong_count(&short), 1, "the op let go of it");
    });
}

/// A relay whose frame came before its op started: the receive lands as
/// it is posted, at the op's first step, and the relay must send on at once
/// (it once waited for another event that never came, until its timeout).
#[test]
fn a_receive_that_lands_as_it_is_posted_is_relayed_at_once() {
    rt().block_on(async {
        // Ring broadcast from 0 over 3 ranks: 0 sends to 1, 1 relays to 2.
        let ss = sessions(3, Strategy::Ring, 11, Duration::from_secs(5));
        let x: Vec<i32> = (0..12).collect();
        let root = ss[0].broadcast("early", &x, Rank(0));
        // Rank 1 holds the frame before its op exists.
        let t1 = ss[1].transport().clone();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while t1.mailbox_stats().0 == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the root's frame never came"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let relay = ss[1].broadcast("early", &[0; 12], Rank(0));
        let last = ss[2].broadcast("early", &[0; 12], Rank(0));
        for h in [root, relay, last] {
            assert_eq!(h.await.unwrap(), x);
        }
    });
}
