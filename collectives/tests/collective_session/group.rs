//! Fusion (`Session::group`): members fused per (type, operator) in name
//! order under the name the C ABI always used, and how members fail.

use super::*;

use kungfu_collectives::{Group, OpHandle};

/// The fused op's name, written out here rather than taken from the
/// library (so a change to the rule fails): `kf/group/`, the FNV-1a 64
/// hash of the member names each followed by a NUL, `/`, their number.
fn fused_name(names: &[&str]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in names.iter().flat_map(|n| n.bytes().chain([0])) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("kf/group/{h:016x}/{}", names.len())
}

/// A member's elements, in its type.
enum Vals {
    F32(Vec<f32>),
    U64(Vec<u64>),
    I32(Vec<i32>),
    I16(Vec<i16>),
}

impl Vals {
    fn new(dtype: DType, v: impl Iterator<Item = i64>) -> Vals {
        match dtype {
            DType::F32 => Vals::F32(v.map(|x| x as f32).collect()),
            DType::U64 => Vals::U64(v.map(|x| x as u64).collect()),
            DType::I32 => Vals::I32(v.map(|x| x as i32).collect()),
            DType::I16 => Vals::I16(v.map(|x| x as i16).collect()),
            other => panic!("no test values of {other}"),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Vals::F32(v) => bytemuck::cast_slice(v),
            Vals::U64(v) => bytemuck::cast_slice(v),
            Vals::I32(v) => bytemuck::cast_slice(v),
            Vals::I16(v) => bytemuck::cast_slice(v),
        }
    }

    /// Adds the member through the typed API; its result as bytes.
    fn add<'a>(
        &'a self,
        g: &mut Group<'a, MemTransport>,
        name: &str,
        op: ReduceOp,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<u8>, CollectiveError>> + Send>> {
        fn bytes_of<E: bytemuck::Pod + Send>(
            h: OpHandle<Vec<E>>,
        ) -> Pin<Box<dyn Future<Output = Result<Vec<u8>, CollectiveError>> + Send>> {
            Box::pin(async move { h.await.map(|v| bytemuck::cast_slice(&v).to_vec()) })
        }
        match self {
            Vals::F32(v) => bytes_of(g.allreduce(name, v, op)),
            Vals::U64(v) => bytes_of(g.allreduce(name, v, op)),
            Vals::I32(v) => bytes_of(g.allreduce(name, v, op)),
            Vals::I16(v) => bytes_of(g.allreduce(name, v, op)),
        }
    }
}

/// The members of the first test: names whose byte order differs from
/// the table's ("Zeta" < "grad/fc1" < "grad/fc10" < "grad/fc2" < "norm"),
/// an empty member, and "dup" under two operators of one type.
const MEMBERS: [(&str, DType, ReduceOp, usize); 10] = [
    ("grad/fc2", DType::F32, ReduceOp::Sum, 3),
    ("grad/fc1", DType::F32, ReduceOp::Sum, 5),
    ("grad/empty", DType::F32, ReduceOp::Sum, 0),
    ("grad/fc10", DType::F32, ReduceOp::Sum, 2),
    ("norm", DType::F32, ReduceOp::Max, 2),
    ("Zeta", DType::F32, ReduceOp::Max, 1),
    ("steps", DType::U64, ReduceOp::Max, 1),
    ("count", DType::I32, ReduceOp::Sum, 4),
    ("dup", DType::I16, ReduceOp::Min, 3),
    ("dup", DType::I16, ReduceOp::Max, 3),
];

/// Member `k`'s input on rank `r`: small integers, so sums are exact in
/// every type, different per rank, so min, max and sum differ.
fn input(k: usize, r: usize) -> impl Iterator<Item = i64> {
    let len = MEMBERS[k].3;
    (0..len).map(move |i| ((k * 7 + i * 3 + r * 5) % 50) as i64)
}

