//! Raw bindings to the system libfabric (OFI), version 1.17 of its API.
//!
//! Three layers, one flat namespace that keeps the C names:
//!
//! - the bindgen output (`src/bindings.rs`, made by `regen.sh`, checked in
//!   so that a build needs no libclang): the structs (`fi_info` and its
//!   attributes, the `fid_*` objects and their ops tables, the completion
//!   entries) and the `FI_*` constants;
//! - libfabric's exported calls (`fi_getinfo`, `fi_freeinfo`, `fi_dupinfo`,
//!   `fi_fabric`, `fi_strerror`, `fi_version`, `fi_tostr`, `fi_tostr_r`),
//!   loaded at run time from `libfabric.so.1` ([`load`]; nothing links
//!   libfabric, and loading it keeps the program's signal handlers: see
//!   the `dl` module);
//! - hand-written `unsafe fn`s for the API that the headers define as
//!   `static inline` calls through an object's ops table (`fi_domain`,
//!   `fi_endpoint`, `fi_tsend`, `fi_cq_read`, `fi_close`, ...), which bindgen
//!   cannot emit. Each does what its C inline does, with one difference:
//!   where the C code would call through a null ops table or a null entry
//!   (a provider without that operation), the Rust function returns
//!   `-FI_ENOSYS` (a null pointer for the string calls) instead of crashing.
//!
//! Constants keep the C types: the `FI_E*` error codes are `c_int` and
//! positive, as in C (calls return them negated; `fi_strerror` takes them
//! positive), the capability, mode and flag bits are `u64`, the `FI_MR_*`
//! bits are `c_int` (`fi_domain_attr::mr_mode` is an `int`), and the
//! constants of the headers' anonymous enums (`FI_GETWAIT`, `FI_EOTHER`,
//! `FI_SOCKADDR_IN`, ...) are `c_int`, C's type for them. Named enums are
//! type aliases (`fi_ep_type`, `fi_wait_obj`, ...) with one constant per
//! value, never Rust enums, so a value a newer library adds is not
//! undefined behaviour.
//!
//! The function-like macros `FI_VERSION`, `FI_MAJOR` and `FI_MINOR` and the
//! cast constants `FI_ADDR_UNSPEC`, `FI_ADDR_NOTAVAIL` and `FI_KEY_NOTAVAIL`
//! are written by hand below.
#![allow(unsafe_code)] // a -sys crate: every item is an FFI call or type

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    clippy::missing_safety_doc
)]
mod bindings;

mod cq;
mod dl;
mod domain;
mod endpoint;
mod fabric;
mod msg;
mod tagged;

pub use bindings::*;
pub use cq::*;
pub use dl::{
    fi_dupinfo, fi_fabric, fi_freeinfo, fi_getinfo, fi_strerror, fi_tostr, fi_tostr_r, fi_version,
};
pub use dl::{load, LIBFABRIC};
pub use domain::*;
pub use endpoint::*;
pub use fabric::*;
pub use msg::*;
pub use tagged::*;

/// `struct iovec` of `<sys/uio.h>`, taken from libc so that it is the one
/// the rest of a program uses.
pub use libc::iovec;

/// `FI_VERSION(major, minor)` of fabric.h: the version word `fi_getinfo`
/// and `fi_version` use.
#[allow(non_snake_case)]
pub const fn FI_VERSION(major: u32, minor: u32) -> u32 {
    (major << 16) | minor
}

/// `FI_MAJOR(version)` of fabric.h.
#[allow(non_snake_case)]
pub const fn FI_MAJOR(version: u32) -> u32 {
    version >> 16
}

/// `FI_MINOR(version)` of fabric.h.
#[allow(non_snake_case)]
pub const fn FI_MINOR(version: u32) -> u32 {
    version & 0xFFFF
}

/// `FI_ADDR_UNSPEC` of fabric.h (`(uint64_t) -1`): "from any source" in a
/// receive, "no address" elsewhere.
pub const FI_ADDR_UNSPEC: fi_addr_t = u64::MAX;
/// `FI_ADDR_NOTAVAIL` of fabric.h (`(uint64_t) -1`): an address that the AV
/// could not insert, or a completion's unknown source.
pub const FI_ADDR_NOTAVAIL: fi_addr_t = u64::MAX;
/// `FI_KEY_NOTAVAIL` of fabric.h (`(uint64_t) -1`).
pub const FI_KEY_NOTAVAIL: u64 = u64::MAX;

/// `-FI_ENOSYS` as the `int` the control-path calls return: what a wrapper
/// returns where the provider has no entry for the operation.
const ENOSYS: std::os::raw::c_int = -FI_ENOSYS;
/// `-FI_ENOSYS` as the `ssize_t` the data-path calls return.
const ENOSYS_SSIZE: isize = -(FI_ENOSYS as isize);

/// The ops table at `table`, or `None` where the provider left it null.
///
/// # Safety
///
/// `table` was just read from a live libfabric object (a `fid_*` that is
/// open): a provider's ops tables outlive the objects that point to them.
#[inline]
unsafe fn ops<'a, T>(table: *const T) -> Option<&'a T> {
    // SAFETY: null or a table that outlives 'a (the caller's contract).
    unsafe { table.as_ref() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_macros() {
        let v = FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
        assert_eq!(v, (1 << 16) | 17);
        assert_eq!(FI_MAJOR(v), 1);
        assert_eq!(FI_MINOR(v), 17);
    }

    #[test]
    fn library_version_is_at_least_the_headers() {
        // SAFETY: fi_version takes nothing and only returns a number.
        let lib = unsafe { fi_version() };
        assert!(
            lib >= FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION),
            "{lib:#x}"
        );
    }

    #[test]
    fn strerror_knows_the_codes() {
        // SAFETY: fi_strerror returns a static NUL-terminated string.
        let s = unsafe { std::ffi::CStr::from_ptr(fi_strerror(FI_EAGAIN)) };
        assert!(!s.to_bytes().is_empty());
        // SAFETY: as above, for a libfabric-specific code.
        let s = unsafe { std::ffi::CStr::from_ptr(fi_strerror(FI_ETRUNC)) };
        assert!(!s.to_bytes().is_empty());
    }
}
