//! Entry points of the fuzz targets (`fuzz/` at the repository root),
//! public so that a stable test can replay their corpus too. Each takes
//! arbitrary bytes and panics only on a broken invariant.

pub(crate) use kungfu_transport::fuzzing::{ready, Chunks};

use crate::elastic::ClusterConfig;

/// The config server's HTTP: a request read, answered, and the answer read
/// back by the client's side.
pub fn http(data: &[u8]) {
    crate::elastic::fuzz_http(data);
}

/// The cluster config text (`version N` / `peers ...`): what parses
/// encodes to text that parses to the same config.
pub fn cluster_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = ClusterConfig::parse(text) {
        assert_eq!(ClusterConfig::parse(&c.encode()).as_ref(), Ok(&c));
    }
}

/// The etcd client's responses: HTTP framing (lengths, chunks, trailers)
/// read whole and in pieces, and the JSON of calls and watches.
pub fn etcd_response(data: &[u8]) {
    crate::etcd::fuzz_response(data);
}

/// The rendezvous lines: a registration and rank 0's reply.
pub fn rendezvous(data: &[u8]) {
    crate::rendezvous::fuzz_rendezvous(data);
}
