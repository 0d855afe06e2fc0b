//! Shared pieces of the KungFu-rs tools: argument parsing helpers and the
//! launcher's job plan (which worker runs where, with which environment).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use anyhow::{bail, Context};
use kungfu_topology::{Peer, PeerList};

pub mod bind;
pub mod certs;
pub mod cli;
pub mod config_store;
pub mod launch;
pub mod options;
pub mod plot;
mod procs;
pub mod rdzv;
pub mod remote;
pub mod served;
pub mod sim;

/// Parses `90s`, `5m`, `1h`, `250ms`, or a plain number of seconds.
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or((s, ""), |i| s.split_at(i));
    let v: f64 = num.parse().with_context(|| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "m" | "min" => v * 60.0,
        "h" => v * 3600.0,
        _ => bail!("bad duration unit in {s:?} (use ms, s, m or h)"),
    };
    if !secs.is_finite() || secs < 0.0 {
        bail!("bad duration {s:?}");
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses a byte size such as `1K`, `64M`, `2G` or `4096` (powers of 1024).
pub fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num.parse().with_context(|| format!("bad size {s:?}"))?;
    n.checked_mul(mult)
        .with_context(|| format!("size {s:?} overflows"))
}

/// Formats a byte count the way the bench prints sizes.
pub fn fmt_size(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}B"),
    }
}

/// One `-H` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostSlots {
    pub host: String,
    pub slots: usize,
}

/// Parses `host:slots,host:slots` (a host without `:slots` has one slot).
pub fn parse_hosts(s: &str) -> anyhow::Result<Vec<HostSlots>> {
    let mut out: Vec<HostSlots> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (host, slots) = match part.rsplit_once(':') {
            Some((h, n)) if !h.contains(':') || h.starts_with('[') => (
                h.trim_matches(['[', ']']),
                n.parse()
                    .with_context(|| format!("bad slot count in {part:?}"))?,
            ),
            _ => (part, 1),
        };
        if host.is_empty() || slots == 0 {
            bail!("bad host entry {part:?}");
        }
        if out.iter().any(|h| h.host == host) {
            bail!("host {host} is listed twice");
        }
        out.push(HostSlots {
            host: host.to_string(),
            slots,
        });
    }
    if out.is_empty() {
        bail!("empty host list");
    }
    Ok(out)
}

/// Whether `host` names this machine, as mpirun decides it: `localhost`,
/// a loopback address (all of 127.0.0.0/8 is local on Linux), an address
/// of one of this machine's network interfaces, this machine's name, or a
/// name that resolves to one of those addresses.
pub fn is_local_host(host: &str) -> bool {
    if host == "localhost" {
        return true;
    }
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
        return is_local_ip(ip, &interface_addrs());
    }
    if std::fs::read_to_string("/proc/sys/kernel/hostname").is_ok_and(|h| h.trim() == host) {
        return true;
    }
    use std::net::ToSocketAddrs;
    let own = interface_addrs();
    (host, 0)
        .to_socket_addrs()
        .is_ok_and(|mut addrs| addrs.any(|a| is_local_ip(a.ip(), &own)))
}

fn is_local_ip(ip: IpAddr, own: &[IpAddr]) -> bool {
    ip.is_loopback() || own.contains(&ip)
}

/// The addresses of this machine's network interfaces (of its network
/// namespace), IPv4 and IPv6; none if they cannot be listed.
pub fn interface_addrs() -> Vec<IpAddr> {
    let Ok(ifaces) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    ifaces
        .filter_map(|i| i.address)
        .filter_map(|a| {
            a.as_sockaddr_in()
                .map(|v4| IpAddr::V4(v4.ip()))
                .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
        })
        .collect()
}

/// One worker of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSlot {
    pub rank: usize,
    pub host: String,
    pub local_rank: usize,
    pub local_size: usize,
}

/// Assigns `np` ranks to hosts in order, filling each host's slots.
pub fn assign_ranks(np: usize, hosts: &[HostSlots]) -> anyhow::Result<Vec<WorkerSlot>> {
    let total: usize = hosts.iter().map(|h| h.slots).sum();
    if np == 0 {
        bail!("-np must be at least 1");
    }
    if np > total {
        bail!("-np {np} exceeds the {total} slots of the host list");
    }
    if np > PeerList::MAX_SIZE {
        bail!("-np {np} exceeds the maximum of {}", PeerList::MAX_SIZE);
    }
    let mut slots = Vec::with_capacity(np);
    let mut per_host: BTreeMap<usize, usize> = BTreeMap::new();
    let mut h = 0;
    for rank in 0..np {
        while per_host.get(&h).copied().unwrap_or(0) == hosts[h].slots {
            h += 1;
        }
        let local = per_host.entry(h).or_insert(0);
        slots.push(WorkerSlot {
            rank,
            host: hosts[h].host.clone(),
            local_rank: *local,
            local_size: 0,
        });
        *local += 1;
    }
    for s in &mut slots {
        let h = hosts
            .iter()
            .position(|x| x.host == s.host)
            .expect("own host");
        s.local_size = per_host[&h];
    }
    Ok(slots)
}

