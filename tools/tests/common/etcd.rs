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
    pub fn start(cmd: Command, host: &str, client: u16, peer: u16, dir: PathBuf) -> EtcdServer {
        EtcdServer::start_scheme(cmd, "http", host, client, peer, dir)
    }

    /// [`EtcdServer::start`] with clients on `scheme` (`https` where `cmd`
    /// has the TLS flags).
    pub fn start_scheme(
        cmd: Command,
        scheme: &str,
        host: &str,
        client: u16,
        peer: u16,
        dir: PathBuf,
    ) -> EtcdServer {
        let peer_url = format!("http://{host}:{peer}");
        let mut e = EtcdServer::spawn(
            cmd,
            "kf",
            scheme,
            host,
            client,
            peer,
            &format!("kf={peer_url}"),
            dir,
        );
        e.wait_ready();
        e
    }

    /// A cluster of `ports.len()` members on the loopback (client and peer
    /// port each), data under `dir`, once every member serves.
    #[allow(dead_code)]
    pub fn start_cluster(ports: &[(u16, u16)], dir: PathBuf) -> Vec<EtcdServer> {
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("kf{i}=http://127.0.0.1:{peer}"))
            .collect();
        let initial = initial.join(",");
        let mut members: Vec<EtcdServer> = ports
            .iter()
            .enumerate()
            .map(|(i, &(client, peer))| {
                let name = format!("kf{i}");
                let d = dir.join(&name);
                let mut cmd = Command::new("etcd");
                // slower than the defaults (100 ms, 1 s), so that two
                // loaded cores elect no leader but when one died
                cmd.args(["--heartbeat-interval", "200", "--election-timeout", "2000"]);
                EtcdServer::spawn(cmd, &name, "http", "127.0.0.1", client, peer, &initial, d)
            })
            .collect();
        for m in &mut members {
            m.wait_ready();
        }
        members
    }

    #[allow(clippy::too_many_arguments)]
    fn spawn(
        mut cmd: Command,
        name: &str,
        scheme: &str,
        host: &str,
        client: u16,
        peer: u16,
        initial: &str,
        dir: PathBuf,
    ) -> EtcdServer {
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("etcd.log");
        let client_url = format!("{scheme}://{host}:{client}");
        let peer_url = format!("http://{host}:{peer}");
        let child = cmd
            .args(["--name", name, "--data-dir"])
            .arg(dir.join("data"))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", initial])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("starting etcd");
        EtcdServer {
            child,
            dir,
            log,
            addr: format!("{host}:{client}"),
        }
    }

    /// Waits until it serves clients (30 s at most).
    fn wait_ready(&mut self) {
        let t = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if text.contains("ready to serve client requests") {
                return;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
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

/// PEM files of a CA, a certificate it signed for an etcd at `ip`, and a
/// client certificate.
#[allow(dead_code)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub server: PathBuf,
    pub server_key: PathBuf,
    pub client: PathBuf,
    pub client_key: PathBuf,
}

#[allow(dead_code)]
impl TlsFiles {
    /// Makes them in `dir`.
    pub fn make(dir: &std::path::Path, ip: &str) -> TlsFiles {
        use rcgen::{
            BasicConstraints, CertificateParams, DistinguishedName, ExtendedKeyUsagePurpose as Eku,
            IsCa, Issuer, KeyPair,
        };
        std::fs::create_dir_all(dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = Issuer::new(ca, ca_key);
        let leaf = |san: &str, eku: Vec<Eku>| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(vec![san.to_string()]).unwrap();
            p.extended_key_usages = eku;
            // etcd's gateway refuses a client certificate with a
            // CommonName once auth is on (it would not use it as the user)
            p.distinguished_name = DistinguishedName::new();
            (
                p.signed_by(&key, &issuer).unwrap().pem(),
                key.serialize_pem(),
            )
        };
        // the gateway reaches etcd's own gRPC server with the server's
        // certificate, which must then be good for a client too
        let (server, server_key) = leaf(ip, vec![Eku::ServerAuth, Eku::ClientAuth]);
        let (client, client_key) = leaf("kungfu-test", vec![Eku::ClientAuth]);
        let f = |n: &str| dir.join(n);
        let files = TlsFiles {
            ca: f("ca.pem"),
            server: f("server.pem"),
            server_key: f("server.key"),
            client: f("client.pem"),
            client_key: f("client.key"),
        };
        for (p, text) in [
            (&files.ca, ca_pem),
            (&files.server, server),
            (&files.server_key, server_key),
            (&files.client, client),
            (&files.client_key, client_key),
        ] {
            std::fs::write(p, text).unwrap();
        }
        files
    }

    /// etcd's flags for TLS with these, client certificates required.
    pub fn server_args(&self, cmd: &mut Command) {
        cmd.arg("--cert-file")
            .arg(&self.server)
            .arg("--key-file")
            .arg(&self.server_key)
            .arg("--trusted-ca-file")
            .arg(&self.ca)
            .arg("--client-cert-auth");
    }

    /// The `KUNGFU_ETCD_*` variables of a client with these.
    pub fn client_env(&self) -> [(&'static str, &std::path::Path); 3] {
        [
            ("KUNGFU_ETCD_CA", &self.ca),
            ("KUNGFU_ETCD_CERT", &self.client),
            ("KUNGFU_ETCD_KEY", &self.client_key),
        ]
    }
}

/// The gateway calls that turn etcd's users on: `root` (password
/// `root-password`) to administer, and `user` with `password`, allowed
/// to read and write every key under `prefix` only.
#[allow(dead_code)]
pub fn auth_setup(
    prefix: &str,
    user: &str,
    password: &str,
) -> Vec<(&'static str, serde_json::Value)> {
    use kungfu::etcd::{b64, prefix_end};
    use serde_json::json;
    let perm =
        json!({"permType": "READWRITE", "key": b64(prefix), "range_end": b64(prefix_end(prefix))});
    vec![
        ("/v3/auth/role/add", json!({"name": "root"})),
        (
            "/v3/auth/user/add",
            json!({"name": "root", "password": "root-password"}),
        ),
        (
            "/v3/auth/user/grant",
            json!({"user": "root", "role": "root"}),
        ),
        ("/v3/auth/role/add", json!({"name": user})),
        ("/v3/auth/role/grant", json!({"name": user, "perm": perm})),
        (
            "/v3/auth/user/add",
            json!({"name": user, "password": password}),
        ),
        ("/v3/auth/user/grant", json!({"user": user, "role": user})),
        ("/v3/auth/enable", json!({})),
    ]
}
