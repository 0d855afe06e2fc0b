//! How a completion is read: the verbs ABI's status and opcode values,
//! one work completion ([`Wc`]) and what it means to the wire
//! ([`Completion`]).

use kungfu_topology::Rank;

use super::wr::{Imm, WrId};

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
