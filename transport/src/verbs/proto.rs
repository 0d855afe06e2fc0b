//! The verbs wire's protocol as plain data, with no device: what the
//! bootstrap exchanges ([`QpInfo`]), the queue pair's way to ready-to-send
//! ([`QpStep`], [`QpState`]), the work requests the wire posts
//! ([`SendWr`], [`RecvWr`], [`WrId`], [`Imm`]), the rendezvous message
//! ([`Ready`]), how a completion is read ([`Wc`], [`Completion`]), and what
//! a missing device is called ([`device_list_error`]). Everything here is
//! tested without hardware; `sys` turns it into verbs calls.

use kungfu_topology::Rank;

use crate::{Epoch, OpId, OpTag};

/// The device port the wire uses (the first; multi-port HCAs are named by
/// device, one port each in practice).
pub(crate) const PORT: u8 = 1;

/// RNR NAK timer the receiver asks for: 12 = 0.64 ms before a sender
/// retries a send that found no receive posted.
pub(crate) const MIN_RNR_TIMER: u8 = 12;
/// Local ACK timeout: 4.096 us * 2^14 = 67 ms per try.
pub(crate) const ACK_TIMEOUT: u8 = 14;
/// Transport retries before a silent peer fails the queue pair (7 tries of
/// 67 ms: about half a second).
pub(crate) const RETRY_COUNT: u8 = 7;
/// RNR retries: 7 means without end. A receiver with no slot posted is
/// back pressure (its matcher is full), not a failure; a dead receiver is
/// found by its control link.
pub(crate) const RNR_RETRY: u8 = 7;

// ---- The bootstrap ---------------------------------------------------------

/// What a rank tells a peer about the queue pair it made for it, over
/// their bootstrap link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    /// The queue pair number (24 bits).
    pub qpn: u32,
    /// The first packet sequence number it sends with (24 bits).
    pub psn: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's active MTU as `ibv_mtu` (1 = 256 bytes ... 5 = 4096).
    pub mtu: u8,
    /// The port's GID at the chosen index (RoCE: an IP address).
    pub gid: [u8; 16],
    /// The sender's eager limit: every rank must use the same.
    pub eager_max: u32,
}

impl QpInfo {
    /// Bytes of the encoded form: `"KFV"`, mtu, qpn, psn, lid, two zero
    /// bytes, gid, eager limit (little-endian).
    pub const LEN: usize = 36;
    /// The magic in front, so that a peer of another wire fails clearly.
    const MAGIC: [u8; 3] = *b"KFV";

    pub fn encode(&self) -> [u8; QpInfo::LEN] {
        let mut b = [0u8; QpInfo::LEN];
        b[..3].copy_from_slice(&Self::MAGIC);
        b[3] = self.mtu;
        b[4..8].copy_from_slice(&self.qpn.to_le_bytes());
        b[8..12].copy_from_slice(&self.psn.to_le_bytes());
        b[12..14].copy_from_slice(&self.lid.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32..36].copy_from_slice(&self.eager_max.to_le_bytes());
        b
    }

