//! The protocol's pure parts: encodings, queue pair transitions, work
//! requests, completions, and the words for a missing device.

use kungfu_topology::Rank;

use crate::verbs::proto::*;
use crate::{Epoch, OpId, OpTag};

fn info() -> QpInfo {
    QpInfo {
        qpn: 0x12_3456,
        psn: 0xab_cdef,
        lid: 7,
        mtu: 3,
        gid: [9; 16],
        eager_max: 16 << 10,
    }
}

#[test]
fn qp_info_round_trips_and_bad_ones_are_refused() {
    let i = info();
    assert_eq!(QpInfo::decode(&i.encode()), Ok(i));
    let mut b = i.encode();
    b[0] = b'X';
    assert!(QpInfo::decode(&b).unwrap_err().contains("verbs wire"));
    for mtu in [0, 6] {
        let e = QpInfo::decode(&QpInfo { mtu, ..i }.encode()).unwrap_err();
        assert!(e.contains("MTU"), "{e}");
    }
    let e = QpInfo::decode(&QpInfo { qpn: 1 << 24, ..i }.encode()).unwrap_err();
    assert!(e.contains("24 bits"), "{e}");
    let e = QpInfo::decode(&QpInfo { psn: 1 << 24, ..i }.encode()).unwrap_err();
    assert!(e.contains("24 bits"), "{e}");
}

fn port(ethernet: bool, lid: u16) -> LocalPort {
    LocalPort {
        port: 1,
        lid,
        gid: [1; 16],
        gid_index: 3,
        mtu: 5,
        ethernet,
    }
}

#[test]
fn the_first_step_allows_remote_writes_on_port_one() {
    assert_eq!(
        init_step(PORT),
        QpStep::Init {
            port: 1,
            pkey_index: 0,
            remote_write: true
        }
    );
}

