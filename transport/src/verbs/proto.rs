//! The verbs wire's protocol as plain data, with no device: what the
//! bootstrap exchanges ([`QpInfo`]), the queue pair's way to ready-to-send
//! ([`QpStep`], [`QpState`]), the work requests the wire posts
//! ([`SendWr`], [`RecvWr`], [`WrId`], [`Imm`]), the rendezvous message
//! ([`Ready`]), how a completion is read ([`Wc`], [`Completion`]), and what
//! a missing device is called ([`device_list_error`]). Everything here is
//! tested without hardware; `sys` turns it into verbs calls.
//!
//! The parts: the queue pair and its bootstrap (`qp`), the work requests
//! and the rendezvous message (`wr`), completions (`wc`), and the words
//! for a missing device (`device`).

mod device;
mod qp;
mod wc;
mod wr;

pub use self::device::*;
pub use self::qp::*;
pub use self::wc::*;
pub use self::wr::*;
