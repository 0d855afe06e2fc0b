//! The certificates of a QUIC job. By default kungfu-run hands out none:
//! each worker issues its own from the job's secret
//! (`kungfu_transport::quic::QuicTls::from_secret`: a CA every holder of
//! the secret derives alike, so workers on every host trust each other's
//! certificates, and nobody else's), and proves the secret in the
//! handshake. A user with their own PKI gives the three files instead
//! (`--quic-ca`, `--quic-cert`, `--quic-key`), which every worker gets in
//! `KUNGFU_QUIC_CA`, `KUNGFU_QUIC_CERT` and `KUNGFU_QUIC_KEY`.

use std::path::PathBuf;

use tokio::process::Command;

/// Paths of a worker's PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl QuicFiles {
    /// Points a worker's `cmd` at the files.
    pub fn apply(&self, cmd: &mut Command) {
        cmd.env("KUNGFU_QUIC_CA", &self.ca)
            .env("KUNGFU_QUIC_CERT", &self.cert)
            .env("KUNGFU_QUIC_KEY", &self.key);
    }
}
