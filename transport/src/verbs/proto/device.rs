//! What a missing RDMA device is called: the words for each reason
//! libibverbs gives, naming what to install or load.

/// Where the kernel lists uverbs devices; absent without `ib_uverbs`.
pub const SYSFS_VERBS: &str = "/sys/class/infiniband_verbs";

/// The SoftRoCE recipe, for messages.
pub const SOFTROCE_HINT: &str =
    "e.g. SoftRoCE: `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`";

/// Why `ibv_get_device_list` failed (`errno`), in words that name what is
/// missing. rdma-mummy-sys answers EOPNOTSUPP when it cannot load
/// libibverbs; libibverbs answers ENOSYS without kernel support.
pub fn device_list_error(errno: Option<i32>, err: &str, sysfs_present: bool) -> String {
    match errno {
        Some(libc::EOPNOTSUPP) => format!(
            "libibverbs.so.1 could not be loaded ({err}); install the rdma-core user space \
             (Debian: libibverbs1 ibverbs-providers)"
        ),
        Some(libc::ENOSYS) if !sysfs_present => format!(
            "no RDMA device: {SYSFS_VERBS} is missing ({err}); load ib_uverbs and a device \
             driver, {SOFTROCE_HINT}"
        ),
        _ => format!("ibv_get_device_list failed: {err}"),
    }
}

/// No device in the list.
pub fn no_device() -> String {
    format!("no RDMA device (libibverbs lists none): attach an HCA or add a SoftRoCE link, {SOFTROCE_HINT}")
}

/// The named device is not in the list.
pub fn no_such_device(wanted: &str, available: &[String]) -> String {
    format!(
        "no RDMA device named {wanted:?} (available: {})",
        if available.is_empty() {
            "none".to_string()
        } else {
            available.join(", ")
        }
    )
}
