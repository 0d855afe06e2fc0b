//! What the wire posts, as data: the work requests ([`SendWr`],
//! [`RecvWr`]), the ids that name them ([`WrId`]), the immediates that say
//! what a message is ([`Imm`]), and the rendezvous message ([`Ready`]).

use kungfu_topology::Rank;

use crate::{Epoch, OpId, OpTag};

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
