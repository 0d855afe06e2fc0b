//! The queue pair as data: what a rank tells a peer about the pair it
//! made for it ([`QpInfo`]), this rank's port ([`LocalPort`]), and the
//! pair's way to ready-to-send ([`QpStep`], [`QpState`]) with the
//! attributes the wire asks for.

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
