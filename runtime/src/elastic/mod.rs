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
//! So `curl -X PUT -d 'size 4' http://127.0.0.1:PORT/cluster` resizes a
//! running job, and a worker does the same with
//! [`crate::Worker::propose_new_size`].
//!
//! A worker's identity across versions is its address: its rank in a
//! version is its position in that version's peer list.
//!
//! # Credential
//!
//! A server with a credential ([`ServerRules::credential`]; `kungfu-run
//! -w` always gives one) refuses a `PUT` without `Authorization: Bearer
//! <token>` (401) or with another token (403), compared in constant time.
//! The token is [`JobSecret::config_token`] of the job's secret
//! (`KUNGFU_JOB_SECRET`): workers make it themselves, and `kungfu-run
//! --config-token` prints it for a user whose environment holds the
//! secret. It is derived, not the secret, because plain HTTP carries it in
//! clear (over loopback: `kungfu-run` binds the server to 127.0.0.1). `GET`
//! stays open: it changes nothing, and what it shows (the workers'
//! loopback addresses) any local user can list with `ss -tln`.
//!
//! [`JobSecret::config_token`]: kungfu_transport::auth::JobSecret::config_token

use kungfu_topology::PeerList;

mod client;
mod message;
mod server;
#[cfg(test)]
mod tests;

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
