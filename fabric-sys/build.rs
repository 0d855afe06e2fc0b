//! Links the system libfabric, found through pkg-config. The bindings are
//! checked in (src/bindings.rs, made by regen.sh), so a build needs neither
//! libclang nor a C compiler: only libfabric's .so and its libfabric.pc.

/// The headers src/bindings.rs was generated from. Older libraries lack
/// parts of the API bound here (and reject `FI_VERSION(1, 17)` in
/// `fi_getinfo`); newer 1.x ones keep its ABI (new fields are appended and
/// the exported calls are symbol-versioned).
const MIN_VERSION: &str = "1.17";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // the pkg-config crate prints cargo:rustc-link-lib=fabric and the search
    // path, and reruns this script when PKG_CONFIG_PATH & co. change
    match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .probe("libfabric")
    {
        Ok(lib) => {
            for dir in &lib.include_paths {
                // for crates that build C against the same headers
                println!("cargo:include={}", dir.display());
            }
            println!("cargo:version={}", lib.version);
        }
        Err(e) => {
            eprintln!(
                "\nkungfu-fabric-sys: libfabric >= {MIN_VERSION} was not found through pkg-config.\n\
                 Install its development package, on Debian or Ubuntu:\n\
                 \n    apt-get install libfabric-dev pkg-config\n\n\
                 or point PKG_CONFIG_PATH at the directory holding libfabric.pc.\n\
                 pkg-config said: {e}\n"
            );
            std::process::exit(1);
        }
    }
}
