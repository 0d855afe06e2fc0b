//! Starting the workers of another machine: `kungfu-run` runs itself there
//! through `ssh`, with `--self HOST` so that it starts only that host's
//! workers.
//!
//! Everything but the job secret goes on the remote command line. The
//! secret does not: a command line is visible to every user of both
//! machines (`ps`), and ssh forwards environment variables only where the
//! server's `AcceptEnv` allows. It goes through ssh's standard input
//! instead, one line that the remote launcher reads (`--secret-stdin`)
//! before it starts anything. The rest of ssh's standard input is the
//! control channel (`--control-stdin`): the starting launcher writes there
//! the signals it forwards (its own SIGINT, SIGTERM or SIGHUP, a stop
//! after a failure elsewhere), which a signal to the ssh client could not
//! carry, and its end (the starting launcher died, or the connection did)
//! stops the workers of that host, so that none is left behind.
//!
//! How to reach an etcd config store (`KUNGFU_ETCD_CA` and the rest of
//! `kungfu::etcd::access`: file paths and a user name, no password) goes
//! on the command line as `env VAR=...`: the files must be at the same
//! paths on every host, as `kungfu-run` and the program must.

use std::path::Path;

use anyhow::Context;
use tokio::process::Command;

use crate::launch::{Bind, LaunchOptions, OnFailure};

/// The flag that makes `kungfu-run` read the job secret from its standard
/// input (one line).
pub const SECRET_STDIN: &str = "--secret-stdin";

/// The flag that makes `kungfu-run` take the rest of its standard input as
/// the control channel of the launcher that started it: the names of the
/// signals to forward to its workers, one per line, and at its end (that
/// launcher, or the connection to it, is gone) it stops its workers.
pub const CONTROL_STDIN: &str = "--control-stdin";

/// The command that runs `line` on `host` through `ssh` (`--ssh`: the
/// command and its own arguments).
pub fn ssh_command(ssh: &[String], host: &str, line: &str) -> anyhow::Result<Command> {
    let (ssh, ssh_args) = ssh.split_first().context("--ssh: no command")?;
    let mut cmd = Command::new(ssh);
    // keepalives: a connection that dies silently ends the ssh, and so
    // the remote launcher's control channel
    cmd.args(ssh_args).args([
        "-o",
        "BatchMode=yes",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
        host,
        line,
    ]);
    Ok(cmd)
}

/// The command line of the launcher on `host`, `exe` the path of
/// `kungfu-run` (the same on every host), as one shell-quoted string for
/// `ssh`.
/// In an elastic job (`-w`, `--on-failure shrink|replace`) the launcher
/// there follows the config store at `url`.
pub fn remote_command(
    opts: &LaunchOptions,
    host: &str,
    cluster_id: u64,
    exe: &Path,
    url: Option<&str>,
) -> String {
    let hosts: Vec<String> = opts
        .hosts
        .iter()
        .map(|h| format!("{}:{}", h.host, h.slots))
        .collect();
    let mut remote = etcd_access_env(url, |k| std::env::var(k).ok());
    remote.extend([
        exe.display().to_string(),
        "--self".into(),
        host.into(),
        SECRET_STDIN.into(),
        CONTROL_STDIN.into(),
        "--cluster-id".into(),
        format!("{cluster_id:x}"),
        "-np".into(),
        opts.np.to_string(),
        "-H".into(),
        hosts.join(","),
        "--port-base".into(),
        opts.port_base.to_string(),
        "--grace".into(),
        format!("{}ms", opts.grace.as_millis()),
        "--transport".into(),
        opts.transport.name().into(),
    ]);
    if let Some(f) = &opts.quic {
        for (flag, path) in [
            ("--quic-ca", &f.ca),
            ("--quic-cert", &f.cert),
            ("--quic-key", &f.key),
        ] {
            remote.extend([flag.into(), path.display().to_string()]);
        }
    }
    if let Some(st) = &opts.strategy {
        remote.extend(["--strategy".into(), st.clone()]);
    }
    let bind = match opts.bind {
        Bind::Auto => "auto",
        Bind::Core => "core",
        Bind::None => "none",
    };
    remote.extend(["--bind-to".into(), bind.into()]);
    if let Some(url) = url {
        remote.extend([
            "--config-server".into(),
            url.into(),
            "--max-np".into(),
            opts.max_np.to_string(),
            "--detach-timeout".into(),
            format!("{}ms", opts.detach_timeout.as_millis()),
        ]);
        if opts.watch {
            remote.push("-w".into());
        }
        let on_failure = match opts.on_failure {
            OnFailure::Stop => None,
            OnFailure::Shrink => Some("shrink"),
            OnFailure::Replace => Some("replace"),
        };
        if let Some(f) = on_failure {
            remote.extend(["--on-failure".into(), f.into()]);
        }
    }
    for (k, v) in &opts.env {
        remote.extend(["-x".into(), format!("{k}={v}")]);
    }
    remote.push("--".into());
    remote.extend(opts.program.iter().cloned());
    let line: Vec<String> = remote.iter().map(|a| shell_quote(a)).collect();
    line.join(" ")
}

