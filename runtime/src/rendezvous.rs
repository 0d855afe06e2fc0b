//! A small rendezvous for workers that were not given a peer list (torchrun,
//! Slurm, Open MPI): rank 0 serves, every rank (rank 0 included) registers
//! the address it listens on, and once all have registered each gets the
//! full peer list and the cluster id.
//!
//! One line each way, bounded in length, every read under the deadline:
//! ```text
//! worker -> rank 0:  KFRV1 <rank> <size> <version> <host> <port>\n
//! rank 0 -> worker:  OK <cluster id, hex> <host:port,host:port,...>\n
//!                    ERR <reason>\n
//! ```
//! A worker advertises the local address of its connection to the
//! rendezvous, which is an address the rendezvous host (and so, on a flat
//! cluster network, every other host) can reach.

use std::collections::BTreeMap;
use std::time::Duration;

use kungfu_topology::{fnv1a64, Peer, PeerList};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::BootstrapError;

const MAX_REQUEST: u64 = 512;
/// A peer entry is at most ~300 bytes; 16384 of them fit.
const MAX_REPLY: u64 = 8 << 20;

fn err(addr: &str, reason: impl Into<String>) -> BootstrapError {
    BootstrapError::Rendezvous {
        addr: addr.to_string(),
        reason: reason.into(),
    }
}

async fn read_line(
    s: &mut BufReader<TcpStream>,
    max: u64,
    deadline: Instant,
) -> Result<String, String> {
    let mut line = String::new();
    let n = tokio::time::timeout_at(deadline, (&mut *s).take(max).read_line(&mut line))
        .await
        .map_err(|_| "timed out".to_string())?
        .map_err(|e| format!("read: {e}"))?;
    if n == 0 || !line.ends_with('\n') {
        return Err("connection closed or line too long".into());
    }
    line.pop();
    Ok(line)
}

/// Serves one rendezvous for `size` workers of cluster version `version`,
/// until all registered or `deadline`.
pub async fn serve(
    listener: TcpListener,
    size: usize,
    version: u32,
    deadline: Instant,
) -> Result<(), BootstrapError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let mut joined: BTreeMap<usize, (Peer, BufReader<TcpStream>)> = BTreeMap::new();
    let mut refusals: Vec<String> = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    while joined.len() < size {
        tokio::select! {
            acc = listener.accept() => {
                let Ok((s, from)) = acc else { continue };
                pending.spawn(async move {
                    let mut s = BufReader::new(s);
                    let r = read_line(&mut s, MAX_REQUEST, deadline).await;
                    (from, s, r)
                });
            }
            Some(Ok((from, mut s, line))) = pending.join_next(), if !pending.is_empty() => {
                let verdict = line.and_then(|l| parse_request(&l, size, version));
                match verdict {
                    Ok((rank, _)) if joined.contains_key(&rank) => {
                        let why = format!("rank {rank} registered twice");
                        let _ = s.get_mut().write_all(format!("ERR {why}\n").as_bytes()).await;
                        refusals.push(format!("{from}: {why}"));
                    }
                    Ok((rank, peer)) => {
                        joined.insert(rank, (peer, s));
                    }
                    Err(why) => {
                        let _ = s.get_mut().write_all(format!("ERR {why}\n").as_bytes()).await;
                        refusals.push(format!("{from}: {why}"));
                    }
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<String> = (0..size)
                    .filter(|r| !joined.contains_key(r))
                    .map(|r| r.to_string())
                    .collect();
                let mut why = format!("ranks [{}] did not register in time", missing.join(", "));
                if !refusals.is_empty() {
                    why.push_str(&format!("; refused: {}", refusals.join("; ")));
                }
                return Err(err(&addr, why));
            }
        }
    }
    let peers: Vec<Peer> = joined.values().map(|(p, _)| p.clone()).collect();
    let reply = match PeerList::new(peers) {
        Ok(list) => format!("OK {:x} {list}\n", cluster_id(&list)),
        Err(e) => format!("ERR {e}\n"),
    };
    for (_, (_, mut s)) in joined {
        // A worker that left after registering finds out when it connects
        // to its peers; the others must still get the list.
        let _ = tokio::time::timeout_at(deadline, s.get_mut().write_all(reply.as_bytes())).await;
    }
    Ok(())
}

