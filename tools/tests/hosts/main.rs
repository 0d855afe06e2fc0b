//! kungfu-run across "hosts" that are network namespaces of this machine
//! (`scripts/netns-cluster.sh`): host I at 198.18.0.I, each with its own
//! loopback and ports, joined by a bridge, with a real sshd in every host
//! that ssh mode reaches (Debian's openssh-server, a key made by the test).
//!
//! They need root and network namespaces. Where those are missing they
//! say so and pass, unless `KUNGFU_REQUIRE_NETNS=1` (which
//! `scripts/test.sh` sets, as CI runs as root) makes that a failure.
//! Every process is bounded: kungfu-run gets `--timeout`, each command a
//! deadline, and the cluster's drop kills whatever is left in its
//! namespaces before it removes them.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[path = "../common/bounded.rs"]
mod bounded;
use bounded::run_bounded;
#[path = "../common/etcd.rs"]
mod etcd;

mod elastic;
mod launch;
mod recover;

const RUN: &str = env!("CARGO_BIN_EXE_kungfu-run");
const SELFTEST: &str = env!("CARGO_BIN_EXE_kungfu-selftest");
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/netns-cluster.sh");
const SSHD: &str = "/usr/sbin/sshd";

/// Why this machine cannot run these tests, if it cannot.
fn unsupported() -> Option<String> {
    let uid = Command::new("id").arg("-u").output();
    if !uid.is_ok_and(|o| o.stdout.trim_ascii() == b"0") {
        return Some("not root".into());
    }
    let check = Command::new(SCRIPT).arg("check").output();
    match check {
        Ok(o) if o.status.success() => {}
        Ok(o) => return Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
        Err(e) => return Some(format!("{SCRIPT}: {e}")),
    }
    if !Path::new(SSHD).exists() {
        return Some(format!("no {SSHD} (apt-get install openssh-server)"));
    }
    None
}

/// A cluster of `n` hosts, or `None` (after saying why) where namespaces
/// cannot be made and `KUNGFU_REQUIRE_NETNS` does not ask for them.
fn cluster(n: usize, test: &str) -> Option<Cluster> {
    if let Some(why) = unsupported() {
        assert!(
            std::env::var("KUNGFU_REQUIRE_NETNS").as_deref() != Ok("1"),
            "{test}: KUNGFU_REQUIRE_NETNS=1 but: {why}"
        );
        eprintln!("{test}: skipped: {why}");
        return None;
    }
    Some(Cluster::up(n))
}

/// Network namespaces as hosts, with a scratch directory; all removed when
/// dropped.
struct Cluster {
    prefix: String,
    n: usize,
    dir: PathBuf,
    sshd: Vec<Child>,
}

