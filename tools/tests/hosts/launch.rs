//! Launching one job on two hosts: ssh mode (started on one of them, which
//! must know itself by its interface address) and per-node mode (the same
//! command on each, with `--self`).

use super::*;

const HOSTS: &str = "198.18.0.1:2,198.18.0.2:2";
/// The job secret of the per-node tests (32 hex digits).
const SECRET: &str = "00112233445566778899aabbccddeeff";

/// kungfu-run in ssh mode on host 1, for the 2 x 2 job.
fn ssh_job(c: &Cluster, extra: &[&str], program: &[&str]) -> Command {
    let ssh = c.ssh();
    let mut args = vec!["--timeout", "90s", "-np", "4", "-H", HOSTS, "--ssh", &ssh];
    args.extend(extra);
    args.push("--");
    args.extend(program);
    c.on(1, RUN, &args)
}

#[test]
fn ssh_mode_runs_a_job_on_two_hosts_started_on_one_of_them() {
    let Some(mut c) = cluster(2, "ssh_mode") else {
        return;
    };
    c.start_sshd(&[2]);
    let out = run_bounded(
        ssh_job(&c, &[], &[SELFTEST, "--steps", "3"]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    // host 1 started its own workers (no ssh to itself), host 2's came
    // through ssh; every line says which host and rank it is from
    for (rank, host, local) in [(0, 1, 0), (1, 1, 1), (2, 2, 0), (3, 2, 1)] {
        let tag = format!("[{rank}@198.18.0.{host}] ");
        let me = format!("rank {rank}/4 local {local}/2");
        assert!(
            t.lines().any(|l| l.starts_with(&tag) && l.contains(&me)),
            "no line {tag}... {me}:\n{t}"
        );
    }
    assert!(!t.contains("Connection refused"), "{t}");
}

/// `KUNGFU_SECURE=1` across hosts: `auto` runs on QUIC, with no PKI of the
/// user's (each worker's certificate comes from the job's secret), and
/// every value is exact; `tcp`, whose frames carry no MAC, is refused at
/// start, saying why.
#[test]
fn secure_mode_runs_across_hosts_on_quic_and_refuses_tcp() {
    let Some(mut c) = cluster(2, "secure") else {
        return;
    };
    c.start_sshd(&[2]);
    let secure = ["-x", "KUNGFU_SECURE=1"];
    let out = run_bounded(
        ssh_job(&c, &secure, &[SELFTEST, "--steps", "20"]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("kungfu: auto: across hosts over quic (KUNGFU_SECURE=1)"),
        "{t}"
    );
    let tcp = [&secure[..], &["--transport", "tcp", "--grace", "5s"]].concat();
    let out = run_bounded(
        ssh_job(&c, &tcp, &[SELFTEST, "--steps", "20"]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("KUNGFU_SECURE=1: tcp's frames between hosts carry no MAC"),
        "{t}"
    );
}

#[test]
fn a_worker_failing_on_the_remote_host_stops_the_job_and_is_named() {
    let Some(mut c) = cluster(2, "remote_failure") else {
        return;
    };
    c.start_sshd(&[2]);
    let out = run_bounded(
        ssh_job(
            &c,
            &["--grace", "5s"],
            &[SELFTEST, "--steps", "50", "--exit", "3:2:7"],
        ),
        Duration::from_secs(120),
    );
    let t = text(&out);
    // The status is the first failure this launcher sees: rank 3's (7),
    // through ssh, or a survivor's here that noticed it first (1).
    assert!(matches!(out.status.code(), Some(7 | 1)), "{t}");
    assert!(
        t.contains("rank 3 on 198.18.0.2 exited with status 7"),
        "the failure is not named with its host and rank:\n{t}"
    );
    for h in [1, 2] {
        assert!(c.pids_of(h, "kungfu-selftest").is_empty(), "host {h}: {t}");
    }
}

#[test]
fn a_signal_to_the_launcher_reaches_the_workers_on_every_host() {
    let Some(mut c) = cluster(2, "signals") else {
        return;
    };
    c.start_sshd(&[2]);
    let mut cmd = ssh_job(&c, &[], &["sh", "-c", "echo up; exec sleep 300"]);
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut child);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut up = 0;
    while up < 4 {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(l) if l.ends_with("] up") => up += 1,
            Ok(_) => {}
            Err(_) => {
                let _ = child.kill();
                panic!("only {up} of 4 workers started");
            }
        }
    }
    // "up" comes before the shell execs sleep: wait (bounded) for both
    let until = Instant::now() + Duration::from_secs(10);
    while c.pids_of(2, "sleep").len() < 2 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(c.pids_of(2, "sleep").len(), 2);
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("kungfu-run did not exit within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
    assert_eq!(status.code(), Some(143), "{err}");
    assert!(
        err.contains("kungfu-run on 198.18.0.2: SIGTERM from the launcher"),
        "{err}"
    );
    // the remote workers got it (not left behind by a cut connection)
    let t0 = Instant::now();
    while !c.pids_of(2, "sleep").is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "workers left on host 2:\n{err}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(c.pids_of(1, "sleep").is_empty(), "{err}");
}

/// Runs `cmds` (host, command) at the same time, in the order given;
/// their outputs by host.
fn at_once(cmds: Vec<(usize, Command)>) -> Vec<(usize, Output)> {
    let runs: Vec<_> = cmds
        .into_iter()
        .map(|(host, cmd)| {
            let run = std::thread::spawn(move || run_bounded(cmd, Duration::from_secs(120)));
            std::thread::sleep(Duration::from_millis(200));
            (host, run)
        })
        .collect();
    runs.into_iter()
        .map(|(host, run)| (host, run.join().expect("a runner thread")))
        .collect()
}

/// Per-node mode: every host runs the same command with its own `--self`,
/// one `--cluster-id` and one secret.
#[test]
fn per_node_mode_runs_one_job_from_launchers_started_apart() {
    let Some(c) = cluster(2, "per_node") else {
        return;
    };
    let launch = |host: usize| {
        let me = Cluster::addr(host);
        let mut cmd = c.on(
            host,
            RUN,
            &[
                "--timeout",
                "90s",
                "-np",
                "4",
                "-H",
                HOSTS,
                "--self",
                &me,
                "--cluster-id",
                "c0ffee",
                SELFTEST,
                "--steps",
                "3",
            ],
        );
        cmd.env("KUNGFU_JOB_SECRET", SECRET);
        cmd
    };
    for (host, out) in at_once(vec![(1, launch(1)), (2, launch(2))]) {
        let t = text(&out);
        assert!(out.status.success(), "host {host}: {t}");
        let rank = 2 * (host - 1) + 1;
        assert!(
            t.contains(&format!("[{rank}@198.18.0.{host}] "))
                && t.contains(&format!("rank {rank}/4")),
            "host {host}: {t}"
        );
    }
    // without a cluster id, or without the secret, a clear error at once
    for (drop_arg, what) in [("--cluster-id", "--cluster-id"), ("", "KUNGFU_JOB_SECRET")] {
        let me = Cluster::addr(1);
        let mut args = vec!["-np", "4", "-H", HOSTS, "--self", &me];
        if drop_arg.is_empty() {
            args.extend(["--cluster-id", "c0ffee"]);
        }
        args.extend([SELFTEST, "--steps", "1"]);
        let mut cmd = c.on(1, RUN, &args);
        cmd.env_remove("KUNGFU_JOB_SECRET");
        if !drop_arg.is_empty() {
            cmd.env("KUNGFU_JOB_SECRET", SECRET);
        }
        let out = run_bounded(cmd, Duration::from_secs(20));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(what), "{}", text(&out));
    }
}

/// The rendezvous form: no host list; every node runs the same command,
/// host 1 serves the rendezvous, and the job is the 2 x 2 one.
#[test]
fn the_rendezvous_finds_the_hosts() {
    let Some(c) = cluster(2, "rdzv") else {
        return;
    };
    let launch = |host: usize, secret: &str, timeout: &str| {
        let mut cmd = c.on(
            host,
            RUN,
            &[
                "--timeout",
                "90s",
                "-np",
                "4",
                "--rdzv",
                "198.18.0.1:29400",
                "--slots",
                "2",
                "--rdzv-timeout",
                timeout,
                SELFTEST,
                "--steps",
                "3",
            ],
        );
        cmd.env("KUNGFU_JOB_SECRET", secret);
        cmd
    };
    // host 2 first: it waits for the rendezvous to come up
    let cmds = [2, 1].map(|h| (h, launch(h, SECRET, "60s")));
    for (host, out) in at_once(cmds.into()) {
        let t = text(&out);
        assert!(out.status.success(), "host {host}: {t}");
        assert!(
            t.contains("rendezvous at 198.18.0.1:29400: hosts 198.18.0.1:2,198.18.0.2:2"),
            "host {host}: {t}"
        );
        for rank in [2 * host - 2, 2 * host - 1] {
            let line = format!("[{rank}@198.18.0.{host}] ");
            assert!(
                t.contains(&line) && t.contains(&format!("rank {rank}/4")),
                "{t}"
            );
        }
    }
    // another secret: refused at once, by name; the rendezvous then ends
    // at its deadline, short of slots, and says so
    let wrong = launch(2, "ffeeddccbbaa99887766554433221100", "10s");
    let serve = launch(1, SECRET, "5s");
    let server = std::thread::spawn(move || run_bounded(serve, Duration::from_secs(60)));
    std::thread::sleep(Duration::from_millis(300));
    let out = run_bounded(wrong, Duration::from_secs(60));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("refused: bad credential"),
        "{}",
        text(&out)
    );
    let out = server.join().unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("2 of 4 slots joined"), "{}", text(&out));
}

