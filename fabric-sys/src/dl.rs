//! libfabric's exported calls, loaded at run time (`dlopen` of
//! `libfabric.so.1`), so that nothing links libfabric: a program that never
//! uses the fabric transport never loads it.
//!
//! Why: Debian's libfabric is linked against its providers' libraries,
//! and one of them (`libinfinipath`, PSM's) installs handlers for SIGINT,
//! SIGTERM and other signals when it is loaded, turning Ctrl-C into an
//! `exit(1)` of the whole process. Loaded at program start (linked), it
//! would change the signal handling of every program built on KungFu-rs.
//! Loaded here, only when the fabric transport starts, and with every
//! signal disposition saved before and restored after (so what the loaded
//! libraries installed is undone, and the program keeps its own).
//!
//! Every function has the C signature; the ops-table calls (the headers'
//! `static inline` API) need no symbol and live in the other modules.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::{fi_fabric_attr, fi_info, fi_type, fid_fabric, FI_ENOSYS};

/// The library file loaded (the SONAME of libfabric 1.x).
pub const LIBFABRIC: &str = "libfabric.so.1";

struct Lib {
    getinfo: unsafe extern "C" fn(
        u32,
        *const c_char,
        *const c_char,
        u64,
        *const fi_info,
        *mut *mut fi_info,
    ) -> c_int,
    freeinfo: unsafe extern "C" fn(*mut fi_info),
    dupinfo: unsafe extern "C" fn(*const fi_info) -> *mut fi_info,
    fabric: unsafe extern "C" fn(*mut fi_fabric_attr, *mut *mut fid_fabric, *mut c_void) -> c_int,
    strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    version: unsafe extern "C" fn() -> u32,
    tostr: unsafe extern "C" fn(*const c_void, fi_type) -> *mut c_char,
    tostr_r: unsafe extern "C" fn(*mut c_char, usize, *const c_void, fi_type) -> *mut c_char,
}

static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();

