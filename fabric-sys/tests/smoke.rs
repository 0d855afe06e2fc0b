//! The bindings against the system libfabric, with no hardware: for the
//! `tcp;ofi_rxm` (over the loopback) and `shm` providers, two FI_EP_RDM
//! endpoints in this process exchange tagged messages. Prints the
//! provider's facts (run with `--nocapture` to see them). Every wait is
//! bounded (rig::DEADLINE).
//!
//! The providers are chosen with FI_PROVIDER (an include list, read once
//! by the library's first call): providers for hardware this machine lacks
//! (psm2, psm3, opx, verbs, efa, ...) are then never asked, and FI_TCP_IFACE
//! keeps tcp on the loopback.
#![allow(unsafe_code)] // the bindings are all unsafe

mod rig;

use std::os::raw::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, Once};
use std::thread;
use std::time::{Duration, Instant};

use kungfu_fabric_sys::*;
use rig::*;

/// The capabilities every test asks for.
const CAPS: u64 = FI_TAGGED | FI_MSG;
/// The ones the backend would like: the source of a receive in its
/// completion, and receives from one peer only.
const EXTRA: u64 = FI_SOURCE | FI_DIRECTED_RECV;

/// A tag with the top bit set: all 64 bits must match.
const TAG: u64 = 0xFEDC_BA98_7654_3210;

/// Sets the environment once, before the first libfabric call, and runs
/// the tests one at a time (the timings would disturb each other, and this
/// machine may have 2 cores).
fn setup() -> MutexGuard<'static, ()> {
    static ENV: Once = Once::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    ENV.call_once(|| {
        std::env::set_var("FI_PROVIDER", "tcp,ofi_rxm,shm");
        std::env::set_var("FI_TCP_IFACE", "lo");
    });
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The rig of `prov`, with FI_SOURCE and FI_DIRECTED_RECV where it has
/// them, its CQs with the first of `waits` it takes.
fn rig_with(prov: &str, waits: &[fi_wait_obj]) -> Rig {
    let info = Info::get(prov, CAPS | EXTRA)
        .or_else(|_| Info::get(prov, CAPS))
        .unwrap_or_else(|e| panic!("fi_getinfo({prov}): {e} ({})", strerror(e)));
    Rig::open(info, waits)
}

/// The rig of `prov`, its CQs with FI_WAIT_FD where it takes it, else
/// FI_WAIT_NONE.
fn rig(prov: &str) -> Rig {
    rig_with(prov, &[FI_WAIT_FD, FI_WAIT_NONE])
}

macro_rules! provider_tests {
    ($($module:ident: $prov:literal,)*) => {$(
        mod $module {
            #[test]
            fn facts_and_tagged_transfers() {
                let _serial = super::setup();
                super::facts($prov);
                super::transfers($prov);
            }

            #[test]
            fn wait_object() {
                let _serial = super::setup();
                super::wait_object($prov);
            }

            #[test]
            fn ping_pong() {
                let _serial = super::setup();
                super::ping_pong($prov);
            }
        }
    )*};
}

provider_tests! {
    tcp_rxm: "tcp;ofi_rxm",
    shm: "shm",
}

/// Prints what the backend design needs to know about `prov`.
fn facts(prov: &str) {
    let base = Info::get(prov, CAPS).unwrap_or_else(|e| panic!("fi_getinfo({prov}): {e}"));
    let (tx, rx, ep, dom) = base.attrs();
    let i = base.first();
    let (name, domain) = base.names();
    println!("== {prov}: provider {name}, domain {domain}");
    println!(
        "caps (asked FI_TAGGED|FI_MSG): {}",
        tostr(&i.caps, FI_TYPE_CAPS)
    );
    println!("mode: {}", tostr(&i.mode, FI_TYPE_MODE));
    println!(
        "mr_mode: {} ({:#x})",
        tostr(&dom.mr_mode, FI_TYPE_MR_MODE),
        dom.mr_mode
    );
    println!(
        "addr_format: {}, src_addrlen {}",
        tostr(&i.addr_format, FI_TYPE_ADDR_FORMAT),
        i.src_addrlen
    );
    println!(
        "max_msg_size {}, inject_size {}",
        ep.max_msg_size, tx.inject_size
    );
    println!(
        "mem_tag_format {:#x}, cq_data_size {}",
        ep.mem_tag_format, dom.cq_data_size
    );
    println!(
        "tx size {}, rx size {}, iov_limit tx {} rx {}",
        tx.size, rx.size, tx.iov_limit, rx.iov_limit
    );
    println!(
        "threading {}, progress control {} data {}",
        tostr(&dom.threading, FI_TYPE_THREADING),
        tostr(&dom.control_progress, FI_TYPE_PROGRESS),
        tostr(&dom.data_progress, FI_TYPE_PROGRESS)
    );
    println!("msg_order tx: {}", tostr(&tx.msg_order, FI_TYPE_MSG_ORDER));
    for (cap, what) in [
        (FI_SOURCE, "FI_SOURCE"),
        (FI_DIRECTED_RECV, "FI_DIRECTED_RECV"),
    ] {
        let has = Info::get(prov, CAPS | cap).is_ok();
        println!("{what}: {}", if has { "supported" } else { "not offered" });
    }
    assert!(i.caps & CAPS == CAPS, "asked caps missing");
}

