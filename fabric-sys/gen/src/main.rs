//! Writes `src/bindings.rs` of kungfu-fabric-sys from the system libfabric
//! headers. Run through `../regen.sh`, which builds this tool and passes the
//! output path and the include directory found by pkg-config.
//!
//!   kungfu-fabric-sys-gen OUT.rs [INCLUDE_DIR...]
//!
//! Only what a reliable-datagram (FI_EP_RDM) tagged-message backend needs is
//! allowlisted: the exported functions, the `fid_*` objects whose ops tables
//! the hand-written wrappers in `src/` call through, the attribute structs,
//! the completion entries and the `FI_*` constants.

use bindgen::callbacks::{IntKind, ParseCallbacks};
use bindgen::{EnumVariation, RustEdition, RustTarget};

/// The headers bound: the core, the objects used by a tagged RDM backend
/// and the error codes. RMA, atomics, collectives, triggers and the
/// provider extensions are left out.
const HEADER: &str = "\
#include <rdma/fabric.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_tagged.h>
";

// No functions: libfabric's few exported calls (fi_getinfo, fi_freeinfo,
// fi_dupinfo, fi_fabric, fi_strerror, fi_version, fi_tostr, fi_tostr_r) are
// loaded at run time by src/dl.rs, so that nothing links libfabric.

/// Types bound (with everything they reference).
const TYPES: &[&str] = &[
    "fi_info",
    "fid_t",
    "fi_addr_t",
    "fid_fabric",
    "fid_domain",
    "fid_ep",
    "fid_av",
    "fid_cq",
    "fid_mr",
    "fid_wait",
    "fi_cq_attr",
    "fi_av_attr",
    "fi_mr_attr",
    "fi_cq_entry",
    "fi_cq_msg_entry",
    "fi_cq_data_entry",
    "fi_cq_tagged_entry",
    "fi_cq_err_entry",
    "fi_msg_tagged",
    "fi_context",
    "fi_context2",
    "fi_type",
    "fi_wait_obj",
    "fi_cq_format",
    "fi_cq_wait_cond",
    "fi_av_type",
    "fi_ep_type",
    "fi_mr_mode",
    "fi_threading",
    "fi_progress",
    "fi_resource_mgmt",
];

/// Integer types of the `#define` constants, as C uses them: the errno
/// values are `int` (returned negated), the `FI_MR_*` bits go into the
/// `int mr_mode` of `fi_domain_attr`, the version parts are `uint32_t`,
/// and every other flag is a `uint64_t` bit (caps, mode, op flags, order).
#[derive(Debug)]
struct MacroTypes;

impl ParseCallbacks for MacroTypes {
    fn int_macro(&self, name: &str, value: i64) -> Option<IntKind> {
        let errno = name == "FI_SUCCESS" || (name.starts_with("FI_E") && value < 4096);
        Some(if errno || name.starts_with("FI_MR_") {
            IntKind::Int
        } else if name.ends_with("_VERSION") || name == "FI_PROV_SPECIFIC" {
            IntKind::U32
        } else {
            IntKind::U64
        })
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .expect("usage: kungfu-fabric-sys-gen OUT.rs [INCLUDE_DIR...]");
    let target = RustTarget::stable(82, 0).expect("a Rust target bindgen knows");

    let mut builder = bindgen::Builder::default()
        .header_contents("kungfu_fabric_sys.h", HEADER)
        .rust_target(target)
        .rust_edition(RustEdition::Edition2021)
        // C enums as plain constants: a Rust enum holding a value the
        // library adds later would be undefined behaviour.
        .default_enum_style(EnumVariation::Consts)
        .prepend_enum_name(false)
        .allowlist_var("FI_.*")
        .parse_callbacks(Box::new(MacroTypes))
        // struct iovec is libc's: interoperable with the rest of the code.
        .blocklist_type("iovec")
        .raw_line("use libc::iovec;")
        .derive_default(true)
        .derive_debug(true)
        .generate_comments(false)
        .layout_tests(true)
        .merge_extern_blocks(true)
        .wrap_unsafe_ops(true)
        .sort_semantically(true);
    for t in TYPES {
        builder = builder.allowlist_type(t);
    }
    for dir in args {
        builder = builder.clang_arg(format!("-I{dir}"));
    }
    let bindings = builder.generate().expect("bindgen failed");
    let text = anonymous_enums_as_c_int(&bindings.to_string());
    std::fs::write(&out, text).expect("writing the bindings");
}

/// C gives the constants of an anonymous enum (`FI_GETWAIT`, `FI_EOTHER`,
/// `FI_SOCKADDR_IN`, ...) the type `int`; bindgen names a type alias
/// `_bindgen_ty_N` for each, numbered in parse order (so renumbered by any
/// header change). Replaces those aliases by `c_int`; the unnamed unions
/// inside structs (`fi_bus_attr__bindgen_ty_1`) keep their names.
fn anonymous_enums_as_c_int(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line.starts_with("pub type _bindgen_ty_") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("_bindgen_ty_") {
            let (head, tail) = rest.split_at(at + "_bindgen_ty_".len());
            let standalone = !head[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_');
            if standalone {
                out.push_str(&head[..at]);
                out.push_str("::std::os::raw::c_int");
                rest = tail.trim_start_matches(|c: char| c.is_ascii_digit());
            } else {
                // a member of a struct (`fi_bus_attr__bindgen_ty_1`): kept
                out.push_str(head);
                rest = tail;
            }
        }
        out.push_str(rest);
        out.push('\n');
    }
    out
}
