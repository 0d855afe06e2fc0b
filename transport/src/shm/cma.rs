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
//! user, and no Yama restriction: `ptrace_scope` 0 or absent) and no
//! seccomp filter blocks the call (some container runtimes do).
//! [`available`] probes it.

use std::io;

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

/// Whether cross-memory attach works here: Yama allows reading a peer of
/// the same user, and a read of this process's own memory goes through
/// (seccomp would refuse it).
pub fn available() -> bool {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    // 1 (Ubuntu's default) lets a process read only its descendants:
    // sibling workers could not read each other, though reading itself
    // (the probe below) works.
    if scope > 0 {
        return false;
    }
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
}