/// The tagged transfers between A and B, each checked byte by byte.
fn transfers(prov: &str) {
    let rig = rig(prov);
    println!(
        "{prov}: A is {}, B is {} (names of {} bytes); CQ wait object {}; FI_SOURCE {}",
        rig.a.straddr(),
        rig.b.straddr(),
        rig.a.name.len(),
        wait_name(rig.wait_obj),
        rig.source
    );
    for w in [
        FI_WAIT_FD,
        FI_WAIT_POLLFD,
        FI_WAIT_UNSPEC,
        FI_WAIT_YIELD,
        FI_WAIT_MUTEX_COND,
    ] {
        let ret = rig.probe_cq(w);
        let res = if ret == 0 {
            "ok".to_owned()
        } else {
            format!("{ret} ({})", strerror(ret))
        };
        println!("{prov}: fi_cq_open with {}: {res}", wait_name(w));
    }
    // a receive posted first, then a send: the expected path
    expected(&rig, 13, TAG);
    // a send first, then the receive: the unexpected path
    unexpected(&rig, 29, TAG ^ 1);
    // large: rendezvous (rxm) or CMA (shm)
    expected(&rig, 4 << 20, 7);
    ignore_bits(&rig);
    inject(&rig);
    senddata(&rig);
    directed_and_cancel(&rig);
    let rest = rig.unclaimed();
    assert!(rest.is_empty(), "stray completions: {rest:?}");
}

fn wait_name(w: fi_wait_obj) -> &'static str {
    match w {
        FI_WAIT_FD => "FI_WAIT_FD",
        FI_WAIT_NONE => "FI_WAIT_NONE",
        FI_WAIT_UNSPEC => "FI_WAIT_UNSPEC",
        FI_WAIT_YIELD => "FI_WAIT_YIELD",
        FI_WAIT_MUTEX_COND => "FI_WAIT_MUTEX_COND",
        FI_WAIT_POLLFD => "FI_WAIT_POLLFD",
        _ => "another",
    }
}

/// A pattern that differs for each byte and each message length.
fn fill(buf: &mut [u8], seed: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8;
    }
}

/// Posts a tagged receive of `side` into `buf`.
fn trecv(
    rig: &Rig,
    side: Side,
    buf: &mut Buf,
    src: fi_addr_t,
    tag: u64,
    ignore: u64,
    c: *mut c_void,
) {
    let ep = rig.ep(side).ep;
    let (data, len, desc) = (buf.data.as_mut_ptr().cast(), buf.data.len(), buf.desc);
    rig.post("fi_trecv", || {
        // SAFETY: the endpoint is enabled; `buf` is registered and outlives
        // the receive (the test waits for its completion); `c` is a boxed
        // fi_context2 the test keeps until then.
        unsafe { fi_trecv(ep, data, len, desc, src, tag, ignore, c) }
    });
}

/// Posts a tagged send of `buf` from `side` to the other endpoint.
fn tsend(rig: &Rig, side: Side, buf: &Buf, tag: u64, c: *mut c_void) {
    let (ep, to) = match side {
        Side::A => (rig.a.ep, rig.a_to_b),
        Side::B => (rig.b.ep, rig.b_from_a),
    };
    let (data, len, desc) = (buf.data.as_ptr().cast(), buf.data.len(), buf.desc);
    rig.post("fi_tsend", || {
        // SAFETY: the endpoint is enabled; `buf` is registered and outlives
        // the send (the test waits for its completion); `c` is kept until
        // then.
        unsafe { fi_tsend(ep, data, len, desc, to, tag, c) }
    });
}

