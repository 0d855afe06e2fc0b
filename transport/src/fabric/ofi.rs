//! The libfabric objects of one fabric wire, and every call into libfabric
//! the wire makes: one reliable-datagram endpoint (`FI_EP_RDM`, tagged
//! messages, `FI_SOURCE`) with its completion queue and address vector.
//!
//! The data calls are `unsafe fn`s with one contract: the buffers and the
//! context given stay valid (and the receive buffers unaliased) until the
//! completion carrying that context has been read, or the endpoint is
//! closed ([`Ofi`]'s drop closes it first). The wire's pending table
//! ([`super::core`]) keeps that promise.

use std::ffi::{CStr, CString};
use std::os::raw::{c_int, c_void};
use std::ptr::{null, null_mut};

use kungfu_fabric_sys::*;

/// A libfabric error, in its own words.
pub(super) fn strerror(ret: isize) -> String {
    let code = c_int::try_from(ret.unsigned_abs()).unwrap_or(FI_EOTHER);
    // SAFETY: fi_strerror returns a static NUL-terminated string for any code.
    let s = unsafe { CStr::from_ptr(fi_strerror(code)) };
    format!("{} ({ret})", s.to_string_lossy())
}

fn check(what: &str, ret: isize) -> Result<(), String> {
    if ret < 0 {
        return Err(format!("{what}: {}", strerror(ret)));
    }
    Ok(())
}

/// What a data call said: posted, or the queue is full for now.
pub(super) enum Posted {
    Yes,
    Again,
}

fn posted(what: &str, ret: isize) -> Result<Posted, String> {
    if ret == -(FI_EAGAIN as isize) {
        return Ok(Posted::Again);
    }
    check(what, ret).map(|()| Posted::Yes)
}

/// One completion.
pub(super) enum Cqe {
    Done {
        ctx: usize,
        len: usize,
        /// The source's address (its rank: the AV is a table in rank order).
        src: Option<u64>,
    },
    Failed {
        ctx: usize,
        /// `FI_ECANCELED` for a cancelled operation.
        err: c_int,
        why: String,
    },
}

/// The endpoint and what it needs, closed in reverse order on drop.
pub(super) struct Ofi {
    info: *mut fi_info,
    fabric: *mut fid_fabric,
    domain: *mut fid_domain,
    cq: *mut fid_cq,
    av: *mut fid_av,
    ep: *mut fid_ep,
    /// The CQ's file descriptor, where the provider has one (`FI_WAIT_FD`).
    pub(super) wait_fd: Option<c_int>,
    /// Completions carry their source.
    pub(super) source: bool,
    /// Local buffers must be registered (`FI_MR_LOCAL`).
    pub(super) mr_local: bool,
    /// The domain's `mr_mode`.
    pub(super) mr_mode: c_int,
    pub(super) provider: String,
}

// SAFETY: the domain is opened FI_THREAD_SAFE, so its objects may be used
// from any thread; the wire also calls the data path under one lock.
unsafe impl Send for Ofi {}
// SAFETY: as above.
unsafe impl Sync for Ofi {}

