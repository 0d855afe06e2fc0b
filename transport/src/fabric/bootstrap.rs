//! The bootstrap of a fabric wire: a TCP link per pair of ranks, opened
//! with the shared handshake (the higher rank dials), over which the two
//! tell each other their eager limit and their libfabric address.

use std::collections::HashMap;
use std::sync::Arc;

use kungfu_topology::Rank;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::FabricConfig;
use crate::connect::{self, Incoming};
use crate::{Instant, TransportError};

/// What a rank tells each peer at connect: its eager limit and its address.
async fn exchange(
    s: &mut TcpStream,
    eager_max: usize,
    name: &[u8],
    dialer: bool,
) -> Result<(u32, Vec<u8>), String> {
    let mut out = Vec::with_capacity(6 + name.len());
    out.extend_from_slice(&(eager_max as u32).to_le_bytes());
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
    if dialer {
        s.write_all(&out)
            .await
            .map_err(|e| format!("send address: {e}"))?;
        read_address(s).await
    } else {
        let got = read_address(s).await?;
        s.write_all(&out)
            .await
            .map_err(|e| format!("send address: {e}"))?;
        Ok(got)
    }
}

async fn read_address(s: &mut TcpStream) -> Result<(u32, Vec<u8>), String> {
    let mut head = [0u8; 6];
    s.read_exact(&mut head)
        .await
        .map_err(|e| format!("read address: {e}"))?;
    let eager = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
    let len = u16::from_le_bytes(head[4..].try_into().expect("2 bytes"));
    let mut name = vec![0u8; usize::from(len)];
    s.read_exact(&mut name)
        .await
        .map_err(|e| format!("read address: {e}"))?;
    Ok((eager, name))
}

type Link = (TcpStream, u32, Vec<u8>);

pub(super) async fn dial_lower(
    cfg: &Arc<FabricConfig>,
    name: &[u8],
    deadline: Instant,
) -> Result<HashMap<Rank, Link>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank);
    connect::dial_all(lower, |peer| {
        let (cfg, name) = (cfg.clone(), name.to_vec());
        async move {
            let p = cfg.peers.peer(peer).expect("peer below our rank");
            let me = cfg.identity();
            connect::dial(peer, p.to_string(), deadline, || async {
                let mut s = connect::tcp_hello(p, &me, peer).await?;
                let (eager, addr) = exchange(&mut s, cfg.eager_max, &name, true)
                    .await
                    .map_err(|e| (true, e))?;
                Ok((s, eager, addr))
            })
            .await
        }
    })
    .await
}

pub(super) async fn accept_higher(
    cfg: &Arc<FabricConfig>,
    name: &[u8],
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
        let (cfg, name) = (cfg.clone(), name.to_vec());
        async move {
            let may_dial = |r: Rank| r > cfg.rank;
            let from = connect::tcp_answer(&mut s, &cfg.identity(), may_dial).await?;
            let (eager, addr) = exchange(&mut s, cfg.eager_max, &name, false).await?;
            Ok((from, (s, eager, addr)))
        }
    };
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}
