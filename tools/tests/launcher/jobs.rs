//! Jobs that run to the end: every strategy and op, signals, the shared
//! memory transport, two hosts, and workers started by torchrun's variables,
//! by mpirun or pinned to cores.

use super::*;

#[test]
fn every_strategy_and_size_is_correct() {
    for (np, transport) in (1..=4).flat_map(|np| [(np, "tcp"), (np, "auto")]) {
        for s in Strategy::ALL {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--transport",
                transport,
                "--strategy",
                s.name(),
                BENCH,
                "allreduce",
                "-b",
                "0",
                "-e",
                "4M",
                "-f",
                "32",
                "-n",
                "2",
                "-w",
                "1",
                "-c",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(150));
            let t = text(&out);
            assert!(out.status.success(), "np={np} {s} {transport}:\n{t}");
            assert!(
                t.contains("# Out of bounds values : 0 OK"),
                "np={np} {s} {transport}:\n{t}"
            );
            // every rank's peak resident set, the largest: a few MiB at least
            let rss: f64 = t
                .lines()
                .find_map(|l| l.split("# Peak RSS (largest rank): ").nth(1))
                .and_then(|v| v.trim_end_matches(" MiB").parse().ok())
                .unwrap_or_else(|| panic!("no peak RSS line:\n{t}"));
            assert!(rss > 1.0, "peak RSS {rss} MiB:\n{t}");
            // sizes 0 B .. 4 MiB all printed
            assert!(
                t.contains(&format!("{:>10} ", 4 << 20)),
                "np={np} {s}:\n{t}"
            );
        }
    }
}

#[test]
fn every_op_is_correct_under_the_launcher() {
    for op in [
        "broadcast",
        "allgather",
        "reduce-scatter",
        "reduce",
        "alltoall",
    ] {
        for (np, s) in [(3, "RING"), (4, "BINARY_TREE"), (2, "STAR")] {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--strategy",
                s,
                BENCH,
                op,
                "-b",
                "0",
                "-e",
                "1M",
                "-f",
                "64",
                "-n",
                "2",
                "-w",
                "1",
                "-r",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(150));
            let t = text(&out);
            assert!(out.status.success(), "{op} np={np} {s}:\n{t}");
            assert!(t.contains("# Out of bounds values : 0 OK"), "{op}:\n{t}");
        }
    }
}

/// Ctrl-C reaches every worker, and the job ends promptly.
#[test]
fn sigint_reaches_every_worker() {
    let mut c = kungfu_run(&["-np", "3", SELFTEST, "--steps", "100000000", "--size", "64"]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn kungfu-run");
    let stdout = child.stdout.take().expect("piped");
    let mut guard = Guard(vec![child]);
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut started = 0;
    while started < 3 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            started += usize::from(l.contains("step 0 ok"));
        }
    }
    assert_eq!(started, 3, "workers did not start");
    let pid = nix::unistd::Pid::from_raw(guard.0[0].id() as i32);
    let sent = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = loop {
        if let Some(st) = guard.0[0].try_wait().unwrap() {
            break st;
        }
        // (the job's own --timeout is 120 s)
        assert!(
            sent.elapsed() < Duration::from_secs(30),
            "kungfu-run ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    // the workers died of SIGINT themselves (not of the SIGKILL fallback)
    let mut err = String::new();
    std::io::Read::read_to_string(guard.0[0].stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("forwarding SIGINT"), "{err}");
    assert_eq!(
        err.matches("killed by signal 2 (SIGINT)").count(),
        3,
        "{err}"
    );
}

/// The shared-memory transport under the launcher: every op correct, and a
/// worker killed mid-allreduce is noticed through its pid (no socket tells).
#[test]
fn shared_memory_transport() {
    for (np, s) in [(2, "STAR"), (3, "RING"), (4, "AUTO")] {
        for op in ["allreduce", "allgather", "broadcast"] {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--transport",
                "shm",
                "--strategy",
                s,
                BENCH,
                op,
                "-b",
                "0",
                "-e",
                "4M",
                "-f",
                "64",
                "-n",
                "2",
                "-w",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(120));
            assert!(out.status.success(), "{op} np={np} {s}:\n{}", text(&out));
        }
    }
    let out = run_bounded(
        kungfu_run_failing(&[
            "-np",
            "3",
            "--transport",
            "shm",
            SELFTEST,
            "--steps",
            "100000",
            "--size",
            "4096",
            "--exit",
            "1:30:9",
        ]),
        Duration::from_secs(90),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert_noticed(&t);
    assert!(t.contains("kungfu-run: rank 1 exited with status 9"), "{t}");
    // a survivor saw the pid gone (the other may hear it from that one)
    assert!(
        t.lines().any(|l| !l.starts_with("[1]")
            && l.contains("rank 1 is lost: ")
            && (l.contains("sending process") || l.contains("receiving process"))),
        "{t}"
    );
    // auto: shared memory inside each "host", TCP between them
    for s in ["BINARY_TREE_STAR", "RING", "CLIQUE"] {
        let cmd = kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            "--transport",
            "auto",
            "--strategy",
            s,
            BENCH,
            "allreduce",
            "-b",
            "0",
            "-e",
            "4M",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        let out = run_bounded(cmd, Duration::from_secs(120));
        assert!(out.status.success(), "auto {s}:\n{}", text(&out));
    }
    // two hosts cannot share memory: a clear error, not a hang
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "--transport",
            "shm",
            SELFTEST,
        ]),
        Duration::from_secs(60),
    );
    assert!(
        text(&out).contains("shm needs every worker on one host"),
        "{}",
        text(&out)
    );
}

