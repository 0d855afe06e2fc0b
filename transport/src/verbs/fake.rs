//! An in-process RC fabric behind the `Verbs` seam (`seam.rs`), for tests (and the
//! conformance suite): queue pairs that move through the verbs states
//! (and refuse illegal transitions, and posts in the wrong state),
//! registrations checked on every access, sends that wait for a receive
//! at the peer (RNR) and keep their pair's order, RDMA writes into
//! registered memory checked against the target's key, range and access,
//! completions on a queue whose events ring a socket, and flushes when a
//! pair goes to the error state. Memory is copied when a request
//! executes, which may be long after it was posted: a wire that let go of
//! a buffer too early is caught (its registration is gone).

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use kungfu_topology::Rank;

use super::proto::{opcode, status, LocalPort, Op, QpState, QpStep, RecvWr, SendWr, Sge, Wc};
use super::seam::{Reg, Verbs};

/// The fabric: every endpoint's queue pairs, registrations and
/// completion queue.
#[derive(Default)]
pub struct FakeNet {
    inner: Mutex<Net>,
}

#[derive(Default)]
struct Net {
    qps: HashMap<u32, Qp>,
    mrs: HashMap<u32, Mr>,
    eps: Vec<Ep>,
    next_qpn: u32,
    next_key: u32,
    /// Every send request posted: (endpoint, request).
    log: Vec<(usize, SendWr)>,
}

struct Qp {
    ep: usize,
    state: QpState,
    remote_write: bool,
    dest: Option<u32>,
    recvs: VecDeque<RecvWr>,
    out: VecDeque<SendWr>,
}

struct Mr {
    ep: usize,
    addr: u64,
    len: usize,
    write: bool,
}

struct Ep {
    cq: VecDeque<Wc>,
    armed: bool,
    bell: UnixStream,
    /// The endpoint's queue pair to each rank (0 for itself).
    qpns: Vec<u32>,
}

/// One rank's device on a [`FakeNet`].
pub struct FakeVerbs {
    net: Arc<FakeNet>,
    ep: usize,
    me: Rank,
    bell: UnixStream,
}

/// Deregisters its key when dropped.
struct MrGuard {
    net: Weak<FakeNet>,
    key: u32,
}

impl Drop for MrGuard {
    fn drop(&mut self) {
        if let Some(net) = self.net.upgrade() {
            net.lock().mrs.remove(&self.key);
        }
    }
}

enum Step {
    Done,
    Blocked,
}

impl FakeNet {
    pub fn new() -> Arc<FakeNet> {
        Arc::new(FakeNet::default())
    }

    fn lock(&self) -> MutexGuard<'_, Net> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device of rank `me` of `size`: a queue pair (RESET) per peer.
    pub fn open(self: &Arc<Self>, me: Rank, size: usize) -> FakeVerbs {
        let (bell, ring) = UnixStream::pair().expect("a socket pair");
        bell.set_nonblocking(true).expect("non-blocking");
        ring.set_nonblocking(true).expect("non-blocking");
        let mut net = self.lock();
        let ep = net.eps.len();
        let mut qpns = vec![0; size];
        for (r, q) in qpns.iter_mut().enumerate() {
            if r == me.idx() {
                continue;
            }
            net.next_qpn += 1;
            *q = net.next_qpn;
            let qp = Qp {
                ep,
                state: QpState::Reset,
                remote_write: false,
                dest: None,
                recvs: VecDeque::new(),
                out: VecDeque::new(),
            };
            net.qps.insert(*q, qp);
        }
        net.eps.push(Ep {
            cq: VecDeque::new(),
            armed: false,
            bell: ring,
            qpns,
        });
        FakeVerbs {
            net: self.clone(),
            ep,
            me,
            bell,
        }
    }

