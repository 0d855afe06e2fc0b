//! The cluster config and the membership of an elastic job in a real etcd
//! (`kungfu-run --config-store etcd://...`, `kungfu::store`), on loopback:
//! linearisable versions, watches, leases that expire, and the elastic
//! test of `tools/tests/launcher/elastic.rs` run against it.

use std::collections::BTreeSet;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kungfu::elastic::ClusterConfig;
use kungfu::store::{ConfigStore, Created, Placement, PutError, MEMBER_TTL_S};
use tokio::time::Instant;

#[path = "common/bounded.rs"]
mod bounded;
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/resize.rs"]
mod resize;
use bounded::run_bounded;
use etcd::{auth_setup, etcd_present, EtcdServer, TlsFiles};
use resize::assert_resized_2_4_3_1_3;

const RUN: &str = env!("CARGO_BIN_EXE_kungfu-run");
const BENCH: &str = env!("CARGO_BIN_EXE_kungfu-bench");
const SELFTEST: &str = env!("CARGO_BIN_EXE_kungfu-selftest");

fn text(out: &std::process::Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Two ports that were free on the loopback a moment ago.
fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

/// An etcd on the loopback, with its data in a scratch directory.
fn etcd_here(test: &str) -> Option<EtcdServer> {
    if !etcd_present(test) {
        return None;
    }
    let (client, peer) = free_ports();
    let dir = std::env::temp_dir().join(format!("kungfu-etcd-{}-{test}", std::process::id()));
    Some(EtcdServer::start(
        Command::new("etcd"),
        "127.0.0.1",
        client,
        peer,
        dir,
    ))
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn config(version: u32, peers: &str) -> ClusterConfig {
    ClusterConfig {
        version,
        peers: peers.parse().unwrap(),
    }
}

fn etcd_store(s: &ConfigStore) -> &kungfu::store::EtcdStore {
    match s {
        ConfigStore::Etcd(e) => e,
        ConfigStore::Http(_) => panic!("not etcd"),
    }
}

#[test]
fn versions_are_linearisable_watched_and_bounded_by_the_rules() {
    let Some(mut server) = etcd_here("versions") else {
        return;
    };
    let url = format!("etcd://{}/t/1", server.addr);
    rt().block_on(async {
        let store = ConfigStore::open(&url, None).unwrap();
        let e = etcd_store(&store);
        let rules = Placement {
            max_size: 4,
            hosts: vec![("10.0.0.1".into(), 2), ("10.0.0.2".into(), 2)],
            bounded: true,
            port_base: 100,
        };
        let v0 = config(0, "10.0.0.1:100,10.0.0.1:101");
        assert_eq!(e.create(&v0, &rules, soon()).await, Ok(Created::New));
        // another launcher of the same job; then another job's
        assert_eq!(e.create(&v0, &rules, soon()).await, Ok(Created::Existing));
        let other = config(0, "10.0.0.2:100");
        let err = e.create(&other, &rules, soon()).await.unwrap_err();
        assert!(err.contains("another job"), "{err}");
        assert_eq!(store.get(soon()).await.unwrap(), v0);

        let mut watch = store.follow(0, Duration::from_millis(100), Duration::from_secs(3));
        // size N places new workers as the rules say
        let v1 = store.put("size 4", soon()).await.unwrap();
        assert_eq!(
            v1,
            config(1, "10.0.0.1:100,10.0.0.1:101,10.0.0.2:100,10.0.0.2:101")
        );
        match store.put("size 5", soon()).await {
            Err(PutError::Failed(e)) => assert!(e.contains("1..=4"), "{e}"),
            other => panic!("{other:?}"),
        }
        let off = "version 2\npeers 10.0.0.9:1";
        match store.put(off, soon()).await {
            Err(PutError::Failed(e)) => assert!(e.contains("not on a host"), "{e}"),
            other => panic!("{other:?}"),
        }
        // a stale whole config is a conflict, the next one is taken
        match store.put("version 1\npeers 10.0.0.1:100", soon()).await {
            Err(PutError::Conflict(_)) => {}
            other => panic!("{other:?}"),
        }
        let v2 = store
            .put("version 2\npeers 10.0.0.1:100", soon())
            .await
            .unwrap();
        assert_eq!(v2, config(2, "10.0.0.1:100"));
        // a port once given is not given again
        let v3 = store.put("size 2", soon()).await.unwrap();
        assert_eq!(v3, config(3, "10.0.0.1:100,10.0.0.1:102"));

        // the size it has already: no new version
        assert_eq!(store.put("size 2", soon()).await.unwrap(), v3);

        // eight proposers of version 4 at once: exactly one wins
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let s = store.clone();
                tokio::spawn(async move {
                    let body = format!("version 4\npeers 10.0.0.2:{}", 200 + i);
                    s.put(&body, soon()).await
                })
            })
            .collect();
        let mut won = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(c) => won.push(c),
                Err(PutError::Conflict(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(won.len(), 1, "{won:?}");
        assert_eq!(store.get(soon()).await.unwrap(), won[0]);
        assert_eq!(
            store.get_version(2, soon()).await.unwrap(),
            Some(v2.clone())
        );
        assert_eq!(store.get_version(9, soon()).await.unwrap(), None);

        // the watch saw every version, in order
        let mut seen = Vec::new();
        while seen.len() < 4 {
            let c = tokio::time::timeout(Duration::from_secs(10), watch.recv())
                .await
                .expect("a version within 10 s")
                .expect("the watch goes on")
                .expect("no error");
            seen.push(c);
        }
        assert_eq!(seen, [v1, v2, v3, won[0].clone()]);

        // etcd gone: the watch says so once its give-up time is over
        server.kill();
        let t = Instant::now();
        let end = tokio::time::timeout(Duration::from_secs(30), watch.recv())
            .await
            .expect("the watch ends within 30 s");
        match end {
            Some(Err(e)) => assert!(e.contains("unreachable"), "{e}"),
            other => panic!("{other:?}"),
        }
        // (counted from its last news, a little before the kill)
        assert!(t.elapsed() >= Duration::from_secs(2), "{:?}", t.elapsed());
    });
}

#[test]
fn a_members_key_lives_with_its_lease() {
    let Some(server) = etcd_here("members") else {
        return;
    };
    let url = format!("etcd://{}/t/2", server.addr);
    rt().block_on(async {
        let store = ConfigStore::open(&url, None).unwrap();
        let e = etcd_store(&store);
        let a = e.register("10.0.0.1:100", "rank 0", soon()).await.unwrap();
        let b = e.register("10.0.0.1:101", "rank 1", soon()).await.unwrap();
        assert_eq!(
            e.members(soon()).await.unwrap(),
            ["10.0.0.1:100", "10.0.0.1:101"]
        );
        // renewed: still there after two lease times
        tokio::time::sleep(Duration::from_secs(2 * MEMBER_TTL_S as u64)).await;
        assert_eq!(e.members(soon()).await.unwrap().len(), 2);
        // leaving removes the key at once
        b.leave(soon()).await;
        assert_eq!(e.members(soon()).await.unwrap(), ["10.0.0.1:100"]);
        // one no longer renewed (its worker died) expires within the TTL
        drop(a);
        let t = Instant::now();
        while !e.members(soon()).await.unwrap().is_empty() {
            assert!(
                t.elapsed() < Duration::from_secs(MEMBER_TTL_S as u64 + 5),
                "the key outlived its lease"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
}

/// A port `p` such that `p..p + n` are free on the loopback now (below
/// the kernel's ephemeral range, where it does not pick).
fn free_port_range(n: u16) -> u16 {
    // apart for each test of this process, and for each process
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let k = NEXT.fetch_add(1, Ordering::Relaxed);
    let start = (std::process::id() % 600) as u16 * 20 + k * 3001;
    (0..100)
        .map(|i| (start + i * 97) % 12000 + 20000)
        .find(|&p| (p..p + n).all(|q| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok()))
        .expect("a free port range")
}

/// The elastic launcher test against etcd: 2 -> 4 -> 3 -> 1 -> 3 with the
/// model checked on every worker; every worker holds a member key while
/// it runs, and the job's keys are gone when it is over.
#[test]
fn an_elastic_job_in_etcd_resizes_and_keeps_the_model() {
    let Some(server) = etcd_here("elastic") else {
        return;
    };
    let base = free_port_range(8);
    let job = format!("etcd://{}/ci/c0ffee", server.addr);
    // the revision before the job: etcd's history from it holds every
    // member key put while the job ran (polling could miss a short-lived
    // one)
    let etcd = kungfu::etcd::Etcd::new(server.addr.as_str());
    let members = "/ci/c0ffee/members/";
    let (_, start) = rt().block_on(etcd.range(members, true, soon())).unwrap();
    let mut cmd = Command::new(RUN);
    cmd.args(["--timeout", "120s", "-w", "-np", "2"])
        .args(["--config-store", &format!("etcd://{}/ci", server.addr)])
        .args(["--cluster-id", "c0ffee", "--port-base", &base.to_string()])
        .args([
            BENCH, "resize", "--sizes", "4,3,1,3", "-n", "4", "-b", "64K",
        ]);
    let out = run_bounded(cmd, Duration::from_secs(150));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_resized_2_4_3_1_3(&t);
    // the ports came from --port-base: 2 first, 2 more at 4, 2 more at 3;
    // every one of the six workers held its key (one worker's key alone
    // would not do: that was the bug of 9d0142c)
    let seen: BTreeSet<String> = rt().block_on(async {
        let mut w = etcd.watch(members, start + 1, soon()).await.unwrap();
        let mut seen = BTreeSet::new();
        let quiet = || tokio::time::Instant::now() + Duration::from_secs(1);
        while let Some(kvs) = w.next(quiet()).await.unwrap() {
            for kv in kvs.into_iter().filter(|kv| !kv.deleted) {
                seen.insert(kv.key.strip_prefix(members).unwrap().to_string());
            }
        }
        seen
    });
    let ports: BTreeSet<String> = (base..base + 6).map(|p| format!("127.0.0.1:{p}")).collect();
    assert_eq!(
        seen, ports,
        "the member keys seen, against the workers\n{t}"
    );
    // nothing of the job is left in etcd
    rt().block_on(async {
        let store = ConfigStore::open(&job, None).unwrap();
        let err = store.get(soon()).await.unwrap_err();
        assert!(err.contains("no config"), "{err}");
        assert!(etcd_store(&store).members(soon()).await.unwrap().is_empty());
    });
}

/// A cluster id whose keys exist names another job: refused, with the way
/// out.
#[test]
fn a_cluster_id_in_use_is_refused() {
    let Some(server) = etcd_here("in_use") else {
        return;
    };
    let store = format!("etcd://{}/ci", server.addr);
    rt().block_on(async {
        let s = ConfigStore::open(&format!("{store}/beef"), None).unwrap();
        let rules = Placement {
            max_size: 1,
            hosts: vec![("127.0.0.1".into(), 1)],
            bounded: false,
            port_base: 1,
        };
        let c = config(0, "127.0.0.1:1");
        assert_eq!(
            etcd_store(&s).create(&c, &rules, soon()).await,
            Ok(Created::New)
        );
    });
    let mut cmd = Command::new(RUN);
    cmd.args([
        "--timeout",
        "30s",
        "-w",
        "-np",
        "1",
        "--config-store",
        &store,
    ])
    .args(["--cluster-id", "beef", "true"]);
    let out = run_bounded(cmd, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("keys of cluster id beef"), "{err}");
    assert!(err.contains("holds another job's config"), "{err}");
    // and the other job's keys are left as they were
    rt().block_on(async {
        let s = ConfigStore::open(&format!("{store}/beef"), None).unwrap();
        assert_eq!(s.get(soon()).await.unwrap(), config(0, "127.0.0.1:1"));
    });
}

/// `--on-failure replace` against etcd: a worker exits at step 20, the
/// survivors recover (their proposals meet in one transaction), the
/// launcher asks for the full size again and the new worker joins.
#[test]
fn replace_in_etcd_a_new_worker_joins_and_the_job_ends_at_full_size() {
    let Some(server) = etcd_here("replace") else {
        return;
    };
    let base = free_port_range(8);
    let mut cmd = Command::new(RUN);
    cmd.args(["--timeout", "100s", "--grace", "30s", "-np", "3"])
        .args(["--on-failure", "replace", "--port-base", &base.to_string()])
        .args(["--config-store", &format!("etcd://{}", server.addr)])
        .args([
            SELFTEST, "--steps", "60", "--size", "1024", "--exit", "1:20:3",
        ])
        .args(["--recover", "--follow-config"])
        .env("KUNGFU_OP_TIMEOUT_MS", "600000");
    let out = run_bounded(cmd, Duration::from_secs(120));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for line in [
        "kungfu-run: rank 1 exited with status 3; the others go on without it",
        "kungfu-run: cluster version 1: 2 workers",
        "kungfu-run: cluster version 2: 3 workers",
        "joined at step 20 as rank 2/3",
    ] {
        assert!(t.contains(line), "no {line:?} in\n{t}");
    }
    assert_eq!(t.matches("] done").count(), 3, "{t}");
}

/// What `--config-store` goes with, and what elastic per-node mode needs,
/// is said at once (no etcd needed).
#[test]
fn misuses_of_the_config_store_are_refused_by_name() {
    let secret = "00112233445566778899aabbccddeeff";
    for (args, want) in [
        (
            vec!["-np", "1", "--config-store", "etcd://127.0.0.1:1", "true"],
            "give -w or --on-failure",
        ),
        (
            vec![
                "-w",
                "-np",
                "1",
                "--config-store",
                "http://127.0.0.1:1/x",
                "true",
            ],
            "expected etcd://HOST:PORT[/PREFIX]",
        ),
        (
            vec![
                "-w",
                "-np",
                "1",
                "--self",
                "127.0.0.1",
                "--cluster-id",
                "1",
                "true",
            ],
            "needs --config-store",
        ),
        (
            vec![
                "--on-failure",
                "shrink",
                "-np",
                "2",
                "--rdzv",
                "127.0.0.1:1",
                "true",
            ],
            "needs --config-store",
        ),
    ] {
        let mut cmd = Command::new(RUN);
        cmd.args(&args).env("KUNGFU_JOB_SECRET", secret);
        let out = run_bounded(cmd, Duration::from_secs(20));
        let t = text(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(t.contains(want), "{args:?}: {want:?} not in {t}");
    }
}

/// A per-node launcher that finds its job changed already starts the
/// workers of the current version (here: it came late, or again), and a
/// job whose launchers said `done` is over: its id is refused.
#[test]
fn a_late_per_node_launcher_joins_the_current_version_and_an_ended_job_is_refused() {
    let Some(server) = etcd_here("late") else {
        return;
    };
    let base = free_port_range(4);
    let me = format!("127.0.0.1:{base}");
    let store = format!("etcd://{}/ci", server.addr);
    let rules = Placement {
        max_size: 2,
        hosts: vec![("127.0.0.1".into(), 2)],
        bounded: true,
        port_base: base,
    };
    let launch = |id: &str| {
        let mut cmd = Command::new(RUN);
        cmd.args(["--timeout", "60s", "-w", "-np", "1", "-H", "127.0.0.1:2"])
            .args(["--self", "127.0.0.1", "--cluster-id", id])
            .args(["--port-base", &base.to_string(), "--config-store", &store])
            .args([
                "sh",
                "-c",
                "echo version $KUNGFU_CLUSTER_VERSION of $KUNGFU_SIZE",
            ])
            .env("KUNGFU_JOB_SECRET", "00112233445566778899aabbccddeeff");
        run_bounded(cmd, Duration::from_secs(90))
    };
    rt().block_on(async {
        let s = ConfigStore::open(&format!("{store}/a1"), None).unwrap();
        let e = etcd_store(&s);
        e.create(&config(0, &me), &rules, soon()).await.unwrap();
        s.put("size 2", soon()).await.unwrap();
    });
    let out = launch("a1");
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    // the two workers of version 1, not the one of version 0
    assert_eq!(t.matches("version 1 of 2").count(), 2, "{t}");
    assert!(!t.contains("version 0"), "{t}");
    // the only host is done: the job's keys are gone
    rt().block_on(async {
        let s = ConfigStore::open(&format!("{store}/a1"), None).unwrap();
        assert!(s.get(soon()).await.is_err());
    });

    rt().block_on(async {
        let s = ConfigStore::open(&format!("{store}/b2"), None).unwrap();
        let e = etcd_store(&s);
        e.create(&config(0, &me), &rules, soon()).await.unwrap();
        let k = e
            .hold_launcher("127.0.0.2", "run 0 0", soon())
            .await
            .unwrap();
        k.settle("done", soon()).await.unwrap();
    });
    let out = launch("b2");
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("by a job that is over"), "{t}");
}

/// An etcd with TLS (client certificates required) and users, as a
/// production one has: an elastic job reaches it through `etcds://` and
/// `KUNGFU_ETCD_*` and resizes with the model checked, its user's token
/// expiring every 2 s of idleness on the way; a wrong password, a missing
/// CA, no client certificate and TLS files with an etcd:// URL are refused
/// by name.
#[test]
fn an_etcd_with_tls_and_users_serves_an_elastic_job() {
    use kungfu::etcd::access::{ENV_CA, ENV_PASSWORD_FILE, ENV_USER};
    use kungfu::etcd::{Access, Etcd};
    if !etcd_present("tls") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("kungfu-etcd-tls-{}", std::process::id()));
    let files = TlsFiles::make(&dir.join("pki"), "127.0.0.1");
    let (port, peer) = free_ports();
    let mut cmd = Command::new("etcd");
    files.server_args(&mut cmd);
    cmd.args(["--auth-token-ttl", "2"]);
    let server = EtcdServer::start_scheme(cmd, "https", "127.0.0.1", port, peer, dir.join("etcd"));
    let pw = dir.join("pw");
    let bad_pw = dir.join("bad-pw");
    std::fs::write(&pw, "kf-password\n").unwrap();
    std::fs::write(&bad_pw, "not-it\n").unwrap();
    let tls_vars = files.client_env();
    let access = |extra: &[(&str, &std::path::Path)]| {
        let mut vars: Vec<(String, std::ffi::OsString)> = tls_vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_os_str().into()))
            .collect();
        vars.extend(
            extra
                .iter()
                .map(|(k, v)| (k.to_string(), v.as_os_str().into())),
        );
        Access::from_vars(true, move |k| {
            vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        })
        .unwrap()
    };
    rt().block_on(async {
        // users: root to administer, kf with read and write under /ci only
        let admin = Etcd::with_access(&server.addr, &access(&[])).unwrap();
        for (path, body) in auth_setup("/ci", "kf", "kf-password") {
            admin
                .call(path, &body, soon())
                .await
                .unwrap_or_else(|e| panic!("{path}: {e}"));
        }
        // nobody may read now; kf may, and again after its token expired
        let err = admin.range("/ci/x", false, soon()).await.unwrap_err();
        assert!(err.contains("permission denied"), "{err}");
        let u = std::path::Path::new("kf");
        let kf_access = access(&[(ENV_USER, u), (ENV_PASSWORD_FILE, &pw)]);
        let kf = Etcd::with_access(&server.addr, &kf_access).unwrap();
        kf.range("/ci/x", false, soon()).await.unwrap();
        // one login for every call and every client of one access
        let again = Etcd::with_access(&server.addr, &kf_access).unwrap();
        again.range("/ci/x", false, soon()).await.unwrap();
        kf.range("/ci/x", false, soon()).await.unwrap();
        assert_eq!(kf_access.logins(), 1);
        // the token expires after 2 s idle: etcd refuses it, and the
        // client logs in again and goes on
        tokio::time::sleep(Duration::from_millis(3500)).await;
        kf.range("/ci/x", false, soon()).await.unwrap();
        assert_eq!(kf_access.logins(), 2);
        let err = kf.range("/elsewhere", false, soon()).await.unwrap_err();
        assert!(err.contains("permission denied"), "{err}");
        // no client certificate: the handshake fails, named
        let mut vars = vec![(ENV_CA, files.ca.clone())];
        vars.push((ENV_USER, "kf".into()));
        vars.push((ENV_PASSWORD_FILE, pw.clone()));
        let no_cert = Access::from_vars(true, move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.clone().into())
        })
        .unwrap();
        let e = Etcd::with_access(&server.addr, &no_cert).unwrap();
        let err = e.range("/ci/x", false, soon()).await.unwrap_err();
        assert!(
            err.contains("authenticating as \"kf\"") && err.contains("fatal alert"),
            "{err}"
        );
    });

    // the elastic test through etcds://, as kf
    let base = free_port_range(8);
    let launch = |url: &str, password: &std::path::Path, limit: u64| {
        let mut cmd = Command::new(RUN);
        cmd.args(["--timeout", "120s", "-w", "-np", "2"])
            .args(["--config-store", url])
            .args(["--cluster-id", "5ec", "--port-base", &base.to_string()])
            .args([
                BENCH, "resize", "--sizes", "4,3,1,3", "-n", "4", "-b", "64K",
            ])
            .env(ENV_USER, "kf")
            .env(ENV_PASSWORD_FILE, password);
        for (k, v) in tls_vars {
            cmd.env(k, v);
        }
        run_bounded(cmd, Duration::from_secs(limit))
    };
    let url = format!("etcds://{}/ci", server.addr);
    let out = launch(&url, &pw, 150);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_resized_2_4_3_1_3(&t);

    // refused, by name and at once: a wrong password, TLS files with an
    // etcd:// URL (no TLS), an etcds:// URL without a CA
    let out = launch(&url, &bad_pw, 60);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("authenticating as \"kf\"") && t.contains("authentication failed"),
        "{t}"
    );
    let out = launch(&format!("etcd://{}/ci", server.addr), &pw, 60);
    let t = text(&out);
    assert!(!out.status.success() && t.contains("etcds://"), "{t}");
    let mut cmd = Command::new(RUN);
    cmd.args(["-w", "-np", "1", "--config-store", &url, "true"])
        .env_remove(ENV_CA);
    let out = run_bounded(cmd, Duration::from_secs(30));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains(ENV_CA), "{t}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A store over a three-member etcd cluster (`etcd://A,B,C/PREFIX`) goes
/// on when its leader dies: calls pass over a member that cannot be
/// reached, and over one without a leader while the others elect one (a change the leader's death cut short is read again
/// and found made or made again); when two of three are gone the store
/// says so in time; the elastic test runs with the first member dead
/// from its start.
#[test]
fn an_etcd_cluster_serves_the_job_with_a_member_dead() {
    if !etcd_present("members") {
        return;
    }
    let ports = || {
        // six ports free at once
        let held: Vec<std::net::TcpListener> = (0..6)
            .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let p: Vec<u16> = held
            .iter()
            .map(|l| l.local_addr().unwrap().port())
            .collect();
        [(p[0], p[1]), (p[2], p[3]), (p[4], p[5])]
    };
    let dir = std::env::temp_dir().join(format!("kungfu-etcd-members-{}", std::process::id()));
    let mut members = EtcdServer::start_cluster(&ports(), dir.clone());
    let all: Vec<String> = members.iter().map(|m| m.addr.clone()).collect();
    let all = all.join(",");
    rt().block_on(async {
        let store = ConfigStore::open(&format!("etcd://{all}/t/1"), None).unwrap();
        let rules = Placement {
            max_size: 4,
            hosts: vec![("10.0.0.1".into(), 4)],
            bounded: true,
            port_base: 100,
        };
        let v0 = config(0, "10.0.0.1:100");
        let e = etcd_store(&store);
        assert_eq!(e.create(&v0, &rules, soon()).await, Ok(Created::New));
        // the leader dies: the store's member (the first) if it led, else
        // one the store's member then waits for a new leader without
        let mut leader = None;
        for (i, m) in members.iter().enumerate() {
            let s = kungfu::etcd::Etcd::new(m.addr.as_str())
                .call("/v3/maintenance/status", &serde_json::json!({}), soon())
                .await
                .unwrap();
            if s["leader"] == s["header"]["member_id"] {
                leader = Some(i);
            }
        }
        let leader = leader.expect("a leader");
        members[leader].kill();
        let v1 = store.put("size 2", soon()).await.unwrap();
        assert_eq!(v1, config(1, "10.0.0.1:100,10.0.0.1:101"));
        assert_eq!(store.get(soon()).await.unwrap(), v1);
        // and another: two of three are gone, no quorum; once the last
        // sees no leader (past its election timeout) it refuses at once,
        // as asked, and the store says so within its deadline
        members[(leader + 1) % 3].kill();
        // (raft draws the timeout from 1 to 2 times the configured 2 s; a
        // busy machine notices later: each call fails within its deadline,
        // and within 20 s one says why)
        std::thread::sleep(Duration::from_millis(4500));
        let until = Instant::now() + Duration::from_secs(20);
        let err = loop {
            let t = Instant::now();
            let err = store
                .get(Instant::now() + Duration::from_secs(3))
                .await
                .unwrap_err();
            assert!(t.elapsed() < Duration::from_secs(5), "{err}");
            if err.contains("no leader") || Instant::now() > until {
                break err;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        assert!(err.contains("no leader"), "{err}");
    });
    drop(members);

    // a fresh cluster, its first member dead before the job starts
    let dir2 = dir.join("again");
    let mut members = EtcdServer::start_cluster(&ports(), dir2);
    let all: Vec<String> = members.iter().map(|m| m.addr.clone()).collect();
    let all = all.join(",");
    members[0].kill();
    // the job starts once the other two have a leader (a write while they
    // elect one may time out, made or not: that is etcd's to say)
    rt().block_on(async {
        let etcd = kungfu::etcd::Etcd::new(all.as_str());
        let until = Instant::now() + Duration::from_secs(30);
        while let Err(e) = etcd.range("/probe", false, soon()).await {
            assert!(Instant::now() < until, "no leader in 30 s: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let base = free_port_range(8);
    let mut cmd = Command::new(RUN);
    cmd.args(["--timeout", "120s", "-w", "-np", "2"])
        .args(["--config-store", &format!("etcd://{all}/ci")])
        .args(["--cluster-id", "3e3", "--port-base", &base.to_string()])
        .args([
            BENCH, "resize", "--sizes", "4,3,1,3", "-n", "4", "-b", "64K",
        ]);
    let out = run_bounded(cmd, Duration::from_secs(150));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_resized_2_4_3_1_3(&t);
    drop(members);
    let _ = std::fs::remove_dir_all(&dir);
}
