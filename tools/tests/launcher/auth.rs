//! The job secret: where kungfu-run takes it from, how workers get it,
//! and the credential its config server wants.

use super::*;

/// What the workers of a 2-rank job see of the secret, with kungfu-run's
/// environment holding `secret` (or not).
fn workers_secret(secret: Option<&str>) -> String {
    let mut cmd = kungfu_run(&[
        "-np",
        "2",
        "bash",
        "-c",
        "echo \"secret=$KUNGFU_JOB_SECRET\"",
    ]);
    match secret {
        Some(s) => cmd.env("KUNGFU_JOB_SECRET", s),
        None => cmd.env_remove("KUNGFU_JOB_SECRET"),
    };
    let out = run_bounded(cmd, Duration::from_secs(60));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    t
}

/// kungfu-run passes its own `KUNGFU_JOB_SECRET` on (so that launchers
/// started apart share one), or makes 32 random bytes per job; every
/// worker of a job gets the same.
#[test]
fn workers_get_the_launchers_secret_or_a_fresh_one() {
    let t = workers_secret(Some("shared by every launcher"));
    for r in 0..2 {
        assert!(
            t.contains(&format!("[{r}] secret=shared by every launcher")),
            "{t}"
        );
    }
    let secrets = |t: &str| -> Vec<String> {
        t.lines()
            .filter_map(|l| l.split_once("secret=").map(|(_, s)| s.to_string()))
            .collect()
    };
    let (a, b) = (workers_secret(None), workers_secret(None));
    let (a, b) = (secrets(&a), secrets(&b));
    assert_eq!(a.len(), 2);
    assert_eq!(a[0], a[1], "one secret per job");
    assert_eq!(a[0].len(), 64, "32 bytes in hex");
    assert!(a[0].bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a[0], b[0], "a fresh one per job");
}

/// A job with a secret runs its collectives over authenticated links
/// (TCP between the workers, and shared memory).
#[test]
fn a_job_with_a_secret_runs() {
    for transport in ["tcp", "shm"] {
        let mut cmd = kungfu_run(&[
            "-np",
            "2",
            "--transport",
            transport,
            BENCH,
            "allreduce",
            "-b",
            "1K",
            "-e",
            "4K",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        cmd.env("KUNGFU_JOB_SECRET", "a secret of this test");
        let out = run_bounded(cmd, Duration::from_secs(120));
        let t = text(&out);
        assert!(out.status.success(), "{transport}: {t}");
        assert!(t.contains("# Out of bounds values : 0 OK"), "{t}");
    }
}

/// `--secret-stdin` (what the launcher runs through ssh passes) takes the
/// secret from standard input, not from the command line.
#[test]
fn the_secret_can_come_on_standard_input() {
    let dir = TempDir::new("secret-stdin");
    let path = dir.0.join("secret");
    std::fs::write(&path, "from standard input\n").unwrap();
    let mut cmd = kungfu_run(&[
        "--secret-stdin",
        "-np",
        "1",
        "bash",
        "-c",
        "echo \"secret=$KUNGFU_JOB_SECRET\"",
    ]);
    cmd.stdin(std::fs::File::open(&path).unwrap());
    let out = run_bounded(cmd, Duration::from_secs(60));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] secret=from standard input"), "{t}");
}

/// The config server of `-w` listens on the loopback and refuses every
/// request, GET included, that is not signed with the job's secret: none
/// (401), an old bearer token (401); `kungfu-run --resize N
/// --config-server URL` signs with the secret of its environment, and is
/// refused with another secret (403) or none; `--config-token` is gone
/// and says what replaced it.
#[test]
fn the_config_server_wants_the_credential() {
    let script = r#"
a=${KUNGFU_CONFIG_SERVER#http://}; a=${a%%/*}
echo "server at ${a%:*}"
req() {
  exec 3<>/dev/tcp/${a%:*}/${a#*:}
  printf "$1 /cluster HTTP/1.1\r\n%bContent-Length: 6\r\n\r\nsize 1" "$2" >&3
  head -c 12 <&3; echo " ($1 ${3:-})"
  exec 3<&-
}
req PUT "" none
req PUT "Authorization: Bearer 00ff\r\n" bearer
req GET "" none
"$KFRUN" --resize 1 --config-server "$KUNGFU_CONFIG_SERVER" | head -1
KUNGFU_JOB_SECRET=another "$KFRUN" --resize 1 --config-server "$KUNGFU_CONFIG_SERVER" 2>&1 | grep -o '403 bad credential'
env -u KUNGFU_JOB_SECRET "$KFRUN" --resize 1 --config-server "$KUNGFU_CONFIG_SERVER" 2>&1 | grep -o 'KUNGFU_JOB_SECRET is not set'
"$KFRUN" --resize 0 --config-server "$KUNGFU_CONFIG_SERVER" 2>&1 | grep -o 'a number of at least 1'
"$KFRUN" --resize 1 2>&1 | grep -o 'needs --config-server URL'
"#;
    let mut cmd = kungfu_run(&[
        "-w",
        "-np",
        "1",
        "-x",
        &format!("KFRUN={RUN}"),
        "bash",
        "-c",
        script,
    ]);
    cmd.env("KUNGFU_JOB_SECRET", "the job's secret");
    let out = run_bounded(cmd, Duration::from_secs(60));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for line in [
        "[0] server at 127.0.0.1",
        "[0] HTTP/1.1 401 (PUT none)",
        "[0] HTTP/1.1 401 (PUT bearer)",
        "[0] HTTP/1.1 401 (GET none)",
        // one worker already: the same version
        "[0] version 0",
        "[0] 403 bad credential",
        "[0] KUNGFU_JOB_SECRET is not set",
        "[0] a number of at least 1",
        "[0] needs --config-server URL",
    ] {
        assert!(t.contains(line), "no {line:?} in\n{t}");
    }
    let mut gone = Command::new(RUN);
    gone.arg("--config-token");
    let out = run_bounded(gone, Duration::from_secs(10));
    assert!(!out.status.success());
    assert!(
        text(&out).contains("--resize N --config-server URL"),
        "{}",
        text(&out)
    );
}
