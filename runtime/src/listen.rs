//! The socket a worker accepts its peers' connections on.
//!
//! `kungfu-run` binds each local worker's listening socket itself, at a
//! port the kernel picks (port 0), and passes it down as an inherited file
//! descriptor named in `KUNGFU_LISTEN_FD`. From the launcher's bind on, no
//! other process (and no other worker) can take the port: choosing a free
//! port, releasing it and letting the worker bind it later raced with
//! every other process on the host, and two workers of a job were once
//! handed the same port.
//!
//! A worker adopts its inherited socket once and keeps it for the life of
//! the process: every cluster version accepts on a duplicate of it, so the
//! port stays held across resizes too (connections that arrive between
//! two versions wait in the backlog rather than being refused). Workers
//! given no descriptor (the rendezvous launchers, a peer list written by
//! hand, multi-machine kungfu-run) bind their address at each version, as
//! before.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::sync::Mutex;

use kungfu_topology::Peer;
use tokio::net::TcpListener;

use crate::BootstrapError;

/// The environment variable that names the inherited socket.
pub const LISTEN_FD_VAR: &str = "KUNGFU_LISTEN_FD";

/// Sockets adopted by this process, by descriptor: adopted once (owning a
/// descriptor twice would close it twice), duplicated for each version.
static ADOPTED: Mutex<Vec<(RawFd, std::net::TcpListener)>> = Mutex::new(Vec::new());

/// A listener at `me` (this worker's address): a duplicate of the
/// inherited socket `fd` if there is one, otherwise a new bind.
pub(crate) async fn listen(me: &Peer, fd: Option<RawFd>) -> Result<TcpListener, BootstrapError> {
    let Some(fd) = fd else {
        return TcpListener::bind((me.host.as_str(), me.port))
            .await
            .map_err(|source| BootstrapError::Listen {
                addr: me.to_string(),
                source,
            });
    };
    let fail = |why: String| BootstrapError::Listen {
        addr: format!("{me} ({LISTEN_FD_VAR}={fd})"),
        source: std::io::Error::other(why),
    };
    let mut adopted = ADOPTED.lock().unwrap_or_else(|e| e.into_inner());
    if !adopted.iter().any(|(f, _)| *f == fd) {
        adopted.push((fd, adopt(fd).map_err(&fail)?));
    }
    let (_, l) = adopted.iter().find(|(f, _)| *f == fd).expect("just added");
    let port = l.local_addr().map_err(|e| fail(e.to_string()))?.port();
    if port != me.port {
        return Err(fail(format!(
            "the inherited socket listens on port {port}, not on this worker's port"
        )));
    }
    let dup = l.try_clone().map_err(|e| fail(format!("dup: {e}")))?;
    drop(adopted);
    TcpListener::from_std(dup).map_err(|e| fail(e.to_string()))
}

/// Binds a listening socket at `host`, on a port the kernel picks, and
/// keeps it for the life of the process as an inherited one is kept:
/// every cluster version accepts on a duplicate of it ([`listen`] with
/// the returned descriptor). For a worker no launcher gave an address (it
/// starts alone, and a reconfigure later names its peers): no other
/// process can take its port between two versions.
pub(crate) fn bind_own(host: &str) -> Result<(Peer, RawFd), BootstrapError> {
    let fail = |source| BootstrapError::Listen {
        addr: format!("{host}:0"),
        source,
    };
    // (std sets close-on-exec on every socket it makes)
    let l = std::net::TcpListener::bind((host, 0)).map_err(fail)?;
    l.set_nonblocking(true).map_err(fail)?;
    let port = l.local_addr().map_err(fail)?.port();
    let fd = l.as_raw_fd();
    let mut adopted = ADOPTED.lock().unwrap_or_else(|e| e.into_inner());
    adopted.push((fd, l));
    let me = Peer {
        host: host.to_string(),
        port,
    };
    Ok((me, fd))
}

