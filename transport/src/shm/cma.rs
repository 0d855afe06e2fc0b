//! Cross-memory attach: reading another process's memory with one copy
//! (`process_vm_readv`, what Open MPI's shared-memory component uses for
//! large messages). The collectives' host fast path reads its peers'
//! working buffers with it, so a large op moves each byte once, from the
//! peer's buffer into this one, instead of through a ring.
//!
//! # Trust
//!
//! A peer says where its buffer is (pid, address, length, through its
//! lane). A wrong address makes the kernel refuse the read (`EFAULT`), a
//! wrong pid reads nothing or another of this user's processes' memory,
//! which is no worse than what the peer could send itself: this side only
//! ever *reads* remote memory into its own buffers, never writes it.
//!
//! # When it is there
//!
//! Linux 3.2+, and permitted: the caller may ptrace the peer (the same
//! user, and Yama allows it) and no seccomp filter blocks the call (some
//! container runtimes do). [`available`] decides, once per process.
//!
//! Yama's `ptrace_scope` (`/proc/sys/kernel/yama/ptrace_scope`):
//! - **0** (or no Yama): any process of the same user.
//! - **1** (the default of Ubuntu and others): only a process's
//!   descendants, and the process it names with `prctl(PR_SET_PTRACER)`
//!   and that process's descendants. The workers of a host are siblings,
//!   so none could read another. Where [`LAUNCHER_PID_VAR`] names the
//!   process that started them (kungfu-run sets it to its own pid), every
//!   worker names it as its ptracer: its descendants, the job's workers on
//!   this host, may then read each other, and no other process gains
//!   anything. Without the variable, or where the `prctl` fails, it is
//!   off. A process with `CAP_SYS_PTRACE` needs neither.
//! - **2**: only with `CAP_SYS_PTRACE`. **3**: never.
//!
//! Every worker of a host must reach the same verdict, or an op would
//! take the one-copy path on some ranks and the rings on others (and fail
//! at its deadline): under one launcher they share the kernel, the
//! variable and their credentials, so they do.

use std::io;
use std::sync::OnceLock;

/// The environment variable that names (by pid) the process that started
/// this host's workers, a common ancestor of them all: kungfu-run sets it.
/// Under Yama's `ptrace_scope` 1 each worker admits that process and its
/// descendants as readers of its memory (see the module docs). Another
/// launcher can set it to its own pid, or a shell script to `$$` before it
/// starts the workers (one process for all of them: a wrapper per worker
/// that names itself admits nobody else). Ignored unless it names an
/// ancestor of this process.
pub const LAUNCHER_PID_VAR: &str = "KUNGFU_LAUNCHER_PID";

/// `CAP_SYS_PTRACE`'s bit in the capability sets of `/proc/self/status`.
const CAP_SYS_PTRACE: u32 = 19;

/// Reads `dst.len()` bytes at `addr` in process `pid` into `dst`.
pub fn read(pid: u32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, format!("pid {pid}")))?;
    let mut done = 0usize;
    while done < dst.len() {
        let left = dst.len() - done;
        let from = addr
            .checked_add(done as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "address overflows"))?;
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: left,
        };
        let remote = libc::iovec {
            iov_base: from as usize as *mut libc::c_void,
            iov_len: left,
        };
        // SAFETY: `local` is `left` writable bytes of `dst`, borrowed
        // mutably for the call; the kernel checks the remote range against
        // the other process's mappings (EFAULT if it is not mapped) and
        // only reads it.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read 0 of {left} bytes at {from:#x} in process {pid}"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether cross-memory attach works here between this host's workers:
/// Yama permits it (see the module docs; under `ptrace_scope` 1 this names
/// the launcher as this process's ptracer), and a read of this process's
/// own memory goes through (seccomp would refuse it). Decided once per
/// process.
pub fn available() -> bool {
    static VERDICT: OnceLock<bool> = OnceLock::new();
    *VERDICT.get_or_init(|| {
        let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        let launcher = std::env::var(LAUNCHER_PID_VAR)
            .ok()
            .and_then(|v| launcher_pid(&v))
            .filter(|&pid| is_ancestor(pid));
        yama_permits(scope, launcher, may_ptrace_any(), set_ptracer) && reads_itself()
    })
}

/// A value of [`LAUNCHER_PID_VAR`] that may name a launcher: not init (pid
/// 1: every process descends from it), and not `u32::MAX` (which a
/// 32-bit `c_ulong` would turn into `PR_SET_PTRACER_ANY`: any process).
fn launcher_pid(v: &str) -> Option<u32> {
    v.trim()
        .parse::<u32>()
        .ok()
        .filter(|&pid| pid > 1 && pid != u32::MAX)
}

/// Whether `pid` is an ancestor of this process (its parent, or its
/// parent's, ...), by `/proc/PID/stat`. A launcher that exited, a worker
/// that was reparented, or a pid of another namespace is not: naming it
/// would admit nobody, and every large op would fail its reads.
fn is_ancestor(pid: u32) -> bool {
    let mut p = std::os::unix::process::parent_id();
    // bounded: a chain of processes is short, and a read may race an exit
    for _ in 0..64 {
        if p == pid {
            return true;
        }
        match std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .as_deref()
            .and_then(parent_in_stat)
        {
            Some(parent) if parent > 0 && parent != p => p = parent,
            _ => return false,
        }
    }
    false
}

