//! Point-to-point messages (`kf_send`, `kf_recv`): a worker sends bytes to
//! another under a tag, which receives them from it or from any worker
//! (`KF_ANY_SOURCE`). See `kungfu_collectives::sendrecv` for the protocol
//! (a rendezvous: a send completes once its receive matched it).
//!
//! The mailbox is made on first use and made again over the new session
//! after a resize.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kungfu_collectives::sendrecv::Mailbox;
use kungfu_topology::{fnv1a64, Rank};
use kungfu_transport::any::AnyTransport;

use crate::handles::{Completion, OutPtr};
use crate::p2p::fail_of;
use crate::request::read_input;
use crate::subgroup::{kf_group_t, session_of, KF_GROUP_WORLD};
use crate::{ctx, guard, invalid, kf_callback, kf_handle, kf_status, lock, Ctx, Res, Session};

/// The `peer` of [`kf_recv`] that takes a message from any worker.
pub const KF_ANY_SOURCE: c_int = -1;

static MAILBOX: Mutex<Option<Arc<Mailbox<AnyTransport>>>> = Mutex::new(None);

/// This worker's mailbox over the session now.
fn mailbox(c: &Ctx) -> Arc<Mailbox<AnyTransport>> {
    let mut m = lock(&MAILBOX);
    match m.as_ref() {
        Some(mb) if mb.session().same(&c.session) => mb.clone(),
        _ => {
            // its server tasks run on the library's runtime
            let _in = c.rt.enter();
            let mb = Arc::new(Mailbox::new(&c.session));
            *m = Some(mb.clone());
            mb
        }
    }
}

/// `peer`, another rank of `group` (a session, or a subgroup of it), as a
/// rank of the whole session.
fn peer_of(group: &Session<AnyTransport>, peer: c_int) -> Res<Rank> {
    let (me, n) = (group.rank(), group.size());
    u32::try_from(peer)
        .ok()
        .filter(|&p| (p as usize) < n && p != me.0)
        .map(|p| group.session_rank(Rank(p)))
        .ok_or_else(|| {
            invalid(format!(
                "peer {peer}: another rank of 0..{n} (this is {me})"
            ))
        })
}

/// The tag a message of `group` travels under: the caller's for the whole
/// session; for a subgroup, the FNV-1a 64 hash of `kf/group/tag`, a NUL,
/// the group's id and the tag, so that two groups' messages between the
/// same two ranks do not meet (as two groups' ops do not: their names
/// hash from the group's own basis).
fn tag_in(group: &Session<AnyTransport>, tag: u64) -> u64 {
    match group.group_id() {
        None => tag,
        Some(id) => {
            let h = fnv1a64(0xcbf2_9ce4_8422_2325, b"kf/group/tag\0");
            fnv1a64(fnv1a64(h, &id.to_le_bytes()), &tag.to_le_bytes())
        }
    }
}

/// Sends a copy of the `len` bytes at `data` to rank `peer` under `tag`.
/// The op completes once `peer`'s matching `kf_recv` took it (a
/// rendezvous: two workers that each wait for a send to the other before
/// they receive wait for each other until the op timeout,
/// `KUNGFU_OP_TIMEOUT_MS`). Messages from one worker to another under one
/// tag are received in the order of their `kf_send` calls. A receive of
/// another length fails both ends with `KF_ERR_MISMATCH`.
///
/// # Safety
/// `data` holds `len` bytes (NULL only if `len` is 0); `handle` is NULL or
/// points to a `kf_handle`.
#[no_mangle]
pub unsafe extern "C" fn kf_send(
    peer: c_int,
    tag: u64,
    data: *const c_void,
    len: usize,
    cb: kf_callback,
    user: *mut c_void,
    handle: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_send's.
    unsafe { kf_group_send(KF_GROUP_WORLD, peer, tag, data, len, cb, user, handle) }
}

