//! A test rig over the raw bindings: one provider's fabric and domain with
//! two FI_EP_RDM endpoints (A and B) in this process, each with its own CQ
//! and AV holding the other's address, registered buffers, and CQ reading
//! with a deadline. Every wait is bounded; nothing here blocks for longer
//! than [`STEP`] at a time.

use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kungfu_fabric_sys::*;

/// The longest any one wait of a test may take.
pub const DEADLINE: Duration = Duration::from_secs(10);
/// The longest one blocking call (poll, fi_cq_sread) may take.
pub const STEP: Duration = Duration::from_millis(500);

/// Panics with libfabric's text for a negative return code.
#[track_caller]
pub fn check(what: &str, ret: isize) -> isize {
    if ret < 0 {
        panic!("{what}: {ret} ({})", strerror(ret));
    }
    ret
}

/// `fi_strerror` of a (negative) return code.
pub fn strerror(ret: isize) -> String {
    let code = c_int::try_from(ret.unsigned_abs()).unwrap_or(FI_EOTHER);
    // SAFETY: fi_strerror returns a static NUL-terminated string for any code.
    unsafe { CStr::from_ptr(fi_strerror(code)) }
        .to_string_lossy()
        .into_owned()
}

/// `fi_tostr_r` of the value at `data`, of the libfabric type `ty`.
pub fn tostr<T>(data: &T, ty: fi_type) -> String {
    let mut buf = vec![0 as c_char; 4096];
    // SAFETY: `buf` is writable for its length and `data` is a live value of
    // the type `ty` names (the caller's choice of `ty`).
    let s = unsafe { fi_tostr_r(buf.as_mut_ptr(), buf.len(), (data as *const T).cast(), ty) };
    // SAFETY: fi_tostr_r NUL-terminates within `buf` and returns it.
    unsafe { CStr::from_ptr(s) }
        .to_string_lossy()
        .trim()
        .to_owned()
}

/// The list `fi_getinfo` returned, freed on drop.
pub struct Info(*mut fi_info);

impl Info {
    /// `fi_getinfo` for an FI_EP_RDM endpoint of provider `prov` with
    /// `caps`, the FI_CONTEXT modes (the rig passes `fi_context2`s), all
    /// the MR modes the rig handles, and FI_THREAD_SAFE (the wait test
    /// drives A and B from two threads). Returns the negative error code
    /// when no provider matches.
    pub fn get(prov: &str, caps: u64) -> Result<Info, isize> {
        let name = CString::new(prov).unwrap();
        // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute
        // structs allocated (checked not null), which this block fills in and
        // frees; prov_name is strdup'ed because fi_freeinfo frees it.
        unsafe {
            let hints = fi_allocinfo();
            assert!(!hints.is_null(), "fi_allocinfo");
            (*hints).caps = caps;
            (*hints).mode = FI_CONTEXT | FI_CONTEXT2;
            (*(*hints).ep_attr).type_ = FI_EP_RDM;
            (*(*hints).domain_attr).mr_mode =
                FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
            (*(*hints).domain_attr).threading = FI_THREAD_SAFE;
            (*(*hints).fabric_attr).prov_name = libc::strdup(name.as_ptr());
            if prov.starts_with("tcp") {
                // IPv4 on the loopback (FI_TCP_IFACE=lo, set by the test)
                (*hints).addr_format = FI_SOCKADDR_IN as u32;
            }
            let mut info = null_mut();
            let version = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
            let ret = fi_getinfo(version, null(), null(), 0, hints, &mut info);
            fi_freeinfo(hints);
            if ret != 0 {
                return Err(ret as isize);
            }
            Ok(Info(info))
        }
    }

    /// The first entry.
    pub fn first(&self) -> &fi_info {
        // SAFETY: a successful fi_getinfo returns a non-empty list, alive
        // until drop.
        unsafe { &*self.0 }
    }

    /// The first entry's attribute structs.
    pub fn attrs(&self) -> (&fi_tx_attr, &fi_rx_attr, &fi_ep_attr, &fi_domain_attr) {
        let i = self.first();
        // SAFETY: fi_getinfo fills in every attribute pointer of its entries.
        unsafe { (&*i.tx_attr, &*i.rx_attr, &*i.ep_attr, &*i.domain_attr) }
    }

