//! Working buffers, from the transport's buffer pool.
//!
//! Every op needs a working buffer of its own size, and every frame a
//! backend sends later needs a copy. Both come from the pool of the
//! session's endpoint ([`kungfu_transport::Transport::pool`]), the one its
//! wires fill received payloads from: one pool per process, with one budget
//! for idle buffers ([`kungfu_transport::pool`] says why it pays and how
//! the budget holds).

pub(crate) use kungfu_transport::pool::PooledBuf;
