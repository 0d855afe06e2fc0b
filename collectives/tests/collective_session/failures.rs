//! Bad input and faults: disagreeing specs, lost and missing peers, stale
//! and hostile frames, invalid arguments.

use super::*;

/// Rank 2 disagrees with the others on one property of the op. No rank
/// hangs, completes or sees corrupted data: every rank fails with a
/// mismatch naming rank 2, fast, also a rank whose part of the data ends
/// before any of rank 2's frames could reach it (a reduce or gather leaf,
/// a broadcast root): rooted ops end with confirmations through the tree.
#[test]
fn disagreeing_specs_fail_everywhere_with_names() {
    rt().block_on(async {
        let n = 4;
        let base = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: 8,
            check: 0,
        };
        let bcast = |root| OpSpec {
            kind: OpKind::Broadcast { root: Rank(root) },
            ..base
        };
        let reduce = |root| OpSpec {
            kind: OpKind::Reduce {
                op: ReduceOp::Sum,
                root: Rank(root),
            },
            ..base
        };
        let gather = OpSpec {
            kind: OpKind::Gather { root: Rank(1) },
            ..base
        };
        // (name, spec of the others, spec of rank 2)
        let checked = |spec: OpSpec, check| OpSpec { check, ..spec };
        let variants: [(&str, OpSpec, OpSpec); 13] = [
            ("count", base, OpSpec { count: 9, ..base }),
            // same spec, other checks (tensors of one count, other shapes)
            ("check", checked(base, 5), checked(base, 6)),
            ("check-unset", checked(base, 5), base),
            ("bcast-check", checked(bcast(1), 5), checked(bcast(1), 6)),
            (
                "gather-check",
                checked(gather, 1 << 40),
                checked(gather, 1 << 41),
            ),
            (
                "op",
                base,
                OpSpec {
                    kind: OpKind::Allreduce(ReduceOp::Max),
                    ..base
                },
            ),
            // same byte count, other type: must not be reduced as f32
            (
                "dtype",
                base,
                OpSpec {
                    dtype: DType::U32,
                    ..base
                },
            ),
            ("zero-count", base, OpSpec { count: 0, ..base }),
            ("root", bcast(0), bcast(1)),
            ("root-is-the-odd-one", bcast(1), bcast(2)),
            ("reduce-root", reduce(0), reduce(3)),
            (
                "reduce-count",
                reduce(0),
                OpSpec {
                    count: 9,
                    ..reduce(0)
                },
            ),
            ("gather-count", gather, OpSpec { count: 0, ..gather }),
        ];
        for strategy in [
            Strategy::Star,
            Strategy::Ring,
            Strategy::BinaryTree,
            Strategy::Clique,
        ] {
            for (name, normal, odd) in variants {
                let ss = sessions(n, strategy, 11, Duration::from_secs(20));
                let started = std::time::Instant::now();
                let specs: Vec<OpSpec> =
                    (0..n).map(|r| if r == 2 { odd } else { normal }).collect();
                let handles: Vec<_> = ss
                    .iter()
                    .zip(&specs)
                    .enumerate()
                    .map(|(r, (s, spec))| {
                        s.submit(
                            name,
                            *spec,
                            &vec![r as u8 + 1; spec.input_len(Rank(r as u32), n).unwrap()],
                        )
                    })
                    .collect();
                for (r, h) in handles.into_iter().enumerate() {
                    match h.await {
                        Err(CollectiveError::Mismatch {
                            name: got,
                            ranks,
                            detail,
                            ..
                        }) => {
                            assert_eq!(&*got, name);
                            assert!(
                                ranks.contains(&Rank(2)),
                                "{strategy} {name}: rank {r}: {ranks:?} ({detail})"
                            );
                        }
                        Ok(out) => panic!("{strategy} {name}: rank {r} completed: {out:?}"),
                        Err(e) => {
                            panic!("{strategy} {name}: rank {r}: expected a mismatch, got {e}")
                        }
                    }
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "{strategy} {name}: too slow"
                );
            }
        }
    });
}

