//! The wire: the only thing a backend implements.
//!
//! A wire moves frames to the peers it has links to and pushes what
//! arrives into the endpoint's [`Matcher`](crate::endpoint::Matcher),
//! which it is given when it connects. Everything above the bytes
//! (matching, epochs, strays, the back-pressure budget, lost peers, the
//! receive loop, the choice of a wire per peer) is the
//! [`Endpoint`](crate::endpoint::Endpoint)'s, written once.
//!
//! What a wire declares in its [`Caps`] is what the endpoint and the op
//! driver act on; nothing else tells them which backend they run over:
//!
//! - `inject`: a small frame can go straight from the caller's bytes when
//!   there is room (shared memory's ring; libfabric's `fi_inject`, verbs'
//!   inline sends), so the driver tries [`Wire::inject`] before copying.
//! - `holds_sends`: a frame that did not fit may wait in the caller's
//!   memory and be injected again (a ring that drains as the peer reads);
//!   the driver then keeps it instead of copying it into an owned payload.
//! - `polled`: frames move only while someone polls (shared memory read
//!   by the receiving task; libfabric's manual progress): a receive spins
//!   calling [`Wire::pump`] before it sleeps.
//! - `lends`: [`Wire::pump`] can offer a frame in place (in the ring's
//!   memory, in pieces when it wraps), so an op applies it with no copy.
//!   Receives from a wire that does not lend are posted into the op's
//!   memory ([`Wire::post_recv`]), where the wire writes them.
//! - `borrows_sends`: a send may go straight from the op's memory (TCP
//!   writes the range to the socket), not from a copy.
//! - `eager_max`: frames above it are received only into posted memory.
//! - `needs_registration`: the endpoint registers op memory
//!   ([`Wire::register`]) before it posts a receive into it.
//! - `max_frame`: the endpoint refuses larger sends.

use std::any::{Any, TypeId};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use crate::endpoint::Pump;
use crate::endpoint::RecvKey;
use crate::region::{Mem, MemMut, Region};
use crate::{Header, OpTag, PeerSet, TransportError};

/// What a wire can do. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The backend's name (`"tcp"`, `"shm"`, `"mem"`, ...).
    pub name: &'static str,
    /// The largest payload one frame may carry.
    pub max_frame: usize,
    /// [`Wire::inject`] may succeed.
    pub inject: bool,
    /// A frame [`Wire::inject`] refused for lack of room may wait in the
    /// caller's memory and be injected again.
    pub holds_sends: bool,
    /// Frames move only while a receiver calls [`Wire::pump`].
    pub polled: bool,
    /// [`Wire::pump`] lends frames in place.
    pub lends: bool,
    /// [`Wire::send`] resolves only once the wire has let go of the
    /// payload (written it out), so the payload may be a range of the op's
    /// memory, lent for the send ([`Bytes::from_owner`] of a
    /// [`Mem`]): no copy. A wire that passes payloads on
    /// (the in-memory network hands them to the receiver) does not.
    pub borrows_sends: bool,
    /// The largest payload a peer may send before its receive is posted.
    /// A larger frame waits for a posted receive (a rendezvous, as RDMA
    /// wires do with large messages), so the driver posts every receive
    /// above it (into a scratch range where the frame is reduced, not
    /// copied). `max_frame` where any frame may arrive unexpected.
    pub eager_max: usize,
    /// Memory must be registered ([`Wire::register`]) before the wire
    /// moves it (RDMA).
    pub needs_registration: bool,
}

impl Caps {
    /// A wire of byte streams (TCP, QUIC): frames go whole through a
    /// stream, a send resolves once the stream has its own copy (so it may
    /// read the op's memory), nothing is injected, lent or registered.
    pub fn stream(name: &'static str, max_frame: usize) -> Caps {
        Caps {
            name,
            max_frame,
            inject: false,
            holds_sends: false,
            polled: false,
            lends: false,
            needs_registration: false,
            borrows_sends: true,
            eager_max: max_frame,
        }
    }
}

/// A wire's tasks (readers, writers): awaited on a graceful close, aborted
/// on shutdown.
#[derive(Default)]
pub struct Tasks(std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>);

impl Tasks {
    pub fn new(tasks: Vec<tokio::task::JoinHandle<()>>) -> Tasks {
        Tasks(std::sync::Mutex::new(tasks))
    }

    fn take(&self) -> Vec<tokio::task::JoinHandle<()>> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Waits for every task to end by itself until `deadline`, aborting
    /// those that did not.
    pub async fn join_until(&self, deadline: crate::Instant) {
        for mut t in self.take() {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
            }
        }
    }

    /// Aborts every task.
    pub fn abort(&self) {
        self.take().into_iter().for_each(|t| t.abort());
    }
}

/// A capability that a backend offers beyond moving frames, found by its
/// type: the wire and transport traits name no backend's types, and only
/// code that knows a capability's type (the host fast path knows the
/// shared-memory lanes) asks for it, through [`Transport::extension`].
///
/// [`Transport::extension`]: crate::Transport::extension
pub type Extension = Arc<dyn Any + Send + Sync>;

/// A frame offered in place: `(sender, header, payload in pieces)`; true
/// when the callee consumed it.
pub type Apply<'a> = &'a mut (dyn FnMut(Rank, &Header, &[&[u8]]) -> bool + Send);