/// Loads libfabric (once per process): `Err` says why it cannot be used
/// (not installed: Debian's package is `libfabric1`).
pub fn load() -> Result<(), String> {
    LIB.get_or_init(open)
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

fn lib() -> Option<&'static Lib> {
    LIB.get_or_init(open).as_ref().ok()
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until
    // the next dl call on this thread.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The signals whose dispositions a load may change (all but SIGKILL and
/// SIGSTOP, which cannot be caught).
fn signals() -> impl Iterator<Item = c_int> {
    (1..32).filter(|&s| s != libc::SIGKILL && s != libc::SIGSTOP)
}

#[allow(clippy::missing_transmute_annotations)] // the field types say it
fn open() -> Result<Lib, String> {
    let name = std::ffi::CString::new(LIBFABRIC).expect("no NUL");
    // Save every disposition: the libraries libfabric loads may install
    // handlers from their constructors.
    let saved: Vec<(c_int, libc::sigaction)> = signals()
        .filter_map(|s| {
            // SAFETY: a zeroed sigaction is a valid out-parameter; querying
            // (null new action) changes nothing.
            let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            let r = unsafe { libc::sigaction(s, std::ptr::null(), &mut old) };
            (r == 0).then_some((s, old))
        })
        .collect();
    // SAFETY: dlopen of a library by name; its constructors run now (the
    // reason for the save and restore around it).
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    for (s, old) in &saved {
        // SAFETY: restores a disposition read just above.
        unsafe { libc::sigaction(*s, old, std::ptr::null_mut()) };
    }
    if h.is_null() {
        return Err(format!(
            "{LIBFABRIC} could not be loaded ({}): install libfabric (Debian: libfabric1)",
            dlerror()
        ));
    }
    let sym = |n: &str| -> Result<*mut c_void, String> {
        let c = std::ffi::CString::new(n).expect("no NUL");
        // SAFETY: a symbol lookup in the handle just opened (never closed).
        let p = unsafe { libc::dlsym(h, c.as_ptr()) };
        if p.is_null() {
            Err(format!("{LIBFABRIC} has no {n}: {}", dlerror()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each transmute: the symbol is libfabric's function of that
    // name, whose C signature (fabric.h, API 1.x) is the pointer's type.
    let lib = unsafe {
        Lib {
            getinfo: std::mem::transmute(sym("fi_getinfo")?),
            freeinfo: std::mem::transmute(sym("fi_freeinfo")?),
            dupinfo: std::mem::transmute(sym("fi_dupinfo")?),
            fabric: std::mem::transmute(sym("fi_fabric")?),
            strerror: std::mem::transmute(sym("fi_strerror")?),
            version: std::mem::transmute(sym("fi_version")?),
            tostr: std::mem::transmute(sym("fi_tostr")?),
            tostr_r: std::mem::transmute(sym("fi_tostr_r")?),
        }
    };
    Ok(lib)
}

/// `fi_getinfo`; `-FI_ENOSYS` if libfabric cannot be loaded ([`load`]
/// says why).
///
/// # Safety
/// As the C function's: `hints` null or a valid `fi_info`, `info`
/// writable; the strings null or NUL-terminated.
pub unsafe fn fi_getinfo(
    version: u32,
    node: *const c_char,
    service: *const c_char,
    flags: u64,
    hints: *const fi_info,
    info: *mut *mut fi_info,
) -> c_int {
    match lib() {
        // SAFETY: the caller's contract.
        Some(l) => unsafe { (l.getinfo)(version, node, service, flags, hints, info) },
        None => -FI_ENOSYS,
    }
}

/// `fi_freeinfo` (nothing without libfabric: it gave no `fi_info`).
///
/// # Safety
/// `info` null or a list `fi_getinfo`/`fi_dupinfo`/`fi_allocinfo` gave.
pub unsafe fn fi_freeinfo(info: *mut fi_info) {
    if let Some(l) = lib() {
        // SAFETY: the caller's contract.
        unsafe { (l.freeinfo)(info) }
    }
}

/// `fi_dupinfo`; null without libfabric.
///
/// # Safety
/// `info` null or a valid `fi_info`.
pub unsafe fn fi_dupinfo(info: *const fi_info) -> *mut fi_info {
    match lib() {
        // SAFETY: the caller's contract.
        Some(l) => unsafe { (l.dupinfo)(info) },
        None => std::ptr::null_mut(),
    }
}

/// `fi_fabric`; `-FI_ENOSYS` without libfabric.
///
/// # Safety
/// As the C function's: `attr` from an `fi_info` of `fi_getinfo`.
pub unsafe fn fi_fabric(
    attr: *mut fi_fabric_attr,
    fabric: *mut *mut fid_fabric,
    context: *mut c_void,
) -> c_int {
    match lib() {
        // SAFETY: the caller's contract.
        Some(l) => unsafe { (l.fabric)(attr, fabric, context) },
        None => -FI_ENOSYS,
    }
}

/// `fi_strerror`: a static string for any code.
///
/// # Safety
/// None beyond the C function's (it takes any code).
pub unsafe fn fi_strerror(errnum: c_int) -> *const c_char {
    match lib() {
        // SAFETY: fi_strerror takes any code.
        Some(l) => unsafe { (l.strerror)(errnum) },
        None => c"libfabric is not loaded".as_ptr(),
    }
}

/// `fi_version`: the library's API version; 0 without libfabric.
///
/// # Safety
/// None.
pub unsafe fn fi_version() -> u32 {
    match lib() {
        // SAFETY: no arguments.
        Some(l) => unsafe { (l.version)() },
        None => 0,
    }
}

/// `fi_tostr`; null without libfabric.
///
/// # Safety
/// `data` points to a value of the type `datatype` names.
pub unsafe fn fi_tostr(data: *const c_void, datatype: fi_type) -> *mut c_char {
    match lib() {
        // SAFETY: the caller's contract.
        Some(l) => unsafe { (l.tostr)(data, datatype) },
        None => std::ptr::null_mut(),
    }
}

/// `fi_tostr_r`; null without libfabric.
///
/// # Safety
/// `buf` writable for `len` bytes; `data` as for [`fi_tostr`].
pub unsafe fn fi_tostr_r(
    buf: *mut c_char,
    len: usize,
    data: *const c_void,
    datatype: fi_type,
) -> *mut c_char {
    match lib() {
        // SAFETY: the caller's contract.
        Some(l) => unsafe { (l.tostr_r)(buf, len, data, datatype) },
        None => std::ptr::null_mut(),
    }
}