/// [`kf_send`] in group `g`: `peer` is a rank of the group, and messages
/// of a group under a tag meet only receives of the same group under it.
///
/// # Safety
/// As [`kf_send`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kf_group_send(
    g: kf_group_t,
    peer: c_int,
    tag: u64,
    data: *const c_void,
    len: usize,
    cb: kf_callback,
    user: *mut c_void,
    handle: *mut kf_handle,
) -> kf_status {
    guard(|| {
        let c = ctx()?;
        let group = session_of(&c, g)?;
        let to = peer_of(&group, peer)?;
        let tag = tag_in(&group, tag);
        let data = Bytes::from(read_input(data, len, "data")?);
        let deadline = tokio::time::Instant::now() + c.session.config().op_timeout;
        // its place among this worker's messages to `to` is taken now
        let send = mailbox(&c).send(to, tag, data, deadline);
        let done = Completion::new(cb, user, handle);
        c.rt.spawn(async move {
            done.finish(send.await.map_err(|e| fail_of(&e)));
        });
        Ok(())
    })
}

/// Receives into `out`, which must hold exactly the message's `len`
/// bytes, the next message under `tag` from rank `peer`, or from any
/// worker with `KF_ANY_SOURCE`; writes the sender's rank to `*source`
/// unless it is NULL, before the op completes. Receives take messages in
/// the order of their `kf_recv` calls. Fails with `KF_ERR_MISMATCH` (and
/// so does the send) if the lengths differ, with `KF_ERR_PEER_LOST` once
/// the peer (for `KF_ANY_SOURCE`: every peer) is gone, and with
/// `KF_ERR_TIMEOUT` after the op timeout (`KUNGFU_OP_TIMEOUT_MS`).
///
/// # Safety
/// `out` holds `len` bytes (NULL only if `len` is 0) and, like `source`
/// (NULL or an `int`), stays valid until the op completes; `handle` is
/// NULL or points to a `kf_handle`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kf_recv(
    peer: c_int,
    tag: u64,
    out: *mut c_void,
    len: usize,
    source: *mut c_int,
    cb: kf_callback,
    user: *mut c_void,
    handle: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_recv's.
    unsafe {
        kf_group_recv(
            KF_GROUP_WORLD,
            peer,
            tag,
            out,
            len,
            source,
            cb,
            user,
            handle,
        )
    }
}

/// [`kf_recv`] in group `g`: `peer` (and the rank written to `*source`)
/// is a rank of the group; it takes only messages sent in the group.
///
/// # Safety
/// As [`kf_recv`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kf_group_recv(
    g: kf_group_t,
    peer: c_int,
    tag: u64,
    out: *mut c_void,
    len: usize,
    source: *mut c_int,
    cb: kf_callback,
    user: *mut c_void,
    handle: *mut kf_handle,
) -> kf_status {
    guard(|| {
        if out.is_null() && len > 0 {
            return Err(invalid("out is NULL"));
        }
        let c = ctx()?;
        let group = session_of(&c, g)?;
        let from = match peer {
            KF_ANY_SOURCE => None,
            p => Some(peer_of(&group, p)?),
        };
        let tag = tag_in(&group, tag);
        // the sender's rank in the group
        let members: Option<Vec<Rank>> = group.members().map(|m| m.to_vec());
        let deadline = tokio::time::Instant::now() + c.session.config().op_timeout;
        // its place among this worker's receives is taken now
        let recv = mailbox(&c).recv(from, tag, len, deadline);
        let done = Completion::new(cb, user, handle);
        let (out, source) = (OutPtr(out as *mut u8), OutPtr(source as *mut u8));
        c.rt.spawn(async move {
            let r = match recv.await {
                Ok((who, bytes)) => {
                    // SAFETY: the caller's buffers, valid until completion
                    // (the ABI's contract); `out` holds `len` bytes, which
                    // the receive checked `bytes` has.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.get(), len);
                        if !source.get().is_null() {
                            let who = match &members {
                                // a member: only members send under the tag
                                Some(m) => m.iter().position(|&r| r == who).unwrap_or(usize::MAX),
                                None => who.idx(),
                            };
                            (source.get() as *mut c_int).write_unaligned(who as c_int);
                        }
                    }
                    Ok(())
                }
                Err(e) => Err(fail_of(&e)),
            };
            done.finish(r);
        });
        Ok(())
    })
}
