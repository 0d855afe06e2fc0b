//! The bootstrap of a verbs wire: a TCP link per pair of ranks, opened
//! with the shared handshake (the higher rank dials), over which the two
//! exchange their queue pairs' [`QpInfo`] and then say they are ready to
//! send; the link then stays open as the control link, whose goodbye or
//! end is the end of its peer.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::Rank;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};

use super::core::Core;
use super::proto::QpInfo;
use super::VerbsConfig;
use crate::connect::{self, Incoming};
use crate::endpoint::CLOSED_BY_PEER;
use crate::{Instant, TransportError};

/// A random first packet sequence number (24 bits).
pub(super) fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    (h.finish() & 0xff_ffff) as u32
}

pub(super) type Link = (TcpStream, QpInfo);

/// Sends `mine` and reads the peer's (the dialer writes first). A link
/// that breaks may be tried again; a peer that is not a verbs wire may not.
async fn exchange(
    s: &mut TcpStream,
    mine: &QpInfo,
    dialer: bool,
) -> Result<QpInfo, (bool, String)> {
    let out = mine.encode();
    let mut got = [0u8; QpInfo::LEN];
    let send = |e: std::io::Error| (true, format!("send queue pair info: {e}"));
    let read = |e: std::io::Error| (true, format!("read queue pair info: {e}"));
    if dialer {
        s.write_all(&out).await.map_err(send)?;
        s.read_exact(&mut got).await.map_err(read)?;
    } else {
        s.read_exact(&mut got).await.map_err(read)?;
        s.write_all(&out).await.map_err(send)?;
    }
    QpInfo::decode(&got).map_err(|e| (false, e))
}

/// Tells every peer this rank's pair to it is ready to send (so it can
/// receive), and waits for each to say the same.
pub(super) async fn ready_all(
    links: &mut HashMap<Rank, Link>,
    deadline: Instant,
) -> Result<(), TransportError> {
    const READY: &[u8; 4] = b"RTS!";
    let fail = |peer: Rank, reason: String| TransportError::Handshake {
        peer: Some(peer),
        addr: String::new(),
        reason,
    };
    for (peer, (s, _)) in links.iter_mut() {
        s.write_all(READY)
            .await
            .map_err(|e| fail(*peer, format!("send ready: {e}")))?;
    }
    for (peer, (s, _)) in links.iter_mut() {
        let mut b = [0u8; 4];
        match tokio::time::timeout_at(deadline, s.read_exact(&mut b)).await {
            Ok(Ok(_)) if &b == READY => {}
            Ok(Ok(_)) => return Err(fail(*peer, "bad ready".into())),
            Ok(Err(e)) => return Err(fail(*peer, format!("read ready: {e}"))),
            Err(_) => return Err(fail(*peer, "not ready before the deadline".into())),
        }
    }
    Ok(())
}

pub(super) async fn dial_lower(
    cfg: &Arc<VerbsConfig>,
    infos: &Arc<Vec<QpInfo>>,
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank);
    connect::dial_all(lower, |peer| {
        let (cfg, infos) = (cfg.clone(), infos.clone());
        async move {
            let p = cfg.peers.peer(peer).expect("peer below our rank");
            let me = cfg.identity();
            connect::dial(peer, p.to_string(), deadline, || async {
                let mut s = connect::tcp_hello(p, &me, peer).await?;
                let remote = exchange(&mut s, &infos[peer.idx()], true).await?;
                Ok((s, remote))
            })
            .await
        }
    })
    .await
}

pub(super) async fn accept_higher(
    cfg: &Arc<VerbsConfig>,
    infos: &Arc<Vec<QpInfo>>,
    listener: TcpListener,
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let wanted: Vec<Rank> = (cfg.rank.0 + 1..cfg.peers.len() as u32).map(Rank).collect();
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let incoming = || async {
        match listener.accept().await {
            Ok((s, addr)) => Incoming::Conn(s, addr.to_string()),
            Err(e) => Incoming::Failed(format!("accept: {e}")),
        }
    };
    let answer = |mut s: TcpStream| {
        let (cfg, infos) = (cfg.clone(), infos.clone());
        async move {
            let may_dial = |r: Rank| r > cfg.rank;
            let from = connect::tcp_answer(&mut s, &cfg.identity(), may_dial).await?;
            let remote = exchange(&mut s, &infos[from.idx()], false)
                .await
                .map_err(|(_, e)| e)?;
            Ok((from, (s, remote)))
        }
    };
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}

/// Watches the control link of `peer`: its goodbye (then waits until its
/// frames all arrived), or its end, is the end of the peer.
pub(super) async fn watch(mut rd: OwnedReadHalf, peer: Rank, core: Arc<Core>) {
    let mut b = [0u8; 12];
    let (why, broken) = match rd.read_exact(&mut b).await {
        Ok(_) if b[..4] == *b"BYE!" => {
            let sent = u64::from_le_bytes(b[4..].try_into().expect("8 bytes"));
            // its frames may still be in flight: wait for them (the close
            // that reads this bounds the wait)
            while core.received[peer.idx()].load(Ordering::Relaxed) < sent {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            (CLOSED_BY_PEER.to_string(), false)
        }
        Ok(_) => (
            "protocol violation: bad goodbye on the control link".to_string(),
            true,
        ),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            (CLOSED_BY_PEER.to_string(), true)
        }
        Err(e) => (format!("control link: {e}"), true),
    };
    core.lose(peer, why, broken);
}