    #[cfg_attr(not(test), allow(dead_code))]
    /// Breaks the link between endpoints `a` and `b` (in opening order)
    /// as a pulled cable would: their first outstanding sends fail with
    /// `RETRY_EXC_ERR`, then both pairs flush.
    pub fn break_link(&self, a: usize, b: usize) {
        let mut net = self.lock();
        let qa = net.eps[a].qpns.get(b).copied().unwrap_or(0);
        let qb = net.eps[b].qpns.get(a).copied().unwrap_or(0);
        net.fail_qp(qa, Some(status::RETRY_EXC_ERR));
        net.fail_qp(qb, Some(status::RETRY_EXC_ERR));
    }

    #[cfg_attr(not(test), allow(dead_code))]
    /// Every send request posted so far, by endpoint.
    pub fn posted(&self) -> Vec<(usize, SendWr)> {
        self.lock().log.clone()
    }

    #[cfg_attr(not(test), allow(dead_code))]
    /// Registrations alive.
    pub fn registrations(&self) -> usize {
        self.lock().mrs.len()
    }
}

impl Net {
    fn complete(&mut self, ep: usize, wc: Wc) {
        let e = &mut self.eps[ep];
        e.cq.push_back(wc);
        if std::mem::take(&mut e.armed) {
            let _ = (&e.bell).write(&[1]);
        }
    }

    /// Moves `qpn` to the error state: its receives and queued sends
    /// complete as flushed (the first send with `first` if given).
    fn fail_qp(&mut self, qpn: u32, mut first: Option<u32>) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.state = QpState::Error;
        let (ep, recvs, out) = (
            qp.ep,
            std::mem::take(&mut qp.recvs),
            std::mem::take(&mut qp.out),
        );
        for r in recvs {
            self.complete(ep, wc(r.wr_id, status::WR_FLUSH_ERR, opcode::RECV, 0, None));
        }
        for s in out {
            let st = first.take().unwrap_or(status::WR_FLUSH_ERR);
            self.complete(ep, wc(s.wr_id, st, opcode::SEND, 0, None));
        }
    }

    /// Whether `sge` is registered at `ep` (for writing if `write`).
    fn covered(&self, ep: usize, sge: &Sge, write: bool) -> bool {
        self.mrs.get(&sge.lkey).is_some_and(|m| {
            m.ep == ep
                && (m.write || !write)
                && sge.addr >= m.addr
                && sge.addr - m.addr + u64::from(sge.len) <= m.len as u64
        })
    }

    /// Runs what the queue pairs can run now.
    fn run(&mut self) {
        loop {
            let mut moved = false;
            let mut busy: Vec<u32> = self
                .qps
                .iter()
                .filter(|(_, q)| !q.out.is_empty())
                .map(|(n, _)| *n)
                .collect();
            busy.sort_unstable();
            for qpn in busy {
                while let Some(&wr) = self.qps.get(&qpn).and_then(|q| q.out.front()) {
                    match self.execute(qpn, &wr) {
                        Step::Done => moved = true,
                        Step::Blocked => break,
                    }
                }
            }
            if !moved {
                return;
            }
        }
    }

    /// Executes the first request of `qpn`'s send queue, if it can go.
    fn execute(&mut self, qpn: u32, wr: &SendWr) -> Step {
        let qp = &self.qps[&qpn];
        let (ep, dest) = (qp.ep, qp.dest.unwrap_or(0));
        let reachable = self
            .qps
            .get(&dest)
            .filter(|d| d.state != QpState::Error && d.dest == Some(qpn));
        let Some(d) = reachable else {
            // nobody answers: the transport retries run out
            self.fail_qp(qpn, Some(status::RETRY_EXC_ERR));
            return Step::Done;
        };
        if !matches!(d.state, QpState::Rtr | QpState::Rts) {
            return Step::Blocked; // the peer cannot receive yet: retried
        }
        let (dep, d_write, d_recv) = (d.ep, d.remote_write, d.recvs.front().copied());
        if let Some(s) = &wr.sge {
            if !self.covered(ep, s, false) {
                self.fail_qp(qpn, Some(status::LOC_PROT_ERR));
                return Step::Done;
            }
        }
        let len = wr.sge.map_or(0, |s| s.len);
        match wr.op {
            Op::Write { addr, rkey } => {
                let target = Sge {
                    addr,
                    len,
                    lkey: rkey,
                };
                if !d_write || !self.covered(dep, &target, true) {
                    self.fail_qp(qpn, Some(status::REM_ACCESS_ERR));
                    return Step::Done;
                }
                copy(wr.sge, addr);
                self.pop(qpn);
                if wr.signaled {
                    self.complete(ep, wc(wr.wr_id, 0, opcode::RDMA_WRITE, 0, None));
                }
            }
            Op::SendImm { imm } => {
                let Some(recv) = d_recv else {
                    return Step::Blocked; // RNR: retried until one is posted
                };
                if len > recv.sge.len || !self.covered(dep, &recv.sge, true) {
                    let st = if len > recv.sge.len {
                        status::LOC_LEN_ERR
                    } else {
                        status::LOC_PROT_ERR
                    };
                    self.qps.get_mut(&dest).expect("found").recvs.pop_front();
                    self.complete(dep, wc(recv.wr_id, st, opcode::RECV, 0, None));
                    self.fail_qp(dest, None);
                    self.fail_qp(qpn, Some(status::REM_INV_REQ_ERR));
                    return Step::Done;
                }
                copy(wr.sge, recv.sge.addr);
                self.qps.get_mut(&dest).expect("found").recvs.pop_front();
                self.pop(qpn);
                self.complete(dep, wc(recv.wr_id, 0, opcode::RECV, len, Some(imm)));
                if wr.signaled {
                    self.complete(ep, wc(wr.wr_id, 0, opcode::SEND, 0, None));
                }
            }
        }
        Step::Done
    }

    fn pop(&mut self, qpn: u32) {
        self.qps.get_mut(&qpn).expect("running").out.pop_front();
    }
}