/// Checks B's receive completion: the flags, length, tag and source.
fn check_recv(rig: &Rig, got: &Completion, len: usize, tag: u64) {
    assert_eq!(got.side, Side::B);
    assert_eq!(got.err, None, "receive failed: {got:?}");
    assert_eq!(
        got.flags & (FI_RECV | FI_TAGGED),
        FI_RECV | FI_TAGGED,
        "{got:?}"
    );
    assert_eq!(got.len, len, "length");
    assert_eq!(got.tag, tag, "tag");
    if rig.source {
        assert_eq!(
            got.src,
            Some(rig.b_from_a),
            "the source address (FI_SOURCE)"
        );
    }
}

fn expected(rig: &Rig, len: usize, tag: u64) {
    let mut out = rig.buffer(Side::A, len, 0);
    fill(&mut out.data, len);
    let mut into = rig.buffer(Side::B, len, 0);
    let (mut rc, mut sc) = (context(), context());
    trecv(
        rig,
        Side::B,
        &mut into,
        FI_ADDR_UNSPEC,
        tag,
        0,
        ctx(&mut rc),
    );
    tsend(rig, Side::A, &out, tag, ctx(&mut sc));
    let got = rig.wait(&[ctx(&mut rc), ctx(&mut sc)]);
    let recv = got.iter().find(|c| c.context == ctx(&mut rc)).unwrap();
    check_recv(rig, recv, len, tag);
    let send = got.iter().find(|c| c.context == ctx(&mut sc)).unwrap();
    assert_eq!((send.side, send.err), (Side::A, None), "{send:?}");
    assert_eq!(
        send.flags & (FI_SEND | FI_TAGGED),
        FI_SEND | FI_TAGGED,
        "{send:?}"
    );
    assert!(into.data == out.data, "{len} bytes arrived changed");
}

fn unexpected(rig: &Rig, len: usize, tag: u64) {
    let mut out = rig.buffer(Side::A, len, 0);
    fill(&mut out.data, len + 1);
    let mut into = rig.buffer(Side::B, len, 0);
    let (mut rc, mut sc) = (context(), context());
    tsend(rig, Side::A, &out, tag, ctx(&mut sc));
    // let the message reach B before its receive is posted
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(100) {
        rig.poll();
    }
    trecv(
        rig,
        Side::B,
        &mut into,
        FI_ADDR_UNSPEC,
        tag,
        0,
        ctx(&mut rc),
    );
    let got = rig.wait(&[ctx(&mut rc), ctx(&mut sc)]);
    check_recv(
        rig,
        got.iter().find(|c| c.context == ctx(&mut rc)).unwrap(),
        len,
        tag,
    );
    assert!(
        into.data == out.data,
        "the unexpected message arrived changed"
    );
}

/// A receive that ignores the low byte of the tag gets the sender's tag.
fn ignore_bits(rig: &Rig) {
    let (sent, posted) = (TAG & !0xFF | 0x12, TAG | 0xFF);
    let mut out = rig.buffer(Side::A, 64, 0x5A);
    fill(&mut out.data, 3);
    let mut into = rig.buffer(Side::B, 64, 0);
    let (mut rc, mut sc) = (context(), context());
    trecv(
        rig,
        Side::B,
        &mut into,
        FI_ADDR_UNSPEC,
        posted,
        0xFF,
        ctx(&mut rc),
    );
    tsend(rig, Side::A, &out, sent, ctx(&mut sc));
    let got = rig.wait(&[ctx(&mut rc), ctx(&mut sc)]);
    check_recv(
        rig,
        got.iter().find(|c| c.context == ctx(&mut rc)).unwrap(),
        64,
        sent,
    );
    assert!(into.data == out.data);
}

/// fi_tinject: no send completion, the bytes arrive.
fn inject(rig: &Rig) {
    let len = rig.info.attrs().0.inject_size.min(48);
    let mut payload = vec![0u8; len];
    fill(&mut payload, 9);
    let mut into = rig.buffer(Side::B, len, 0);
    let mut rc = context();
    trecv(rig, Side::B, &mut into, FI_ADDR_UNSPEC, 42, 0, ctx(&mut rc));
    let (ep, to) = (rig.a.ep, rig.a_to_b);
    rig.post("fi_tinject", || {
        // SAFETY: A is enabled; `payload` is read during the call only and
        // `len` is at most the inject size.
        unsafe { fi_tinject(ep, payload.as_ptr().cast(), len, to, 42) }
    });
    let got = rig.wait(&[ctx(&mut rc)]);
    check_recv(rig, &got[0], len, 42);
    assert!(into.data == payload);
}