/// Takes ownership of `fd` if it is an open, listening TCP socket; marks it
/// close-on-exec (the worker's own children must not hold the port) and
/// non-blocking (for tokio).
fn adopt(fd: RawFd) -> Result<std::net::TcpListener, String> {
    if fd < 3 {
        return Err("not a socket the launcher passes (0-2 are stdio)".into());
    }
    let opt = |name: libc::c_int| -> Result<libc::c_int, String> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        #[allow(unsafe_code)]
        // SAFETY: getsockopt writes at most `len` bytes to `v`, a c_int
        // that lives across the call; an fd that is not an open socket
        // makes it fail with EBADF or ENOTSOCK, touching nothing.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                name,
                (&raw mut v).cast::<libc::c_void>(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        Ok(v)
    };
    let domain = opt(libc::SO_DOMAIN)?;
    if ![libc::AF_INET, libc::AF_INET6].contains(&domain)
        || opt(libc::SO_TYPE)? != libc::SOCK_STREAM
    {
        return Err("not a TCP socket".into());
    }
    if opt(libc::SO_ACCEPTCONN)? != 1 {
        return Err("not a listening socket".into());
    }
    #[allow(unsafe_code)]
    // SAFETY: `fd` is open and is a listening TCP socket (checked above),
    // so a TcpListener may own it: closing it is all it needs. Nothing
    // else in this process owns it: the launcher passed it for this
    // worker alone, and ADOPTED (whose lock the caller holds) makes this
    // the only adoption of `fd`.
    let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    let set = || -> std::io::Result<()> {
        #[allow(unsafe_code)]
        // SAFETY: F_SETFD on a descriptor this process owns (`l`); it
        // changes only the descriptor's flags.
        let r = unsafe { libc::fcntl(l.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        if r == -1 {
            return Err(std::io::Error::last_os_error());
        }
        l.set_nonblocking(true)
    };
    if let Err(e) = set() {
        // hand it back unclosed: it is still the launcher's socket
        let _ = l.into_raw_fd();
        return Err(e.to_string());
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(port: u16) -> Peer {
        Peer {
            host: "127.0.0.1".into(),
            port,
        }
    }

    /// Every version gets a duplicate of the one adopted socket: the port
    /// is never released, and a connection made between two versions is
    /// accepted by the next one.
    #[tokio::test]
    async fn an_inherited_socket_is_adopted_once_and_kept() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // as a launcher passes it: the process no longer owns it as `l`
        let fd = l.into_raw_fd();
        let first = listen(&me(port), Some(fd)).await.unwrap();
        drop(first);
        assert!(
            std::net::TcpListener::bind(("127.0.0.1", port)).is_err(),
            "port {port} was released when a version's listener closed"
        );
        let early = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let second = listen(&me(port), Some(fd)).await.unwrap();
        let (_, from) = second.accept().await.unwrap();
        assert_eq!(from, early.local_addr().unwrap());
        // the socket is not handed to the worker's own children
        #[allow(unsafe_code)]
        // SAFETY: F_GETFD only reads the flags of a descriptor we own.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }

    #[tokio::test]
    async fn a_wrong_descriptor_is_refused_and_left_open() {
        // a socket that is not listening
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let e = listen(&me(1), Some(u.as_raw_fd())).await.unwrap_err();
        assert!(e.to_string().contains("not a TCP socket"), "{e}");
        assert!(u.local_addr().is_ok(), "the descriptor was closed");
        // a listening socket at another port than the worker's
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let fd = l.into_raw_fd();
        let e = listen(&me(port.wrapping_add(1)), Some(fd))
            .await
            .unwrap_err();
        assert!(e.to_string().contains(&format!("on port {port}")), "{e}");
        // no descriptor, no socket
        let e = listen(&me(1), Some(987_654)).await.unwrap_err();
        assert!(e.to_string().contains("Bad file descriptor"), "{e}");
    }
}
