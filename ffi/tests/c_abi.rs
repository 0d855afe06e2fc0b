//! The C ABI as C and C++ programs use it: install libkungfu with the
//! Makefile into a scratch prefix, compile against it with pkg-config
//! alone (C dynamically and statically, C++ under AddressSanitizer, the
//! CMake example), and run each under kungfu-run.
//!
//! Needs the workspace built first (`cargo build --workspace`: `cargo test`
//! does not build the cdylib), a C and a C++ compiler, make,
//! pkg-config and cmake (scripts/test.sh installs what is missing).
//! Every process is bounded by kungfu-run's `--timeout` and a kill here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kungfu_tests::{output_text as text, target_dir};

mod common;
use common::{ok, Scratch, FFI};

/// Installs libkungfu and its headers under `prefix` with the Makefile.
fn install(prefix: &Path) {
    let lib = target_dir().join("libkungfu.so");
    assert!(
        lib.exists(),
        "{} is missing: `cargo build --workspace` first (scripts/test.sh does; \
         `cargo test` alone does not build a cdylib)",
        lib.display()
    );
    let mut make = Command::new("make");
    make.args(["-s", "-C", FFI, "install"])
        .arg(format!("PREFIX={}", prefix.display()))
        .arg(format!("LIBDIR={}", target_dir().display()));
    ok(make, Duration::from_secs(60));
}

/// `pkg-config ARGS kungfu` against the scratch install.
fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let mut c = Command::new("pkg-config");
    c.args(args)
        .arg("kungfu")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"));
    let out = ok(c, Duration::from_secs(30));
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

/// Compiles `src` with `compiler` and `flags` against the install in
/// `prefix` (headers from pkg-config; `link` as given, or pkg-config's
/// `--libs` and an rpath when `None`) into `prefix/exe`.
fn compile(
    prefix: &Path,
    compiler: &str,
    flags: &[&str],
    src: &Path,
    link: Option<Vec<String>>,
    exe: &str,
) -> PathBuf {
    let out = prefix.join(exe);
    let link = link.unwrap_or_else(|| {
        let mut l = pkg_config(prefix, &["--libs"]);
        l.push(format!("-Wl,-rpath,{}", prefix.join("lib").display()));
        l
    });
    let mut c = Command::new(compiler);
    c.args(flags)
        .arg(src)
        .args(pkg_config(prefix, &["--cflags"]))
        .args(link)
        .arg("-o")
        .arg(&out);
    ok(c, Duration::from_secs(180));
    out
}

const C_FLAGS: &[&str] = &["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"];

/// kungfu-run -np `np` PROGRAM, checking that every rank said `passed`.
fn run_job(np: usize, program: &Path, passed: &str, env: &[(&str, &str)]) {
    let kungfu_run = target_dir().join("kungfu-run");
    assert!(
        kungfu_run.exists(),
        "{} is missing: build the workspace first (cargo test --workspace does)",
        kungfu_run.display()
    );
    let mut c = Command::new(kungfu_run);
    c.args(["-np", &np.to_string(), "--timeout", "180s"]);
    for (k, v) in env {
        c.args(["-x", &format!("{k}={v}")]);
    }
    c.arg(program);
    let out = ok(c, Duration::from_secs(200));
    let t = text(&out);
    for r in 0..np {
        assert!(
            t.contains(&format!("[{r}] rank {r}: {passed}")),
            "rank {r}:\n{t}"
        );
    }
}

#[test]
fn c_trainer_linked_dynamically() {
    let dir = Scratch::new("c");
    install(&dir.0);
    let src = Path::new(FFI).join("tests/c/trainer.c");
    let exe = compile(&dir.0, "cc", C_FLAGS, &src, None, "trainer");
    run_job(4, &exe, "all C checks passed", &[]);
}

/// Adaptation from C under `kungfu-run -w`: monitors, proposals and
/// agreement (a strategy swap, a custom action, resizes 2 -> 3 -> 2 with
/// the state synced), the model checked at every step.
#[test]
fn c_elastic_trainer_adapts_and_resizes() {
    let dir = Scratch::new("c-elastic");
    install(&dir.0);
    let src = Path::new(FFI).join("tests/c/elastic.c");
    let mut link = pkg_config(&dir.0, &["--libs"]);
    link.push(format!("-Wl,-rpath,{}", dir.0.join("lib").display()));
    link.push("-lm".into());
    let exe = compile(&dir.0, "cc", C_FLAGS, &src, Some(link), "elastic");
    let mut c = Command::new(target_dir().join("kungfu-run"));
    c.args(["-w", "-np", "2", "--timeout", "120s"]).arg(&exe);
    let out = ok(c, Duration::from_secs(150));
    let t = text(&out);
    // the first two, and the one that joined at version 1, end together;
    // the worker that left at step 20 was told so
    assert!(
        t.contains("kungfu-run: cluster version 1: 3 workers"),
        "{t}"
    );
    assert!(
        t.contains("kungfu-run: cluster version 2: 2 workers"),
        "{t}"
    );
    assert!(
        t.contains("rank 2: detached at step 20; all C checks passed"),
        "{t}"
    );
    for r in 0..2 {
        let line = format!(
            "rank {r}: joined at version 0, 2 workers at step 30, version 2; all C checks passed"
        );
        assert!(t.contains(&line), "rank {r}:\n{t}");
    }
}

