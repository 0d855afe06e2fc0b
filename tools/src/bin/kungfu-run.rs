//! `kungfu-run`: start a KungFu-rs job.
//!
//! ```text
//! kungfu-run -np N [-H host:slots,...] [--strategy S] [--transport T]
//!            [--quic-ca F --quic-cert F --quic-key F]
//!            [--timeout DUR] [-w [--max-np N]] [--on-failure stop|shrink|replace] [-x NAME=VALUE]... [--] PROGRAM ARGS...
//! ```

use std::time::Duration;

use anyhow::{bail, Context};
use kungfu_tools::certs::QuicFiles;
use kungfu_tools::launch::{run, Bind, LaunchOptions, OnFailure};
use kungfu_tools::remote::{read_secret, CONTROL_STDIN, SECRET_STDIN};
use kungfu_tools::{parse_duration, parse_hosts, HostSlots};
use kungfu_transport::any::TransportKind;
use kungfu_transport::auth::JobSecret;

/// The help text; `{strategies}` stands for the strategy names.
const USAGE: &str = "\
usage: kungfu-run -np N [options] [--] PROGRAM [ARGS...]

Starts N workers of PROGRAM and gives each its identity in the environment
(KUNGFU_RANK, KUNGFU_SIZE, KUNGFU_LOCAL_RANK, KUNGFU_LOCAL_SIZE, KUNGFU_PEERS,
KUNGFU_STRATEGY, KUNGFU_TRANSPORT, KUNGFU_CLUSTER_VERSION, KUNGFU_CLUSTER_ID)
and the job secret every connection proves (KUNGFU_JOB_SECRET: this process's
if set, so that launchers started apart on each host share one, else 32
random bytes; set it in the environment, never with -x, which shows it on
the command line).
When every host is this machine, each worker also inherits its listening
socket, already bound at a port the kernel chose (KUNGFU_LISTEN_FD).
Each output line is prefixed with the worker's rank ([3]), and its host when
the job has more than one ([3@node2]). The hosts of -H that are this machine
(loopback, an address of its interfaces, or its name) start here; the others
start through ssh, or by a kungfu-run started on each host (--self). If a worker fails, the
others are stopped and kungfu-run exits non-zero, naming it (unless
--on-failure says otherwise).