    /// Decodes and checks the ranges.
    pub fn decode(b: &[u8; QpInfo::LEN]) -> Result<QpInfo, String> {
        if b[..3] != Self::MAGIC {
            return Err(format!(
                "bad queue pair info (magic {:02x?}): the peer does not run the verbs wire",
                &b[..3]
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let info = QpInfo {
            mtu: b[3],
            qpn: u32_at(4),
            psn: u32_at(8),
            lid: u16::from_le_bytes([b[12], b[13]]),
            gid: b[16..32].try_into().expect("16 bytes"),
            eager_max: u32_at(32),
        };
        if !(1..=5).contains(&info.mtu) {
            return Err(format!("bad path MTU code {} (1..=5)", info.mtu));
        }
        if info.qpn >= 1 << 24 || info.psn >= 1 << 24 {
            return Err(format!(
                "queue pair number {:#x} or PSN {:#x} over 24 bits",
                info.qpn, info.psn
            ));
        }
        Ok(info)
    }
}

/// What this rank's port is, for the queue pair's address vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPort {
    pub port: u8,
    pub lid: u16,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// Active MTU as `ibv_mtu`.
    pub mtu: u8,
    /// Ethernet link layer (RoCE, SoftRoCE): routed by GID, with a GRH.
    pub ethernet: bool,
}

// ---- The queue pair's states -----------------------------------------------

/// The global route of a RoCE (or cross-subnet) peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
}

/// One `ibv_modify_qp`: the state it moves to and the attributes that
/// state needs (each variant is exactly the attribute mask of its
/// transition for an RC queue pair).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpStep {
    /// RESET -> INIT: `STATE | PKEY_INDEX | PORT | ACCESS_FLAGS`.
    Init {
        port: u8,
        pkey_index: u16,
        /// Peers may RDMA-write into this pair's memory regions.
        remote_write: bool,
    },
    /// INIT -> RTR: `STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN |
    /// MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER`.
    Rtr {
        port: u8,
        mtu: u8,
        dest_qpn: u32,
        rq_psn: u32,
        max_dest_rd_atomic: u8,
        min_rnr_timer: u8,
        dlid: u16,
        grh: Option<Grh>,
    },
    /// RTR -> RTS: `STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN |
    /// MAX_QP_RD_ATOMIC`.
    Rts {
        sq_psn: u32,
        timeout: u8,
        retry_cnt: u8,
        rnr_retry: u8,
        max_rd_atomic: u8,
    },
    /// Any state -> ERROR: outstanding work requests are flushed, nothing
    /// more is sent or placed.
    Error,
}

/// The first step of a new queue pair.
pub fn init_step(port: u8) -> QpStep {
    QpStep::Init {
        port,
        pkey_index: 0,
        remote_write: true,
    }
}

/// The steps to ready-to-send once the peer's info is known: RTR (to the
/// peer's queue pair, at the smaller MTU, routed by GID on Ethernet or
/// where the peer has no LID), then RTS from `local_psn`.
pub fn connect_steps(local: &LocalPort, local_psn: u32, remote: &QpInfo) -> [QpStep; 2] {
    let grh = (local.ethernet || remote.lid == 0).then_some(Grh {
        dgid: remote.gid,
        sgid_index: local.gid_index,
        hop_limit: 64,
    });
    [
        QpStep::Rtr {
            port: local.port,
            mtu: local.mtu.min(remote.mtu),
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: MIN_RNR_TIMER,
            dlid: remote.lid,
            grh,
        },
        QpStep::Rts {
            sq_psn: local_psn,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rnr_retry: RNR_RETRY,
            max_rd_atomic: 1,
        },
    ]
}

/// A queue pair's state, as far as the wire moves it (what the fake
/// device enforces).
#[cfg_attr(not(any(test, feature = "verbs-fake")), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

#[cfg_attr(not(any(test, feature = "verbs-fake")), allow(dead_code))]
impl QpState {
    /// The state after `step`, if the transition is legal for RC.
    pub fn after(self, step: &QpStep) -> Result<QpState, String> {
        let next = match (self, step) {
            (QpState::Reset, QpStep::Init { .. }) => QpState::Init,
            (QpState::Init, QpStep::Rtr { .. }) => QpState::Rtr,
            (QpState::Rtr, QpStep::Rts { .. }) => QpState::Rts,
            (_, QpStep::Error) => QpState::Error,
            (s, step) => return Err(format!("illegal queue pair transition {s:?} -> {step:?}")),
        };
        Ok(next)
    }

    /// Receives may be posted from INIT on (they are kept while an error
    /// state flushes them).
    pub fn can_post_recv(self) -> bool {
        matches!(self, QpState::Init | QpState::Rtr | QpState::Rts)
    }

    /// Sends only in RTS.
    pub fn can_post_send(self) -> bool {
        self == QpState::Rts
    }
}

// ---- Work requests ---------------------------------------------------------

/// A registered local buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `IBV_WR_SEND_WITH_IMM`: a message into the peer's next posted
    /// receive, with 32 bits beside it.
    SendImm { imm: u32 },
    /// `IBV_WR_RDMA_WRITE`: into the peer's registered memory, no receive
    /// consumed, no completion there.
    Write { addr: u64, rkey: u32 },
}

