//! Pinning workers to CPUs (`kungfu-run --bind-to`).

use anyhow::Context;
use nix::unistd::Pid;
use tokio::process::Command;

use crate::options::Bind;

/// The CPUs this process may run on, in order.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    use nix::sched::{sched_getaffinity, CpuSet};
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// The CPU for local worker `local_rank` of `local_size`, if it is to be
/// pinned. `Core` with more workers than CPUs wraps around.
pub fn cpu_for(
    bind: Bind,
    allowed: &[usize],
    local_rank: usize,
    local_size: usize,
) -> Option<usize> {
    if allowed.is_empty() {
        return None;
    }
    match bind {
        Bind::None => None,
        Bind::Auto if local_size > allowed.len() => None,
        Bind::Auto | Bind::Core => Some(allowed[local_rank % allowed.len()]),
    }
}

/// Pins the child to `cpu` between fork and exec.
pub(crate) fn pin(cmd: &mut Command, cpu: usize) -> anyhow::Result<()> {
    use nix::sched::{sched_setaffinity, CpuSet};
    let mut set = CpuSet::new();
    set.set(cpu).with_context(|| format!("CPU {cpu}"))?;
    #[allow(unsafe_code)]
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: it makes one system call
    // (sched_setaffinity) on a set built before the fork, and allocates
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            sched_setaffinity(Pid::from_raw(0), &set).map_err(std::io::Error::from)
        });
    }
    Ok(())
}

#[cfg(test)]
mod bind_tests {
    use super::*;

    #[test]
    fn cpus_for_workers() {
        let two = [0, 1];
        assert_eq!(cpu_for(Bind::Auto, &two, 1, 2), Some(1));
        assert_eq!(
            cpu_for(Bind::Auto, &two, 1, 4),
            None,
            "more workers than CPUs"
        );
        assert_eq!(cpu_for(Bind::Core, &two, 3, 4), Some(1), "wraps around");
        assert_eq!(cpu_for(Bind::None, &two, 0, 1), None);
        assert_eq!(
            cpu_for(Bind::Auto, &[4, 6], 1, 2),
            Some(6),
            "the allowed set, in order"
        );
        assert_eq!(cpu_for(Bind::Core, &[], 0, 1), None);
        assert_eq!("core".parse::<Bind>().unwrap(), Bind::Core);
        assert!("socket".parse::<Bind>().is_err());
    }
}