options:
  -np N                 number of workers (required)
  -H host:slots,...     hosts and their slots (default: 127.0.0.1:N); ranks fill
                        hosts in order; workers on other machines start via ssh
  --strategy S          {strategies} (default AUTO)
  --transport T         auto (default: shared memory inside each host; across
                        hosts RDMA if every worker has it, else tcp), tcp,
                        shm (every worker on one host), quic (mutual TLS:
                        each worker issues its certificate from the job
                        secret, on any host), fabric (libfabric; choose the provider with
                        -x KUNGFU_FABRIC_PROVIDER=P, e.g. verbs;ofi_rxm, efa,
                        tcp;ofi_rxm, shm) or verbs (ibverbs, in a build with
                        the feature verbs; -x KUNGFU_VERBS_DEVICE=D)
  --quic-ca F --quic-cert F --quic-key F
                        your own PEM files for quic instead (every worker
                        uses them, and still proves the job secret)
  --timeout DUR         stop the job after DUR (e.g. 90s, 5m); exit status 124
  --grace DUR           after a worker fails, how long the others may take to
                        exit by themselves before SIGTERM (default 2s)
  --port-base P         first port on each host of a multi-machine job (38000)
  --ssh CMD             how to reach the other hosts (default ssh; split at
                        spaces, e.g. 'ssh -i KEY -p 2222'); kungfu-run runs
                        itself there (the same path) with --self HOST
  --self HOST           per-node mode: start only HOST's workers of the -H
                        list (run the same command on every host, each with
                        its own --self, one --cluster-id and one
                        KUNGFU_JOB_SECRET in the environment)
  --cluster-id ID       the job's id (hex), the same on every host; made up
                        when not given
  --rdzv HOST:PORT      per-node mode without a host list (torchrun's
                        --rdzv-endpoint): every node runs the same command;
                        the one on HOST serves the rendezvous, all join it
                        with their --slots, and once N slots joined each
                        starts its workers (KUNGFU_JOB_SECRET, the same on
                        every node, proves the joins)
  --slots S             this node's workers with --rdzv (1)
  --rdzv-timeout DUR    how long to wait for the nodes (5m)
  --bind-to B           auto (default: pin each worker to one CPU when a host has
                        at least as many CPUs as workers), core (always pin,
                        wrapping around), or none
  -w, --watch           elastic job: serve the cluster config over HTTP (its URL
                        in KUNGFU_CONFIG_SERVER; GET it, PUT 'size N' or a whole
                        config) and start the workers each new version adds;
                        removed workers are told by the library and exit.
                        The server listens on 127.0.0.1 (across hosts on
                        this host's address of -H, and the launchers started
                        on the others follow it); every request must be
                        signed with the job secret, each once (see
                        --resize)
  --config-store URL    with -w or --on-failure: keep the cluster config and
                        the workers' membership in etcd instead
                        (etcd://HOST:PORT[,HOST:PORT...][/PREFIX], the
                        etcd cluster's members; prefix /kungfu: the job's
                        keys go under PREFIX/<cluster id>; etcds:// for TLS,
                        with KUNGFU_ETCD_CA, and KUNGFU_ETCD_CERT/_KEY,
                        KUNGFU_ETCD_USER/_PASSWORD_FILE as etcd wants them:
                        see docs/hosts.md); workers take new
                        ports from --port-base. -w and --on-failure in
                        per-node mode (--self, --rdzv) need it: every node's
                        launcher then follows the job there
  --on-failure F        what a worker's failure does: stop (default: stop the
                        others, exit with its status), shrink (the others go
                        on; they agree on who is left and shrink the cluster,
                        with the library's recover step: kf_recover,
                        Worker::recover) or replace (shrink, then start a new
                        worker that joins as in -w); shrink and replace serve
                        the config server as -w does (across hosts too, from
                        the host that starts the job; not with --self)
  --max-np N            the largest size a watched job may grow to (64)
  --detach-timeout DUR  how long a worker a new version leaves out may run on
                        before it is stopped (60s; it exits by itself at its
                        next resize, when the library tells it is detached)
  -x NAME=VALUE         set an environment variable for every worker
  -h, --help            this text