fn parse_request(line: &str, size: usize, version: u32) -> Result<(usize, Peer), String> {
    let f: Vec<&str> = line.split(' ').collect();
    if f.len() != 6 || f[0] != "KFRV1" {
        return Err(format!("malformed registration {line:?}"));
    }
    let num = |s: &str| s.parse::<u64>().map_err(|_| format!("bad number {s:?}"));
    let (rank, their_size, their_version) = (num(f[1])?, num(f[2])?, num(f[3])?);
    if their_size != size as u64 {
        return Err(format!("size {their_size} differs from {size}"));
    }
    if their_version != u64::from(version) {
        return Err(format!(
            "cluster version {their_version} differs from {version}"
        ));
    }
    if rank >= size as u64 {
        return Err(format!("rank {rank} outside a cluster of {size}"));
    }
    let port = f[5]
        .parse::<u16>()
        .map_err(|_| format!("bad port {:?}", f[5]))?;
    if f[4].is_empty() {
        return Err("empty host".into());
    }
    Ok((
        rank as usize,
        Peer {
            host: f[4].to_string(),
            port,
        },
    ))
}

/// A job-unique id chosen by rank 0 (no RNG crate needed: the clock, the
/// process id and the peer list are unique enough to tell jobs apart).
fn cluster_id(list: &PeerList) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut h = fnv1a64(list.digest().0, &now.to_le_bytes());
    h = fnv1a64(h, &std::process::id().to_le_bytes());
    h
}

/// Registers rank `rank` with the rendezvous at `host:port` and returns the
/// listener it advertised, the peer list and the cluster id.
pub async fn register(
    host: &str,
    port: u16,
    rank: usize,
    size: usize,
    version: u32,
    deadline: Instant,
) -> Result<(TcpListener, PeerList, u64), BootstrapError> {
    let addr = format!("{host}:{port}");
    let mut backoff = Duration::from_millis(5);
    let stream = loop {
        match tokio::time::timeout_at(deadline, TcpStream::connect((host, port))).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if Instant::now() + backoff < deadline => {
                let _ = e;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Ok(Err(e)) => return Err(err(&addr, format!("cannot connect: {e}"))),
            Err(_) => return Err(err(&addr, "cannot connect before the deadline")),
        }
    };
    let local = stream
        .local_addr()
        .map_err(|e| err(&addr, format!("local address: {e}")))?;
    let listener = TcpListener::bind((local.ip(), 0))
        .await
        .map_err(|e| err(&addr, format!("bind a data port on {}: {e}", local.ip())))?;
    let my_port = listener
        .local_addr()
        .map_err(|e| err(&addr, format!("data port: {e}")))?
        .port();
    let mut s = BufReader::new(stream);
    let req = format!("KFRV1 {rank} {size} {version} {} {my_port}\n", local.ip());
    s.get_mut()
        .write_all(req.as_bytes())
        .await
        .map_err(|e| err(&addr, format!("send: {e}")))?;
    let line = read_line(&mut s, MAX_REPLY, deadline)
        .await
        .map_err(|e| err(&addr, e))?;
    if let Some(why) = line.strip_prefix("ERR ") {
        return Err(err(&addr, format!("refused: {why}")));
    }
    let bad = || {
        err(
            &addr,
            format!("malformed reply {:?}", &line[..line.len().min(80)]),
        )
    };
    let rest = line.strip_prefix("OK ").ok_or_else(bad)?;
    let (id, list) = rest.split_once(' ').ok_or_else(bad)?;
    let id = u64::from_str_radix(id, 16).map_err(|_| bad())?;
    let peers: PeerList = list.parse().map_err(|_| bad())?;
    if peers.len() != size {
        return Err(bad());
    }
    Ok((listener, peers, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_validated() {
        assert!(parse_request("KFRV1 1 4 0 10.0.0.1 5000", 4, 0).is_ok());
        for bad in [
            "KFRV1 4 4 0 h 1",
            "KFRV1 1 5 0 h 1",
            "KFRV1 1 4 1 h 1",
            "KFRV1 1 4 0 h 70000",
            "HELLO",
            "KFRV1 1 4 0  1",
        ] {
            assert!(parse_request(bad, 4, 0).is_err(), "{bad}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn everyone_gets_the_same_list() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let deadline = Instant::now() + Duration::from_secs(10);
        let server = tokio::spawn(serve(l, 3, 0, deadline));
        let clients: Vec<_> = (0..3)
            .map(|r| {
                tokio::spawn(async move { register("127.0.0.1", port, r, 3, 0, deadline).await })
            })
            .collect();
        let mut lists = Vec::new();
        for c in clients {
            let (_l, peers, id) = c.await.unwrap().unwrap();
            lists.push((peers, id));
        }
        server.await.unwrap().unwrap();
        assert!(lists.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(lists[0].0.len(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wrong_size_is_refused_and_the_server_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        // the refusal comes long before the server's deadline, however
        // loaded the machine: only the order of magnitude matters
        let deadline = Instant::now() + Duration::from_secs(3);
        let server = tokio::spawn(serve(l, 2, 0, deadline));
        let e = register("127.0.0.1", port, 1, 3, 0, deadline)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("size 3 differs from 2"), "{e}");
        let e = server.await.unwrap().unwrap_err();
        assert!(
            e.to_string().contains("ranks [0, 1] did not register"),
            "{e}"
        );
    }
}
