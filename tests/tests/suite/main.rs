//! The cross-crate tests of KungFu-rs as one test binary (one link instead
//! of one per file): collectives over real transports, the wires'
//! conformance suite on each wire, the transports' own behaviour, a hostile
//! peer against a worker, and the fuzz corpus replayed. Each file is a
//! module; under `cargo nextest` each test still runs in a process of its
//! own.

mod collective_fast;
mod collective_net;
mod collective_shm;
mod conformance_fabric_registered;
mod conformance_fabric_shm;
mod conformance_fabric_tcp;
mod conformance_hybrid;
mod conformance_mem;
mod conformance_quic;
mod conformance_shm;
mod conformance_tcp;
#[cfg(feature = "verbs")]
mod conformance_verbs;
mod fuzz_corpus;
mod transport_auth;
mod transport_auto;
mod transport_quic;
mod transport_shm;
mod transport_swap;
mod transport_tcp;
mod worker_hostile;