/// Ranks that give the same check run the op as without one, plan
/// cached or not; the same spec under another check after it too.
#[test]
fn equal_checks_complete() {
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Ring, 3, Duration::from_secs(20));
        for (i, check) in [7u64, 7, u64::MAX, 0].into_iter().enumerate() {
            let spec = OpSpec {
                kind: OpKind::Allreduce(ReduceOp::Sum),
                dtype: DType::U8,
                count: 5,
                check,
            };
            let name = format!("checked/{i}");
            let handles: Vec<_> = ss
                .iter()
                .enumerate()
                .map(|(r, s)| s.submit(&name, spec, &[r as u8 + 1; 5]))
                .collect();
            for h in handles {
                let out = h.await.unwrap();
                assert_eq!(out.bytes().unwrap(), &[6u8; 5], "check {check}");
            }
        }
    });
}

/// Every rank names itself the root of a broadcast (the torch backend's
/// hole: each completed with its own data): every rank refuses it.
#[test]
fn a_broadcast_where_every_rank_is_the_root_fails_everywhere() {
    rt().block_on(async {
        for n in [2, 4] {
            for strategy in [Strategy::Star, Strategy::Ring, Strategy::BinaryTree] {
                let ss = sessions(n, strategy, 5, Duration::from_secs(20));
                let handles: Vec<_> = ss
                    .iter()
                    .enumerate()
                    .map(|(r, s)| {
                        let spec = OpSpec {
                            kind: OpKind::Broadcast {
                                root: Rank(r as u32),
                            },
                            dtype: DType::U8,
                            count: 16,
                            check: 0,
                        };
                        s.submit("roots", spec, &[r as u8 + 1; 16])
                    })
                    .collect();
                for (r, h) in handles.into_iter().enumerate() {
                    match h.await {
                        Err(CollectiveError::Mismatch { ranks, .. }) => {
                            assert!(ranks.len() == 2, "{strategy} n={n} rank {r}: {ranks:?}")
                        }
                        other => panic!("{strategy} n={n} rank {r}: {other:?}"),
                    }
                }
            }
        }
    });
}

/// A rank that dies: pending and later ops that need it fail with an error
/// naming it, within the deadline.
#[test]
fn lost_peer_fails_pending_and_later_ops() {
    rt().block_on(async {
        let n = 4;
        let ts = MemNetwork::new(n, MemConfig::default());
        let ss: Vec<_> = ts
            .iter()
            .map(|t| {
                Session::new(
                    t.clone(),
                    PeerList::local(n),
                    SessionConfig {
                        strategy: Strategy::Ring,
                        op_timeout: Duration::from_secs(20),
                        ..SessionConfig::default()
                    },
                )
                .unwrap()
            })
            .collect();
        // ranks 0..3 start an op; rank 3 never does, then dies
        let pending: Vec<_> = ss[..3]
            .iter()
            .map(|s| s.allreduce("x", &[1.0f32; 64], ReduceOp::Sum))
            .collect();
        // Kill rank 3 once all three ops are waiting for it: in the ring of
        // 64 floats (segments of 64 bytes) rank 2's third frame to rank 3
        // needs rank 1's second, which needs rank 0's first, so with 192
        // bytes queued for rank 3 every op has sent what it could.
        let deadline = std::time::Instant::now() + LONG;
        while ts[3].mailbox_stats().0 < 3 * 64 {
            assert!(
                std::time::Instant::now() < deadline,
                "the ops never started"
            );
            tokio::task::yield_now().await;
        }
        assert_eq!(ts[3].mailbox_stats().0, 3 * 64, "nothing more can come");
        let started = std::time::Instant::now();
        ts[3].kill();
        all_fail_losing(pending, Rank(3), "x", started).await;
        // a later op fails at once
        match ss[0].allreduce("y", &[1.0f32], ReduceOp::Sum).await {
            Err(CollectiveError::PeerLost { peer, .. }) => assert_eq!(peer, Rank(3)),
            other => panic!("{other:?}"),
        }
    });
}