#[test]
fn two_hosts_on_loopback() {
    for s in ["BINARY_TREE_STAR", "MULTI_BINARY_TREE_STAR", "AUTO", "RING"] {
        let cmd = kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            "--strategy",
            s,
            BENCH,
            "allreduce",
            "-b",
            "4",
            "-e",
            "1M",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        let out = run_bounded(cmd, Duration::from_secs(150));
        assert!(out.status.success(), "{s}:\n{}", text(&out));
    }
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            SELFTEST,
            "--steps",
            "3",
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("rank 3/4 local 1/2"), "{t}");
    assert!(t.contains("rank 2/4 local 0/2"), "{t}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Workers started the way torchrun starts them: only RANK, WORLD_SIZE,
/// LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the runtime's rendezvous uses
/// MASTER_PORT + 1).
#[test]
fn torchrun_variables() {
    let n = 4;
    let port = free_port();
    let children: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(SELFTEST)
                .args(["--steps", "3"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string())
                .env("KUNGFU_CONNECT_TIMEOUT_MS", "30000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut guard = Guard(children);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut outs = Vec::new();
    for mut c in guard.0.drain(..) {
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "torchrun-style worker hung");
            std::thread::sleep(Duration::from_millis(50));
        }
        outs.push(c.wait_with_output().unwrap());
    }
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", text(o));
        let t = text(o);
        assert!(
            t.contains(&format!("rank {r}/4 local {r}/4 launcher Torchrun")),
            "{t}"
        );
        assert!(t.contains("done"), "{t}");
    }
}

/// The same job started by Open MPI's mpirun (Debian's openmpi-bin).
#[test]
fn mpirun_starts_a_job() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        if std::env::var_os("KUNGFU_SKIP_MPI").is_some() {
            eprintln!("mpirun not installed; skipped because KUNGFU_SKIP_MPI is set");
            return;
        }
        panic!(
            "mpirun not found: install openmpi-bin (scripts/test.sh does) or set KUNGFU_SKIP_MPI=1"
        );
    }
    let port = free_port();
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "4",
        "-x",
        "KUNGFU_RENDEZVOUS_PORT",
    ])
    .env("KUNGFU_RENDEZVOUS_PORT", port.to_string())
    .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    .args([SELFTEST, "--steps", "3"]);
    let out = run_bounded(c, Duration::from_secs(90));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for r in 0..4 {
        assert!(
            t.contains(&format!("rank {r}/4 local {r}/4 launcher OpenMpi")),
            "{t}"
        );
    }
    assert_eq!(t.matches("done").count(), 4, "{t}");
}