#[test]
fn c_trainer_linked_statically() {
    let dir = Scratch::new("c-static");
    install(&dir.0);
    // the archive itself, then what pkg-config says it needs
    let mut link = vec![dir.0.join("lib/libkungfu.a").display().to_string()];
    link.extend(
        pkg_config(&dir.0, &["--static", "--libs"])
            .into_iter()
            .filter(|a| a != "-lkungfu"),
    );
    let src = Path::new(FFI).join("tests/c/trainer.c");
    let exe = compile(&dir.0, "cc", C_FLAGS, &src, Some(link), "trainer");
    // no libkungfu.so is needed at run time
    std::fs::remove_file(dir.0.join("lib/libkungfu.so")).expect("remove the shared library");
    run_job(2, &exe, "all C checks passed", &[]);
}

#[test]
fn cpp_wrapper() {
    let dir = Scratch::new("cpp-plain");
    install(&dir.0);
    let flags = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O2"];
    let src = Path::new(FFI).join("tests/cpp/trainer.cpp");
    let exe = compile(&dir.0, "c++", &flags, &src, None, "trainer_cpp");
    run_job(4, &exe, "all C++ checks passed", &[]);
}

#[test]
fn cpp_wrapper_under_address_sanitizer() {
    let dir = Scratch::new("cpp");
    install(&dir.0);
    let flags = [
        "-std=c++17",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-O1",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
    ];
    let src = Path::new(FFI).join("tests/cpp/trainer.cpp");
    let exe = compile(&dir.0, "c++", &flags, &src, None, "trainer_cpp");
    run_job(
        4,
        &exe,
        "all C++ checks passed",
        &[
            ("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=1"),
            ("UBSAN_OPTIONS", "halt_on_error=1"),
        ],
    );
}

#[test]
fn cmake_example_finds_the_library_with_pkg_config() {
    let dir = Scratch::new("cmake");
    install(&dir.0);
    let build = dir.0.join("build");
    let mut configure = Command::new("cmake");
    configure
        .arg("-S")
        .arg(Path::new(FFI).join("examples/cmake"))
        .arg("-B")
        .arg(&build)
        .env("PKG_CONFIG_PATH", dir.0.join("lib/pkgconfig"));
    ok(configure, Duration::from_secs(120));
    let mut make = Command::new("cmake");
    make.arg("--build").arg(&build);
    ok(make, Duration::from_secs(180));
    let kungfu_run = target_dir().join("kungfu-run");
    let mut c = Command::new(kungfu_run);
    c.args(["-np", "2", "--timeout", "120s"])
        .arg(build.join("kungfu_example"));
    let out = ok(c, Duration::from_secs(150));
    let t = text(&out);
    assert!(t.contains("[1] rank 1 of 2: average 1.5"), "{t}");
}

/// The complete example of docs/c-api.md compiles and runs as printed.
#[test]
fn the_documented_example_works() {
    let doc =
        std::fs::read_to_string(Path::new(FFI).join("../docs/c-api.md")).expect("docs/c-api.md");
    let start = doc.find("```c\n").expect("a C block in docs/c-api.md") + 5;
    let len = doc[start..].find("```").expect("the end of the C block");
    let dir = Scratch::new("doc");
    install(&dir.0);
    let src = dir.0.join("example.c");
    std::fs::write(&src, &doc[start..start + len]).expect("writing the example");
    let exe = compile(&dir.0, "cc", C_FLAGS, &src, None, "example");
    let mut c = Command::new(target_dir().join("kungfu-run"));
    c.args(["-np", "2", "--timeout", "120s"]).arg(&exe);
    let t = text(&ok(c, Duration::from_secs(150)));
    assert!(
        t.contains("[1] rank 1 of 2: grad 0.5 (expect 0.5), bias 2 (expect 2)"),
        "{t}"
    );
    assert!(t.contains("[0] bias reduced"), "{t}");
}
