//! Where `size N` puts new workers in etcd, and the ports each host has
//! given out (the keys `P/rules` and `P/ports`).

use kungfu_topology::{Peer, PeerList};

use super::MAX_SIZE;

/// Where `size N` puts new workers, for a store that has no launcher in
/// the path (etcd): as the built-in server of a job across hosts does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The largest cluster.
    pub max_size: usize,
    /// The hosts, in order, with their slots.
    pub hosts: Vec<(String, usize)>,
    /// Whether the slots bound the workers of a host (else every new
    /// worker goes on the first host).
    pub bounded: bool,
    /// The first port of a host's workers.
    pub port_base: u16,
}

impl Placement {
    pub fn encode(&self) -> String {
        let hosts: Vec<String> = self.hosts.iter().map(|(h, s)| format!("{h}={s}")).collect();
        format!(
            "max {}\nbounded {}\nport_base {}\nhosts {}\n",
            self.max_size,
            self.bounded,
            self.port_base,
            hosts.join(",")
        )
    }

    pub fn parse(text: &str) -> Result<Placement, String> {
        let mut p = Placement {
            max_size: 0,
            hosts: Vec::new(),
            bounded: false,
            port_base: 0,
        };
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let bad = || format!("bad rules line {line:?}");
            let (k, v) = line.split_once(' ').ok_or_else(bad)?;
            match k {
                "max" => p.max_size = v.parse().map_err(|_| bad())?,
                "bounded" => p.bounded = v.parse().map_err(|_| bad())?,
                "port_base" => p.port_base = v.parse().map_err(|_| bad())?,
                "hosts" => {
                    for h in v.split(',') {
                        let (host, slots) = h.rsplit_once('=').ok_or_else(bad)?;
                        p.hosts
                            .push((host.into(), slots.parse().map_err(|_| bad())?));
                    }
                }
                _ => return Err(bad()),
            }
        }
        if p.hosts.is_empty() || p.max_size == 0 {
            return Err("rules without hosts or size".into());
        }
        if p.max_size > MAX_SIZE {
            return Err(format!(
                "rules for {} workers; at most {MAX_SIZE}",
                p.max_size
            ));
        }
        Ok(p)
    }

    /// The peers of `size n` from `cur`: the first `n` kept, new ones
    /// added where there is room, at the next port of their host
    /// (`ports`, updated).
    pub(super) fn resize(
        &self,
        cur: &PeerList,
        n: usize,
        ports: &mut Ports,
    ) -> Result<Vec<Peer>, String> {
        if n == 0 || n > self.max_size {
            return Err(format!("size {n} is outside 1..={}", self.max_size));
        }
        let mut peers: Vec<Peer> = cur.peers().iter().take(n).cloned().collect();
        while peers.len() < n {
            let room = |(h, slots): &&(String, usize)| {
                !self.bounded || peers.iter().filter(|p| &p.host == h).count() < *slots
            };
            let (host, _) = self
                .hosts
                .iter()
                .find(room)
                .ok_or("all slots of the job's hosts are taken")?;
            let port = match ports.iter().find(|(h, _)| h == host) {
                Some((_, last)) => last
                    .checked_add(1)
                    .ok_or_else(|| format!("no port left on {host}"))?,
                None => self.port_base,
            };
            note_port(ports, host, port);
            peers.push(Peer {
                host: host.clone(),
                port,
            });
        }
        Ok(peers)
    }
}

/// The highest port each host has given out.
pub(super) type Ports = Vec<(String, u16)>;

pub(super) fn note_port(ports: &mut Ports, host: &str, port: u16) {
    match ports.iter_mut().find(|(h, _)| h == host) {
        Some((_, last)) => *last = (*last).max(port),
        None => ports.push((host.to_string(), port)),
    }
}

pub(super) fn encode_ports(ports: &Ports) -> String {
    ports.iter().map(|(h, p)| format!("{h} {p}\n")).collect()
}

pub(super) fn parse_ports(text: &str) -> Result<Ports, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (h, p) = l
                .rsplit_once(' ')
                .ok_or_else(|| format!("bad ports line {l:?}"))?;
            Ok((
                h.to_string(),
                p.parse().map_err(|_| format!("bad port {p:?}"))?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_and_placement() {
        let rules = Placement {
            max_size: 5,
            hosts: vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 1)],
            bounded: true,
            port_base: 100,
        };
        assert_eq!(Placement::parse(&rules.encode()).unwrap(), rules);
        assert!(Placement::parse("max 1\n").is_err());
        assert!(Placement::parse("hosts a=x\nmax 1").is_err());
        let cur: PeerList = "a:100,b:100".parse().unwrap();
        let mut ports = vec![("a".to_string(), 100), ("b".to_string(), 100)];
        let grown = rules.resize(&cur, 5, &mut ports).unwrap();
        let grown: Vec<String> = grown.iter().map(|p| p.to_string()).collect();
        assert_eq!(grown, ["a:100", "b:100", "a:101", "b:101", "c:100"]);
        assert!(rules
            .resize(&cur, 6, &mut ports)
            .unwrap_err()
            .contains("1..=5"));
        assert_eq!(parse_ports(&encode_ports(&ports)).unwrap(), ports);
        // a port once given is not given again: a shrink and a regrow
        // take the next ones
        let again = rules
            .resize(&"a:100".parse().unwrap(), 2, &mut ports)
            .unwrap();
        assert_eq!(again[1].to_string(), "a:102");
        assert!(parse_ports("a x").is_err());
    }
}