/// fi_tsenddata: the 64-bit immediate arrives in B's completion.
fn senddata(rig: &Rig) {
    let out = rig.buffer(Side::A, 100, 0x33);
    let mut into = rig.buffer(Side::B, 100, 0);
    let (mut rc, mut sc) = (context(), context());
    trecv(rig, Side::B, &mut into, FI_ADDR_UNSPEC, 77, 0, ctx(&mut rc));
    let (ep, data, desc, to, c) = (
        rig.a.ep,
        out.data.as_ptr().cast(),
        out.desc,
        rig.a_to_b,
        ctx(&mut sc),
    );
    let imm = 0x0123_4567_89AB_CDEF;
    rig.post("fi_tsenddata", || {
        // SAFETY: as fi_tsend in tsend().
        unsafe { fi_tsenddata(ep, data, 100, desc, imm, to, 77, c) }
    });
    let got = rig.wait(&[ctx(&mut rc), ctx(&mut sc)]);
    let recv = got.iter().find(|c| c.context == ctx(&mut rc)).unwrap();
    check_recv(rig, recv, 100, 77);
    assert!(recv.flags & FI_REMOTE_CQ_DATA != 0, "{recv:?}");
    assert_eq!(recv.data, imm);
    assert!(into.data == out.data);
}

/// With FI_DIRECTED_RECV, a receive for another source is passed over:
/// B posts one for its own address, then one for A, with the same tag, and
/// A's message lands in the second. The first is then cancelled and
/// completes with FI_ECANCELED (fi_cancel, fi_cq_readerr). Without
/// FI_DIRECTED_RECV only the cancel is tested.
fn directed_and_cancel(rig: &Rig) {
    let directed = rig.info.first().caps & FI_DIRECTED_RECV != 0;
    let mut wrong = rig.buffer(Side::B, 32, 0);
    let mut right = rig.buffer(Side::B, 32, 0);
    let out = rig.buffer(Side::A, 32, 0x77);
    let (mut wc, mut rc, mut sc) = (context(), context(), context());
    if directed {
        trecv(rig, Side::B, &mut wrong, rig.b_self, 5, 0, ctx(&mut wc));
        trecv(rig, Side::B, &mut right, rig.b_from_a, 5, 0, ctx(&mut rc));
        tsend(rig, Side::A, &out, 5, ctx(&mut sc));
        let got = rig.wait(&[ctx(&mut rc), ctx(&mut sc)]);
        check_recv(
            rig,
            got.iter().find(|c| c.context == ctx(&mut rc)).unwrap(),
            32,
            5,
        );
        assert!(right.data == out.data && wrong.data.iter().all(|b| *b == 0));
    } else {
        trecv(rig, Side::B, &mut wrong, FI_ADDR_UNSPEC, 5, 0, ctx(&mut wc));
    }
    let ep = rig.b.ep;
    // SAFETY: B is open; `wc` is the context of its pending receive.
    let ret = unsafe { fi_cancel(&raw mut (*ep).fid, ctx(&mut wc)) };
    check("fi_cancel", ret);
    let got = rig.wait(&[ctx(&mut wc)]);
    assert_eq!(got[0].err.map(|e| e.0), Some(FI_ECANCELED), "{:?}", got[0]);
    println!("FI_DIRECTED_RECV checked: {directed}; fi_cancel gave FI_ECANCELED");
}