/// The adapter's DMA: `len` bytes of `from` to `to`.
fn copy(from: Option<Sge>, to: u64) {
    let Some(s) = from else {
        return;
    };
    // SAFETY: both ranges were just checked against live registrations
    // (under the fabric's lock, which deregistering takes). The source is
    // named by the request executing, which the `Verbs` contract keeps
    // allocated and unwritten until its completion; the target is a posted
    // receive slot (likewise), or a range the receiver posted for this
    // write and holds until the sender's `Done` (the wire's rendezvous).
    unsafe {
        std::ptr::copy(s.addr as *const u8, to as *mut u8, s.len as usize);
    }
}

fn wc(wr_id: u64, status: u32, opcode: u32, byte_len: u32, imm: Option<u32>) -> Wc {
    Wc {
        wr_id,
        status,
        opcode,
        byte_len,
        imm,
    }
}

impl FakeVerbs {
    fn qpn(&self, net: &Net, peer: Rank) -> Result<u32, String> {
        net.eps[self.ep]
            .qpns
            .get(peer.idx())
            .copied()
            .filter(|&q| q != 0 && net.qps.contains_key(&q))
            .ok_or_else(|| format!("no queue pair to {peer}"))
    }
}

impl Verbs for FakeVerbs {
    fn port(&self) -> LocalPort {
        LocalPort {
            port: 1,
            lid: self.ep as u16 + 1,
            gid: [self.ep as u8; 16],
            gid_index: 0,
            mtu: 5,
            ethernet: false,
        }
    }

    fn device(&self) -> String {
        format!("fake{}", self.me.0)
    }

    fn qp_num(&self, peer: Rank) -> u32 {
        self.qpn(&self.net.lock(), peer).unwrap_or(0)
    }

    unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
        remote_write: bool,
    ) -> Result<Reg, String> {
        if len == 0 {
            return Err("ibv_reg_mr: zero length".into());
        }
        let mut net = self.net.lock();
        net.next_key += 1;
        let key = net.next_key;
        let mr = Mr {
            ep: self.ep,
            addr: ptr as u64,
            len,
            write: remote_write,
        };
        net.mrs.insert(key, mr);
        let guard = MrGuard {
            net: Arc::downgrade(&self.net),
            key,
        };
        Ok(Reg::new(
            key,
            key,
            ptr as u64,
            len,
            remote_write,
            Box::new(guard),
        ))
    }

    fn modify_qp(&self, peer: Rank, step: &QpStep) -> Result<(), String> {
        let mut net = self.net.lock();
        let qpn = self.qpn(&net, peer)?;
        let state = net.qps[&qpn].state.after(step)?;
        match *step {
            QpStep::Error => net.fail_qp(qpn, None),
            QpStep::Init { remote_write, .. } => {
                net.qps.get_mut(&qpn).expect("found").remote_write = remote_write;
            }
            QpStep::Rtr { dest_qpn, mtu, .. } => {
                if !(1..=5).contains(&mtu) {
                    return Err(format!("bad path MTU {mtu}"));
                }
                net.qps.get_mut(&qpn).expect("found").dest = Some(dest_qpn);
            }
            QpStep::Rts { .. } => {}
        }
        net.qps.get_mut(&qpn).expect("found").state = state;
        net.run();
        Ok(())
    }

    unsafe fn post_send(&self, peer: Rank, wrs: &[SendWr]) -> Result<(), String> {
        let mut net = self.net.lock();
        let qpn = self.qpn(&net, peer)?;
        let state = net.qps[&qpn].state;
        if !state.can_post_send() && state != QpState::Error {
            return Err(format!("ibv_post_send in state {state:?}"));
        }
        for wr in wrs {
            net.log.push((self.ep, *wr));
            if state == QpState::Error {
                net.complete(self.ep, wc(wr.wr_id, status::WR_FLUSH_ERR, 0, 0, None));
            } else {
                net.qps.get_mut(&qpn).expect("found").out.push_back(*wr);
            }
        }
        net.run();
        Ok(())
    }

    unsafe fn post_recv(&self, peer: Rank, wr: &RecvWr) -> Result<(), String> {
        let mut net = self.net.lock();
        let qpn = self.qpn(&net, peer)?;
        let state = net.qps[&qpn].state;
        if state == QpState::Error {
            net.complete(
                self.ep,
                wc(wr.wr_id, status::WR_FLUSH_ERR, opcode::RECV, 0, None),
            );
            return Ok(());
        }
        if !state.can_post_recv() {
            return Err(format!("ibv_post_recv in state {state:?}"));
        }
        net.qps.get_mut(&qpn).expect("found").recvs.push_back(*wr);
        net.run();
        Ok(())
    }

    fn poll_cq(&self, out: &mut Vec<Wc>) -> Result<(), String> {
        let mut net = self.net.lock();
        let cq = &mut net.eps[self.ep].cq;
        let n = cq.len().min(32);
        out.extend(cq.drain(..n));
        Ok(())
    }

    fn arm_cq(&self) -> Result<(), String> {
        let mut net = self.net.lock();
        let e = &mut net.eps[self.ep];
        if e.cq.is_empty() {
            e.armed = true;
        } else {
            let _ = (&e.bell).write(&[1]);
        }
        Ok(())
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.bell.as_raw_fd())
    }

    fn drain_events(&self) {
        let mut b = [0u8; 64];
        while matches!((&self.bell).read(&mut b), Ok(n) if n > 0) {}
    }
}

impl Drop for FakeVerbs {
    /// Destroys the queue pairs: nothing lands in this endpoint's memory
    /// from now on (the peers' sends to them fail).
    fn drop(&mut self) {
        let mut net = self.net.lock();
        let qpns = std::mem::take(&mut net.eps[self.ep].qpns);
        for q in qpns {
            net.qps.remove(&q);
        }
        net.eps[self.ep].cq.clear();
    }
}