kungfu-run --resize N --config-server URL
                        resize a running elastic job to N workers: sends
                        'size N' to its config server (the URL its workers
                        have in KUNGFU_CONFIG_SERVER: http://, https://
                        across hosts, or etcd://),
                        signed with the KUNGFU_JOB_SECRET of this
                        environment, and prints the new config
";

/// The help text, listing every strategy the library accepts (taken from
/// the topology crate, so that a new one cannot be left out).
fn usage() -> String {
    const INDENT: usize = 24;
    const WIDTH: usize = 80;
    let names: Vec<&str> = kungfu_topology::Strategy::ALL
        .iter()
        .map(|s| s.name())
        .collect();
    let mut list = String::new();
    let mut col = INDENT;
    for (i, name) in names.iter().enumerate() {
        let word = match names.len() - i {
            1 => name.to_string(),
            2 => format!("{name} or"),
            _ => format!("{name},"),
        };
        if i > 0 {
            if col + 1 + word.len() > WIDTH {
                list.push('\n');
                list.push_str(&" ".repeat(INDENT));
                col = INDENT;
            } else {
                list.push(' ');
                col += 1;
            }
        }
        list.push_str(&word);
        col += word.len();
    }
    USAGE.replace("{strategies}", &list)
}

/// `--rdzv`: the rendezvous to join, this node's slots, and how long to
/// wait for the others.
struct Rdzv {
    endpoint: String,
    slots: usize,
    timeout: Duration,
}

fn parse_args(args: &[String]) -> anyhow::Result<Option<(LaunchOptions, Option<Rdzv>)>> {
    let mut np: Option<usize> = None;
    let mut hosts: Option<Vec<HostSlots>> = None;
    let mut o = LaunchOptions {
        np: 0,
        hosts: Vec::new(),
        strategy: None,
        transport: TransportKind::Auto,
        quic: None,
        timeout: None,
        port_base: 38000,
        self_host: None,
        cluster_id: None,
        secret: None,
        grace: Duration::from_secs(2),
        env: Vec::new(),
        bind: Bind::Auto,
        watch: false,
        max_np: 0,
        detach_timeout: Duration::from_secs(60),
        on_failure: OnFailure::Stop,
        ssh: vec!["ssh".into()],
        controlled: false,
        config_server: None,
        config_store: None,
        program: Vec::new(),
    };
    let mut max_np = None;
    let mut rdzv: Option<String> = None;
    let mut slots: Option<usize> = None;
    let mut rdzv_timeout = Duration::from_secs(300);
    let mut quic: [Option<String>; 3] = [None, None, None];
    let mut i = 0;
    let value = |i: &mut usize, flag: &str| -> anyhow::Result<String> {
        *i += 1;
        args.get(*i)
            .cloned()
            .with_context(|| format!("{flag} needs a value"))
    };
    while i < args.len() {
        let a = args[i].as_str();
        match a {
            "-h" | "--help" => return Ok(None),
            "--config-token" => bail!(
                "--config-token is gone: a fixed token could be replayed, so every request \
                 to the config server is now signed, each once; resize a job with \
                 `kungfu-run --resize N --config-server URL`"
            ),
            // after --self: the launcher that ran us through ssh writes it
            SECRET_STDIN => o.secret = Some(read_secret(&mut std::io::stdin().lock())?),
            CONTROL_STDIN => o.controlled = true,
            "--config-server" => o.config_server = Some(value(&mut i, a)?),
            "--config-store" => {
                let url = value(&mut i, a)?;
                kungfu_tools::config_store::check_url(&url)?;
                o.config_store = Some(url);
            }
            "--rdzv" => rdzv = Some(value(&mut i, a)?),
            "--slots" => {
                slots = Some(
                    value(&mut i, a)?
                        .parse()
                        .ok()
                        .filter(|&n| n > 0)
                        .context("--slots needs a number of at least 1")?,
                )
            }
            "--rdzv-timeout" => rdzv_timeout = parse_duration(&value(&mut i, a)?)?,
            "--ssh" => {
                o.ssh = value(&mut i, a)?
                    .split_whitespace()
                    .map(str::to_string)
                    .collect();
                if o.ssh.is_empty() {
                    bail!("--ssh needs a command");
                }
            }
            "-np" | "-n" | "--np" => {
                np = Some(value(&mut i, a)?.parse().context("-np needs a number")?)
            }
            "-H" | "--hosts" => hosts = Some(parse_hosts(&value(&mut i, a)?)?),
            "--strategy" => {
                let s = value(&mut i, a)?;
                s.parse::<kungfu_topology::Strategy>()?;
                o.strategy = Some(s);
            }
            "--transport" => {
                o.transport = value(&mut i, a)?.parse().map_err(anyhow::Error::msg)?;
                if !o.transport.built() {
                    bail!(
                        "transport {} is not available (this build has: {})",
                        o.transport,
                        TransportKind::available()
                    );
                }
            }
            "--quic-ca" => quic[0] = Some(value(&mut i, a)?),
            "--quic-cert" => quic[1] = Some(value(&mut i, a)?),
            "--quic-key" => quic[2] = Some(value(&mut i, a)?),
            "--timeout" => o.timeout = Some(parse_duration(&value(&mut i, a)?)?),
            "--grace" => o.grace = parse_duration(&value(&mut i, a)?)?,
            "--port-base" => {
                o.port_base = value(&mut i, a)?
                    .parse()
                    .context("--port-base needs a port")?
            }
            "--bind-to" => o.bind = value(&mut i, a)?.parse()?,
            "-w" | "--watch" => o.watch = true,
            "--on-failure" => o.on_failure = value(&mut i, a)?.parse()?,
            "--detach-timeout" => o.detach_timeout = parse_duration(&value(&mut i, a)?)?,
            "--max-np" => {
                max_np = Some(
                    value(&mut i, a)?
                        .parse()
                        .context("--max-np needs a number")?,
                )
            }
            "--self" => o.self_host = Some(value(&mut i, a)?),
            "--cluster-id" => {
                o.cluster_id = Some(
                    u64::from_str_radix(&value(&mut i, a)?, 16).context("--cluster-id is hex")?,
                )
            }
            "-x" => {
                let kv = value(&mut i, a)?;
                let (k, v) = kv
                    .split_once('=')
                    .with_context(|| format!("-x {kv:?}: expected NAME=VALUE"))?;
                o.env.push((k.to_string(), v.to_string()));
            }
            "--" => {
                o.program = args[i + 1..].to_vec();
                break;
            }
            _ if a.starts_with('-') => bail!("unknown option {a:?}"),
            _ => {
                o.program = args[i..].to_vec();
                break;
            }
        }
        i += 1;
    }
    o.np = np.context("-np is required")?;
    o.quic = match quic {
        [None, None, None] => None,
        [Some(ca), Some(cert), Some(key)] => Some(QuicFiles {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
        }),
        _ => bail!("--quic-ca, --quic-cert and --quic-key go together"),
    };
    o.max_np = max_np.unwrap_or(64).max(o.np);
    let rdzv = match rdzv {
        None => None,
        Some(endpoint) => {
            if hosts.is_some() || o.self_host.is_some() {
                bail!("--rdzv finds the hosts itself: not with -H or --self");
            }
            if !std::env::var(kungfu::env::SECRET_VAR).is_ok_and(|s| !s.is_empty()) {
                bail!(
                    "--rdzv needs the job secret in {}, the same on every node",
                    kungfu::env::SECRET_VAR
                );
            }
            if !endpoint.contains(':') {
                bail!("--rdzv HOST:PORT, not {endpoint:?}");
            }
            Some(Rdzv {
                endpoint,
                slots: slots.unwrap_or(1),
                timeout: rdzv_timeout,
            })
        }
    };
    let elastic = o.watch || o.on_failure != OnFailure::Stop;
    if o.config_store.is_some() && !elastic {
        bail!(
            "--config-store holds an elastic job's config: give -w or --on-failure shrink|replace"
        );
    }
    if elastic
        && (o.self_host.is_some() || rdzv.is_some())
        && !o.controlled
        && o.config_store.is_none()
    {
        bail!(
            "-w or --on-failure in per-node mode (--self, --rdzv) needs --config-store \
             etcd://HOST:PORT: no launcher serves the config there"
        );
    }
    if rdzv.is_none() && slots.is_some() {
        bail!("--slots goes with --rdzv (with -H, give host:slots)");
    }
    o.hosts = hosts.unwrap_or_else(|| {
        vec![HostSlots {
            host: "127.0.0.1".into(),
            slots: o.np,
        }]
    });
    if o.program.is_empty() {
        bail!("no program given");
    }
    if let Some(me) = &o.self_host {
        // Launchers started apart must agree on both, or their workers
        // refuse each other's handshakes: say so now, not after a wait.
        if !o.hosts.iter().any(|h| &h.host == me) {
            bail!("--self {me}: not a host of -H");
        }
        if o.cluster_id.is_none() {
            bail!(
                "--self (per-node mode) needs --cluster-id ID (hex), the same on every host, \
                 so that the workers the launchers start form one job"
            );
        }
        let from_env = std::env::var(kungfu::env::SECRET_VAR).is_ok_and(|s| !s.is_empty());
        if o.secret.is_none() && !from_env {
            bail!(
                "--self (per-node mode) needs the job secret in {}, the same on every host",
                kungfu::env::SECRET_VAR
            );
        }
    }
    Ok(Some((o, rdzv)))
}

/// Joins the rendezvous (serving it if its host is this machine), then
/// runs the job as in per-node mode with the hosts it gave.
async fn run_rdzv(mut opts: LaunchOptions, r: Rdzv) -> anyhow::Result<i32> {
    use kungfu_tools::rdzv;
    let deadline = tokio::time::Instant::now() + r.timeout;
    let secret = JobSecret::new(kungfu_tools::launch::job_secret(None)?.as_bytes())?;
    let (host, _) = r.endpoint.rsplit_once(':').context("--rdzv HOST:PORT")?;
    let server = if kungfu_tools::is_local_host(host.trim_matches(['[', ']'])) {
        let l = tokio::net::TcpListener::bind(&r.endpoint)
            .await
            .with_context(|| format!("serving the rendezvous at {}", r.endpoint))?;
        let id = kungfu_tools::launch::job_id();
        Some(tokio::spawn(rdzv::serve(
            l,
            opts.np,
            secret.clone(),
            id,
            deadline,
        )))
    } else {
        None
    };
    // the serving node waits a little longer, to hear why its server ended
    let mine = deadline + Duration::from_secs(if server.is_some() { 2 } else { 0 });
    let joined = rdzv::join(&r.endpoint, r.slots, &secret, mine).await?;
    if let Some(s) = server {
        // every node has its answer once ours came: the server is done
        s.await.context("the rendezvous server")??;
    }
    eprintln!(
        "kungfu-run: rendezvous at {}: hosts {}, this one {}",
        r.endpoint,
        joined
            .hosts
            .iter()
            .map(|h| format!("{}:{}", h.host, h.slots))
            .collect::<Vec<_>>()
            .join(","),
        joined.me
    );
    opts.hosts = joined.hosts;
    opts.self_host = Some(joined.me);
    opts.cluster_id = Some(joined.cluster_id);
    run(opts).await
}

/// `kungfu-run --resize N --config-server URL`: the new config, or why
/// not.
async fn resize(args: &[String]) -> anyhow::Result<String> {
    let (mut n, mut url) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--resize" => {
                let v = it.next().context("--resize needs a number of workers")?;
                n = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|&n| n > 0)
                        .with_context(|| format!("--resize {v:?}: a number of at least 1"))?,
                );
            }
            "--config-server" => {
                url = Some(it.next().context("--config-server needs a URL")?.clone())
            }
            other => bail!("--resize takes only --config-server URL, not {other:?}"),
        }
    }
    let n = n.context("--resize needs a number of workers")?;
    let url = url.context("--resize needs --config-server URL (the job's KUNGFU_CONFIG_SERVER)")?;
    let secret = std::env::var(kungfu::env::SECRET_VAR)
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| JobSecret::new(s.as_bytes()))
        .transpose()?;
    if secret.is_none() && (url.starts_with("http://") || url.starts_with("https://")) {
        bail!("--resize: KUNGFU_JOB_SECRET is not set (the job's secret signs the request)");
    }
    let store =
        kungfu::store::ConfigStore::open(&url, secret.as_ref()).map_err(anyhow::Error::msg)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let c = store
        .put(&format!("size {n}"), deadline)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(c.encode())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--resize") {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        match rt.block_on(resize(&args)) {
            Ok(config) => print!("{config}"),
            Err(e) => {
                eprintln!("kungfu-run: {e:#}");
                std::process::exit(1);
            }
        }
        return;
    }
    let (opts, rdzv) = match parse_args(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{}", usage());
            return;
        }
        Err(e) => {
            eprintln!("kungfu-run: {e:#}\n\n{}", usage());
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let job = async {
        match rdzv {
            Some(r) => run_rdzv(opts, r).await,
            None => run(opts).await,
        }
    };
    match rt.block_on(job) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("kungfu-run: {e:#}");
            std::process::exit(1);
        }
    }
}