#[test]
fn infiniband_peers_are_routed_by_lid_at_the_smaller_mtu() {
    let remote = info();
    let [rtr, rts] = connect_steps(&port(false, 4), 0x42, &remote);
    assert_eq!(
        rtr,
        QpStep::Rtr {
            port: 1,
            mtu: 3,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: MIN_RNR_TIMER,
            dlid: 7,
            grh: None,
        }
    );
    assert_eq!(
        rts,
        QpStep::Rts {
            sq_psn: 0x42,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            // back pressure, not failure: retried without end
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    );
}

#[test]
fn roce_peers_and_peers_without_a_lid_are_routed_by_gid() {
    let grh = Some(Grh {
        dgid: [9; 16],
        sgid_index: 3,
        hop_limit: 64,
    });
    let [rtr, _] = connect_steps(&port(true, 0), 1, &QpInfo { lid: 0, ..info() });
    assert!(matches!(rtr, QpStep::Rtr { grh: g, dlid: 0, .. } if g == grh));
    let [rtr, _] = connect_steps(&port(false, 4), 1, &QpInfo { lid: 0, ..info() });
    assert!(matches!(rtr, QpStep::Rtr { grh: g, .. } if g == grh));
    // the smaller MTU, whichever side has it
    let [rtr, _] = connect_steps(
        &LocalPort {
            mtu: 2,
            ..port(true, 0)
        },
        1,
        &info(),
    );
    assert!(matches!(rtr, QpStep::Rtr { mtu: 2, .. }));
}

#[test]
fn queue_pairs_move_reset_init_rtr_rts_and_to_error_from_anywhere() {
    let [rtr, rts] = connect_steps(&port(false, 1), 1, &info());
    let init = init_step(PORT);
    let mut s = QpState::Reset;
    assert!(!s.can_post_recv() && !s.can_post_send());
    for (step, next) in [
        (init, QpState::Init),
        (rtr, QpState::Rtr),
        (rts, QpState::Rts),
    ] {
        s = s.after(&step).unwrap();
        assert_eq!(s, next);
        assert!(s.can_post_recv());
    }
    assert!(s.can_post_send());
    assert!(!QpState::Rtr.can_post_send());
    for from in [QpState::Reset, QpState::Init, QpState::Rtr, QpState::Rts] {
        assert_eq!(from.after(&QpStep::Error), Ok(QpState::Error));
    }
    for (from, step) in [
        (QpState::Reset, rtr),
        (QpState::Reset, rts),
        (QpState::Init, rts),
        (QpState::Init, init),
        (QpState::Rts, rtr),
        (QpState::Error, init),
    ] {
        let e = from.after(&step).unwrap_err();
        assert!(e.contains("illegal"), "{e}");
    }
    assert!(!QpState::Error.can_post_recv());
}

#[test]
fn work_request_ids_round_trip_and_foreign_ones_are_not_ours() {
    let top = Rank((1 << 24) - 1);
    for id in [
        WrId::Slot {
            peer: Rank(0),
            slot: 0,
        },
        WrId::Slot {
            peer: top,
            slot: u32::MAX,
        },
        WrId::Send {
            peer: Rank(5),
            seq: 77,
        },
        WrId::Write {
            peer: Rank(5),
            seq: 77,
        },
    ] {
        assert_eq!(WrId::decode(id.encode()), Some(id));
    }
    assert_eq!(WrId::decode(0), None);
    assert_eq!(WrId::decode(9 << 56), None);
    assert_ne!(
        WrId::Send {
            peer: Rank(1),
            seq: 1
        }
        .encode(),
        WrId::Write {
            peer: Rank(1),
            seq: 1
        }
        .encode()
    );
}

#[test]
fn immediates_round_trip_and_unknown_ones_are_refused() {
    let max = (1 << RID_BITS) - 1;
    for imm in [
        Imm::Eager,
        Imm::Ready(0),
        Imm::Ready(max),
        Imm::Done(12345),
        Imm::Cancel(1),
        Imm::CancelAck(max),
    ] {
        assert_eq!(Imm::decode(imm.encode()), Some(imm));
    }
    assert_eq!(Imm::decode(0), None);
    assert_eq!(Imm::decode(6 << RID_BITS), None);
    assert_eq!(Imm::decode(Imm::Eager.encode() | 1), None);
    assert_ne!(Imm::Ready(3).encode(), Imm::Done(3).encode());
}

fn ready() -> Ready {
    Ready {
        key: FrameKey {
            tag: OpTag {
                epoch: Epoch(3),
                op: OpId(0xdead_beef_0000_0001),
                seq: 9,
            },
            chunk: 4,
            step: 2,
        },
        len: 1 << 20,
        addr: 0x7f00_0000_1000,
        rkey: 0x55,
        rid: 17,
    }
}

#[test]
fn ready_round_trips_with_its_id_from_the_immediate() {
    let r = ready();
    assert_eq!(Ready::decode(&r.encode(), 17), Some(r));
    assert_eq!(Ready::decode(&r.encode()[..40], 17), None);
}

#[test]
fn messages_are_signaled_sends_with_an_immediate() {
    let sge = Sge {
        addr: 0x1000,
        len: 100,
        lkey: 9,
    };
    let wr = message(Rank(2), 5, Imm::Eager, Some(sge));
    assert_eq!(
        wr,
        SendWr {
            wr_id: WrId::Send {
                peer: Rank(2),
                seq: 5
            }
            .encode(),
            op: Op::SendImm {
                imm: Imm::Eager.encode()
            },
            sge: Some(sge),
            signaled: true,
        }
    );
    // an empty message names no buffer at all
    assert_eq!(message(Rank(2), 6, Imm::Cancel(4), None).sge, None);
}

#[test]
fn a_rendezvous_writes_the_payload_then_sends_the_header_done() {
    let (payload, header) = (
        Sge {
            addr: 0x10_0000,
            len: 1 << 20,
            lkey: 1,
        },
        Sge {
            addr: 0x2000,
            len: 40,
            lkey: 2,
        },
    );
    let r = ready();
    let [write, done] = rendezvous(Rank(1), 8, payload, &r, header);
    assert_eq!(
        write,
        SendWr {
            wr_id: WrId::Write {
                peer: Rank(1),
                seq: 8
            }
            .encode(),
            op: Op::Write {
                addr: r.addr,
                rkey: r.rkey
            },
            sge: Some(payload),
            signaled: false,
        }
    );
    assert_eq!(done, message(Rank(1), 8, Imm::Done(17), Some(header)));
    assert!(done.signaled);
}

fn wc(wr: WrId, status: u32, imm: Option<u32>, byte_len: u32) -> Wc {
    Wc {
        wr_id: wr.encode(),
        status,
        opcode: 0,
        byte_len,
        imm,
    }
}

#[test]
fn completions_are_read_as_arrivals_sends_flushes_and_failures() {
    let (peer, slot, seq) = (Rank(3), 4, 6);
    let s = WrId::Slot { peer, slot };
    assert_eq!(
        classify(&wc(s, status::SUCCESS, Some(Imm::Done(9).encode()), 40)),
        Completion::Received {
            peer,
            slot,
            msg: Some(Imm::Done(9)),
            len: 40
        }
    );
    // a send without an immediate, or with a foreign one
    for imm in [None, Some(0)] {
        assert!(matches!(
            classify(&wc(s, status::SUCCESS, imm, 1)),
            Completion::Received { msg: None, .. }
        ));
    }
    let send = WrId::Send { peer, seq };
    assert_eq!(
        classify(&wc(send, status::SUCCESS, None, 0)),
        Completion::Sent { peer, seq }
    );
    match classify(&wc(send, status::WR_FLUSH_ERR, None, 0)) {
        Completion::Failed { wr, flushed, .. } => assert!(flushed && wr == send),
        other => panic!("{other:?}"),
    }
    let write = WrId::Write { peer, seq };
    for (st, words) in [
        (status::REM_ACCESS_ERR, "refused the access"),
        (status::RETRY_EXC_ERR, "no answer"),
        (status::RNR_RETRY_EXC_ERR, "no receive"),
        (status::LOC_PROT_ERR, "protection"),
        (99, "unknown status"),
    ] {
        match classify(&wc(write, st, None, 0)) {
            Completion::Failed { wr, flushed, why } => {
                assert!(!flushed && wr == write);
                assert!(why.contains(words) && why.contains("RDMA write"), "{why}");
                assert!(why.contains(&format!("status {st}")), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }
    // never signaled: a success is not ours to act on
    assert!(matches!(
        classify(&wc(write, status::SUCCESS, None, 0)),
        Completion::Unknown(_)
    ));
    let foreign = Wc {
        wr_id: 0x1234,
        ..wc(send, status::SUCCESS, None, 0)
    };
    assert_eq!(classify(&foreign), Completion::Unknown(0x1234));
}

#[test]
fn a_missing_device_is_named() {
    let e = device_list_error(Some(libc::EOPNOTSUPP), "Operation not supported", true);
    assert!(
        e.contains("libibverbs.so.1") && e.contains("libibverbs1"),
        "{e}"
    );
    let e = device_list_error(Some(libc::ENOSYS), "Function not implemented", false);
    assert!(
        e.contains(SYSFS_VERBS) && e.contains("ib_uverbs") && e.contains("rdma_rxe"),
        "{e}"
    );
    let e = device_list_error(Some(libc::EIO), "Input/output error", true);
    assert!(
        e.contains("ibv_get_device_list") && e.contains("Input/output"),
        "{e}"
    );
    assert!(no_device().contains("rdma link add"));
    let e = no_such_device("mlx5_9", &["rxe0".into(), "mlx5_0".into()]);
    assert!(
        e.contains("\"mlx5_9\"") && e.contains("rxe0, mlx5_0"),
        "{e}"
    );
    assert!(no_such_device("x", &[]).contains("none"));
}
