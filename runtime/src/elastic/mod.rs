//! Elastic clusters: the cluster config (a version and a peer list), the
//! HTTP config server `kungfu-run -w` runs, and its client.
//!
//! The server speaks a deliberately small slice of HTTP/1.1 (one request
//! per connection, bounded heads and bodies, every read under a deadline):
//!
//! ```text
//! GET /cluster            200  version 3\npeers 127.0.0.1:4001,127.0.0.1:4002\n
//! PUT /cluster  size N    200  the new config (version + 1; the first N
//!                              peers kept, or new ones added on this host)
//! PUT /cluster  version V\npeers ...
//!                         200  the config as given; V must be the current
//!                              version + 1 (409 otherwise)
//! ```
//! So `kungfu-run --resize 4 --config-server http://127.0.0.1:PORT/cluster`
//! resizes a running job, and a worker does the same with
//! [`crate::Worker::propose_new_size`].
//!
//! A worker's identity across versions is its address: its rank in a
//! version is its position in that version's peer list.
//!
//! # Credential
//!
//! A server with a credential ([`ServerRules::credential`], the job's
//! secret; `kungfu-run` always gives one) takes a request, `GET`
//! included, only if it is signed with the secret over itself, its time
//! and a fresh nonce, and only once; it signs its answers back, and the
//! client takes an answer only so signed: see [`credential`]. Workers and
//! launchers sign with `KUNGFU_JOB_SECRET`; `kungfu-run --resize N
//! --config-server URL` does for a person.
//!
//! Across hosts the server speaks TLS ([`ServerRules::tls`], an `https://`
//! URL) with a certificate of the job's CA, which every holder of the
//! secret derives and a client trusts alone: see `tls.rs`.

use kungfu_topology::PeerList;

mod client;
pub mod credential;
mod message;
mod server;
#[cfg(test)]
mod tests;
mod tls;

pub use client::{follow, get_config, get_version, put_config, request};
pub(crate) use server::fuzz_http;
pub use server::{ConfigServer, NewPeer, ServerRules};

/// One version of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    pub version: u32,
    pub peers: PeerList,
}

impl ClusterConfig {
    /// The text form served and accepted by the config server.
    pub fn encode(&self) -> String {
        format!("version {}\npeers {}\n", self.version, self.peers)
    }

    /// Parses [`ClusterConfig::encode`]'s form.
    pub fn parse(text: &str) -> Result<ClusterConfig, String> {
        let mut version = None;
        let mut peers = None;
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            match line.split_once(' ') {
                Some(("version", v)) => {
                    version = Some(
                        v.trim()
                            .parse::<u32>()
                            .map_err(|_| format!("bad version {v:?}"))?,
                    )
                }
                Some(("peers", p)) => {
                    peers = Some(
                        p.trim()
                            .parse::<PeerList>()
                            .map_err(|e| format!("bad peer list: {e}"))?,
                    )
                }
                _ => return Err(format!("unexpected line {line:?}")),
            }
        }
        Ok(ClusterConfig {
            version: version.ok_or("no version line")?,
            peers: peers.ok_or("no peers line")?,
        })
    }
}
