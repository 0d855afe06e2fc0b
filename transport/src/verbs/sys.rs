//! The real [`Verbs`]: one device opened through sideway (which loads
//! libibverbs at run time, through rdma-mummy-sys), with a protection
//! domain, a completion queue on a completion channel, and an RC queue
//! pair per peer. Completions are polled and the channel's events taken
//! with the raw calls of rdma-mummy-sys (sideway's poller may keep
//! completions it read if it is not drained, and hides `wc_flags`).
//!
//! Opening says what is missing when it cannot: libibverbs, kernel
//! support, any device, the named one, an active port.

use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::{Arc, Mutex};

use kungfu_topology::Rank;
use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc,
    ibv_wc_flags, ibv_wc_opcode, ibv_wc_status,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, GetDeviceListErrorKind};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState, QueuePairType,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::core::Layout;
use super::proto::{self, opcode, status, LocalPort, Op, QpStep, RecvWr, SendWr, Wc, PORT};
use super::seam::{Reg, Verbs};

// The verbs ABI the protocol's constants stand for.
const _: () = {
    assert!(status::SUCCESS == ibv_wc_status::IBV_WC_SUCCESS);
    assert!(status::WR_FLUSH_ERR == ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
    assert!(status::REM_ACCESS_ERR == ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
    assert!(status::RETRY_EXC_ERR == ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    assert!(status::RNR_RETRY_EXC_ERR == ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR);
    assert!(status::GENERAL_ERR == ibv_wc_status::IBV_WC_GENERAL_ERR);
    assert!(opcode::SEND == ibv_wc_opcode::IBV_WC_SEND);
    assert!(opcode::RDMA_WRITE == ibv_wc_opcode::IBV_WC_RDMA_WRITE);
    assert!(opcode::RECV == ibv_wc_opcode::IBV_WC_RECV);
};

/// Completions read per `ibv_poll_cq`.
const BATCH: usize = 32;

/// An opened device. Fields drop in order: the queue pairs before the
/// completion queue, its channel, the domain and the device (each also
/// holds what it needs alive).
pub(super) struct Sys {
    qps: Vec<Option<Mutex<BasicQueuePair>>>,
    cq: Arc<BasicCompletionQueue>,
    chan: Arc<CompletionChannel>,
    pd: Arc<ProtectionDomain>,
    _ctx: Arc<DeviceContext>,
    port: LocalPort,
    name: String,
}

fn err(what: &str, e: impl std::error::Error) -> String {
    let mut s = format!("{what}: {e}");
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// The device `want` (or the first), its port checked active.
fn open_device(want: Option<&str>) -> Result<(Arc<DeviceContext>, String), String> {
    let list = DeviceList::new().map_err(|e| {
        let GetDeviceListErrorKind::Ibverbs(io) = &e.0 else {
            return err("ibv_get_device_list", &e);
        };
        proto::device_list_error(
            io.raw_os_error(),
            &io.to_string(),
            std::path::Path::new(proto::SYSFS_VERBS).exists(),
        )
    })?;
    if list.is_empty() {
        return Err(proto::no_device());
    }
    let dev = match want {
        None => list.get(0).ok_or_else(proto::no_device)?,
        Some(name) => list.iter().find(|d| d.name() == name).ok_or_else(|| {
            let names: Vec<String> = list.iter().map(|d| d.name()).collect();
            proto::no_such_device(name, &names)
        })?,
    };
    let name = dev.name();
    let ctx = dev
        .open()
        .map_err(|e| err(&format!("ibv_open_device({name})"), e))?;
    let port = ctx
        .query_port(PORT)
        .map_err(|e| err(&format!("ibv_query_port({name}, {PORT})"), e))?;
    if port.port_state() != PortState::Active {
        return Err(format!(
            "port {PORT} of RDMA device {name} is {:?}, not active (for SoftRoCE: is the \
             netdev up? `rdma link show`)",
            port.port_state()
        ));
    }
    Ok((ctx, name))
}

/// Checks that an RDMA device (`want`, or any) can be used here, without
/// connecting: its name, or why not.
pub(super) fn probe(want: Option<&str>) -> Result<String, String> {
    guard(|| open_device(want).map(|(_, name)| name))
}

/// Runs `f`, a panic in the bindings (which assert on odd device data)
/// becoming an error.
fn guard<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let why = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(format!("the verbs bindings panicked: {why}"))
    })
}

/// A RoCE v2 GID of the port (an IPv4-mapped one first), else index 0
/// (InfiniBand, or no table).
fn pick_gid_index(ctx: &DeviceContext) -> u8 {
    let Ok(table) = ctx.query_gid_table() else {
        return 0;
    };
    let v2 = |e: &&sideway::ibverbs::address::GidEntry| {
        e.port_num() == u32::from(PORT) && e.gid_type() == GidType::RoceV2
    };
    let mapped = |e: &&sideway::ibverbs::address::GidEntry| e.gid().raw[..12] == V4_MAPPED;
    table
        .iter()
        .filter(v2)
        .find(mapped)
        .or_else(|| table.iter().find(v2))
        .and_then(|e| u8::try_from(e.gid_index()).ok())
        .unwrap_or(0)
}

const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

impl Sys {
    /// Opens `device` (or the first) with a queue pair (RESET) for each
    /// peer of `layout`.
    pub(super) fn open(
        device: Option<&str>,
        gid_index: Option<u8>,
        layout: &Layout,
    ) -> Result<Sys, String> {
        guard(|| Self::open_inner(device, gid_index, layout))
    }

    fn open_inner(
        device: Option<&str>,
        gid_index: Option<u8>,
        layout: &Layout,
    ) -> Result<Sys, String> {
        let (ctx, name) = open_device(device)?;
        let attr = ctx.query_device().map_err(|e| err("ibv_query_device", e))?;
        let cqe = layout.cq_depth();
        let wr = layout.sq_depth.max(layout.slots);
        if cqe > attr.max_cqe().max(0) as usize || wr > attr.max_qp_wr().max(0) as usize {
            return Err(format!(
                "{name} allows {} completions per queue and {} requests per queue pair; \
                 {} peers with {} eager slots need {cqe} and {wr}: use fewer eager slots",
                attr.max_cqe(),
                attr.max_qp_wr(),
                layout.size.saturating_sub(1),
                layout.slots
            ));
        }
        let port = ctx.query_port(PORT).map_err(|e| err("ibv_query_port", e))?;
        let gid_index = gid_index.unwrap_or_else(|| pick_gid_index(&ctx));
        let gid = ctx
            .query_gid(PORT, u32::from(gid_index))
            .map_err(|e| err(&format!("ibv_query_gid(index {gid_index})"), e))?;
        let local = LocalPort {
            port: PORT,
            lid: port.lid(),
            gid: gid.raw,
            gid_index,
            mtu: port.active_mtu() as u8,
            ethernet: port.link_layer() == LinkLayer::Ethernet,
        };
        let pd = ctx.alloc_pd().map_err(|e| err("ibv_alloc_pd", e))?;
        let chan = CompletionChannel::new(&ctx).map_err(|e| err("ibv_create_comp_channel", e))?;
        chan.set_nonblocking(true)
            .map_err(|e| err("completion channel O_NONBLOCK", e))?;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(cqe as u32)
            .setup_comp_channel(&chan, 0)
            .build()
            .map_err(|e| err("ibv_create_cq", e))?;
        let mut qps = Vec::with_capacity(layout.size);
        for r in 0..layout.size {
            if r == layout.me.idx() {
                qps.push(None);
                continue;
            }
            let qp = pd
                .create_qp_builder()
                .setup_qp_type(QueuePairType::ReliableConnection)
                .setup_max_send_wr(layout.sq_depth as u32)
                .setup_max_recv_wr(layout.slots as u32)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_send_cq(cq.clone())
                .setup_recv_cq(cq.clone())
                .build()
                .map_err(|e| err("ibv_create_qp(RC)", e))?;
            qps.push(Some(Mutex::new(qp)));
        }
        Ok(Sys {
            qps,
            cq,
            chan,
            pd,
            _ctx: ctx,
            port: local,
            name,
        })
    }

    fn qp(&self, peer: Rank) -> Result<std::sync::MutexGuard<'_, BasicQueuePair>, String> {
        let qp = self
            .qps
            .get(peer.idx())
            .and_then(Option::as_ref)
            .ok_or_else(|| format!("no queue pair to {peer}"))?;
        Ok(qp.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn cq_ptr(&self) -> *mut ibv_cq {
        // SAFETY: only the pointer is taken; the CQ lives as long as `self`.
        unsafe { self.cq.cq() }.as_ptr()
    }
}

fn access(remote_write: bool) -> AccessFlags {
    if remote_write {
        AccessFlags::LocalWrite | AccessFlags::RemoteWrite
    } else {
        AccessFlags::none()
    }
}

impl Verbs for Sys {
    fn port(&self) -> LocalPort {
        self.port
    }

    fn device(&self) -> String {
        self.name.clone()
    }

    fn qp_num(&self, peer: Rank) -> u32 {
        self.qp(peer).map_or(0, |qp| qp.qp_number())
    }

    unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
        remote_write: bool,
    ) -> Result<Reg, String> {
        // SAFETY: the caller keeps the memory valid until the returned
        // registration (which holds the MR) is dropped.
        let mr = unsafe { self.pd.reg_mr(ptr as usize, len, access(remote_write)) }
            .map_err(|e| err(&format!("ibv_reg_mr({len} bytes)"), e))?;
        Ok(Reg::new(
            mr.lkey(),
            mr.rkey(),
            ptr as u64,
            len,
            remote_write,
            Box::new(mr),
        ))
    }

    fn modify_qp(&self, peer: Rank, step: &QpStep) -> Result<(), String> {
        let mut attr = QueuePairAttribute::new();
        match *step {
            QpStep::Init {
                port,
                pkey_index,
                remote_write,
            } => {
                attr.setup_state(QueuePairState::Init)
                    .setup_pkey_index(pkey_index)
                    .setup_port(port)
                    .setup_access_flags(access(remote_write));
            }
            QpStep::Rtr {
                port,
                mtu,
                dest_qpn,
                rq_psn,
                max_dest_rd_atomic,
                min_rnr_timer,
                dlid,
                grh,
            } => {
                let mut ah = AddressHandleAttribute::new();
                ah.setup_port(port)
                    .setup_service_level(0)
                    .setup_dest_lid(dlid);
                if let Some(g) = grh {
                    ah.setup_grh(&Gid { raw: g.dgid }, 0, g.sgid_index, g.hop_limit, 0);
                }
                if !(1..=5).contains(&mtu) {
                    return Err(format!("bad path MTU code {mtu}"));
                }
                attr.setup_state(QueuePairState::ReadyToReceive)
                    .setup_path_mtu(Mtu::from(u32::from(mtu)))
                    .setup_dest_qp_num(dest_qpn)
                    .setup_rq_psn(rq_psn)
                    .setup_max_dest_read_atomic(max_dest_rd_atomic)
                    .setup_min_rnr_timer(min_rnr_timer)
                    .setup_address_vector(&ah);
            }
            QpStep::Rts {
                sq_psn,
                timeout,
                retry_cnt,
                rnr_retry,
                max_rd_atomic,
            } => {
                attr.setup_state(QueuePairState::ReadyToSend)
                    .setup_sq_psn(sq_psn)
                    .setup_timeout(timeout)
                    .setup_retry_cnt(retry_cnt)
                    .setup_rnr_retry(rnr_retry)
                    .setup_max_read_atomic(max_rd_atomic);
            }
            QpStep::Error => {
                attr.setup_state(QueuePairState::Error);
            }
        }
        self.qp(peer)?
            .modify(&attr)
            .map_err(|e| err(&format!("ibv_modify_qp({step:?})"), e))
    }

    unsafe fn post_send(&self, peer: Rank, wrs: &[SendWr]) -> Result<(), String> {
        let mut qp = self.qp(peer)?;
        let mut g = qp.start_post_send();
        for wr in wrs {
            let flags = if wr.signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let h = g.construct_wr(wr.wr_id, flags);
            // the immediate goes on the wire as it is given: big-endian
            // by convention, undone in `poll_cq`
            let local = match wr.op {
                Op::SendImm { imm } => h.setup_send_imm(imm.to_be()),
                Op::Write { addr, rkey } => h.setup_write(rkey, addr),
            };
            if let Some(s) = wr.sge {
                // SAFETY: the caller's contract: the buffer is registered
                // under `lkey` and lives until the completion.
                unsafe { local.setup_sge(s.lkey, s.addr, s.len) };
            }
        }
        g.post().map_err(|e| err("ibv_post_send", e))
    }

    unsafe fn post_recv(&self, peer: Rank, wr: &RecvWr) -> Result<(), String> {
        let mut qp = self.qp(peer)?;
        let mut g = qp.start_post_recv();
        let s = wr.sge;
        // SAFETY: the caller's contract: the buffer is registered under
        // `lkey`, unaliased, and lives until the completion.
        unsafe { g.construct_wr(wr.wr_id).setup_sge(s.lkey, s.addr, s.len) };
        g.post().map_err(|e| err("ibv_post_recv", e))
    }

    fn poll_cq(&self, out: &mut Vec<Wc>) -> Result<(), String> {
        let mut wcs = std::mem::MaybeUninit::<[ibv_wc; BATCH]>::uninit();
        // SAFETY: a live CQ; the array is writable for BATCH entries, of
        // which the call initialises the first `n` it returns.
        let n = unsafe { ibv_poll_cq(self.cq_ptr(), BATCH as i32, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(format!("ibv_poll_cq: error {n}"));
        }
        let first: *const ibv_wc = wcs.as_ptr().cast();
        for i in 0..n as usize {
            // SAFETY: entry i < n was written by ibv_poll_cq.
            let wc = unsafe { &*first.add(i) };
            let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            out.push(Wc {
                wr_id: wc.wr_id,
                status: wc.status,
                opcode: wc.opcode,
                byte_len: wc.byte_len,
                // SAFETY: the union holds the immediate when the flag says so.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
            });
        }
        Ok(())
    }

    fn arm_cq(&self) -> Result<(), String> {
        // SAFETY: a live CQ created on a completion channel.
        match unsafe { ibv_req_notify_cq(self.cq_ptr(), 0) } {
            0 => Ok(()),
            e => Err(format!("ibv_req_notify_cq: error {e}")),
        }
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.chan.as_raw_fd())
    }

    fn drain_events(&self) {
        // SAFETY: only the pointer is taken; the channel lives as long as
        // `self`.
        let chan = unsafe { self.chan.comp_channel() }.as_ptr();
        loop {
            let mut cq: *mut ibv_cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: a live channel in non-blocking mode: returns -1 at
            // once when no event is queued.
            if unsafe { ibv_get_cq_event(chan, &mut cq, &mut ctx) } != 0 {
                return;
            }
            // SAFETY: the event's CQ is ours; every event is acknowledged
            // (ibv_destroy_cq waits for that).
            unsafe { ibv_ack_cq_events(cq, 1) };
        }
    }
}