/// `--bind-to core` pins each worker to one CPU (worker i to the i-th
/// allowed CPU, wrapping around); `--bind-to none` leaves the full set.
#[test]
fn workers_are_pinned_to_cores() {
    let script = "grep Cpus_allowed_list /proc/self/status";
    let out = run_bounded(
        kungfu_run(&["-np", "2", "--bind-to", "core", "sh", "-c", script]),
        Duration::from_secs(30),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let allowed = std::fs::read_to_string("/proc/self/status").unwrap();
    let mine = allowed
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list"))
        .unwrap()
        .to_string();
    for rank in 0..2 {
        let line = t
            .lines()
            .find(|l| l.starts_with(&format!("[{rank}] Cpus_allowed_list")))
            .unwrap_or_else(|| panic!("no line of rank {rank}: {t}"));
        let list = line.rsplit(['\t', ' ']).next().unwrap();
        assert!(
            list.parse::<usize>().is_ok(),
            "rank {rank} is not pinned to one CPU: {line} (ours: {mine})"
        );
    }
    let out = run_bounded(
        kungfu_run(&["-np", "1", "--bind-to", "none", "sh", "-c", script]),
        Duration::from_secs(30),
    );
    let t = text(&out);
    let want = mine.rsplit(['\t', ' ']).next().unwrap();
    assert!(t.contains(want), "unbound worker: {t} (ours: {mine})");
}

/// QUIC under the launcher: kungfu-run makes the job's CA and a
/// certificate per worker in a private directory (under the TMPDIR it is
/// given here) and removes it at the end; every op is correct. Then the
/// user's own files (`--quic-ca/--quic-cert/--quic-key`), and a worker
/// given a certificate of another CA, which is refused.
#[test]
fn quic_transport() {
    let tmp = std::env::temp_dir().join(format!("kf-quic-jobs-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (np, s, op) in [
        (2, "STAR", "allreduce"),
        (3, "RING", "allgather"),
        (4, "AUTO", "allreduce"),
    ] {
        let np_s = np.to_string();
        let mut cmd = kungfu_run(&[
            "-np",
            &np_s,
            "--transport",
            "quic",
            "--strategy",
            s,
            BENCH,
            op,
            "-b",
            "0",
            "-e",
            "4M",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "1",
        ]);
        cmd.env("TMPDIR", &tmp).env_remove("XDG_RUNTIME_DIR");
        let out = run_bounded(cmd, Duration::from_secs(120));
        let t = text(&out);
        assert!(out.status.success(), "{op} np={np} {s}:\n{t}");
        assert!(t.contains("transport quic"), "{t}");
        assert!(t.contains("# Out of bounds values : 0 OK"), "{t}");
        let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
        assert!(left.is_empty(), "certificates left behind: {left:?}");
    }

    // the user's own certificates: one CA, one certificate for all
    let ca = kungfu_transport::quic::JobCa::new().unwrap();
    let (cert, key) = ca.issue_pem("any").unwrap();
    let files = [
        ("ca.pem", ca.cert_pem().to_string()),
        ("w.pem", cert),
        ("w.key", key),
    ];
    for (name, text) in &files {
        std::fs::write(tmp.join(name), text).unwrap();
    }
    let path = |n: &str| tmp.join(n).display().to_string();
    let (ca_p, cert_p, key_p) = (path("ca.pem"), path("w.pem"), path("w.key"));
    let user = |extra: &[&str]| {
        let mut args = vec!["-np", "2", "--transport", "quic", "--quic-ca", &ca_p];
        args.extend(["--quic-cert", &cert_p, "--quic-key", &key_p]);
        args.extend_from_slice(extra);
        args.extend([
            BENCH,
            "allreduce",
            "-b",
            "4",
            "-e",
            "64K",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        run_bounded(kungfu_run(&args), Duration::from_secs(120))
    };
    let out = user(&[]);
    assert!(out.status.success(), "{}", text(&out));
    // a CA the workers' certificate is not from: refused, and said so
    let other = kungfu_transport::quic::JobCa::new().unwrap();
    std::fs::write(tmp.join("ca.pem"), other.cert_pem()).unwrap();
    let out = user(&["-x", "KUNGFU_CONNECT_TIMEOUT_MS=3000"]);
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("refused a QUIC connection") || t.contains("TLS"),
        "{t}"
    );
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// libfabric under the launcher, over each provider that works without
/// hardware: every op checked, the provider in the header.
#[test]
fn fabric_transport() {
    for provider in ["tcp;ofi_rxm", "shm"] {
        for (np, s, op) in [
            (2, "STAR", "allreduce"),
            (3, "RING", "allgather"),
            (4, "AUTO", "broadcast"),
        ] {
            let np_s = np.to_string();
            let prov = format!("KUNGFU_FABRIC_PROVIDER={provider}");
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--transport",
                "fabric",
                "-x",
                &prov,
                "--strategy",
                s,
                BENCH,
                op,
                "-b",
                "0",
                "-e",
                "4M",
                "-f",
                "64",
                "-n",
                "2",
                "-w",
                "1",
                "-c",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(120));
            let t = text(&out);
            assert!(out.status.success(), "{provider} {op} np={np} {s}:\n{t}");
            assert!(t.contains(&format!("transport fabric ({provider})")), "{t}");
            assert!(t.contains("# Out of bounds values : 0 OK"), "{t}");
        }
    }
    // a provider that is not there: a clear error naming it
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "2",
            "--transport",
            "fabric",
            "-x",
            "KUNGFU_FABRIC_PROVIDER=verbs;ofi_rxm",
            BENCH,
            "allreduce",
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains("transport fabric (verbs;ofi_rxm) is not available here"),
        "{t}"
    );
}

/// `auto` across hosts (two loopback addresses as two hosts): TCP between
/// them (shared memory inside each) while no worker has RDMA, which rank 0
/// logs with the reason; libfabric once every worker has the provider
/// `KUNGFU_FABRIC_PROVIDER` names (here tcp;ofi_rxm, as efa or
/// verbs;ofi_rxm would be found on a cluster).
#[test]
fn auto_across_hosts_moves_to_the_fabric_only_where_every_worker_has_it() {
    let job = |extra: &[&str]| {
        let mut args = vec!["-np", "4", "-H", "127.0.0.1:2,127.0.0.2:2"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[
            "--transport",
            "auto",
            BENCH,
            "allreduce",
            "-b",
            "0",
            "-e",
            "1M",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
            "-c",
            "1",
        ]);
        let out = run_bounded(kungfu_run(&args), Duration::from_secs(120));
        let t = text(&out);
        assert!(out.status.success(), "{extra:?}:\n{t}");
        assert!(t.contains("# Out of bounds values : 0 OK"), "{t}");
        t
    };
    // this machine has no RDMA device
    let t = job(&[]);
    assert!(t.contains("transport auto (shm+tcp)"), "{t}");
    assert!(
        t.contains("kungfu: auto: across hosts over shm+tcp (no RDMA: ")
            && t.contains("efa")
            && t.contains("verbs;ofi_rxm"),
        "{t}"
    );
    let t = job(&["-x", "KUNGFU_FABRIC_PROVIDER=tcp;ofi_rxm"]);
    assert!(t.contains("transport auto (fabric (tcp;ofi_rxm))"), "{t}");
    assert!(
        t.contains("kungfu: auto: across hosts over fabric (tcp;ofi_rxm)\n"),
        "{t}"
    );
}

/// The transport swapped while a training loop runs (kungfu-selftest checks
/// every step exactly): tcp -> quic -> fabric -> tcp, through the runtime
/// (each worker rebinds its port, QUIC with the job's certificates). A
/// transport that is not built in fails on every worker, saying so.
#[test]
fn transport_swap_in_a_training_loop() {
    let cmd = kungfu_run(&[
        "-np",
        "4",
        "--transport",
        "tcp",
        "-x",
        "KUNGFU_FABRIC_PROVIDER=tcp;ofi_rxm",
        SELFTEST,
        "--steps",
        "16",
        "--size",
        "100003",
        "--swap-transports",
        "quic,fabric,tcp",
    ]);
    let out = run_bounded(cmd, Duration::from_secs(120));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for want in [
        "swapped to quic (epoch 1)",
        "swapped to fabric (tcp;ofi_rxm) (epoch 2)",
        "swapped to tcp (epoch 3)",
    ] {
        assert_eq!(t.matches(want).count(), 4, "{want}:\n{t}");
    }
    assert_eq!(t.matches("] done").count(), 4, "{t}");

    let cmd = kungfu_run(&[
        "-np",
        "2",
        SELFTEST,
        "--steps",
        "4",
        "--swap-transports",
        "verbs",
    ]);
    let out = run_bounded(cmd, Duration::from_secs(60));
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert_eq!(
        t.matches("transport verbs is not available").count(),
        2,
        "{t}"
    );
}

/// Workers that share a host get OMP_NUM_THREADS=1 when nobody chose a
/// value, and the launcher says so; a value given (in its environment or
/// with -x) is kept, and a lone worker is left alone.
#[test]
fn workers_that_share_a_host_get_one_omp_thread_unless_told() {
    let show = "echo omp=${OMP_NUM_THREADS:-unset}";
    // (-np, OMP_NUM_THREADS of the launcher, more options, what each
    // worker prints, whether the launcher says it set it)
    type Case<'a> = (&'a str, Option<&'a str>, &'a [&'a str], &'a str, bool);
    let cases: [Case; 4] = [
        ("2", None, &[], "omp=1", true),
        ("1", None, &[], "omp=unset", false),
        ("2", Some("3"), &[], "omp=3", false),
        ("2", None, &["-x", "OMP_NUM_THREADS=2"], "omp=2", false),
    ];
    for (np, inherited, extra, want, notice) in cases {
        let mut args = vec!["-np", np];
        args.extend_from_slice(extra);
        args.extend(["sh", "-c", show]);
        let mut cmd = kungfu_run(&args);
        match inherited {
            Some(v) => cmd.env("OMP_NUM_THREADS", v),
            None => cmd.env_remove("OMP_NUM_THREADS"),
        };
        let out = run_bounded(cmd, Duration::from_secs(60));
        let t = text(&out);
        assert!(out.status.success(), "{t}");
        let got = t.lines().filter(|l| l.ends_with(want)).count();
        assert_eq!(
            got,
            np.parse::<usize>().unwrap(),
            "np {np}, want {want}:\n{t}"
        );
        assert_eq!(
            t.contains("OMP_NUM_THREADS=1 for every worker"),
            notice,
            "{t}"
        );
    }
}

/// Every worker is told its launcher's pid (`KUNGFU_LAUNCHER_PID`): the
/// process it names as its ptracer under Yama's ptrace_scope 1, which
/// must be an ancestor of every worker of the host. Here each is the
/// launcher's child, so the value is the worker's parent.
#[test]
fn workers_are_told_their_launchers_pid() {
    let show = "echo launcher=${KUNGFU_LAUNCHER_PID:-unset} parent=$PPID";
    let out = run_bounded(
        kungfu_run(&["-np", "3", "sh", "-c", show]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let pids: Vec<(&str, &str)> = t
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("launcher=")?;
            rest.split_once(" parent=")
        })
        .collect();
    assert_eq!(pids.len(), 3, "{t}");
    for (launcher, parent) in &pids {
        assert!(launcher.parse::<u32>().is_ok_and(|p| p > 1), "{t}");
        assert_eq!(launcher, parent, "{t}");
        assert_eq!(launcher, &pids[0].0, "{t}");
    }
}