/// Member `k`'s result over `n` ranks, reduced here.
fn expected(k: usize, n: usize) -> Vals {
    let (_, dtype, op, len) = MEMBERS[k];
    let per_rank: Vec<Vec<i64>> = (0..n).map(|r| input(k, r).collect()).collect();
    let v = (0..len).map(|i| {
        let xs = per_rank.iter().map(|x| x[i]);
        match op {
            ReduceOp::Sum => xs.sum(),
            ReduceOp::Max => xs.max().unwrap(),
            ReduceOp::Min => xs.min().unwrap(),
            other => panic!("no test of {other}"),
        }
    });
    Vals::new(dtype, v)
}

/// Ranks 0 and 1 add the members in opposite orders (rank 1 partly
/// through the raw callback API); rank 2 runs no group but the fused
/// allreduces themselves, written out below, under the names the rule
/// gives and in the order it says they start. Every rank gets exact
/// results, and ranks 0 and 1 ran 6 ops, not 10: only if the group fuses
/// exactly as written do rank 2's ops meet theirs (a wrong name never
/// meets and times out; a wrong member order gives wrong values; the two
/// "dup" ops share a name, so starting them in the wrong order pairs a
/// min with a max: a mismatch).
#[test]
fn group_fuses_by_type_and_op_in_name_order() {
    // (type, operator, members in name order), in the order they start
    const FUSED: [(DType, ReduceOp, &[&str]); 6] = [
        (DType::I16, ReduceOp::Max, &["dup"]),
        (DType::I16, ReduceOp::Min, &["dup"]),
        (DType::I32, ReduceOp::Sum, &["count"]),
        (DType::U64, ReduceOp::Max, &["steps"]),
        (DType::F32, ReduceOp::Max, &["Zeta", "norm"]),
        (
            DType::F32,
            ReduceOp::Sum,
            &["grad/empty", "grad/fc1", "grad/fc10", "grad/fc2"],
        ),
    ];
    let member = |name: &str, dtype: DType, op: ReduceOp| {
        MEMBERS
            .iter()
            .position(|m| (m.0, m.1, m.2) == (name, dtype, op))
            .expect("a member of the table")
    };
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Ring, 5, Duration::from_secs(10));
        let mut tasks = Vec::new();
        for s in ss {
            tasks.push(tokio::spawn(async move {
                let r = s.rank().idx();
                if r == 2 {
                    for (dtype, op, names) in FUSED {
                        let ks: Vec<usize> = names.iter().map(|m| member(m, dtype, op)).collect();
                        let mut bytes = Vec::new();
                        let mut want = Vec::new();
                        for &k in &ks {
                            bytes.extend_from_slice(Vals::new(dtype, input(k, r)).bytes());
                            want.extend_from_slice(expected(k, n).bytes());
                        }
                        let spec = OpSpec {
                            kind: OpKind::Allreduce(op),
                            dtype,
                            count: bytes.len() / dtype.size(),
                            check: 0,
                        };
                        let got = s.submit(&fused_name(names), spec, &bytes).await.unwrap();
                        assert_eq!(got.bytes().unwrap(), &want[..], "{names:?} {op}");
                    }
                } else {
                    let vals: Vec<Vals> = (0..MEMBERS.len())
                        .map(|k| Vals::new(MEMBERS[k].1, input(k, r)))
                        .collect();
                    let mut order: Vec<usize> = (0..MEMBERS.len()).collect();
                    if r == 1 {
                        order.reverse();
                    }
                    let mut g = s.group();
                    let mut results = Vec::new();
                    for k in order {
                        let (name, dtype, op, _) = MEMBERS[k];
                        let got = if r == 1 && k % 2 == 0 {
                            let (tx, rx) = tokio::sync::oneshot::channel();
                            let done = Box::new(move |res: Result<&[u8], CollectiveError>| {
                                let _ = tx.send(res.map(<[u8]>::to_vec));
                            });
                            g.allreduce_with_callback(name, dtype, op, vals[k].bytes(), done);
                            Box::pin(async move { rx.await.expect("the callback ran") })
                        } else {
                            vals[k].add(&mut g, name, op)
                        };
                        results.push((k, got));
                    }
                    g.submit();
                    for (k, got) in results {
                        let got = got
                            .await
                            .unwrap_or_else(|e| panic!("{:?}: {e}", MEMBERS[k]));
                        assert_eq!(got, expected(k, n).bytes(), "{:?}", MEMBERS[k]);
                    }
                }
                let ops: u64 = s.op_stats().iter().map(|(_, o)| o.ops).sum();
                assert_eq!(
                    ops,
                    FUSED.len() as u64,
                    "rank {r}: one op per (type, operator)"
                );
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// A group dropped unsubmitted fails its members at once, naming them,
/// and starts nothing: the same members grouped again afterwards meet the
/// other rank's first group, with this rank's new inputs.
#[test]
fn a_dropped_group_fails_its_members_and_starts_nothing() {
    rt().block_on(async {
        let ss = sessions(2, Strategy::Star, 9, Duration::from_secs(10));
        let mut tasks = Vec::new();
        for s in ss {
            tasks.push(tokio::spawn(async move {
                let r = s.rank().0;
                if r == 0 {
                    let stale = [100.0f32; 4];
                    let mut g = s.group();
                    let mut a = g.allreduce("a", &stale, ReduceOp::Sum);
                    let (tx, mut rx) = tokio::sync::oneshot::channel();
                    g.allreduce_with_callback(
                        "b",
                        DType::F32,
                        ReduceOp::Sum,
                        bytemuck::cast_slice(&stale),
                        Box::new(move |res| drop(tx.send(res.map(<[u8]>::to_vec)))),
                    );
                    drop(g);
                    let a = a.try_result().expect("failed by the drop");
                    let b = rx.try_recv().expect("called back by the drop");
                    for (want, r) in [("a", a.map(|_| ())), ("b", b.map(|_| ()))] {
                        match r {
                            Err(CollectiveError::InvalidArgument { name, reason }) => {
                                assert_eq!(&*name, want);
                                assert!(reason.contains("dropped"), "{reason}");
                            }
                            other => panic!("{want}: {other:?}"),
                        }
                    }
                }
                let x = [r as f32 + 1.0; 4];
                let mut g = s.group();
                let a = g.allreduce("a", &x, ReduceOp::Sum);
                let b = g.allreduce("b", &x, ReduceOp::Sum);
                g.submit();
                assert_eq!(a.await.unwrap(), vec![3.0; 4]);
                assert_eq!(b.await.unwrap(), vec![3.0; 4]);
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Members refused when added fail at once and are left out of the fused
/// op (rank 0 adds them, rank 1 does not, and their fused ops still meet);
/// a fused op that fails fails each of its members with its error, while
/// the group's other fused ops complete.
#[test]
fn refused_members_fail_alone_and_a_failed_fused_op_fails_its_members() {
    rt().block_on(async {
        let ss = sessions(2, Strategy::Star, 13, Duration::from_secs(10));
        let mut tasks = Vec::new();
        for s in ss {
            tasks.push(tokio::spawn(async move {
                let r = s.rank().0;
                let x = [r as f32 + 1.0; 2];
                let ints = [1i32; 2];
                // rank 1's "p" has another count: its fused op mismatches
                let p = vec![1.0f32; 2 + r as usize];
                let q = [u64::from(r) + 7];
                let mut g = s.group();
                let ok = g.allreduce("x", &x, ReduceOp::Sum);
                let p = g.allreduce("p", &p, ReduceOp::Min);
                let q = g.allreduce("q", &q, ReduceOp::Max);
                if r == 0 {
                    let mut refused = [
                        ("", g.allreduce("", &x, ReduceOp::Sum)),
                        ("bad\0name", g.allreduce("bad\0name", &x, ReduceOp::Sum)),
                    ];
                    let mut avg = g.allreduce("avg/int", &ints, ReduceOp::Avg);
                    let (tx, mut rx) = tokio::sync::oneshot::channel();
                    g.allreduce_with_callback(
                        "odd/bytes",
                        DType::F32,
                        ReduceOp::Sum,
                        &[0u8; 3],
                        Box::new(move |res| drop(tx.send(res.map(<[u8]>::to_vec)))),
                    );
                    let odd = rx.try_recv().expect("refused at once").map(|_| ());
                    let mut results: Vec<_> = refused
                        .iter_mut()
                        .map(|(name, h)| {
                            let r = h.try_result().expect("refused at once").map(|_| ());
                            (name.to_string(), r)
                        })
                        .collect();
                    results.push(("odd/bytes".into(), odd));
                    let avg = avg.try_result().expect("refused at once").map(|_| ());
                    results.push(("avg/int".into(), avg));
                    for (want, r) in results {
                        match r {
                            Err(CollectiveError::InvalidArgument { name, .. }) => {
                                assert_eq!(*name, *want);
                            }
                            other => panic!("{want:?}: {other:?}"),
                        }
                    }
                }
                g.submit();
                assert_eq!(ok.await.unwrap(), vec![3.0; 2]);
                assert_eq!(q.await.unwrap(), vec![8]);
                match p.await {
                    Err(e @ CollectiveError::Mismatch { .. }) => {
                        let name = e.op_name().unwrap();
                        assert_eq!(name, fused_name(&["p"]), "{e}");
                    }
                    other => panic!("p: {other:?}"),
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

/// Members' checks: equal ones fuse and complete; one member whose check
/// differs on one rank fails the fused op, so all its members, on every
/// rank, while the other batch (another type) completes.
#[test]
fn members_checks_go_into_the_fused_op() {
    rt().block_on(async {
        let n = 3;
        let ss = sessions(n, Strategy::Ring, 3, Duration::from_secs(20));
        for odd in [false, true] {
            let tasks: Vec<_> = ss
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let s = s.clone();
                    tokio::spawn(async move {
                        let got = |tx: tokio::sync::oneshot::Sender<_>| {
                            Box::new(move |res: Result<&[u8], CollectiveError>| {
                                drop(tx.send(res.map(<[u8]>::to_vec)))
                            })
                        };
                        let (ta, a) = tokio::sync::oneshot::channel();
                        let (tb, b) = tokio::sync::oneshot::channel();
                        let (tc, c) = tokio::sync::oneshot::channel();
                        let input = [1u8; 4];
                        let mut g = s.group();
                        let b_check = if odd && r == 1 { 3 } else { 2 };
                        g.allreduce_checked_with_callback(
                            "a",
                            DType::U8,
                            ReduceOp::Sum,
                            1,
                            &input,
                            got(ta),
                        );
                        g.allreduce_checked_with_callback(
                            "b",
                            DType::U8,
                            ReduceOp::Sum,
                            b_check,
                            &input,
                            got(tb),
                        );
                        g.allreduce_with_callback("c", DType::U16, ReduceOp::Sum, &input, got(tc));
                        g.submit();
                        let (a, b, c) = (a.await.unwrap(), b.await.unwrap(), c.await.unwrap());
                        assert_eq!(c.unwrap(), [3; 4]); // 0x0101 * 3, twice
                        if !odd {
                            assert_eq!(a.unwrap(), [3; 4]);
                            assert_eq!(b.unwrap(), [3; 4]);
                            return;
                        }
                        for res in [a, b] {
                            match res {
                                Err(e @ CollectiveError::Mismatch { .. }) => {
                                    assert_eq!(e.op_name().unwrap(), fused_name(&["a", "b"]));
                                }
                                other => panic!("rank {r}: {other:?}"),
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        }
    });
}
