//! The certificates of a QUIC job: the user's own files, or a CA made for
//! this job and a certificate per worker.
//!
//! A job's CA lives in kungfu-run's memory only; its key is never written.
//! Each worker's certificate and key go to a directory only the user can
//! enter (mode 0700), the key in a file only the user can read (0600),
//! created new (never through a file or link someone else put there), and
//! the directory is removed when kungfu-run ends. The worker finds them in
//! `KUNGFU_QUIC_CA`, `KUNGFU_QUIC_CERT` and `KUNGFU_QUIC_KEY`.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use kungfu_transport::any::TransportKind;
use kungfu_transport::quic::JobCa;
use tokio::process::Command;

/// Paths of a worker's PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuicFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Where workers' certificates come from.
pub enum JobTls {
    /// The user's: every worker gets the same three files.
    User(QuicFiles),
    /// Made for this job.
    Job(Box<JobCerts>),
}

impl JobTls {
    /// Points `cmd` (the worker of `rank`) at its certificates, issuing
    /// them first if this job makes its own.
    pub fn apply(&self, cmd: &mut Command, rank: usize) -> anyhow::Result<()> {
        let f = match self {
            JobTls::User(f) => f.clone(),
            JobTls::Job(j) => j.for_rank(rank)?,
        };
        cmd.env("KUNGFU_QUIC_CA", &f.ca)
            .env("KUNGFU_QUIC_CERT", &f.cert)
            .env("KUNGFU_QUIC_KEY", &f.key);
        Ok(())
    }
}

/// Where a job's QUIC certificates come from: the user's files, or a CA
/// made for this job (one host only: the other hosts' launchers could not
/// share its key; made whatever the transport, so that a job may swap to
/// QUIC while it runs). `None` for a job across hosts that does not start
/// on QUIC and has no files of the user's (it cannot swap to QUIC).
pub fn job_tls(
    transport: TransportKind,
    user: Option<&QuicFiles>,
    one_host: bool,
    cluster_id: u64,
) -> anyhow::Result<Option<JobTls>> {
    if let Some(f) = user {
        return Ok(Some(JobTls::User(f.clone())));
    }
    if transport != TransportKind::Quic && !one_host {
        return Ok(None);
    }
    anyhow::ensure!(
        one_host,
        "--transport quic across hosts needs certificates every host trusts: \
         give --quic-ca, --quic-cert and --quic-key (kungfu-run makes a CA of its own only for one-host jobs)"
    );
    let parent = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    Ok(Some(JobTls::Job(Box::new(JobCerts::new(
        &parent, cluster_id,
    )?))))
}

/// A job's own CA and the directory its workers' files are in (removed
/// when dropped).
pub struct JobCerts {
    ca: JobCa,
    dir: PathBuf,
    issued: Mutex<HashSet<usize>>,
}

impl JobCerts {
    /// A new CA, and a new private directory for the files under `parent`.
    pub fn new(parent: &Path, cluster_id: u64) -> anyhow::Result<JobCerts> {
        let ca = JobCa::new().context("making the job's CA")?;
        let dir = parent.join(format!("kungfu-quic-{cluster_id:x}-{}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let certs = JobCerts {
            ca,
            dir,
            issued: Mutex::new(HashSet::new()),
        };
        write_new(&certs.dir.join("ca.pem"), certs.ca.cert_pem(), 0o644)?;
        Ok(certs)
    }

    /// The directory the files are in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The files of worker `rank`, issued at its first start (a rank a
    /// resize starts again keeps its files).
    pub fn for_rank(&self, rank: usize) -> anyhow::Result<QuicFiles> {
        let f = QuicFiles {
            ca: self.dir.join("ca.pem"),
            cert: self.dir.join(format!("rank-{rank}.pem")),
            key: self.dir.join(format!("rank-{rank}.key")),
        };
        let mut issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        if issued.insert(rank) {
            let (cert, key) = self
                .ca
                .issue_pem(&rank.to_string())
                .context("issuing a worker certificate")?;
            write_new(&f.key, &key, 0o600)?;
            write_new(&f.cert, &cert, 0o644)?;
        }
        Ok(f)
    }
}

impl Drop for JobCerts {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            // stderr may be closed; a drop must not panic
            let _ = writeln!(
                std::io::stderr(),
                "kungfu-run: could not remove the job's certificates in {}: {e}",
                self.dir.display()
            );
        }
    }
}

/// Writes `text` to a file that must not exist yet, created with `mode`.
fn write_new(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn files_are_private_issued_once_and_removed() {
        let parent = std::env::temp_dir();
        let certs = JobCerts::new(&parent, 0xabc0_0000 ^ u64::from(std::process::id())).unwrap();
        let dir = certs.dir().to_path_buf();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        let f = certs.for_rank(3).unwrap();
        assert_eq!(mode(&f.key), 0o600);
        let key = std::fs::read_to_string(&f.key).unwrap();
        // a second start of rank 3 keeps its files
        assert_eq!(certs.for_rank(3).unwrap(), f);
        assert_eq!(std::fs::read_to_string(&f.key).unwrap(), key);
        // and the worker can load them
        kungfu_transport::quic::QuicTls::from_pem_files(&f.ca, &f.cert, &f.key).unwrap();
        drop(certs);
        assert!(!dir.exists());
    }
}