/// Per-node mode, elastic, with the config in etcd (a pod per node on
/// Kubernetes): a launcher started apart on each host, an etcd on host 1.
/// Host 1's two workers grow to four, shrink to two and grow again: host
/// 2's launcher, which had none at first, waits, starts two, lets them go
/// and starts two new ones; both launchers end when the job does, and its
/// keys are gone.
#[test]
fn per_node_launchers_follow_an_elastic_job_in_etcd() {
    let args = ["-np", "2", "-H", HOSTS, "--cluster-id", "5eed"];
    per_node_in_etcd("per_node_etcd", &args, true, "4,2,4");
}

/// The same with the hosts found by a rendezvous (`--rdzv`, torchrun's
/// elastic form): 2 + 2 workers shrink to host 1's and grow back.
#[test]
fn rendezvous_launchers_follow_an_elastic_job_in_etcd() {
    let args = ["-np", "4", "--rdzv", "198.18.0.1:29400", "--slots", "2"];
    per_node_in_etcd("rdzv_etcd", &args, false, "2,4");
}

/// Runs `kungfu-bench resize --sizes sizes` on two hosts with per-node
/// launchers (`args`, and `--self HOST` each if `own_self`), in an etcd on
/// host 1, and checks every change on both hosts.
fn per_node_in_etcd(test: &str, args: &[&str], own_self: bool, sizes: &str) {
    if !etcd::etcd_present(test) {
        return;
    }
    let Some(c) = cluster(2, test) else {
        return;
    };
    let server = c.start_etcd(1);
    let store = format!("etcd://{}", server.addr);
    let bench = env!("CARGO_BIN_EXE_kungfu-bench");
    let launch = |host: usize| {
        let me = Cluster::addr(host);
        let mut all = vec!["--timeout", "90s", "-w", "--config-store", &store];
        all.extend_from_slice(args);
        if own_self {
            all.extend(["--self", &me]);
        }
        all.extend([bench, "resize", "--sizes", sizes, "-n", "4", "-b", "64K"]);
        let mut cmd = c.on(host, RUN, &all);
        cmd.env("KUNGFU_JOB_SECRET", SECRET);
        cmd
    };
    let outs = at_once(vec![(1, launch(1)), (2, launch(2))]);
    let t: Vec<String> = outs.iter().map(|(_, o)| text(o)).collect();
    for (host, out) in &outs {
        // both hosts' output: a worker that failed on one host shows on
        // the other as a peer that never connected
        assert!(
            out.status.success(),
            "host {host} failed\n== host 1:\n{}\n== host 2:\n{}",
            t[0],
            t[1]
        );
    }
    let sizes: Vec<usize> = sizes.split(',').map(|n| n.parse().unwrap()).collect();
    let start = if own_self { 2 } else { 4 };
    let mut from = start;
    for (i, &to) in sizes.iter().enumerate() {
        let v = i + 1;
        let line = format!("[0@198.18.0.1] # resize {from} -> {to} (version {v}): latency ");
        assert!(t[0].contains(&line), "no {line:?} in\n{}", t[0]);
        let line = format!("kungfu-run on 198.18.0.2: cluster version {v}: {to} workers");
        assert!(t[1].contains(&line), "no {line:?} on host 2:\n{}", t[1]);
        from = to;
    }
    // host 2's new workers joined: four checked the model at the end
    let summary = format!(
        "sizes {sizes:?}, model 65536 bytes, final size 4, version {}, model checked on every worker",
        sizes.len()
    );
    assert!(t[0].contains(&summary), "{}", t[0]);
    for rank in [2, 3] {
        let line = format!("[{rank}@198.18.0.2] # detached at step");
        assert!(t[1].contains(&line), "no {line:?} on host 2:\n{}", t[1]);
    }
    assert_eq!(c.etcd_keys(1, &server.addr, None, None, "/kungfu/"), 0);
}

/// Each host has a /dev/shm of its own, as real machines do, shared by
/// whatever runs on it.
#[test]
fn each_host_has_its_own_dev_shm() {
    let Some(c) = cluster(2, "own_shm") else {
        return;
    };
    let sh = |host: usize, script: &str| {
        let out = run_bounded(c.on(host, "sh", &["-c", script]), Duration::from_secs(20));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    sh(1, "echo here > /dev/shm/kungfu-own-shm-test");
    let probe = "cat /dev/shm/kungfu-own-shm-test 2>/dev/null || echo absent";
    assert_eq!(sh(1, probe), "here");
    assert_eq!(sh(2, probe), "absent");
    assert!(!std::path::Path::new("/dev/shm/kungfu-own-shm-test").exists());
}
