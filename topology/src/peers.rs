//! Ranks, peers and peer lists.

use std::fmt;
use std::str::FromStr;

use crate::Digest;

/// The index of a worker in the cluster, `0..size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rank(pub u32);

impl Rank {
    /// The rank as an index into per-rank tables.
    pub fn idx(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// Where one worker listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Peer {
    /// A host name or IP address (v6 addresses in brackets when written).
    pub host: String,
    pub port: u16,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Peer {
    /// Whether `host` can stand in a peer list: not empty, and none of
    /// whitespace, control characters, `[`, `]` or `,` (the list's text
    /// form uses them), so that every list prints as text that parses back
    /// to the same list. A `:` is fine (an IPv6 address; printed in
    /// brackets).
    pub fn is_valid_host(host: &str) -> bool {
        !host.is_empty()
            && !host
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '[' | ']' | ','))
    }
}

/// Why a peer list could not be parsed or built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeerListError {
    #[error("peer list is empty")]
    Empty,
    #[error("peer {index} ({text:?}): expected HOST:PORT")]
    BadPeer { index: usize, text: String },
    #[error("peer {index} ({text:?}) appears twice")]
    Duplicate { index: usize, text: String },
    #[error("peer list has {len} peers; at most {max} are supported")]
    TooLarge { len: usize, max: usize },
}

/// The workers of one cluster version, in rank order.
///
/// Workers on the same `host` form a host group; hosts are ordered by their
/// first appearance, and a worker's local rank is its position inside its
/// group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerList {
    peers: Vec<Peer>,
    /// host index of each rank
    host_of: Vec<usize>,
    /// ranks of each host, ascending
    hosts: Vec<Vec<Rank>>,
}

impl PeerList {
    /// The largest cluster supported: ranks travel as `u32` and ring steps
    /// as `u16` (`2 * (n - 1)` steps), so `n` stays well below both.
    pub const MAX_SIZE: usize = 16_384;

    /// Builds a list from peers in rank order.
    pub fn new(peers: Vec<Peer>) -> Result<PeerList, PeerListError> {
        if peers.is_empty() {
            return Err(PeerListError::Empty);
        }
        if peers.len() > Self::MAX_SIZE {
            return Err(PeerListError::TooLarge {
                len: peers.len(),
                max: Self::MAX_SIZE,
            });
        }
        let mut seen = std::collections::HashSet::new();
        // host name -> host index: a map, as a list of 16k distinct hosts
        // (from a config server's client) took 0.2 s to group by search
        let mut host_index: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::new();
        let mut host_of = Vec::with_capacity(peers.len());
        let mut hosts: Vec<Vec<Rank>> = Vec::new();
        for (i, p) in peers.iter().enumerate() {
            if !Peer::is_valid_host(&p.host) {
                return Err(PeerListError::BadPeer {
                    index: i,
                    text: p.to_string(),
                });
            }
            if !seen.insert((p.host.as_str(), p.port)) {
                return Err(PeerListError::Duplicate {
                    index: i,
                    text: p.to_string(),
                });
            }
            let h = *host_index.entry(p.host.as_str()).or_insert_with(|| {
                hosts.push(Vec::new());
                hosts.len() - 1
            });
            host_of.push(h);
            hosts[h].push(Rank(i as u32));
        }
        Ok(PeerList {
            peers,
            host_of,
            hosts,
        })
    }

    /// A list of `n` peers on 127.0.0.1 with placeholder ports, for tests and
    /// for in-process transports where addresses do not matter.
    pub fn local(n: usize) -> PeerList {
        assert!(
            n > 0 && n <= Self::MAX_SIZE,
            "invalid local cluster size {n}"
        );
        let peers = (0..n)
            .map(|i| Peer {
                host: "127.0.0.1".into(),
                port: 10_000 + i as u16,
            })
            .collect();
        PeerList::new(peers).expect("distinct ports")
    }

    /// `hosts[h]` workers on host `h`, ranks assigned host by host; for
    /// tests of host-aware strategies.
    pub fn with_hosts(per_host: &[usize]) -> PeerList {
        let mut peers = Vec::new();
        for (h, &k) in per_host.iter().enumerate() {
            for l in 0..k {
                peers.push(Peer {
                    host: format!("127.0.0.{}", h + 1),
                    port: 10_000 + l as u16,
                });
            }
        }
        PeerList::new(peers).expect("valid synthetic peer list")
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    /// Always false: a peer list has at least one peer.
    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    pub fn peers(&self) -> &[Peer] {
        &self.peers
    }

    /// The peer of `rank`, if the rank is in the list.
    pub fn peer(&self, rank: Rank) -> Option<&Peer> {
        self.peers.get(rank.idx())
    }

    pub fn ranks(&self) -> impl ExactSizeIterator<Item = Rank> + '_ {
        (0..self.peers.len() as u32).map(Rank)
    }

