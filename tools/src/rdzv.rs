//! The launchers' rendezvous, for when the host list is not known in
//! advance (torchrun's `--rdzv-endpoint`): every node runs `kungfu-run -np N
//! --rdzv HOST:PORT --slots S prog`; the launcher on HOST serves the
//! rendezvous at HOST:PORT, every launcher (that one too) joins it with its
//! slot count, and once the slots joined reach N each gets the host list in
//! the order they joined, its own host (the address it reached the
//! rendezvous from, which the others can reach too) and the job's cluster
//! id; then each goes on as in per-node mode (`--self`).
//!
//! One line at a time, bounded in length, every read and the whole wait
//! under the deadline:
//! ```text
//! server -> launcher:  KFRDZV1 <nonce, hex>\n
//! launcher -> server:  JOIN <slots> <mac, hex>\n
//! server -> launcher:  OK <cluster id, hex> <host:slots,host:slots,...>\n
//!                      ERR <reason>\n
//!
//! mac = HMAC-SHA256(job secret, "kungfu-run rendezvous v1" | nonce | slots)
//! ```
//! A join needs the job secret (`KUNGFU_JOB_SECRET`, the same on every
//! node), over the server's fresh nonce, so that nobody without it can
//! join and a recorded join cannot be replayed.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use kungfu_transport::auth::{eq_constant_time, hex, random, JobSecret};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::{parse_hosts, HostSlots};

const MAC_LABEL: &[u8] = b"kungfu-run rendezvous v1";
/// The most workers a node may bring.
const MAX_SLOTS: usize = 1 << 16;
/// The longest line either side reads (a host list of a few thousand).
const MAX_LINE: u64 = 256 << 10;

/// What the rendezvous gives a launcher.
#[derive(Debug, PartialEq, Eq)]
pub struct Joined {
    pub hosts: Vec<HostSlots>,
    /// This launcher's host in `hosts`.
    pub me: String,
    pub cluster_id: u64,
}

/// A host's name in the job's host list: its address as the rendezvous
/// saw it (`-H` reads an IPv6 one in brackets, as the list writes it).
fn host_name(ip: std::net::IpAddr) -> String {
    ip.to_string()
}

fn join_mac(secret: &JobSecret, nonce: &str, slots: usize) -> String {
    hex(&secret.mac(
        MAC_LABEL,
        &[nonce.as_bytes(), b" ", slots.to_string().as_bytes()],
    ))
}

async fn read_line<R: tokio::io::AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    deadline: Instant,
) -> anyhow::Result<String> {
    let mut line = String::new();
    let n = tokio::time::timeout_at(deadline, r.take(MAX_LINE).read_line(&mut line))
        .await
        .context("timed out")??;
    if n == 0 || !line.ends_with('\n') {
        bail!("the connection closed (or sent a line of more than {MAX_LINE} bytes)");
    }
    Ok(line.trim_end().to_string())
}