/// A send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub op: Op,
    /// None for an empty message (never a zero-length element: some
    /// providers read a zero length as 2 GiB).
    pub sge: Option<Sge>,
    /// Asks for a completion (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
}

/// A receive-queue work request: one eager slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sge: Sge,
}

/// What a work request id names: the wire's own 64 bits, `kind << 56 |
/// peer << 32 | index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WrId {
    /// A receive slot of the queue pair to `peer`.
    Slot { peer: Rank, slot: u32 },
    /// A signaled send (a message, or the last of a rendezvous pair).
    Send { peer: Rank, seq: u32 },
    /// The unsignaled write of rendezvous `seq` (seen only if it fails).
    Write { peer: Rank, seq: u32 },
}

impl WrId {
    pub fn encode(self) -> u64 {
        let (kind, peer, idx) = match self {
            WrId::Slot { peer, slot } => (1u64, peer, slot),
            WrId::Send { peer, seq } => (2, peer, seq),
            WrId::Write { peer, seq } => (3, peer, seq),
        };
        debug_assert!(peer.0 < 1 << 24, "ranks fit 24 bits (checked at connect)");
        kind << 56 | u64::from(peer.0 & 0xff_ffff) << 32 | u64::from(idx)
    }

    pub fn decode(id: u64) -> Option<WrId> {
        let peer = Rank(((id >> 32) & 0xff_ffff) as u32);
        let idx = id as u32;
        match id >> 56 {
            1 => Some(WrId::Slot { peer, slot: idx }),
            2 => Some(WrId::Send { peer, seq: idx }),
            3 => Some(WrId::Write { peer, seq: idx }),
            _ => None,
        }
    }

    pub fn peer(self) -> Rank {
        match self {
            WrId::Slot { peer, .. } | WrId::Send { peer, .. } | WrId::Write { peer, .. } => peer,
        }
    }
}

/// Bits of a receive id (the rest of an immediate names the message).
pub const RID_BITS: u32 = 28;
const RID_MASK: u32 = (1 << RID_BITS) - 1;

/// The immediate of every message: what it is, and which posted receive
/// it concerns (`kind << 28 | rid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    /// A whole frame: header and payload.
    Eager,
    /// Receiver to sender: receive `rid` is posted (body: [`Ready`]).
    Ready(u32),
    /// Sender to receiver: the payload of `rid` is written (body: the
    /// frame's header).
    Done(u32),
    /// Receiver to sender: receive `rid` is withdrawn (its op ended).
    Cancel(u32),
    /// Sender to receiver: `rid` was not and will not be written.
    CancelAck(u32),
}

impl Imm {
    pub fn encode(self) -> u32 {
        let (kind, rid) = match self {
            Imm::Eager => (1, 0),
            Imm::Ready(r) => (2, r),
            Imm::Done(r) => (3, r),
            Imm::Cancel(r) => (4, r),
            Imm::CancelAck(r) => (5, r),
        };
        debug_assert!(rid <= RID_MASK);
        kind << RID_BITS | (rid & RID_MASK)
    }

    pub fn decode(imm: u32) -> Option<Imm> {
        let rid = imm & RID_MASK;
        match imm >> RID_BITS {
            1 if rid == 0 => Some(Imm::Eager),
            2 => Some(Imm::Ready(rid)),
            3 => Some(Imm::Done(rid)),
            4 => Some(Imm::Cancel(rid)),
            5 => Some(Imm::CancelAck(rid)),
            _ => None,
        }
    }
}

/// A message with `imm` from an eager slot or none (`sge`), signaled: its
/// completion frees what it holds.
pub fn message(peer: Rank, seq: u32, imm: Imm, sge: Option<Sge>) -> SendWr {
    SendWr {
        wr_id: WrId::Send { peer, seq }.encode(),
        op: Op::SendImm { imm: imm.encode() },
        sge,
        signaled: true,
    }
}

/// The rendezvous pair: the payload written where `ready` says, then the
/// header as `Done(rid)`. Only the second is signaled; RC executes them
/// in order, so the receiver's completion of the header means the payload
/// is in place, and the sender's means both are done.
pub fn rendezvous(peer: Rank, seq: u32, payload: Sge, ready: &Ready, header: Sge) -> [SendWr; 2] {
    [
        SendWr {
            wr_id: WrId::Write { peer, seq }.encode(),
            op: Op::Write {
                addr: ready.addr,
                rkey: ready.rkey,
            },
            sge: Some(payload),
            signaled: false,
        },
        message(peer, seq, Imm::Done(ready.rid), Some(header)),
    ]
}