/// The parent pid in a `/proc/PID/stat` text: the field after the
/// state, which follows the command name in parentheses (which may hold
/// spaces and parentheses itself, so the last `)` ends it).
fn parent_in_stat(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Whether Yama lets this host's workers read each other: `scope` is its
/// `ptrace_scope` (None: no Yama), `launcher` their common ancestor,
/// `cap` whether this process has `CAP_SYS_PTRACE`, and `set_ptracer`
/// names a process as this one's ptracer. Under scope 1 the launcher is
/// named even by a process with the capability: its peers may not have
/// it, and they read this one too.
fn yama_permits(
    scope: Option<u32>,
    launcher: Option<u32>,
    cap: bool,
    set_ptracer: impl FnOnce(u32) -> io::Result<()>,
) -> bool {
    match scope {
        None | Some(0) => true,
        Some(1) => {
            let named = launcher.is_some_and(|pid| set_ptracer(pid).is_ok());
            named || cap
        }
        Some(2) => cap,
        Some(_) => false,
    }
}

/// `prctl(PR_SET_PTRACER, pid)`: `pid` and its descendants may ptrace
/// (and so read) this process. Fails with `EINVAL` where the kernel has
/// no Yama.
fn set_ptracer(pid: u32) -> io::Result<()> {
    let pid = libc::c_ulong::from(pid);
    // SAFETY: PR_SET_PTRACER takes a pid by value and touches no memory of
    // this process.
    let r = unsafe { libc::prctl(libc::PR_SET_PTRACER, pid, 0 as libc::c_ulong, 0, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether this process has `CAP_SYS_PTRACE` in its effective set.
fn may_ptrace_any() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .as_deref()
        .and_then(effective_caps)
        .is_some_and(|caps| caps >> CAP_SYS_PTRACE & 1 == 1)
}

/// The `CapEff` mask of a `/proc/PID/status` text.
fn effective_caps(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(line.trim(), 16).ok()
}

/// A read of this process's own memory goes through.
fn reads_itself() -> bool {
    let src = [0x5au8; 64];
    let mut dst = [0u8; 64];
    read(std::process::id(), src.as_ptr() as u64, &mut dst).is_ok() && dst == src
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_memory_and_refuses_bad_addresses() {
        assert!(available(), "process_vm_readv is not permitted here");
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        read(std::process::id(), src.as_ptr() as u64, &mut dst).unwrap();
        assert_eq!(dst, src);
        // an unmapped address is an error, not a fault
        assert!(read(std::process::id(), 8, &mut dst[..16]).is_err());
        assert!(read(std::process::id(), u64::MAX - 4, &mut dst[..16]).is_err());
    }

    #[test]
    fn yama_decides_by_scope_launcher_and_capability() {
        let ok = |_: u32| Ok(());
        let refused = |_: u32| Err(io::Error::from_raw_os_error(libc::EINVAL));
        // no Yama, or scope 0: nothing to ask
        for scope in [None, Some(0)] {
            assert!(yama_permits(scope, None, false, |_| panic!("not asked")));
        }
        // scope 1: the launcher as ptracer, if the kernel takes it
        let mut named = None;
        assert!(yama_permits(Some(1), Some(4242), false, |p| {
            named = Some(p);
            Ok(())
        }));
        assert_eq!(named, Some(4242));
        assert!(!yama_permits(Some(1), Some(4242), false, refused));
        assert!(!yama_permits(Some(1), None, false, ok));
        assert!(yama_permits(Some(1), None, true, ok));
        // with the capability the launcher is still named (peers may lack it)
        let mut asked = false;
        assert!(yama_permits(Some(1), Some(7), true, |_| {
            asked = true;
            Ok(())
        }));
        assert!(asked);
        // scope 2: the capability only; 3: never
        assert!(!yama_permits(Some(2), Some(4242), false, ok));
        assert!(yama_permits(Some(2), None, true, ok));
        assert!(!yama_permits(Some(3), Some(4242), true, ok));
    }

    #[test]
    fn the_ptracer_prctl_reaches_the_kernel() {
        // Yama takes it; a kernel without Yama refuses the option itself
        let yama = std::path::Path::new("/proc/sys/kernel/yama").exists();
        match set_ptracer(std::os::unix::process::parent_id()) {
            Ok(()) => assert!(yama, "PR_SET_PTRACER taken without Yama"),
            Err(e) => {
                assert!(!yama, "Yama refused PR_SET_PTRACER: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
            }
        }
    }

    #[test]
    fn a_launcher_must_be_a_real_ancestor() {
        assert_eq!(launcher_pid(" 4242\n"), Some(4242));
        for bad in ["1", "0", "4294967295", "-3", "x", ""] {
            assert_eq!(launcher_pid(bad), None, "{bad:?}");
        }
        // this test's parent is an ancestor; this process and a pid that
        // does not exist are not
        assert!(is_ancestor(std::os::unix::process::parent_id()));
        assert!(!is_ancestor(std::process::id()));
        assert!(!is_ancestor(u32::MAX - 1));
        assert_eq!(parent_in_stat("12 (a) b) S 34 12 12"), Some(34));
        assert_eq!(parent_in_stat("12 (sh) R 1 5"), Some(1));
        assert_eq!(parent_in_stat("garbage"), None);
    }

    #[test]
    fn reads_the_effective_capabilities() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert_eq!(effective_caps(status), Some(0x1ff_ffff_ffff));
        assert_eq!(effective_caps("CapEff:\tzz\n"), None);
        assert_eq!(effective_caps("Name: x\n"), None);
        let root = effective_caps("CapEff:\t0000000000080000\n").unwrap();
        assert_eq!(root >> CAP_SYS_PTRACE & 1, 1);
    }
}