/// `env VAR=...` for the variables of the etcd access
/// (`kungfu::etcd::access`: paths and a user name, never a password) that
/// `var` gives, where the job's store is etcd; nothing otherwise. env(1)
/// runs under any login shell, where `VAR=... cmd` needs a POSIX one.
fn etcd_access_env(url: Option<&str>, var: impl Fn(&str) -> Option<String>) -> Vec<String> {
    if !url.is_some_and(|u| u.starts_with("etcd://") || u.starts_with("etcds://")) {
        return Vec::new();
    }
    // the files made absolute: the remote shell starts in the home
    // directory, not in this one
    let set: Vec<String> = kungfu::etcd::access::ACCESS_VARS
        .iter()
        .filter_map(|&k| {
            let v = var(k)?;
            let v = match k == kungfu::etcd::access::ENV_USER {
                true => v,
                false => std::path::absolute(&v).map_or(v, |p| p.display().to_string()),
            };
            Some(format!("{k}={v}"))
        })
        .collect();
    match set.is_empty() {
        true => set,
        false => std::iter::once("env".to_string()).chain(set).collect(),
    }
}

/// `s` quoted for a POSIX shell (as is when it is plain).
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=,@+".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Reads the job secret that `--secret-stdin` says comes on standard
/// input: its first line, without the line end.
pub fn read_secret(input: &mut impl std::io::BufRead) -> anyhow::Result<String> {
    let mut line = String::new();
    input.read_line(&mut line)?;
    let secret = line.trim_end_matches(['\n', '\r']).to_string();
    anyhow::ensure!(
        !secret.is_empty(),
        "{SECRET_STDIN}: no job secret on standard input"
    );
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostSlots;
    use kungfu_transport::any::TransportKind;
    use std::time::Duration;

    #[test]
    fn the_etcd_access_goes_through_env_for_an_etcd_store_only() {
        let var = |k: &str| match k {
            "KUNGFU_ETCD_CA" => Some("/etc/kf/ca.pem".to_string()),
            "KUNGFU_ETCD_KEY" => Some("rel/key.pem".to_string()),
            "KUNGFU_ETCD_USER" => Some("kf".to_string()),
            "KUNGFU_ETCD_PASSWORD_FILE" => Some("/etc/kf/pw".to_string()),
            _ => None,
        };
        // a relative path is made absolute (the remote shell starts at home)
        let key = std::env::current_dir().unwrap().join("rel/key.pem");
        assert_eq!(
            etcd_access_env(Some("etcds://e:2379/kungfu/1"), var),
            [
                "env".to_string(),
                "KUNGFU_ETCD_CA=/etc/kf/ca.pem".into(),
                format!("KUNGFU_ETCD_KEY={}", key.display()),
                "KUNGFU_ETCD_USER=kf".into(),
                "KUNGFU_ETCD_PASSWORD_FILE=/etc/kf/pw".into(),
            ]
        );
        assert!(etcd_access_env(Some("http://h:1/cluster"), var).is_empty());
        assert!(etcd_access_env(None, var).is_empty());
        assert!(etcd_access_env(Some("etcd://e:1/p"), |_| None).is_empty());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc-1.2/x"), "abc-1.2/x");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    /// The remote command line asks for the secret on standard input and
    /// never holds it, even when the user passed it with `-x`... which
    /// the help text warns against, so it is only the launcher's own.
    #[test]
    fn the_secret_is_not_on_the_command_line() {
        let opts = LaunchOptions {
            np: 4,
            hosts: vec![
                HostSlots {
                    host: "a".into(),
                    slots: 2,
                },
                HostSlots {
                    host: "b".into(),
                    slots: 2,
                },
            ],
            strategy: None,
            transport: TransportKind::Tcp,
            quic: None,
            timeout: None,
            port_base: 38000,
            self_host: None,
            cluster_id: None,
            secret: Some("0123456789abcdef".into()),
            grace: Duration::from_secs(2),
            env: vec![("X".into(), "1 2".into())],
            bind: Bind::Auto,
            watch: false,
            on_failure: crate::launch::OnFailure::Stop,
            max_np: 4,
            detach_timeout: Duration::from_secs(60),
            ssh: vec!["ssh".into()],
            controlled: false,
            config_server: None,
            config_store: None,
            program: vec!["prog".into(), "arg".into()],
        };
        let line = remote_command(&opts, "b", 0xabc, Path::new("/bin/kungfu-run"), None);
        assert_eq!(
            line,
            "/bin/kungfu-run --self b --secret-stdin --control-stdin --cluster-id abc -np 4 -H a:2,b:2 \
             --port-base 38000 --grace 2000ms --transport tcp --bind-to auto -x 'X=1 2' -- prog arg"
        );
        assert!(!line.contains("0123456789abcdef"));
        let mut input = std::io::Cursor::new(b"0123456789abcdef\nrest".to_vec());
        assert_eq!(read_secret(&mut input).unwrap(), "0123456789abcdef");
        assert!(read_secret(&mut std::io::Cursor::new(b"\n".to_vec())).is_err());
    }
}
