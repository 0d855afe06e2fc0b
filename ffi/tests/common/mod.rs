//! Helpers of the C ABI tests: scratch directories, and C programs built
//! against the header and the library as cargo built them.

#![allow(dead_code)] // each test file uses some of them

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kungfu_tests::{output_text as text, run_bounded as run, target_dir};

pub const FFI: &str = env!("CARGO_MANIFEST_DIR");

/// A scratch directory, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(what: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "kungfu-ffi-{what}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch dir");
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `cmd` (bounded by `limit`) and checks that it succeeded.
pub fn ok(cmd: Command, limit: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let out = run(cmd, limit);
    assert!(out.status.success(), "{desc} failed\n{}", text(&out));
    out
}

/// target/<profile>/NAME, which must have been built.
pub fn built(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: `cargo build -p kungfu-ffi -p kungfu-tools` first \
         (scripts/test.sh does; `cargo test` alone does not build a cdylib)",
        p.display()
    );
    p
}

/// Compiles the C program `ffi/tests/c/NAME.c` with `extra` flags against
/// `ffi/include` and target/<profile>/libkungfu.so (found through an
/// rpath) into `dir/NAME`. (c_abi.rs tests the installed library; these
/// tests are about behaviour, so they skip the install.)
pub fn compile_c(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    built("libkungfu.so");
    let exe = dir.join(name);
    let mut cc = Command::new("cc");
    cc.args([
        "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g", "-pthread",
    ])
    .args(extra)
    .arg(Path::new(FFI).join(format!("tests/c/{name}.c")))
    .arg(format!("-I{FFI}/include"))
    .arg(format!("-L{}", target_dir().display()))
    .arg("-lkungfu")
    .arg(format!("-Wl,-rpath,{}", target_dir().display()))
    .arg("-o")
    .arg(&exe);
    ok(cc, Duration::from_secs(180));
    exe
}

/// `kungfu-run -np NP --timeout 60s ARGS...` (its own timeout, and a kill
/// here 30 s later), which must succeed; returns its output.
pub fn kungfu_run(np: usize, args: &[&str]) -> String {
    let mut c = Command::new(built("kungfu-run"));
    c.args(["-np", &np.to_string(), "--timeout", "60s"])
        .args(args);
    text(&ok(c, Duration::from_secs(90)))
}

/// Checks that `out` has every line of `want`, saying which are missing.
pub fn assert_lines(out: &str, want: &[String]) {
    let lines: Vec<&str> = out.lines().collect();
    let missing: Vec<&String> = want
        .iter()
        .filter(|w| !lines.contains(&w.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "missing lines:\n{}\n\nin:\n{out}",
        missing
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}