impl Ofi {
    /// Opens an endpoint of `provider` (e.g. `tcp;ofi_rxm`, `shm`,
    /// `verbs;ofi_rxm`, `efa`; `None`: the first that libfabric offers,
    /// which honours `FI_PROVIDER`), with a CQ of `cq_size` entries.
    pub(super) fn open(
        provider: Option<&str>,
        domain: Option<&str>,
        cq_size: usize,
    ) -> Result<Ofi, String> {
        let mut o = Ofi {
            info: null_mut(),
            fabric: null_mut(),
            domain: null_mut(),
            cq: null_mut(),
            av: null_mut(),
            ep: null_mut(),
            wait_fd: None,
            source: false,
            mr_local: false,
            mr_mode: 0,
            provider: String::new(),
        };
        // libfabric is loaded now, not at program start (see fabric-sys)
        kungfu_fabric_sys::load()?;
        o.info = get_info(provider, domain)?;
        // SAFETY: `o.info` is the non-empty list fi_getinfo returned; every
        // object is opened on the one before it and stored in `o` at once,
        // so `o`'s drop closes whatever opened if a later step fails.
        unsafe {
            let info = &*o.info;
            o.provider = CStr::from_ptr((*info.fabric_attr).prov_name)
                .to_string_lossy()
                .into_owned();
            o.mr_mode = (*info.domain_attr).mr_mode;
            o.mr_local = o.mr_mode & FI_MR_LOCAL != 0;
            o.source = info.caps & FI_SOURCE != 0;
            check(
                "fi_fabric",
                fi_fabric(info.fabric_attr, &mut o.fabric, null_mut()) as isize,
            )?;
            check(
                "fi_domain",
                fi_domain(o.fabric, o.info, &mut o.domain, null_mut()) as isize,
            )?;
            // FI_WAIT_FD where the provider has it (tcp), else none (shm):
            // the wire then polls with a growing pause
            for wait_obj in [FI_WAIT_FD, FI_WAIT_NONE] {
                let mut attr = fi_cq_attr {
                    format: FI_CQ_FORMAT_TAGGED,
                    wait_obj,
                    size: cq_size,
                    ..Default::default()
                };
                if fi_cq_open(o.domain, &mut attr, &mut o.cq, null_mut()) == 0 {
                    break;
                }
                o.cq = null_mut();
            }
            if o.cq.is_null() {
                return Err(format!(
                    "{}: no completion queue could be opened",
                    o.provider
                ));
            }
            let mut fd: c_int = -1;
            if fi_control(&raw mut (*o.cq).fid, FI_GETWAIT, (&raw mut fd).cast()) == 0 && fd >= 0 {
                o.wait_fd = Some(fd);
            }
            let mut av_attr = fi_av_attr {
                type_: FI_AV_TABLE,
                ..Default::default()
            };
            check(
                "fi_av_open",
                fi_av_open(o.domain, &mut av_attr, &mut o.av, null_mut()) as isize,
            )?;
            check(
                "fi_endpoint",
                fi_endpoint(o.domain, o.info, &mut o.ep, null_mut()) as isize,
            )?;
            check(
                "fi_ep_bind(av)",
                fi_ep_bind(o.ep, &raw mut (*o.av).fid, 0) as isize,
            )?;
            let r = fi_ep_bind(o.ep, &raw mut (*o.cq).fid, FI_TRANSMIT | FI_RECV);
            check("fi_ep_bind(cq)", r as isize)?;
            check("fi_enable", fi_enable(o.ep) as isize)?;
        }
        Ok(o)
    }

    /// This endpoint's address, to hand to the peers.
    pub(super) fn name(&self) -> Result<Vec<u8>, String> {
        let mut name = vec![0u8; 1024];
        let mut len = name.len();
        // SAFETY: an enabled endpoint; `name` is writable for `len` bytes.
        let r = unsafe { fi_getname(&raw mut (*self.ep).fid, name.as_mut_ptr().cast(), &mut len) };
        check("fi_getname", r as isize)?;
        name.truncate(len);
        Ok(name)
    }

    /// Inserts every rank's address, in rank order: in the table the
    /// address of rank `r` is then `r`.
    pub(super) fn insert_all(&self, names: &[Vec<u8>]) -> Result<(), String> {
        for (r, name) in names.iter().enumerate() {
            let mut addr = FI_ADDR_NOTAVAIL;
            // SAFETY: the AV is open; `name` is an address as fi_getname
            // gives them (checked by the provider, which returns 0 if not).
            let n =
                unsafe { fi_av_insert(self.av, name.as_ptr().cast(), 1, &mut addr, 0, null_mut()) };
            if n != 1 || addr != r as u64 {
                return Err(format!(
                    "fi_av_insert of rank {r}'s address: {} (address {addr})",
                    if n < 0 {
                        strerror(n as isize)
                    } else {
                        format!("{n} inserted")
                    }
                ));
            }
        }
        Ok(())
    }

    /// Posts a tagged receive into `iov` from any source.
    ///
    /// # Safety
    /// The buffers of `iov` and `ctx` stay valid and unaliased until this
    /// operation's completion is read or the endpoint is closed.
    pub(super) unsafe fn trecv(
        &self,
        iov: &[libc::iovec],
        desc: &mut [*mut c_void],
        tag: u64,
        ctx: *mut fi_context2,
    ) -> Result<Posted, String> {
        // SAFETY: the caller's contract; `iov` and `desc` are read during
        // the call only.
        let r = unsafe {
            fi_trecvv(
                self.ep,
                iov.as_ptr(),
                desc.as_mut_ptr(),
                iov.len(),
                FI_ADDR_UNSPEC,
                tag,
                0,
                ctx.cast(),
            )
        };
        posted("fi_trecvv", r)
    }