/// Binds a listening socket on `host` (a local address) at a port the
/// kernel picks. The kernel never hands out a port that is bound, and the
/// port stays bound from here on: the socket goes to the worker as an
/// inherited descriptor (see `kungfu::listen`), so no other process, and
/// no other worker, can take it in between. (Drawing a free port, releasing
/// it and letting the worker bind it raced with both.) A bound port is not
/// taken for outgoing connections either, though it comes from the
/// ephemeral range.
pub fn bind_listener(host: &str) -> anyhow::Result<std::net::TcpListener> {
    std::net::TcpListener::bind((host, 0)).with_context(|| format!("binding a port on {host}"))
}

/// The addresses of a job's workers and, where kungfu-run binds them
/// itself, their listening sockets.
#[derive(Debug)]
pub struct JobPorts {
    pub peers: PeerList,
    /// By rank: the socket bound for the worker (every worker of an
    /// all-local job), to be passed down to it.
    pub listeners: Vec<Option<std::net::TcpListener>>,
}

/// The peer list of a job. When every host is this machine, each worker's
/// socket is bound here (kernel-assigned ports, held until the worker has
/// it); otherwise each worker listens on `port_base + local rank` of its
/// host, so that every host's launcher computes the same list without
/// talking to the others.
pub fn job_ports(
    slots: &[WorkerSlot],
    all_local: bool,
    port_base: u16,
) -> anyhow::Result<JobPorts> {
    let mut peers = Vec::with_capacity(slots.len());
    let mut listeners = Vec::with_capacity(slots.len());
    for s in slots {
        let (port, listener) = if all_local {
            let l = bind_listener(&s.host)?;
            (l.local_addr()?.port(), Some(l))
        } else {
            let port = port_base
                .checked_add(s.local_rank as u16)
                .context("port base + local rank overflows")?;
            (port, None)
        };
        peers.push(Peer {
            host: s.host.clone(),
            port,
        });
        listeners.push(listener);
    }
    Ok(JobPorts {
        peers: PeerList::new(peers)?,
        listeners,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("3 parsecs").is_err());
        assert_eq!(parse_size("1K").unwrap(), 1024);
        assert_eq!(parse_size("64M").unwrap(), 64 << 20);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert!(parse_size("12Q").is_err());
        assert_eq!(fmt_size(64 << 20), "64M");
        assert_eq!(fmt_size(1000), "1000B");
    }

    #[test]
    fn hosts_and_ranks() {
        let h = parse_hosts("127.0.0.1:2,127.0.0.2:3").unwrap();
        let s = assign_ranks(4, &h).unwrap();
        let hosts: Vec<&str> = s.iter().map(|w| w.host.as_str()).collect();
        assert_eq!(hosts, ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]);
        assert_eq!(s[3].local_rank, 1);
        assert_eq!(s[3].local_size, 2);
        assert_eq!(s[0].local_size, 2);
        assert!(assign_ranks(6, &h).is_err());
        assert!(parse_hosts("a:2,a:1").is_err());
        assert!(parse_hosts("a:0").is_err());
        assert_eq!(parse_hosts("node7").unwrap()[0].slots, 1);
    }

    #[test]
    fn local_hosts() {
        assert!(is_local_host("127.0.0.2"));
        assert!(is_local_host("localhost"));
        assert!(is_local_host("::1"));
        assert!(
            !is_local_host("10.1.1.1") || interface_addrs().contains(&"10.1.1.1".parse().unwrap())
        );
        // every address of an interface is this machine, as for mpirun
        for ip in interface_addrs() {
            assert!(is_local_host(&ip.to_string()), "{ip}");
        }
    }

    #[test]
    fn remote_layouts_use_the_port_base() {
        let h = parse_hosts("n1:2,n2:2").unwrap();
        let s = assign_ranks(4, &h).unwrap();
        let p = job_ports(&s, false, 38000).unwrap();
        assert_eq!(p.peers.to_string(), "n1:38000,n1:38001,n2:38000,n2:38001");
        assert!(p.listeners.iter().all(Option::is_none));
    }

    /// Every port of a local job is bound before the job starts, and stays
    /// bound until the worker has it: no other process can take it, and
    /// no two workers, of this job or of another, get the same one.
    #[test]
    fn local_ports_are_held_from_the_start() {
        let h = parse_hosts("127.0.0.1:4,127.0.0.2:4").unwrap();
        let s = assign_ranks(8, &h).unwrap();
        // several jobs at once, as on a shared machine
        let jobs: Vec<JobPorts> = (0..8).map(|_| job_ports(&s, true, 0).unwrap()).collect();
        let mut seen = std::collections::HashSet::new();
        for job in &jobs {
            for (rank, p) in job.peers.peers().iter().enumerate() {
                let l = job.listeners[rank].as_ref().unwrap_or_else(|| {
                    panic!("rank {rank} ({p}) has no socket: its port is not held")
                });
                assert_eq!(l.local_addr().unwrap().port(), p.port, "rank {rank}");
                assert!(
                    std::net::TcpListener::bind((p.host.as_str(), p.port)).is_err(),
                    "{p} could be bound by another process before its worker starts"
                );
                assert!(seen.insert(p.to_string()), "{p} was handed out twice");
            }
        }
    }
}