/// Receive slot `slot` of the queue pair to `peer`.
pub fn slot_recv(peer: Rank, slot: u32, sge: Sge) -> RecvWr {
    RecvWr {
        wr_id: WrId::Slot { peer, slot }.encode(),
        sge,
    }
}

// ---- The rendezvous message ------------------------------------------------

/// Which frame a posted receive is for (the receiver's `RecvKey` less the
/// sender, who is the peer it goes to).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrameKey {
    pub tag: OpTag,
    pub chunk: u32,
    pub step: u16,
}

/// Receiver to sender: where to write the frame `key` (`len` bytes), and
/// the id that names this receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ready {
    pub key: FrameKey,
    pub len: u64,
    pub addr: u64,
    pub rkey: u32,
    /// Travels in the immediate, not in the body.
    pub rid: u32,
}

impl Ready {
    /// Bytes of the body.
    pub const LEN: usize = 44;

    pub fn encode(&self) -> [u8; Ready::LEN] {
        let mut b = [0u8; Ready::LEN];
        b[0..4].copy_from_slice(&self.key.tag.epoch.0.to_le_bytes());
        b[4..12].copy_from_slice(&self.key.tag.op.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.key.tag.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.key.chunk.to_le_bytes());
        b[20..22].copy_from_slice(&self.key.step.to_le_bytes());
        // 22..24: zero
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.addr.to_le_bytes());
        b[40..44].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8], rid: u32) -> Option<Ready> {
        let b: &[u8; Ready::LEN] = b.try_into().ok()?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Some(Ready {
            key: FrameKey {
                tag: OpTag {
                    epoch: Epoch(u32_at(0)),
                    op: OpId(u64_at(4)),
                    seq: u32_at(12),
                },
                chunk: u32_at(16),
                step: u16::from_le_bytes([b[20], b[21]]),
            },
            len: u64_at(24),
            addr: u64_at(32),
            rkey: u32_at(40),
            rid,
        })
    }
}

// ---- Completions -----------------------------------------------------------

/// `ibv_wc_status` values (the verbs ABI; `sys` checks them against the
/// bindings).
pub mod status {
    pub const SUCCESS: u32 = 0;
    pub const LOC_LEN_ERR: u32 = 1;
    pub const LOC_QP_OP_ERR: u32 = 2;
    pub const LOC_PROT_ERR: u32 = 4;
    pub const WR_FLUSH_ERR: u32 = 5;
    pub const BAD_RESP_ERR: u32 = 7;
    pub const LOC_ACCESS_ERR: u32 = 8;
    pub const REM_INV_REQ_ERR: u32 = 9;
    pub const REM_ACCESS_ERR: u32 = 10;
    pub const REM_OP_ERR: u32 = 11;
    pub const RETRY_EXC_ERR: u32 = 12;
    pub const RNR_RETRY_EXC_ERR: u32 = 13;
    pub const REM_ABORT_ERR: u32 = 16;
    pub const FATAL_ERR: u32 = 19;
    pub const RESP_TIMEOUT_ERR: u32 = 20;
    pub const GENERAL_ERR: u32 = 21;
}

/// `ibv_wc_opcode` values the wire sees.
pub mod opcode {
    pub const SEND: u32 = 0;
    pub const RDMA_WRITE: u32 = 1;
    pub const RECV: u32 = 128;
}