/// B sleeps on its CQ's wait object while a thread drives A's send: with
/// FI_WAIT_FD through fi_trywait + poll(2) on the fd from FI_GETWAIT, then
/// with fi_cq_sread; a provider without FI_WAIT_FD only the latter, with
/// FI_WAIT_UNSPEC. Reports how B woke up and the CPU time it spent
/// waiting; fails where it never woke (the message then only arrived
/// through the reads after time-outs).
fn wait_object(prov: &str) {
    let rig = rig_with(prov, &[FI_WAIT_FD, FI_WAIT_UNSPEC]);
    let wait = wait_name(rig.wait_obj);
    // connect A and B first (rxm connects on the first send)
    expected(&rig, 8, 1);
    if let Some(fd) = rig.b.wait_fd {
        let got = wait_once(&rig, 11, |cq, _| {
            // SAFETY: the fabric and B's CQ are open; `fids` holds its one fid.
            let ret = unsafe {
                let mut fids = [&raw mut (*cq).fid];
                fi_trywait(rig.fabric, fids.as_mut_ptr(), 1)
            };
            if ret != 0 {
                return None; // completions pending (-FI_EAGAIN): read again
            }
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; the timeout bounds the wait.
            let n = unsafe { libc::poll(&mut p, 1, STEP.as_millis() as c_int) };
            Some(n > 0)
        });
        println!("{prov}: {wait}, fi_trywait + poll(fd): {got}");
        assert!(got.woke > 0, "the fd never became readable");
    } else {
        println!("{prov}: no FI_WAIT_FD for the CQ; {wait} instead");
    }
    let got = wait_once(&rig, 12, |cq, got| {
        let mut e = fi_cq_tagged_entry::default();
        let timeout = STEP.as_millis() as c_int;
        // SAFETY: B's CQ is open, with a wait object and the tagged format;
        // `e` is writable for the one entry asked for.
        let ret = unsafe { fi_cq_sread(cq, (&raw mut e).cast(), 1, std::ptr::null(), timeout) };
        if ret == 1 {
            let (context, flags, len, tag, data) = (e.op_context, e.flags, e.len, e.tag, e.data);
            got.push(Completion {
                side: Side::B,
                context,
                flags,
                len,
                tag,
                data,
                src: None,
                err: None,
            });
            Some(true)
        } else if ret == -(FI_EAGAIN as isize) {
            Some(false)
        } else {
            None // an error entry (-FI_EAVAIL) or error: the next read reports it
        }
    });
    println!("{prov}: {wait}, fi_cq_sread: {got}");
    assert!(got.woke > 0, "fi_cq_sread never returned the entry");
}

/// How B's wait in wait_once went.
struct Waited {
    /// Returns from the sleep with something to read.
    woke: u32,
    /// Returns from the sleep on its time-out.
    timeouts: u32,
    /// From posting the receive to its completion (A sends after 50 ms).
    took: Duration,
    /// The CPU time B's thread spent in that time.
    cpu: Duration,
}

impl std::fmt::Display for Waited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Waited {
            woke,
            timeouts,
            took,
            cpu,
        } = self;
        write!(
            f,
            "received after {took:.1?} (CPU {cpu:.1?}), {woke} wake-ups, {timeouts} time-outs"
        )
    }
}