    /// The first entry's provider and domain names.
    pub fn names(&self) -> (String, String) {
        let (_, _, _, dom) = self.attrs();
        // SAFETY: fi_getinfo fills in the fabric attributes and the names.
        unsafe {
            let fab = &*self.first().fabric_attr;
            (
                CStr::from_ptr(fab.prov_name).to_string_lossy().into_owned(),
                CStr::from_ptr(dom.name).to_string_lossy().into_owned(),
            )
        }
    }
}

impl Drop for Info {
    fn drop(&mut self) {
        // SAFETY: the list fi_getinfo returned, freed once.
        unsafe { fi_freeinfo(self.0) }
    }
}

/// Which endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    A,
    B,
}

/// One endpoint with its CQ and AV.
pub struct Endpoint {
    pub ep: *mut fid_ep,
    pub cq: *mut fid_cq,
    pub av: *mut fid_av,
    /// The CQ's file descriptor, when it was opened with FI_WAIT_FD.
    pub wait_fd: Option<c_int>,
    /// Its address, as fi_getname gave it.
    pub name: Vec<u8>,
}

/// The raw pointers of one endpoint, to drive it from another thread (the
/// domain is FI_THREAD_SAFE, and each thread uses its own endpoint and CQ).
#[derive(Clone, Copy)]
pub struct Remote {
    pub ep: *mut fid_ep,
    pub cq: *mut fid_cq,
}
// SAFETY: libfabric objects of an FI_THREAD_SAFE domain may be used from any
// thread; the rig outlives the threads it hands these to (scoped threads).
unsafe impl Send for Remote {}

/// A completion read from a CQ: an entry, or an error entry.
#[derive(Debug)]
pub struct Completion {
    pub side: Side,
    pub context: *mut c_void,
    pub flags: u64,
    pub len: usize,
    pub tag: u64,
    pub data: u64,
    /// The source's address in the reader's AV (fi_cq_readfrom), where the
    /// endpoint has FI_SOURCE.
    pub src: Option<fi_addr_t>,
    /// err and prov_errno of an error entry.
    pub err: Option<(c_int, c_int)>,
}

/// A buffer registered with the domain, deregistered on drop.
pub struct Buf {
    pub data: Vec<u8>,
    pub mr: *mut fid_mr,
    pub desc: *mut c_void,
}

impl Drop for Buf {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // a failed test may leave a transfer in flight into this buffer
            // (its endpoint is closed later, by the rig): leak it instead
            std::mem::forget(std::mem::take(&mut self.data));
            return;
        }
        // SAFETY: the region registered by Rig::buffer, closed once, after its
        // transfers completed (the tests wait for them).
        let ret = unsafe { fi_close(&raw mut (*self.mr).fid) };
        closed(ret, "fi_close(mr)");
    }
}

/// Checks a close in a drop (unless already unwinding from a failure).
fn closed(ret: c_int, what: &str) {
    if ret != 0 && !std::thread::panicking() {
        panic!("{what}: {ret} ({})", strerror(ret as isize));
    }
}

/// A fabric, a domain and two endpoints that know each other.
pub struct Rig {
    pub info: Info,
    pub fabric: *mut fid_fabric,
    pub domain: *mut fid_domain,
    pub a: Endpoint,
    pub b: Endpoint,
    /// B's address in A's AV.
    pub a_to_b: fi_addr_t,
    /// A's address in B's AV.
    pub b_from_a: fi_addr_t,
    /// B's own address in B's AV (a source that never sends, for the
    /// directed-receive test).
    pub b_self: fi_addr_t,
    /// The wait object the CQs were opened with.
    pub wait_obj: fi_wait_obj,
    /// Whether the endpoints have FI_SOURCE (completions carry the source).
    pub source: bool,
    /// Completions read but not yet asked for.
    backlog: RefCell<Vec<Completion>>,
}