impl Cluster {
    fn up(n: usize) -> Cluster {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let prefix = format!(
            "kft{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(format!("kungfu-{prefix}"));
        std::fs::create_dir_all(&dir).unwrap();
        let c = Cluster {
            prefix,
            n,
            dir,
            sshd: Vec::new(),
        };
        let out = Command::new(SCRIPT)
            .args(["up", &n.to_string(), &c.prefix])
            .output()
            .unwrap();
        assert!(out.status.success(), "netns-cluster up: {}", text(&out));
        c
    }

    fn ns(&self, host: usize) -> String {
        format!("{}-h{host}", self.prefix)
    }

    /// `198.18.0.I`
    fn addr(host: usize) -> String {
        format!("198.18.0.{host}")
    }

    /// `cmd args` on host `host` (1-based), through the script's `exec`:
    /// with the host's own /dev/shm.
    fn on(&self, host: usize, cmd: &str, args: &[&str]) -> Command {
        let mut c = Command::new(SCRIPT);
        c.args(["exec", &host.to_string(), cmd])
            .args(args)
            .env("KUNGFU_NETNS_PREFIX", &self.prefix);
        c
    }

    /// The ssh command (for `--ssh`) that reaches the hosts with the key
    /// `start_sshd` made, ignoring the user's own configuration.
    fn ssh(&self) -> String {
        format!(
            "ssh -F /dev/null -i {} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
             -o LogLevel=ERROR -o ConnectTimeout=10",
            self.dir.join("id").display()
        )
    }

    /// Starts an sshd on each of `hosts` that accepts the test's key, and
    /// waits until host 1 can log in to every one.
    fn start_sshd(&mut self, hosts: &[usize]) {
        let key = self.dir.join("id");
        let host_key = self.dir.join("host");
        for k in [&key, &host_key] {
            let out = Command::new("ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(k)
                .output()
                .unwrap();
            assert!(out.status.success(), "ssh-keygen: {}", text(&out));
        }
        // sshd's privilege separation directory, as the package makes it
        std::fs::create_dir_all("/run/sshd").unwrap();
        let config = self.dir.join("sshd_config");
        let mut f = std::fs::File::create(&config).unwrap();
        write!(
            f,
            "ListenAddress 0.0.0.0:22\nHostKey {}\nAuthorizedKeysFile {}.pub\n\
             PermitRootLogin prohibit-password\nPasswordAuthentication no\n\
             KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
             PidFile none\nPrintMotd no\n",
            host_key.display(),
            key.display()
        )
        .unwrap();
        for &h in hosts {
            let log = std::fs::File::create(self.dir.join(format!("sshd.{h}.log"))).unwrap();
            let child = self
                .on(h, SSHD, &["-D", "-e", "-f"])
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            self.sshd.push(child);
        }
        let ssh = self.ssh();
        let ssh: Vec<&str> = ssh.split(' ').collect();
        for &h in hosts {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let mut args = ssh[1..].to_vec();
                let target = Cluster::addr(h);
                args.extend(["-o", "BatchMode=yes", &target, "true"]);
                let out = run_bounded(self.on(1, "ssh", &args), Duration::from_secs(15));
                if out.status.success() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cannot ssh from host 1 to host {h}: {}\nsshd log: {}",
                    text(&out),
                    std::fs::read_to_string(self.dir.join(format!("sshd.{h}.log")))
                        .unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }

    /// Starts an etcd on host `host`, at its address, port 2379.
    fn start_etcd(&self, host: usize) -> etcd::EtcdServer {
        let dir = self.dir.join(format!("etcd{host}"));
        etcd::EtcdServer::start(
            self.on(host, "etcd", &[]),
            &Cluster::addr(host),
            2379,
            2380,
            dir,
        )
    }

    /// Starts an etcd on host `host` with TLS (client certificates
    /// required; files made in the cluster's directory), at its address,
    /// port 2379.
    fn start_etcd_tls(&self, host: usize) -> (etcd::EtcdServer, etcd::TlsFiles) {
        let files = etcd::TlsFiles::make(&self.dir.join("etcd-pki"), &Cluster::addr(host));
        let mut cmd = self.on(host, "etcd", &[]);
        files.server_args(&mut cmd);
        let dir = self.dir.join(format!("etcd{host}"));
        let server =
            etcd::EtcdServer::start_scheme(cmd, "https", &Cluster::addr(host), 2379, 2380, dir);
        (server, files)
    }

    /// One call of the JSON gateway of the etcd at `addr`, made from host
    /// `host` (an etcd inside the cluster is not reachable from outside
    /// it) with curl, over TLS with `tls`'s client files, and with etcd's
    /// auth `token`: the reply.
    fn etcd_call(
        &self,
        host: usize,
        addr: &str,
        tls: Option<&etcd::TlsFiles>,
        path: &str,
        body: &serde_json::Value,
        token: Option<&str>,
    ) -> serde_json::Value {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let url = format!("{scheme}://{addr}{path}");
        let body = body.to_string();
        let mut args = vec!["-sS", "--max-time", "15", "-X", "POST", "-d", &body];
        let files: Vec<String>;
        if let Some(t) = tls {
            files = [&t.ca, &t.client, &t.client_key]
                .map(|p| p.display().to_string())
                .to_vec();
            args.extend([
                "--cacert", &files[0], "--cert", &files[1], "--key", &files[2],
            ]);
        }
        let header = token.map(|t| format!("Authorization: {t}"));
        if let Some(h) = &header {
            args.extend(["-H", h]);
        }
        args.push(&url);
        let out = run_bounded(self.on(host, "curl", &args), Duration::from_secs(20));
        let reply = String::from_utf8_lossy(&out.stdout);
        serde_json::from_str(&reply)
            .unwrap_or_else(|e| panic!("{path}: {e}: {reply}\n{}", text(&out)))
    }

    /// How many keys start with `prefix` in the etcd at `addr` (see
    /// [`Cluster::etcd_call`]).
    fn etcd_keys(
        &self,
        host: usize,
        addr: &str,
        tls: Option<&etcd::TlsFiles>,
        token: Option<&str>,
        prefix: &str,
    ) -> usize {
        let body = serde_json::json!({
            "key": kungfu::etcd::b64(prefix),
            "range_end": kungfu::etcd::b64(kungfu::etcd::prefix_end(prefix)),
            "count_only": true,
        });
        let v = self.etcd_call(host, addr, tls, "/v3/kv/range", &body, token);
        assert!(v.get("header").is_some(), "{v}");
        // etcd's JSON leaves out a count of 0, and gives int64 as strings
        match v.get("count") {
            None => 0,
            Some(c) => kungfu::etcd::num(c).unwrap_or_else(|e| panic!("{e}: {v}")) as usize,
        }
    }

    /// The pids of processes named `comm` on host `host`.
    fn pids_of(&self, host: usize, comm: &str) -> Vec<i32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.ns(host)])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &mut self.sshd {
            let _ = c.kill();
            let _ = c.wait();
        }
        // kills what is left in the namespaces, then removes them
        let _ = Command::new(SCRIPT).args(["down", &self.prefix]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = self.n;
    }
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Reads `child`'s stdout on a thread, line by line, into a channel.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
