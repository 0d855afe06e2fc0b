//! Elastic across hosts: `kungfu-run -w` started on one host, with the
//! launchers it starts on the others (through ssh) following its config
//! server and starting or stopping their own workers.

use super::*;

const BENCH: &str = env!("CARGO_BIN_EXE_kungfu-bench");

/// 2 hosts x 2 workers grow to 3 hosts x 2, then shrink to one host; the
/// bench checks the model on every worker at every step and after each
/// change.
#[test]
fn a_watched_job_grows_onto_a_third_host_and_shrinks_to_one() {
    let Some(mut c) = cluster(3, "elastic_hosts") else {
        return;
    };
    watched_job(&mut c, &[], &[]);
}

/// The same with the config in etcd (`--config-store etcds://`), which
/// runs on host 1 with TLS (client certificates required) and users: the
/// launchers of hosts 2 and 3, started through ssh, get the
/// `KUNGFU_ETCD_*` variables on their command line and watch it there as
/// the job's user.
#[test]
fn a_watched_job_in_etcd_grows_onto_a_third_host_and_shrinks_to_one() {
    if !etcd::etcd_present("elastic_hosts_etcd") {
        return;
    }
    let Some(mut c) = cluster(3, "elastic_hosts_etcd") else {
        return;
    };
    let (server, tls) = c.start_etcd_tls(1);
    for (path, body) in etcd::auth_setup("/kf", "kf", "kf-password") {
        let v = c.etcd_call(1, &server.addr, Some(&tls), path, &body, None);
        assert!(v.get("error").is_none(), "{path}: {v}");
    }
    let pw = c.dir.join("etcd-pw");
    std::fs::write(&pw, "kf-password\n").unwrap();
    let mut env: Vec<(&str, &Path)> = tls.client_env().to_vec();
    env.extend([
        ("KUNGFU_ETCD_USER", Path::new("kf")),
        ("KUNGFU_ETCD_PASSWORD_FILE", &pw),
    ]);
    let store = format!("etcds://{}/kf", server.addr);
    watched_job(&mut c, &["--config-store", &store], &env);
    // the job's keys went with it
    let login = serde_json::json!({"name": "kf", "password": "kf-password"});
    let v = c.etcd_call(
        1,
        &server.addr,
        Some(&tls),
        "/v3/auth/authenticate",
        &login,
        None,
    );
    let token = v["token"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string();
    assert_eq!(
        c.etcd_keys(1, &server.addr, Some(&tls), Some(&token), "/kf/"),
        0
    );
    drop(server);
}

fn watched_job(c: &mut Cluster, extra: &[&str], env: &[(&str, &Path)]) {
    c.start_sshd(&[2, 3]);
    let ssh = c.ssh();
    let mut args = extra.to_vec();
    args.extend([
        "--timeout",
        "120s",
        "-w",
        "-np",
        "4",
        "-H",
        "198.18.0.1:2,198.18.0.2:2,198.18.0.3:2",
        "--ssh",
        &ssh,
        BENCH,
        "resize",
        "--sizes",
        "6,2",
        "-n",
        "4",
        "-b",
        "64K",
    ]);
    let mut cmd = c.on(1, RUN, &args);
    cmd.envs(env.iter().copied());
    let out = run_bounded(cmd, Duration::from_secs(150));
    let t = text(&out);
    if std::env::var_os("KUNGFU_TEST_SHOW").is_some() {
        eprintln!("{t}");
    }
    assert!(out.status.success(), "{t}");
    for (from, to, v) in [(4, 6, 1), (6, 2, 2)] {
        let line = format!("[0@198.18.0.1] # resize {from} -> {to} (version {v}): latency ");
        assert!(t.contains(&line), "no {line:?} in\n{t}");
    }
    // host 3's launcher started the two workers version 1 added there
    for rank in [4, 5] {
        let tag = format!("[{rank}@198.18.0.3] ");
        assert!(t.lines().any(|l| l.starts_with(&tag)), "no {tag} in\n{t}");
    }
    assert!(
        t.contains("kungfu-run on 198.18.0.3: cluster version 1: 6 workers"),
        "{t}"
    );
    // 6 -> 2 detaches the workers of hosts 2 and 3
    assert_eq!(t.matches("# detached at step").count(), 4, "{t}");
    assert!(
        t.contains("sizes [6, 2], model 65536 bytes, final size 2, version 2, model checked on every worker"),
        "{t}"
    );
    for h in 1..=3 {
        assert!(c.pids_of(h, "kungfu-bench").is_empty(), "host {h}:\n{t}");
        assert!(c.pids_of(h, "kungfu-run").is_empty(), "host {h}:\n{t}");
    }
}