impl Rig {
    /// Opens everything on the first entry of `info`; the CQs with the
    /// first of `waits` the provider takes.
    pub fn open(info: Info, waits: &[fi_wait_obj]) -> Rig {
        let entry = info.0;
        let mut fabric = null_mut();
        let mut domain = null_mut();
        // SAFETY: `entry` is a live fi_info of `info` (kept in the rig), its
        // fabric_attr filled in by fi_getinfo; the out pointers are writable.
        unsafe {
            let r = fi_fabric((*entry).fabric_attr, &mut fabric, null_mut());
            check("fi_fabric", r as isize);
            check(
                "fi_domain",
                fi_domain(fabric, entry, &mut domain, null_mut()) as isize,
            );
        }
        let mut tried = Vec::new();
        let (a, wait_obj) = waits
            .iter()
            .find_map(|&w| match Endpoint::open(entry, domain, w) {
                Ok(a) => Some((a, w)),
                Err(e) => {
                    tried.push((w, e));
                    None
                }
            })
            .unwrap_or_else(|| panic!("no CQ with any of the wait objects: {tried:?}"));
        let b = Endpoint::open(entry, domain, wait_obj).expect("the second endpoint");
        let a_to_b = a.insert(&b.name);
        let b_from_a = b.insert(&a.name);
        let b_self = b.insert(&b.name);
        Rig {
            source: info.first().caps & FI_SOURCE != 0,
            info,
            fabric,
            domain,
            a,
            b,
            a_to_b,
            b_from_a,
            b_self,
            wait_obj,
            backlog: RefCell::default(),
        }
    }

    pub fn ep(&self, side: Side) -> &Endpoint {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }

    /// fi_cq_open of a tagged CQ with `wait_obj` on this domain: 0 (the CQ
    /// is closed again) or the negative error.
    pub fn probe_cq(&self, wait_obj: fi_wait_obj) -> isize {
        let mut attr = fi_cq_attr {
            format: FI_CQ_FORMAT_TAGGED,
            wait_obj,
            ..Default::default()
        };
        let mut cq = null_mut();
        // SAFETY: the domain is open, `attr` and `cq` are live locals; a CQ
        // that opened is closed at once.
        unsafe {
            let ret = fi_cq_open(self.domain, &mut attr, &mut cq, null_mut());
            if ret == 0 {
                assert_eq!(fi_close(&raw mut (*cq).fid), 0, "fi_close(cq)");
            }
            ret as isize
        }
    }

    /// The domain's mr_mode.
    pub fn mr_mode(&self) -> c_int {
        self.info.attrs().3.mr_mode
    }