    /// Sends `iov` to rank `to` with `tag`.
    ///
    /// # Safety
    /// As [`Ofi::trecv`]: the buffers and `ctx` live until the completion.
    pub(super) unsafe fn tsend(
        &self,
        iov: &[libc::iovec],
        desc: &mut [*mut c_void],
        to: u64,
        tag: u64,
        ctx: *mut fi_context2,
    ) -> Result<Posted, String> {
        // SAFETY: the caller's contract.
        let r = unsafe {
            fi_tsendv(
                self.ep,
                iov.as_ptr(),
                desc.as_mut_ptr(),
                iov.len(),
                to,
                tag,
                ctx.cast(),
            )
        };
        posted("fi_tsendv", r)
    }

    /// Asks for the operation of `ctx` to be cancelled (its completion then
    /// comes with `FI_ECANCELED`, unless it completed first).
    pub(super) fn cancel(&self, ctx: *mut fi_context2) {
        // SAFETY: an open endpoint; cancelling an unknown or completed
        // context is harmless (-FI_ENOENT).
        let _ = unsafe { fi_cancel(&raw mut (*self.ep).fid, ctx.cast()) };
    }

    /// Reads up to `max` completions into `out`; how many.
    pub(super) fn read_cq(&self, out: &mut Vec<Cqe>, max: usize) -> Result<usize, String> {
        const BATCH: usize = 32;
        let mut entries = [fi_cq_tagged_entry::default(); BATCH];
        let mut src = [FI_ADDR_NOTAVAIL; BATCH];
        let want = max.min(BATCH);
        // SAFETY: an open CQ of the tagged format; the arrays are writable
        // for `want` entries.
        let n = unsafe {
            if self.source {
                fi_cq_readfrom(self.cq, entries.as_mut_ptr().cast(), want, src.as_mut_ptr())
            } else {
                fi_cq_read(self.cq, entries.as_mut_ptr().cast(), want)
            }
        };
        if n == -(FI_EAGAIN as isize) {
            return Ok(0);
        }
        if n == -(FI_EAVAIL as isize) {
            let mut e = fi_cq_err_entry::default();
            // SAFETY: as above; no provider-specific data asked for.
            let r = unsafe { fi_cq_readerr(self.cq, &mut e, 0) };
            if r == -(FI_EAGAIN as isize) {
                return Ok(0); // taken by another reader meanwhile
            }
            check("fi_cq_readerr", r)?;
            // SAFETY: an open CQ; the error entry just read.
            let text = unsafe { fi_cq_strerror(self.cq, e.prov_errno, e.err_data, null_mut(), 0) };
            let why = if text.is_null() {
                strerror(-(e.err as isize))
            } else {
                // SAFETY: fi_cq_strerror returns a NUL-terminated string.
                unsafe { CStr::from_ptr(text) }
                    .to_string_lossy()
                    .into_owned()
            };
            out.push(Cqe::Failed {
                ctx: e.op_context as usize,
                err: e.err,
                why,
            });
            return Ok(1);
        }
        check("fi_cq_read", n)?;
        let n = n as usize;
        for (e, s) in entries.iter().zip(src).take(n) {
            out.push(Cqe::Done {
                ctx: e.op_context as usize,
                len: e.len,
                src: (self.source && s != FI_ADDR_NOTAVAIL).then_some(s),
            });
        }
        Ok(n)
    }

    /// Whether the wire may sleep on the CQ's fd now (`fi_trywait`: nothing
    /// is left to progress or read).
    pub(super) fn try_wait(&self) -> bool {
        let mut fids = [cq_fid(self.cq)];
        // SAFETY: an open fabric and CQ.
        unsafe { fi_trywait(self.fabric, fids.as_mut_ptr(), 1) == 0 }
    }

