//! A real etcd (Debian's etcd-server) for the tests of `kungfu-run
//! --config-store` (included with `#[path]`): one member, its data in a
//! scratch directory, stopped and removed when dropped.
//!
//! Where `etcd` is not installed the tests say so and pass, unless
//! `KUNGFU_REQUIRE_ETCD=1` (which `scripts/test.sh` sets once it installed
//! it) makes that a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `etcd` runs here; if not, says so (or fails, as above).
pub fn etcd_present(test: &str) -> bool {
    let ok = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("KUNGFU_REQUIRE_ETCD").as_deref() != Ok("1"),
            "{test}: KUNGFU_REQUIRE_ETCD=1 but etcd is not installed (apt-get install etcd-server)"
        );
        eprintln!("{test}: skipped: no etcd (apt-get install etcd-server)");
    }
    ok
}

/// A running etcd.
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    /// Its client address, `HOST:PORT`.
    pub addr: String,
}

impl EtcdServer {
    /// Starts `etcd` through `cmd` (the program, possibly behind `ip netns
    /// exec`) with clients on `host:client` and its peer port on
    /// `host:peer`, data under `dir`, and waits until it serves.
    pub fn start(mut cmd: Command, host: &str, client: u16, peer: u16, dir: PathBuf) -> EtcdServer {
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("etcd.log");
        let client_url = format!("http://{host}:{client}");
        let peer_url = format!("http://{host}:{peer}");
        let child = cmd
            .args(["--name", "kf", "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("kf={peer_url}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting etcd");
        let mut e = EtcdServer {
            child,
            dir,
            log,
            addr: format!("{host}:{client}"),
        };
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&e.log).unwrap_or_default();
            if text.contains("ready to serve client requests") {
                return e;
            }
            if let Ok(Some(st)) = e.child.try_wait() {
                panic!("etcd exited ({st}):\n{text}");
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "etcd is not ready after 30 s:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills it now (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What it logged.
    #[allow(dead_code)]
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