/// The CPU time (user and system) of the calling thread.
fn thread_cpu() -> Duration {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage to the pointer it is given.
    let ret = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
    assert_eq!(ret, 0, "getrusage");
    // SAFETY: written by the successful getrusage (and zeroed before).
    let u = unsafe { u.assume_init() };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Posts B's receive, starts a thread that sends from A after 50 ms and
/// drives A's CQ, and waits on B with `sleep` (which may read completions
/// into its second argument; returns None: read again, Some(woke before its
/// timeout)).
fn wait_once(
    rig: &Rig,
    tag: u64,
    sleep: impl Fn(*mut fid_cq, &mut Vec<Completion>) -> Option<bool>,
) -> Waited {
    let out = rig.buffer(Side::A, 256, 0x42);
    let mut into = rig.buffer(Side::B, 256, 0);
    let (mut rc, mut sc) = (context(), context());
    trecv(
        rig,
        Side::B,
        &mut into,
        FI_ADDR_UNSPEC,
        tag,
        0,
        ctx(&mut rc),
    );
    let a = rig.a.remote();
    let send = SendArgs {
        data: out.data.as_ptr().cast(),
        desc: out.desc,
        to: rig.a_to_b,
        c: ctx(&mut sc),
    };
    let (start, cpu) = (Instant::now(), thread_cpu());
    let (mut woke, mut timeouts) = (0, 0);
    thread::scope(|s| {
        s.spawn(move || drive_send(a, send, tag));
        let mut got = Vec::new();
        while !got.iter().any(|c: &Completion| c.context == ctx(&mut rc)) {
            assert!(start.elapsed() < DEADLINE, "B's receive did not complete");
            if read_cq(rig.b.cq, Side::B, rig.source, &mut got) > 0 {
                continue;
            }
            match sleep(rig.b.cq, &mut got) {
                Some(true) => woke += 1,
                Some(false) => timeouts += 1,
                None => {}
            }
        }
    });
    let (took, cpu) = (start.elapsed(), thread_cpu() - cpu);
    assert!(into.data == out.data);
    Waited {
        woke,
        timeouts,
        took,
        cpu,
    }
}

/// What A's thread sends.
struct SendArgs {
    data: *const c_void,
    desc: *mut c_void,
    to: fi_addr_t,
    c: *mut c_void,
}
// SAFETY: the buffer and context outlive the scoped thread that uses them.
unsafe impl Send for SendArgs {}

/// A's side of wait_once: after 50 ms, sends 256 bytes and reads A's CQ
/// until the send completed.
fn drive_send(a: Remote, s: SendArgs, tag: u64) {
    thread::sleep(Duration::from_millis(50));
    let start = Instant::now();
    let mut got = Vec::new();
    loop {
        // SAFETY: A is open and enabled; the buffer, registered, and the
        // context outlive this thread (wait_once waits for it).
        let ret = unsafe { fi_tsend(a.ep, s.data, 256, s.desc, s.to, tag, s.c) };
        if ret != -(FI_EAGAIN as isize) {
            check("fi_tsend", ret);
            break;
        }
        assert!(start.elapsed() < DEADLINE);
        read_cq(a.cq, Side::A, false, &mut got);
    }
    while !got.iter().any(|c| c.context == s.c) {
        assert!(start.elapsed() < DEADLINE, "A's send did not complete");
        read_cq(a.cq, Side::A, false, &mut got);
    }
}

/// Rough numbers, one thread driving both endpoints: the one-way latency
/// of 8-byte messages (half a round trip) and the bandwidth of 1 MiB
/// messages, 8 in flight.
fn ping_pong(prov: &str) {
    let rig = rig(prov);
    expected(&rig, 8, 1); // connect
    let (ping, mut ping_in) = (rig.buffer(Side::A, 8, 1), rig.buffer(Side::B, 8, 0));
    let (pong, mut pong_in) = (rig.buffer(Side::B, 8, 2), rig.buffer(Side::A, 8, 0));
    let rounds = 2000;
    let start = Instant::now();
    let mut done = 0;
    while done < rounds && start.elapsed() < DEADLINE {
        let (mut c1, mut c2, mut c3, mut c4) = (context(), context(), context(), context());
        trecv(
            &rig,
            Side::B,
            &mut ping_in,
            FI_ADDR_UNSPEC,
            3,
            0,
            ctx(&mut c1),
        );
        trecv(
            &rig,
            Side::A,
            &mut pong_in,
            FI_ADDR_UNSPEC,
            4,
            0,
            ctx(&mut c2),
        );
        tsend(&rig, Side::A, &ping, 3, ctx(&mut c3));
        rig.wait(&[ctx(&mut c1)]);
        tsend(&rig, Side::B, &pong, 4, ctx(&mut c4));
        rig.wait(&[ctx(&mut c2), ctx(&mut c3), ctx(&mut c4)]);
        done += 1;
    }
    let lat = start.elapsed() / (2 * done);
    let (len, count, window) = (1 << 20, 64, 8);
    let out = rig.buffer(Side::A, len, 9);
    let mut into: Vec<Buf> = (0..window).map(|_| rig.buffer(Side::B, len, 0)).collect();
    let start = Instant::now();
    let mut sent = 0;
    while sent < count {
        let mut ctxs: Vec<Box<fi_context2>> = (0..2 * window).map(|_| context()).collect();
        let (recvs, sends) = ctxs.split_at_mut(window);
        for (buf, c) in into.iter_mut().zip(recvs.iter_mut()) {
            trecv(&rig, Side::B, buf, FI_ADDR_UNSPEC, 6, 0, ctx(c));
        }
        for c in sends.iter_mut() {
            tsend(&rig, Side::A, &out, 6, ctx(c));
        }
        let all: Vec<*mut c_void> = ctxs.iter_mut().map(|c| ctx(c)).collect();
        rig.wait(&all);
        sent += window;
    }
    let secs = start.elapsed().as_secs_f64();
    let gbps = (count * len) as f64 / secs / 1e9;
    println!("{prov}: one-way latency {lat:?} (8 B, {done} round trips); {gbps:.2} GB/s (1 MiB x {count}, {window} in flight)");
    assert_eq!(
        done, rounds,
        "ping-pong too slow: {done} round trips in {DEADLINE:?}"
    );
}