/// Serves the rendezvous on `listener` for `np` slots: returns once every
/// launcher that joined has its answer, or at `deadline` (when the joined
/// are told why).
pub async fn serve(
    listener: TcpListener,
    np: usize,
    secret: JobSecret,
    cluster_id: u64,
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut joined: Vec<(HostSlots, BufReader<TcpStream>)> = Vec::new();
    while joined.iter().map(|(h, _)| h.slots).sum::<usize>() < np {
        let accepted = tokio::time::timeout_at(deadline, listener.accept()).await;
        let Ok(Ok((s, from))) = accepted else {
            let why = format!(
                "ERR {} of {np} slots joined the rendezvous before its deadline\n",
                joined.iter().map(|(h, _)| h.slots).sum::<usize>()
            );
            for (_, s) in &mut joined {
                let _ = s.get_mut().write_all(why.as_bytes()).await;
            }
            bail!("{}", why.trim_start_matches("ERR ").trim_end());
        };
        // one slow or hostile joiner may not hold the others up for long
        let one = Instant::now() + Duration::from_secs(10);
        let mut s = BufReader::new(s);
        match handshake(&mut s, from, &secret, one.min(deadline)).await {
            Ok(slots) if joined.iter().any(|(h, _)| h.host == host_name(from.ip())) => {
                let _ = s
                    .get_mut()
                    .write_all(b"ERR this host joined already\n")
                    .await;
                let _ = slots;
            }
            Ok(slots) => {
                let host = HostSlots {
                    host: host_name(from.ip()),
                    slots,
                };
                joined.push((host, s));
            }
            Err(e) => {
                let _ = s
                    .get_mut()
                    .write_all(format!("ERR {e:#}\n").as_bytes())
                    .await;
                eprintln!("kungfu-run: rendezvous: refused {from}: {e:#}");
            }
        }
    }
    let list: Vec<String> = joined
        .iter()
        .map(|(h, _)| {
            if h.host.contains(':') {
                format!("[{}]:{}", h.host, h.slots)
            } else {
                format!("{}:{}", h.host, h.slots)
            }
        })
        .collect();
    let ok = format!("OK {cluster_id:x} {}\n", list.join(","));
    for (_, s) in &mut joined {
        let _ = s.get_mut().write_all(ok.as_bytes()).await;
    }
    Ok(())
}