    /// A buffer of `len` bytes (filled with `fill`) registered for sends and
    /// receives of `side`'s endpoint, bound to it where the domain has
    /// FI_MR_ENDPOINT.
    pub fn buffer(&self, side: Side, len: usize, fill: u8) -> Buf {
        let data = vec![fill; len];
        let mut mr = null_mut();
        let acs = FI_SEND | FI_RECV;
        // without FI_MR_PROV_KEY the application picks the keys, unique in
        // the domain (a repeated one is -FI_ENOKEY)
        static KEY: AtomicU64 = AtomicU64::new(1);
        let key = KEY.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the domain is open; `data` (its heap block, which does not
        // move) outlives the region, closed in Buf's drop before it.
        let ret = unsafe {
            fi_mr_reg(
                self.domain,
                data.as_ptr().cast(),
                len,
                acs,
                0,
                key,
                0,
                &mut mr,
                null_mut(),
            )
        };
        check("fi_mr_reg", ret as isize);
        if self.mr_mode() & FI_MR_ENDPOINT != 0 {
            let ep = self.ep(side).ep;
            // SAFETY: an open region and an open endpoint of its domain.
            unsafe {
                check("fi_mr_bind", fi_mr_bind(mr, &raw mut (*ep).fid, 0) as isize);
                check("fi_mr_enable", fi_mr_enable(mr) as isize);
            }
        }
        // SAFETY: `mr` was just opened.
        let desc = unsafe { fi_mr_desc(mr) };
        Buf { data, mr, desc }
    }

    /// Reads what each CQ holds now (one fi_cq_read each) into the backlog.
    pub fn poll(&self) {
        let mut backlog = self.backlog.borrow_mut();
        self.a.read(Side::A, self.source, &mut backlog);
        self.b.read(Side::B, self.source, &mut backlog);
    }

    /// Reads both CQs until a completion for each of `contexts` arrived and
    /// returns those (in the order read; others stay in the backlog);
    /// panics after [`DEADLINE`].
    pub fn wait(&self, contexts: &[*mut c_void]) -> Vec<Completion> {
        let start = Instant::now();
        loop {
            {
                let backlog = self.backlog.borrow();
                if contexts
                    .iter()
                    .all(|c| backlog.iter().any(|g| g.context == *c))
                {
                    break;
                }
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no completion for some of {contexts:?} in {DEADLINE:?}; got {:?}",
                self.backlog.borrow()
            );
            self.poll();
        }
        let mut backlog = self.backlog.borrow_mut();
        let (mine, rest) = backlog
            .drain(..)
            .partition(|c| contexts.contains(&c.context));
        *backlog = rest;
        mine
    }

    /// The completions read so far that no wait asked for.
    pub fn unclaimed(&self) -> Vec<Completion> {
        self.poll();
        std::mem::take(&mut *self.backlog.borrow_mut())
    }

    /// Calls `post` (a transfer call) until it is not `-FI_EAGAIN`, reading
    /// the CQs in between (which makes progress); panics on an error or
    /// after [`DEADLINE`].
    pub fn post(&self, what: &str, mut post: impl FnMut() -> isize) {
        let start = Instant::now();
        loop {
            let ret = post();
            if ret != -(FI_EAGAIN as isize) {
                check(what, ret);
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{what}: -FI_EAGAIN for {DEADLINE:?}"
            );
            self.poll();
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // SAFETY: every object was opened by Rig::open and is closed once,
        // endpoints before the CQs and AVs bound to them, those before the
        // domain, the domain before the fabric.
        unsafe {
            for e in [&mut self.a, &mut self.b] {
                closed(fi_close(&raw mut (*e.ep).fid), "fi_close(ep)");
            }
            for e in [&mut self.a, &mut self.b] {
                closed(fi_close(&raw mut (*e.cq).fid), "fi_close(cq)");
                closed(fi_close(&raw mut (*e.av).fid), "fi_close(av)");
            }
            closed(fi_close(&raw mut (*self.domain).fid), "fi_close(domain)");
            closed(fi_close(&raw mut (*self.fabric).fid), "fi_close(fabric)");
        }
    }
}

impl Endpoint {
    /// A CQ (tagged format, `wait_obj`), an AV (FI_AV_TABLE) and an enabled
    /// endpoint bound to both. Err(code) where the CQ cannot be opened with
    /// that wait object (or, for FI_WAIT_FD, FI_GETWAIT gives no fd).
    fn open(
        info: *mut fi_info,
        domain: *mut fid_domain,
        wait_obj: fi_wait_obj,
    ) -> Result<Self, isize> {
        let mut cq_attr = fi_cq_attr {
            format: FI_CQ_FORMAT_TAGGED,
            wait_obj,
            size: 1024,
            ..Default::default()
        };
        let mut av_attr = fi_av_attr {
            type_: FI_AV_TABLE,
            count: 16,
            ..Default::default()
        };
        let (mut cq, mut av, mut ep) = (null_mut(), null_mut(), null_mut());
        // SAFETY: the domain is open and `info` is the entry it was opened
        // from; the attrs and out pointers are live locals. Each object is
        // bound before fi_enable, as fi_endpoint(3) requires.
        unsafe {
            let ret = fi_cq_open(domain, &mut cq_attr, &mut cq, null_mut());
            if ret != 0 {
                return Err(ret as isize);
            }
            let mut wait_fd = None;
            if wait_obj == FI_WAIT_FD {
                let mut fd: c_int = -1;
                let r = fi_control(&raw mut (*cq).fid, FI_GETWAIT, (&raw mut fd).cast());
                if r != 0 {
                    fi_close(&raw mut (*cq).fid);
                    return Err(r as isize);
                }
                wait_fd = Some(fd);
            }
            check(
                "fi_av_open",
                fi_av_open(domain, &mut av_attr, &mut av, null_mut()) as isize,
            );
            check(
                "fi_endpoint",
                fi_endpoint(domain, info, &mut ep, null_mut()) as isize,
            );
            check(
                "fi_ep_bind(av)",
                fi_ep_bind(ep, &raw mut (*av).fid, 0) as isize,
            );
            let r = fi_ep_bind(ep, &raw mut (*cq).fid, FI_TRANSMIT | FI_RECV);
            check("fi_ep_bind(cq)", r as isize);
            check("fi_enable", fi_enable(ep) as isize);
            let mut name = vec![0u8; 256];
            let mut len = name.len();
            let r = fi_getname(&raw mut (*ep).fid, name.as_mut_ptr().cast(), &mut len);
            check("fi_getname", r as isize);
            name.truncate(len);
            Ok(Endpoint {
                ep,
                cq,
                av,
                wait_fd,
                name,
            })
        }
    }

    /// Inserts an address (as fi_getname gave it) into this endpoint's AV.
    fn insert(&self, name: &[u8]) -> fi_addr_t {
        let mut addr = FI_ADDR_NOTAVAIL;
        // SAFETY: the AV is open, `name` is one address of its format.
        let n = unsafe { fi_av_insert(self.av, name.as_ptr().cast(), 1, &mut addr, 0, null_mut()) };
        assert_eq!(n, 1, "fi_av_insert: {n} ({})", strerror(n as isize));
        assert_ne!(addr, FI_ADDR_NOTAVAIL);
        addr
    }

    /// The string form of this endpoint's address (fi_av_straddr).
    pub fn straddr(&self) -> String {
        let mut buf = vec![0 as c_char; 256];
        let mut len = buf.len();
        // SAFETY: the AV is open, `name` is an address of its format, `buf`
        // writable for `len` bytes.
        let s = unsafe {
            fi_av_straddr(
                self.av,
                self.name.as_ptr().cast(),
                buf.as_mut_ptr(),
                &mut len,
            )
        };
        assert!(!s.is_null(), "fi_av_straddr");
        // SAFETY: fi_av_straddr NUL-terminates within `buf` and returns it.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }

    /// One read of this endpoint's CQ: up to 16 entries, or the error entry.
    pub fn read(&self, side: Side, source: bool, out: &mut Vec<Completion>) {
        read_cq(self.cq, side, source, out);
    }

    pub fn remote(&self) -> Remote {
        Remote {
            ep: self.ep,
            cq: self.cq,
        }
    }
}

/// One read of `cq`: appends its entries (or its error entry) to `out`;
/// returns how many it appended.
pub fn read_cq(cq: *mut fid_cq, side: Side, source: bool, out: &mut Vec<Completion>) -> usize {
    let mut entries = [fi_cq_tagged_entry::default(); 16];
    let mut src = [FI_ADDR_NOTAVAIL; 16];
    let buf = entries.as_mut_ptr().cast();
    // SAFETY: the CQ is open (the rig's), of the tagged format; `entries`
    // and `src` are writable for 16 entries.
    let n = unsafe {
        if source {
            fi_cq_readfrom(cq, buf, entries.len(), src.as_mut_ptr())
        } else {
            fi_cq_read(cq, buf, entries.len())
        }
    };
    if n == -(FI_EAGAIN as isize) {
        return 0;
    }
    if n == -(FI_EAVAIL as isize) {
        let mut e = fi_cq_err_entry::default();
        // SAFETY: as above; `e` is writable with err_data_size 0 (no
        // provider-specific data wanted).
        let r = unsafe { fi_cq_readerr(cq, &mut e, 0) };
        check("fi_cq_readerr", r);
        out.push(Completion {
            side,
            context: e.op_context,
            flags: e.flags,
            len: e.len,
            tag: e.tag,
            data: e.data,
            src: None,
            err: Some((e.err, e.prov_errno)),
        });
        return 1;
    }
    let n = check("fi_cq_read", n) as usize;
    for (e, s) in entries.iter().zip(src).take(n) {
        out.push(Completion {
            side,
            context: e.op_context,
            flags: e.flags,
            len: e.len,
            tag: e.tag,
            data: e.data,
            src: source.then_some(s),
            err: None,
        });
    }
    n
}

/// A fresh operation context: libfabric may use it until the completion
/// (FI_CONTEXT / FI_CONTEXT2 mode), so it is boxed and kept by the test.
pub fn context() -> Box<fi_context2> {
    Box::default()
}

/// The pointer to pass as an operation's `context`.
pub fn ctx(c: &mut fi_context2) -> *mut c_void {
    (c as *mut fi_context2).cast()
}