/// A backend. See the module docs.
pub trait Wire: Send + Sync + 'static {
    fn caps(&self) -> Caps;

    /// Whether this wire has a link to `peer`. An endpoint over several
    /// wires sends to each peer through the first wire that reaches it.
    fn reaches(&self, peer: Rank) -> bool;

    /// Registers `region` for this wire's use (a no-op unless
    /// [`Caps::needs_registration`]); the registration is kept in the
    /// region.
    fn register(&self, region: &Arc<Region>) -> Result<(), TransportError> {
        let _ = region;
        Ok(())
    }

    /// Takes a posted receive, if the wire matches receives itself
    /// (libfabric's tagged receives, a verbs rendezvous): it then writes
    /// the frame into `mem` and reports [`Matcher::landed`] to the
    /// endpoint's matcher. The default gives `mem` back (`Ok(Some)`), and
    /// the endpoint's matcher matches it in software: a reader
    /// [`claim`](crate::endpoint::Matcher::claim)s it and writes into it.
    ///
    /// [`Matcher::landed`]: crate::endpoint::Matcher::landed
    fn post_recv(&self, key: RecvKey, mem: MemMut) -> Result<Option<MemMut>, TransportError> {
        let _ = key;
        Ok(Some(mem))
    }

    /// Sends a frame now, straight from `payload`, if it can without
    /// waiting: `Ok(false)` when it cannot (no room, or the wire never
    /// injects). `header.len` is set here.
    fn inject(&self, to: Rank, header: Header, payload: &[u8]) -> Result<bool, TransportError> {
        let _ = (to, header, payload);
        Ok(false)
    }

    /// Sends one frame; resolves when it is handed whole to the wire
    /// (`payload` may then be reused). Dropping the future does not cut a
    /// frame in half. `header.len` is set here.
    fn send(
        &self,
        to: Rank,
        header: Header,
        payload: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Sends one frame straight from `payload`, a range of the op's memory
    /// (for [`Caps::borrows_sends`] wires): resolves once the wire let go
    /// of it. A wire that needs registered memory finds the region's
    /// registration through `payload.region()`. The default sends it as
    /// [`Bytes::from_owner`].
    fn send_mem(
        &self,
        to: Rank,
        header: Header,
        payload: Mem,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.send(to, header, Bytes::from_owner(payload))
    }

    /// Moves what arrived into the matcher (for [`Caps::polled`] wires).
    /// With `apply`, a frame of `tag` from a rank in `from` is first lent
    /// in place; if `apply` consumes it, this returns [`Pump::Consumed`]
    /// at once.
    fn pump(&self, tag: OpTag, from: &PeerSet, apply: Option<Apply<'_>>) -> Pump {
        let _ = (tag, from, apply);
        Pump::Idle
    }

    /// A receiver starts (`true`) or stops (`false`) polling this wire:
    /// its own readers may then leave the frames to it.
    fn set_polling(&self, on: bool) {
        let _ = on;
    }

    /// A receiver that polled is about to sleep until a frame is
    /// delivered: the wire's readers must not leave frames to it.
    fn going_to_sleep(&self) {}

    /// This wire's capability of type `ty`, if it offers one beyond moving
    /// frames (see [`Extension`]): the shared-memory wire offers its
    /// [`HostLanes`](crate::shm::lane::HostLanes) to the collectives' host
    /// fast path.
    fn extension(&self, ty: TypeId) -> Option<Extension> {
        let _ = ty;
        None
    }

    /// Closes gracefully: frames already sent reach their peers, the peers
    /// are told, and the wire waits up to `linger` for them.
    fn close(&self, linger: Duration) -> impl Future<Output = ()> + Send + '_;

    /// Stops at once; idempotent.
    fn shutdown(&self);
}

#[cfg(test)]
mod tests {
    /// `Wire` and `Transport` name no backend's types (code only: a doc may
    /// point at one as an example); a capability of one backend goes
    /// through [`super::Extension`].
    #[test]
    fn the_traits_name_no_backend() {
        let lib = include_str!("lib.rs");
        let start = lib.find("\npub trait Transport").expect("the trait");
        let len = lib[start + 1..].find("\n}\n").expect("its end");
        let transport = &lib[start..start + 1 + len];
        let backends = ["tcp", "shm", "quic", "fabric", "verbs", "mem", "any"];
        // a path that starts at the backend's module (`shm::`, `crate::shm::`),
        // not `std::mem::` or `std::any::`
        let names = |code: &str, b: &str| {
            let pat = format!("{b}::");
            code.match_indices(&pat).any(|(i, _)| {
                let before = &code[..i];
                before.ends_with("crate::")
                    || before.ends_with("super::")
                    || !before.ends_with(|c: char| c == ':' || c == '_' || c.is_alphanumeric())
            })
        };
        for (file, text) in [("wire.rs", include_str!("wire.rs")), ("lib.rs", transport)] {
            for line in text.lines() {
                let code = line.trim_start();
                if code.starts_with("//") {
                    continue;
                }
                for b in backends {
                    assert!(!names(code, b), "{file} names the {b} backend: {line}");
                }
            }
        }
    }
}