/// The server's side of one join: the slots asked for.
async fn handshake(
    s: &mut BufReader<TcpStream>,
    from: SocketAddr,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<usize> {
    let nonce = hex(&random::<32>().map_err(|e| anyhow::anyhow!("{e}"))?);
    tokio::time::timeout_at(
        deadline,
        s.get_mut()
            .write_all(format!("KFRDZV1 {nonce}\n").as_bytes()),
    )
    .await
    .context("timed out")??;
    let line = read_line(s, deadline).await?;
    let mut f = line.split(' ');
    let (Some("JOIN"), Some(slots), Some(mac), None) = (f.next(), f.next(), f.next(), f.next())
    else {
        bail!(
            "not a join from {from}: {:?}",
            line.chars().take(80).collect::<String>()
        );
    };
    let slots: usize = slots.parse().context("bad slot count")?;
    if slots == 0 || slots > MAX_SLOTS {
        bail!("bad slot count {slots}");
    }
    if !eq_constant_time(join_mac(secret, &nonce, slots).as_bytes(), mac.as_bytes()) {
        bail!("bad credential (another KUNGFU_JOB_SECRET?)");
    }
    Ok(slots)
}

/// Joins the rendezvous at `endpoint` with `slots`, retrying the
/// connection until `deadline` (its server may start later).
pub async fn join(
    endpoint: &str,
    slots: usize,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<Joined> {
    join_from(None, endpoint, slots, secret, deadline).await
}

/// [`join`], from source address `from` if given (tests: loopback
/// addresses stand for hosts).
async fn join_from(
    from: Option<std::net::IpAddr>,
    endpoint: &str,
    slots: usize,
    secret: &JobSecret,
    deadline: Instant,
) -> anyhow::Result<Joined> {
    let connect = || async {
        match from {
            None => TcpStream::connect(endpoint).await,
            Some(ip) => {
                let to: SocketAddr = tokio::net::lookup_host(endpoint)
                    .await?
                    .next()
                    .ok_or_else(|| std::io::Error::other("no address"))?;
                let sock = tokio::net::TcpSocket::new_v4()?;
                sock.bind(SocketAddr::new(ip, 0))?;
                sock.connect(to).await
            }
        }
    };
    let s = loop {
        match tokio::time::timeout_at(deadline, connect()).await {
            Ok(Ok(s)) => break s,
            Ok(Err(e)) if Instant::now() + Duration::from_millis(200) < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Ok(Err(e)) => bail!("cannot reach the rendezvous at {endpoint}: {e}"),
            Err(_) => bail!("cannot reach the rendezvous at {endpoint} before the deadline"),
        }
    };
    let me = host_name(s.local_addr()?.ip());
    let mut s = BufReader::new(s);
    let hello = read_line(&mut s, deadline)
        .await
        .context("the rendezvous's greeting")?;
    let Some(nonce) = hello.strip_prefix("KFRDZV1 ") else {
        bail!("{endpoint} is not a kungfu-run rendezvous");
    };
    let mac = join_mac(secret, nonce, slots);
    s.get_mut()
        .write_all(format!("JOIN {slots} {mac}\n").as_bytes())
        .await?;
    let answer = read_line(&mut s, deadline)
        .await
        .context("waiting for the other nodes at the rendezvous")?;
    if let Some(why) = answer.strip_prefix("ERR ") {
        bail!("the rendezvous at {endpoint} refused: {why}");
    }
    let mut f = answer.split(' ');
    let (Some("OK"), Some(id), Some(hosts), None) = (f.next(), f.next(), f.next(), f.next()) else {
        bail!("a bad answer from the rendezvous at {endpoint}");
    };
    let cluster_id = u64::from_str_radix(id, 16).context("a bad cluster id from the rendezvous")?;
    let hosts = parse_hosts(hosts)?;
    if !hosts.iter().any(|h| h.host == me) {
        bail!("the rendezvous's host list leaves this host ({me}) out");
    }
    if hosts.iter().any(|h| h.slots > MAX_SLOTS) {
        bail!("the rendezvous's host list asks for more than {MAX_SLOTS} slots on a host");
    }
    let loopback = |h: &HostSlots| {
        h.host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    };
    // all on loopback: one machine (tests); some: this node reached its
    // own rendezvous over loopback, and the others cannot
    if hosts.iter().any(loopback) && !hosts.iter().all(loopback) {
        bail!(
            "the rendezvous at {endpoint} is reached over a loopback address, which the other \
             nodes cannot reach: give --rdzv an address of the network (a name that resolves to \
             127.0.1.1, as Debian's /etc/hosts has it for this machine's own name, will not do)"
        );
    }
    Ok(Joined {
        hosts,
        me,
        cluster_id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three launchers join (on loopback addresses of their own); each gets
    /// the same list and id, and itself in it; a joiner with another secret
    /// is refused without holding the others up.
    #[tokio::test]
    async fn launchers_meet_and_strangers_are_refused() {
        let k = JobSecret::new(b"0123456789abcdef").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(20);
        let server = tokio::spawn(serve(l, 5, k.clone(), 0xabc, deadline));
        let other = JobSecret::new(b"fedcba9876543210").unwrap();
        let e = join(&at, 1, &other, deadline).await.unwrap_err();
        assert!(format!("{e:#}").contains("bad credential"), "{e:#}");
        let mut joins = Vec::new();
        for (ip, slots) in [("127.0.0.2", 2), ("127.0.0.3", 1), ("127.0.0.4", 2)] {
            let (at, k) = (at.clone(), k.clone());
            joins.push(tokio::spawn(async move {
                join_from(Some(ip.parse().unwrap()), &at, slots, &k, deadline).await
            }));
        }
        let mut lists = Vec::new();
        for (j, ip) in joins
            .into_iter()
            .zip(["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        {
            let got = j.await.unwrap().unwrap();
            assert_eq!(got.me, ip);
            assert_eq!(got.cluster_id, 0xabc);
            lists.push(got.hosts);
        }
        assert!(lists.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(lists[0].iter().map(|h| h.slots).sum::<usize>(), 5);
        server.await.unwrap().unwrap();
    }

    /// Too few slots by the deadline: everybody is told, nobody hangs.
    #[tokio::test]
    async fn a_rendezvous_short_of_slots_ends_at_its_deadline() {
        let k = JobSecret::new(b"0123456789abcdef").unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = l.local_addr().unwrap().to_string();
        let deadline = Instant::now() + Duration::from_secs(2);
        let server = tokio::spawn(serve(l, 4, k.clone(), 1, deadline));
        let e = join(&at, 2, &k, deadline + Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("2 of 4 slots joined"), "{e:#}");
        assert!(server.await.unwrap().is_err());
    }
}