/// A rank that never joins an op: the others fail by the deadline, and the
/// error names the rank they wait for (directly, or through the abort of the
/// rank that timed out first).
#[test]
fn missing_rank_times_out_naming_it() {
    rt().block_on(async {
        let ss = sessions(3, Strategy::Star, 1, Duration::from_millis(300));
        // rank 0 is the star's root: it waits for rank 2 by name; rank 1
        // waits for the root's broadcast
        let started = std::time::Instant::now();
        let h0 = ss[0].allreduce("lonely", &[1u8], ReduceOp::Sum);
        // rank 1 joins 100 ms later, so that the root's timeout (which
        // names rank 2) comes first: with both at once, rank 1's could
        // fire first under load and abort the op naming only the root
        tokio::time::sleep(Duration::from_millis(100)).await;
        let h1 = ss[1].allreduce("lonely", &[1u8], ReduceOp::Sum);
        let e0 = h0.await.unwrap_err();
        let e1 = h1.await.unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3));
        for e in [&e0, &e1] {
            match e {
                CollectiveError::Timeout { waiting, .. } => {
                    assert!(
                        waiting == &vec![Rank(2)] || waiting == &vec![Rank(0)],
                        "{e}"
                    )
                }
                CollectiveError::Aborted { reason, .. } => {
                    assert!(reason.contains("timed out waiting for rank"), "{e}")
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(
            e0.to_string().contains("[2]") || e1.to_string().contains("rank 2"),
            "{e0} / {e1}"
        );
    });
}

/// Frames of an older epoch are refused and counted; a hostile frame for a
/// live op fails that op with a protocol error naming the sender, on every
/// rank, and never panics.
#[test]
fn stale_and_hostile_frames() {
    rt().block_on(async {
        let cfg = MemConfig {
            epoch: Epoch(5),
            ..MemConfig::default()
        };
        let ts = MemNetwork::new(2, cfg);
        let ss: Vec<_> = ts
            .iter()
            .map(|t| {
                // A star: rank 1 needs rank 0's result, so it cannot finish
                // before rank 0's abort reaches it (with recursive doubling
                // it would finish, correctly, from rank 0's first frame).
                let cfg = SessionConfig {
                    strategy: Strategy::Star,
                    ..SessionConfig::default()
                };
                Session::new(t.clone(), PeerList::local(2), cfg).unwrap()
            })
            .collect();
        let tag = OpTag {
            epoch: Epoch(4),
            op: kungfu_collectives::names::op_id("v"),
            seq: 0,
        };
        let h = Header {
            kind: FrameKind::Data,
            tag,
            chunk: 0,
            step: 0,
            digest: 0,
            len: 0,
        };
        let r = ts[0].inject(Rank(1), h, Bytes::from_static(b"junk")).await;
        assert!(
            matches!(r, Err(kungfu_transport::TransportError::StaleEpoch { .. })),
            "{r:?}"
        );
        assert_eq!(ts[0].mailbox_stats(), (0, 1));

        // a data frame with the right digest but a chunk the plan does not
        // expect, while rank 0 runs the op alone (the transport holds frames
        // by tag, so it reaches the op whenever the op asks)
        let h0 = ss[0].allreduce("v", &[1.0f32; 4], ReduceOp::Sum);
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: 4,
            check: 0,
        };
        let topo = ss[0].topology(kungfu_topology::Root::Any, 16);
        let bad = Header {
            tag: OpTag {
                epoch: Epoch(5),
                ..tag
            },
            chunk: 99,
            digest: spec.digest(&topo).short(),
            ..h
        };
        ts[0].inject(Rank(1), bad, Bytes::new()).await.unwrap();
        match h0.await {
            Err(CollectiveError::Protocol { peer, reason, .. }) => {
                assert_eq!(peer, Rank(1));
                assert!(reason.contains("unexpected frame"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // rank 1 then joins and learns of the failure from rank 0's abort
        match ss[1].allreduce("v", &[1.0f32; 4], ReduceOp::Sum).await {
            Err(CollectiveError::Aborted { by, reason, .. }) => {
                assert_eq!(by, Rank(0));
                assert!(reason.contains("protocol violation by rank 1"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
    });
}

#[test]
fn invalid_arguments_fail_at_once() {
    rt().block_on(async {
        let ss = sessions(2, Strategy::Auto, 1, LONG);
        let s = &ss[0];
        let e = s.allreduce("i", &[1i32], ReduceOp::Avg).await.unwrap_err();
        assert!(matches!(e, CollectiveError::InvalidArgument { .. }), "{e}");
        let e = s.broadcast("b", &[1i32], Rank(7)).await.unwrap_err();
        assert!(e.to_string().contains("root 7"), "{e}");
        let e = s
            .reduce_scatter("rs", &[1i32; 3], ReduceOp::Sum)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("equal blocks"), "{e}");
        let e = s.allreduce("", &[1i32], ReduceOp::Sum).await.unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F64,
            count: 3,
            check: 0,
        };
        let e = s.submit("raw", spec, &[0u8; 23]).await.unwrap_err();
        assert!(e.to_string().contains("24 input bytes"), "{e}");
    });
}
