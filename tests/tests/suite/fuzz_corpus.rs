//! Replays the committed corpus of every fuzz target (`fuzz/corpus/`) and
//! the inputs of the bugs they found (`fuzz/regressions/`) through the
//! same entry points the targets call, on stable and without cargo-fuzz:
//! a change that breaks an invariant a fuzzer once checked fails here.

use std::path::PathBuf;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut out = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries {
            let path = e.expect("a directory entry").path();
            let data = std::fs::read(&path).expect("a corpus file");
            out.push((path, data));
        }
    }
    out.sort();
    out
}

/// Runs `f` on every input of `target`, naming the input that fails.
fn replay(target: &str, f: fn(&[u8])) {
    let all = inputs(target);
    assert!(all.len() >= 2, "no corpus for {target} in fuzz/");
    for (path, data) in all {
        if std::panic::catch_unwind(|| f(&data)).is_err() {
            panic!("{target}: {} breaks an invariant", path.display());
        }
    }
}

#[test]
fn header() {
    replay("header", kungfu_transport::fuzzing::header);
}

#[test]
fn handshake() {
    replay("handshake", kungfu_transport::fuzzing::handshake);
}

#[test]
fn http() {
    replay("http", kungfu::fuzzing::http);
}

#[test]
fn cluster_config() {
    replay("cluster_config", kungfu::fuzzing::cluster_config);
}

#[test]
fn rendezvous() {
    replay("rendezvous", kungfu::fuzzing::rendezvous);
}

#[test]
fn etcd_response() {
    replay("etcd_response", kungfu::fuzzing::etcd_response);
}
