//! The testing hook `KUNGFU_TEST_SHM_STOP` (see "Testing hooks" in the
//! module docs).

use super::ShmConfig;

/// The points of connection set-up where a test can stop a worker (see
/// "Testing hooks" in the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Connecting began; nothing created yet.
    Start,
    /// The first inbound ring was created (others may not be yet).
    Created,
    /// An outbound ring was mapped and its file unlinked, before the
    /// receiver is told (attached).
    Opened,
    /// `connect` is about to return.
    Connected,
    /// The first frame was written into a ring (an op is under way).
    Sent,
}

impl Stage {
    const ALL: [(Stage, &'static str); 5] = [
        (Stage::Start, "start"),
        (Stage::Created, "created"),
        (Stage::Opened, "opened"),
        (Stage::Connected, "connected"),
        (Stage::Sent, "sent"),
    ];

    fn name(self) -> &'static str {
        Stage::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map_or("?", |(_, n)| n)
    }
}

/// The variable of the testing hook.
pub const TEST_STOP_VAR: &str = "KUNGFU_TEST_SHM_STOP";

/// `KUNGFU_TEST_SHM_STOP=ACTION:STAGE:RANK`, parsed once per process;
/// never read without the `testing` feature.
#[cfg(not(feature = "testing"))]
fn test_stop() -> Option<(bool, Stage, u32)> {
    None
}

/// `KUNGFU_TEST_SHM_STOP=ACTION:STAGE:RANK`, parsed once per process.
#[cfg(feature = "testing")]
fn test_stop() -> Option<(bool, Stage, u32)> {
    static PARSED: std::sync::OnceLock<Option<(bool, Stage, u32)>> = std::sync::OnceLock::new();
    *PARSED.get_or_init(|| {
        let v = std::env::var(TEST_STOP_VAR).ok()?;
        let mut it = v.split(':');
        let kill = match it.next()? {
            "kill" => true,
            "hang" => false,
            _ => return None,
        };
        let stage = it.next()?;
        let stage = Stage::ALL.iter().find(|(_, n)| *n == stage)?.0;
        let rank = it.next()?.parse().ok()?;
        Some((kill, stage, rank))
    })
}

/// The testing hook: stops this process at `stage` if asked to.
pub(super) fn kill_point(cfg: &ShmConfig, stage: Stage) {
    if stops_at(cfg, stage) {
        stop_here(cfg, stage);
    }
}

pub(super) fn stops_at(cfg: &ShmConfig, stage: Stage) -> bool {
    test_stop().is_some_and(|(_, at, rank)| at == stage && rank == cfg.rank.0)
}

#[cold]
pub(super) fn stop_here(cfg: &ShmConfig, stage: Stage) {
    let Some((kill, _, rank)) = test_stop() else {
        return;
    };
    let what = if kill { "is killed" } else { "hangs" };
    eprintln!(
        "kungfu-shm test hook: rank {rank} {what} at {} (cluster {:016x})",
        stage.name(),
        cfg.cluster_id
    );
    if kill {
        // SAFETY: raise takes no pointers; SIGKILL ends the process here,
        // with no destructor run, as a kill from outside would.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    loop {
        std::thread::park();
    }
}
