//! The job's shared-memory ring files on this host, removed once the
//! job is over.

use std::io::Write;

/// Removes this host's shared-memory ring files of the job when dropped.
/// A worker killed while connecting leaves rings behind that no process of
/// the job can remove any more (see `kungfu_transport::shm`, "Lifetime of
/// the files"); this runs once `run` has reaped every worker, however the
/// job ended: success, a failed or killed worker, the timeout, a signal to
/// kungfu-run, or an error of the launcher itself.
pub(super) struct JobRings(pub(super) u64);

impl Drop for JobRings {
    fn drop(&mut self) {
        let dir = std::path::Path::new(kungfu_transport::shm::RING_DIR);
        let msg = match kungfu_transport::shm::remove_cluster_files(dir, self.0) {
            Ok(names) if names.is_empty() => return,
            Ok(names) => format!(
                "kungfu-run: removed {} shared-memory ring file(s) the job left in {}: {}",
                names.len(),
                dir.display(),
                names.join(" ")
            ),
            Err(e) => format!(
                "kungfu-run: could not remove the job's ring files from {}: {e}",
                dir.display()
            ),
        };
        // stderr may be closed; a drop must not panic
        let _ = writeln!(std::io::stderr(), "{msg}");
    }
}
