//! Concurrent jobs and the ports their workers listen on.

use super::*;

/// Many jobs started at once on one machine never share a port, and no
/// port is ever free between the launcher choosing it and the worker
/// listening on it (each worker checks its own at start, with
/// `--check-port`). All workers of every job are alive at the same time
/// (held with `--wait-for`) when their addresses are compared. The old
/// launcher drew a port, checked that it bound and released it: two
/// workers could draw the same one (`peer 2 ("127.0.0.1:17500") appears
/// twice`), and any process could take it before the worker bound it.
#[test]
fn concurrent_jobs_never_share_a_port() {
    const JOBS: usize = 12;
    const NP: usize = 4;
    let dir = TempDir::new("ports");
    let go = dir.0.join("go");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut guard = Guard(Vec::new());
    let mut errs = Vec::new();
    for j in 0..JOBS {
        let mut c = kungfu_run(&[
            "-np",
            "4",
            "--transport",
            "tcp",
            SELFTEST,
            "--steps",
            "2",
            "--size",
            "64",
            "--check-port",
            "--wait-for",
            go.to_str().unwrap(),
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn kungfu-run");
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        guard.0.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((j, l));
            }
        });
        errs.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut s);
            s
        }));
    }
    drop(tx);
    // every worker of every job connected and waiting, with its address
    let mut addrs: Vec<(usize, String)> = Vec::new();
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while addrs.len() < JOBS * NP && Instant::now() < deadline {
        let Ok((j, l)) = rx.recv_timeout(Duration::from_millis(200)) else {
            if guard
                .0
                .iter_mut()
                .any(|c| !matches!(c.try_wait(), Ok(None)))
            {
                break; // a job ended before all were up: its stderr says why
            }
            continue;
        };
        if let Some(a) = l.split("] address ").nth(1) {
            addrs.push((j, a.split(':').take(2).collect::<Vec<_>>().join(":")));
        }
        lines.push(format!("job {j}: {l}"));
    }
    let report = |guard: &mut Guard, errs: Vec<std::thread::JoinHandle<String>>| {
        drop(std::mem::take(&mut guard.0));
        errs.into_iter()
            .enumerate()
            .map(|(j, e)| format!("--- job {j} stderr\n{}", e.join().unwrap_or_default()))
            .collect::<String>()
    };
    if addrs.len() < JOBS * NP {
        let e = report(&mut guard, errs);
        panic!(
            "{} of {} workers came up:\n{}\n{e}",
            addrs.len(),
            JOBS * NP,
            lines.join("\n")
        );
    }
    let mut seen = std::collections::HashMap::new();
    for (j, a) in &addrs {
        if let Some(other) = seen.insert(a.clone(), *j) {
            let e = report(&mut guard, errs);
            panic!("{a} was given to a worker of job {other} and one of job {j}\n{e}");
        }
    }
    std::fs::write(&go, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut statuses = Vec::new();
    for c in &mut guard.0 {
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        statuses.push(st);
    }
    let e = report(&mut guard, errs);
    for (j, st) in statuses.iter().enumerate() {
        assert!(
            st.is_some_and(|s| s.success()),
            "job {j} ended with {st:?}\n{e}"
        );
    }
    assert!(
        !e.contains("appears twice") && !e.contains("cannot listen"),
        "{e}"
    );
}