    /// Registers `len` bytes at `ptr` for sends and receives, with `key`
    /// (unique in the domain where the application picks keys).
    ///
    /// # Safety
    /// The memory stays valid until the returned [`Mr`] is dropped.
    pub(super) unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
        key: u64,
    ) -> Result<Mr, String> {
        let mut mr = null_mut();
        // SAFETY: the caller's contract; an open domain.
        let r = unsafe {
            fi_mr_reg(
                self.domain,
                ptr.cast(),
                len,
                FI_SEND | FI_RECV,
                0,
                key,
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("fi_mr_reg", r as isize)?;
        if self.mr_mode & FI_MR_ENDPOINT != 0 {
            // SAFETY: an open region and endpoint of the domain.
            let r = unsafe { fi_mr_bind(mr, &raw mut (*self.ep).fid, 0) };
            let r = if r == 0 {
                // SAFETY: as above.
                unsafe { fi_mr_enable(mr) }
            } else {
                r
            };
            if r != 0 {
                // SAFETY: the region just opened, closed once.
                unsafe { fi_close(&raw mut (*mr).fid) };
                return Err(format!("fi_mr_bind/enable: {}", strerror(r as isize)));
            }
        }
        // SAFETY: an open region.
        let desc = unsafe { fi_mr_desc(mr) };
        Ok(Mr { mr, desc })
    }
}

/// The `fid` of a CQ, for `fi_trywait`.
fn cq_fid(cq: *mut fid_cq) -> *mut fid {
    // SAFETY: `fid` is the first field of an open `fid_cq`; only its address
    // is taken.
    unsafe { &raw mut (*cq).fid }
}

impl Drop for Ofi {
    fn drop(&mut self) {
        // SAFETY: each object was opened by Ofi::open (or is null) and is
        // closed once: the endpoint first (no transfer touches a buffer
        // after this), then what it was bound to, the domain, the fabric.
        unsafe {
            if !self.ep.is_null() {
                fi_close(&raw mut (*self.ep).fid);
            }
            if !self.av.is_null() {
                fi_close(&raw mut (*self.av).fid);
            }
            if !self.cq.is_null() {
                fi_close(&raw mut (*self.cq).fid);
            }
            if !self.domain.is_null() {
                fi_close(&raw mut (*self.domain).fid);
            }
            if !self.fabric.is_null() {
                fi_close(&raw mut (*self.fabric).fid);
            }
            if !self.info.is_null() {
                fi_freeinfo(self.info);
            }
        }
    }
}

/// A registered memory region, deregistered on drop.
pub(super) struct Mr {
    mr: *mut fid_mr,
    pub(super) desc: *mut c_void,
}

// SAFETY: a region of an FI_THREAD_SAFE domain; `desc` is only passed back
// to libfabric.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: opened by Ofi::register, closed once.
        unsafe { fi_close(&raw mut (*self.mr).fid) };
    }
}

/// Whether libfabric offers the endpoints the wire needs from `provider`
/// (`None`: any) here: the provider it would give, or why none.
pub(super) fn offers(provider: Option<&str>) -> Result<String, String> {
    kungfu_fabric_sys::load()?;
    let info = get_info(provider, None)?;
    // SAFETY: `info` is the non-empty list fi_getinfo returned (its
    // fabric_attr and prov_name set by libfabric), freed once.
    unsafe {
        let name = CStr::from_ptr((*(*info).fabric_attr).prov_name)
            .to_string_lossy()
            .into_owned();
        fi_freeinfo(info);
        Ok(name)
    }
}

/// `fi_getinfo` for a tagged RDM endpoint with `FI_SOURCE` of `provider`.
fn get_info(provider: Option<&str>, domain: Option<&str>) -> Result<*mut fi_info, String> {
    let cstr = |what: &str, v: Option<&str>| {
        v.map(|p| CString::new(p).map_err(|_| format!("bad {what} name {p:?}")))
            .transpose()
    };
    let name = cstr("provider", provider)?;
    let dom = cstr("domain", domain)?;
    // SAFETY: fi_allocinfo gives a zeroed fi_info with its attribute structs
    // (checked), filled in here and freed below; prov_name is strdup'ed
    // because fi_freeinfo frees it.
    unsafe {
        let hints = fi_allocinfo();
        if hints.is_null() {
            return Err("fi_allocinfo failed".into());
        }
        (*hints).caps = FI_TAGGED | FI_SOURCE;
        (*hints).mode = FI_CONTEXT | FI_CONTEXT2;
        (*(*hints).ep_attr).type_ = FI_EP_RDM;
        // a send completes once the frame is at the peer: a rank that
        // closes after its sends completed loses none of them
        (*(*hints).tx_attr).op_flags = FI_DELIVERY_COMPLETE;
        (*(*hints).domain_attr).mr_mode =
            FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_ENDPOINT;
        (*(*hints).domain_attr).threading = FI_THREAD_SAFE;
        if let Some(n) = &name {
            (*(*hints).fabric_attr).prov_name = libc::strdup(n.as_ptr());
        }
        if let Some(d) = &dom {
            (*(*hints).domain_attr).name = libc::strdup(d.as_ptr());
        }
        let mut info = null_mut();
        let version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
        let r = fi_getinfo(version, null(), null(), 0, hints, &mut info);
        fi_freeinfo(hints);
        if r != 0 || info.is_null() {
            return Err(format!(
                "no libfabric provider{}{} offers tagged reliable-datagram endpoints with FI_SOURCE here: {}",
                provider.map(|p| format!(" {p:?}")).unwrap_or_default(),
                domain.map(|d| format!(" on domain {d:?}")).unwrap_or_default(),
                strerror(r as isize)
            ));
        }
        Ok(info)
    }
}