    /// The rank listening at `peer`, if any.
    pub fn rank_of(&self, peer: &Peer) -> Option<Rank> {
        self.peers
            .iter()
            .position(|p| p == peer)
            .map(|i| Rank(i as u32))
    }

    /// Ranks grouped by host, hosts in order of first appearance.
    pub fn hosts(&self) -> &[Vec<Rank>] {
        &self.hosts
    }

    /// The host index of `rank`. Panics if `rank` is out of range.
    pub fn host_of(&self, rank: Rank) -> usize {
        self.host_of[rank.idx()]
    }

    /// The position of `rank` among the workers of its host.
    pub fn local_rank(&self, rank: Rank) -> usize {
        let h = self.host_of(rank);
        self.hosts[h]
            .iter()
            .position(|&r| r == rank)
            .expect("rank listed under its own host")
    }

    /// The number of workers on the host of `rank`.
    pub fn local_size(&self, rank: Rank) -> usize {
        self.hosts[self.host_of(rank)].len()
    }

    /// A digest of the whole list; workers compare it during the handshake.
    pub fn digest(&self) -> Digest {
        let mut d = Digest::EMPTY.u64(self.peers.len() as u64);
        for p in &self.peers {
            d = d.str(&p.host).u64(u64::from(p.port));
        }
        d
    }
}

impl fmt::Display for PeerList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.peers.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

fn parse_peer(index: usize, text: &str) -> Result<Peer, PeerListError> {
    let bad = || PeerListError::BadPeer {
        index,
        text: text.to_string(),
    };
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (h, p) = rest.split_once("]:").ok_or_else(bad)?;
        (h, p)
    } else {
        text.rsplit_once(':').ok_or_else(bad)?
    };
    if !Peer::is_valid_host(host) {
        return Err(bad());
    }
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(Peer {
        host: host.to_string(),
        port,
    })
}

impl FromStr for PeerList {
    type Err = PeerListError;

    /// Parses `host:port,host:port,...` (the form of `KUNGFU_PEERS`).
    fn from_str(s: &str) -> Result<PeerList, PeerListError> {
        let s = s.trim();
        if s.is_empty() {
            return Err(PeerListError::Empty);
        }
        let peers = s
            .split(',')
            .enumerate()
            .map(|(i, t)| parse_peer(i, t.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        PeerList::new(peers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        let text = "10.0.0.1:100,10.0.0.1:101,h2:5,[::1]:7";
        let pl: PeerList = text.parse().unwrap();
        assert_eq!(pl.len(), 4);
        assert_eq!(pl.to_string(), text);
        assert_eq!(pl.hosts().len(), 3);
        assert_eq!(pl.local_rank(Rank(1)), 1);
        assert_eq!(pl.local_size(Rank(1)), 2);
        assert_eq!(pl.local_size(Rank(3)), 1);
        assert_eq!(pl.peer(Rank(3)).unwrap().host, "::1");
    }

    #[test]
    fn bad_lists_are_refused() {
        assert_eq!("".parse::<PeerList>(), Err(PeerListError::Empty));
        assert!(matches!(
            "a:1,b".parse::<PeerList>(),
            Err(PeerListError::BadPeer { index: 1, .. })
        ));
        assert!(matches!(
            "a:99999".parse::<PeerList>(),
            Err(PeerListError::BadPeer { .. })
        ));
        // hosts that would not print back as they parsed (found by the
        // cluster_config fuzz target: the second peer printed as
        // `[10.4.0.1:1]:7[::1]]:7`, which does not parse)
        for bad in ["10.4.0.1:1]:7[::1]:7", "[[a]:1", "a\u{0}b:1", "[a,b]:1"] {
            assert!(
                matches!(bad.parse::<PeerList>(), Err(PeerListError::BadPeer { .. })),
                "{bad:?}"
            );
        }
        let odd = Peer {
            host: "h\n".into(),
            port: 1,
        };
        assert!(matches!(
            PeerList::new(vec![odd]),
            Err(PeerListError::BadPeer { index: 0, .. })
        ));
        assert!(matches!(
            "a:1,a:1".parse::<PeerList>(),
            Err(PeerListError::Duplicate { index: 1, .. })
        ));
    }

    #[test]
    fn interleaved_hosts_group_by_first_appearance() {
        let pl: PeerList = "b:1,a:1,b:2,a:2".parse().unwrap();
        assert_eq!(
            pl.hosts(),
            &[vec![Rank(0), Rank(2)], vec![Rank(1), Rank(3)]]
        );
        assert_eq!(pl.local_rank(Rank(3)), 1);
    }

    #[test]
    fn digest_depends_on_order() {
        let a: PeerList = "a:1,b:1".parse().unwrap();
        let b: PeerList = "b:1,a:1".parse().unwrap();
        assert_ne!(a.digest(), b.digest());
    }
}