/// What a status means, in words.
pub fn status_text(s: u32) -> String {
    let text = match s {
        status::SUCCESS => "success",
        status::LOC_LEN_ERR => "local length error (a message larger than the receive slot)",
        status::LOC_QP_OP_ERR => "local queue pair operation error",
        status::LOC_PROT_ERR => "local protection error (a buffer outside its registration)",
        status::WR_FLUSH_ERR => "flushed (the queue pair is in the error state)",
        status::BAD_RESP_ERR => "bad response from the peer",
        status::LOC_ACCESS_ERR => "local access error",
        status::REM_INV_REQ_ERR => "the peer refused the request as invalid",
        status::REM_ACCESS_ERR => "the peer refused the access (bad key or range)",
        status::REM_OP_ERR => "the peer failed the operation",
        status::RETRY_EXC_ERR => "no answer from the peer (transport retries exhausted)",
        status::RNR_RETRY_EXC_ERR => "the peer posted no receive (RNR retries exhausted)",
        status::REM_ABORT_ERR => "the peer aborted the operation",
        status::FATAL_ERR => "fatal device error",
        status::RESP_TIMEOUT_ERR => "response timeout",
        status::GENERAL_ERR => "general error",
        _ => "unknown status",
    };
    format!("{text} (status {s})")
}

/// One work completion, as the wire reads it (the immediate in host
/// order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: Option<u32>,
}

/// What a completion means to the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A message in receive slot `slot` from `peer`: `len` bytes, and what
    /// the immediate says (None: none, or one this wire does not send).
    Received {
        peer: Rank,
        slot: u32,
        msg: Option<Imm>,
        len: usize,
    },
    /// The signaled send `seq` to `peer` is done (acknowledged).
    Sent { peer: Rank, seq: u32 },
    /// A work request failed. `flushed`: only because its queue pair is in
    /// error already (the cause was reported by whatever put it there).
    Failed {
        wr: WrId,
        flushed: bool,
        why: String,
    },
    /// Not a work request of this wire.
    Unknown(u64),
}

/// Reads one completion.
pub fn classify(wc: &Wc) -> Completion {
    let Some(wr) = WrId::decode(wc.wr_id) else {
        return Completion::Unknown(wc.wr_id);
    };
    if wc.status != status::SUCCESS {
        let what = match wr {
            WrId::Slot { .. } => "receive",
            WrId::Send { .. } => "send",
            WrId::Write { .. } => "RDMA write",
        };
        return Completion::Failed {
            wr,
            flushed: wc.status == status::WR_FLUSH_ERR,
            why: format!("{what} failed: {}", status_text(wc.status)),
        };
    }
    match wr {
        WrId::Slot { peer, slot } => Completion::Received {
            peer,
            slot,
            msg: wc.imm.and_then(Imm::decode),
            len: wc.byte_len as usize,
        },
        WrId::Send { peer, seq } => Completion::Sent { peer, seq },
        // never signaled: a success here is not ours to act on
        WrId::Write { .. } => Completion::Unknown(wc.wr_id),
    }
}

// ---- Initialisation errors -------------------------------------------------

/// Where the kernel lists uverbs devices; absent without `ib_uverbs`.
pub const SYSFS_VERBS: &str = "/sys/class/infiniband_verbs";

/// The SoftRoCE recipe, for messages.
pub const SOFTROCE_HINT: &str =
    "e.g. SoftRoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`";

/// Why `ibv_get_device_list` failed (`errno`), in words that name what is
/// missing. rdma-mummy-sys answers EOPNOTSUPP when it cannot load
/// libibverbs; libibverbs answers ENOSYS without kernel support.
pub fn device_list_error(errno: Option<i32>, err: &str, sysfs_present: bool) -> String {
    match errno {
        Some(libc::EOPNOTSUPP) => format!(
            "libibverbs.so.1 could not be loaded ({err}); install the rdma-core user space \
             (Debian: libibverbs1 ibverbs-providers)"
        ),
        Some(libc::ENOSYS) if !sysfs_present => format!(
            "no RDMA device: {SYSFS_VERBS} is missing ({err}); load ib_uverbs and a device \
             driver, {SOFTROCE_HINT}"
        ),
        _ => format!("ibv_get_device_list failed: {err}"),
    }
}

/// No device in the list.
pub fn no_device() -> String {
    format!("no RDMA device (libibverbs lists none): attach an HCA or add a SoftRoCE link, {SOFTROCE_HINT}")
}

/// The named device is not in the list.
pub fn no_such_device(wanted: &str, available: &[String]) -> String {
    format!(
        "no RDMA device named {wanted:?} (available: {})",
        if available.is_empty() {
            "none".to_string()
        } else {
            available.join(", ")
        }
    )
}
