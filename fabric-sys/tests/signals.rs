//! Loading libfabric leaves the program's signal handling as it was: one
//! of the libraries Debian's libfabric pulls in (libinfinipath) installs
//! SIGINT and SIGTERM handlers that turn Ctrl-C into exit(1).

#![allow(unsafe_code)] // reading signal dispositions

fn disposition(sig: libc::c_int) -> libc::sighandler_t {
    // SAFETY: a query (null new action) into a zeroed out-parameter.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
        old.sa_sigaction
    }
}

#[test]
fn loading_libfabric_keeps_the_signal_handlers() {
    let before: Vec<_> = [libc::SIGINT, libc::SIGTERM, libc::SIGQUIT, libc::SIGHUP]
        .iter()
        .map(|&s| disposition(s))
        .collect();
    kungfu_fabric_sys::load().expect("libfabric loads (libfabric1 is installed)");
    let after: Vec<_> = [libc::SIGINT, libc::SIGTERM, libc::SIGQUIT, libc::SIGHUP]
        .iter()
        .map(|&s| disposition(s))
        .collect();
    assert_eq!(
        before, after,
        "a library loaded with libfabric changed a signal's handler"
    );
}
