//! The verbs tests that need an RDMA device run only where
//! `KUNGFU_TEST_IB_DEVICE` names one (`cfg(kungfu_ib_device)`); elsewhere
//! they are listed as ignored.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(kungfu_ib_device)");
    println!("cargo::rerun-if-env-changed=KUNGFU_TEST_IB_DEVICE");
    if std::env::var_os("KUNGFU_TEST_IB_DEVICE").is_some_and(|d| !d.is_empty()) {
        println!("cargo::rustc-cfg=kungfu_ib_device");
    }
}
